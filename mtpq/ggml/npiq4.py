"""IQ4_NL / IQ4_XS in numpy alone: the bytes of ``quantize_row_iq4_nl_impl`` (``ntry = 7``), without torch.

The numpy twin of :mod:`.iq4` (which keeps the torch code for other devices and runs this on CPU tensors), so
that ``mtpq quantize`` to these types never imports torch (see :mod:`.npkquants`). The weights ``W`` are x*x
without an importance matrix, else :mod:`.weighted`'s.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as T

from .cnumpy import GROUP_MAX_EPS, Dots, first_absmax, fp16_bits, nearest_int, rdiv, u8
KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# ggml's best_index_int8 picks kv[k] over kv[k+1] iff v - kv[k] < kv[k+1] - v.  Near the midpoint both
# differences are exact in float32, so this is v < (kv[k]+kv[k+1])/2 exactly; the midpoints are multiples of
# 0.5, hence the index only depends on floor(2v), and a 512-entry table over floor(2v) in [-256, 255] gives it.
_IQ4_SUMS = [KVALUES_IQ4NL[k] + KVALUES_IQ4NL[k + 1] for k in range(15)]
IQ4_LUT = [sum(1 for s2 in _IQ4_SUMS if s2 <= t) for t in range(-256, 256)]

_F32 = np.float32
_F0 = np.float32(0.0)
_INDEX = np.array(IQ4_LUT, dtype=np.uint8)  # best_index_int8 by floor(2v) + 256
_VALUE = np.array([KVALUES_IQ4NL[i] for i in IQ4_LUT], dtype=_F32)


def _slot(v: np.ndarray) -> np.ndarray:
    """Each value's row in the 512-entry tables (NaN: ggml's search ends on the top value)."""
    t = np.clip(np.floor(v * np.float32(2.0)), np.float32(-256.0), np.float32(255.0))
    np.nan_to_num(t, copy=False, nan=255.0)
    t += np.float32(256.0)
    return t.astype(np.intp)


def block_scales(X: np.ndarray, ntry: int, W: np.ndarray | None = None) -> np.ndarray:
    """Per 32-element block part of ``quantize_row_iq4_nl_impl`` for every column of ``X`` (32, n_blocks):
    the scale d of each block (the first-pass levels are not needed: ggml recomputes them when ntry > 0)."""
    ns = X.shape[1]
    with np.errstate(all="ignore"):  # zero blocks: inf/NaN as in C, their d zeroed at the end
        amax, mx = first_absmax(X, 0)
        zero = amax < GROUP_MAX_EPS
        if W is None:
            W = X * X
        d0 = np.divide(-mx, np.float32(-127.0))
        consts = [float(i - 127) for i in range(-ntry, ntry + 1)]
        ids = np.concatenate([rdiv(1.0, d0)[None], np.divide(np.array(consts, dtype=_F32)[:, None], mx[None])])
        sumqx, sumq2 = np.empty((2, len(ids), ns), dtype=_F32)
        Q = np.empty_like(X)
        for k in range(len(ids)):  # each candidate's levels, reduced to its two sums (C: w*q*x, w*q*q)
            np.take(_VALUE, _slot(np.multiply(ids[k][None], X, out=Q)), out=Q)
            Dots.dot3(W, Q, X, sumqx[k])
            Dots.dot3(W, Q, Q, sumq2[k])
        d = np.where(sumq2[0] > 0, np.divide(sumqx[0], sumq2[0]), _F0)
        best = d * sumqx[0]
        for k in range(1, len(ids)):
            sqx, sq2 = sumqx[k], sumq2[k]
            better = (sq2 > 0) & (sqx * sqx > best * sq2)
            nd = np.divide(sqx, sq2)
            d = np.where(better, nd, d)
            best = np.where(better, nd * sqx, best)
    return np.where(zero, _F0, d)


def _pack(L: np.ndarray) -> np.ndarray:
    """(nb, 32*k) indices -> (nb, 16*k): q[16i+j] = L[32i+j] | L[32i+16+j] << 4."""
    q = L.reshape(L.shape[0], -1, 2, 16)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(L.shape[0], -1)


def quantize_iq4_nl(x: np.ndarray, W: np.ndarray | None = None) -> np.ndarray:
    """``x`` (nb, 32); ``W``: the weights in the layout of ``x.T``, x*x when None."""
    d = block_scales(np.ascontiguousarray(x.T), 7, W)
    with np.errstate(all="ignore"):
        idv = np.where(d != 0, rdiv(1.0, d), _F0)
        L = _INDEX[_slot(idv[:, None] * x)]
    return np.concatenate([fp16_bits(d), _pack(L)], axis=1)


def quantize_iq4_xs(x: np.ndarray, W: np.ndarray | None = None) -> np.ndarray:
    """``x`` (nb, 256); ``W``: the weights in the layout of ``x``'s 32-value sub-blocks, element-major
    (:func:`.npkquants.sub_blocks`), x*x when None."""
    nb = x.shape[0]
    scales = block_scales(np.ascontiguousarray(x.reshape(-1, 32).T), 7, W)
    S = scales.reshape(nb, 8)
    with np.errstate(all="ignore"):
        max_scale = first_absmax(S, 1)[1]
        d = np.divide(-max_scale, np.float32(32.0))  # float d = -max_scale/32 (-0.0 for an all-zero super-block)
        idv = np.where(d != 0, rdiv(1.0, d), _F0)
        l = np.clip(nearest_int(idv[:, None] * S), -32, 31)
        dl = d[:, None] * l.astype(_F32)
        idl = np.where(dl != 0, rdiv(1.0, dl), _F0)
        L = _INDEX[_slot(np.repeat(idl, 32, axis=1) * x)]
    l += 32
    lo = l & 0xF
    scales_l = u8(lo[:, 0::2] | (lo[:, 1::2] << 4))
    sh = ((l >> 4) << (2 * np.arange(8, dtype=np.int32))).sum(axis=1)
    scales_h = u8(np.stack([sh, sh >> 8], axis=1))
    return np.concatenate([fp16_bits(d), scales_h, scales_l, _pack(L)], axis=1)


KERNELS: dict[T, Callable[[np.ndarray], np.ndarray]] = {T.IQ4_NL: quantize_iq4_nl, T.IQ4_XS: quantize_iq4_xs}
CHUNK: dict[T, int] = {T.IQ4_NL: 1 << 16, T.IQ4_XS: 1 << 16}  # values per chunk, as the torch kernels take
