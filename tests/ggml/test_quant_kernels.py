"""mtpq's torch quantization kernels are byte-identical to ggml's reference quantizers.

Golden vectors (``tests/data/golden_quants/``)
---------------------------------------------
``inputs.npz`` holds float32 test matrices (one key per case, shape
``(rows, n_per_row)``), made once with ``numpy.random.default_rng(20250101)``:

* ``gauss_512``  4x512 N(0, 0.02^2) -- ordinary weights;
* ``gauss_256``  3x256 N(0, 1);
* ``zeros``      2x256 all zero (row 1 has -0.0 at every third position);
* ``const``      4x256 constant rows (0.5, -0.25), constant 32-blocks of
  1, -1, 0, 3, -7.5, 1e-3, 2^-20, 100, and constant 16-blocks;
* ``outliers``   3x512 N(0, 1e-4) with ~1% of the values set to +-1e4;
* ``tiny``       5x256 N(0,1) scaled by 1e-30, 1e-40 and 1e-44 (subnormal),
  a row mixing 1e-3 / 1e-38 / 1e-16 / 1e-15 sub-blocks (around ggml's
  GROUP_MAX_EPS), and 1e-20;
* ``signs``      4x256 all positive, all negative, alternating signs, one
  negative value among positives;
* ``misc``       5x512 uniform(-1, 1), Student-t(2) * 0.05, 90% sparse,
  multiples of 0.5 and of 0.125 (rounding ties);
* ``large``      2x256 N(0,1) * 3e4: Q4_1/Q5_1 minima overflow fp16 here.

``<TYPE>.npz`` holds, per case, the uint8 bytes ``(rows, bytes_per_row)`` that
llama.cpp's own ``ggml_quantize_chunk(type, src, dst, 0, rows, n_per_row,
imatrix=NULL)`` writes -- the call ``llama-quantize`` makes without an
importance matrix, which dispatches to ``quantize_row_*_ref`` (and to
``quantize_iq4_nl`` / ``quantize_iq4_xs`` with ntry = 7 for the IQ4 types).

The llama.cpp used is the copy vendored in the llama-cpp-python 0.3.36 sdist
(``vendor/llama.cpp``, git commit 0c1e57098bba43ac29e6e3b677cdceebdd22334f,
``llama.cpp version 0.5.0-dev``, ggml 0.25.3), configured with its default
CMake options (Release, GGML_NATIVE=ON, shared libs, gcc 12.2.0, x86-64) and
built with ``cmake --build build``.  The C harness tests/golden/qharness.c (it
reads ``rows*n_per_row`` float32 from a file, calls ``ggml_quantize_chunk`` and
writes the bytes out) was compiled against the built library, and
tests/golden/make_golden_quants.py ran it once per (type, case) and saved the npz
files; ``make_golden_quants.py --llama-cpp SRC`` checks (or ``--write`` remakes)
every golden from the committed inputs.
``llama-quantize --pure`` of the same build, run on an F32 GGUF holding these
cases, writes the very same bytes (``test_llama_quantize_agrees`` checks it
when ``MTPQ_LLAMA_CPP_BIN`` is set); except for ``large`` in Q4_1 / Q5_1,
which llama-quantize refuses ("quantized data validation failed"), as our
``quantize`` does (``check_scales``).

FMA: ``ggml-quants.c`` lives in ``libggml-base``, which llama.cpp's CMake
compiles WITHOUT ``-march`` flags even with GGML_NATIVE=ON (only the ggml-cpu
backend gets ``-march=native``), so on x86-64 no FMA instruction is available
and gcc's default ``-ffp-contract=fast`` contracts nothing: every float op is
rounded separately, which is what the torch kernels reproduce.  Compiling the
same file with ``-march=native`` (FMA contraction) changes the bytes of 22-57%
of Q2_K blocks, 24-30% of Q5_K, ~6% of Q4_K and <0.3% of Q6_K / IQ4 blocks on
gaussian / Student-t data (legacy types and Q3_K are unaffected); builds that
contract (e.g. aarch64, where FMA is baseline) can therefore differ from these
goldens -- the x86-64 build is the reference.

Besides the goldens, the final kernels were fuzzed against the same harness on
~9.4 million values per type (3 seeds x 12 distributions x 64x4096: per-block
scales from 1e-44 to 1e30, scales around the point where ggml's 1/d overflows,
integer grids, sparse, heavy tails, outliers, constant blocks...) with no
difference, and ``benchmarks/quant_bench.py`` compares against llama-quantize
on a 4096x4096 matrix (identical bytes for Q8_0, Q4_K, Q6_K).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import os
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from mtpq.ggml import cnumpy, iquants, kernels, legacy, npquant, vecops
from mtpq.ggml.kernels import SUPPORTED_TYPES, block_size, bytes_per_row, dequantize, quantize

GOLDEN = Path(__file__).parents[1] / "data" / "golden_quants"
QUANT_TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS]
# the i-quants (mtpq.ggml.iquants) have their own goldens and tests: tests/ggml/test_iquant_kernels.py
IQUANT_TYPES = [T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M]
CASES = ["gauss_512", "gauss_256", "zeros", "const", "outliers", "tiny", "signs", "misc", "large"]
# llama-quantize rejects these (an fp16 block scale overflows): mtpq's quantize does too
OVERFLOWS = {(T.Q4_1, "large"), (T.Q5_1, "large")}
# relative RMS error bound of the round trip on the data of test_round_trip_matches_gguf_py
# (N(0, 1) with a zero block and one outlier); measured values are ~2/3 of these
RT_BOUND = {
    T.F32: 0.0, T.F16: 5e-4, T.BF16: 3e-3, T.Q8_0: 0.011, T.Q4_0: 0.15, T.Q4_1: 0.13, T.Q5_0: 0.09,
    T.Q5_1: 0.062, T.Q2_K: 0.42, T.Q3_K: 0.22, T.Q4_K: 0.12, T.Q5_K: 0.058, T.Q6_K: 0.035,
    T.IQ4_NL: 0.135, T.IQ4_XS: 0.135,
}


@pytest.fixture(scope="module")
def inputs() -> dict[str, np.ndarray]:
    with np.load(GOLDEN / "inputs.npz") as z:
        return {k: z[k] for k in z.files}


_golden_cache: dict[T, dict[str, np.ndarray]] = {}


def golden(qtype: T) -> dict[str, np.ndarray]:
    if qtype not in _golden_cache:
        with np.load(GOLDEN / f"{qtype.name}.npz") as z:
            _golden_cache[qtype] = {k: z[k] for k in z.files}
    return _golden_cache[qtype]


# ----------------------------------------------------------------------------- golden bytes


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_golden_bytes(qtype, case, inputs):
    x = torch.from_numpy(inputs[case])
    ref = golden(qtype)[case]
    ours = quantize(x, qtype, case, check_scales=False)
    assert ours.dtype == np.uint8 and ours.shape == ref.shape
    if not np.array_equal(ours, ref):
        bs, ts = gguf.GGML_QUANT_SIZES[qtype]
        bad = np.nonzero((ours.reshape(-1, ts) != ref.reshape(-1, ts)).any(-1))[0]
        pytest.fail(f"{qtype.name}/{case}: {len(bad)} blocks differ from ggml, first {bad[:5].tolist()}")
    if (qtype, case) in OVERFLOWS:
        with pytest.raises(ValueError, match=rf"{case}: values too large for {qtype.name}"):
            quantize(x, qtype, case)
    else:
        assert np.array_equal(quantize(x, qtype, case), ref)


@pytest.mark.parametrize("qtype", sorted(npquant.NUMPY_TYPES), ids=lambda t: t.name)
def test_torch_legacy_kernels_match_the_numpy_ones(qtype, inputs):
    """On CPU these types run in numpy (npquant); legacy's torch kernels remain for other devices and for
    the chunks numpy hands back (deep-subnormal scales): both give ggml's bytes."""
    fn = {T.Q8_0: legacy.quantize_q8_0, T.Q4_0: legacy.quantize_q4_0, T.Q5_0: legacy.quantize_q5_0,
          T.Q4_1: legacy.quantize_q4_1, T.Q5_1: legacy.quantize_q5_1}[qtype]
    for case, x in inputs.items():
        ref = golden(qtype)[case]
        blocks = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32).reshape(-1, block_size(qtype)))
        assert np.array_equal(fn(blocks).numpy().reshape(ref.shape), ref), case
        assert np.array_equal(npquant._torch_chunk(blocks.numpy(), qtype).reshape(ref.shape), ref), case


@pytest.mark.parametrize("workers", ["fork", "threads"])
@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_golden_bytes_in_small_chunks_and_workers(qtype, workers, inputs, monkeypatch):
    """Chunking (blocks split across chunks and workers) must not change a byte,
    with forked workers (Linux) and with the thread fallback."""
    if workers == "fork" and not sys.platform.startswith("linux"):
        pytest.skip("forked workers are Linux-only")
    monkeypatch.setenv("MTPQ_WORKERS", workers)
    monkeypatch.setattr(kernels, "_FORK_MIN_VALUES", 0)  # forked however small the tensor
    q, d, _, _ = kernels._KERNELS[qtype]
    monkeypatch.setitem(kernels._KERNELS, qtype, (q, d, 256, 256))  # one super-block per chunk
    monkeypatch.setattr(npquant, "CHUNK", 256)  # the numpy kernels' chunks (their own threads)
    used = []
    for name in ("_run_forked", "_run_parallel"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _real=real, _name=name: (used.append(_name), _real(*a)))
    x = torch.from_numpy(np.concatenate([inputs["gauss_512"], inputs["outliers"]]))
    ref = np.concatenate([golden(qtype)["gauss_512"], golden(qtype)["outliers"]])
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        assert np.array_equal(quantize(x, qtype), ref)
        assert torch.get_num_threads() == 3  # restored after the workers
    finally:
        torch.set_num_threads(saved)
    numpy_only = qtype in npquant.NUMPY_TYPES  # never forked: numpy threads
    assert used == [] if numpy_only else ["_run_forked" if workers == "fork" and qtype in kernels._FORKED_TYPES
                                          else "_run_parallel"]
    with pytest.raises(ChildProcessError):  # every forked worker was reaped
        os.waitpid(-1, os.WNOHANG)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forked workers are Linux-only")
def test_forked_workers_report_errors(monkeypatch):
    """An error in a forked worker comes back as the same one line, and nothing lingers."""
    monkeypatch.setattr(kernels, "_FORK_MIN_VALUES", 0)
    monkeypatch.setitem(kernels._KERNELS, T.Q4_K, (*kernels._KERNELS[T.Q4_K][:2], 256, 256))
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.zeros(8, 1024)
        x[7, 1000] = float("nan")  # in the last chunk
        with pytest.raises(ValueError) as e:
            quantize(x, T.Q4_K, "blk.3.ffn_up.weight")
        assert str(e.value) == "blk.3.ffn_up.weight: contains NaN/Inf values"
        x = torch.zeros(8, 1024)
        x[3, 5] = 1e30  # a Q4_K scale overflowing fp16, in a middle chunk
        with pytest.raises(ValueError, match="blk.0.w: values too large for Q4_K"):
            quantize(x, T.Q4_K, "blk.0.w")

        def broken(_):
            raise MemoryError("no room")

        monkeypatch.setitem(kernels._KERNELS, T.Q4_K, (broken, *kernels._KERNELS[T.Q4_K][1:]))
        with pytest.raises(RuntimeError, match="quantization worker failed: MemoryError: no room"):
            quantize(torch.zeros(8, 1024), T.Q4_K, "w")
    finally:
        torch.set_num_threads(saved)
    with pytest.raises(ChildProcessError):
        os.waitpid(-1, os.WNOHANG)


def test_small_tensors_go_to_threads_big_ones_to_forked_workers(monkeypatch):
    """Forking costs the parent milliseconds of system time per worker: only tensors of at least
    _FORK_MIN_VALUES values are split over forked workers, smaller ones over threads."""
    if not sys.platform.startswith("linux"):
        pytest.skip("forked workers are Linux-only")
    monkeypatch.setenv("MTPQ_WORKERS", "fork")
    monkeypatch.setattr(kernels, "_FORK_MIN_VALUES", 4 * 1024)
    used = []
    for name in ("_run_forked", "_run_parallel"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _real=real, _name=name: (used.append(_name), _real(*a)))
    monkeypatch.setitem(kernels._KERNELS, T.Q6_K, (*kernels._KERNELS[T.Q6_K][:2], 1024, 1024))
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        small, big = torch.randn(3, 1024), torch.randn(4, 1024)
        assert np.array_equal(quantize(small, T.Q6_K), quantize(small[None], T.Q6_K)[0])
        assert used == ["_run_parallel", "_run_parallel"]
        used.clear()
        quantize(big, T.Q6_K)
        assert used == ["_run_forked"]
    finally:
        torch.set_num_threads(saved)


SEARCH_TYPES = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS]


@pytest.mark.parametrize("qtype", SEARCH_TYPES, ids=lambda t: t.name)
def test_golden_bytes_generic_torch_path(qtype, inputs, monkeypatch):
    """The all-torch bookkeeping used on CUDA gives the same bytes (run here on CPU)."""
    monkeypatch.setattr(vecops, "numpy_path", lambda X: False)
    for case in CASES:
        ours = quantize(torch.from_numpy(inputs[case]), qtype, case, check_scales=False)
        assert np.array_equal(ours, golden(qtype)[case]), case


@pytest.mark.parametrize("qtype", SEARCH_TYPES, ids=lambda t: t.name)
def test_golden_bytes_without_einsum(qtype, inputs, monkeypatch):
    """The fallback for numpy builds whose einsum fuses (multiply, then row-by-row sum)."""
    monkeypatch.setattr(cnumpy.Dots, "dot", staticmethod(cnumpy.dot_reduce))
    monkeypatch.setattr(cnumpy.Dots, "dot3", staticmethod(cnumpy.dot3_reduce))
    for case in CASES:
        ours = quantize(torch.from_numpy(inputs[case]), qtype, case, check_scales=False)
        assert np.array_equal(ours, golden(qtype)[case]), case


def test_einsum_probe():
    """The probe accepts this numpy's einsum and rejects fused, pairwise or float64 variants."""
    assert cnumpy.einsum_is_exact()
    real = np.einsum

    def wide(spec, *ops):  # products and sums in float64, rounded once: what an FMA build does, roughly
        return real(spec, *(o.astype(np.float64) for o in ops)).astype(np.float32)

    def backwards(spec, *ops):  # rows summed last to first
        return real(spec, *(o[::-1] for o in ops))

    for fake in (wide, backwards):
        assert not cnumpy.einsum_is_exact(fake), fake.__name__
    assert cnumpy.einsum_is_exact(real)


def test_leading_dims_and_input_dtypes(inputs):
    x = torch.from_numpy(inputs["gauss_512"])  # (4, 512)
    ref = golden(T.Q4_K)["gauss_512"]
    assert np.array_equal(quantize(x.reshape(2, 2, 512), T.Q4_K), ref.reshape(2, 2, -1))
    assert np.array_equal(quantize(x.numpy(), T.Q4_K), ref)  # numpy input
    assert np.array_equal(quantize(x.t().contiguous().t(), T.Q4_K), ref)  # non-contiguous
    # bf16 / f16 inputs are widened exactly to f32 first
    xb = x.to(torch.bfloat16)
    assert np.array_equal(quantize(xb, T.Q6_K), quantize(xb.float(), T.Q6_K))
    xh = x.to(torch.float16)
    assert np.array_equal(quantize(xh, T.Q8_0), quantize(xh.float(), T.Q8_0))


# ----------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("qtype", [t for t in SUPPORTED_TYPES if t not in IQUANT_TYPES], ids=lambda t: t.name)
def test_round_trip_matches_gguf_py(qtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 512, generator=g)
    x[0, :32] = 0.0  # an all-zero block
    x[1, 40] = 30.0  # an outlier
    raw = quantize(x, qtype, "w")
    ours = dequantize(raw, qtype, x.shape)
    assert ours.dtype == torch.float32 and ours.shape == x.shape
    theirs = np.asarray(gguf.quants.dequantize(raw.view(np.uint8) if qtype == T.BF16 else raw, qtype))
    theirs = torch.from_numpy(theirs.astype(np.float32).reshape(x.shape))
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32)), "not bit-identical to gguf-py"
    rel = ((ours - x).pow(2).mean().sqrt() / x.pow(2).mean().sqrt()).item()
    assert rel <= RT_BOUND[qtype], f"{qtype.name}: relative RMS error {rel:.4f}"
    # torch input, leading dims, chunked decode: same values
    t = torch.from_numpy(np.ascontiguousarray(raw))
    assert torch.equal(dequantize(t, qtype, x.shape), ours)
    assert torch.equal(dequantize(t.reshape(2, 4, -1), qtype, (2, 4, 512)), ours.reshape(2, 4, 512))


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_dequantize_chunked_and_rows(qtype, monkeypatch, inputs):
    raw = golden(qtype)["gauss_512"]
    full = dequantize(raw, qtype, (4, 512))
    monkeypatch.setattr(kernels, "_DEQUANT_CHUNK", 256)
    assert torch.equal(dequantize(raw, qtype, (4, 512)), full)
    # a gathered subset of rows decodes to the same rows (runtime embedding lookup)
    rows = torch.from_numpy(raw)[torch.tensor([3, 1])]
    assert torch.equal(dequantize(rows, qtype, (2, 512)), full[[3, 1]])


def test_dequantize_read_only_memmap(tmp_path):
    raw = golden(T.Q8_0)["gauss_256"]
    p = tmp_path / "raw.bin"
    raw.tofile(p)
    mm = np.memmap(p, dtype=np.uint8, mode="r", shape=raw.shape)
    assert torch.equal(dequantize(mm, T.Q8_0, (3, 256)), dequantize(raw, T.Q8_0, (3, 256)))


def test_dequantize_wrong_size():
    raw = golden(T.Q4_0)["gauss_256"]
    with pytest.raises(ValueError, match="bytes"):
        dequantize(raw, T.Q4_0, (3, 512))


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_K, T.IQ4_XS], ids=lambda t: t.name)
def test_nan_inf_rejected(qtype, bad):
    x = torch.zeros(2, 256)
    x[1, 77] = bad
    with pytest.raises(ValueError) as e:
        quantize(x, qtype, "blk.3.ffn_up.weight")
    assert str(e.value) == "blk.3.ffn_up.weight: contains NaN/Inf values"


@pytest.mark.parametrize(
    "qtype,n", [(T.Q8_0, 48), (T.Q4_0, 16), (T.Q5_1, 100), (T.Q4_K, 384), (T.Q6_K, 128), (T.IQ4_XS, 32)]
)
def test_bad_row_length(qtype, n):
    with pytest.raises(ValueError) as e:
        quantize(torch.zeros(3, n), qtype, "blk.0.attn_q.weight")
    msg = str(e.value)
    assert msg.startswith("blk.0.attn_q.weight:") and qtype.name in msg and str(n) in msg
    with pytest.raises(ValueError, match=qtype.name):
        bytes_per_row(qtype, n)


def test_unsupported_type():
    with pytest.raises(ValueError, match="IQ2_XXS"):
        quantize(torch.zeros(1, 256), T.IQ2_XXS, "w")


def test_f16_overflow_rejected():
    x = torch.tensor([[1.0, 70000.0]])
    with pytest.raises(ValueError, match="w: values exceed the F16 range"):
        quantize(x, T.F16, "w")
    assert np.isinf(quantize(x, T.F16, "w", check_scales=False)[0, 1])


# ----------------------------------------------------------------------------- float types


def _special_f32() -> np.ndarray:
    bits = np.array(
        [0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F80C000,
         0x7F7FFFFF, 0xFF7FFFFF, 0x387FC000, 0x33800000, 0x33800001, 0x477FEFFF, 0x477FF000, 0x0001FFFF],
        dtype=np.uint32,
    )  # zeros, subnormals, bf16 ties (even/odd), fp16 subnormal / max-range edges
    rng = np.random.default_rng(7)
    rand = (rng.standard_normal(4096) * 10.0 ** rng.uniform(-8, 4, 4096)).astype(np.float32)
    return np.concatenate([bits.view(np.float32), rand]).reshape(-1, 16)


def test_f32_f16_bf16():
    x = _special_f32()
    xt = torch.from_numpy(x)
    f32 = quantize(xt, T.F32)
    assert f32.dtype == np.float32 and np.array_equal(f32.view(np.uint32), x.view(np.uint32))
    small = np.where(np.abs(x) < 65520, x, 0).astype(np.float32)  # 65520 and up round to inf
    f16 = quantize(torch.from_numpy(small), T.F16)
    assert f16.dtype == np.float16 and np.array_equal(f16.view(np.uint16), small.astype(np.float16).view(np.uint16))
    # FLT_MAX rounds to bf16 inf: ggml writes it, llama-quantize's validation refuses it
    with pytest.raises(ValueError, match="values exceed the BF16 range"):
        quantize(xt, T.BF16, "w")
    bf = quantize(xt, T.BF16, check_scales=False)
    assert bf.dtype == np.uint16 and bf.shape == x.shape
    assert np.array_equal(bf.view(np.uint8), gguf.quants.quantize(x, T.BF16))  # ggml_compute_fp32_to_bf16
    assert np.array_equal(bf, torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
    # a bf16 tensor passes through unchanged
    xb = torch.from_numpy(np.where(np.abs(x) < 1e38, x, 0).astype(np.float32)).to(torch.bfloat16)
    assert np.array_equal(quantize(xb, T.BF16), xb.view(torch.int16).numpy().view(np.uint16))
    for qt, arr in [(T.F32, f32), (T.F16, f16), (T.BF16, bf)]:
        back = dequantize(arr, qt, arr.shape)
        ref = gguf.quants.dequantize(arr.view(np.uint8) if qt == T.BF16 else arr, qt)
        ref = np.asarray(ref, np.float32).reshape(arr.shape)
        assert np.array_equal(back.numpy().view(np.uint32), ref.view(np.uint32))


def test_bf16_nan_is_quiet():
    # NaN never reaches quantize (rejected), but the rounding helper matches ggml for it
    x = np.array([0x7F800001, 0xFFC00001, 0x7FFFFFFF], dtype=np.uint32).view(np.float32)
    bits = kernels._bf16_bits(torch.from_numpy(x)).numpy().view(np.uint16)
    assert np.array_equal(bits, np.array([0x7FC0, 0xFFC0, 0x7FFF]))


def test_helpers():
    assert block_size(T.Q4_K) == 256 and block_size(T.Q8_0) == 32 and block_size(T.F16) == 1
    assert bytes_per_row(T.Q4_K, 4096) == 16 * 144
    assert bytes_per_row(T.Q8_0, 4096) == 128 * 34
    assert bytes_per_row(T.BF16, 10) == 20
    assert set(QUANT_TYPES) | set(IQUANT_TYPES) | {T.F32, T.F16, T.BF16} == set(SUPPORTED_TYPES)


def test_sqrt_f32_is_correctly_rounded():
    """Both sqrt paths (numpy on CPU, the float64 midpoint test elsewhere) equal the
    float64 root rounded once to float32 (exact: 53 >= 2*24 + 2 bits), on random
    bit patterns over every exponent, subnormals included, and on sums of squares."""
    from mtpq.ggml import legacy

    g = np.random.default_rng(7)
    bits = g.integers(0, 0x7F800000, size=1 << 20, dtype=np.uint32)
    x = np.concatenate([bits.view(np.float32), (g.standard_normal(1 << 18).astype(np.float32) ** 2) / 32])
    want = np.sqrt(x.astype(np.float64)).astype(np.float32)
    for fn in (legacy.sqrt_f32, legacy._sqrt_f32_by_float64):
        got = fn(torch.from_numpy(x)).numpy()
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), fn.__name__
    # the reason for both: torch's own float32 sqrt misses now and then
    assert not np.array_equal(torch.sqrt(torch.from_numpy(x)).numpy(), want)


def test_gguf_writer_accepts_output(tmp_path):
    """The arrays go straight into gguf-py's writer and read back unchanged."""
    g = torch.Generator().manual_seed(3)
    tensors = {qt: quantize(torch.randn(4, 256, generator=g), qt, qt.name) for qt in SUPPORTED_TYPES
               if qt not in iquants.REQUIRES_WEIGHTS}
    p = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(p, "llama")
    for qt, arr in tensors.items():
        w.add_tensor(f"t.{qt.name}", arr, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = gguf.GGUFReader(p)
    for t in r.tensors:
        qt = T[t.name[2:]]
        assert t.tensor_type == qt and [int(s) for s in t.shape] == [256, 4]
        assert np.asarray(t.data).tobytes() == tensors[qt].tobytes()


# ----------------------------------------------------------------------------- llama-quantize itself


@pytest.mark.llama_cpp
@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_llama_quantize_agrees(qtype, inputs, llama_cpp_bin, tmp_path):
    import subprocess

    src = tmp_path / "f32.gguf"
    w = gguf.GGUFWriter(src, "llama")
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(256)
    w.add_feed_forward_length(512)
    w.add_head_count(1)
    w.add_layer_norm_rms_eps(1e-5)
    cases = [c for c in CASES if (qtype, c) not in OVERFLOWS]
    for c in cases:
        w.add_tensor(f"blk.0.{c}.weight", inputs[c])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = tmp_path / "q.gguf"
    subprocess.run(
        [str(llama_cpp_bin / "llama-quantize"), "--pure", str(src), str(out), qtype.name, "2"],
        check=True, capture_output=True,
    )
    for t in gguf.GGUFReader(out).tensors:
        c = t.name[len("blk.0."):-len(".weight")]
        assert t.tensor_type == qtype
        ours = quantize(torch.from_numpy(inputs[c]), qtype, c)
        assert np.asarray(t.data).tobytes() == ours.tobytes(), f"{qtype.name}/{c}"


def test_mxfp4_dequantize_is_gguf_py_bit_for_bit():
    """MXFP4 is read, not written (a checkpoint's experts kept by the converter): every exponent byte (the two
    subnormal scales, 255's overflow to inf) and every code decode to gguf-py's float32 bits."""
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(4096, 17), dtype=np.uint8)
    raw[:256, 0] = np.arange(256)
    with np.errstate(over="ignore"):
        want = gguf.quants.dequantize(raw, T.MXFP4).reshape(4096, 32)
    got = kernels.dequantize(raw, T.MXFP4, (4096, 32)).numpy()
    assert np.isinf(want).any() and (want[:2] != 0).any()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    with pytest.raises(ValueError, match="no kernel"):
        kernels.quantize(torch.zeros(4, 32), T.MXFP4)
