"""IQ4_NL and IQ4_XS: ``quantize_row_iq4_nl_impl`` (``ntry = 7``, with or without importance weights, as
``quantize_iq4_nl`` / ``quantize_iq4_xs`` call it) and the dequantizers of ``ggml-quants.c``. Signatures as
in :mod:`.legacy`; both quantizers take the weights (empty: none)."""

from __future__ import annotations

import numpy as np

from .jit import GROUP_MAX_EPS, QK_K, F, absmax, bind, fp16, get_fp16, inline, kernel, nearest_int
from .kquants import sum_x2
from .legacy import dequantize_nibbles

KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
_NO_WEIGHTS = np.empty(0, np.float32)
_KV = KVALUES_IQ4NL.astype(np.float32)


# _MU[floor(x) + 128] is 1 + the number of inner values (val[1..14]) not above x: the values are integers, so
# x >= val[k] exactly when floor(x) >= val[k]
_MU = np.array([1 + int(np.sum(KVALUES_IQ4NL[1:15] <= k)) for k in range(-128, 128)], np.int64)


@inline
def best_index_int8(x):
    """``best_index_int8(16, kvalues_iq4nl, x)``: the index of the table value nearest ``x`` (ties to the lower
    one). C's binary search ends at the mu with ``val[mu-1] <= x < val[mu]`` (1 below ``val[1]``, 15 from
    ``val[14]`` on or for NaN), found here in one look-up by ``floor(x)`` instead of branches the data decide at
    random; the first/last answers come out of the same final test."""
    if not x < F(127.0):  # NaN too
        mu = 15
    else:  # below -128 (-inf too): the table's first entry
        mu = _MU[np.int64(np.floor(max(x, F(-128.0)))) + 128]
    return mu - 1 if x - _KV[mu - 1] < _KV[mu] - x else mu


@inline
def _iq4_impl(super_size, x, xo, y, o, xs, scales, weight, L, Lt, qw, qo, ntry):
    """``quantize_row_iq4_nl_impl(super_size, 32, ...)`` for the super-block at ``x[xo]``, into the block at
    ``y[o]`` (IQ4_NL: d, qs; IQ4_XS: d, scales_h, scales_l, qs)."""
    weighted = qw.size > 0
    sigma2 = sum_x2(x, xo, super_size) * (F(2.0) / F(super_size))
    q4 = o + 8 if xs else o + 2
    for j in range(super_size // 2):
        y[q4 + j] = 0
    h = fp16(F(0.0))
    max_scale = F(0.0)
    amax_scale = F(0.0)
    v0 = _KV[0]
    for ib in range(super_size // 32):
        xb = xo + 32 * ib
        for j in range(32):
            if weighted:
                weight[j] = qw[qo + 32 * ib + j] * np.sqrt(sigma2 + x[xb + j] * x[xb + j])
            else:
                weight[j] = x[xb + j] * x[xb + j]
        amax, mx = absmax(x, xb, 32)
        if amax < GROUP_MAX_EPS:
            scales[ib] = F(0.0)
            continue
        d = -mx / v0 if ntry > 0 else mx / v0
        idv = F(1.0) / d
        sumqx = F(0.0)
        sumq2 = F(0.0)
        for j in range(32):
            L[32 * ib + j] = best_index_int8(idv * x[xb + j])
        for j in range(32):
            q = _KV[L[32 * ib + j]]
            w = weight[j]
            sumqx += w * q * x[xb + j]
            sumq2 += w * q * q
        d = sumqx / sumq2 if sumq2 > 0 else F(0.0)
        best = d * sumqx
        for itry in range(-ntry, ntry + 1):
            idv = F(itry + np.int64(KVALUES_IQ4NL[0])) / mx
            for j in range(32):  # the look-ups first, in a loop of their own that LLVM vectorizes
                Lt[j] = best_index_int8(idv * x[xb + j])
            sumqx = F(0.0)
            sumq2 = F(0.0)
            for j in range(32):
                q = _KV[Lt[j]]
                w = weight[j]
                sumqx += w * q * x[xb + j]
                sumq2 += w * q * q
            if sumq2 > 0 and sumqx * sumqx > best * sumq2:
                d = sumqx / sumq2
                best = d * sumqx
        scales[ib] = d
        if abs(d) > amax_scale:
            amax_scale = abs(d)
            max_scale = d
    if xs:
        y[o + 2] = 0
        y[o + 3] = 0
        d = -max_scale / F(32.0)
        h = fp16(d)
        idv = F(1.0) / d if d != 0 else F(0.0)
        for ib in range(super_size // 32):
            l = max(-32, min(31, nearest_int(idv * scales[ib])))
            dl = d * F(l)
            idl = F(1.0) / dl if dl != 0 else F(0.0)
            for j in range(32):
                L[32 * ib + j] = best_index_int8(idl * x[xo + 32 * ib + j])
            l += 32
            if ib % 2 == 0:
                y[o + 4 + ib // 2] = np.uint8(l & 0xF)
            else:
                y[o + 4 + ib // 2] |= np.uint8((l & 0xF) << 4)
            hbits = (l >> 4) << (2 * (ib % 8))
            y[o + 2] |= np.uint8(hbits & 0xFF)
            y[o + 3] |= np.uint8((hbits >> 8) & 0xFF)
    else:
        h = fp16(scales[0])
        if ntry > 0:
            idv = F(1.0) / scales[0] if scales[0] != 0 else F(0.0)
            for j in range(super_size):
                L[j] = best_index_int8(idv * x[xo + j])
    y[o] = np.uint8(h & 0xFF)
    y[o + 1] = np.uint8(h >> 8)
    for i in range(super_size // 32):
        for j in range(16):
            y[q4 + 16 * i + j] = np.uint8(L[32 * i + j] | (L[32 * i + 16 + j] << 4))


def _iq4_quantizer(super_size, ts):
    """The kernel of one of the two types: ``(x, y, n, qw)``, its block sizes compile-time constants."""
    xs = super_size == QK_K

    @kernel
    def quantize(x, y, n, qw):
        L = np.empty(QK_K, np.int64)
        Lt = np.empty(32, np.int64)
        weight = np.empty(32, np.float32)
        scales = np.empty(8, np.float32)
        for i in range(x.size // super_size):
            xo = super_size * i
            _iq4_impl(super_size, x, xo, y, ts * i, xs, scales, weight, L, Lt, qw, xo % n, 7)

    return quantize


quantize_iq4_nl_weighted = _iq4_quantizer(32, 18)
quantize_iq4_nl = bind(quantize_iq4_nl_weighted, _NO_WEIGHTS)
quantize_iq4_xs_weighted = _iq4_quantizer(QK_K, 136)
quantize_iq4_xs = bind(quantize_iq4_xs_weighted, _NO_WEIGHTS)


dequantize_iq4_nl = bind(dequantize_nibbles, KVALUES_IQ4NL)


@kernel
def dequantize_iq4_xs(y, x):
    for i in range(x.size // QK_K):
        o = 136 * i
        d = get_fp16(y, o)
        sh = np.int64(y[o + 2]) | (np.int64(y[o + 3]) << 8)
        for ib in range(8):
            ls = ((np.int64(y[o + 4 + ib // 2]) >> (4 * (ib % 2))) & 0xF) | (((sh >> (2 * ib)) & 3) << 4)
            dl = d * F(ls - 32)
            for j in range(16):
                b = y[o + 8 + 16 * ib + j]
                x[QK_K * i + 32 * ib + j] = dl * F(KVALUES_IQ4NL[b & 0xF])
                x[QK_K * i + 32 * ib + j + 16] = dl * F(KVALUES_IQ4NL[b >> 4])
