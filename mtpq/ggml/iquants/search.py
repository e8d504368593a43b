"""The grid types' search: signs, candidate scales, nearest grid points (torch, and numpy's exact
candidate scorer on CPU), and the block-packing steps they share."""

from __future__ import annotations

import functools

import numpy as np
import torch
from gguf import GGMLQuantizationType

from ..legacy import div, f32, fp16_bits, nearest_int, rdiv, sqrt_f32
from ..cfloat import _seq_sum
from ..cnumpy import _EINSUM, Dots, seq_sum as _seq_sum_np
from .tables import _device_tables, _F32, _grid, GROUP_MAX_EPS, GROUP_MAX_EPS_IQ3_XXS, QK_K, T


# --------------------------------------------------------------------------- shared steps

def _elem_major(x: torch.Tensor, n: int) -> torch.Tensor:
    """(nb, 256) -> (n, nb*256/n): column s is sub-block s."""
    return x.reshape(-1, n).t().contiguous()


def _signs(X: torch.Tensor, W: torch.Tensor, parity: bool):
    """Signs per group of 8: (xval (n, S), block_signs (n/8, S) int64).

    ``parity`` (IQ2_XXS, IQ2_XS, IQ3_XXS): only 7 sign bits are stored, so an
    odd number of negatives is made even by flipping the value with the smallest
    w*x*x (the first such); otherwise (IQ2_S, IQ3_S) all 8 bits are kept.
    """
    n, S = X.shape
    neg = X < 0
    xval = torch.where(neg, -X, X)
    negg = neg.view(n // 8, 8, S)
    pw = torch.arange(8, device=X.device).view(1, 8, 1)
    s = (negg.to(torch.int64) << pw).sum(1)  # (n/8, S)
    if not parity:
        return xval, s
    odd = (negg.sum(1) % 2) == 1
    ax = (W * X * X).view(n // 8, 8, S)
    imin = ax.argmin(dim=1)  # first minimum: the C loop's strict <
    flip = torch.zeros((n // 8, 8, S), dtype=torch.bool, device=X.device)
    flip.scatter_(1, imin.unsqueeze(1), odd.unsqueeze(1))
    xval = torch.where(flip.view(n, S), -xval, xval)
    s = s ^ (odd.to(torch.int64) << imin)
    return xval, s & 127


def _nearest_neighbours(xg, wg, scale, u, nb, gofs, n_lv, qvals=None):
    """``iq*_find_best_neighbour`` for a batch of off-grid groups.

    xg, wg: (n, gw) values and weights (waux); scale: (n,); u: (n,) lattice
    points; nb: the CSR neighbour table; gofs (gw, n_entries): ``i*n_lv + l_i`` of
    every CSR entry's grid point.  A coordinate can take only ``n_lv`` values, so the
    error terms ``w*diff*diff`` (``diff = scale*q - x``, each rounded as in C)
    are tabulated per group first, (n, gw, n_lv); a neighbour's error is then
    the sequential float sum of ``gw`` table entries.  All (group, neighbour)
    pairs are laid out flat, so no work goes to padding (IQ2_XXS lists hold 1
    to 150 points, 18 on average).  Returns the chosen grid indices (n,): per
    group the first neighbour with the smallest error, as the C loop's strict
    ``<`` picks.  ``qvals`` (n or 1, n_lv): the value of each level (IQ1: the shifted
    -1, 0, 1 of the group).
    """
    start, count, flat = nb
    dev = xg.device
    n, gw = xg.shape
    if qvals is None:  # the grid value of level l is 2*l+1
        qvals = (2 * torch.arange(n_lv, device=dev) + 1).to(_F32).view(1, n_lv)
    diff = scale.view(n, 1, 1) * qvals.unsqueeze(1) - xg.unsqueeze(2)
    table = (wg.unsqueeze(2) * diff * diff).view(-1)  # (n * gw * n_lv)
    cnt = count[u]
    if dev.type == "cpu":  # numpy's gathers and segment reductions cost a half to a third of torch's
        return torch.from_numpy(_nearest_numpy(table.numpy(), u.numpy(), cnt.numpy(), start.numpy(),
                                               flat.numpy(), gofs, gw * n_lv))
    seg = torch.repeat_interleave(torch.arange(n, device=dev), cnt)
    N = seg.shape[0]
    offs = torch.cumsum(cnt, 0) - cnt
    pos = torch.arange(N, device=dev)
    e = pos - offs[seg] + start[u][seg]  # entry of the CSR list
    idx = gofs[:, e] + seg * (gw * n_lv)  # (gw, N) table positions
    d2 = _seq_sum(table[idx])
    segmin = torch.full((n,), float("inf"), dtype=_F32, device=dev).scatter_reduce(0, seg, d2, "amin")
    key = torch.where(d2 == segmin[seg], pos, N)
    first = torch.full((n,), N, dtype=torch.int64, device=dev).scatter_reduce(0, seg, key, "amin")
    return flat[e[first]]


_ROWS: dict[int, tuple[torch.Tensor, np.ndarray]] = {}


def _entry_rows(gofs: torch.Tensor) -> np.ndarray:
    """``gofs`` (gw, n_entries), a cached CPU table, as contiguous numpy rows (n_entries, gw), made once."""
    hit = _ROWS.get(id(gofs))
    if hit is None or hit[0] is not gofs:  # holding the tensor keeps its id from being reused
        hit = _ROWS[id(gofs)] = (gofs, np.ascontiguousarray(gofs.numpy().T))
    return hit[1]


def _nearest_numpy(table, u, cnt, start, flat, gofs, stride):
    n = len(u)
    N = int(cnt.sum())
    offs = np.cumsum(cnt) - cnt
    e = np.arange(N, dtype=np.int64) + np.repeat(start[u] - offs, cnt)
    # an entry's gw offsets are one 32-byte row to copy (a take along axis 1 copies them one by one),
    # and gathering through the transposed view reads each entry's table values together: 2-3x quicker
    idx = np.take(_entry_rows(gofs), e, axis=0)  # (N, gw)
    idx += np.repeat(np.arange(0, n * stride, stride, dtype=idx.dtype), cnt)[:, None]
    vals = np.take(table, idx.T)  # (gw, N), C order
    d2 = np.add.reduce(vals, axis=0)  # row after row: the C sum's order
    segmin = np.minimum.reduceat(d2, offs)
    first = np.minimum.reduceat(np.where(d2 == np.repeat(segmin, cnt), np.arange(N), N), offs)
    return flat[e[first]]


def host(t: torch.Tensor) -> np.ndarray:
    """A tensor as a numpy array on the host (no copy on CPU)."""
    return t.cpu().numpy()


def _make_qp_quants_np(nmax: int, X: np.ndarray, W: np.ndarray) -> np.ndarray:
    """ggml's ``make_qp_quants(32, nmax, x, L, w)`` per column of X (32, S): the scale. In numpy (a
    third of torch's per-call cost); the refinement sweeps run on the columns still changing only.

    L is a ``uint8_t`` array in C: negative levels (x may hold one negative value) are stored
    wrapped (-1 -> 255) and read back so; reproduced."""
    n, S = X.shape
    f = np.float32
    with np.errstate(all="ignore"):
        mx = np.maximum(X.max(0), f(0.0))
        zero = mx < GROUP_MAX_EPS
        iscale = f(nmax) / mx
        Lw = nearest_int(iscale * X) & 255
        diff = X - (f(1.0) / iscale) * Lw.astype(f)
        best_mse = _seq_sum_np((W * diff) * diff)
        for is_ in range(-4, 5):
            if is_ == 0:
                continue
            iscale_is = f(f32(f32(f32(0.1) * is_) + nmax)) / mx
            l = np.minimum(nearest_int(iscale_is * X), nmax)
            diff = X - (f(1.0) / iscale_is) * l.astype(f)
            mse = _seq_sum_np((W * diff) * diff)
            better = mse < best_mse
            best_mse = np.where(better, mse, best_mse)
            iscale = np.where(better, iscale_is, iscale)
        l = np.minimum(nearest_int(iscale * X), nmax)
        lf = l.astype(f)
        sumlx = _seq_sum_np((W * X) * lf)
        suml2 = _seq_sum_np((W * lf) * lf)
        cols = np.arange(S)
        Xa, Wa, La, slx_a, sl2_a = X, W, l & 255, sumlx, suml2
        for _ in range(5):
            changed = np.zeros(len(cols), dtype=bool)
            for i in range(n):
                w, x, Li = Wa[i], Xa[i], La[i]
                Lf = Li.astype(f)
                wx = w * x
                slx = slx_a - wx * Lf
                sl2 = sl2_a - (w * Lf) * Lf
                ok = (slx > 0) & (sl2 > 0)
                new_l = np.minimum(nearest_int((x * sl2) / slx), nmax)
                ok &= new_l != Li
                nf = new_l.astype(f)
                slx = slx + wx * nf
                sl2 = sl2 + (w * nf) * nf
                ok &= (slx * slx) * sl2_a > (slx_a * slx_a) * sl2
                La[i] = np.where(ok, new_l & 255, Li)
                slx_a = np.where(ok, slx, slx_a)
                sl2_a = np.where(ok, sl2, sl2_a)
                changed |= ok
            sumlx[cols], suml2[cols] = slx_a, sl2_a
            keep = np.flatnonzero(changed)
            if not keep.size:
                break
            cols, Xa, Wa, La, slx_a, sl2_a = cols[keep], Xa[:, keep], Wa[:, keep], La[:, keep], slx_a[keep], sl2_a[keep]
        res = np.where(suml2 > 0, sumlx / suml2, f(0.0))
    return np.where(zero, f(0.0), res).astype(f)

# --------------------------------------------------------------------------- the grid search on CPU

_U = 2.0 ** -24  # float32 unit roundoff
_DOT, _DOT3 = Dots.dot, Dots.dot3


_WIDTHS = (2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384)  # padded neighbour-list lengths


@functools.cache
def _host_tables(qtype: GGMLQuantizationType, max_level: int):
    """numpy tables of :class:`_Scorer`: kmap, the grid's q values, each grid point's two half
    codes, the CSR lists, and the lists padded per length class."""
    g = _grid(qtype)
    start, count, flat = g.neighbours(max_level)
    n_grid, gw = g.levels.shape
    # per coordinate, each grid point's q^2 + i*q; the padding point n_grid gets inf + 0i (see _Scorer._runs)
    q = g.values.T.astype(np.float32)
    qpair = np.zeros((gw, n_grid + 1), dtype=np.complex64)
    qpair.real[:, :-1], qpair.imag[:, :-1] = q * q, q
    qpair[0, -1] = np.inf
    # lists of up to w points padded with n_grid: a class's lists are one (w, n_u) table
    cls = np.full(len(g.kmap), -1, dtype=np.int8)
    # index arrays in np.intp: np.take converts any other index type first, a slow path with out=
    row = np.zeros(len(g.kmap), dtype=np.intp)
    pads = []
    lo = 0
    for k, w in enumerate(_WIDTHS):
        us = np.flatnonzero((count > lo) & (count <= w))
        lo = w
        cls[us], row[us] = k, np.arange(len(us))
        pad = np.full((len(us), w), n_grid, dtype=np.intp)
        col = np.arange(w)[None, :]
        ok = col < count[us][:, None]
        pad[ok] = flat[(start[us][:, None] + col)[ok]]
        pads.append(np.ascontiguousarray(pad.T))  # (w, n_u)
    assert count.max() <= _WIDTHS[-1]
    return (g.kmap.astype(np.int32), np.ascontiguousarray(q), qpair, cls, row, pads,
            start, count, flat)


class _Scorer:
    """``iq*_find_best_neighbour`` for the off-grid groups of a chunk, at any scale (CPU, numpy).

    The C loop's error of neighbour j at scale s is the float sum of ``w_i*(s*q_i - x_i)^2``;
    in real numbers that is ``s^2*A_j - 2*s*B_j + sum w x^2`` with A_j = sum w q^2 and
    B_j = sum w x q, which depend on the group but not on s.  A and B of a (group, lattice
    point) pair's neighbours are computed once (per coordinate, the grid point's q^2 and q
    from a small table times the group's w and w*x, summed over the coordinates) for all
    the consecutive candidates at which the group rounds to that point; a candidate then costs a row copy and three flops per
    neighbour instead of gw table lookups and adds.

    That score is not the C float sum, but it is close: with m_i = s*qmax + |x_i| and
    M = sum w_i*m_i^2, the C value is within 14.1u*M of the real one (u = 2^-24: each
    diff has error <= u*(s*q + |diff|) <= 2u*m, w*diff*diff adds 2 roundings, the 7 sums
    7u), and our float32 score (A, B of at most 10 roundings, 3 more ops) within 20u*M.
    A group whose best score beats every other neighbour's by more than 100u*M has the
    same winner in C; the rest (near ties, e.g. from zero weights: a few in a thousand)
    go through the exact C-order sums of :func:`_nearest_numpy`, which also keeps ggml's
    first-in-list choice.
    """

    def __init__(self, qtype, max_level: int, xval: np.ndarray, W: np.ndarray, waux: np.ndarray):
        (self.kmap, self.qcols, self.qpair, self.cls, self.row, self.pads, self.start, self.count,
         self.flat) = _host_tables(qtype, max_level)
        gw = self.qcols.shape[0]
        n, S = xval.shape
        self.gw, self.ng, self.S, self.max_level = gw, n // gw, S, max_level
        self.lweights = (2.0 ** (_grid(qtype).bits * np.arange(gw))).astype(np.float32)
        # coordinate-major copies: column g = k*S + s is group k of sub-block s, so that the sums
        # over a group's coordinates are row after row (not reductions over rows of 4)
        self.xc = np.ascontiguousarray(xval.reshape(self.ng, gw, S).transpose(1, 0, 2)).reshape(gw, -1)
        self.wc = np.ascontiguousarray(waux.reshape(self.ng, gw, S).transpose(1, 0, 2)).reshape(gw, -1)
        # per coordinate and group w + i*(w*x): a neighbour's A + iB is the sum over coordinates of
        # these times its q^2 + i*q, part by part
        self.coef = np.empty(self.xc.shape, dtype=np.complex64)
        self.coef.real = self.wc
        self.coef.imag = self.wc * self.xc
        ax = np.abs(self.xc)
        wax = self.wc * ax
        qmax = np.float32(2 * max_level + 1)
        # M = s^2*qmax^2*sum(w) + 2s*qmax*sum(w|x|) + sum(w x^2), coefficients per group
        self.m2 = self.wc.sum(0) * (qmax * qmax)
        self.m1 = wax.sum(0) * (2 * qmax)
        self.m0 = (wax * ax).sum(0)
        # below 2^-126 the float ops err by up to 2^-150 each, not relatively: a slack of
        # 2^-140*(1+s)^2*p covers every such error of both computations
        self.p = self.m2 + self.m1 + self.m0 + ax.max(0) + np.float32(1.0)
        self.xval, self.W = xval, W
        self.gofs = _device_tables(qtype, max_level, "cpu")[5]
        self.near_code = (np.arange(_WIDTHS[-1], dtype=np.float32) * np.float32(1024) + np.float32(1))
        self.qflat = self.qcols.reshape(-1)
        self.qoffs = (np.arange(gw, dtype=np.intp) * self.qcols.shape[1]).reshape(1, gw, 1)
        self.wx = self.W * self.xval

    def round(self, id_: np.ndarray, scale: np.ndarray, mask: np.ndarray | None = None):
        """Grid index of every group rounded at each candidate ``id_`` (C, S), off-grid ones
        snapped at ``scale`` (C, S).

        All candidates at once, candidate innermost.  Returns (gi (ng, S, C) int32,
        on_grid (ng, S, C)); off-grid groups outside ``mask`` (ng, S, C) keep -1.
        """
        C = id_.shape[0]
        # the level nearest_int((x*id - 1)*0.5), from t = x*id*0.5 - 0.5: where x*id >= 0.5 the
        # two are the same float (the subtractions are exact or round alike), below both levels
        # are 0.  Within nearest_int's range (|t| < 2^22) it is rint (round half to even, as
        # the magic-number add); outside (inf/NaN scales, e.g. a refit at scale 0, whose groups
        # the mask drops) the bit trick as in C.  Clipped levels and the lattice point
        # u = sum l_i << bits*i are small integers, exact in float32.
        with np.errstate(all="ignore"):
            t = self.xval[:, :, None] * id_.T[None]  # (n, S, C)
            t *= np.float32(0.5)
            t -= np.float32(0.5)
            if t.max() <= np.float32(4194303.0):
                np.rint(t, out=t)
            else:
                t = nearest_int(t).astype(np.float32)
            np.clip(t, 0, self.max_level, out=t)
        u = _EINSUM("gisc,i->gsc", t.reshape(self.ng, self.gw, self.S, C), self.lweights).astype(np.int32)
        gi = np.take(self.kmap, u)  # written through a flat view below; take: half a fancy index's time
        on = gi >= 0
        off = ~on if mask is None else (~on & mask)
        # A group keeps its lattice point u over a run of consecutive candidates (5-7 on
        # average): its neighbours' A, B are made once per run.  Scores at scale s are
        # s*(s*A - 2B): divided by s, linear in s, and the margin we demand, divided by s,
        # is convex in s.  So a neighbour that wins with that margin at both ends of a run
        # wins with it at every candidate in between (s is monotonic in the candidate):
        # only the ends are scored, then the inside of the runs whose ends disagree.
        # The runs are found on the dense (ng, S, C) arrays (bool and int32 passes), not on
        # the list of off-grid entries.
        same = off[..., 1:] & off[..., :-1]
        same &= u[..., 1:] == u[..., :-1]  # entry c continues the run of entry c-1
        first, last = off.copy(), off.copy()
        first[..., 1:] &= ~same
        last[..., :-1] &= ~same
        a, b = np.flatnonzero(first), np.flatnonzero(last)  # (k*S + s)*C + c of the run ends
        if not a.size:
            return gi, on
        g = a // C  # the group, k*S + s
        scale_t = np.ascontiguousarray(scale.T).reshape(-1)  # s*C + c
        base = (g % self.S) * C - g * C  # flat entry -> its scale
        s_a = scale_t[base + a]
        runs, out_a, out_b, agree = self._runs(g, u.reshape(-1)[a], s_a, s_a if C == 1 else scale_t[base + b])
        n_run = b - a + 1
        gf = gi.reshape(-1)
        gf[off.reshape(-1)] = np.repeat(out_a, n_run)  # the entries off the grid are the runs, in order
        gf[b] = out_b
        order = runs[-1]  # the runs by length class
        dis = order[(~agree & (n_run > 2))[order]]  # runs whose insides need scoring, by class
        if dis.size:
            m = n_run[dis] - 2
            r = np.repeat(dis, m)
            pos = np.arange(len(r)) + np.repeat(a[dis] + 1 - (np.cumsum(m) - m), m)
            bounds = np.zeros(len(self.pads) + 1, dtype=np.intp)
            bounds[1:] = np.cumsum(np.bincount(runs[2][dis], weights=m, minlength=len(self.pads)))
            gf[pos] = self._pick(runs, r, scale_t[base[r] + pos], bounds)
        return gi, on

    def _runs(self, g, u, s_a, s_b):
        """Per run (group g, lattice point u, scales s_a >= s_b at its ends): the run's table
        (its length class, its column there, the margin at s_a, which bounds it over the run:
        it grows with s; per class the padded neighbour lists and their A + iB, (w, runs) so
        that the reductions over a list are row after row, vectorised over runs), the
        winners at both ends, and whether they are the same, by the margin at both."""
        with np.errstate(all="ignore"):
            margin = np.float32(100 * _U) * ((s_a * s_a * self.m2[g] + s_a * self.m1[g]) + self.m0[g])
            margin += np.float32(2.0 ** -140) * np.square(s_a + np.float32(1.0)) * self.p[g]
        cls = self.cls[u]
        order = np.argsort(cls, kind="stable")
        bounds = np.searchsorted(cls[order], np.arange(len(self.pads) + 1))
        col = np.empty(len(u), dtype=np.int64)
        out_a, out_b = np.empty(len(u), dtype=np.int32), np.empty(len(u), dtype=np.int32)
        unsure_a, unsure_b, tabs = [], [], []
        one = s_b is s_a  # one-candidate runs (the refit): its single scale scored once
        ends = ((s_a, out_a, unsure_a),) if one else ((s_a, out_a, unsure_a), (s_b, out_b, unsure_b))
        for k, pad in enumerate(self.pads):
            o = order[bounds[k]:bounds[k + 1]]
            col[o] = np.arange(len(o))
            if not o.size:
                tabs.append(None)
                continue
            nb = np.take(pad, self.row[u[o]], axis=1)  # (w, R) grid indices, n_grid for padding
            # per coordinate i the q^2, q pairs (gw, w, 2R) times w, w*x of the run's group (gw, 2R),
            # summed over i: one gather and one einsum pass
            qq = np.take(self.qpair, nb, axis=1).view(np.float32)
            cf = np.take(self.coef, g[o], axis=1).view(np.float32)
            ab = _EINSUM("iwr,ir->wr", qq, cf).view(np.complex64)  # (w, R) A + iB
            tabs.append((nb, ab))
            cols = np.arange(len(o))
            for s, out_e, unsure in ends:
                out_e[o], n_near = self._best(nb, ab, cols, s[o], margin[o])
                unsure.append(o[n_near != 1])
        if one:
            return (g, u, cls, col, margin, tabs, order), out_a, out_a, self._exact(g, u, s_a, out_a, unsure_a)
        sure_a, sure_b = self._exact(g, u, s_a, out_a, unsure_a), self._exact(g, u, s_b, out_b, unsure_b)
        return (g, u, cls, col, margin, tabs, order), out_a, out_b, sure_a & sure_b & (out_a == out_b)

    def _best(self, nb, ab, cols, s, margin):
        """The neighbour with the smallest score at scale s among columns ``cols`` of a class's
        table (ab (w, P), already those columns), and how many score within the margin of it."""
        with np.errstate(all="ignore"):
            score = ab.real * (s * s)
            score -= ab.imag * (s * np.float32(2.0))
            # fmin: a padding entry scores inf, or NaN where its group's first weight is 0
            near = np.less_equal(score, np.fmin.reduce(score, axis=0) + margin, out=score)  # 1.0 or 0.0
        # one pass for the count of near neighbours and, where there is one, its position k:
        # sum of near * (1 + 1024k), exact in float32 (< 2^24)
        code = _EINSUM("k,kp->p", self.near_code[:len(near)], near).astype(np.int32)
        n_near = code & 1023
        i = np.minimum(code >> 10, len(near) - 1)  # the others go to the exact sums
        return nb.reshape(-1)[i * nb.shape[1] + cols], n_near

    def _exact(self, g, u, s, out, unsure, r=None):
        """Where no neighbour won by the margin (near ties, or NaN): ggml's C-order sums
        (:func:`_nearest_numpy`), which also keep its first-in-list choice.  Returns sure (m,).
        Entry e is of group g[e], point u[e], or with runs ``r``, of g[r[e]], u[r[e]]."""
        sure = np.ones(len(s), dtype=bool)
        amb = np.concatenate(unsure)
        if amb.size:
            sure[amb] = False
            ra = amb if r is None else r[amb]
            ga = g[ra]
            xg, wg, sa = self.xc[:, ga].T, self.wc[:, ga].T, s[amb]
            qv = np.float32(2) * np.arange(self.max_level + 1, dtype=np.float32) + np.float32(1)
            diff = sa[:, None, None] * qv[None, None, :] - xg[:, :, None]
            table = (wg[:, :, None] * diff) * diff
            ua = u[ra].astype(np.int64)
            out[amb] = _nearest_numpy(table.reshape(-1), ua, self.count[ua], self.start, self.flat, self.gofs,
                                      self.gw * (self.max_level + 1))
        return sure

    def _pick(self, runs, r, s, bounds):
        """Best neighbour for candidates of runs ``r`` (m,) at scales s (m,); the candidates
        come by length class, those of class k at bounds[k]:bounds[k + 1]."""
        g_r, u_r, cls_r, col_r, margin, tabs, _ = runs
        out = np.empty(len(r), dtype=np.int32)
        unsure = []
        for k, tab in enumerate(tabs):
            lo, hi = bounds[k], bounds[k + 1]
            if lo == hi:
                continue
            nb, abk = tab
            rk = r[lo:hi]
            cols = col_r[rk]
            ab = np.take(abk, cols, axis=1)  # (w, P)
            out[lo:hi], n_near = self._best(nb, ab, cols, s[lo:hi], margin[rk])
            unsure.append(lo + np.flatnonzero(n_near != 1))
        self._exact(g_r, u_r, s, out, unsure, r)
        return out

    def sums(self, gi: np.ndarray):
        """The C loop's sumqx = sum w*xval*q, sumq2 = sum w*q*q (sequential) over the grid
        points gi (ng, S, C): (S, C) each.  A candidate whose groups all take the same grid
        points as the one before has its sums (IQ3_XXS: ~60 % of them): only the others are
        summed, q gathered straight into (n, columns) rows, each sum one fused pass
        (:mod:`.cfloat`'s exact einsum)."""
        ng, S, C = gi.shape
        new = np.ones((S, C), dtype=bool)
        new[:, 1:] = (gi[:, :, 1:] != gi[:, :, :-1]).any(0)
        new = new.reshape(-1)
        cols = np.flatnonzero(new)  # s*C + c
        sub = cols // C
        q = np.take(self.qflat, np.take(gi.reshape(ng, -1), cols, axis=1)[:, None] + self.qoffs)
        q = q.reshape(len(self.W), -1)  # (n, K)
        qx = _DOT(np.take(self.wx, sub, axis=1), q, np.empty(len(cols), np.float32))
        q2 = _DOT3(np.take(self.W, sub, axis=1), q, q, np.empty(len(cols), np.float32))
        src = np.cumsum(new) - 1  # the summed candidate each one copies
        return qx[src].reshape(S, C), q2[src].reshape(S, C)


# --------------------------------------------------------------------------- the grid search

class _Spec:
    """What differs between the grid types' ``quantize_row_iq*_impl`` (see each kernel)."""

    def __init__(self, qtype, sb, kmax, parity, eps, steps, step, start, on_grid0, refit,
                 sigma_mul, no_weights, flip_mask):
        self.qtype, self.sb, self.kmax, self.parity, self.eps = qtype, sb, kmax, parity, eps
        self.steps, self.step, self.start, self.on_grid0, self.refit = steps, step, start, on_grid0, refit
        self.sigma_mul, self.no_weights, self.flip_mask = sigma_mul, no_weights, flip_mask


def _search(spec: _Spec, x: torch.Tensor, qw: torch.Tensor | None):
    """Per sub-block: scale (S,), grid indices (ng, S), signs (n/8, S), alive (S,).

    Sub-blocks that the C code skips (all values below ``eps``) are not alive:
    scale 0, and the caller writes nothing for them.
    """
    nb = x.shape[0]
    n = spec.sb
    Xs = x.t().contiguous()  # (256, nb)
    sumx2 = _seq_sum(Xs * Xs)
    sigma2 = div(sumx2 * spec.sigma_mul if spec.sigma_mul != 1 else sumx2, float(QK_K))
    X = _elem_major(x, n)
    sig = sigma2.repeat_interleave(QK_K // n).unsqueeze(0)
    if qw is not None:
        QW = _elem_major(qw.expand(nb, QK_K).to(_F32), n)
        W = QW * sqrt_f32(sig + X * X)
    elif spec.no_weights == "x2":
        W = X * X
    elif spec.no_weights == "sigma":  # IQ2_S: 0.25f*sigma2 + x*x
        W = sig * f32(0.25) + X * X
    else:
        raise ValueError(f"{spec.qtype.name} needs importance weights (an imatrix), as in ggml")
    waux = sqrt_f32(W)
    S = X.shape[1]
    xval, signs = _signs(X, W, spec.parity)
    mx = xval.amax(0)
    alive = (mx > 0) if spec.eps is None else (mx >= spec.eps)
    mxs = torch.where(alive, mx, torch.ones_like(mx))
    kmax = spec.kmax
    if spec.start == "qp":  # IQ2_XXS: the scale of make_qp_quants, and eff_max = scale*kMaxQ
        start = torch.from_numpy(_make_qp_quants_np(kmax + 1, host(xval), host(W))).to(X.device)
        eff = start * kmax
        alive &= eff > 0
        denom = torch.where(alive, eff, torch.ones_like(eff))
    else:
        start = div(mxs, float(2 * kmax - 1))
        denom = mxs
    ids = [f32((2 * kmax - 1) + f32(f32(i) * f32(spec.step))) for i in range(-spec.steps, spec.steps + 1)]
    # The candidate search runs on the host on every device: it is long runs of short passes (bound by
    # per-call cost, not arithmetic), and one search is the one the ggml fuzz tests verify.
    scale, gi = _candidates_np(spec, ids, host(xval), host(W), host(waux), host(denom), host(start))
    scale, gi = torch.from_numpy(scale).to(X.device), torch.from_numpy(gi.astype(np.int64)).to(X.device)
    negs = scale < 0  # "should never happen": flip the scale and the signs
    scale = torch.where(negs, -scale, scale)
    signs = torch.where(negs.unsqueeze(0), (~signs) & spec.flip_mask, signs)
    scale = torch.where(alive, scale, torch.zeros_like(scale))
    return nb, scale, gi, signs, alive


def _candidates_np(spec, ids, xval, W, waux, denom, start):
    """The candidate scales, then the refit: (scale (S,), grid indices (ng, S)). Every candidate's
    groups are rounded and snapped at once (they do not depend on each other), then the C loop's
    choice between them runs on the (S, C) sums."""
    qtype, max_level = spec.qtype, spec.kmax - 1
    sc = _Scorer(qtype, max_level, xval, W, waux)
    S = xval.shape[1]
    with np.errstate(all="ignore"):
        id_ = np.array(ids, dtype=np.float32)[:, None] / denom[None, :]  # (C, S)
        gi, on = sc.round(id_, np.float32(1.0) / id_)
        sumqx, sumq2 = sc.sums(gi)
        best = np.zeros(S, dtype=np.float32)
        scale = start.copy()
        pick = np.full(S, -1)
        for c in range(len(ids)):
            qx, q2 = sumqx[:, c], sumq2[:, c]
            take = (q2 > 0) & (qx * qx > best * q2)
            new_scale = qx / q2
            scale = np.where(take, new_scale, scale)
            best = np.where(take, new_scale * qx, best)
            pick = np.where(take, c, pick)
        # no candidate taken: L stays all 0 and every group counts as on the grid (as on_grid0)
        none = pick < 0
        p = np.maximum(pick, 0)[None, :, None]
        gi_best = np.where(none, sc.kmap[0], np.take_along_axis(gi, p, 2)[..., 0])
        on_best = np.where(none, spec.on_grid0, np.take_along_axis(on, p, 2)[..., 0])
        pos = scale > 0
        if spec.refit == "all":  # IQ2_XXS: every group, whenever scale > 0
            need = pos
            mask = np.broadcast_to(need, on_best.shape)
        elif spec.refit == "all_if_off":  # IQ3_S: every group, if any was off the grid
            need = pos & (~on_best).any(0)
            mask = np.broadcast_to(need, on_best.shape)
        else:  # only the groups that were off the grid
            need = pos & (~on_best).any(0)
            mask = need & ~on_best
        if need.any():
            gi, _ = sc.round(np.float32(1.0) / scale[None, :], scale[None, :], mask[..., None])
            gi_best = np.where(mask, gi[..., 0], gi_best)
            sumqx, sumq2 = sc.sums(gi_best[..., None])
            scale = np.where(need & (sumq2[:, 0] > 0), sumqx[:, 0] / sumq2[:, 0], scale)
    if (gi_best < 0).any():
        raise RuntimeError(f"{qtype.name}: a point off the grid after the search (ggml aborts here too)")
    return scale, gi_best

def _grid_index_of(qtype, L, max_level):
    """kmap lookup of final levels (the C code's last loop; it aborts on an off-grid point)."""
    kmap, _, values, _, shifts, _ = _device_tables(qtype, max_level, L.device.type)
    gw = values.shape[1]
    n, S = L.shape
    u = (L.view(n // gw, gw, S) << shifts.view(1, gw, 1)).sum(1)
    gi = kmap[u]
    if bool((gi < 0).any()):
        raise RuntimeError(f"{qtype.name}: a point off the grid after the search (ggml aborts here too)")
    return gi


def _super_scales(scales: torch.Tensor, nb: int, fudge: float | None):
    """d = max_scale/31 (stored times ``fudge``) and the 4-bit sub-block scales (nb, n_sub) int64.

    Returns (empty (nb,) bool: max_scale == 0, the fp16 bytes of d (0 where empty), scales).
    """
    sc = scales.view(nb, -1)
    max_scale = sc.amax(1)
    d = div(max_scale, 31.0)
    dstore = d * f32(fudge) if fudge is not None else d
    id_ = rdiv(1.0, d).unsqueeze(1)
    l = nearest_int((id_ * sc - 1) * 0.5).clamp(0, 15).to(torch.int64)
    empty = max_scale == 0
    dstore = torch.where(empty, torch.zeros_like(dstore), dstore)
    return empty, fp16_bits(dstore), l


def _le_bytes(v: torch.Tensor, width: int) -> torch.Tensor:
    """(..., k) int64 holding unsigned ``width``-byte values -> (..., width*k) little-endian uint8."""
    b = torch.stack([(v >> (8 * j)) & 255 for j in range(width)], -1)
    return b.reshape(*v.shape[:-1], -1).to(torch.uint8)


def _finish(empty, dbytes, body):
    body = torch.where(empty.unsqueeze(1), torch.zeros_like(body), body)
    return torch.cat([dbytes, body], 1)


def _col(v, nb):
    """(k, S) per-sub-block values -> (nb, n_sub, k)."""
    return v.t().reshape(nb, -1, v.shape[0])


def _shifted(v, bits):
    """sum_k v[k] << bits*k along dim 0."""
    sh = (bits * torch.arange(v.shape[0], device=v.device)).view(-1, *([1] * (v.dim() - 1)))
    return (v << sh).sum(0)


def _zero_dead(v, alive):
    return torch.where(alive, v, torch.zeros_like(v))


_IQ2_XXS = _Spec(T.IQ2_XXS, 32, 3, True, GROUP_MAX_EPS, 6, 0.1, "qp", True, "all", 1, None, 127)
_IQ2_XS = _Spec(T.IQ2_XS, 16, 3, True, GROUP_MAX_EPS, 9, 0.1, "max", True, "off", 1, None, 127)
_IQ2_S = _Spec(T.IQ2_S, 16, 3, False, f32(1e-8), 9, 0.1, "max", True, "off", 2, "sigma", 255)
_IQ3_XXS = _Spec(T.IQ3_XXS, 32, 8, True, GROUP_MAX_EPS_IQ3_XXS, 15, 0.2, "max", True, "off", 2, "x2", 127)
_IQ3_S = _Spec(T.IQ3_S, 32, 8, False, None, 9, 0.2, "max", False, "all_if_off", 2, "x2", 255)
