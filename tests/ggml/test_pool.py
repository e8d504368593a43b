"""The writer's worker pool (mtpq/ggml/pool.py): forked once per file, the same bytes as one process.

The truth is the single-process kernel (itself checked against llama.cpp's bytes in test_quant_kernels);
here the pool must give exactly its bytes, whatever the input dtype, the bands the arenas force and the
importance weights, raise bad input as the kernel does, and never leave a worker behind.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from mtpq.ggml import kernels, pool

pytestmark = pytest.mark.skipif(not pool.available(), reason="forked workers are Linux-only")


def quantize_with(workers: int, x: torch.Tensor, qtype: T, **kw) -> np.ndarray:
    saved = torch.get_num_threads()
    torch.set_num_threads(workers)
    try:
        return kernels.quantize(x, qtype, "w", **kw)
    finally:
        torch.set_num_threads(saved)


def one_process(x: torch.Tensor, qtype: T, **kw) -> np.ndarray:
    return quantize_with(1, x, qtype, **kw)


def in_pool(x: torch.Tensor, qtype: T, **kw) -> np.ndarray:
    return quantize_with(2, x, qtype, **kw)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture(params=["one band", "bands"])
def small_arenas(request, monkeypatch):
    """The real arenas (the tensor in one band, several chunks), or arenas of a few rows (several bands)."""
    if request.param == "bands":
        monkeypatch.setattr(pool, "IN_BYTES", 64 * 1024)
        monkeypatch.setattr(pool, "OUT_BYTES", 64 * 1024)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("qtype", [T.Q6_K, T.Q4_K, T.Q3_K, T.IQ4_XS])
def test_pool_bytes_equal_one_process(qtype, dtype, small_arenas):
    g = torch.Generator().manual_seed(int(qtype) * 7 + dtype.itemsize)
    x = (torch.randn(640, 512, generator=g) * 0.02).to(dtype)  # more than one chunk of every type
    want = one_process(x, qtype)
    with pool.scope():
        got = in_pool(x, qtype)
        used = pool._state["pool"]
        assert used is not None and used.alive, "the pool was not used"
        pids = list(used.pids)
    assert np.array_equal(got, want)
    assert pids and all(gone(p) for p in pids), "a worker outlived its scope"


def test_pool_importance_and_experts_equal_one_process(small_arenas):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 1100, 256, generator=g) * 0.02  # an expert stack: one importance row per expert
    imp = torch.rand(4, 256, generator=g) + 0.1
    want = one_process(x, T.Q4_K, importance=imp)
    with pool.scope():
        got = in_pool(x, T.Q4_K, importance=imp)
    assert np.array_equal(got, want)


def test_pool_survives_bad_input_and_names_the_tensor():
    x = torch.randn(640, 512) * 0.02
    bad = x.clone()
    bad[537, 100] = float("nan")
    with pool.scope():
        with pytest.raises(ValueError, match=r"^w: contains NaN/Inf values$"):
            in_pool(bad, T.Q6_K)
        first = pool._state["pool"]
        assert first is not None and first.alive
        assert np.array_equal(in_pool(x, T.Q6_K), one_process(x, T.Q6_K))
        assert pool._state["pool"] is first, "bad input should not cost the pool"


def _exit_on_task_3(task, arena_in, arena_out, arena_aux):
    if task[1] == 3:
        os._exit(9)


def _slow(task, arena_in, arena_out, arena_aux):
    time.sleep(5)


def test_a_worker_that_dies_is_an_error_not_a_hang():
    p = pool.Pool(2, _exit_on_task_3)
    try:
        t0 = time.monotonic()
        with pytest.raises(pool.WorkerDied):
            p.run([(0, k, 0, 0, 0, 0, 0, 0) for k in range(8)])
        assert time.monotonic() - t0 < 10
        assert not p.alive and not p.pids
    finally:
        p.close(kill=True)


def test_an_interrupt_stops_the_workers():
    p = pool.Pool(2, _slow)
    pids = list(p.pids)

    def interrupt(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    try:
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            p.run([(0, k, 0, 0, 0, 0, 0, 0) for k in range(4)])
        assert time.monotonic() - t0 < 3, "the parent waited for the busy workers"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        p.close(kill=True)
    assert all(gone(pid) for pid in pids)


def test_a_pool_made_by_a_thread_that_ended_is_made_again():
    """Workers die with the thread that forked them (PR_SET_PDEATHSIG): the next call must not find them gone."""
    import threading

    x = torch.randn(640, 512) * 0.02
    want = one_process(x, T.Q6_K)
    with pool.scope():
        t = threading.Thread(target=in_pool, args=(x, T.Q6_K))
        t.start()
        t.join()
        first = pool._state["pool"]
        assert first is not None
        assert np.array_equal(in_pool(x, T.Q6_K), want)
        assert pool._state["pool"] is not first


def test_no_pool_outside_a_scope():
    assert pool.get(2, _slow) is None
