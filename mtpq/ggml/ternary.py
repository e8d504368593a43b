"""TQ1_0 and TQ2_0: ``quantize_row_tq1_0_ref`` / ``quantize_row_tq2_0_ref`` (ggml has no weighted path for
them) and their dequantizers. Signatures as in :mod:`.legacy`."""

from __future__ import annotations

import numpy as np

from .jit import QK_K, F, get_fp16, kernel, put_fp16, roundf

_LONG_MAX_F = F(9.223372036854775807e18)


@kernel
def _trit(f):
    """``lroundf(f) + 1`` as its low byte (x86's conversion gives LONG_MIN for NaN or inf)."""
    if f > -_LONG_MAX_F and f < _LONG_MAX_F:
        return (np.int64(roundf(f)) + 1) & 0xFF
    return 1


@kernel
def _put_absmax_scale(x, xo, y, at):
    """The block's scale, its largest |x|, stored as fp16 at ``y[at]``; returns its inverse (0 for 0)."""
    amax = F(0.0)
    for j in range(QK_K):
        a = abs(x[xo + j])
        amax = amax if amax > a else a
    put_fp16(y, at, amax)
    return F(1.0) / amax if amax != 0 else F(0.0)


@kernel
def _pack5(x, xo, idv, width, y, at, trits):
    """Bytes of five trits each, ``width`` of them, from values ``xo + m + n*width`` (the last ``5 - trits`` 0)."""
    for m in range(width):
        q = 0
        for n in range(5):
            q = (q * 3 + (_trit(x[xo + m + n * width] * idv) if n < trits else 0)) & 0xFF
        y[at + m] = np.uint8((q * 256 + 242) // 243)


@kernel
def quantize_tq1_0(x, y, n_per_row):
    for i in range(x.size // QK_K):
        xo, o = QK_K * i, 54 * i
        idv = _put_absmax_scale(x, xo, y, o + 52)
        _pack5(x, xo, idv, 32, y, o, 5)
        _pack5(x, xo + 160, idv, 16, y, o + 32, 5)
        _pack5(x, xo + 240, idv, 4, y, o + 48, 4)


@kernel
def quantize_tq2_0(x, y, n_per_row):
    for i in range(x.size // QK_K):
        xo, o = QK_K * i, 66 * i
        idv = _put_absmax_scale(x, xo, y, o + 64)
        for j in range(0, 64, 32):
            for m in range(32):
                q = 0
                for n in range(4):
                    q += (_trit(x[xo + 4 * j + m + 32 * n] * idv) & 3) << (2 * n)
                y[o + j + m] = np.uint8(q & 0xFF)


@kernel
def _unpack5(y, at, width, d, x, xo, trits):
    for n in range(trits):
        for m in range(width):
            q = (np.int64(y[at + m]) * (3**n)) & 0xFF
            x[xo + n * width + m] = F(((q * 3) >> 8) - 1) * d


@kernel
def dequantize_tq1_0(y, x):
    for i in range(x.size // QK_K):
        o, xo = 54 * i, QK_K * i
        d = get_fp16(y, o + 52)
        _unpack5(y, o, 32, d, x, xo, 5)
        _unpack5(y, o + 32, 16, d, x, xo + 160, 5)
        _unpack5(y, o + 48, 4, d, x, xo + 240, 4)


@kernel
def dequantize_tq2_0(y, x):
    for i in range(x.size // QK_K):
        o, xo = 66 * i, QK_K * i
        d = get_fp16(y, o + 64)
        for j in range(0, 64, 32):
            for l in range(4):
                for m in range(32):
                    x[xo + 4 * j + 32 * l + m] = F(np.int64((y[o + j + m] >> (2 * l)) & 3) - 1) * d
