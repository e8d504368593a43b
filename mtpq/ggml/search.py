"""ggml's scale searches, vectorised over sub-blocks (columns of ``X``), in torch for other devices than the CPU.

``make_qx_quants`` (rmse_type 1, with or without weights), ``make_q3_quants``,
``make_qkx2_quants`` (``make_qkx3_quants`` with weights is the same routine
with other step constants), ``make_qp_quants`` (the weighted search of the
K-quants' sub-block scales and mins) and the last rounding pass of the
K-quant routines, byte-exact with ``ggml-quants.c``.  The candidate scales run one
after the other over a few reused full-size buffers, updated in place; the
small per-sub-block bookkeeping between them runs on :mod:`.vecops` vectors.
On CPU each search runs :mod:`.npkquants`' numpy version on the tensors' memory
(tests switch that off to run the torch code here).
"""

from __future__ import annotations

import functools
from typing import Callable

import numpy as np
import torch

from . import npkquants
from .cfloat import _F32, _GROUP_MAX_EPS, _SAFE, _round_clamp_exact, _seq_sum, _seq_sum_from_first, _zeros, seq_sum_np
from .cnumpy import qkx2_candidates as _qkx2_candidates, qx_candidates as _qx_candidates
from .legacy import f32, first_absmax, first_min, nearest_int, rdiv, u8
from . import vecops  # vecops.numpy_path looked up at call time: tests switch it off to run the torch path
from .vecops import _first_absmax_cols


def _make_qx_quants_rmse1(
    X: torch.Tensor, nmax: int, W: torch.Tensor | None = None
) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
    """``make_qx_quants(n, nmax, x, L, rmse_type=1, qw)`` for every column of ``X``:
    ``qw = NULL`` (weights x*x) when ``W`` is None, else the weights ``W`` (same shape).

    Returns (scale (n_sub,), levels) where ``levels()`` gives L (n, n_sub), float32
    in [0, 2*nmax-1].  The 19 candidate scales do not depend on each other: each
    is one reused (n, n_sub) buffer of levels (small enough to stay in cache)
    reduced to its two sums, and the C loop's choice between them -- candidate
    0, then each later one that is strictly better -- runs afterwards on the
    (19, n_sub) sums.  L is computed only on demand: the caller's last pass
    recomputes it anyway wherever the final sub-block scale is nonzero (see
    :func:`_final_levels`).
    """
    if vecops.numpy_path(X):
        scale, levels = npkquants.make_qx_quants_rmse1(X.numpy(), nmax, None if W is None else W.numpy())
        return torch.from_numpy(scale), lambda: torch.from_numpy(levels())
    v = vecops._TorchVec
    ns = X.shape[1]
    amax, mx, lo, hi = _first_absmax_cols(X, v)
    zero_v = amax < _GROUP_MAX_EPS
    consts = _qx_candidates(nmax)
    nc = len(consts)
    if W is None:
        W = X * X
    WX = W * X
    L = torch.empty_like(X)
    Wa, WXa, La = v.arr(W), v.arr(WX), v.arr(L)
    SLX, SL2 = v.empty((nc, ns), X), v.empty((nc, ns), X)
    with np.errstate(all="ignore"):  # inf/NaN propagate as in C
        ISC = v.div(v.consts(consts, X)[:, None], mx[None])  # (nc, ns): every candidate's iscale
        ISC_t = v.t(ISC)
        # iscale * x lies in [-|c|, |c| * r] (rounding aside), r the largest ratio of the far side
        # of zero to the max; a clamp that cannot act is skipped (columns with max below
        # GROUP_MAX_EPS may hold inf/NaN levels, but they are set to zero below)
        opp = v.where(mx > 0, -lo, hi) / amax
        r = v.amax(v.where(zero_v, 0.0, opp))
        r = r if r <= 1.0 else float("inf")  # NaN: clamp always
        for k, c in enumerate(consts):
            # |iscale * x| <= nmax + 1 whenever max >= GROUP_MAX_EPS, and there nearest_int
            # is round-half-even
            torch.mul(X, ISC_t[k : k + 1], out=L).round_()
            low = -c * (1 + 1e-5) > nmax + 0.5  # may round to -nmax-1
            high = -c * r * (1 + 1e-5) >= nmax - 0.5  # may round to nmax
            if low or high:
                L.clamp_(-nmax if low else None, nmax - 1 if high else None)
            v.dot(WXa, La, SLX[k])  # sum of (w*x)*l
            v.dot3(Wa, La, La, SL2[k])  # sum of (w*l)*l
        NS = v.div(SLX, SL2)  # each candidate's scale
        v.put(NS[0], SL2[0] == 0, 0.0)  # candidate 0: scale = suml2 ? sumlx/suml2 : 0
        Q = v.mul(NS, SLX)  # its "best" = scale * sumlx
        SQ = v.mul(SLX, SLX)
        never = ~(SL2 > 0)
        if v.any(never):
            v.put(SQ, never, -np.inf)  # a candidate with suml2 <= 0 never wins: -inf > y is false
        # the C loop: candidate 0, then each one that is strictly better (a Python step per
        # candidate, but on (n_sub,) vectors of sums); the winner is the last that was better
        best = v.clone(Q[0])
        better = v.bools((nc, ns), X)
        better[0] = True
        tmp = v.empty(ns, X)
        for k in range(1, nc):
            v.gt(SQ[k], v.mul(best, SL2[k], out=tmp), out=better[k])  # sumlx^2 > best * suml2
            v.put(best, better[k], Q[k])
        win = v.last_true(better)
        scale = v.where(zero_v, 0.0, v.take(NS, win))
        best_isc = v.where(zero_v, 0.0, v.take(ISC, win))

    def levels() -> torch.Tensor:
        torch.mul(X, v.t(best_isc)[None], out=L).round_().clamp_(-nmax, nmax - 1)
        return L.add_(nmax).mul_((~v.t(zero_v)).to(_F32)[None])

    return v.t(scale), levels


def _make_q3_quants(X: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``make_q3_quants(n, nmax, x, L, do_rmse=true)`` for every column of ``X``, in torch (other devices than
    the CPU, where :func:`.npkquants.make_q3_quants` runs)."""
    amax, mx = first_absmax(X, 0)
    zero = amax < _GROUP_MAX_EPS
    iscale = rdiv(f32(-nmax), mx)
    L = torch.clamp(nearest_int(iscale[None] * X), -nmax, nmax - 1)
    Lf = L.to(_F32)
    W = X * X
    WX = W * X
    sumlx = _seq_sum(WX * Lf)
    suml2 = _seq_sum((W * Lf) * Lf)
    L, sumlx, suml2 = _q3_refine_torch(X, W, WX, L, Lf, sumlx, suml2, nmax)
    L = L + nmax
    scale = torch.where(suml2 > 0, torch.div(sumlx, suml2), _zeros(sumlx))
    L = L * (~zero).to(torch.int32)[None]
    scale = torch.where(zero, _zeros(scale), scale)
    return scale, L


def _q3_step(xi, wi, wxi, li, lfi, sumlx, suml2, nmax: int, where, clamp, to_f32):
    """One ``i`` of make_q3_quants' refinement, for every column at once (numpy or torch operands):
    (new L row, its float copy, sumlx, suml2, which columns changed)."""
    slx = sumlx - wxi * lfi
    sl2 = suml2 - (wi * lfi) * lfi
    new_l = clamp(nearest_int((xi * sl2) / slx), -nmax, nmax - 1)
    new_lf = to_f32(new_l)
    slx2 = slx + wxi * new_lf
    sl22 = sl2 + (wi * new_lf) * new_lf
    upd = (slx > 0) & (new_l != li) & (sl22 > 0) & ((slx2 * slx2) * suml2 > (sumlx * sumlx) * sl22)
    return where(upd, new_l, li), where(upd, new_lf, lfi), where(upd, slx2, sumlx), where(upd, sl22, suml2), upd


def _q3_refine_torch(X, W, WX, L, Lf, sumlx, suml2, nmax: int):
    """make_q3_quants' five refinement passes over the rows, every column at once (other devices)."""
    n = X.shape[0]
    rows, rows_f = [L[i] for i in range(n)], [Lf[i] for i in range(n)]
    f32_of = lambda t: t.to(_F32)  # noqa: E731
    for _itry in range(5):
        changed = None
        for i in range(n):
            rows[i], rows_f[i], sumlx, suml2, upd = _q3_step(X[i], W[i], WX[i], rows[i], rows_f[i], sumlx, suml2,
                                                             nmax, torch.where, torch.clamp, f32_of)
            changed = upd if changed is None else (changed | upd)
        # a sub-block with no change is at a fixed point: further passes leave it alone
        if not bool(changed.any()):
            break
    return torch.stack(rows), sumlx, suml2


def _make_qkx2_quants(
    X: torch.Tensor, W: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool,
    zero_sign: bool = False,
) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
    """``make_qkx2_quants`` for every column. Returns ((scale, the_min) as (2, n_sub), levels).

    ``zero_sign``: also get the sign of a zero ``the_min`` right (the C scan keeps the
    first minimal element, -0.0 or 0.0); Q4_1/Q5_1 store the min as fp16, where it shows.

    ``levels()`` gives the winner's L (n, n_sub) as float32, on demand (see
    :func:`_make_qx_quants_rmse1`).

    The C routine updates ``min`` whenever a candidate wins, and later candidates
    use it, so the candidate loop stays sequential.  Instead of carrying L we
    remember (iscale, min) of the winning candidate and recompute L once.
    Each candidate is four in-place passes for the levels, three sums of
    products and four passes for the error, over two reused (n, n_sub) buffers;
    its per-sub-block arithmetic writes into vectors made once.
    """
    if vecops.numpy_path(X):
        SM, levels = npkquants.make_qkx2_quants(X.numpy(), W.numpy(), nmax, rmin, rdelta, nstep, use_mad, zero_sign)
        return torch.from_numpy(SM), lambda: torch.from_numpy(levels())
    # The sign of a zero min/max never reaches the output (levels, errors and the
    # 6-bit min codes come out the same), so no first-index scan is needed.
    v = vecops._TorchVec
    ns = X.shape[1]
    xmin, mx = v.col_min(X), v.col_max(X)
    La = torch.empty_like(X)  # levels of the current candidate
    A = torch.empty_like(X)
    Xa, Wa, Laa, Aa = (v.arr(T) for T in (X, W, La, A))  # what the sums of products take
    # The least-squares fit needs six products of the sums.  Laid out as
    # F = [sum_x, sum_l, sum_xl, sum_w, sum_l2, sum_x], they are two products of
    # (3, n_sub) views and one broadcast, N = F[3:6]*F[2:5] - sum_l*F[0:3] =
    # [scale numerator, D, min numerator], each with the C operands.
    F = v.empty((6, ns), X)
    sum_l, sum_xl, sum_l2 = F[1], F[2], F[4]
    v.copy(F[3], v.vec(_seq_sum_from_first(W)))
    v.copy(F[0], v.vec(_seq_sum_from_first(W * X)))
    v.copy(F[5], F[0])
    N, P = v.empty((3, ns), X), v.empty((3, ns), X)
    D = N[1]
    cand = v.empty((2, ns), X)  # this_scale, this_min
    this_scale, this_min = cand
    # the winner so far: the (iscale, min) its levels were computed with, its error, scale and min
    state = v.empty((5, ns), X)
    win_isc, win_mn, best_err, best_scale, best_min = state
    isc, err, rng, tmp = v.empty((4, ns), X)
    isc_b, this_scale_b, this_min_b, best_min_b = (v.bcast(r) for r in (isc, this_scale, this_min, best_min))
    steps = _qkx2_candidates(nmax, rmin, rdelta, nstep)

    def ratio_bound(m, rng) -> float:
        """max |x - m| / |rng|: |iscale * (x - m)| <= c * this (float rounding is monotonic).

        inf when some c / rng could overflow (subnormal ranges); NaN propagates.  Either
        sends ``levels`` down the exact path.
        """
        r = v.abs(rng)
        if not v.amin(r) > 1e-30:
            return float("inf")
        b = v.amax(v.abs(m - xmin) / r)
        return max(1.0, b) if b == b else float("inf")

    def levels(isc_b, m_b, bound: float) -> None:
        """La = clamp(nearest_int(isc * (x - m)), 0, nmax) as float32."""
        torch.sub(X, m_b, out=La).mul_(isc_b)
        if bound < _SAFE:  # there nearest_int is round-half-even
            La.round_().clamp_(0, nmax)
        else:
            La.copy_(_round_clamp_exact(La, 0, nmax))

    def err_sum(sc_b, m_b, out) -> None:
        """out = sum of w * f((scale * L + min) - x), f = |.| or square."""
        torch.mul(La, sc_b, out=A).add_(m_b).sub_(X)
        if use_mad:
            A.abs_()
            v.dot(Aa, Wa, out)
        else:
            v.dot3(Aa, Aa, Wa, out)

    def set_range() -> float:
        """rng = max - min of the winner (1 where the column is flat); returns its ratio_bound."""
        v.sub(mx, best_min, out=rng)
        if any_flat:
            v.put(rng, flat, 1.0)
        return ratio_bound(best_min, rng)

    with np.errstate(all="ignore"):  # inf/NaN propagate as in C
        x0 = v.vec(first_min(X, 0)) if zero_sign else xmin
        v.copy(best_min, v.where(x0 > 0, 0.0, x0))
        v.copy(win_mn, best_min)
        flat = mx == best_min  # C returns early: L = 0, scale 0; such columns are never updated
        any_flat = v.any(flat)
        bound = set_range()
        v.rdiv(float(nmax), rng, out=win_isc)
        v.rdiv(1.0, win_isc, out=best_scale)
        levels(v.bcast(win_isc), best_min_b, nmax * bound)
        err_sum(v.bcast(best_scale), best_min_b, best_err)
        v.put(best_err, flat, -np.inf)  # -inf: no candidate beats it
        for c in steps:
            v.rdiv(c, rng, out=isc)
            levels(isc_b, best_min_b, c * bound)
            v.dot(Wa, Laa, sum_l)
            v.dot3(Wa, Laa, Laa, sum_l2)
            v.dot3(Wa, Laa, Xa, sum_xl)
            v.sub(v.mul(F[3:6], F[2:5], out=N), v.mul(F[1:2], F[0:3], out=P), out=N)
            v.div(N[0::2], N[1:2], out=cand)  # this_scale, this_min
            pos = this_min > 0
            if v.any(pos):
                v.put(this_min, pos, 0.0)
                v.put(this_scale, pos, v.div(sum_xl, sum_l2, out=tmp))
            err_sum(this_scale_b, this_min_b, err)
            upd = (D > 0) & (err < best_err)
            if not v.any(upd):
                continue
            v.put(win_isc, upd, isc)
            v.put(win_mn, upd, best_min)
            v.put(best_err, upd, err)
            v.put(best_scale, upd, this_scale)
            v.put(best_min, upd, this_min)
            bound = set_range()
        v.put(best_scale, flat, 0.0)
        v.neg(best_min, out=best_min)  # the_min

    def best_levels() -> torch.Tensor:
        with np.errstate(all="ignore"):
            bound = ratio_bound(win_mn, v.where(flat, 1.0, mx - win_mn))
            levels(v.bcast(win_isc), v.bcast(win_mn), (nmax + 1) * bound)
        return La.mul_((~v.t(flat)).to(_F32)[None])

    return v.t(state[3:5]), best_levels


def _final_levels(Y: torch.Tensor, dl: torch.Tensor, lo: int, hi: int, offset: int, search_levels) -> torch.Tensor:
    """The last pass of the K-quant routines, as uint8 (n, n_sub).

    ``l = nearest_int(y / d)`` clamped to [lo, hi], plus ``offset``, for every
    sub-block whose final scale ``d`` is nonzero; the others keep the levels
    of the search (``search_levels()``, already offset), which are computed
    only when such a sub-block exists.
    """
    if vecops.numpy_path(Y):
        return torch.from_numpy(npkquants.final_levels(Y.numpy(), dl.numpy(), lo, hi, offset,
                                                       lambda: search_levels().numpy()))
    nz = dl != 0
    all_nz = bool(nz.all())
    Q = torch.div(Y, (dl if all_nz else torch.where(nz, dl, torch.ones_like(dl)))[None])
    q_lo, q_hi = torch.aminmax(Q)
    if -_SAFE < float(q_lo) and float(q_hi) < _SAFE:  # round-half-even there; NaN: exact path
        Q.clamp_(lo, hi).round_()
    else:
        Q = _round_clamp_exact(Q, lo, hi)
    if offset:
        Q.add_(offset)
    if not all_nz:
        Q = torch.where(nz[None], Q, search_levels())
    if Q.device.type == "cpu":  # numpy converts 4x faster; the values are small whole numbers
        return torch.from_numpy(Q.numpy().astype(np.uint8))
    return Q.to(torch.uint8)


def make_qp_quants(X: torch.Tensor, nmax: int, W: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``make_qp_quants(n, nmax, x, L, quant_weights=w)`` for every column of ``X`` (n, m).

    Returns (scale (m,), L (n, m) int32 as stored in the C ``uint8_t`` array).
    n is 8 or 16 (a super-block's scales): small vectors, so numpy (a third of
    torch's per-op cost), on CPU whatever the device of the input.  The
    refinement passes run element by element like the C loop; a column that
    changed nothing in a pass is at its fixed point, so passes stop when no
    column changes.
    """
    s, L = _qp_numpy(X.cpu().numpy(), nmax, W.cpu().numpy())
    return torch.from_numpy(s).to(X.device), torch.from_numpy(L).to(X.device)


def _qp_numpy(X: np.ndarray, nmax: int, W: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n, m = X.shape
    f0 = np.float32(0.0)
    mx = np.zeros(m, dtype=np.float32)  # float max = 0; max = MAX(max, x[i]) = max > x ? max : x
    for i in range(n):
        mx = np.where(mx > X[i], mx, X[i])
    zero = mx < _GROUP_MAX_EPS
    with np.errstate(all="ignore"):
        iscale = rdiv(float(nmax), mx)
        L0 = u8(nearest_int(iscale * X)).astype(np.float32)
        scale = rdiv(1.0, iscale)
        d = X - scale * L0
        best = seq_sum_np((W * d) * d)
        # the 8 other candidates side by side, (8, n, m): a few large ops instead of many small ones;
        # each mse is summed along n in C order (numpy adds row after row along a middle axis)
        ISC = np.divide(np.array(_qp_candidates(nmax), dtype=np.float32)[:, None], mx[None])  # (0.1f*is + nmax)/max
        SC = rdiv(1.0, ISC)
        LF = np.minimum(nearest_int(ISC[:, None, :] * X[None]), nmax).astype(np.float32)
        D = X[None] - SC[:, None, :] * LF
        MSE = np.add.reduce((W[None] * D) * D, axis=1, initial=np.float32(0.0)) if m > 1 else \
            np.stack([seq_sum_np(((W * D[k]) * D[k])) for k in range(len(ISC))])
        for k in range(len(ISC)):  # the C loop's choice: each candidate strictly better than the best so far
            upd = MSE[k] < best
            best = np.where(upd, MSE[k], best)
            iscale = np.where(upd, ISC[k], iscale)
        li = np.minimum(nearest_int(iscale * X), nmax)
        lf = li.astype(np.float32)
        WX = W * X
        sumlx = seq_sum_np(WX * lf)
        suml2 = seq_sum_np((W * lf) * lf)
        L = u8(li).astype(np.int32)  # L[i] is a uint8_t
        _qp_refine(X, W, WX, L, sumlx, suml2, nmax)
        scale = np.where(suml2 > 0, sumlx / suml2, f0)
    L[:, zero] = 0
    return np.where(zero, f0, scale).astype(np.float32), L


def _qp_refine(X, W, WX, L, sumlx, suml2, nmax: int) -> None:
    """make_qp_quants' up to 5 passes of one-level moves, in place on L, sumlx, suml2.

    A column that a pass leaves unchanged is at its fixed point; the next pass
    runs only on the columns that changed (smaller arrays: the ops cost less).
    """
    cols = None  # None: every column
    for _ in range(5):
        if cols is None:
            x, w, wx, lv, slx_all, sl2_all = X, W, WX, L, sumlx, suml2
        else:
            x, w, wx, lv = X[:, cols], W[:, cols], WX[:, cols], L[:, cols]
            slx_all, sl2_all = sumlx[cols], suml2[cols]
        changed = np.zeros(lv.shape[1], dtype=bool)
        for i in range(x.shape[0]):
            l = lv[i].astype(np.float32)
            slx = slx_all - wx[i] * l
            sl2 = sl2_all - (w[i] * l) * l
            new_l = np.minimum(nearest_int((x[i] * sl2) / slx), nmax)
            nl = new_l.astype(np.float32)
            slx2 = slx + wx[i] * nl
            sl22 = sl2 + (w[i] * nl) * nl
            upd = (np.minimum(slx, sl2) > 0) & (new_l != lv[i]) & ((slx2 * slx2) * sl2_all > (slx_all * slx_all) * sl22)
            if not np.count_nonzero(upd):
                continue
            changed |= upd
            np.copyto(lv[i], u8(new_l), where=upd, casting="unsafe")
            np.copyto(slx_all, slx2, where=upd)
            np.copyto(sl2_all, sl22, where=upd)
        if cols is not None:  # write the subset back
            L[:, cols], sumlx[cols], suml2[cols] = lv, slx_all, sl2_all
        if not changed.any():
            return
        cols = np.nonzero(changed)[0] if cols is None else cols[changed]


@functools.lru_cache(maxsize=None)
def _qp_candidates(nmax: int) -> tuple[float, ...]:
    """make_qp_quants' numerators ``0.1f*is + nmax`` for is = -4..4, is != 0 (float32)."""
    return tuple(float(np.float32(np.float32(0.1) * np.float32(i)) + np.float32(nmax))
                 for i in (-4, -3, -2, -1, 1, 2, 3, 4))
