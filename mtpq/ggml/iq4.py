"""IQ4_NL and IQ4_XS: ``quantize_row_iq4_nl_impl`` (``ntry = 7``, with or without importance weights, as
``quantize_iq4_nl`` / ``quantize_iq4_xs`` call it) and the dequantizers of ``ggml-quants.c``. Signatures as
in :mod:`.legacy`; both quantizers take the weights (empty: none)."""

from __future__ import annotations

import numpy as np

from .jit import GROUP_MAX_EPS, QK_K, F, absmax, bind, fp16, get_fp16, kernel, nearest_int

KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
_NO_WEIGHTS = np.empty(0, np.float32)


@kernel
def best_index_int8(n, val, x):
    """``best_index_int8``: the index of the table value nearest ``x`` (ties to the lower one)."""
    if x <= F(val[0]):
        return 0
    if x >= F(val[n - 1]):
        return n - 1
    ml = 0
    mu = n - 1
    while mu - ml > 1:
        mav = (ml + mu) // 2
        if x < F(val[mav]):
            mu = mav
        else:
            ml = mav
    return mu - 1 if x - F(val[mu - 1]) < F(val[mu]) - x else mu


@kernel
def _iq4_impl(super_size, x, xo, y, o, xs, scales, weight, L, values, qw, qo, ntry):
    """``quantize_row_iq4_nl_impl(super_size, 32, ...)`` for the super-block at ``x[xo]``, into the block at
    ``y[o]`` (IQ4_NL: d, qs; IQ4_XS: d, scales_h, scales_l, qs)."""
    weighted = qw.size > 0
    sigma2 = F(0.0)
    for j in range(super_size):
        sigma2 += x[xo + j] * x[xo + j]
    sigma2 *= F(2.0) / F(super_size)
    q4 = o + 8 if xs else o + 2
    for j in range(super_size // 2):
        y[q4 + j] = 0
    h = fp16(F(0.0))
    max_scale = F(0.0)
    amax_scale = F(0.0)
    v0 = F(values[0])
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
            l = best_index_int8(16, values, idv * x[xb + j])
            L[32 * ib + j] = l
            q = F(values[l])
            w = weight[j]
            sumqx += w * q * x[xb + j]
            sumq2 += w * q * q
        d = sumqx / sumq2 if sumq2 > 0 else F(0.0)
        best = d * sumqx
        for itry in range(-ntry, ntry + 1):
            idv = F(itry + np.int64(values[0])) / mx
            sumqx = F(0.0)
            sumq2 = F(0.0)
            for j in range(32):
                q = F(values[best_index_int8(16, values, idv * x[xb + j])])
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
                L[32 * ib + j] = best_index_int8(16, values, idl * x[xo + 32 * ib + j])
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
                L[j] = best_index_int8(16, values, idv * x[xo + j])
    y[o] = np.uint8(h & 0xFF)
    y[o + 1] = np.uint8(h >> 8)
    for i in range(super_size // 32):
        for j in range(16):
            y[q4 + 16 * i + j] = np.uint8(L[32 * i + j] | (L[32 * i + 16 + j] << 4))


@kernel
def _iq4(x, y, n, qw, super_size, ts):
    L = np.empty(QK_K, np.int64)
    weight = np.empty(32, np.float32)
    scales = np.empty(8, np.float32)
    for i in range(x.size // super_size):
        xo = super_size * i
        _iq4_impl(super_size, x, xo, y, ts * i, super_size == QK_K, scales, weight, L, KVALUES_IQ4NL, qw, xo % n, 7)


quantize_iq4_nl = bind(_iq4, _NO_WEIGHTS, 32, 18)
quantize_iq4_nl_weighted = bind(_iq4, 32, 18)
quantize_iq4_xs = bind(_iq4, _NO_WEIGHTS, QK_K, 136)
quantize_iq4_xs_weighted = bind(_iq4, QK_K, 136)


@kernel
def dequantize_iq4_nl(y, x):
    for i in range(x.size // 32):
        d = get_fp16(y, 18 * i)
        for j in range(16):
            b = y[18 * i + 2 + j]
            x[32 * i + j] = d * F(KVALUES_IQ4NL[b & 0xF])
            x[32 * i + j + 16] = d * F(KVALUES_IQ4NL[b >> 4])


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
