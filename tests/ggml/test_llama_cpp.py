"""The kernels against llama.cpp itself (MTPQ_LLAMA_CPP_BIN / MTPQ_LLAMA_CPP_SRC): ggml_quantize_chunk through
tests/golden/qharness.c on fuzzed data, with and without importance, for every type; and llama-quantize --pure
on an F32 GGUF of the golden cases for every type it writes, the new 1-2-bit ones and MXFP4 included."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from mtpq.ggml.engine import quantize
from mtpq.ggml.registry import FLOAT_TYPES, TYPES
from tests.helpers.golden_quants import CASES

HARNESS_C = Path(__file__).parents[1] / "golden" / "qharness.c"
QUANT_TYPES = [t for t in TYPES if t not in FLOAT_TYPES]
# llama-quantize refuses these without an imatrix (tensor_requires_imatrix), beyond those whose kernels need one
NEEDS_IMATRIX = {T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ1_S, T.IQ1_M}
PRESET_OF = {T.MXFP4: "MXFP4_MOE", T.IQ2_S: "IQ2_M"}  # the presets whose base type these are

pytestmark = pytest.mark.llama_cpp


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Path:
    src, lib = os.environ.get("MTPQ_LLAMA_CPP_SRC"), os.environ.get("MTPQ_LLAMA_CPP_BIN")
    if not src or not lib or not shutil.which("gcc"):
        pytest.skip("needs gcc, MTPQ_LLAMA_CPP_SRC and MTPQ_LLAMA_CPP_BIN (with libggml-base)")
    exe = tmp_path_factory.mktemp("qh") / "qh"
    subprocess.run(
        [
            "gcc",
            "-O2",
            "-o",
            str(exe),
            str(HARNESS_C),
            f"-I{src}/ggml/include",
            f"-L{lib}",
            "-lggml-base",
            f"-Wl,-rpath,{lib}",
        ],
        check=True,
    )
    return exe


def ggml_quantize(exe: Path, qtype: T, x: np.ndarray, qw: np.ndarray | None, tmp: Path) -> np.ndarray:
    rows, n = x.shape
    np.ascontiguousarray(x, np.float32).tofile(tmp / "x")
    if qw is not None:
        np.ascontiguousarray(qw, np.float32).tofile(tmp / "w")
    subprocess.run(
        [
            str(exe),
            str(int(qtype)),
            str(rows),
            str(n),
            str(tmp / "x"),
            str(tmp / "w") if qw is not None else "-",
            str(tmp / "o"),
        ],
        check=True,
    )
    return np.fromfile(tmp / "o", np.uint8).reshape(rows, -1)


def fuzz_data(seed: int, rows: int = 8, n: int = 1024):
    """(name, x, importance) triples: value distributions from ordinary weights to per-block scales spanning
    1e-9..1e4, sparse, integer and half-integer grids, subnormals; importance lognormal, uniform or with zeros,
    and none."""
    rng = np.random.default_rng(seed)
    g = rng.standard_normal((rows, n)).astype(np.float32)
    xs = {
        "gauss": g * 0.02,
        "student_t": rng.standard_t(3, (rows, n)) * 0.02,
        "scaled_blocks": (g.reshape(rows, -1, 256) * np.exp(rng.uniform(-20, 10, (rows, n // 256, 1)))).reshape(
            rows, n
        ),
        "sparse": np.where(rng.random((rows, n)) < 0.8, 0, g),
        "integers": rng.integers(-4, 5, (rows, n)),
        "halves": rng.integers(-30, 31, (rows, n)) / 2,  # MXFP4's midpoints (0.5 .. 10 at d = 1), exactly
        "outliers": np.where(rng.random((rows, n)) < 0.01, g * 100, g * 0.01),
        "subnormal": g * 1e-38,
    }
    ws = {
        "lognormal": np.exp(rng.normal(0, 2, n)),
        "uniform": rng.uniform(0, 1, n),
        "with_zeros": np.where(rng.random(n) < 0.2, 0, rng.uniform(0, 10, n)),
    }
    for i, (name, x) in enumerate(xs.items()):
        wn = list(ws)[(i + seed) % len(ws)]  # each distribution with one kind of importance, and with none
        yield f"{name}/{wn}", x.astype(np.float32), ws[wn].astype(np.float32)
        yield f"{name}/none", x.astype(np.float32), None


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_fuzz_against_ggml_quantize_chunk(qtype, harness, tmp_path):
    rec = TYPES[qtype]
    checked = 0
    for seed in (1, 2):
        for name, x, qw in fuzz_data(seed):
            if qw is None and rec.requires_imatrix:
                continue
            want = ggml_quantize(harness, qtype, x, qw, tmp_path)
            got = quantize(x, qtype, name, importance=qw, check_scales=False)
            bad = np.nonzero((got.reshape(-1, rec.type_size) != want.reshape(-1, rec.type_size)).any(1))[0]
            assert len(bad) == 0, f"{qtype.name} seed {seed} {name}: {len(bad)} blocks differ, first {bad[:5]}"
            checked += x.size
    assert checked > 0


# the kernels with a fast path for ordinary blocks and C's conversions one by one for the rest
EDGE_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.IQ4_NL, T.IQ4_XS, T.Q1_0, T.Q2_0, T.MXFP4]


def edge_values(seed: int, n: int = 256) -> np.ndarray:
    """Rows of blocks the engine refuses but a kernel must still write as C does: NaN, +-inf, FLT_MAX, block
    scales from 1e-45 (1 / d overflows) to 3e38, constant blocks and quarter-integer grids; and blocks it takes
    whose bytes hang on which of two equal values C's loops keep: +0 and -0 as the min or max, +-c as |x|'s max."""
    rng = np.random.default_rng(seed)
    scales = np.array([1e-45, 1e-41, 3e-39, 1e-38, 1e-30, 1e-3, 1.0, 1e10, 1e30, 1e37, 3e38])
    x = rng.standard_normal((44, n)) * np.repeat(scales, 4)[:, None]
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 3.4e38, -3.4e38, 1e-45, -1e-45])
    g = rng.standard_normal((16, n))
    hit = rng.random(g.shape) < 0.02
    g[hit] = rng.choice(special, hit.sum())
    grid = rng.integers(-40, 41, (8, n)) / 4.0
    constant = np.repeat(rng.standard_normal((8, n // 32)), 32, axis=1)
    # zeros of both signs as a block's min or max (which one C's loop keeps is its order's), and ties of |x|
    zeros = np.where(rng.random((16, n)) < 0.3, np.abs(rng.standard_normal((16, n))), rng.choice([0.0, -0.0], (16, n)))
    zeros[8:] *= -1
    ties = rng.choice(np.array([-1.5, 1.5, 0.25, -0.25, 0.0, -0.0]), (8, n))
    with np.errstate(over="ignore"):
        return np.concatenate([x, g, grid, constant, zeros, ties]).astype(np.float32)


@pytest.mark.parametrize("qtype", EDGE_TYPES, ids=lambda t: t.name)
def test_kernels_on_edge_values_against_ggml_quantize_chunk(qtype, harness, tmp_path):
    rec = TYPES[qtype]
    for seed in (1, 2):
        x = edge_values(seed)
        want = ggml_quantize(harness, qtype, x, None, tmp_path)
        got = np.zeros(want.size, np.uint8)
        with np.errstate(all="ignore"):
            rec.quantize(x.reshape(-1), got, x.shape[1])
        bad = np.nonzero((got.reshape(-1, rec.type_size) != want.reshape(-1, rec.type_size)).any(1))[0]
        assert len(bad) == 0, f"{qtype.name} seed {seed}: {len(bad)} blocks differ, first {bad[:5]}"


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_llama_quantize_agrees(qtype, inputs, llama_cpp_bin, tmp_path):
    """llama-quantize --pure of an F32 GGUF of the golden cases (rows that fit the type's block, 2-D, of a
    llama-shaped file) writes the bytes quantize writes for them (with an imatrix for the types that need one).
    Cases whose fp16 scales overflow (quantize refuses them) are left out: llama-quantize refuses them too."""
    rec = TYPES[qtype]
    imp = {c: np.ones(inputs[c].shape[1], np.float32) if qtype in NEEDS_IMATRIX else None for c in CASES}

    def takes(c: str) -> bool:
        try:
            quantize(inputs[c], qtype, c, importance=imp[c])
        except ValueError:
            return False
        return True

    src = tmp_path / "f32.gguf"
    w = gguf.GGUFWriter(src, "llama")
    for key, value in (
        ("block_count", 1),
        ("context_length", 256),
        ("embedding_length", 256),
        ("feed_forward_length", 512),
        ("head_count", 1),
    ):
        getattr(w, f"add_{key}")(value)
    w.add_layer_norm_rms_eps(1e-5)
    cases = [c for c in CASES if inputs[c].shape[1] % rec.block_size == 0 and takes(c)]
    for c in cases:
        w.add_tensor(f"blk.0.{c}.weight", inputs[c])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out, args = tmp_path / "q.gguf", []
    if qtype in NEEDS_IMATRIX:
        from mtpq.quantize.imatrix import Entry, Imatrix, write_imatrix

        im = tmp_path / "im.dat"
        write_imatrix(
            Imatrix(
                {
                    f"blk.0.{c}.weight": Entry(np.ones((1, inputs[c].shape[1]), np.float32), np.ones(1, np.float32))
                    for c in cases
                },
                legacy=True,
            ),
            im,
        )
        args = ["--imatrix", str(im)]
    subprocess.run(
        [
            str(llama_cpp_bin / "llama-quantize"),
            "--pure",
            *args,
            str(src),
            str(out),
            PRESET_OF.get(qtype, qtype.name),
            "2",
        ],
        check=True,
        capture_output=True,
    )
    seen = 0
    for t in gguf.GGUFReader(out).tensors:
        c = t.name[len("blk.0.") : -len(".weight")]
        assert t.tensor_type == qtype, f"{c}: {t.tensor_type.name}"
        assert np.asarray(t.data).tobytes() == quantize(inputs[c], qtype, c, importance=imp[c]).tobytes(), c
        seen += 1
    assert seen == len(cases)
