"""(Re)make tests/data/golden_quants/*.npz with llama.cpp's own quantizer, or check the committed ones.

    python tests/golden/make_golden_quants.py --llama-cpp SRC [--check | --write]

SRC is a llama.cpp source tree with a build in SRC/build (libggml-base); the goldens in the repo were made with
the one vendored in the llama-cpp-python 0.3.36 sdist (ggml 0.25.3). The inputs are committed data:
``inputs.npz`` (the float32 test matrices described in tests/ggml/test_quant_kernels.py), ``importance.npz`` and
``iquant_weights.npz`` (importance vectors, see tests/ggml/test_imatrix_kernels.py and
tests/ggml/test_iquant_kernels.py);
this script derives every output from them with qharness.c (``ggml_quantize_chunk``):

- ``<TYPE>.npz``          legacy and k-quants and IQ4_NL/IQ4_XS without importance: one key per case;
- ``<TYPE>_imatrix.npz``  the same types with the case's ``importance.npz`` vector;
- ``<IQ TYPE>.npz``       the 2/3/1-bit i-quants with the case's ``iquant_weights.npz`` vector, and under
                          ``<case>__noimatrix`` without one (types whose quantizer accepts that).

``--check`` (the default) compares with the committed files and exits 1 on a difference; ``--write`` rewrites them.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T

HERE = Path(__file__).parent
GOLDEN = HERE.parent / "data" / "golden_quants"
PLAIN = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS]
WITH_IMATRIX = [t for t in PLAIN if t is not T.Q8_0]
IQ = [T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M]
IQ_NEED_WEIGHTS = {T.IQ2_XXS, T.IQ2_XS, T.IQ1_S}  # ggml aborts on these without an imatrix


def build_harness(src: Path, out: Path) -> Path:
    exe = out / "qharness"
    lib = src / "build" / "bin"
    subprocess.run(
        [
            "gcc",
            "-O2",
            "-o",
            str(exe),
            str(HERE / "qharness.c"),
            "-I",
            str(src / "ggml" / "include"),
            "-L",
            str(lib),
            "-lggml-base",
            f"-Wl,-rpath,{lib}",
        ],
        check=True,
    )
    return exe


def quantize(exe: Path, tmp: Path, qtype: T, x: np.ndarray, w: np.ndarray | None) -> np.ndarray:
    rows, n = x.shape
    src, imx, dst = tmp / "x.f32", tmp / "w.f32", tmp / "out.bin"
    np.ascontiguousarray(x, dtype=np.float32).tofile(src)
    if w is not None:
        np.ascontiguousarray(w, dtype=np.float32).tofile(imx)
    subprocess.run(
        [str(exe), str(int(qtype)), str(rows), str(n), str(src), str(imx) if w is not None else "-", str(dst)],
        check=True,
    )
    return np.fromfile(dst, dtype=np.uint8).reshape(rows, -1)


def make_all(exe: Path, tmp: Path) -> dict[str, dict[str, np.ndarray]]:
    load = lambda name: dict(np.load(GOLDEN / name))  # noqa: E731
    inputs, importance, iq_weights = load("inputs.npz"), load("importance.npz"), load("iquant_weights.npz")
    out: dict[str, dict[str, np.ndarray]] = {}
    for t in PLAIN:
        out[f"{t.name}.npz"] = {c: quantize(exe, tmp, t, x, None) for c, x in inputs.items()}
    for t in WITH_IMATRIX:
        out[f"{t.name}_imatrix.npz"] = {c: quantize(exe, tmp, t, x, importance[c]) for c, x in inputs.items()}
    for t in IQ:
        d = {}
        for c, x in inputs.items():
            d[c] = quantize(exe, tmp, t, x, iq_weights[c])
            if t not in IQ_NEED_WEIGHTS:
                d[c + "__noimatrix"] = quantize(exe, tmp, t, x, None)
        out[f"{t.name}.npz"] = d
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree with build/bin")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", default=True)
    mode.add_argument("--write", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        made = make_all(build_harness(a.llama_cpp, tmp), tmp)
    bad = 0
    for name, arrays in made.items():
        if a.write:
            np.savez(GOLDEN / name, **arrays)
            continue
        with np.load(GOLDEN / name) as z:
            committed = {k: z[k] for k in z.files}
        if set(committed) != set(arrays):
            print(f"{name}: keys differ: {sorted(set(committed) ^ set(arrays))}")
            bad += 1
            continue
        for k, v in arrays.items():
            if not np.array_equal(v, committed[k]):
                print(f"{name}[{k}]: {int((v != committed[k]).sum())} bytes differ")
                bad += 1
    print(("wrote" if a.write else "checked") + f" {len(made)} files" + (f", {bad} differences" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
