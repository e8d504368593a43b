"""The scale searches that run C's candidates side by side (kquants.make_qx_quants, make_qkx_quants) give what C's
one-after-the-other loops give, bit for bit, on data made to stress them: blocks whose minimum moves at almost
every step, clusters with one far outlier (the chosen minimum far from the block's, where make_qkx_quants' float
levels are not exact and it goes step by step), zero weights, ties on rounding boundaries, sub-normal and huge
values. The references are C's loops as numba code: make_qx_quants and make_qkx_quants as C writes them, pass
after pass and step after step. tests/ggml's goldens and llama.cpp fuzz check the whole types against ggml."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from mtpq.ggml import iq4 as IQ4
from mtpq.ggml import kquants as K
from mtpq.ggml.jit import GROUP_MAX_EPS, absmax, nearest_int

F = np.float32


@numba.njit(error_model="numpy")
def qx_reference(n, nmax, x, L, qw):
    """ggml's make_qx_quants(n, nmax, x, L, 1, qw), pass after pass (qw empty: NULL)."""
    amax, mx = absmax(x, 0, n)
    if amax < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return F(0.0)
    iscale = F(-nmax) / mx
    weighted = qw.size > 0
    sumlx = F(0.0)
    suml2 = F(0.0)
    for i in range(n):
        l = max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
        L[i] = l + nmax
        w = qw[i] if weighted else x[i] * x[i]
        sumlx += w * x[i] * F(l)
        suml2 += w * F(l) * F(l)
    scale = sumlx / suml2 if suml2 != 0 else F(0.0)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -(F(nmax) + F(0.1) * F(step)) / mx
        sumlx = F(0.0)
        suml2 = F(0.0)
        for i in range(n):
            l = max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
            w = qw[i] if weighted else x[i] * x[i]
            sumlx += w * x[i] * F(l)
            suml2 += w * F(l) * F(l)
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            for i in range(n):
                L[i] = nmax + max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@numba.njit(error_model="numpy")
def qkx_reference(n, nmax, x, weights, L, rmin, rdelta, nstep, use_mad):
    """ggml's make_qkx2_quants: make_qkx_quants' start, then all its steps one after the other."""
    mn, mx, _, sum_w, sum_x, scale, best_mad = K.qkx_start(n, nmax, x, weights, L, use_mad)
    if mx <= mn or nstep < 1:
        return scale, -mn
    Laux = np.empty(n, np.int64)
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * F(step) + F(nmax)) / (mx - mn)
        sum_l = F(0.0)
        sum_l2 = F(0.0)
        sum_xl = F(0.0)
        for i in range(n):
            l = max(0, min(nmax, nearest_int(iscale * (x[i] - mn))))
            Laux[i] = l
            w = weights[i]
            sum_l += w * F(l)
            sum_l2 += w * F(l) * F(l)
            sum_xl += w * F(l) * x[i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > 0:
                this_min = F(0.0)
                this_scale = sum_xl / sum_l2
            mad = F(0.0)
            for i in range(n):
                diff = this_scale * F(Laux[i]) + this_min - x[i]
                diff = abs(diff) if use_mad else diff * diff
                mad += weights[i] * diff
            if mad < best_mad:
                for i in range(n):
                    L[i] = Laux[i]
                best_mad = mad
                scale = this_scale
                mn = this_min
    return scale, -mn


def blocks(n: int, count: int, seed: int):
    """(x, weights) pairs of length n: ordinary, clustered with a far outlier, all negative, ties, extremes."""
    rng = np.random.default_rng(seed)
    for k in range(count):
        kind = k % 8
        if kind == 0:
            x = rng.standard_normal(n) * 0.02
        elif kind == 1:  # a tight cluster and one far outlier below it
            x = -1.0 + rng.standard_normal(n) * 1e-4
            x[rng.integers(n)] = -1e3
        elif kind == 2:  # all negative, close together
            x = -rng.uniform(1.0, 1.0 + 1e-3, n)
        elif kind == 3:  # multiples of 1/8: rounding ties
            x = rng.integers(-16, 17, n) / 8.0
        elif kind == 4:  # one value and zeros
            x = np.zeros(n)
            x[rng.integers(n)] = rng.choice([-1.0, 1.0]) * 10.0 ** rng.uniform(-20, 20)
        elif kind == 5:  # spans of magnitude
            x = rng.standard_normal(n) * np.exp(rng.uniform(-30, 30, n))
        elif kind == 6:  # mostly positive, minimum near zero
            x = np.abs(rng.standard_normal(n)) + rng.choice([0.0, -1e-6])
        else:
            x = rng.standard_t(2, n)
        w = [
            np.abs(x) + np.sqrt(np.mean(x * x)),
            np.exp(rng.normal(0, 2, n)),
            np.where(rng.random(n) < 0.5, 0.0, rng.uniform(0, 10, n)),
        ][k % 3]
        yield x.astype(F), w.astype(F)


@pytest.mark.parametrize("n,nmax", [(16, 32), (16, 4), (32, 8), (32, 16)])
def test_make_qx_quants_is_c_pass_by_pass(n, nmax):
    tmp = np.empty(K.QX_TMP, F)
    checked = 0
    for x, w in blocks(n, 400, seed=n * 100 + nmax):
        for qw in (np.empty(0, F), w):
            La, Lb = np.empty(n, np.int64), np.empty(n, np.int64)
            got = K.make_qx_quants(n, nmax, x, La, 1, qw, tmp)
            want = qx_reference(n, nmax, x, Lb, qw)
            assert np.float32(got).tobytes() == np.float32(want).tobytes() and np.array_equal(La, Lb), (x, qw)
            checked += 1
    assert checked == 800


@pytest.mark.parametrize(
    "n,nmax,rmin,rdelta,nstep,use_mad",
    [
        (32, 15, -1.0, 0.1, 20, False),  # Q4_K
        (32, 31, -0.5, 0.1, 15, False),  # Q5_K
        (32, 15, -0.9, 0.05, 36, False),  # with importance, Q4_1
        (16, 3, -0.5, 0.1, 15, True),  # Q2_K
        (16, 3, -0.9, 0.05, 36, False),  # Q2_K with importance
    ],
)
def test_make_qkx_quants_is_c_step_by_step(n, nmax, rmin, rdelta, nstep, use_mad):
    tmp = np.empty(K.QKX_TMP, F)
    for x, w in blocks(n, 400, seed=nstep * 1000 + n):
        La, Lb = np.empty(n, np.int64), np.empty(n, np.int64)
        got = K.make_qkx_quants(n, nmax, x, w, La, F(rmin), F(rdelta), nstep, use_mad, tmp)
        want = qkx_reference(n, nmax, x, w, Lb, F(rmin), F(rdelta), nstep, use_mad)
        assert np.asarray(got, F).tobytes() == np.asarray(want, F).tobytes() and np.array_equal(La, Lb), (x, w)


@numba.njit(error_model="numpy")
def best_index_reference(val, x):
    """ggml's best_index_int8(16, val, x): the two early returns, then the binary search."""
    if x <= F(val[0]):
        return 0
    if x >= F(val[15]):
        return 15
    ml, mu = 0, 15
    while mu - ml > 1:
        mav = (ml + mu) // 2
        if x < F(val[mav]):
            mu = mav
        else:
            ml = mav
    return mu - 1 if x - F(val[mu - 1]) < F(val[mu]) - x else mu


@numba.njit(error_model="numpy")
def _indices(xs, out_ours, out_ref, val):
    for i in range(xs.size):
        out_ours[i] = IQ4.best_index_int8(xs[i])
        out_ref[i] = best_index_reference(val, xs[i])


def test_iq4_table_look_up_is_cs_binary_search():
    """The look-up by floor(x) against C's search on every table value and midpoint +-3 ulp, each integer from
    -130 to 130 +-3 ulp, the ends of the look-up's range, NaN, +-inf, subnormals and random values."""
    val = IQ4.KVALUES_IQ4NL
    points = np.concatenate(
        [val, (val[1:].astype(F) + val[:-1]) / 2, np.arange(-130, 131), [-128.0, 127.0, 0.0, -0.0, 1e-40, -1e-40]]
    ).astype(F)
    near = [points]
    for k in range(1, 4):
        near += [np.nextafter(points, F(np.inf)), np.nextafter(points, F(-np.inf))]
        points = np.concatenate([near[-2], near[-1]])
    rng = np.random.default_rng(7)
    xs = np.concatenate(
        near + [np.array([np.nan, np.inf, -np.inf, 3e38, -3e38], F), rng.uniform(-140, 140, 200_000).astype(F)]
    )
    ours, ref = np.empty(xs.size, np.int64), np.empty(xs.size, np.int64)
    _indices(xs, ours, ref, val)
    assert np.array_equal(ours, ref), xs[ours != ref][:10]
    assert set(np.unique(ref)) == set(range(16))
