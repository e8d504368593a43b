"""mtpq's i-quant kernels (mtpq.ggml.iquants) are byte-identical to ggml's.

Golden vectors (``tests/data/golden_quants/``)
---------------------------------------------
Inputs are the float32 cases of ``inputs.npz`` (see tests/ggml/test_quant_kernels.py).
``iquant_weights.npz`` holds one importance vector per case (float32
``(n_per_row,)``, made once with ``numpy.random.default_rng(20261123)``:
``exp(N(0, 1.5^2))`` -- an imatrix's spread over orders of magnitude -- with ~3%
of the columns set to 0, as for inputs that never saw an activation).

``<TYPE>.npz`` (IQ2_XXS, IQ3_XXS, ...) holds per case the uint8 bytes
``(rows, bytes_per_row)`` that ``ggml_quantize_chunk(type, src, dst, 0, rows,
n_per_row, imatrix)`` of the vendored llama.cpp (the same build as the other
goldens: llama-cpp-python 0.3.36's vendor/llama.cpp, ggml 0.25.3, default CMake
options, x86-64, libggml-base without FMA) writes with the case's importance
vector, and under ``<case>__noimatrix`` with ``imatrix = NULL`` for the types
whose ggml quantizer accepts that (not IQ2_XXS / IQ2_XS / IQ1_S, which abort).
They were made by the harness tests/golden/qharness.c (public ggml API only:
``ggml_quantize_init`` + ``ggml_quantize_chunk``), compiled as::

    gcc -O2 -o qh qh.c -I vendor/llama.cpp/ggml/include \\
        -L vendor/llama.cpp/build/bin -lggml-base -Wl,-rpath,vendor/llama.cpp/build/bin

``test_fuzz_against_ggml`` (marker ``llama_cpp``; needs gcc, MTPQ_LLAMA_CPP_SRC
and MTPQ_LLAMA_CPP_BIN pointing at the built libraries) compiles the same
harness and compares on random data of several distributions and imatrices.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from mtpq.ggml import iquants, kernels
from mtpq.ggml.kernels import dequantize, quantize
from tests.helpers.golden_quants import CASES, load_golden as _load

IQ_TYPES = [T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M]
HARNESS_C = Path(__file__).parents[1] / "golden" / "qharness.c"  # (tests/golden/make_golden_quants.py makes the goldens)


@pytest.fixture(scope="module")
def weights():
    return _load("iquant_weights.npz")


def _ours(qtype: T, x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    """The kernel on whole rows: blocks (rows * n/256, 256), importance repeated per row."""
    fn = kernels._KERNELS[qtype][0]
    rows, n = x.shape
    xb = torch.from_numpy(np.ascontiguousarray(x)).reshape(-1, 256)
    wb = None if qw is None else torch.from_numpy(qw).reshape(1, -1, 256).expand(rows, -1, -1).reshape(-1, 256)
    return fn(xb, wb).numpy().reshape(rows, -1)


def _diff_blocks(qtype, ours, ref):
    ts = gguf.GGML_QUANT_SIZES[qtype][1]
    return np.nonzero((ours.reshape(-1, ts) != ref.reshape(-1, ts)).any(-1))[0]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("qtype", IQ_TYPES, ids=lambda t: t.name)
def test_golden_bytes(qtype, case, inputs, weights):
    gold = _load(f"{qtype.name}.npz")
    variants = [(weights[case], case)]
    if qtype not in iquants.REQUIRES_WEIGHTS:
        variants.append((None, case + "__noimatrix"))
    for qw, key in variants:
        ours = _ours(qtype, inputs[case], qw)
        bad = _diff_blocks(qtype, ours, gold[key])
        assert ours.shape == gold[key].shape
        assert len(bad) == 0, f"{qtype.name}/{key}: {len(bad)} blocks differ from ggml, first {bad[:5].tolist()}"


@pytest.mark.parametrize("qtype", IQ_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf_py(qtype):
    """Our torch dequantizer equals gguf-py's on ggml's own bytes (every golden case)."""
    for key, raw in _load(f"{qtype.name}.npz").items():
        ref = gguf.quants.dequantize(raw, qtype)
        ours = dequantize(raw, qtype, ref.shape).numpy()
        assert np.array_equal(ours, ref, equal_nan=True), key


@pytest.mark.parametrize("qtype", IQ_TYPES, ids=lambda t: t.name)
def test_round_trip_error(qtype, inputs, weights):
    """Sanity of the round trip on N(0, 1): a few-bit code, but not noise."""
    x = inputs["gauss_512"]
    q = _ours(qtype, x, weights["gauss_512"])
    y = gguf.quants.dequantize(q, qtype)
    rel = np.sqrt(np.mean((y - x) ** 2) / np.mean(x ** 2))
    assert 0.05 < rel < BOUND[qtype], rel


BOUND = {T.IQ2_XXS: 0.45, T.IQ2_XS: 0.4, T.IQ2_S: 0.4, T.IQ3_XXS: 0.3, T.IQ3_S: 0.3, T.IQ1_S: 0.7, T.IQ1_M: 0.6}


def test_facade_without_imatrix(inputs):
    """A type that needs an imatrix: one line naming the tensor; one that does not: ggml's bytes."""
    with pytest.raises(ValueError, match=r"^blk\.0\.ffn_up\.weight: IQ2_XXS needs an importance matrix"):
        quantize(torch.from_numpy(inputs["gauss_512"]), T.IQ2_XXS, "blk.0.ffn_up.weight")
    gold = _load("IQ3_XXS.npz")
    for case in ("gauss_512", "misc", "tiny"):
        assert np.array_equal(quantize(torch.from_numpy(inputs[case]), T.IQ3_XXS, case), gold[case + "__noimatrix"])


@pytest.mark.parametrize("workers", ["fork", "threads"])
def test_facade_chunks_and_workers(workers, inputs, monkeypatch):
    """IQ3_XXS through the facade, one super-block per chunk on 3 workers: same bytes."""
    monkeypatch.setenv("MTPQ_WORKERS", workers)
    q, d, _, _ = kernels._KERNELS[T.IQ3_XXS]
    monkeypatch.setitem(kernels._KERNELS, T.IQ3_XXS, (q, d, 256, 256))
    gold = _load("IQ3_XXS.npz")
    x = np.concatenate([inputs["gauss_512"], inputs["outliers"]])
    ref = np.concatenate([gold["gauss_512__noimatrix"], gold["outliers__noimatrix"]])
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        assert np.array_equal(quantize(torch.from_numpy(x), T.IQ3_XXS), ref)
    finally:
        torch.set_num_threads(saved)


def test_neighbour_tables_follow_ggml_rules():
    """Spot checks of the derived tables: grid points map to themselves; a neighbour list holds
    exactly the grid points at the two smallest distances, sorted by (distance, index)."""
    g = iquants._grid(T.IQ2_XXS)
    assert len(g.values) == 256 and set(np.unique(g.values)) == {1, 3, 5}
    start, count, flat = g.neighbours(2)
    rng = np.random.default_rng(0)
    off = np.nonzero(count)[0]
    assert len(off) == 3 ** 8 - 256  # every reachable off-grid lattice point has a list
    for u in rng.choice(off, 20, replace=False):
        pos = 2 * ((u >> (2 * np.arange(8))) & 3) + 1
        d2 = ((g.values - pos) ** 2).sum(1)
        two = np.unique(d2)[:2]
        want = sorted(np.nonzero(np.isin(d2, two))[0], key=lambda j: (d2[j], j))
        assert flat[start[u]:start[u] + count[u]].tolist() == want


# ----------------------------------------------------------------------------- fuzz (llama.cpp)


def _harness(tmp_path_factory) -> Path:
    src = os.environ.get("MTPQ_LLAMA_CPP_SRC")
    lib = os.environ.get("MTPQ_LLAMA_CPP_BIN")
    if not src or not lib or not shutil.which("gcc"):
        pytest.skip("needs gcc, MTPQ_LLAMA_CPP_SRC and MTPQ_LLAMA_CPP_BIN (with libggml-base)")
    d = tmp_path_factory.mktemp("qh")
    (d / "qh.c").write_text(HARNESS_C.read_text())
    subprocess.run(["gcc", "-O2", "-o", str(d / "qh"), str(d / "qh.c"), f"-I{src}/ggml/include", f"-L{lib}",
                    "-lggml-base", f"-Wl,-rpath,{lib}"], check=True)
    return d / "qh"


def ggml_quantize(qh: Path, qtype: T, x: np.ndarray, qw: np.ndarray | None, tmp: Path) -> np.ndarray:
    rows, n = x.shape
    np.ascontiguousarray(x, np.float32).tofile(tmp / "x")
    if qw is not None:
        np.ascontiguousarray(qw, np.float32).tofile(tmp / "w")
    subprocess.run([str(qh), str(int(qtype)), str(rows), str(n), str(tmp / "x"),
                    str(tmp / "w") if qw is not None else "-", str(tmp / "o")], check=True)
    return np.fromfile(tmp / "o", np.uint8).reshape(rows, -1)


def fuzz_data(seed: int, rows: int, n: int):
    """(name, x, importance) triples: several value and imatrix distributions."""
    rng = np.random.default_rng(seed)
    g = rng.standard_normal((rows, n)).astype(np.float32)
    xs = {
        "gauss": g * 0.02,
        "student_t": (rng.standard_t(3, (rows, n)) * 0.02).astype(np.float32),
        "scaled_blocks": (g.reshape(rows, -1, 256) * np.exp(rng.uniform(-20, 10, (rows, n // 256, 1)))).reshape(rows, n),
        "sparse": np.where(rng.random((rows, n)) < 0.8, 0, g).astype(np.float32),
        "uniform": rng.uniform(-1, 1, (rows, n)).astype(np.float32),
        "outliers": np.where(rng.random((rows, n)) < 0.01, g * 100, g * 0.01).astype(np.float32),
        "integers": rng.integers(-4, 5, (rows, n)).astype(np.float32),
    }
    ws = {
        "lognormal": np.exp(rng.normal(0, 2, n)).astype(np.float32),
        "uniform": rng.uniform(0, 1, n).astype(np.float32),
        "with_zeros": np.where(rng.random(n) < 0.2, 0, rng.uniform(0, 10, n)).astype(np.float32),
    }
    for i, (xn, x) in enumerate(xs.items()):
        wn = list(ws)[i % len(ws)]
        yield f"{xn}/{wn}", x.astype(np.float32), ws[wn]
        yield f"{xn}/none", x.astype(np.float32), None


@pytest.mark.llama_cpp
@pytest.mark.parametrize("qtype", IQ_TYPES, ids=lambda t: t.name)
def test_fuzz_against_ggml(qtype, tmp_path_factory, tmp_path):
    qh = _harness(tmp_path_factory)
    total = 0
    for seed in (1, 2):
        for name, x, qw in fuzz_data(seed, 8, 1024):
            if qw is None and qtype in iquants.REQUIRES_WEIGHTS:
                continue
            ref = ggml_quantize(qh, qtype, x, qw, tmp_path)
            bad = _diff_blocks(qtype, _ours(qtype, x, qw), ref)
            assert len(bad) == 0, f"{qtype.name} seed {seed} {name}: {len(bad)} blocks differ"
            total += ref.size
    assert total > 0
