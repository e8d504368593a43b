"""Q2_K, Q3_K, Q4_K, Q5_K and Q6_K in numpy alone: the bytes of ``quantize_row_q{2..6}_K_ref``, without torch.

Why: ``import torch`` is ~1.4 s of start-up, more than llama-quantize takes for a small model, and on CPU
these searches run in numpy anyway (a numpy op costs a third of a torch op at the sizes of the per-sub-block
vectors). :mod:`.from_file`'s pool runs these kernels for unweighted K-quants, so ``mtpq quantize`` to them
never imports torch; :mod:`.kquants` and :mod:`.search` (the torch versions, for other devices) call them for
CPU tensors, the importance-weighted searches of :mod:`.weighted` included.

Layout: a chunk of super-blocks ``x`` (n_blocks, 256) is viewed as sub-blocks stored element-major, ``X``
(n, n_sub) with n = 16 or 32, so that "element i of every sub-block" is one contiguous row and every sum
``s += ...`` of the C loops is a row-after-row reduction along axis 0 (:mod:`.cnumpy`). Each search runs its
candidate scales one after the other over a few reused (n, n_sub) buffers, updated in place; the per-sub-block
bookkeeping between them runs on vectors made once. docs/notes/quantize.md records what was measured.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as T

from .cnumpy import (
    GROUP_MAX_EPS, MAGIC, QK_K, SAFE, Dots, absmax_cols, first_absmax, fp16_bits, fp16_round, nearest_int,
    nearest_int_clip_, pos_max, qkx2_candidates, qx_candidates, rdiv, seq_sum, seq_sum_from_first, u8, wrap_i8,
)

_F32 = np.float32
_F0 = np.float32(0.0)

__all__ = ["KERNELS", "quantize_q2_k", "quantize_q3_k", "quantize_q4_k", "quantize_q5_k", "quantize_q6_k"]


# --------------------------------------------------------------------------- layout

def sub_blocks(x: np.ndarray, n: int) -> np.ndarray:
    """(nb, 256) -> (n, nb*256/n): column s is sub-block s, row i its element i."""
    return np.ascontiguousarray(x.reshape(-1, n).T)


def from_sub_blocks(X: np.ndarray, nb: int) -> np.ndarray:
    """Inverse of :func:`sub_blocks` (any dtype)."""
    return np.ascontiguousarray(X.T).reshape(nb, QK_K)


def _clip_big(a: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Clamp a full-size float32 buffer in place (np.clip with float32 bounds: 3x np.maximum with a scalar)."""
    return np.clip(a, np.float32(lo), np.float32(hi), out=a)


def _last_true(B: np.ndarray) -> np.ndarray:
    """Per column, the index (< 128) of the last True row; B[0] is all True.  A max over axis 0 in int8,
    which numpy reduces row by row (argmax along it is slow)."""
    rows = np.arange(B.shape[0], dtype=np.int8)[:, None]
    return np.maximum.reduce(B.view(np.int8) * rows, axis=0).astype(np.int64)


def _take_cols(V: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``V[idx[j], j]`` for every column j (a flat take: take_along_axis is slower)."""
    n = V.shape[1]
    return V.reshape(-1).take(idx * n + np.arange(n))


def _any(m: np.ndarray) -> bool:
    return np.count_nonzero(m) > 0  # several times quicker than ndarray.any() on these vectors


# --------------------------------------------------------------------------- the scale searches

def make_qx_quants_rmse1(X: np.ndarray, nmax: int, W: np.ndarray | None = None
                         ) -> tuple[np.ndarray, Callable[[], np.ndarray]]:
    """``make_qx_quants(n, nmax, x, L, rmse_type=1, qw)`` for every column of ``X``: ``qw = NULL`` (weights
    x*x) when ``W`` is None, else the weights ``W`` (same shape).

    Returns (scale (n_sub,), levels) where ``levels()`` gives L (n, n_sub), float32 in [0, 2*nmax-1]. The 19
    candidate scales do not depend on each other: each is one reused (n, n_sub) buffer of levels reduced to its
    two sums, and the C loop's choice between them -- candidate 0, then each later one that is strictly
    better -- runs afterwards on the (19, n_sub) sums. L is computed only on demand: the caller's last pass
    recomputes it anyway wherever the final sub-block scale is nonzero (see :func:`final_levels`).
    """
    dot, dot3 = Dots.dot, Dots.dot3
    ns = X.shape[1]
    amax, mx, lo, hi = absmax_cols(X)
    zero_v = amax < GROUP_MAX_EPS
    consts = qx_candidates(nmax)
    nc = len(consts)
    L = np.empty_like(X)
    SLX, SL2 = np.empty((2, nc, ns), dtype=_F32)
    with np.errstate(all="ignore"):  # inf/NaN propagate as in C
        if W is None:
            W = X * X
        WX = W * X
        ISC = np.divide(np.array(consts, dtype=_F32)[:, None], mx[None])  # (nc, ns): every candidate's iscale
        # iscale * x lies in [-|c|, |c| * r] (rounding aside), r the largest ratio of the far side of zero to
        # the max; a clamp that cannot act is skipped (columns with max below GROUP_MAX_EPS may hold inf/NaN
        # levels, but they are set to zero below)
        opp = np.where(mx > 0, -lo, hi) / amax
        r = float(np.where(zero_v, _F0, opp).max())
        r = r if r <= 1.0 else float("inf")  # NaN: clamp always
        for k, c in enumerate(consts):
            # |iscale * x| <= nmax + 1 whenever max >= GROUP_MAX_EPS, and there nearest_int is round-half-even
            np.rint(np.multiply(X, ISC[k:k + 1], out=L), out=L)
            low = -c * (1 + 1e-5) > nmax + 0.5  # may round to -nmax-1
            high = -c * r * (1 + 1e-5) >= nmax - 0.5  # may round to nmax
            if low or high:
                _clip_big(L, -nmax if low else -np.inf, nmax - 1 if high else np.inf)
            dot(WX, L, SLX[k])  # sum of (w*x)*l
            dot3(W, L, L, SL2[k])  # sum of (w*l)*l
        NS = np.divide(SLX, SL2)  # each candidate's scale
        np.putmask(NS[0], SL2[0] == 0, 0.0)  # candidate 0: scale = suml2 ? sumlx/suml2 : 0
        Q = np.multiply(NS, SLX)  # its "best" = scale * sumlx
        SQ = np.multiply(SLX, SLX)
        never = ~(SL2 > 0)
        if _any(never):
            np.putmask(SQ, never, -np.inf)  # a candidate with suml2 <= 0 never wins: -inf > y is false
        # the C loop: candidate 0, then each one that is strictly better (a Python step per candidate, but on
        # (n_sub,) vectors of sums); the winner is the last that was better
        best = Q[0].copy()
        better = np.empty((nc, ns), dtype=bool)
        better[0] = True
        tmp = np.empty(ns, dtype=_F32)
        for k in range(1, nc):
            np.greater(SQ[k], np.multiply(best, SL2[k], out=tmp), out=better[k])  # sumlx^2 > best * suml2
            np.putmask(best, better[k], Q[k])
        win = _last_true(better)
        scale = np.where(zero_v, _F0, _take_cols(NS, win))
        best_isc = np.where(zero_v, _F0, _take_cols(ISC, win))

    def levels() -> np.ndarray:
        np.rint(np.multiply(X, best_isc[None], out=L), out=L)
        np.add(_clip_big(L, -nmax, nmax - 1), np.float32(nmax), out=L)
        return np.multiply(L, (~zero_v).astype(_F32)[None], out=L)

    return scale, levels


def make_qkx2_quants(X: np.ndarray, W: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int,
                     use_mad: bool, zero_sign: bool = False) -> tuple[np.ndarray, Callable[[], np.ndarray]]:
    """``make_qkx2_quants`` for every column. Returns ((scale, the_min) as (2, n_sub), levels).

    ``zero_sign``: also get the sign of a zero ``the_min`` right (the C scan keeps the first minimal element,
    -0.0 or 0.0); Q4_1/Q5_1 store the min as fp16, where it shows. ``levels()`` gives the winner's L
    (n, n_sub) as float32, on demand (see :func:`make_qx_quants_rmse1`).

    The C routine updates ``min`` whenever a candidate wins, and later candidates use it, so the candidate loop
    stays sequential. Instead of carrying L we remember (iscale, min) of the winning candidate and recompute L
    once. Each candidate is three in-place passes for the levels, three sums of products and three passes for
    the error, over two reused (n, n_sub) buffers; its per-sub-block arithmetic writes into vectors made once.
    """
    # The sign of a zero min/max never reaches the output (levels, errors and the 6-bit min codes come out the
    # same), so no first-index scan is needed unless zero_sign.
    dot, dot3 = Dots.dot, Dots.dot3
    ns = X.shape[1]
    xmin, mx = np.minimum.reduce(X, axis=0), np.maximum.reduce(X, axis=0)
    La = np.empty_like(X)  # levels of the current candidate
    A = np.empty_like(X)
    # The least-squares fit needs six products of the sums. Laid out as F = [sum_x, sum_l, sum_xl, sum_w,
    # sum_l2, sum_x], they are two products of (3, n_sub) views and one broadcast, N = F[3:6]*F[2:5] -
    # sum_l*F[0:3] = [scale numerator, D, min numerator], each with the C operands.
    F = np.empty((6, ns), dtype=_F32)
    sum_l, sum_xl, sum_l2 = F[1], F[2], F[4]
    with np.errstate(all="ignore"):
        F[3] = seq_sum_from_first(W)
        F[0] = seq_sum_from_first(W * X)
    F[5] = F[0]
    N, P = np.empty((2, 3, ns), dtype=_F32)
    D = N[1]
    cand = np.empty((2, ns), dtype=_F32)  # this_scale, this_min
    this_scale, this_min = cand
    # the winner so far: the (iscale, min) its levels were computed with, its error, scale and min
    state = np.empty((5, ns), dtype=_F32)
    win_isc, win_mn, best_err, best_scale, best_min = state
    isc, err, rng, tmp = np.empty((4, ns), dtype=_F32)
    isc_b, this_scale_b, this_min_b, best_min_b = (r[None] for r in (isc, this_scale, this_min, best_min))
    steps = qkx2_candidates(nmax, rmin, rdelta, nstep)

    def ratio_bound(m, rng) -> float:
        """max |x - m| / |rng|: |iscale * (x - m)| <= c * this (float rounding is monotonic). inf when some
        c / rng could overflow (subnormal ranges); NaN propagates. Either sends ``levels`` down the exact
        path."""
        r = np.abs(rng)
        if not float(r.min()) > 1e-30:
            return float("inf")
        b = float((np.abs(m - xmin) / r).max())
        return max(1.0, b) if b == b else float("inf")

    def levels(isc_b, m_b, bound: float) -> None:
        """La = clamp(nearest_int(isc * (x - m)), 0, nmax) as float32."""
        np.multiply(np.subtract(X, m_b, out=La), isc_b, out=La)
        if bound < SAFE:  # there nearest_int is round-half-even
            _clip_big(np.rint(La, out=La), 0, nmax)
        else:
            La[...] = np.clip(nearest_int(La), 0, nmax)

    def err_sum(sc_b, m_b, out) -> None:
        """out = sum of w * f((scale * L + min) - x), f = |.| or square."""
        np.subtract(np.add(np.multiply(La, sc_b, out=A), m_b, out=A), X, out=A)
        if use_mad:
            np.abs(A, out=A)
            dot(A, W, out)
        else:
            dot3(A, A, W, out)

    def set_range() -> float:
        """rng = max - min of the winner (1 where the column is flat); returns its ratio_bound."""
        np.subtract(mx, best_min, out=rng)
        if any_flat:
            np.putmask(rng, flat, 1.0)
        return ratio_bound(best_min, rng)

    with np.errstate(all="ignore"):  # inf/NaN propagate as in C
        x0 = X[X.argmin(axis=0), np.arange(ns)] if zero_sign else xmin  # the first minimal element
        np.copyto(best_min, np.where(x0 > 0, _F0, x0))
        np.copyto(win_mn, best_min)
        flat = mx == best_min  # C returns early: L = 0, scale 0; such columns are never updated
        any_flat = _any(flat)
        bound = set_range()
        rdiv(float(nmax), rng, out=win_isc)
        rdiv(1.0, win_isc, out=best_scale)
        levels(win_isc[None], best_min_b, nmax * bound)
        err_sum(best_scale[None], best_min_b, best_err)
        np.putmask(best_err, flat, -np.inf)  # -inf: no candidate beats it
        for c in steps:
            rdiv(c, rng, out=isc)
            levels(isc_b, best_min_b, c * bound)
            dot(W, La, sum_l)
            dot3(W, La, La, sum_l2)
            dot3(W, La, X, sum_xl)
            np.subtract(np.multiply(F[3:6], F[2:5], out=N), np.multiply(F[1:2], F[0:3], out=P), out=N)
            np.divide(N[0::2], N[1:2], out=cand)  # this_scale, this_min
            pos = this_min > 0
            if _any(pos):
                np.putmask(this_min, pos, 0.0)
                np.putmask(this_scale, pos, np.divide(sum_xl, sum_l2, out=tmp))
            err_sum(this_scale_b, this_min_b, err)
            upd = (D > 0) & (err < best_err)
            if not _any(upd):
                continue
            np.putmask(win_isc, upd, isc)
            np.putmask(win_mn, upd, best_min)
            np.putmask(best_err, upd, err)
            np.putmask(best_scale, upd, this_scale)
            np.putmask(best_min, upd, this_min)
            bound = set_range()
        np.putmask(best_scale, flat, 0.0)
        np.negative(best_min, out=best_min)  # the_min

    def best_levels() -> np.ndarray:
        with np.errstate(all="ignore"):
            bound = ratio_bound(win_mn, np.where(flat, np.float32(1.0), mx - win_mn))
            levels(win_isc[None], win_mn[None], (nmax + 1) * bound)
        return np.multiply(La, (~flat).astype(_F32)[None], out=La)

    return state[3:5], best_levels


def final_levels(Y: np.ndarray, dl: np.ndarray, lo: int, hi: int, offset: int, search_levels) -> np.ndarray:
    """The last pass of the K-quant routines, as uint8 (n, n_sub): ``l = nearest_int(y / d)`` clamped to
    [lo, hi], plus ``offset``, for every sub-block whose final scale ``d`` is nonzero; the others keep the
    levels of the search (``search_levels()``, already offset), which are computed only when such a sub-block
    exists."""
    nz = dl != 0
    all_nz = bool(nz.all())
    with np.errstate(all="ignore"):
        Q = np.divide(Y, (dl if all_nz else np.where(nz, dl, np.float32(1.0)))[None])
        if -SAFE < float(Q.min()) and float(Q.max()) < SAFE:  # round-half-even there; NaN: exact path
            np.rint(_clip_big(Q, lo, hi), out=Q)
        else:
            Q = np.clip(nearest_int(Q), lo, hi).astype(_F32)
    if offset:
        Q += np.float32(offset)
    if not all_nz:
        Q = np.where(nz[None], Q, search_levels())
    return Q.astype(np.uint8)


# --------------------------------------------------------------------------- Q3_K's search

_Q3_BLOCK = 4096  # columns of the every-row test at a time: its (16, block) temporaries stay in L2


def make_q3_quants(X: np.ndarray, amax: np.ndarray, mx: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """make_q3_quants(do_rmse=true) for every column of the float32 (n, n_sub) ``X``, given each column's
    absolute maximum and first element of that magnitude: (scale, L as int32 in [0, 2*nmax)).

    C's refinement visits the elements of a sub-block one after the other, up to five passes, and an element
    moves only if that lowers the error; the sums it tests against change only when one moves. So each pass
    first tests every element at once against the sums the pass starts with (:func:`_q3_movable`): a sub-block
    where none would move is settled, and C's loop stops there. The element-by-element loop then runs over the
    rest, about a fifth of a random matrix's sub-blocks in the first pass and fewer after. Each element's terms
    of the two sums (``w*x*L`` and ``w*L*L``, w = x*x) are kept rather than recomputed at every visit."""
    with np.errstate(all="ignore"):  # all-zero columns (inf scale; zeroed at the end) and C's slx == 0 cases
        zero = amax < GROUP_MAX_EPS
        iscale = np.divide(np.float32(-nmax), mx)
        L = nearest_int_clip_(X * iscale[None], -nmax, nmax - 1)
        Lf = L.astype(np.float32)
        W = X * X
        WX = W * X
        T1 = WX * Lf  # w*x*L, element by element
        T2 = W * Lf
        T2 *= Lf  # w*L*L
        sumlx, suml2 = seq_sum(T1), seq_sum(T2)
        _q3_refine(X, W, WX, Lf, T1, T2, sumlx, suml2, nmax)
        scale = np.where(suml2 > 0, np.divide(sumlx, suml2), np.float32(0.0))
    scale[zero] = 0.0
    L = Lf.astype(np.int32)
    L += nmax
    L[:, zero] = 0
    return scale, L


def _q3_movable(X, T1, T2, Lf, sumlx, suml2, cols: np.ndarray, nmax: int) -> np.ndarray:
    """Which of ``cols`` hold an element that C's next pass would try to move: ``slx > 0`` and a new level
    other than its own, against the sums as they are (the same float32 operations as :func:`_q3_refine`'s
    loop)."""
    full = len(cols) == X.shape[1]
    found = np.empty(len(cols), dtype=bool)
    for b0 in range(0, len(cols), _Q3_BLOCK):
        idx = slice(b0, b0 + _Q3_BLOCK) if full else cols[b0:b0 + _Q3_BLOCK]
        pick = (lambda A: A[:, idx]) if full else (lambda A: np.take(A, idx, axis=1))  # take: 2.5x A[:, idx]
        slx = np.subtract(sumlx[idx][None], pick(T1))
        sl2 = np.subtract(suml2[idx][None], pick(T2))
        sl2 *= pick(X)
        sl2 /= slx
        new_l = nearest_int_clip_(sl2, -nmax, nmax - 1).astype(np.float32)
        move = new_l != pick(Lf)
        move &= slx > 0
        found[b0:b0 + _Q3_BLOCK] = move.any(axis=0)
    return cols[found]


def _q3_refine(X, W, WX, Lf, T1, T2, sumlx, suml2, nmax: int) -> None:
    """make_q3_quants' refinement passes, in place on ``Lf`` (levels as float32, C-contiguous) and the sums,
    for the columns some pass can change (see :func:`make_q3_quants`). Each pass gathers its columns from the
    previous pass's, and writes its levels and sums back."""
    n, n_sub = X.shape
    arrays, sums = (X, W, WX, Lf, T1, T2), (sumlx, suml2)
    origin = np.arange(n_sub)  # the columns of ``arrays`` in X
    keep = origin
    for _itry in range(5):
        cols = _q3_movable(arrays[0], arrays[4], arrays[5], arrays[3], *sums, keep, nmax)
        if not len(cols):
            break
        Xc, Wc, WXc, Lc, T1c, T2c = (np.take(A, cols, axis=1) for A in arrays)
        sx, s2 = (s[cols] for s in sums)
        origin = origin[cols]
        m = len(cols)
        slx, sl2, q, new, n1, n2, slx2, sl22, a, b = np.empty((10, m), dtype=np.float32)
        upd, ok = np.empty((2, m), dtype=bool)
        changed = np.zeros(m, dtype=bool)
        # constants as arrays: numpy's int32 maximum/minimum with a scalar operand cost 2.5x more per call
        magic, lo, hi = np.full(m, MAGIC, np.float32), np.full(m, -nmax, np.int32), np.full(m, nmax - 1, np.int32)
        qi = q.view(np.int32)
        sub, mul, add, gt, copyto = np.subtract, np.multiply, np.add, np.greater, np.copyto  # bound once
        for i in range(n):
            sub(sx, T1c[i], out=slx)
            sub(s2, T2c[i], out=sl2)
            mul(Xc[i], sl2, out=q)
            q /= slx
            q += magic  # nearest_int, clamped
            qi &= 0x007FFFFF
            qi -= 0x00400000
            np.maximum(qi, lo, out=qi)
            np.minimum(qi, hi, out=qi)
            copyto(new, qi, casting="unsafe")
            np.not_equal(new, Lc[i], out=upd)
            upd &= gt(slx, 0, out=ok)
            if not upd.any():
                continue
            mul(WXc[i], new, out=n1)
            add(slx, n1, out=slx2)
            mul(Wc[i], new, out=n2)
            n2 *= new
            add(sl2, n2, out=sl22)
            upd &= gt(sl22, 0, out=ok)
            mul(slx2, slx2, out=a)
            a *= s2
            mul(sx, sx, out=b)
            b *= sl22
            upd &= gt(a, b, out=ok)  # slx*slx*suml2 > sumlx*sumlx*sl2, C's order
            at = np.flatnonzero(upd)  # a tenth of the columns or fewer: indexing beats masked copies
            Lc[i, at], T1c[i, at], T2c[i, at], sx[at], s2[at] = new[at], n1[at], n2[at], slx2[at], sl22[at]
            changed[at] = True
        Lf.reshape(-1)[(np.arange(n)[:, None] * n_sub + origin).ravel()] = Lc.ravel()  # 2.5x Lf[:, origin] = Lc
        sumlx[origin], suml2[origin] = sx, s2
        arrays, sums = (Xc, Wc, WXc, Lc, T1c, T2c), (sx, s2)
        keep = np.flatnonzero(changed)  # a pass that changed nothing: C stops there


# --------------------------------------------------------------------------- packing (numpy or torch operands)

def pack_2bit(L):
    """(nb, 256) values in [0,3] -> (nb, 64): qs[32h+l] = L[128h+l] | L[128h+l+32]<<2 | ... (ints, unwrapped)"""
    q = L.reshape(-1, 2, 4, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(-1, 64)


def _pack_q3_levels(q: np.ndarray, out: np.ndarray) -> None:
    """Q3_K's levels (uint8 in [0, 8), (nb, 256)) into ``out``'s hmask (bytes 0-31: bit m of byte j is element
    32m + j's third bit) and qs (32-95: :func:`pack_2bit` of the low two bits). On uint32 words of four elements,
    as numpy's uint8 shifts are not vectorised; no bit crosses into the byte above (at most 0x80 / 0xC0)."""
    nb = q.shape[0]
    U = q.view(np.uint32).reshape(nb, 8, 8)  # [block, group of 32 elements, word of 4]
    hi = U >> np.uint32(2)
    hi &= np.uint32(0x01010101)
    hm = hi[:, 0].copy()
    for m in range(1, 8):
        hm |= hi[:, m] << np.uint32(m)
    low = (U & np.uint32(0x03030303)).reshape(nb, 2, 4, 8)  # [block, half, quarter, word]
    qs = low[:, :, 0] | (low[:, :, 1] << np.uint32(2))
    qs |= low[:, :, 2] << np.uint32(4)
    qs |= low[:, :, 3] << np.uint32(6)
    out[:, :32] = hm.view(np.uint8)
    out[:, 32:96] = qs.reshape(nb, 16).view(np.uint8)


def pack_q3_scales(ls):
    """Q3_K's 16 6-bit scale codes (nb, 16) -> (low nibbles (nb, 8), high bits (nb, 4)): byte j < 8 holds codes
    j and j + 8's low nibbles, byte 8 + k the high two bits of codes k, 4 + k, 8 + k, 12 + k."""
    low = (ls[:, :8] & 0xF) | ((ls[:, 8:] & 0xF) << 4)
    hi = (ls >> 4).reshape(-1, 4, 4)  # [group g = j//4, k = j%4]
    return low, hi[:, 0] | (hi[:, 1] << 2) | (hi[:, 2] << 4) | (hi[:, 3] << 6)


def pack_k4_scales(ls, lm) -> list:
    """6-bit (scale, min) pairs of Q4_K/Q5_K, (nb, 8) each -> the three (nb, 4) fields of their 12 bytes."""
    b0 = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    b1 = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    b2 = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    return [b0, b1, b2]


# --------------------------------------------------------------------------- the quantizers

def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    nb = x.shape[0]
    X = sub_blocks(x, 16)
    SM, levels = make_qkx2_quants(X, np.abs(X), 3, -0.5, 0.1, 15, True)
    S, M = SM.reshape(2, nb, 16)
    with np.errstate(all="ignore"):
        max_scale, max_min = pos_max(S, 1), pos_max(M, 1)
        sp, mp = max_scale > 0, max_min > 0
        lsc = np.where(sp[:, None], nearest_int(rdiv(15.0, max_scale)[:, None] * S), 0)
        lmn = nearest_int(rdiv(15.0, max_min)[:, None] * M)
        sbyte = np.where(mp[:, None], lsc | (lmn << 4), lsc) & 0xFF
        d = np.where(sp, fp16_round(max_scale / np.float32(15.0)), _F0)
        dmin = np.where(mp, fp16_round(max_min / np.float32(15.0)), _F0)
        dl = (d[:, None] * (sbyte & 0xF).astype(_F32)).reshape(-1)
        ml = (dmin[:, None] * (sbyte >> 4).astype(_F32)).reshape(-1)
        L = final_levels(X + ml[None], dl, 0, 3, 0, levels)
    qs = u8(pack_2bit(from_sub_blocks(L, nb)))
    return np.concatenate([u8(sbyte), qs, fp16_bits(d), fp16_bits(dmin)], axis=1)


def quantize_q3_k(x: np.ndarray) -> np.ndarray:
    nb = x.shape[0]
    X = sub_blocks(x, 16)
    amax, mx = absmax_cols(X)[:2]
    scales, L = make_q3_quants(X, amax, mx, 4)
    S = scales.reshape(nb, 16)
    with np.errstate(all="ignore"):  # all-zero super-blocks: inf/NaN as in C, zeroed below
        max_scale = first_absmax(S, 1)[1]
        nz = max_scale != 0
        iscale = np.divide(np.float32(-32.0), max_scale)
        ls = np.clip(wrap_i8(nearest_int(iscale[:, None] * S)), -32, 31) + 32
        ls[~nz] = 0  # memset(scales, 0) when max_scale == 0
        d = np.where(nz, fp16_round(np.divide(np.float32(1.0), iscale)), _F0)
        dl = (d[:, None] * (ls - 32).astype(np.float32)).reshape(-1)
        # where a sub-block's scale is not zero its levels are recomputed from it, nearest_int(x/dl) clamped, in
        # x's own layout (the sub-block layout transposed back cost more than the division); the others keep
        # make_q3_quants' levels
        q = np.divide(x.reshape(-1), np.repeat(dl, 16))
    Lx = nearest_int_clip_(q, -4, 3).reshape(-1, 16)
    Lx += 4
    kept = np.flatnonzero(dl == 0)
    if len(kept):
        Lx[kept] = L[:, kept].T
    out = np.empty((nb, 110), dtype=np.uint8)
    _pack_q3_levels(Lx.astype(np.uint8).reshape(nb, QK_K), out)
    out[:, 96:104], out[:, 104:108] = pack_q3_scales(ls)
    out[:, 108:110] = fp16_bits(d)
    return out


def _quantize_q45_k(x: np.ndarray, nmax: int, rmin: float, nstep: int) -> tuple[np.ndarray, np.ndarray]:
    """The 16 head bytes (d, dmin, 6-bit scales and mins) and the levels (nb, 256) of Q4_K / Q5_K."""
    nb = x.shape[0]
    X = sub_blocks(x, 32)
    sum_x2 = Dots.dot(X, X, np.empty(X.shape[1], dtype=_F32))
    av_x = np.sqrt(sum_x2 / np.float32(32.0))  # numpy's float32 sqrt is correctly rounded, as sqrtf
    W = np.abs(X)
    W += av_x[None]  # av_x + |x|
    SM, levels = make_qkx2_quants(X, W, nmax, rmin, 0.1, nstep, False)
    SM = SM.reshape(2, nb, 8)  # scales and mins side by side
    with np.errstate(all="ignore"):
        max_sm = pos_max(SM, 2)
        inv = np.where(max_sm > 0, rdiv(63.0, max_sm), _F0)
        lsm = np.minimum(nearest_int(inv[:, :, None] * SM) & 0xFF, 63)
        dd = fp16_round(max_sm / np.float32(63.0))
        dl, ml = (dd[:, :, None] * lsm.astype(_F32)).reshape(2, -1)
        L = final_levels(X + ml[None], dl, 0, nmax, 0, levels)
    head = np.concatenate([fp16_bits(dd[0]), fp16_bits(dd[1]), *(u8(b) for b in pack_k4_scales(lsm[0], lsm[1]))],
                          axis=1)
    return head, from_sub_blocks(L, nb)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    head, Lb = _quantize_q45_k(x, 15, -1.0, 20)
    q = Lb.reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([head, qs], axis=1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    head, Lb = _quantize_q45_k(x, 31, -0.5, 15)
    q = Lb.reshape(-1, 4, 2, 32)
    lo, hi = q & 0xF, q >> 4  # hi in {0,1}
    qs = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(-1, 128)
    shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(1, 4, 1)
    qh = np.bitwise_or.reduce((hi[:, :, 0] << shifts) | (hi[:, :, 1] << (shifts + 1)), axis=1)
    return np.concatenate([head, qh, qs], axis=1)


def quantize_q6_k(x: np.ndarray, qw_sub: np.ndarray | None = None) -> np.ndarray:
    """``quantize_row_q6_K_ref``, or ``quantize_row_q6_K_impl`` with importance weights ``qw_sub`` (in the
    layout of ``sub_blocks(x, 16)``): the same search with them as its weights."""
    nb = x.shape[0]
    X = sub_blocks(x, 16)
    scales, levels = make_qx_quants_rmse1(X, 32, qw_sub)
    S = scales.reshape(nb, 16)
    amax, max_scale = absmax_cols(np.ascontiguousarray(S.T))[:2]
    zero = amax < GROUP_MAX_EPS
    with np.errstate(all="ignore"):  # all-zero super-blocks: inf/NaN as in C, zeroed below
        iscale = rdiv(-128.0, max_scale)
        d = fp16_round(rdiv(1.0, iscale))
        sc = wrap_i8(np.minimum(nearest_int(iscale[:, None] * S), 127))
        dl = (d[:, None] * sc.astype(_F32)).reshape(-1)
        L = from_sub_blocks(final_levels(X, dl, -32, 31, 32, levels), nb)
    # element 128h + 32g + t; the 32-value groups g and g+2 share bytes: [b, h, g // 2, g % 2, t]
    q = L.reshape(nb, 2, 2, 2, 32)
    lo, hi = q & 0xF, q >> 4
    ql = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(nb, 128)  # g | g+2 << 4, for g = 0, 1
    h2 = hi[:, :, 0] | (hi[:, :, 1] << 4)  # g | g+2 << 4
    qh = (h2[:, :, 0] | (h2[:, :, 1] << 2)).reshape(nb, 64)  # g=0 | g=1 << 2 | g=2 << 4 | g=3 << 6
    out = np.concatenate([ql, qh, u8(sc), fp16_bits(d)], axis=1)
    if _any(zero):
        out[zero] = 0  # memset(0) for an all-zero super-block
    return out


# the kernels of the types this module takes: a float32 (n_blocks, 256) chunk -> uint8 (n_blocks, type size)
KERNELS: dict[T, Callable[[np.ndarray], np.ndarray]] = {
    T.Q2_K: quantize_q2_k, T.Q3_K: quantize_q3_k, T.Q4_K: quantize_q4_k, T.Q5_K: quantize_q5_k,
    T.Q6_K: quantize_q6_k,
}
# values per chunk on one core: the searches' (n, n_sub) buffers stay in L2 at 2**16; Q3_K's refinement loop
# costs per call, so it takes bigger chunks
CHUNK: dict[T, int] = {T.Q2_K: 1 << 16, T.Q3_K: 1 << 18, T.Q4_K: 1 << 16, T.Q5_K: 1 << 16, T.Q6_K: 1 << 16}
