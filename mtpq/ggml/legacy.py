"""Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the 1-/2-bit Q1_0, Q2_0: ``quantize_row_*_ref``, the importance-weighted
``quantize_row_*_impl`` and ``dequantize_row_*`` of ``ggml-quants.c``, loop for loop.

Every quantizer takes ``(x, y, n_per_row)`` -- float32 rows laid end to end, their uint8 blocks -- and the
weighted ones ``(x, y, n_per_row, qw)`` with one importance weight per column; dequantizers ``(y, x)``.
"""

from __future__ import annotations

import numpy as np

from .jit import (
    F,
    bind,
    block_absmax,
    block_min_max,
    c_int,
    get_fp16,
    get_u32,
    i8,
    inline,
    kernel,
    put_fp16,
    put_u32,
    roundf,
)
from .kquants import QKX_TMP, QX_TMP, make_qkx_quants, make_qx_quants, sum_x2

_FLT_MAX = F(3.4028234663852886e38)


@kernel
def _min_max(x, at):
    mn, mx = _FLT_MAX, -_FLT_MAX
    for j in range(32):
        v = x[at + j]
        if v < mn:
            mn = v
        if v > mx:
            mx = v
    return mn, mx


@kernel
def _put_levels(y, o, L, five):
    """Levels (32) into nibbles at ``o`` (and their fifth bits as the uint32 qh before them, Q5)."""
    qs = o + 4 if five else o
    qh = 0
    for j in range(16):
        xi0 = L[j] & 0xFF
        xi1 = L[j + 16] & 0xFF
        y[qs + j] = np.uint8((xi0 & 0x0F) | ((xi1 & 0x0F) << 4))
        qh |= ((xi0 & 0x10) >> 4) << j
        qh |= ((xi1 & 0x10) >> 4) << (j + 16)
    if five:
        put_u32(y, o, qh)


@inline
def _level(v, top, clamp):
    """C's ``MIN(top, (int8_t)v)`` (``clamp``) or ``(uint8_t)v`` for a ``v`` known to be in [0, 64) or NaN: a
    NaN is x86's INT_MIN, whose low byte is 0. A select and a plain conversion, which LLVM vectorizes."""
    v = v if v >= F(0.0) else F(0.0)
    level = np.int32(v)
    return min(np.int32(top), level) if clamp else level & np.int32(0xFF)


@inline
def _put_block(y, o, x, at, idv, mn, offset, top, clamp, five):
    """:func:`_put_levels` of the levels of ``(x - mn) * idv + offset``, computed in place (the fast path)."""
    qs = o + 4 if five else o
    qh = np.uint32(0)
    for j in range(16):
        a = _level((x[at + j] - mn) * idv + offset, top, clamp)
        b = _level((x[at + 16 + j] - mn) * idv + offset, top, clamp)
        y[qs + j] = np.uint8((a & 0x0F) | ((b & 0x0F) << 4))
        if five:
            qh |= np.uint32((a & 0x10) >> 4) << np.uint32(j)
            qh |= np.uint32((b & 0x10) >> 4) << np.uint32(j + 16)
    if five:
        put_u32(y, o, qh)


def _ref(ts, top, nmax=0):
    """quantize_row_q4_0_ref / q5_0_ref (``nmax`` 8 / 16: d = max / -nmax, levels ``MIN(top, x * id + nmax +
    0.5)``) and q4_1_ref / q5_1_ref (no nmax: d = (max - min) / top and the min stored; Q5_1 without MIN): a
    kernel per type, its sizes compile-time constants (the inner loops lose their branches)."""
    five, signed = top == 31, nmax > 0
    clamp = signed or not five

    @kernel
    def quantize(x, y, n_per_row):
        L = np.empty(32, np.int64)
        for i in range(x.size // 32):
            if signed:  # x - 0 is x: C's x * id + offset
                mn, offset = F(0.0), F(nmax) + F(0.5)
                d = block_absmax(x, 32 * i)[1] / F(-nmax)
            else:
                (mn, mx), offset = block_min_max(x, 32 * i), F(0.5)
                if mn == 0 or mx == 0:  # which zero C's loop kept: its own order decides
                    mn, mx = _min_max(x, 32 * i)
                d = (mx - mn) / F(top)
            idv = F(1.0) / d if d != 0 else F(0.0)
            put_fp16(y, ts * i, d)
            if not signed:
                put_fp16(y, ts * i + 2, mn)
            at = ts * i + (2 if signed else 4)
            if abs(d) < np.inf and abs(idv) < np.inf:  # (x - mn) * idv in [0, 2 nmax or top] (+ ulps), x finite
                _put_block(y, at, x, 32 * i, idv, mn, offset, top, clamp, five)
                continue
            for j in range(32):  # an infinite range or 1 / d: +-inf and NaN levels, C's conversions one by one
                v = c_int((x[32 * i + j] - mn) * idv + offset)
                L[j] = min(top, i8(v)) if clamp else v & 0xFF
            _put_levels(y, at, L, five)

    return quantize


quantize_q4_0 = _ref(18, 15, nmax=8)
quantize_q5_0 = _ref(22, 31, nmax=16)
quantize_q4_1 = _ref(20, 15)
quantize_q5_1 = _ref(24, 31)


@kernel
def quantize_q8_0(x, y, n_per_row):
    for i in range(x.size // 32):
        amax = F(0.0)
        for j in range(32):
            a = abs(x[32 * i + j])
            amax = amax if amax > a else a
        d = amax / F(127.0)
        idv = F(1.0) / d if d != 0 else F(0.0)
        put_fp16(y, 34 * i, d)
        for j in range(32):
            y[34 * i + 2 + j] = np.uint8(c_int(roundf(x[32 * i + j] * idv)) & 0xFF)


def _impl(ts, nmax, with_min):
    """quantize_row_q4_0_impl / q5_0_impl (make_qx_quants) and q4_1_impl / q5_1_impl (make_qkx_quants, a min
    stored), row by row, per type as :func:`_ref`."""
    five = nmax == (31 if with_min else 16)

    @kernel
    def quantize(x, y, n, qw):
        weight = np.empty(32, np.float32)
        L = np.empty(32, np.int64)
        tmp = np.empty(QKX_TMP if with_min else QX_TMP, np.float32)
        nb = n // 32
        for r in range(x.size // n):
            sigma2 = sum_x2(x, r * n, n) / F(n)
            for ib in range(nb):
                at, o = r * n + 32 * ib, ts * (r * nb + ib)
                for j in range(32):
                    weight[j] = qw[32 * ib + j] * np.sqrt(sigma2 + x[at + j] * x[at + j])
                xb = x[at : at + 32]
                if with_min:
                    d, mn = make_qkx_quants(32, nmax, xb, weight, L, F(-0.9), F(0.05), 36, False, tmp)
                    put_fp16(y, o + 2, -mn)
                else:
                    d = make_qx_quants(32, nmax, xb, L, 1, weight, tmp)
                put_fp16(y, o, d)
                _put_levels(y, o + (4 if with_min else 2), L, five)

    return quantize


quantize_q4_0_weighted = _impl(18, 8, False)
quantize_q5_0_weighted = _impl(22, 16, False)
quantize_q4_1_weighted = _impl(20, 15, True)
quantize_q5_1_weighted = _impl(24, 31, True)


@kernel
def quantize_q1_0(x, y, n_per_row):
    for i in range(x.size // 128):
        sum_abs = F(0.0)
        for j in range(128):
            sum_abs += abs(x[128 * i + j])
        put_fp16(y, 18 * i, sum_abs / F(128.0))
        for k in range(16):  # bit j % 8 of byte j // 8: x[j] >= 0 (so not for a NaN)
            b = np.uint8(0)
            for bit in range(8):
                b |= np.uint8(x[128 * i + 8 * k + bit] >= F(0.0)) << np.uint8(bit)
            y[18 * i + 2 + k] = b


@inline
def _q2_level(v):
    """``MIN(3, MAX(0, (int)roundf(v) + 1))`` for |v| < 1.5 or NaN: roundf is -1 from -0.5 down, 1 from 0.5
    up; a NaN is x86's INT_MIN + 1, clamped to 0."""
    return np.uint8(1) + np.uint8(v >= F(0.5)) - np.uint8(v <= F(-0.5)) - np.uint8(v != v)


@kernel
def quantize_q2_0(x, y, n_per_row):
    for i in range(x.size // 64):
        d = max(block_absmax(x, 64 * i)[0], block_absmax(x, 64 * i + 32)[0])  # NaN skipped, as C's ``a > amax``
        idv = F(1.0) / d if d > F(0.0) else F(0.0)
        put_fp16(y, 18 * i, d)
        if idv < np.inf:  # |x * idv| <= amax * (1 / amax) < 1.5 for every finite x
            for k in range(16):
                o = 64 * i + 4 * k
                y[18 * i + 2 + k] = (
                    _q2_level(x[o] * idv)
                    | (_q2_level(x[o + 1] * idv) << np.uint8(2))
                    | (_q2_level(x[o + 2] * idv) << np.uint8(4))
                    | (_q2_level(x[o + 3] * idv) << np.uint8(6))
                )
        else:  # amax below 2^-128: 1 / amax is inf, so x * idv is +-inf or NaN
            y[18 * i + 2 : 18 * i + 18] = 0
            for j in range(64):
                q = min(3, max(0, c_int(roundf(x[64 * i + j] * idv)) + 1))
                y[18 * i + 2 + j // 4] |= np.uint8(q << ((j % 4) * 2))


# --------------------------------------------------------------------------- dequantizers


@kernel
def dequantize_nibbles(y, x, values):
    """Blocks of 32 values in 18 bytes: an fp16 scale d, then byte j holding value j's index into ``values``
    in its low nibble and value j + 16's in its high one; value = d * values[index] (Q4_0, IQ4_NL)."""
    for i in range(x.size // 32):
        d = get_fp16(y, 18 * i)
        for j in range(16):
            b = y[18 * i + 2 + j]
            x[32 * i + j] = d * F(values[b & 0x0F])
            x[32 * i + j + 16] = d * F(values[b >> 4])


dequantize_q4_0 = bind(dequantize_nibbles, np.arange(-8, 8, dtype=np.int8))


def _dequantize(ts, five, with_min):
    """dequantize_row_q4_1 (a min), q5_0 (fifth bits in qh, levels - 16) and q5_1 (both), per type."""

    @kernel
    def dequantize(y, x):
        for i in range(x.size // 32):
            d = get_fp16(y, ts * i)
            m = get_fp16(y, ts * i + 2) if with_min else F(0.0)
            at = ts * i + (4 if with_min else 2)
            qh = get_u32(y, at) if five else np.uint32(0)
            qs = at + 4 if five else at
            for j in range(16):
                b = y[qs + j]
                lo = np.int64((b & 0x0F) | (((qh >> j) << 4) & 0x10))
                hi = np.int64((b >> 4) | ((qh >> (j + 12)) & 0x10))
                if with_min:
                    x[32 * i + j] = F(lo) * d + m
                    x[32 * i + j + 16] = F(hi) * d + m
                else:
                    x[32 * i + j] = F(lo - 16) * d
                    x[32 * i + j + 16] = F(hi - 16) * d

    return dequantize


dequantize_q4_1 = _dequantize(20, False, True)
dequantize_q5_0 = _dequantize(22, True, False)
dequantize_q5_1 = _dequantize(24, True, True)


@kernel
def dequantize_q8_0(y, x):
    for i in range(x.size // 32):
        d = get_fp16(y, 34 * i)
        for j in range(32):
            x[32 * i + j] = F(i8(np.int64(y[34 * i + 2 + j]))) * d


@kernel
def dequantize_q1_0(y, x):
    for i in range(x.size // 128):
        d = get_fp16(y, 18 * i)
        for j in range(128):
            x[128 * i + j] = d if (y[18 * i + 2 + j // 8] >> (j % 8)) & 1 else -d


@kernel
def dequantize_q2_0(y, x):
    for i in range(x.size // 64):
        d = get_fp16(y, 18 * i)
        for j in range(64):
            q = (y[18 * i + 2 + j // 4] >> ((j % 4) * 2)) & 3
            x[64 * i + j] = F(np.int64(q) - 1) * d
