"""Every ggml type's bytes are llama.cpp's: tests/data/golden_quants/ (made by tests/golden/make_golden_quants.py
with ggml_quantize_chunk of the vendored llama.cpp, see tests/golden/) through mtpq.ggml.engine, from arrays and
from files, in one chunk and in many shared by threads; and every dequantizer gives gguf-py's values bit for bit.

The golden cases (inputs.npz, float32 (rows, n_per_row), numpy.random.default_rng(20250101)): gauss_512 4x512
N(0, 0.02^2); gauss_256 3x256 N(0, 1); zeros (with -0.0); const (constant rows and blocks, 1e-3, 2^-20 ...);
outliers 3x512 N(0, 1e-4) with +-1e4; tiny (1e-30, subnormal 1e-40 / 1e-44, blocks around GROUP_MAX_EPS);
signs; misc (uniform, Student-t, sparse, multiples of 0.5 / 0.125: rounding ties); large (N(0,1) * 3e4: Q4_1 /
Q5_1 minima overflow fp16, which llama-quantize refuses). ``<TYPE>.npz``: without importance; ``<TYPE>_imatrix.npz``:
with importance.npz's vector; the 1-3-bit i-quants with iquant_weights.npz's, and ``<case>__noimatrix`` without
where ggml allows it.

FMA: ggml-quants.c lives in libggml-base, built without -march, so x86-64 gcc contracts nothing; the kernels
compute as it does (numba without fastmath). A build that contracts (aarch64) can differ from these goldens.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

from mtpq.ggml import engine
from mtpq.ggml.engine import Stored, dequantize, quantize
from mtpq.ggml.registry import TYPES
from tests.helpers.golden_quants import CASES, GOLDEN, load_golden

PLAIN = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS]
WEIGHTED = [t for t in PLAIN if t is not T.Q8_0]
GRID = [T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M]
OVERFLOWS = {(T.Q4_1, "large"), (T.Q5_1, "large")}  # llama-quantize refuses them, as quantize does


def _cases(qtype: T) -> list[tuple[str, str, np.ndarray | None]]:
    """(golden file, key, importance) of every golden of ``qtype``."""
    if qtype in GRID:
        weights, gold = load_golden("iquant_weights.npz"), load_golden(f"{qtype.name}.npz")
        return [(f"{qtype.name}.npz", k, None if k.endswith("__noimatrix") else weights[k]) for k in gold]
    out = [(f"{qtype.name}.npz", c, None) for c in CASES]
    if qtype in WEIGHTED:
        imp = load_golden("importance.npz")
        out += [(f"{qtype.name}_imatrix.npz", c, imp[c]) for c in CASES]
    return out


def _check(qtype, got: np.ndarray, want: np.ndarray, what: str) -> None:
    if not np.array_equal(got, want):
        ts = TYPES[qtype].type_size
        bad = np.nonzero((got.reshape(-1, ts) != want.reshape(-1, ts)).any(1))[0]
        pytest.fail(f"{qtype.name} {what}: {len(bad)} blocks differ from ggml, first {bad[:5].tolist()}")


@pytest.mark.parametrize("qtype", PLAIN + GRID, ids=lambda t: t.name)
def test_golden_bytes(qtype, inputs):
    for file, key, imp in _cases(qtype):
        case = key.removesuffix("__noimatrix")
        want = load_golden(file)[key]
        got = quantize(inputs[case], qtype, case, importance=imp, check_scales=False)
        assert got.dtype == np.uint8 and got.shape == want.shape
        _check(qtype, got, want, f"{file}[{key}]")
        if (qtype, case) in OVERFLOWS:
            with pytest.raises(ValueError, match=rf"{case}: values too large for {qtype.name}"):
                quantize(inputs[case], qtype, case, importance=imp)


@pytest.mark.parametrize("qtype", PLAIN + GRID, ids=lambda t: t.name)
def test_golden_bytes_in_small_chunks_on_threads(qtype, inputs, monkeypatch):
    """One row per chunk, three threads: no byte depends on how the rows are shared out."""
    monkeypatch.setattr(engine, "CHUNK", 1)
    monkeypatch.setitem(engine._state, "n", 3)
    for file, key, imp in _cases(qtype)[::3]:
        case = key.removesuffix("__noimatrix")
        got = quantize(inputs[case], qtype, case, importance=imp, check_scales=False)
        _check(qtype, got, load_golden(file)[key], f"{file}[{key}] in chunks")


@pytest.mark.parametrize("source", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.IQ4_XS, T.IQ2_XXS, T.Q6_K], ids=lambda t: t.name)
def test_stored_values_give_the_arrays_bytes(qtype, source, inputs, tmp_path, monkeypatch):
    """Values read where a file stores them (float32, float16, bf16 bits, at an offset) are quantized as the
    array of the same values is."""
    monkeypatch.setattr(engine, "CHUNK", 512)
    x = inputs["gauss_512"]
    as_stored = {T.F32: x, T.F16: x.astype(np.float16), T.BF16: (x.view(np.uint32) >> 16).astype(np.uint16)}[source]
    path = tmp_path / "values.bin"
    path.write_bytes(b"\x07" * 96 + as_stored.tobytes())
    imp = load_golden("iquant_weights.npz")["gauss_512"] if qtype is T.IQ2_XXS else None
    got = quantize(Stored(path, 96, source, x.shape), qtype, "w", importance=imp)
    assert np.array_equal(got, quantize(as_stored, qtype, "w", importance=imp))
    if source is T.F32 and qtype is not T.IQ2_XXS:
        assert np.array_equal(got, load_golden(f"{qtype.name}.npz")["gauss_512"])


@pytest.mark.parametrize("qtype", [t for t in TYPES if t not in (T.F32, T.F16, T.BF16)], ids=lambda t: t.name)
def test_dequantize_is_ggml_bit_for_bit(qtype):
    """Random blocks (every scale byte, every code) decode to gguf-py's float32 bits; Q1_0/Q2_0, which gguf-py
    lacks, to ggml's dequantize_row formulas written out here."""
    rec = TYPES[qtype]
    rng = np.random.default_rng(int(qtype))
    raw = rng.integers(0, 256, size=(64, rec.type_size), dtype=np.uint8)
    for at in rec.fp16_fields:  # finite scales: gguf-py's numpy would warn on inf * 0
        raw[:, at + 1] &= 0x3B
    got = dequantize(raw, qtype, (64, rec.block_size))
    if qtype in (T.Q1_0, T.Q2_0):
        d = raw[:, :2].copy().view(np.float16).astype(np.float32)
        bits = np.unpackbits(raw[:, 2:], axis=1, bitorder="little").astype(np.float32)
        want = (
            np.where(bits > 0, d, -d) if qtype is T.Q1_0 else ((bits[:, 0::2] + 2 * bits[:, 1::2]) - np.float32(1)) * d
        )
    else:
        with np.errstate(all="ignore"):
            want = np.asarray(gq.dequantize(raw, qtype), np.float32).reshape(got.shape)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    again = dequantize(raw[::-1].copy()[::-1], qtype, got.shape)  # any array of the bytes
    assert np.array_equal(again.view(np.uint32), got.view(np.uint32))


def test_goldens_cover_every_file():
    names = {p.name for p in GOLDEN.glob("*.npz")} - {"inputs.npz", "importance.npz", "iquant_weights.npz"}
    covered = {f for t in PLAIN + GRID for f, _, _ in _cases(t)}
    assert names == covered
