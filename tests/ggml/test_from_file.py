"""Quantizing a float tensor where it lies in a file (mtpq/ggml/from_file.py): the pool's workers read their own
chunks. The truth is the single-process kernel (itself checked against llama.cpp's bytes in
test_quant_kernels): the bytes must be exactly its bytes for every source dtype, band layout and importance
weighting, and bad input must fail as the kernel fails, naming the tensor.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from mtpq.ggml import from_file, kernels, npquant, pool

pytestmark = pytest.mark.skipif(not pool.available(), reason="forked workers are Linux-only")

HEADER = 96  # bytes before the tensor in the test file, as a GGUF's metadata would be
STORED = {T.F32: (torch.float32, np.float32), T.BF16: (torch.bfloat16, np.uint16), T.F16: (torch.float16, np.float16)}


def stored_file(tmp_path, values: torch.Tensor, source: T):
    """``values`` rounded to ``source``, written after HEADER bytes of junk; (path, the rounded values)."""
    torch_dtype, np_dtype = STORED[source]
    v = values.to(torch_dtype).contiguous()
    raw = v.view(torch.int16).numpy().view(np.uint16) if source == T.BF16 else v.numpy()
    path = tmp_path / f"t-{source.name}.bin"
    path.write_bytes(b"\xa5" * HEADER + raw.astype(np_dtype).tobytes())
    return path, v


def one_process(values: torch.Tensor, qtype: T, **kw) -> np.ndarray:
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return kernels.quantize(values, qtype, "w", **kw).reshape(-1)
    finally:
        torch.set_num_threads(saved)


@contextlib.contextmanager
def pool_of(workers: int = 2):
    """A writer's pool scope with ``workers`` workers; the worker count and torch's threads restored after."""
    saved, threads = npquant._workers["n"], torch.get_num_threads()
    npquant.set_workers(workers)
    try:
        with pool.scope():
            yield
    finally:
        from_file.discard()
        npquant._workers["n"] = saved
        torch.set_num_threads(threads)


def stored(path, source: T, shape, qtype: T, workers: int = 2, **kw) -> np.ndarray | None:
    reports: list[int] = []
    with pool_of(workers):
        # kernels' entry: the K- and i-quants' weights checked and tables built there; the rest forwarded
        out = kernels.quantize_stored(path, HEADER, source, tuple(shape), qtype, "blk.0.w",
                                      lambda n: (np.full(n, 0xEE, dtype=np.uint8), reports.append), **kw)
    if out is not None:
        assert reports and reports == sorted(reports) and reports[-1] == out.nbytes  # progress up to the end
    return out


@pytest.fixture(params=["one band", "bands"])
def small_arenas(request, monkeypatch):
    """The real output arena (the tensor in one band), or one of a few rows (several bands)."""
    if request.param == "bands":
        monkeypatch.setattr(pool, "OUT_BYTES", 16 * 1024)


@pytest.mark.parametrize("source", [T.F32, T.BF16, T.F16])
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q5_0, T.Q6_K, T.Q4_K, T.IQ4_XS])
def test_bytes_equal_one_process(tmp_path, qtype, source, small_arenas):
    g = torch.Generator().manual_seed(int(qtype) * 3 + int(source))
    values = torch.randn(48, 1024, generator=g) * torch.rand(48, 1, generator=g) * 4
    values[3, :32] = 0.0  # an all-zero block
    path, rounded = stored_file(tmp_path, values, source)
    got = stored(path, source, values.shape, qtype)
    assert got is not None
    assert np.array_equal(got, one_process(rounded, qtype))


def test_rows_longer_than_a_chunk_are_cut_into_pieces(tmp_path, monkeypatch):
    """A row of more values than a chunk is quantized in parts of one row (each contiguous in the file)."""
    monkeypatch.setattr(npquant, "CHUNK", 1024)
    values = torch.randn(3, 8192, generator=torch.Generator().manual_seed(5))
    path, rounded = stored_file(tmp_path, values, T.F32)
    assert np.array_equal(stored(path, T.F32, values.shape, T.Q8_0), one_process(rounded, T.Q8_0))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.IQ4_XS])
def test_importance_weights_per_column_and_per_expert(tmp_path, qtype, small_arenas):
    g = torch.Generator().manual_seed(11)
    experts = torch.randn(3, 8, 512, generator=g)
    path, rounded = stored_file(tmp_path, experts, T.F32)
    per_expert = torch.rand(3, 512, generator=g) + 0.1
    got = stored(path, T.F32, experts.shape, qtype, importance=per_expert.numpy())
    assert np.array_equal(got, one_process(rounded, qtype, importance=per_expert))
    column = per_expert[1]
    got = stored(path, T.F32, experts.shape, qtype, importance=column.numpy())
    assert np.array_equal(got, one_process(rounded, qtype, importance=column))


def test_nan_names_the_tensor_and_the_pool_stays_usable(tmp_path):
    values = torch.randn(16, 512, generator=torch.Generator().manual_seed(2))
    values[9, 100] = float("nan")
    path, _ = stored_file(tmp_path, values, T.F32)
    for qtype in (T.Q8_0, T.Q6_K):
        with pytest.raises(ValueError, match=r"^blk\.0\.w: contains NaN/Inf values$"):
            stored(path, T.F32, values.shape, qtype)
    values[9, 100] = 1.0
    path, rounded = stored_file(tmp_path, values, T.F32)
    assert np.array_equal(stored(path, T.F32, values.shape, T.Q6_K), one_process(rounded, T.Q6_K))


@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q4_K, T.Q6_K, T.IQ4_XS, T.Q5_1])
def test_a_scale_overflowing_fp16_is_refused_as_the_kernel_does(tmp_path, qtype):
    """numpy's workers check the fp16 scales as kernels does: a super-block of huge values is refused, naming
    the tensor (llama-quantize refuses such data too)."""
    values = torch.randn(8, 512, generator=torch.Generator().manual_seed(5))
    values[6, 256:512] *= 1e9
    path, rounded = stored_file(tmp_path, values, T.F32)
    with pytest.raises(ValueError, match=rf"^w: values too large for {qtype.name}"):
        one_process(rounded, qtype)
    with pool_of(2), pytest.raises(ValueError, match=rf"^blk\.0\.w: values too large for {qtype.name}"):
        from_file.quantize_stored(path, HEADER, T.F32, (8, 512), qtype, "blk.0.w",
                                  lambda n: (np.full(n, 0xEE, dtype=np.uint8), None))


def test_a_file_that_ends_inside_the_tensor_is_refused(tmp_path):
    values = torch.randn(16, 512, generator=torch.Generator().manual_seed(3))
    path, _ = stored_file(tmp_path, values, T.F32)
    with open(path, "r+b") as f:
        f.truncate(HEADER + 15 * 512 * 4 + 100)
    with pytest.raises(ValueError, match=r"^blk\.0\.w: the file ends within this tensor's data"):
        stored(path, T.F32, values.shape, T.Q8_0)


def test_i_quants_without_importance_fail_as_the_kernel_does(tmp_path):
    values = torch.randn(4, 256, generator=torch.Generator().manual_seed(4))
    path, _ = stored_file(tmp_path, values, T.F32)
    with pytest.raises(ValueError, match=r"^blk\.0\.w: IQ2_XXS needs an importance matrix"):
        stored(path, T.F32, values.shape, T.IQ2_XXS)


@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS, T.Q4_1, T.Q5_1])
def test_k_quants_without_kernels(tmp_path, qtype):
    """The K-quants, IQ4 and Q4_1/Q5_1 without importance weights: from_file takes them itself (numpy's kernels in the workers, no
    torch needed), with the bytes of the one-process kernel."""
    g = torch.Generator().manual_seed(int(qtype))
    values = torch.randn(24, 1024, generator=g) * torch.rand(24, 1, generator=g) * 4
    values[5, 256:512] = 0.0  # an all-zero super-block
    path, v = stored_file(tmp_path, values, T.BF16)
    with pool_of(2):
        out = from_file.quantize_stored(path, HEADER, T.BF16, (24, 1024), qtype, "blk.0.w",
                                        lambda n: (np.full(n, 0xEE, dtype=np.uint8), None))
    assert out is not None and np.array_equal(out, one_process(v.float(), qtype))


def test_left_to_the_in_process_path(tmp_path):
    """None, nothing done: one worker, no pool scope, Q4_0 with importance weights (the row mean square comes
    first), a float output type, a K-quant with importance weights not passed through kernels (unchecked)."""
    values = torch.randn(4, 256, generator=torch.Generator().manual_seed(6))
    path, _ = stored_file(tmp_path, values, T.F32)
    assert stored(path, T.F32, values.shape, T.Q8_0, workers=1) is None
    assert stored(path, T.F32, values.shape, T.Q4_0, importance=np.ones(256, dtype=np.float32)) is None
    assert stored(path, T.F32, values.shape, T.F16) is None
    saved, threads = npquant._workers["n"], torch.get_num_threads()
    npquant.set_workers(2)
    try:
        assert from_file.quantize_stored(path, HEADER, T.F32, (4, 256), T.Q8_0, "w", lambda n: 1 / 0) is None
        with pool.scope():
            assert from_file.quantize_stored(path, HEADER, T.F32, (4, 256), T.Q6_K, "w", lambda n: 1 / 0,
                                             importance=np.ones(256, dtype=np.float32)) is None
    finally:
        npquant._workers["n"] = saved
        torch.set_num_threads(threads)


# --------------------------------------------------------------------------- a tensor's last band left running

def _two_tensors(tmp_path, a: torch.Tensor, b: torch.Tensor):
    """Two float32 tensors one after the other after HEADER bytes: (path, offset of a, offset of b)."""
    path = tmp_path / "two.bin"
    path.write_bytes(b"\xa5" * HEADER + a.numpy().tobytes() + b.numpy().tobytes())
    return path, HEADER, HEADER + a.numel() * 4


def _in_scope(calls):
    """Run ``calls`` (functions of a buffer factory) in one pool scope with two workers; their results."""
    with pool_of(2):
        return [call(lambda n: (np.full(n, 0xEE, dtype=np.uint8), None)) for call in calls]


@pytest.mark.parametrize("first_type, second_type", [(T.Q6_K, T.Q8_0), (T.Q8_0, T.Q4_K), (T.Q4_0, T.Q4_0)])
def test_a_band_left_running_is_collected_by_the_next_tensor(tmp_path, first_type, second_type, small_arenas):
    """``defer`` leaves a tensor's last band running; the next tensor hands its own first band out, then
    collects it (settle) and runs what waited for it (after_settle): both come out whole, in either slot."""
    g = torch.Generator().manual_seed(21)
    a, b = torch.randn(40, 1024, generator=g), torch.randn(24, 512, generator=g) * 3
    path, at_a, at_b = _two_tensors(tmp_path, a, b)
    seen = []

    def first(buf):
        out = kernels.quantize_stored(path, at_a, T.F32, tuple(a.shape), first_type, "blk.0.a", buf, defer=True)
        assert from_file._deferred["band"] is not None
        assert from_file.after_settle(lambda: seen.append(out.copy()))
        return out

    def second(buf):
        out = kernels.quantize_stored(path, at_b, T.F32, tuple(b.shape), second_type, "blk.0.b", buf)
        assert from_file._deferred["band"] is None and len(seen) == 1  # collected once the next band was out
        assert not from_file.after_settle(lambda: None)
        return out

    got_a, got_b = _in_scope([first, second])
    assert np.array_equal(seen[0], one_process(a, first_type)) and np.array_equal(got_a, seen[0])
    assert np.array_equal(got_b, one_process(b, second_type))


def test_a_band_left_running_is_collected_before_the_pool_is_forked_again(tmp_path):
    """An i-quant's tables built after the band was handed out make a new pool: the band is collected first."""
    g = torch.Generator().manual_seed(22)
    a, b = torch.randn(16, 1024, generator=g), torch.randn(8, 512, generator=g)
    path, at_a, at_b = _two_tensors(tmp_path, a, b)
    column = torch.rand(512, generator=g) + 0.1
    got_a, got_b = _in_scope([
        lambda buf: kernels.quantize_stored(path, at_a, T.F32, tuple(a.shape), T.Q6_K, "a", buf, defer=True),
        lambda buf: kernels.quantize_stored(path, at_b, T.F32, tuple(b.shape), T.IQ2_XXS, "b", buf,
                                            importance=column.numpy()),
    ])
    assert np.array_equal(got_a, one_process(a, T.Q6_K))
    assert np.array_equal(got_b, one_process(b, T.IQ2_XXS, importance=column))


def test_an_error_in_a_band_left_running_names_its_tensor_and_source(tmp_path):
    """Its NaN surfaces when the next tensor collects it: as a DeferredError with the first tensor's name and the
    source its caller gave it (label_deferred), not the tensor being encoded; the pool stays usable."""
    g = torch.Generator().manual_seed(23)
    a, b = torch.randn(16, 512, generator=g), torch.randn(8, 512, generator=g)
    a[11, 300] = float("nan")
    path, at_a, at_b = _two_tensors(tmp_path, a, b)

    def first(buf):
        out = kernels.quantize_stored(path, at_a, T.F32, tuple(a.shape), T.Q8_0, "blk.0.a", buf, defer=True)
        from_file.label_deferred("model.gguf:blk.0.a")
        return out

    def second(buf):
        with pytest.raises(from_file.DeferredError, match=r"^blk\.0\.a: contains NaN/Inf values$") as err:
            kernels.quantize_stored(path, at_b, T.F32, tuple(b.shape), T.Q8_0, "blk.0.b", buf)
        assert err.value.source == "model.gguf:blk.0.a"
        return kernels.quantize_stored(path, at_b, T.F32, tuple(b.shape), T.Q8_0, "blk.0.b", buf)

    assert np.array_equal(_in_scope([first, second])[1], one_process(b, T.Q8_0))
