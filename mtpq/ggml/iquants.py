"""ggml-exact i-quants (IQ2_XXS, IQ3_XXS, ...) in torch, vectorised over blocks.

Reproduces byte for byte ``ggml_quantize_chunk`` for these types with an
importance vector (``quantize_row_iq2_xxs_impl`` / ``quantize_row_iq3_xxs_impl``
in ``ggml/src/ggml-quants.c``), and without one where ggml allows it (IQ3_XXS
then weights by x^2; IQ2_XXS requires one, as in ggml).

The method, shared by the grid types: every 32-value sub-block gets its signs
fixed first (an even number of negatives per group of 8: the cheapest value,
by weight*x^2, is flipped), then a set of candidate scales is tried; for each,
every group of ``gw`` values (8 for IQ2, 4 for IQ3) is rounded to the nearest
lattice point, and a point that is not on the type's grid is replaced by the
best of its precomputed grid neighbours (smallest weighted squared error at
that scale).  The candidate with the best least-squares score wins, then the
groups are refitted once at the winning scale.

Tables: the grids come from gguf-py's dequantizer tables (``gguf.quants``);
the lattice-point -> grid-index map and the neighbour lists are computed from
them exactly as ``iq2xs_init_impl`` / ``iq3xs_init_impl`` do (all grid points
at the ``nwant`` smallest integer distances, ordered by distance then index),
but only for the lattice points the search can reach.

Layout: sub-blocks are processed element-major, ``X`` of shape (32, S), so
the C loops' sequential float sums are numpy reductions along axis 0
(:func:`mtpq.ggml.cfloat._seq_sum`), and a group of ``gw`` values is a
run of rows.  The neighbour search is done only for the groups that are off
the grid, all their neighbours at once (lists padded with +inf errors);
``argmin`` returns the first minimum, which is the C loop's strict ``<``.  On CPU
the grid types' candidate loop runs in numpy instead (:func:`_candidates_np`,
:class:`_Scorer`): all candidates at once, neighbours scored from per-group sums
and decided exactly only where a proven error bound leaves a near tie.
Float rules as in :mod:`mtpq.ggml.legacy` (one IEEE op at a time, in the
C order, ``nearest_int`` bit trick, C integer wrap-around).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gq

from .cfloat import _EINSUM, _EINSUM_EXACT, _dot3_einsum, _dot3_reduce, _dot_einsum, _dot_reduce, _seq_sum
from .cfloat import seq_sum_np as _seq_sum_np
from .legacy import div, f32, fp16_bits, from_fp16_bytes, nearest_int, rdiv, sqrt_f32

__all__ = [
    "quantize_iq2_xxs", "quantize_iq2_xs", "quantize_iq2_s", "quantize_iq3_xxs", "quantize_iq3_s",
    "quantize_iq1_s", "quantize_iq1_m", "dequantize_iq1_s", "dequantize_iq1_m", "prepare",
    "dequantize_iq2_xxs", "dequantize_iq2_xs", "dequantize_iq2_s", "dequantize_iq3_xxs", "dequantize_iq3_s",
    "REQUIRES_WEIGHTS",
]

QK_K = 256
_F32 = torch.float32
T = GGMLQuantizationType

# types whose ggml quantizer aborts without importance weights
REQUIRES_WEIGHTS = frozenset({T.IQ2_XXS, T.IQ2_XS, T.IQ1_S})

GROUP_MAX_EPS = f32(1e-15)
GROUP_MAX_EPS_IQ3_XXS = f32(1e-8)


# --------------------------------------------------------------------------- tables

class _Grid:
    """One type's grid as the quantizer sees it (``iq2xs_init_impl`` / ``iq3xs_init_impl``).

    ``levels`` (n_grid, gw) int: the lattice coordinate l of each grid value
    (the quantizer's value is 2*l+1); ``kmap`` (bits**gw,) int64: grid index of
    a lattice point ``u = sum l_i << bits*i`` or -1; ``nb`` (bits**gw, M) int64:
    the neighbour list of an off-grid point, padded with -1.
    """

    def __init__(self, qcls, bits: int, nwant: int):
        qcls.init_grid()
        g = np.asarray(qcls.grid, dtype=np.float32).reshape(qcls.grid_shape)
        gmap = np.asarray(qcls.grid_map, dtype=np.float32)
        levels = np.argmax(g[..., None] == gmap, axis=-1)  # grid value -> its index in grid_map
        assert np.all(gmap[levels] == g)
        self.gw = g.shape[1]
        self.bits = bits
        self.levels = levels.astype(np.int64)
        self.values = (2 * self.levels + 1).astype(np.int64)  # kgrid_q2xs / kgrid_q3xs bytes
        shifts = bits * np.arange(self.gw)
        kmap_size = 1 << (bits * self.gw)
        kmap = np.full(kmap_size, -1, dtype=np.int64)
        kmap[(self.levels << shifts).sum(axis=1)] = np.arange(len(g))
        self.kmap = kmap
        self.shifts = shifts
        self._nwant = nwant
        self._nb_cache: dict[int, np.ndarray] = {}

    def neighbours(self, max_level: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Neighbour lists of the off-grid points with all l <= max_level, as CSR.

        Returns (start, count, flat): the list of lattice point u is
        ``flat[start[u]:start[u] + count[u]]`` (count 0 for points not reached).
        """
        if max_level in self._nb_cache:
            return self._nb_cache[max_level]
        n_lv = max_level + 1
        pts = np.stack(np.meshgrid(*[np.arange(n_lv)] * self.gw, indexing="ij"), -1).reshape(-1, self.gw)
        u = (pts << self.shifts).sum(axis=1)
        off = self.kmap[u] < 0
        pts, u = pts[off], u[off]
        pos = (2 * pts + 1).astype(np.float32)
        vals = self.values.astype(np.float32)
        ng = len(vals)
        # squared integer distances to every grid point, by a (exact: small integers) matmul
        d2 = ((vals * vals).sum(1)[None, :] - 2 * (pos @ vals.T) + (pos * pos).sum(1)[:, None]).astype(np.int64)
        # the nwant-th smallest distinct distance of each point, from a presence table of distances
        present = np.zeros((len(u), int(d2.max()) + 1), dtype=bool)
        present[np.arange(len(u))[:, None], d2] = True
        thr = np.argmax(np.cumsum(present, axis=1) >= self._nwant, axis=1)
        # the kept grid points, per point ordered by (distance, index) as ggml's qsort leaves them
        rows, cols = np.nonzero(d2 <= thr[:, None])
        key = (rows * (d2.max() + 1) + d2[rows, cols]) * ng + cols
        o = np.argsort(key, kind="stable")
        rows, cols = rows[o], cols[o]
        cnt = np.bincount(rows, minlength=len(u))
        start = np.zeros(len(self.kmap), dtype=np.int64)
        count = np.zeros(len(self.kmap), dtype=np.int64)
        count[u] = cnt
        start[u] = np.cumsum(cnt) - cnt
        flat = cols
        self._nb_cache[max_level] = (start, count, flat.astype(np.int64))
        return self._nb_cache[max_level]


@functools.cache
def _grid(qtype: GGMLQuantizationType) -> _Grid:
    if qtype == T.IQ2_XXS:
        return _Grid(gq.IQ2_XXS, 2, 2)
    # (bits per lattice coordinate, nwant) as in iq2xs_init_impl / iq3xs_init_impl
    if qtype in (T.IQ1_S, T.IQ1_M):  # one grid for both
        return _Grid(gq.IQ1_S, 2, 3)
    bits, nwant = {T.IQ2_XS: (2, 2), T.IQ2_S: (2, 1), T.IQ3_XXS: (3, 2), T.IQ3_S: (3, 3)}[qtype]
    return _Grid(getattr(gq, qtype.name), bits, nwant)


@functools.cache
def _device_tables(qtype: GGMLQuantizationType, max_level: int, device: str):
    g = _grid(qtype)
    nb = tuple(torch.from_numpy(a).to(device) for a in g.neighbours(max_level))
    return (
        torch.from_numpy(g.kmap).to(device),
        nb,
        torch.from_numpy(g.values.astype(np.float32)).to(device),
        torch.from_numpy(g.levels).to(device),
        torch.from_numpy(g.shifts).to(device),
        # per CSR entry (a grid point), gofs[i] = i*n_lv + l_i: its table offset for coordinate i
        torch.from_numpy((np.arange(g.gw)[:, None] * (max_level + 1) + g.levels[g.neighbours(max_level)[2]].T)
                         .astype(np.int32)).to(device),
    )


_MAX_LEVEL = {T.IQ2_XXS: 2, T.IQ2_XS: 2, T.IQ2_S: 2, T.IQ3_XXS: 7, T.IQ3_S: 7, T.IQ1_S: 2, T.IQ1_M: 2}


def prepare(qtype: GGMLQuantizationType, device: str = "cpu") -> None:
    """Build the type's grid tables now (0.3-3 s, like ggml_quantize_init), e.g. before
    forking workers, which would otherwise each build their own."""
    if qtype in _MAX_LEVEL:
        _device_tables(GGMLQuantizationType(qtype), _MAX_LEVEL[qtype], device)


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
_DOT, _DOT3 = (_dot_einsum, _dot3_einsum) if _EINSUM_EXACT else (_dot_reduce, _dot3_reduce)


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


# --------------------------------------------------------------------------- packing, per type

def quantize_iq2_xxs(x: torch.Tensor, qw: torch.Tensor | None = None) -> torch.Tensor:
    """(nb, 256) float32 (and importance (nb or 1, 256)) -> (nb, 66) uint8 IQ2_XXS blocks.

    Per sub-block two uint32: four 8-bit grid indices; four 7-bit signs and the 4-bit scale.
    """
    nb, scale, gi, signs, alive = _search(_IQ2_XXS, x, qw)
    q0 = _zero_dead(_shifted(gi, 8), alive)
    q1 = _zero_dead(_shifted(signs, 7), alive)
    empty, d, l = _super_scales(scale, nb, None)
    q = torch.stack([q0.view(nb, 8), q1.view(nb, 8) | (l << 28)], -1).reshape(nb, 16)
    return _finish(empty, d, _le_bytes(q, 4))


def quantize_iq2_xs(x: torch.Tensor, qw: torch.Tensor | None = None) -> torch.Tensor:
    """(nb, 256) float32 (and importance) -> (nb, 74) uint8 IQ2_XS blocks.

    Per group of 8 a uint16: 9-bit grid index | 7-bit signs << 9; then 4-bit scales, two a byte.
    """
    nb, scale, gi, signs, alive = _search(_IQ2_XS, x, qw)
    q = _zero_dead(gi | (signs << 9), alive.unsqueeze(0))  # (2, S)
    empty, d, l = _super_scales(scale, nb, None)
    sc = l.view(nb, 8, 2)
    return _finish(empty, d, torch.cat([_le_bytes(q.t().reshape(nb, 32), 2),
                                         (sc[..., 0] | (sc[..., 1] << 4)).to(torch.uint8)], 1))


def quantize_iq2_s(x: torch.Tensor, qw: torch.Tensor | None = None) -> torch.Tensor:
    """(nb, 256) float32 (and optional importance) -> (nb, 82) uint8 IQ2_S blocks.

    qs: 32 low bytes of the 10-bit grid indices, then 32 sign bytes; qh: their high 2 bits,
    four a byte; then 4-bit scales, two a byte.
    """
    nb, scale, gi, signs, alive = _search(_IQ2_S, x, qw)
    gi = _zero_dead(gi, alive.unsqueeze(0))
    signs = _zero_dead(signs, alive.unsqueeze(0))
    g = gi.t().reshape(nb, 32)
    qh = _shifted((g >> 8).view(nb, 8, 4).permute(2, 0, 1), 2)
    empty, d, l = _super_scales(scale, nb, f32(0.9875))
    sc = _zero_dead(l, ~empty.unsqueeze(1)).view(nb, 8, 2)
    # ggml writes qs/signs/qh straight into the block: a block whose scales are all 0 keeps them
    return torch.cat([d, (g & 255).to(torch.uint8), signs.t().reshape(nb, 32).to(torch.uint8),
                      qh.to(torch.uint8), (sc[..., 0] | (sc[..., 1] << 4)).to(torch.uint8)], 1)


def quantize_iq3_xxs(x: torch.Tensor, qw: torch.Tensor | None = None) -> torch.Tensor:
    """(nb, 256) float32 (and optional importance) -> (nb, 98) uint8 IQ3_XXS blocks.

    64 bytes of 8-bit grid indices, then per sub-block a uint32: four 7-bit signs, 4-bit scale.
    """
    nb, scale, gi, signs, alive = _search(_IQ3_XXS, x, qw)
    q3 = _zero_dead(gi, alive.unsqueeze(0))  # (8, S)
    ss = _zero_dead(_shifted(signs, 7), alive)
    empty, d, l = _super_scales(scale, nb, f32(1.0125))
    ss = ss.view(nb, 8) | (l << 28)
    body = torch.cat([q3.t().reshape(nb, 64).to(torch.uint8), _le_bytes(ss, 4)], 1)
    return _finish(empty, d, body)


def quantize_iq3_s(x: torch.Tensor, qw: torch.Tensor | None = None) -> torch.Tensor:
    """(nb, 256) float32 (and optional importance) -> (nb, 110) uint8 IQ3_S blocks.

    qs: 64 low bytes of the 9-bit grid indices; qh: their high bits, one byte per
    sub-block; 32 sign bytes; 4-bit scales, two a byte.  ggml advances its qs and
    signs pointers only for sub-blocks it does not skip (all-zero ones), so the
    later sub-blocks' bytes move up over a skipped one's: reproduced.
    """
    nb, scale, gi, signs, alive = _search(_IQ3_S, x, qw)
    gi = _zero_dead(gi, alive.unsqueeze(0))
    signs = _zero_dead(signs, alive.unsqueeze(0))
    g = _col(gi, nb)  # (nb, 8, 8)
    qh = _shifted((g >> 8).permute(2, 0, 1), 1)  # (nb, 8)
    al = alive.view(nb, 8)
    dest = torch.cumsum(al.to(torch.int64), 1) - 1  # slot of each kept sub-block
    dest = torch.where(al, dest, torch.full_like(dest, 8))  # skipped ones go to a spill slot
    qs = torch.zeros((nb, 9, 8), dtype=torch.int64, device=x.device)
    qs.scatter_(1, dest.unsqueeze(2).expand(nb, 8, 8), g & 255)
    sg = torch.zeros((nb, 9, 4), dtype=torch.int64, device=x.device)
    sg.scatter_(1, dest.unsqueeze(2).expand(nb, 8, 4), _col(signs, nb))
    empty, d, l = _super_scales(scale, nb, f32(1.033))
    sc = _zero_dead(l, ~empty.unsqueeze(1)).view(nb, 4, 2)
    # ggml writes qs/qh/signs straight into the block: a block whose scales are all 0 keeps them
    body = torch.cat([qs[:, :8].reshape(nb, 64), qh, sg[:, :8].reshape(nb, 32),
                      sc[..., 0] | (sc[..., 1] << 4)], 1).to(torch.uint8)
    return torch.cat([d, body], 1)


# --------------------------------------------------------------------------- IQ1_S / IQ1_M

IQ1_DELTA = f32(0.125)
_X_P = (f32(-1 + IQ1_DELTA), IQ1_DELTA, f32(1 + IQ1_DELTA))
_X_M = (f32(-1 - IQ1_DELTA), -IQ1_DELTA, f32(1 - IQ1_DELTA))


def _scan(qx: np.ndarray, q2: np.ndarray, start: np.ndarray):
    """The C loop ``if (q2 > 0 && qx*qx > best*q2) { scale = qx/q2; best = scale*qx; pick = c; }``
    over candidates c (rows of qx, q2: (C, S)), in order, starting with best = -FLT_MAX.

    Returns (pick (S,) int, -1 if none; scale (S,), ``start`` if none).  The running best
    makes it sequential over candidates; it is vectorised over sub-blocks.
    """
    S = qx.shape[1]
    best = np.full(S, -np.finfo(np.float32).max, dtype=np.float32)
    scale = start.copy()
    pick = np.full(S, -1, dtype=np.int64)
    with np.errstate(all="ignore"):
        for c in range(qx.shape[0]):
            a, b = qx[c], q2[c]
            ok = (b > 0) & (a * a > best * b)
            if ok.any():
                sc = a / b
                scale = np.where(ok, sc, scale)
                best = np.where(ok, sc * a, best)
                pick[ok] = c
    return pick, scale


def _iq1_prepare(x, qw, n):
    nb = x.shape[0]
    Xs = x.t().contiguous()
    sumx2 = _seq_sum(Xs * Xs)
    sigma2 = div(sumx2 * 2, float(QK_K))
    X = _elem_major(x, n)
    if qw is None:
        W = X * X
    else:
        QW = _elem_major(qw.expand(nb, QK_K).to(_F32), n)
        W = QW * sqrt_f32(sigma2.repeat_interleave(QK_K // n).unsqueeze(0) + X * X)
    return nb, X, W


def _iq1_sorted_sums(X, W):
    """Stable ascending order of each sub-block's values (glibc 2.36's qsort is a merge sort),
    and the running sums of w*x and w in that order, 0 first: (order (n, S), wx (n, S), w (n, S))."""
    Xn, Wn = X.cpu().numpy(), W.cpu().numpy()
    order = np.argsort(Xn, axis=0, kind="stable")
    return order, np.take_along_axis(Wn * Xn, order, 0), np.take_along_axis(Wn, order, 0)


def _iq1_levels(order, i1, i2, n):
    """L[order[j]] = 0 for j < i1, 1 for i1 <= j < i2, 2 above."""
    j = np.arange(n)[:, None]
    lv_sorted = (j >= i1[None, :]).astype(np.int64) + (j >= i2[None, :])
    L = np.empty_like(lv_sorted)
    np.put_along_axis(L, order, lv_sorted, 0)
    return L


def _iq1_snap(qtype, X, W, L, scale, xx_per_group):
    """Groups of 8 off the grid go to the best neighbour (``iq1_find_best_neighbour2``).

    xx_per_group: (ng, S, 3) float32 level values.  Returns (grid index (ng, S), all_on (S,)).
    """
    kmap, nb, values, levels, shifts, gofs = _device_tables(qtype, 2, X.device.type)
    n, S = X.shape
    ng = n // 8
    u = (L.view(ng, 8, S) << shifts.view(1, 8, 1)).sum(1)
    gi = kmap[u]
    off = gi < 0
    if bool(off.any()):
        k_idx, s_idx = off.nonzero(as_tuple=True)
        xg = X.view(ng, 8, S)[k_idx, :, s_idx]
        wg = W.view(ng, 8, S)[k_idx, :, s_idx]
        gi[k_idx, s_idx] = _nearest_neighbours(xg, wg, scale[s_idx], u[k_idx, s_idx], nb, gofs, 3,
                                               xx_per_group[k_idx, s_idx])
    return gi, ~off.any(0)


def _iq1_refit(qtype, X, W, gi, scale, xx_per_group, need):
    """``if (!all_on_grid)``: scale = sumqx/sumq2 over the snapped points, if both are > 0."""
    _, _, _, levels, _, _ = _device_tables(qtype, 2, X.device.type)
    n, S = X.shape
    ng = n // 8
    lv = levels[gi]  # (ng, S, 8)
    q = torch.gather(xx_per_group, 2, lv)  # (ng, S, 8)
    q = q.permute(0, 2, 1).reshape(n, S)
    wq = W * q
    sumqx, sumq2 = _seq_sum(wq * X), _seq_sum(wq * q)
    ok = need & (sumqx > 0) & (sumq2 > 0)
    return torch.where(ok, div(sumqx, sumq2), scale)


def quantize_iq1_s(x: torch.Tensor, qw: torch.Tensor | None = None) -> torch.Tensor:
    """(nb, 256) float32 and importance -> (nb, 50) uint8 IQ1_S blocks (``quantize_row_iq1_s_impl``).

    Per 32-value sub-block the values go to -1, 0, 1 (+-delta): the best two cut points in
    sorted order are searched exhaustively (561 splits x 2 shifts), then groups of 8 are
    snapped to the 2048-point grid.  qs: low bytes of four 11-bit indices; qh (uint16): their
    high 3 bits, the 3-bit scale << 12, the shift's sign << 15.
    """
    if qw is None:
        raise ValueError("IQ1_S needs importance weights (an imatrix), as in ggml")
    n = 32
    nb, X, W = _iq1_prepare(x, qw, n)
    S = X.shape[1]
    dev = x.device
    mx = X.abs().amax(0)
    alive = (mx >= f32(1e-12)).cpu().numpy()
    order, wx, w = _iq1_sorted_sums(X, W)
    z = np.zeros((1, S), np.float32)
    sx = np.add.accumulate(np.concatenate([z, wx]), axis=0)  # (33, S): sumx[0..32]
    sw = np.add.accumulate(np.concatenate([z, w]), axis=0)
    i1s, i2s = np.triu_indices(n + 1)  # i1 outer, i2 >= i1 inner: the C loop order
    A, B, C = sx[i1s] - sx[0], sx[i2s] - sx[i1s], sx[n] - sx[i2s]
    Aw, Bw, Cw = sw[i1s] - sw[0], sw[i2s] - sw[i1s], sw[n] - sw[i2s]
    qx, q2 = [], []
    for xv in (_X_P, _X_M):
        p0, p1, p2 = (np.float32(v) for v in xv)
        qx.append(A * p0 + B * p1 + C * p2)
        q2.append(Aw * p0 * p0 + Bw * p1 * p1 + Cw * p2 * p2)
    # candidates in C order: per (i1, i2) first x_p then x_m
    qx = np.stack(qx, 1).reshape(-1, S)
    q2 = np.stack(q2, 1).reshape(-1, S)
    pick, scale = _scan(qx, q2, mx.cpu().numpy())
    found = alive & (pick >= 0)
    pk = np.maximum(pick, 0)
    shift = np.where(pk % 2 == 0, 1, -1)
    L = _iq1_levels(order, i1s[pk // 2], i2s[pk // 2], n)
    neg = scale < 0
    L = np.where(neg[None, :], 2 - L, L)
    scale = np.where(neg, -scale, scale)
    shift = np.where(neg, -shift, shift)
    xp, xm = torch.tensor(_X_P, device=dev), torch.tensor(_X_M, device=dev)
    shift_t = torch.from_numpy(shift).to(dev)
    xx = torch.where((shift_t == 1).view(1, S, 1), xp.view(1, 1, 3), xm.view(1, 1, 3)).expand(n // 8, S, 3)
    scale_t = torch.from_numpy(scale).to(dev)
    gi, all_on = _iq1_snap(T.IQ1_S, X, W, torch.from_numpy(L).to(dev), scale_t, xx)
    scale_t = _iq1_refit(T.IQ1_S, X, W, gi, scale_t, xx, ~all_on)
    found_t = torch.from_numpy(found).to(dev)
    scale_t = torch.where(found_t, scale_t, torch.zeros_like(scale_t))
    gi = torch.where(found_t.unsqueeze(0), gi, torch.zeros_like(gi))
    shift_t = torch.where(found_t, shift_t, torch.ones_like(shift_t))
    sc = scale_t.view(nb, 8)
    max_scale = sc.amax(1)
    d = div(max_scale, 15.0)
    empty = max_scale == 0
    dbytes = fp16_bits(torch.where(empty, torch.zeros_like(d), d * f32(1.125)))
    l = nearest_int((rdiv(1.0, d).unsqueeze(1) * sc - 1) * 0.5).clamp(0, 7).to(torch.int64)
    l = l | torch.where(shift_t.view(nb, 8) == -1, 8, 0)
    l = torch.where(empty.unsqueeze(1), torch.zeros_like(l), l)
    g = _col(gi, nb)  # (nb, 8, 4)
    qh = _shifted((g >> 8).permute(2, 0, 1), 3) | (l << 12)  # (nb, 8)
    return torch.cat([dbytes, (g & 255).reshape(nb, 32).to(torch.uint8), _le_bytes(qh, 2)], 1)


def quantize_iq1_m(x: torch.Tensor, qw: torch.Tensor | None = None) -> torch.Tensor:
    """(nb, 256) float32 (and optional importance) -> (nb, 56) uint8 IQ1_M blocks.

    As IQ1_S on 16-value sub-blocks whose two halves pick their shift separately (4
    combinations per split, from per-half running sums); the super-block scale is refitted
    over all codes and stored as an fp16 spread over the top nibbles of the 4 scale words.
    """
    n = 16
    nb, X, W = _iq1_prepare(x, qw, n)
    S = X.shape[1]
    dev = x.device
    mx = X.abs().amax(0)
    alive = (mx >= f32(1e-7)).cpu().numpy()
    order, wx, w = _iq1_sorted_sums(X, W)
    half = (order >= n // 2)  # which half each sorted element came from
    z = np.zeros((1, S), np.float32)
    px, pw = [], []
    for h in (0, 1):
        mine = half == bool(h)
        px.append(np.add.accumulate(np.concatenate([z, np.where(mine, wx, np.float32(0))]), axis=0))
        pw.append(np.add.accumulate(np.concatenate([z, np.where(mine, w, np.float32(0))]), axis=0))
    # (C copies px[h][j] for the other half's elements; adding +0.0 instead changes no bits:
    # a running sum that starts at +0.0 is never -0.0)
    p2, m2 = np.float32(_X_P[2]), np.float32(_X_M[2])
    f = np.float32
    cp1 = f(f(_X_P[0]) * f(_X_P[0])) - f(f(_X_P[1]) * f(_X_P[1]))
    cp2 = f(f(_X_P[1]) * f(_X_P[1])) - f(f(_X_P[2]) * f(_X_P[2]))
    cm1 = f(f(_X_M[0]) * f(_X_M[0])) - f(f(_X_M[1]) * f(_X_M[1]))
    cm2 = f(f(_X_M[1]) * f(_X_M[1])) - f(f(_X_M[2]) * f(_X_M[2]))
    i1s, i2s = np.triu_indices(n + 1)
    qxp, qxm, q2p, q2m = [], [], [], []
    for h in (0, 1):
        txs, tws = px[h][n], pw[h][n]
        sxv = px[h][i1s] + px[h][i2s]
        qxp.append(txs * p2 - sxv)
        qxm.append(txs * m2 - sxv)
        q2p.append(tws * p2 * p2 + pw[h][i1s] * cp1 + pw[h][i2s] * cp2)
        q2m.append(tws * m2 * m2 + pw[h][i1s] * cm1 + pw[h][i2s] * cm2)
    qx = np.stack([qxp[0] + qxp[1], qxp[0] + qxm[1], qxm[0] + qxp[1], qxm[0] + qxm[1]], 1).reshape(-1, S)
    q2 = np.stack([q2p[0] + q2p[1], q2p[0] + q2m[1], q2m[0] + q2p[1], q2m[0] + q2m[1]], 1).reshape(-1, S)
    pick, scale = _scan(qx, q2, mx.cpu().numpy())
    found = alive & (pick >= 0)
    pk = np.maximum(pick, 0)
    best_k = pk % 4
    L = _iq1_levels(order, i1s[pk // 4], i2s[pk // 4], n)
    neg = scale < 0
    L = np.where(neg[None, :], 2 - L, L)
    scale = np.where(neg, -scale, scale)
    best_k = np.where(neg, 3 - best_k, best_k)
    best_k = np.where(found, best_k, 0)
    xp, xm = torch.tensor(_X_P, device=dev), torch.tensor(_X_M, device=dev)
    bk = torch.from_numpy(best_k).to(dev)
    minus = torch.stack([bk >= 2, bk % 2 == 1])  # (2, S): group k uses x_m
    xx = torch.where(minus.unsqueeze(2), xm.view(1, 1, 3), xp.view(1, 1, 3))  # (2, S, 3)
    scale_t = torch.from_numpy(scale).to(dev)
    gi, all_on = _iq1_snap(T.IQ1_M, X, W, torch.from_numpy(L).to(dev), scale_t, xx)
    scale_t = _iq1_refit(T.IQ1_M, X, W, gi, scale_t, xx, ~all_on)
    found_t = torch.from_numpy(found).to(dev)
    scale_t = torch.where(found_t, scale_t, torch.zeros_like(scale_t))
    gi = torch.where(found_t.unsqueeze(0), gi, torch.zeros_like(gi))
    sc = scale_t.view(nb, 16)
    max_scale = sc.amax(1)
    d = div(max_scale, 15.0)
    empty = max_scale == 0
    l = nearest_int((rdiv(1.0, d).unsqueeze(1) * sc - 1) * 0.5).clamp(0, 7).to(torch.int64)  # (nb, 16)
    # the super-block scale: sumqx/sumq2 over every code with its sub-block scale (2l+1)
    _, _, _, levels, _, _ = _device_tables(T.IQ1_M, 2, dev.type)
    q = torch.gather(xx, 2, levels[gi]).permute(0, 2, 1).reshape(n, S)  # (16, S)
    q = q * (2 * l.reshape(S) + 1).to(_F32)
    wq = W * q
    sumqx = _seq_sum((wq * X).reshape(n, nb, 16).permute(2, 0, 1).reshape(QK_K, nb))
    sumq2 = _seq_sum((wq * q).reshape(n, nb, 16).permute(2, 0, 1).reshape(QK_K, nb))
    d = torch.where(sumq2 > 0, div(sumqx, sumq2), d)
    dbits = fp16_bits(d * f32(1.1125))
    u16 = dbits[:, 0].to(torch.int64) | (dbits[:, 1].to(torch.int64) << 8)
    scw = _shifted(l.view(nb, 4, 4).permute(2, 0, 1), 3)  # (nb, 4) words
    top = torch.stack([(u16 & 0x000F) << 12, (u16 & 0x00F0) << 8, (u16 & 0x0F00) << 4, u16 & 0xF000], 1)
    scw = torch.where(empty.unsqueeze(1), torch.zeros_like(scw), scw | top)
    g = _col(gi, nb)  # (nb, 16, 2)
    masks = torch.tensor([0x00, 0x80, 0x08, 0x88], device=dev)[bk].view(nb, 16)
    qh = (g[..., 0] >> 8) | ((g[..., 1] >> 8) << 4)
    qh = torch.where(empty.unsqueeze(1), qh, qh | masks)
    return torch.cat([(g & 255).reshape(nb, 32).to(torch.uint8), qh.to(torch.uint8), _le_bytes(scw, 2)], 1)


# --------------------------------------------------------------------------- dequantization

@functools.cache
def _dequant_tables(name: str, device: str):
    qcls = getattr(gq, name)
    qcls.init_grid()
    grid = torch.from_numpy(np.asarray(qcls.grid, dtype=np.float32).reshape(qcls.grid_shape).copy()).to(device)
    ksigns = torch.from_numpy(np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8).astype(np.int64)).to(device)
    return grid, ksigns


def _u32(b: torch.Tensor) -> torch.Tensor:
    """(n, 4k) uint8 -> (n, k) int64 little-endian uint32 values."""
    v = b.to(torch.int64).view(b.shape[0], -1, 4)
    return v[..., 0] | (v[..., 1] << 8) | (v[..., 2] << 16) | (v[..., 3] << 24)


def _sign_factors(bits7: torch.Tensor, ksigns: torch.Tensor) -> torch.Tensor:
    """7-bit sign indices (...,) -> (..., 8) factors +-1 (ksigns adds the parity bit)."""
    s = ksigns[bits7]
    b = (s.unsqueeze(-1) >> torch.arange(8, device=s.device)) & 1
    return torch.where(b == 0, 1.0, -1.0).to(_F32)


def dequantize_iq2_xxs(b: torch.Tensor) -> torch.Tensor:
    """(n, 66) uint8 -> (n, 256) float32, as gguf-py's IQ2_XXS."""
    n = b.shape[0]
    grid, ksigns = _dequant_tables("IQ2_XXS", b.device.type)
    d = from_fp16_bytes(b[:, :2]).view(n, 1)
    qs = _u32(b[:, 2:]).view(n, 8, 2)
    db = (d * (f32(0.5) + (qs[..., 1] >> 28).to(_F32)) * f32(0.25)).view(n, 8, 1, 1)
    sh = torch.tensor([0, 7, 14, 21], device=b.device)
    signs = _sign_factors((qs[..., 1:2] >> sh) & 127, ksigns)  # (n, 8, 4, 8)
    idx = torch.stack([(qs[..., 0] >> (8 * j)) & 255 for j in range(4)], -1)  # (n, 8, 4)
    g = grid[idx]  # (n, 8, 4, 8)
    return (db * g * signs).reshape(n, QK_K)


def dequantize_iq3_xxs(b: torch.Tensor) -> torch.Tensor:
    """(n, 98) uint8 -> (n, 256) float32, as gguf-py's IQ3_XXS."""
    n = b.shape[0]
    grid, ksigns = _dequant_tables("IQ3_XXS", b.device.type)
    d = from_fp16_bytes(b[:, :2]).view(n, 1)
    qs = b[:, 2:66].to(torch.int64).view(n, 8, 8)
    sc = _u32(b[:, 66:98])  # (n, 8)
    db = (d * (f32(0.5) + (sc >> 28).to(_F32)) * f32(0.5)).view(n, 8, 1, 1)
    sh = torch.tensor([0, 7, 14, 21], device=b.device)
    signs = _sign_factors((sc.unsqueeze(-1) >> sh) & 127, ksigns)  # (n, 8, 4, 8)
    g = grid[qs].view(n, 8, 4, 8)
    return (db * g * signs).reshape(n, QK_K)


def _nibble_scales(sc: torch.Tensor) -> torch.Tensor:
    """(n, k) bytes of two 4-bit scales -> (n, 2k) float32: low nibble first."""
    s = torch.stack([sc & 15, sc >> 4], -1).reshape(sc.shape[0], -1)
    return s.to(_F32)


def _bit_signs(b: torch.Tensor) -> torch.Tensor:
    """(...,) sign bytes -> (..., 8) factors +-1, bit i for value i."""
    bits = (b.to(torch.int64).unsqueeze(-1) >> torch.arange(8, device=b.device)) & 1
    return torch.where(bits == 0, 1.0, -1.0).to(_F32)


def dequantize_iq2_xs(b: torch.Tensor) -> torch.Tensor:
    """(n, 74) uint8 -> (n, 256) float32, as gguf-py's IQ2_XS."""
    n = b.shape[0]
    grid, ksigns = _dequant_tables("IQ2_XS", b.device.type)
    d = from_fp16_bytes(b[:, :2]).view(n, 1)
    qs = b[:, 2:66].to(torch.int64).view(n, 32, 2)
    qs = qs[..., 0] | (qs[..., 1] << 8)  # (n, 32) uint16
    db = (d * (f32(0.5) + _nibble_scales(b[:, 66:74])) * f32(0.25)).view(n, 16, 1, 1)
    signs = _sign_factors(qs >> 9, ksigns).view(n, 16, 2, 8)
    g = grid[qs & 511].view(n, 16, 2, 8)
    return (db * g * signs).reshape(n, QK_K)


def dequantize_iq2_s(b: torch.Tensor) -> torch.Tensor:
    """(n, 82) uint8 -> (n, 256) float32, as gguf-py's IQ2_S."""
    n = b.shape[0]
    grid, _ = _dequant_tables("IQ2_S", b.device.type)
    d = from_fp16_bytes(b[:, :2]).view(n, 1)
    db = (d * (f32(0.5) + _nibble_scales(b[:, 74:82])) * f32(0.25)).view(n, 16, 1, 1)
    signs = _bit_signs(b[:, 34:66]).view(n, 16, 2, 8)
    qh = (b[:, 66:74].to(torch.int64).unsqueeze(-1) >> torch.tensor([0, 2, 4, 6], device=b.device)) & 3
    qs = b[:, 2:34].to(torch.int64) | (qh.reshape(n, 32) << 8)
    g = grid[qs].view(n, 16, 2, 8)
    return (db * g * signs).reshape(n, QK_K)


def dequantize_iq3_s(b: torch.Tensor) -> torch.Tensor:
    """(n, 110) uint8 -> (n, 256) float32, as gguf-py's IQ3_S."""
    n = b.shape[0]
    grid, _ = _dequant_tables("IQ3_S", b.device.type)
    d = from_fp16_bytes(b[:, :2]).view(n, 1)
    sc = b[:, 106:110].to(torch.int64)
    sc = torch.stack([sc & 15, sc >> 4], -1).reshape(n, 8)
    db = (d * (1 + 2 * sc).to(_F32)).view(n, 8, 1, 1)
    signs = _bit_signs(b[:, 74:106]).view(n, 8, 4, 8)
    qh = (b[:, 66:74].to(torch.int64).unsqueeze(-1) >> torch.arange(8, device=b.device)) & 1
    qs = b[:, 2:66].to(torch.int64) | (qh.reshape(n, 64) << 8)
    g = grid[qs].view(n, 8, 4, 8)
    return (db * g * signs).reshape(n, QK_K)


def dequantize_iq1_s(b: torch.Tensor) -> torch.Tensor:
    """(n, 50) uint8 -> (n, 256) float32, as gguf-py's IQ1_S."""
    n = b.shape[0]
    grid, _ = _dequant_tables("IQ1_S", b.device.type)
    d = from_fp16_bytes(b[:, :2]).view(n, 1)
    qh = b[:, 34:50].to(torch.int64).view(n, 8, 2)
    qh = qh[..., 0] | (qh[..., 1] << 8)  # (n, 8) uint16
    dl = (d * (2 * ((qh >> 12) & 7) + 1).to(_F32)).view(n, 8, 1, 1)
    delta = torch.where((qh & 0x8000) == 0, IQ1_DELTA, -IQ1_DELTA).to(_F32).view(n, 8, 1, 1)
    hi = (qh.unsqueeze(-1) >> torch.tensor([0, 3, 6, 9], device=b.device)) & 7  # (n, 8, 4)
    qs = b[:, 2:34].to(torch.int64) | (hi.reshape(n, 32) << 8)
    g = grid[qs].view(n, 8, 4, 8)
    return (dl * (g + delta)).reshape(n, QK_K)


def dequantize_iq1_m(b: torch.Tensor) -> torch.Tensor:
    """(n, 56) uint8 -> (n, 256) float32, as gguf-py's IQ1_M."""
    n = b.shape[0]
    grid, _ = _dequant_tables("IQ1_M", b.device.type)
    sc = b[:, 48:56].to(torch.int64).view(n, 4, 2)
    sc = sc[..., 0] | (sc[..., 1] << 8)  # (n, 4) uint16
    dbits = ((sc & 0xF000) >> torch.tensor([12, 8, 4, 0], device=b.device)).sum(1)  # disjoint nibbles
    d = dbits.to(torch.int16).view(torch.float16).to(_F32).view(n, 1)
    s3 = (sc.unsqueeze(-1) >> torch.tensor([0, 3, 6, 9], device=b.device)) & 7
    dl = (d * (2 * s3.reshape(n, 16) + 1).to(_F32)).view(n, 16, 1, 1, 1)
    qh = b[:, 32:48].to(torch.int64)
    qh2 = (qh.unsqueeze(-1) >> torch.tensor([0, 4], device=b.device))  # (n, 16, 2)
    qs = b[:, :32].to(torch.int64) | ((qh2 & 7).reshape(n, 32) << 8)
    delta = torch.where((qh2 & 8) == 0, IQ1_DELTA, -IQ1_DELTA).to(_F32).view(n, 8, 2, 2, 1)
    g = grid[qs].view(n, 8, 2, 2, 8)
    return (dl.view(n, 8, 2, 1, 1) * (g + delta)).reshape(n, QK_K)
