"""Q2_K, Q3_K, Q4_K, Q5_K, Q6_K: ``quantize_row_*_K_ref``, ``quantize_row_*_K_impl`` (with importance weights)
and ``dequantize_row_*_K`` of ``ggml-quants.c``, with the scale searches they share (``make_qx_quants``,
``make_q3_quants``, ``make_qkx2_quants``, ``make_qkx3_quants``, ``make_qp_quants``; the legacy types'
weighted paths use two of them). Signatures as in :mod:`.legacy`.

The searches take their scratch arrays from the caller, as the C code keeps them on its stack; levels are
int64 arrays whose values the C code's ``int8_t``/``uint8_t`` hold unchanged (every wrap is written out).
"""

from __future__ import annotations

import numpy as np

from .jit import GROUP_MAX_EPS, QK_K, F, absmax, bind, f32_bits, get_fp16, i8, kernel, nearest_int, put_fp16, raw_kernel

_NO_WEIGHTS = np.empty(0, np.float32)


_MAGIC = F(12582912.0)
QX_TMP = 64  # the float32 scratch make_qx_quants takes
_FLOAT_LEVELS = F(4194304.0)  # 2**22: below it, _level is nearest_int


@kernel
def _level(v, lo, hi):
    """``MAX(lo, MIN(hi, nearest_int(v)))`` as a float32, for |v| < 2**22: ``(v + 12582912.f) - 12582912.f`` is
    the integer whose bits nearest_int reads out of the same sum, and the clamp of an integer-valued float is
    exact. Float operations throughout (no int round trip): fewer instructions, as the hot loops need."""
    r = (v + _MAGIC) - _MAGIC
    return max(lo, min(hi, r))


@kernel
def make_qx_quants(n, nmax, x, L, rmse_type, qw, tmp):
    """``make_qx_quants`` (rmse_type 1 or 0; ``qw`` empty for NULL: weights x*x); ``tmp``: float32 scratch of
    QX_TMP.

    C tries 19 scales one after the other, each a pass over x summing two chains of float additions: the
    additions' latency bounds it. The passes do not depend on each other (only the choice between them does),
    so here one pass over x runs the 19 side by side -- each scale's sums still taken in C's order, one lane
    each -- and the choices are then made in C's order; the levels written are those of the last scale chosen,
    as C leaves them. Every ``iscale * x[i]`` is within nmax + 1 of 0 (``max`` is the largest |x|), so the
    levels come from :func:`_level`. tests/ggml/test_searches.py holds it to C's pass-by-pass loop."""
    amax, mx = absmax(x, 0, n)
    if amax < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return F(0.0)
    lo = F(-nmax)
    hi = F(nmax - 1)
    if rmse_type == 0:
        iscale = F(-nmax) / mx
        for i in range(n):
            L[i] = nmax + np.int64(_level(iscale * x[i], lo, hi))
        return F(1.0) / iscale
    iscales = tmp[0:19]  # C's first scale, then is = -9..-1, 1..9
    sumlx = tmp[20:39]
    suml2 = tmp[40:59]
    iscales[0] = F(-nmax) / mx
    for k in range(18):
        step = k - 9 if k < 9 else k - 8
        iscales[k + 1] = -(F(nmax) + F(0.1) * F(step)) / mx
    for s in range(19):
        sumlx[s] = F(0.0)
        suml2[s] = F(0.0)
    weighted = qw.size > 0
    for i in range(n):
        xi = x[i]
        w = qw[i] if weighted else xi * xi
        wx = w * xi  # C's w*x[i]*l is (w*x[i])*l
        for s in range(19):
            fl = _level(iscales[s] * xi, lo, hi)
            sumlx[s] += wx * fl
            suml2[s] += w * fl * fl
    scale = sumlx[0] / suml2[0] if suml2[0] != 0 else F(0.0)
    best = scale * sumlx[0]
    chosen = 0
    for s in range(1, 19):
        if suml2[s] > 0 and sumlx[s] * sumlx[s] > best * suml2[s]:
            scale = sumlx[s] / suml2[s]
            best = scale * sumlx[s]
            chosen = s
    iscale = iscales[chosen]
    for i in range(n):
        L[i] = nmax + np.int64(_level(iscale * x[i], lo, hi))
    return scale


@kernel
def make_q3_quants(n, nmax, x, L):
    """``make_q3_quants(..., do_rmse = true)``."""
    amax, mx = absmax(x, 0, n)
    if amax < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return F(0.0)
    iscale = F(-nmax) / mx
    sumlx = F(0.0)
    suml2 = F(0.0)
    for i in range(n):
        l = max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
        L[i] = l
        w = x[i] * x[i]
        sumlx += w * x[i] * F(l)
        suml2 += w * F(l) * F(l)
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            w = x[i] * x[i]
            slx = sumlx - w * x[i] * F(L[i])
            if slx > 0:
                sl2 = suml2 - w * F(L[i]) * F(L[i])
                new_l = max(-nmax, min(nmax - 1, nearest_int(x[i] * sl2 / slx)))
                if new_l != L[i]:
                    slx += w * x[i] * F(new_l)
                    sl2 += w * F(new_l) * F(new_l)
                    if sl2 > 0 and slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    for i in range(n):
        L[i] += nmax
    return sumlx / suml2 if suml2 > 0 else F(0.0)


@kernel
def qkx_start(n, nmax, x, weights, L, use_mad):
    """The search's start, levels at ``nmax / (max - min)`` with ``min`` at most 0: (min, max, the least x, the
    sums of weights and of weights * x, scale, its error); with ``max <= min`` a scale 0 and levels 0."""
    mn = x[0]
    mx = x[0]
    sum_w = weights[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        if x[i] < mn:
            mn = x[i]
        if x[i] > mx:
            mx = x[i]
        w = weights[i]
        sum_w += w
        sum_x += w * x[i]
    xmin = mn
    if mn > 0:
        mn = F(0.0)
    best_mad = F(0.0)
    if mx <= mn:
        for i in range(n):
            L[i] = 0
        return mn, mx, xmin, sum_w, sum_x, F(0.0), best_mad
    iscale = F(nmax) / (mx - mn)
    scale = F(1.0) / iscale
    for i in range(n):
        L[i] = max(0, min(nmax, nearest_int(iscale * (x[i] - mn))))
        diff = scale * F(L[i]) + mn - x[i]
        diff = abs(diff) if use_mad else diff * diff
        best_mad += weights[i] * diff
    return mn, mx, xmin, sum_w, sum_x, scale, best_mad


QKX_LANES = 8  # make_qkx_quants' steps run side by side (one AVX2 register of float32)
QKX_TMP = 8 * QKX_LANES  # the float32 scratch it takes


@kernel
def _nearest_level(v, lo, hi):
    """:func:`_level` for any ``v``: ``MAX(lo, MIN(hi, nearest_int(v)))`` as C computes it."""
    return F(max(np.int32(lo), min(np.int32(hi), nearest_int(v))))


def _qkx_group(exact):
    """The kernel that runs steps ``first``..``first + k - 1`` side by side, their ``iscale`` in ``tmp[:k]``, levels
    by :func:`_level` (``exact``) or :func:`_nearest_level`; their choices in C's order up to the
    first that moves ``min``: (the next step, min, scale, best_mad)."""
    level = _level if exact else _nearest_level

    @raw_kernel  # no reference counting: a call per group, four arrays each, would cost atomics
    def group(n, x, weights, L, mn, first, k, hi, sum_w, sum_x, scale, best_mad, use_mad, tmp):
        isc = tmp[0:k]
        s_l = tmp[QKX_LANES : QKX_LANES + k]
        s_l2 = tmp[2 * QKX_LANES : 2 * QKX_LANES + k]
        s_xl = tmp[3 * QKX_LANES : 3 * QKX_LANES + k]
        t_scale = tmp[4 * QKX_LANES : 4 * QKX_LANES + k]
        t_min = tmp[5 * QKX_LANES : 5 * QKX_LANES + k]
        t_d = tmp[6 * QKX_LANES : 6 * QKX_LANES + k]
        mads = tmp[7 * QKX_LANES : 7 * QKX_LANES + k]
        for j in range(k):
            s_l[j] = F(0.0)
            s_l2[j] = F(0.0)
            s_xl[j] = F(0.0)
            mads[j] = F(0.0)
        for i in range(n):
            xi = x[i]
            d = xi - mn
            w = weights[i]
            for j in range(k):
                fl = level(isc[j] * d, F(0.0), hi)
                wl = w * fl
                s_l[j] += wl
                s_l2[j] += wl * fl
                s_xl[j] += wl * xi
        for j in range(k):
            D = sum_w * s_l2[j] - s_l[j] * s_l[j]
            this_scale = (sum_w * s_xl[j] - sum_x * s_l[j]) / D
            this_min = (s_l2[j] * sum_x - s_l[j] * s_xl[j]) / D
            if this_min > 0:
                this_min = F(0.0)
                this_scale = s_xl[j] / s_l2[j]
            t_d[j] = D
            t_scale[j] = this_scale
            t_min[j] = this_min
        for i in range(n):
            xi = x[i]
            d = xi - mn
            w = weights[i]
            for j in range(k):
                diff = t_scale[j] * level(isc[j] * d, F(0.0), hi) + t_min[j] - xi
                diff = abs(diff) if use_mad else diff * diff
                mads[j] += w * diff
        nxt = first + k
        taken = -1  # the last step taken: its levels are those C leaves in L (all at this group's min)
        for j in range(k):
            if t_d[j] > 0 and mads[j] < best_mad:
                taken = j
                best_mad = mads[j]
                scale = t_scale[j]
                if f32_bits(t_min[j]) != f32_bits(mn):  # moved (bits: C's min = this_min may be 0.0 for -0.0)
                    nxt = first + j + 1
                    break
        if taken >= 0:
            for i in range(n):
                L[i] = np.int64(level(isc[taken] * (x[i] - mn), F(0.0), hi))
            mn = t_min[taken]
        return nxt, mn, scale, best_mad

    return group


_qkx_lanes, _qkx_step = _qkx_group(True), _qkx_group(False)


@kernel
def make_qkx_quants(n, nmax, x, weights, L, rmin, rdelta, nstep, use_mad, tmp):
    """``make_qkx2_quants`` and ``make_qkx3_quants`` (given weights): (scale, the_min); ``tmp``: float32 scratch
    of QKX_TMP. The two C functions run the same loop; qkx3 adds an early return for ``nstep < 1`` and tests
    ``max <= min`` where qkx2 tests ``max == min``, the same on finite values.

    C's steps run one after the other, each bound by its chains of float additions, and each depends on the
    steps before it only through ``min``, which a step taken with another minimum moves. So QKX_LANES steps run
    side by side (one lane each, every sum in C's order) on the current ``min`` (:func:`_qkx_group`), and the
    next group starts after the first step that moved it (why groups of 8: docs/notes/quantize.md). The levels
    come from :func:`_level` when every ``iscale * (x[i] - min)`` of a group is below 2**22 (its bound is that of
    x's two ends), else that group is one step, leveled by nearest_int as C."""
    mn, mx, xmin, sum_w, sum_x, scale, best_mad = qkx_start(n, nmax, x, weights, L, use_mad)
    if mx <= mn or nstep < 1:
        return scale, -mn
    hi = F(nmax)
    first = 0
    while first <= nstep:
        k = min(nstep + 1 - first, QKX_LANES)
        exact = True
        for j in range(k):
            tmp[j] = (rmin + rdelta * F(first + j) + F(nmax)) / (mx - mn)
            exact = exact and max(abs(tmp[j] * (xmin - mn)), abs(tmp[j] * (mx - mn))) < _FLOAT_LEVELS
        if exact:
            first, mn, scale, best_mad = _qkx_lanes(
                n, x, weights, L, mn, first, k, hi, sum_w, sum_x, scale, best_mad, use_mad, tmp
            )
        else:
            first, mn, scale, best_mad = _qkx_step(
                n, x, weights, L, mn, first, 1, hi, sum_w, sum_x, scale, best_mad, use_mad, tmp
            )
    return scale, -mn


@kernel
def make_qp_quants(n, nmax, x, L, qw):
    """``make_qp_quants``; ``L`` holds C's ``uint8_t`` levels (a negative level wraps, as the i-quants' signed
    values can make it)."""
    mx = F(0.0)
    for i in range(n):
        mx = mx if mx > x[i] else x[i]
    if mx < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return F(0.0)
    iscale = F(nmax) / mx
    for i in range(n):
        L[i] = nearest_int(iscale * x[i]) & 0xFF
    scale = F(1.0) / iscale
    best_mse = F(0.0)
    for i in range(n):
        diff = x[i] - scale * F(L[i])
        best_mse += qw[i] * diff * diff
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_is = (F(0.1) * F(step) + F(nmax)) / mx
        scale_is = F(1.0) / iscale_is
        mse = F(0.0)
        for i in range(n):
            l = min(nmax, nearest_int(iscale_is * x[i]))
            diff = x[i] - scale_is * F(l)
            mse += qw[i] * diff * diff
        if mse < best_mse:
            best_mse = mse
            iscale = iscale_is
    sumlx = F(0.0)
    suml2 = F(0.0)
    for i in range(n):
        l = min(nmax, nearest_int(iscale * x[i]))
        L[i] = l & 0xFF
        w = qw[i]
        sumlx += w * x[i] * F(l)
        suml2 += w * F(l) * F(l)
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            w = qw[i]
            slx = sumlx - w * x[i] * F(L[i])
            sl2 = suml2 - w * F(L[i]) * F(L[i])
            if slx > 0 and sl2 > 0:
                new_l = min(nmax, nearest_int(x[i] * sl2 / slx))
                if new_l != L[i]:
                    slx += w * x[i] * F(new_l)
                    sl2 += w * F(new_l) * F(new_l)
                    if slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l & 0xFF
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    return sumlx / suml2 if suml2 > 0 else F(0.0)


@kernel
def _sub_weights(x, at, qw, qat, sigma2, weights, n):
    """``weights[l] = qw[l] * sqrtf(sigma2 + x[l]*x[l])``, and their sum."""
    sumw = F(0.0)
    for l in range(n):
        weights[l] = qw[qat + l] * np.sqrt(sigma2 + x[at + l] * x[at + l])
    for l in range(n):
        sumw += weights[l]
    return sumw


@kernel
def _max_codes(v, top, codes):
    """The unweighted k-quants' codes of their sub-block scales (or mins) ``v``: ``nearest_int(top / max * v)``
    as C's ``uint8_t``, all 0 when no value is above 0; returns the block's value, ``max / top``."""
    vmax = F(0.0)
    for j in range(v.size):
        if v[j] > vmax:
            vmax = v[j]
    inv = F(top) / vmax if vmax > 0 else F(0.0)
    for j in range(v.size):
        codes[j] = nearest_int(inv * v[j]) & 0xFF
    return vmax / F(top)


@kernel
def sum_x2(x, at, n):
    """The sum of ``x[at:at+n]`` squared, in order (every weighted path's sigma2)."""
    s = F(0.0)
    for l in range(n):
        s += x[at + l] * x[at + l]
    return s


@kernel
def _pack_2bit(y, o, L):
    """The levels' low 2 bits, four to a byte (Q2_K, Q3_K)."""
    for j in range(0, QK_K, 128):
        for l in range(32):
            y[o + j // 4 + l] = np.uint8(
                (L[j + l] & 3) | ((L[j + l + 32] & 3) << 2) | ((L[j + l + 64] & 3) << 4) | ((L[j + l + 96] & 3) << 6)
            )


@kernel
def _pack_high_bits(y, o, L, bit):
    """Bit ``bit`` of each level into the mask at ``o``: level ``32 * k + m`` is bit k of byte m (Q3_K's hmask,
    Q5_K's qh). C tests and subtracts level by level; the same bits without its unpredictable branches."""
    for m in range(32):
        b = 0
        for k in range(8):
            b |= ((L[32 * k + m] >> bit) & 1) << k
        y[o + m] = np.uint8(b)


# --------------------------------------------------------------------------- Q2_K


@kernel
def _q2_k_levels(x, xo, y, o, L):
    """The requantization at the fp16 scales both Q2_K paths end with, and the packing."""
    dd = get_fp16(y, o + 80)
    mm = get_fp16(y, o + 82)
    for j in range(16):
        d = dd * F(y[o + j] & 0xF)
        if d == 0:
            continue
        dm = mm * F(y[o + j] >> 4)
        for ii in range(16):
            L[16 * j + ii] = max(0, min(3, nearest_int((x[xo + 16 * j + ii] + dm) / d)))
    _pack_2bit(y, o + 16, L)


@kernel
def quantize_q2_k_weighted(x, y, n, qw):
    """``quantize_row_q2_K_ref`` (``qw`` empty) / ``_impl``."""
    L = np.empty(QK_K, np.int64)
    weights = np.empty(16, np.float32)
    mins = np.empty(16, np.float32)
    scales = np.empty(16, np.float32)
    sw = np.empty(16, np.float32)
    Ls = np.empty(16, np.int64)
    Lm = np.empty(16, np.int64)
    tmp = np.empty(QKX_TMP, np.float32)
    weighted = qw.size > 0
    rmin, rdelta, nstep = (F(-0.9), F(0.05), 36) if weighted else (F(-0.5), F(0.1), 15)
    for i in range(x.size // QK_K):
        xo, o, qo = QK_K * i, 84 * i, (QK_K * i) % n
        sigma2 = sum_x2(x, xo, QK_K) / F(QK_K) if weighted else F(0.0)
        for j in range(16):
            if weighted:
                sw[j] = _sub_weights(x, xo + 16 * j, qw, qo + 16 * j, sigma2, weights, 16)
            else:
                for l in range(16):
                    weights[l] = abs(x[xo + 16 * j + l])
            scales[j], mins[j] = make_qkx_quants(
                16, 3, x[xo + 16 * j :], weights, L[16 * j :], rmin, rdelta, nstep, not weighted, tmp
            )
        if weighted:
            put_fp16(y, o + 80, make_qp_quants(16, 15, scales, Ls, sw))
            put_fp16(y, o + 82, make_qp_quants(16, 15, mins, Lm, sw))
        else:
            put_fp16(y, o + 80, _max_codes(scales, 15, Ls))
            put_fp16(y, o + 82, _max_codes(mins, 15, Lm))
        for j in range(16):
            y[o + j] = np.uint8((Ls[j] | (Lm[j] << 4)) & 0xFF)
        _q2_k_levels(x, xo, y, o, L)


quantize_q2_k = bind(quantize_q2_k_weighted, _NO_WEIGHTS)


# --------------------------------------------------------------------------- Q3_K


@kernel
def _q3_k_finish(x, xo, y, o, L):
    """Both Q3_K paths after the scales: requantize at each sub-block's scale, hmask and 2-bit levels."""
    d_all = get_fp16(y, o + 108)
    for j in range(16):
        d = d_all * F(_q3_k_scale(y, o, j))
        if d == 0:
            continue
        for ii in range(16):
            L[16 * j + ii] = max(-4, min(3, nearest_int(x[xo + 16 * j + ii] / d))) + 4
    _pack_high_bits(y, o, L, 2)
    _pack_2bit(y, o + 32, L)


@kernel
def _q3_k_scale(y, o, j):
    """Sub-block j's scale: its low 4 bits in a nibble of bytes 96-103, its high 2 in bytes 104-107, minus 32."""
    low = y[o + 96 + j] & 0xF if j < 8 else y[o + 96 + j - 8] >> 4
    return i8(np.int64(low) | (((np.int64(y[o + 104 + j % 4]) >> (2 * (j // 4))) & 3) << 4)) - 32


@kernel
def _q3_k_put_scale(y, o, j, l):
    if j < 8:
        y[o + 96 + j] = np.uint8(l & 0xF)
    else:
        y[o + 96 + j - 8] |= np.uint8((l & 0xF) << 4)
    y[o + 96 + j % 4 + 8] |= np.uint8(((l >> 4) << (2 * (j // 4))) & 0xFF)


@kernel
def quantize_q3_k(x, y, n_per_row):
    L = np.empty(QK_K, np.int64)
    scales = np.empty(16, np.float32)
    for i in range(x.size // QK_K):
        xo, o = QK_K * i, 110 * i
        max_scale = F(0.0)
        amax = F(0.0)
        for j in range(16):
            scales[j] = make_q3_quants(16, 4, x[xo + 16 * j :], L[16 * j :])
            scale = abs(scales[j])
            if scale > amax:
                amax = scale
                max_scale = scales[j]
        for j in range(12):
            y[o + 96 + j] = 0
        if max_scale != 0:
            iscale = F(-32.0) / max_scale
            for j in range(16):
                l = max(-32, min(31, i8(nearest_int(iscale * scales[j])))) + 32
                _q3_k_put_scale(y, o, j, l)
            put_fp16(y, o + 108, F(1.0) / iscale)
        else:
            put_fp16(y, o + 108, F(0.0))
        _q3_k_finish(x, xo, y, o, L)


@kernel
def quantize_q3_k_weighted(x, y, n, qw):
    L = np.empty(QK_K, np.int64)
    scales = np.empty(16, np.float32)
    weights = np.empty(16, np.float32)
    sw = np.empty(16, np.float32)
    Ls = np.empty(16, np.int64)
    tmp = np.empty(QX_TMP, np.float32)
    for i in range(x.size // QK_K):
        xo, o, qo = QK_K * i, 110 * i, (QK_K * i) % n
        sigma2 = F(2.0) * sum_x2(x, xo, QK_K) / F(QK_K)
        for j in range(16):
            sw[j] = _sub_weights(x, xo + 16 * j, qw, qo + 16 * j, sigma2, weights, 16)
            scales[j] = make_qx_quants(16, 4, x[xo + 16 * j :], L[16 * j :], 1, weights, tmp)
        for j in range(12):
            y[o + 96 + j] = 0
        d_block = make_qx_quants(16, 32, scales, Ls, 1, sw, tmp)
        for j in range(16):
            _q3_k_put_scale(y, o, j, Ls[j])
        put_fp16(y, o + 108, d_block)
        _q3_k_finish(x, xo, y, o, L)


# --------------------------------------------------------------------------- Q4_K / Q5_K


@kernel
def _scale_min_k4(j, y, so):
    if j < 4:
        return y[so + j] & 63, y[so + j + 4] & 63
    return ((y[so + j + 4] & 0xF) | ((y[so + j - 4] >> 6) << 4), (y[so + j + 4] >> 4) | ((y[so + j] >> 6) << 4))


@kernel
def _put_scale_min_k4(y, so, j, ls, lm):
    if j < 4:
        y[so + j] = np.uint8(ls)
        y[so + j + 4] = np.uint8(lm)
    else:
        y[so + j + 4] = np.uint8((ls & 0xF) | ((lm & 0xF) << 4))
        y[so + j - 4] |= np.uint8(((ls >> 4) << 6) & 0xFF)
        y[so + j] |= np.uint8(((lm >> 4) << 6) & 0xFF)


@kernel
def _q45_k_finish(x, xo, y, o, L, nmax):
    """The requantization at the fp16 scales and the packing, Q4_K (nmax 15) and Q5_K (31)."""
    dd = get_fp16(y, o)
    dmin = get_fp16(y, o + 2)
    for j in range(8):
        sc, m = _scale_min_k4(j, y, o + 4)
        d = dd * F(sc)
        if d == 0:
            continue
        dm = dmin * F(m)
        for ii in range(32):
            L[32 * j + ii] = max(0, min(nmax, nearest_int((x[xo + 32 * j + ii] + dm) / d)))
    if nmax == 31:
        _pack_high_bits(y, o + 16, L, 4)
    qs = o + 16 if nmax == 15 else o + 48
    for j in range(0, QK_K, 64):
        for l in range(32):
            y[qs + j // 2 + l] = np.uint8((L[j + l] & 15) | ((L[j + l + 32] & 15) << 4))


@kernel
def _q45_k(x, y, n, qw, ts, nmax, rmin, nstep):
    """``quantize_row_q4_K_ref`` / ``q5_K_ref`` (``qw`` empty; ``rmin``, ``nstep`` theirs) and their ``_impl``."""
    L = np.empty(QK_K, np.int64)
    Ls = np.empty(8, np.int64)
    Lm = np.empty(8, np.int64)
    weights = np.empty(32, np.float32)
    sw = np.empty(8, np.float32)
    mins = np.empty(8, np.float32)
    scales = np.empty(8, np.float32)
    tmp = np.empty(QKX_TMP, np.float32)
    weighted = qw.size > 0
    rmin, rdelta, nstep = (F(-0.9), F(0.05), 36) if weighted else (rmin, F(0.1), nstep)
    for i in range(x.size // QK_K):
        xo, o, qo = QK_K * i, ts * i, (QK_K * i) % n
        sigma2 = F(2.0) * sum_x2(x, xo, QK_K) / F(QK_K) if weighted else F(0.0)
        for j in range(8):
            if weighted:
                sw[j] = _sub_weights(x, xo + 32 * j, qw, qo + 32 * j, sigma2, weights, 32)
            else:
                av_x = np.sqrt(sum_x2(x, xo + 32 * j, 32) / F(32.0))
                for l in range(32):
                    weights[l] = av_x + abs(x[xo + 32 * j + l])
            scales[j], mins[j] = make_qkx_quants(
                32, nmax, x[xo + 32 * j :], weights, L[32 * j :], rmin, rdelta, nstep, False, tmp
            )
        if weighted:
            put_fp16(y, o, make_qp_quants(8, 63, scales, Ls, sw))
            put_fp16(y, o + 2, make_qp_quants(8, 63, mins, Lm, sw))
        else:
            put_fp16(y, o, _max_codes(scales, 63, Ls))
            put_fp16(y, o + 2, _max_codes(mins, 63, Lm))
        for j in range(8):
            _put_scale_min_k4(y, o + 4, j, min(63, Ls[j] & 0xFF), min(63, Lm[j] & 0xFF))
        _q45_k_finish(x, xo, y, o, L, nmax)


quantize_q4_k = bind(_q45_k, _NO_WEIGHTS, 144, 15, F(-1.0), 20)
quantize_q5_k = bind(_q45_k, _NO_WEIGHTS, 176, 31, F(-0.5), 15)
quantize_q4_k_weighted = bind(_q45_k, 144, 15, F(-1.0), 20)
quantize_q5_k_weighted = bind(_q45_k, 176, 31, F(-0.5), 15)


# --------------------------------------------------------------------------- Q6_K


@kernel
def quantize_q6_k_weighted(x, y, n, qw):
    """``quantize_row_q6_K_ref`` (``qw`` empty) / ``_impl``: the same search, with the importance as weights."""
    L = np.empty(QK_K, np.int64)
    scales = np.empty(16, np.float32)
    tmp = np.empty(QX_TMP, np.float32)
    weighted = qw.size > 0
    for i in range(x.size // QK_K):
        xo, o, qo = QK_K * i, 210 * i, (QK_K * i) % n
        max_scale = F(0.0)
        max_abs_scale = F(0.0)
        for ib in range(16):
            w = qw[qo + 16 * ib : qo + 16 * ib + 16] if weighted else qw
            scale = make_qx_quants(16, 32, x[xo + 16 * ib :], L[16 * ib :], 1, w, tmp)
            scales[ib] = scale
            if abs(scale) > max_abs_scale:
                max_abs_scale = abs(scale)
                max_scale = scale
        if max_abs_scale < GROUP_MAX_EPS:
            for k in range(210):
                y[o + k] = 0
            continue
        iscale = F(-128.0) / max_scale
        put_fp16(y, o + 208, F(1.0) / iscale)
        d_all = get_fp16(y, o + 208)
        for ib in range(16):
            y[o + 192 + ib] = np.uint8(min(127, nearest_int(iscale * scales[ib])) & 0xFF)
        for j in range(16):
            d = d_all * F(i8(np.int64(y[o + 192 + j])))
            if d == 0:
                continue
            for ii in range(16):
                L[16 * j + ii] = max(-32, min(31, nearest_int(x[xo + 16 * j + ii] / d))) + 32
        for j in range(0, QK_K, 128):  # low nibbles: value l with l + 64, l + 32 with l + 96; the top 2 bits
            for l in range(32):
                y[o + j // 2 + l] = np.uint8((L[j + l] & 0xF) | ((L[j + l + 64] & 0xF) << 4))
                y[o + j // 2 + l + 32] = np.uint8((L[j + l + 32] & 0xF) | ((L[j + l + 96] & 0xF) << 4))
                h = (L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2) | ((L[j + l + 64] >> 4) << 4)
                y[o + 128 + j // 4 + l] = np.uint8((h | ((L[j + l + 96] >> 4) << 6)) & 0xFF)


quantize_q6_k = bind(quantize_q6_k_weighted, _NO_WEIGHTS)


# --------------------------------------------------------------------------- dequantizers


@kernel
def dequantize_q2_k(y, x):
    for i in range(x.size // QK_K):
        o, xo = 84 * i, QK_K * i
        d = get_fp16(y, o + 80)
        mn = get_fp16(y, o + 82)
        k = 0
        for n in range(0, QK_K, 128):
            q = o + 16 + n // 4
            for j in range(4):
                for half in range(2):
                    sc = y[o + (n // 16) + 2 * j + half]
                    dl = d * F(sc & 0xF)
                    ml = mn * F(sc >> 4)
                    for l in range(16):
                        x[xo + k] = dl * F((y[q + 16 * half + l] >> (2 * j)) & 3) - ml
                        k += 1


@kernel
def dequantize_q3_k(y, x):
    for i in range(x.size // QK_K):
        o, xo = 110 * i, QK_K * i
        d_all = get_fp16(y, o + 108)
        k = 0
        m = 1
        for n in range(0, QK_K, 128):
            q = o + 32 + n // 4
            for j in range(4):
                for half in range(2):
                    dl = d_all * F(_q3_k_scale(y, o, n // 16 + 2 * j + half))
                    for l in range(16):
                        h = 0 if y[o + 16 * half + l] & m else 4
                        x[xo + k] = dl * F(np.int64((y[q + 16 * half + l] >> (2 * j)) & 3) - h)
                        k += 1
                m <<= 1


@kernel
def _dequantize_q45_k(y, x, ts, five):
    for i in range(x.size // QK_K):
        o, xo = ts * i, QK_K * i
        d = get_fp16(y, o)
        mn = get_fp16(y, o + 2)
        ql = o + 48 if five else o + 16
        u1 = 1
        u2 = 2
        for j in range(0, QK_K, 64):
            sc, m = _scale_min_k4(j // 32, y, o + 4)
            d1, m1 = d * F(sc), mn * F(m)
            sc, m = _scale_min_k4(j // 32 + 1, y, o + 4)
            d2, m2 = d * F(sc), mn * F(m)
            for l in range(32):
                h = (16 if y[o + 16 + l] & u1 else 0) if five else 0
                x[xo + j + l] = d1 * F((y[ql + j // 2 + l] & 0xF) + h) - m1
            for l in range(32):
                h = (16 if y[o + 16 + l] & u2 else 0) if five else 0
                x[xo + j + 32 + l] = d2 * F((y[ql + j // 2 + l] >> 4) + h) - m2
            u1 <<= 2
            u2 <<= 2


dequantize_q4_k = bind(_dequantize_q45_k, 144, False)
dequantize_q5_k = bind(_dequantize_q45_k, 176, True)


@kernel
def dequantize_q6_k(y, x):
    for i in range(x.size // QK_K):
        o, xo = 210 * i, QK_K * i
        d = get_fp16(y, o + 208)
        for n in range(0, QK_K, 128):
            ql = o + n // 2
            qh = o + 128 + n // 4
            sc = o + 192 + n // 16
            for l in range(32):
                h = np.int64(y[qh + l])
                for k in range(4):  # value l + 32 k: the nibble k // 2 of byte l + 32 (k % 2), bits 2k of h
                    q = i8(np.int64((y[ql + l + 32 * (k % 2)] >> (4 * (k // 2))) & 0xF) | (((h >> (2 * k)) & 3) << 4))
                    x[xo + n + l + 32 * k] = d * F(i8(np.int64(y[sc + l // 16 + 2 * k]))) * F(q - 32)
