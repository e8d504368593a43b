"""The legacy types' vector block scans (jit.block_min_max, jit.block_absmax) against C's one-value-at-a-time
loops as legacy._min_max and jit.absmax write them (those two are checked against ggml's bytes by the goldens,
and the kernels that use the scans by tests/ggml/test_llama_cpp.py's edge values against ggml itself)."""

from __future__ import annotations

import numpy as np
from numba import njit

from mtpq.ggml.jit import absmax, block_absmax, block_min_max
from mtpq.ggml.legacy import _min_max


@njit(cache=False)
def _scans(x):
    out = np.empty((x.size // 32, 4), np.float32)
    for i in range(x.size // 32):
        out[i, 0], out[i, 1] = block_min_max(x, 32 * i)
        out[i, 2], out[i, 3] = block_absmax(x, 32 * i)
    return out


@njit(cache=False)
def _c_loops(x):
    out = np.empty((x.size // 32, 4), np.float32)
    for i in range(x.size // 32):
        out[i, 0], out[i, 1] = _min_max(x, 32 * i)
        out[i, 2], out[i, 3] = absmax(x, 32 * i, 32)
    return out


def _blocks(n: int = 20000) -> np.ndarray:
    """Blocks of specials (NaN, +-inf, +-0, FLT_MAX, the smallest subnormals, ties of +-c), some with gaussian
    values among them; plain gaussian blocks; blocks whose min or max is a zero of either sign."""
    rng = np.random.default_rng(5)
    special = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1.0, -1.0, 3.4028235e38, -3.4028235e38, 1e-45, -1e-45])
    x = rng.choice(special, (n, 32))
    mixed = rng.random((n, 32)) < rng.random((n, 1))
    x[mixed] = rng.standard_normal(int(mixed.sum())) * rng.choice([1e-3, 1.0], int(mixed.sum()))
    x[: n // 10] = rng.standard_normal((n // 10, 32))
    x[n // 10 : n // 5] = rng.choice(np.array([0.0, -0.0, 1.0, 2.5]), (n // 10, 32))  # a zero is the min ...
    x[n // 5 : 3 * n // 10] = -rng.choice(np.array([0.0, -0.0, 1.0, 2.5]), (n // 10, 32))  # ... or the max
    return x.astype(np.float32).reshape(-1)


def test_block_scans_are_c_loops_but_for_the_sign_of_a_zero_min_or_max():
    x = _blocks()
    got, want = _scans(x), _c_loops(x)
    same = got.view(np.uint32) == want.view(np.uint32)
    # absmax: the same largest |x| and the same first value that has it, bit for bit, NaN and zeros included
    assert same[:, 2:].all(), np.flatnonzero(~same[:, 2:].all(1))[:5]
    # min and max: the same values; only where one is a zero may the sign differ (the kernels then ask C's loop)
    zero = (want[:, :2] == 0) & (got[:, :2] == 0)
    assert (same[:, :2] | zero).all(), np.flatnonzero(~(same[:, :2] | zero).all(1))[:5]
    assert (~same[:, :2]).any()  # the blocks include such zeros: the kernels' fallback is needed, not idle
