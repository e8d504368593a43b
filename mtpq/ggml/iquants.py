"""IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M: ``quantize_row_iq*_impl`` and ``dequantize_row_iq*``
of ``ggml-quants.c``, on the grids of :mod:`.iqtables`.

The five grid types share one search (:func:`_grid_search`): signs first, then candidate scales, each group of
8 (IQ2) or 4 (IQ3) levels snapped to its grid point or to the best of its neighbours, the best candidate
refitted; their own code packs the blocks. The IQ1 types (:func:`_iq1_quantizer`) split sorted values into
three groups. ``QUANTIZERS[kind]`` quantizes rows of one type (``kind``: its code below) with its own kernel (its
``.kernel``), compiled for that type alone: ``(x, y, n_per_row, qw, grid, levels, kmap, neighbours)`` (``qw``
empty: none given), the tables' arrays at the end; :mod:`.registry` binds them. The kernels run without numba's
reference counting (:data:`.jit.raw_kernel`): their helpers are inlined, and each array an inlined helper takes
would otherwise cost an atomic increment and decrement at every group of every candidate.
"""

from __future__ import annotations

import numpy as np

from .iqtables import KSIGNS
from .jit import (
    QK_K,
    F,
    fp16,
    fp16_to_f32,
    get_fp16,
    get_u16,
    get_u32,
    inline,
    kernel,
    nearest_int,
    put_fp16,
    put_u32,
    raw_kernel,
)
from .kquants import make_qp_quants, sum_x2

_FLT_MAX = F(3.4028234663852886e38)
_IQ1_DELTA = F(0.125)


# --------------------------------------------------------------------------- shared parts


@inline
def _weights(x, xo, qw, qo, sigma2, weight, n, no_imatrix_bias):
    """``qw * sqrtf(sigma2 + x*x)``, or without weights ``x*x`` (+ ``0.25f*sigma2`` for IQ2_S)."""
    if qw.size > 0:
        for i in range(n):
            weight[i] = qw[qo + i] * np.sqrt(sigma2 + x[xo + i] * x[xo + i])
    elif no_imatrix_bias:
        for i in range(n):
            weight[i] = F(0.25) * sigma2 + x[xo + i] * x[xo + i]
    else:
        for i in range(n):
            weight[i] = x[xo + i] * x[xo + i]


@inline
def _signs(x, xo, weight, xval, signs, n, parity):
    """|x| into ``xval`` and each 8 values' sign bits; with ``parity`` (an even count of negatives, the 7-bit
    codes) the value of least weighted square changes sign when the count is odd."""
    for k in range(n // 8):
        nflip = 0
        s = 0
        for i in range(8):
            v = x[xo + 8 * k + i]
            if v >= 0:
                xval[8 * k + i] = v
            else:
                xval[8 * k + i] = -v
                nflip += 1
                s |= 1 << i
        if parity and nflip % 2:
            imin = 0
            mn = weight[8 * k] * x[xo + 8 * k] * x[xo + 8 * k]
            for i in range(1, 8):
                ax = weight[8 * k + i] * x[xo + 8 * k + i] * x[xo + 8 * k + i]
                if ax < mn:
                    mn = ax
                    imin = i
            xval[8 * k + imin] = -xval[8 * k + imin]
            s ^= 1 << imin
        signs[k] = s & 127 if parity else s


@inline
def _find_best_neighbour(neighbours, start, grid, levels, gw, xval, xo, waux, wo, scale, L, lo):
    """``iq2_find_best_neighbour`` / ``iq3_find_best_neighbour`` / ``iq1_find_best_neighbour2``: the neighbour of
    least weighted squared error to ``xval[xo:]`` (weights ``waux[wo:]``) at ``scale``; its levels into ``L[lo:]``."""
    best_d2 = _FLT_MAX
    grid_index = -1
    for j in range(1, np.int64(neighbours[start]) + 1):
        g = np.int64(neighbours[start + j])
        d2 = F(0.0)
        for i in range(gw):
            diff = scale * grid[gw * g + i] - xval[xo + i]
            d2 += waux[wo + i] * diff * diff
        if d2 < best_d2:
            best_d2 = d2
            grid_index = g
    for i in range(gw):
        L[lo + i] = levels[gw * grid_index + i]
    return grid_index


@inline
def _snap(xval, xo, waux, L, k, gw, bits, scale, kmap, neighbours, grid, levels):
    """Group k's levels ``L[gw*k:]`` to a grid point (its values ``xval[xo:]``, weights ``waux[gw*k:]``): its index,
    and whether they were on the grid."""
    u = 0
    for i in range(gw):
        u |= L[gw * k + i] << (bits * i)
    g = kmap[u]
    if g >= 0:
        return g, True
    return _find_best_neighbour(neighbours, -g - 1, grid, levels, gw, xval, xo, waux, gw * k, scale, L, gw * k), False


@inline
def _levels_at(xval, L, k, gw, idv, kmax):
    for i in range(gw):
        L[gw * k + i] = max(0, min(kmax - 1, nearest_int(F(0.5) * (idv * xval[gw * k + i] - F(1.0)))))


@inline
def _fit(weight, xval, L, n):
    sumqx = F(0.0)
    sumq2 = F(0.0)
    for i in range(n):
        w = weight[i]
        q = F(2 * L[i] + 1)
        sumqx += w * xval[i] * q
        sumq2 += w * q * q
    return sumqx, sumq2


@inline
def _grid_search(n, spec, xval, weight, waux, L, Laux, gidx, on_grid, on_grid_aux, tables):
    """The candidate scales of one sub-block of ``n`` values: (scale, whether it has one); ``L`` ends on the
    grid, ``gidx`` its points. ``spec``: the type's constants (:func:`_grid_quantizer`); ``start_qp``: IQ2_XXS's
    start (``make_qp_quants``, candidates around the effective max, the refit always)."""
    gw, bits, kmax, steps, step, start_qp, init_on_grid, refit_all = spec
    kmap, neighbours, grid, levels = tables
    ng = n // gw
    mx = xval[0]
    for i in range(1, n):
        mx = mx if mx > xval[i] else xval[i]
    for i in range(n):
        L[i] = 0  # the levels when no candidate scores (every weight zero)
    if start_qp:
        scale = make_qp_quants(n, kmax + 1, xval, L, weight)
        top = scale * F(kmax)
        if top <= 0:
            return F(0.0), False
    else:
        scale = mx / F(2 * kmax - 1)
        top = mx
    best = F(0.0)
    for k in range(ng):
        on_grid[k] = init_on_grid
    for s in range(-steps, steps + 1):
        idv = (F(2 * kmax - 1) + F(s) * step) / top
        this_scale = F(1.0) / idv
        for k in range(ng):
            _levels_at(xval, Laux, k, gw, idv, kmax)
            gidx[k], on_grid_aux[k] = _snap(
                xval, gw * k, waux, Laux, k, gw, bits, this_scale, kmap, neighbours, grid, levels
            )
        sumqx, sumq2 = _fit(weight, xval, Laux, n)
        if sumq2 > 0 and sumqx * sumqx > best * sumq2:
            scale = sumqx / sumq2
            best = scale * sumqx
            for i in range(n):
                L[i] = Laux[i]
            for k in range(ng):
                on_grid[k] = on_grid_aux[k]
    n_off = 0
    for k in range(ng):
        if not on_grid[k]:
            n_off += 1
    if (n_off > 0 or start_qp) and scale > 0:
        idv = F(1.0) / scale
        for k in range(ng):
            if on_grid[k] and not refit_all:
                continue
            _levels_at(xval, L, k, gw, idv, kmax)
            _snap(xval, gw * k, waux, L, k, gw, bits, scale, kmap, neighbours, grid, levels)
        sumqx, sumq2 = _fit(weight, xval, L, n)
        if sumq2 > 0:
            scale = sumqx / sumq2
    for k in range(ng):
        u = 0
        for i in range(gw):
            u |= L[gw * k + i] << (bits * i)
        gidx[k] = kmap[u]
    return scale, True


@inline
def _scale_code(idv, scale, top):
    return max(0, min(top, nearest_int(F(0.5) * (idv * scale - F(1.0)))))


# the codes of the i-quant types (the registry's records name them)
IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M = range(7)

# per grid type: values per sub-block, per group, bits per level, kMaxQ, candidate steps, step, GROUP_MAX_EPS
# (0: ``!max``), bytes per block, the fudge factor of d; then parity signs, ``0.25f*sigma2`` in the unweighted
# weights, IQ2_XXS's start, groups start on the grid, refit every group, sigma2 doubled
_GRID_SPECS = {
    IQ2_XXS: (32, 8, 2, 3, 6, 0.1, 1e-15, 66, 1.0, (True, False, True, False, True, False)),
    IQ2_XS: (16, 8, 2, 3, 9, 0.1, 1e-15, 74, 1.0, (True, False, False, True, False, False)),
    IQ2_S: (16, 8, 2, 3, 9, 0.1, 1e-8, 82, 0.9875, (False, True, False, True, False, True)),
    IQ3_XXS: (32, 4, 3, 8, 15, 0.2, 1e-8, 98, 1.0125, (True, False, False, True, False, True)),
    IQ3_S: (32, 4, 3, 8, 9, 0.2, 0.0, 110, 1.033, (False, False, False, False, True, True)),
}


def _grid_quantizer(kind):
    """``quantize_row_iq2_xxs_impl`` .. ``quantize_row_iq3_s_impl`` (``kind``: IQ2_XXS .. IQ3_S), row by row: one
    kernel per type (``rows``), its spec compile-time constants (numba freezes the values a closure reads);
    ``quantize`` hands it its scratch arrays."""
    bn, gw, bits, kmax, steps, step, eps, ts, fudge, flags = _GRID_SPECS[kind]
    parity, bias, start_qp, init_on_grid, refit_all, twice = flags
    step, eps, fudge = F(step), F(eps), F(fudge)
    nsub = QK_K // bn
    spec = (gw, bits, kmax, steps, step, start_qp, init_on_grid, refit_all)  # constants, as the closure's

    def quantize(x, y, n, qw, grid, levels, kmap, neighbours):
        f32, i64, ng = np.float32, np.int64, bn // gw
        fs, ls, ons = np.empty((3, bn), f32), np.empty((2, bn), i64), np.empty((2, ng), np.bool_)
        scratch = fs, ls, np.empty(ng, i64), ons, np.empty(bn // 8, i64), np.empty(nsub, f32), np.empty(104, i64)
        rows(x, y, n, qw, grid, levels, kmap, neighbours, *scratch)

    @raw_kernel
    def rows(x, y, n, qw, grid, levels, kmap, neighbours, fs, ls, gidx, ons, signs, scales, q):
        weight, waux, xval = fs[0], fs[1], fs[2]
        L, Laux = ls[0], ls[1]
        on_grid, on_aux = ons[0], ons[1]
        tables = (kmap, neighbours, grid, levels)
        for ibl in range(x.size // QK_K):
            xo, o, qo = QK_K * ibl, ts * ibl, (QK_K * ibl) % n
            for j in range(ts):
                y[o + j] = 0
            q[:] = 0
            qpos = o + 2  # IQ3_S: its qs and signs move on only past the sub-blocks it keeps
            spos = o + 74
            max_scale = F(0.0)
            sigma2 = F(2.0 if twice else 1.0) * sum_x2(x, xo, QK_K) / F(QK_K)
            for ib in range(nsub):
                xb = xo + bn * ib
                _weights(x, xb, qw, qo + bn * ib, sigma2, weight, bn, bias)
                for i in range(bn):
                    waux[i] = np.sqrt(weight[i])
                _signs(x, xb, weight, xval, signs, bn, parity)
                mx = xval[0]
                for i in range(1, bn):
                    mx = mx if mx > xval[i] else xval[i]
                if mx < eps or mx == 0:
                    scales[ib] = F(0.0)
                    continue
                scale, ok = _grid_search(bn, spec, xval, weight, waux, L, Laux, gidx, on_grid, on_aux, tables)
                if not ok:
                    scales[ib] = F(0.0)
                    continue
                if scale < 0:
                    scale = -scale
                    for k in range(bn // 8):
                        signs[k] = (~signs[k]) & (127 if parity else 255)
                if kind == IQ2_XXS:
                    for k in range(4):
                        q[2 * ib] |= gidx[k] << (8 * k)
                        q[2 * ib + 1] |= signs[k] << (7 * k)
                elif kind == IQ2_XS:
                    for k in range(2):
                        q[2 * ib + k] = gidx[k] | (signs[k] << 9)
                elif kind == IQ2_S:
                    for k in range(2):
                        i8 = 2 * ib + k
                        y[o + 2 + i8] = np.uint8(gidx[k] & 255)
                        y[o + 66 + i8 // 4] |= np.uint8((gidx[k] >> 8) << (2 * (i8 % 4)))
                        y[o + 34 + i8] = np.uint8(signs[k])
                elif kind == IQ3_XXS:
                    for k in range(8):
                        q[8 * ib + k] = gidx[k]
                    q[64 + ib] = signs[0] | (signs[1] << 7) | (signs[2] << 14) | (signs[3] << 21)
                else:
                    for k in range(8):
                        y[qpos + k] = np.uint8(gidx[k] & 255)
                        y[o + 66 + ib] |= np.uint8((gidx[k] >> 8) << k)
                    qpos += 8
                    for k in range(4):
                        y[spos + k] = np.uint8(signs[k])
                    spos += 4
                scales[ib] = scale
                max_scale = max_scale if max_scale > scale else scale
            if max_scale == 0:
                continue
            d = max_scale / F(31.0)
            put_fp16(y, o, d * fudge if kind >= IQ2_S else d)
            idv = F(1.0) / d
            if kind == IQ2_XXS:
                for ib in range(8):
                    q[2 * ib + 1] |= _scale_code(idv, scales[ib], 15) << 28
                for j in range(16):
                    put_u32(y, o + 2 + 4 * j, q[j])
            elif kind == IQ2_XS or kind == IQ2_S:
                for j in range(32):
                    if kind == IQ2_XS:
                        y[o + 2 + 2 * j] = np.uint8(q[j] & 255)
                        y[o + 3 + 2 * j] = np.uint8(q[j] >> 8)
                for ib in range(16):
                    y[o + ts - 8 + ib // 2] |= np.uint8(_scale_code(idv, scales[ib], 15) << (4 * (ib % 2)))
            elif kind == IQ3_XXS:
                for ib in range(8):
                    q[64 + ib] |= _scale_code(idv, scales[ib], 15) << 28
                for j in range(64):
                    y[o + 2 + j] = np.uint8(q[j])
                for ib in range(8):
                    put_u32(y, o + 66 + 4 * ib, q[64 + ib])
            else:
                for ib in range(0, 8, 2):
                    l1 = _scale_code(idv, scales[ib], 15)
                    l2 = _scale_code(idv, scales[ib + 1], 15)
                    y[o + 106 + ib // 2] = np.uint8(l1 | (l2 << 4))

    quantize.kernel = rows
    return quantize


# --------------------------------------------------------------------------- IQ1_S, IQ1_M


_XP = np.array([F(-1.0) + _IQ1_DELTA, _IQ1_DELTA, F(1.0) + _IQ1_DELTA], np.float32)
_XM = np.array([F(-1.0) - _IQ1_DELTA, -_IQ1_DELTA, F(1.0) - _IQ1_DELTA], np.float32)


@inline
def _iq1_half(code, k, ng, grid):
    """Where group ``k`` of ``ng`` finds its values in ``grid`` (:func:`.iqtables.search_tables`: the points' levels
    shifted up, then down): ``code``'s bit 1 shifts the first half down, bit 0 the second (IQ1_M's four codes;
    IQ1_S uses 0 and 3)."""
    return grid.size // 2 if ((code >> 1) if 2 * k < ng else code) & 1 else 0


@inline
def _sort_order(x, xb, n, idx, xs):
    """The order of ``x[xb:xb+n]`` ascending into ``idx``, equal values in index order as glibc's ``qsort`` (a
    merge sort) leaves them: an insertion sort in place (``xs`` the sorted values), no array made per call."""
    for j in range(n):
        v = x[xb + j]
        k = j
        while k > 0 and xs[k - 1] > v:
            xs[k] = xs[k - 1]
            idx[k] = idx[k - 1]
            k -= 1
        xs[k] = v
        idx[k] = j


@inline
def _iq1_finish(x, xb, weight, L, idx, bn, i1, i2, scale, code, index, kmap, neighbours, grid, levels):
    """The chosen split's levels (sorted values below ``i1``: 0, below ``i2``: 1, then 2), flipped with the
    scale's sign; each group of 8 to a grid point, the scale refitted when one was off the grid: (scale, code)."""
    for j in range(bn):
        L[idx[j]] = 0 if j < i1 else (1 if j < i2 else 2)
    if scale < 0:
        for j in range(bn):
            L[j] = 2 - L[j]
        scale = -scale
        code = 3 - code
    ng = bn // 8
    all_on_grid = True
    for k in range(ng):
        at = _iq1_half(code, k, ng, grid)
        index[k], on = _snap(x, xb + 8 * k, weight, L, k, 8, 2, scale, kmap, neighbours, grid[at:], levels)
        all_on_grid = all_on_grid and on
    if not all_on_grid:
        sumqx = F(0.0)
        sumq2 = F(0.0)
        for k in range(ng):
            at = _iq1_half(code, k, ng, grid) + 8 * index[k]
            for j in range(8):
                w = weight[8 * k + j]
                qv = grid[at + j]
                sumqx += w * qv * x[xb + 8 * k + j]
                sumq2 += w * qv * qv
        if sumqx > 0 and sumq2 > 0:
            scale = sumqx / sumq2
    return scale, code


@inline
def _iq1_s_split(x, xb, weight, idx, mx, sumx, sumw):
    """IQ1_S's search over the splits of 32 sorted values, both shifts: (scale, i1, i2, code 0 or 3)."""
    sumx[0] = F(0.0)
    sumw[0] = F(0.0)
    for j in range(32):
        i = idx[j]
        sumx[j + 1] = sumx[j] + weight[i] * x[xb + i]
        sumw[j + 1] = sumw[j] + weight[i]
    best_score = -_FLT_MAX
    scale = mx
    besti1 = -1
    besti2 = -1
    best_shift = -1
    for i1 in range(33):
        for i2 in range(i1, 33):
            for sh in range(2):
                xx = _XP if sh == 0 else _XM
                sumqx = (sumx[i1] - sumx[0]) * xx[0] + (sumx[i2] - sumx[i1]) * xx[1] + (sumx[32] - sumx[i2]) * xx[2]
                sumq2 = (
                    (sumw[i1] - sumw[0]) * xx[0] * xx[0]
                    + (sumw[i2] - sumw[i1]) * xx[1] * xx[1]
                    + (sumw[32] - sumw[i2]) * xx[2] * xx[2]
                )
                if sumq2 > 0 and sumqx * sumqx > best_score * sumq2:
                    scale = sumqx / sumq2
                    best_score = scale * sumqx
                    besti1 = i1
                    besti2 = i2
                    best_shift = 3 * sh
    return scale, besti1, besti2, best_shift


@inline
def _iq1_m_split(x, xb, weight, idx, mx, px, pw):
    """IQ1_M's search over the splits of 16 sorted values, each half's shift apart: (scale, i1, i2, code)."""
    cp1 = _XP[0] * _XP[0] - _XP[1] * _XP[1]
    cp2 = _XP[1] * _XP[1] - _XP[2] * _XP[2]
    cm1 = _XM[0] * _XM[0] - _XM[1] * _XM[1]
    cm2 = _XM[1] * _XM[1] - _XM[2] * _XM[2]
    p2 = _XP[2]
    m2 = _XM[2]
    best_score = -_FLT_MAX
    scale = mx
    besti1 = -1
    besti2 = -1
    best_k = -1
    px[:, 0] = F(0.0)
    pw[:, 0] = F(0.0)
    for j in range(16):
        i = idx[j]
        h = 0 if i < 8 else 1
        px[h, j + 1] = px[h, j] + weight[i] * x[xb + i]
        px[1 - h, j + 1] = px[1 - h, j]
        pw[h, j + 1] = pw[h, j] + weight[i]
        pw[1 - h, j + 1] = pw[1 - h, j]
    for i1 in range(17):
        for i2 in range(i1, 17):
            sx0 = px[0, i1] + px[0, i2]
            sx1 = px[1, i1] + px[1, i2]
            qxp0 = px[0, 16] * p2 - sx0
            qxm0 = px[0, 16] * m2 - sx0
            qxp1 = px[1, 16] * p2 - sx1
            qxm1 = px[1, 16] * m2 - sx1
            q2p0 = pw[0, 16] * p2 * p2 + pw[0, i1] * cp1 + pw[0, i2] * cp2
            q2m0 = pw[0, 16] * m2 * m2 + pw[0, i1] * cm1 + pw[0, i2] * cm2
            q2p1 = pw[1, 16] * p2 * p2 + pw[1, i1] * cp1 + pw[1, i2] * cp2
            q2m1 = pw[1, 16] * m2 * m2 + pw[1, i1] * cm1 + pw[1, i2] * cm2
            sumqx = (qxp0 + qxp1, qxp0 + qxm1, qxm0 + qxp1, qxm0 + qxm1)
            sumq2 = (q2p0 + q2p1, q2p0 + q2m1, q2m0 + q2p1, q2m0 + q2m1)
            for k in range(4):
                if sumq2[k] > 0 and sumqx[k] * sumqx[k] > best_score * sumq2[k]:
                    scale = sumqx[k] / sumq2[k]
                    best_score = scale * sumqx[k]
                    besti1 = i1
                    besti2 = i2
                    best_k = k
    return scale, besti1, besti2, best_k


def _iq1_quantizer(kind):
    """``quantize_row_iq1_s_impl`` / ``quantize_row_iq1_m_impl`` (``kind``: IQ1_S, IQ1_M), row by row: one kernel
    per type, as :func:`_grid_quantizer`."""
    m = kind == IQ1_M
    bn, ts = (16, 56) if m else (32, 50)

    def quantize(x, y, n, qw, grid, levels, kmap, neighbours):
        f32, i64 = np.float32, np.int64
        scratch = np.empty((2, bn), f32), np.empty((2, 2, 33), f32), np.empty((2, bn), i64), np.empty(16, f32)
        rows(x, y, n, qw, grid, levels, kmap, neighbours, *scratch, np.empty(24, i64))

    @raw_kernel
    def rows(x, y, n, qw, grid, levels, kmap, neighbours, fs, sums, ls, scales, ints):
        weight, xs = fs[0], fs[1]
        px, pw = sums[0], sums[1]  # IQ1_S: its sums in px[0], pw[0]
        L, idx = ls[0], ls[1]
        shifts, index, sc = ints[:16], ints[16:20], ints[20:]
        for ibl in range(x.size // QK_K):
            xo, o, qo = QK_K * ibl, ts * ibl, (QK_K * ibl) % n
            for j in range(ts):
                y[o + j] = 0
            max_scale = F(0.0)
            sigma2 = F(2.0) * sum_x2(x, xo, QK_K) / F(QK_K)
            for ib in range(QK_K // bn):
                xb = xo + bn * ib
                _weights(x, xb, qw, qo + bn * ib, sigma2, weight, bn, False)
                mx = abs(x[xb])
                for i in range(1, bn):
                    mx = mx if mx > abs(x[xb + i]) else abs(x[xb + i])
                scales[ib] = F(0.0)
                shifts[ib] = 0
                if mx < (F(1e-7) if m else F(1e-12)):
                    continue
                _sort_order(x, xb, bn, idx, xs)
                if m:
                    scale, i1, i2, code = _iq1_m_split(x, xb, weight, idx, mx, px, pw)
                else:
                    scale, i1, i2, code = _iq1_s_split(x, xb, weight, idx, mx, px[0], pw[0])
                if i1 < 0 or i2 < 0 or code < 0:
                    continue
                scale, code = _iq1_finish(
                    x, xb, weight, L, idx, bn, i1, i2, scale, code, index, kmap, neighbours, grid, levels
                )
                if m:
                    y[o + 2 * ib] = np.uint8(index[0] & 255)
                    y[o + 2 * ib + 1] = np.uint8(index[1] & 255)
                    y[o + 32 + ib] = np.uint8((index[0] >> 8) | ((index[1] >> 8) << 4))
                else:
                    h = 0
                    for k in range(4):
                        y[o + 2 + 4 * ib + k] = np.uint8(index[k] & 255)
                        h |= (index[k] >> 8) << (3 * k)
                    y[o + 34 + 2 * ib] = np.uint8(h & 255)
                    y[o + 35 + 2 * ib] = np.uint8(h >> 8)
                scales[ib] = scale
                shifts[ib] = code
                max_scale = max_scale if max_scale > scale else scale
            if max_scale == 0:
                continue
            d = max_scale / F(15.0)
            idv = F(1.0) / d
            if not m:
                put_fp16(y, o, d * F(1.125))
                for ib in range(8):
                    l = max(0, min(7, nearest_int(F(0.5) * (idv * scales[ib] - F(1.0)))))
                    y[o + 35 + 2 * ib] |= np.uint8((l | (8 if shifts[ib] == 3 else 0)) << 4)
                continue
            sc[:] = 0
            sqx = F(0.0)
            sq2 = F(0.0)
            for ib in range(16):
                l = max(0, min(7, nearest_int(F(0.5) * (idv * scales[ib] - F(1.0)))))
                sc[ib // 4] |= l << (3 * (ib % 4))
                y[o + 32 + ib] |= np.uint8((0x00, 0x80, 0x08, 0x88)[shifts[ib]])
                xb = xo + 16 * ib
                _weights(x, xb, qw, qo + 16 * ib, sigma2, weight, 16, False)
                qh = np.int64(y[o + 32 + ib])
                for k in range(2):
                    g = np.int64(y[o + 2 * ib + k]) + ((qh << (8 - 4 * k)) & 0x700)
                    at = _iq1_half(shifts[ib], k, 2, grid) + 8 * g
                    for j in range(8):
                        w = weight[8 * k + j]
                        qv = grid[at + j] * F(2 * l + 1)
                        sqx += w * qv * x[xb + 8 * k + j]
                        sq2 += w * qv * qv
            if sq2 > 0:
                d = sqx / sq2
            s = np.int64(fp16(d * F(1.1125)))
            sc[0] |= (s & 0x000F) << 12
            sc[1] |= (s & 0x00F0) << 8
            sc[2] |= (s & 0x0F00) << 4
            sc[3] |= s & 0xF000
            for j in range(4):
                y[o + 48 + 2 * j] = np.uint8(sc[j] & 255)
                y[o + 49 + 2 * j] = np.uint8((sc[j] >> 8) & 255)

    quantize.kernel = rows
    return quantize


QUANTIZERS = {kind: _grid_quantizer(kind) for kind in _GRID_SPECS} | {k: _iq1_quantizer(k) for k in (IQ1_S, IQ1_M)}


# --------------------------------------------------------------------------- dequantizers


@kernel
def _put_signed(x, at, db, grid, g, n, signs, bit):
    """``n`` values of grid point ``g`` at ``db``, value j negated where ``signs`` has bit ``bit + j``."""
    for j in range(n):
        x[at + j] = db * grid[g, j] * (F(-1.0) if signs & (1 << (bit + j)) else F(1.0))


@kernel
def dequantize_iq2_xxs(y, x, grid):
    for i in range(x.size // QK_K):
        o, xo = 66 * i, QK_K * i
        d = get_fp16(y, o)
        for ib in range(8):
            a1 = get_u32(y, o + 2 + 8 * ib + 4)
            db = d * (F(0.5) + F(a1 >> 28)) * F(0.25)
            for l in range(4):
                g = y[o + 2 + 8 * ib + l]
                signs = KSIGNS[(a1 >> (7 * l)) & 127]
                _put_signed(x, xo + 32 * ib + 8 * l, db, grid, g, 8, signs, 0)


def _dequantize_iq2(s_type):
    """``dequantize_row_iq2_xs`` (a uint16 per 8 values: a 9-bit grid index, 7 sign bits) and ``iq2_s``
    (``s_type``: an index byte, its 2 high bits in qh, a sign byte)."""
    ts, so = (82, 74) if s_type else (74, 66)

    @kernel
    def dequantize(y, x, grid):
        for i in range(x.size // QK_K):
            o, xo = ts * i, QK_K * i
            d = get_fp16(y, o)
            for ib in range(8):
                s = y[o + so + ib]
                db0 = d * (F(0.5) + F(s & 0xF)) * F(0.25)
                db1 = d * (F(0.5) + F(s >> 4)) * F(0.25)
                for l in range(4):
                    if s_type:
                        g = np.int64(y[o + 2 + 4 * ib + l]) | ((np.int64(y[o + 66 + ib]) << (8 - 2 * l)) & 0x300)
                        signs = np.int64(y[o + 34 + 4 * ib + l])
                    else:
                        q = np.int64(get_u16(y, o + 2 + 2 * (4 * ib + l)))
                        g, signs = q & 511, np.int64(KSIGNS[q >> 9])
                    _put_signed(x, xo + 32 * ib + 8 * l, db0 if l < 2 else db1, grid, g, 8, signs, 0)

    return dequantize


def _dequantize_iq3(s_type):
    """``dequantize_row_iq3_xxs`` (per 32 values a uint32: four 7-bit sign codes, a 4-bit scale) and ``iq3_s``
    (``s_type``: high index bits in qh, sign bytes, 4-bit odd scales)."""
    ts = 110 if s_type else 98

    @kernel
    def dequantize(y, x, grid):
        for i in range(x.size // QK_K):
            o, xo = ts * i, QK_K * i
            d = get_fp16(y, o)
            for ib in range(8):
                if s_type:
                    db = d * F(1 + 2 * ((y[o + 106 + ib // 2] >> (4 * (ib % 2))) & 0xF))
                    a = np.uint32(0)
                else:
                    a = get_u32(y, o + 66 + 4 * ib)
                    db = d * (F(0.5) + F(a >> 28)) * F(0.5)
                qh = np.int64(y[o + 66 + ib])
                for l in range(4):
                    g1 = np.int64(y[o + 2 + 8 * ib + 2 * l])
                    g2 = np.int64(y[o + 2 + 8 * ib + 2 * l + 1])
                    if s_type:
                        g1, g2 = g1 | ((qh << (8 - 2 * l)) & 256), g2 | ((qh << (7 - 2 * l)) & 256)
                        signs = np.int64(y[o + 74 + 4 * ib + l])
                    else:
                        signs = np.int64(KSIGNS[(a >> (7 * l)) & 127])
                    _put_signed(x, xo + 32 * ib + 8 * l, db, grid, g1, 4, signs, 0)
                    _put_signed(x, xo + 32 * ib + 8 * l + 4, db, grid, g2, 4, signs, 4)

    return dequantize


dequantize_iq2_xs, dequantize_iq2_s = _dequantize_iq2(False), _dequantize_iq2(True)
dequantize_iq3_xxs, dequantize_iq3_s = _dequantize_iq3(False), _dequantize_iq3(True)


@kernel
def dequantize_iq1_s(y, x, grid):
    for i in range(x.size // QK_K):
        o, xo = 50 * i, QK_K * i
        d = get_fp16(y, o)
        for ib in range(8):
            qh = np.int64(get_u16(y, o + 34 + 2 * ib))
            dl = d * F(2 * ((qh >> 12) & 7) + 1)
            delta = -_IQ1_DELTA if qh & 0x8000 else _IQ1_DELTA
            for l in range(4):
                g = np.int64(y[o + 2 + 4 * ib + l]) | (((qh >> (3 * l)) & 7) << 8)
                for j in range(8):
                    x[xo + 32 * ib + 8 * l + j] = dl * (grid[g, j] + delta)


@kernel
def dequantize_iq1_m(y, x, grid):
    for i in range(x.size // QK_K):
        o, xo = 56 * i, QK_K * i
        h = 0  # the fp16 scale: the top 4 bits of each of the four scale words, low nibble first
        for k in range(4):
            h |= (np.int64(get_u16(y, o + 48 + 2 * k)) >> (12 - 4 * k)) & (0xF << (4 * k))
        d = fp16_to_f32(h)
        for ib in range(8):
            sc = np.int64(get_u16(y, o + 48 + 2 * (ib // 2)))
            dl1 = d * F(2 * ((sc >> (6 * (ib % 2))) & 7) + 1)
            dl2 = d * F(2 * ((sc >> (6 * (ib % 2) + 3)) & 7) + 1)
            for l in range(4):
                qh = np.int64(y[o + 32 + 2 * ib + l // 2])
                g = np.int64(y[o + 4 * ib + l]) | ((qh << (8 - 4 * (l % 2))) & 0x700)
                delta = -_IQ1_DELTA if qh & (0x08 << (4 * (l % 2))) else _IQ1_DELTA
                dl = dl1 if l < 2 else dl2
                for j in range(8):
                    x[xo + 32 * ib + 8 * l + j] = dl * (grid[g, j] + delta)
