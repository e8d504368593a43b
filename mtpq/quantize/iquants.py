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
(:func:`mtpq.quantize.kquants._seq_sum`), and a group of ``gw`` values is a
run of rows.  The neighbour search is done only for the groups that are off
the grid, all their neighbours at once (lists padded with +inf errors);
``argmin`` returns the first minimum, which is the C loop's strict ``<``.
Float rules as in :mod:`mtpq.quantize.legacy` (one IEEE op at a time, in the
C order, ``nearest_int`` bit trick, C integer wrap-around).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gq

from .kquants import _seq_sum
from .legacy import div, f32, fp16_bits, from_fp16_bytes, nearest_int, rdiv, sqrt_f32

__all__ = [
    "quantize_iq2_xxs", "quantize_iq3_xxs",
    "dequantize_iq2_xxs", "dequantize_iq3_xxs",
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
        pos = 2 * pts + 1
        d2 = ((self.values[None, :, :] - pos[:, None, :]) ** 2).sum(-1)  # (n_off, n_grid) int
        order = np.lexsort((np.broadcast_to(np.arange(d2.shape[1]), d2.shape), d2), axis=1)
        d2s = np.take_along_axis(d2, order, axis=1)
        # keep the grid points at the nwant smallest distinct distances, in (distance, index) order
        distinct = np.concatenate([np.ones((len(u), 1), bool), d2s[:, 1:] > d2s[:, :-1]], axis=1)
        keep = np.cumsum(distinct, axis=1) <= self._nwant
        cnt = keep.sum(axis=1)
        start = np.zeros(len(self.kmap), dtype=np.int64)
        count = np.zeros(len(self.kmap), dtype=np.int64)
        count[u] = cnt
        start[u] = np.cumsum(cnt) - cnt
        flat = order[keep]  # row-major: each point's list in order
        self._nb_cache[max_level] = (start, count, flat.astype(np.int64))
        return self._nb_cache[max_level]


@functools.cache
def _grid(qtype: GGMLQuantizationType) -> _Grid:
    if qtype == T.IQ2_XXS:
        return _Grid(gq.IQ2_XXS, 2, 2)
    if qtype == T.IQ3_XXS:
        return _Grid(gq.IQ3_XXS, 3, 2)
    raise KeyError(qtype)


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


# --------------------------------------------------------------------------- shared steps

def _elem_major(x: torch.Tensor, n: int) -> torch.Tensor:
    """(nb, 256) -> (n, nb*256/n): column s is sub-block s."""
    return x.reshape(-1, n).t().contiguous()


def _weights(X: torch.Tensor, QW: torch.Tensor | None, sigma2: torch.Tensor) -> torch.Tensor:
    """``weight[i] = qw[i] * sqrtf(sigma2 + x*x)``, or ``x*x`` without importance data."""
    if QW is None:
        return X * X
    return QW * sqrt_f32(sigma2 + X * X)


def _signs(X: torch.Tensor, W: torch.Tensor):
    """The even-parity sign choice: (xval (32, S), block_signs (4, S) int64)."""
    S = X.shape[1]
    neg = X < 0
    xval = torch.where(neg, -X, X)
    negg = neg.view(4, 8, S)
    pw = (torch.arange(8, device=X.device) ).view(1, 8, 1)
    s = (negg.to(torch.int64) << pw).sum(1)  # (4, S)
    odd = (negg.sum(1) % 2) == 1  # (4, S)
    ax = (W * X * X).view(4, 8, S)
    imin = ax.argmin(dim=1)  # first minimum: the C loop's strict <
    flip = torch.zeros((4, 8, S), dtype=torch.bool, device=X.device)
    flip.scatter_(1, imin.unsqueeze(1), odd.unsqueeze(1))
    xval = torch.where(flip.view(32, S), -xval, xval)
    s = s ^ (odd.to(torch.int64) << imin)
    return xval, s & 127


def _nearest_neighbours(xg, wg, scale, u, nb, gofs, n_lv):
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
    ``<`` picks.
    """
    start, count, flat = nb
    dev = xg.device
    n, gw = xg.shape
    q = (2 * torch.arange(n_lv, device=dev) + 1).to(_F32)
    diff = scale.view(n, 1, 1) * q.view(1, 1, n_lv) - xg.unsqueeze(2)
    table = (wg.unsqueeze(2) * diff * diff).view(-1)  # (n * gw * n_lv)
    cnt = count[u]
    if dev.type == "cpu":  # numpy's gathers and segment reductions cost a half to a third of torch's
        return torch.from_numpy(_nearest_numpy(table.numpy(), u.numpy(), cnt.numpy(), start.numpy(),
                                               flat.numpy(), gofs.numpy(), gw * n_lv))
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


def _nearest_numpy(table, u, cnt, start, flat, gofs, stride):
    n = len(u)
    N = int(cnt.sum())
    offs = np.cumsum(cnt) - cnt
    e = np.arange(N, dtype=np.int64) + np.repeat(start[u] - offs, cnt)
    idx = np.take(gofs, e, axis=1)
    idx += np.repeat(np.arange(0, n * stride, stride, dtype=idx.dtype), cnt)
    d2 = np.add.reduce(np.take(table, idx), axis=0)  # row after row: the C sum's order
    segmin = np.minimum.reduceat(d2, offs)
    first = np.minimum.reduceat(np.where(d2 == np.repeat(segmin, cnt), np.arange(N), N), offs)
    return flat[e[first]]


def _round_groups(qtype, xval, waux, id_, scale, max_level, mask=None):
    """Round every group to the lattice at ``id_`` and snap off-grid points to the best neighbour.

    xval, waux: (32, S); id_, scale: (S,).  Returns (levels (32, S) int64, grid
    index (ng, S), on_grid (ng, S)).  Groups outside ``mask`` (ng, S) are left as
    -1 indices (the caller keeps its previous values there).
    """
    kmap, nb, values, levels, shifts, gofs = _device_tables(qtype, max_level, xval.device.type)
    gw = values.shape[1]
    S = xval.shape[1]
    ng = 32 // gw
    l = nearest_int((id_ * xval - 1) * 0.5)
    l = l.clamp(0, max_level).to(torch.int64)
    lg = l.view(ng, gw, S)
    u = (lg << shifts.view(1, gw, 1)).sum(1)  # (ng, S)
    gi = kmap[u]
    on = gi >= 0
    off = ~on if mask is None else (~on & mask)
    if bool(off.any()):
        k_idx, s_idx = off.nonzero(as_tuple=True)
        xg = xval.view(ng, gw, S)[k_idx, :, s_idx]
        wg = waux.view(ng, gw, S)[k_idx, :, s_idx]
        gi[k_idx, s_idx] = _nearest_neighbours(xg, wg, scale[s_idx], u[k_idx, s_idx], nb, gofs, max_level + 1)
    if mask is not None:
        gi = torch.where(mask, gi, torch.full((), -1, dtype=gi.dtype, device=gi.device))
    lv = levels[gi.clamp(min=0)]  # (ng, S, gw)
    lv = lv.permute(0, 2, 1).reshape(32, S)
    return lv, gi, on


def _sums(W, xval, L):
    """sumqx = sum w*xval*q, sumq2 = sum w*q*q with q = 2*L+1, sequentially."""
    q = (2 * L + 1).to(_F32)
    return _seq_sum(W * xval * q), _seq_sum(W * q * q)


def _make_qp_quants(nmax: int, X: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """ggml's ``make_qp_quants(32, nmax, x, L, w)`` per column of X (32, S): the scale.

    L is a ``uint8_t`` array in C: negative levels (x may hold one negative
    value) are stored wrapped (-1 -> 255) and read back so; reproduced.
    """
    n, S = X.shape
    mx = X.amax(0).clamp(min=0.0)
    zero = mx < GROUP_MAX_EPS
    iscale = div(torch.full_like(mx, float(nmax)), mx)
    Lw = nearest_int(iscale * X) & 255
    scale = rdiv(1.0, iscale)
    diff = X - scale * Lw.to(_F32)
    best_mse = _seq_sum(W * diff * diff)
    for is_ in range(-4, 5):
        if is_ == 0:
            continue
        iscale_is = div(torch.full_like(mx, f32(f32(f32(0.1) * is_) + nmax)), mx)
        scale_is = rdiv(1.0, iscale_is)
        l = nearest_int(iscale_is * X).clamp(max=nmax)
        diff = X - scale_is * l.to(_F32)
        mse = _seq_sum(W * diff * diff)
        better = mse < best_mse
        best_mse = torch.where(better, mse, best_mse)
        iscale = torch.where(better, iscale_is, iscale)
    l = nearest_int(iscale * X).clamp(max=nmax)
    L = l & 255
    lf = l.to(_F32)
    sumlx = _seq_sum(W * X * lf)
    suml2 = _seq_sum(W * lf * lf)
    active = torch.ones(S, dtype=torch.bool, device=X.device)
    for _ in range(5):
        changed = torch.zeros(S, dtype=torch.bool, device=X.device)
        for i in range(n):
            w, x, Li = W[i], X[i], L[i]
            Lf = Li.to(_F32)
            slx = sumlx - w * x * Lf
            sl2 = suml2 - w * Lf * Lf
            ok = active & (slx > 0) & (sl2 > 0)
            new_l = nearest_int(div(x * sl2, slx)).clamp(max=nmax)
            ok &= new_l != Li
            nf = new_l.to(_F32)
            slx = slx + w * x * nf
            sl2 = sl2 + w * nf * nf
            ok &= slx * slx * suml2 > sumlx * sumlx * sl2
            L[i] = torch.where(ok, new_l & 255, Li)
            sumlx = torch.where(ok, slx, sumlx)
            suml2 = torch.where(ok, sl2, suml2)
            changed |= ok
        active &= changed
        if not bool(active.any()):
            break
    res = torch.where(suml2 > 0, div(sumlx, suml2), torch.zeros_like(sumlx))
    return torch.where(zero, torch.zeros_like(res), res)


# --------------------------------------------------------------------------- the grid search

def _grid_search(qtype, X, W, xval, waux, start_scale, max_level, candidates, refit_all):
    """The candidate-scale loop and the refit, per sub-block (columns of X (32, S)).

    ``candidates`` yields the float32 ``id`` numerators; ``start_scale`` the
    scale the C code starts with; ``refit_all``: IQ2_XXS refits every group at
    the final scale, IQ3_XXS only those that were off the grid.
    Returns (scale (S,), grid index (ng, S)).
    """
    S = X.shape[1]
    gw = _grid(qtype).gw
    ng = 32 // gw
    best = torch.zeros(S, dtype=_F32, device=X.device)
    scale = start_scale.clone()
    L = torch.zeros((32, S), dtype=torch.int64, device=X.device)
    GI = torch.full((ng, S), -1, dtype=torch.int64, device=X.device)
    on_grid = torch.ones((ng, S), dtype=torch.bool, device=X.device)
    for num, denom in candidates:
        id_ = rdiv(num, denom)
        this_scale = rdiv(1.0, id_)
        La, gi, on = _round_groups(qtype, xval, waux, id_, this_scale, max_level)
        sumqx, sumq2 = _sums(W, xval, La)
        take = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        new_scale = div(sumqx, sumq2)
        scale = torch.where(take, new_scale, scale)
        best = torch.where(take, new_scale * sumqx, best)
        L = torch.where(take, La, L)
        GI = torch.where(take, gi, GI)
        on_grid = torch.where(take, on, on_grid)
    pos = scale > 0
    need = pos if refit_all else pos & (~on_grid).any(0)
    if bool(need.any()):
        id_ = rdiv(1.0, scale)
        mask = need.unsqueeze(0).expand(ng, S) if refit_all else need.unsqueeze(0) & ~on_grid
        Lr, gir, _ = _round_groups(qtype, xval, waux, id_, scale, max_level, mask)
        m32 = mask.unsqueeze(1).expand(ng, gw, S).reshape(32, S)
        L = torch.where(m32, Lr, L)
        GI = torch.where(mask, gir, GI)
        sumqx, sumq2 = _sums(W, xval, L)
        scale = torch.where(need & (sumq2 > 0), div(sumqx, sumq2), scale)
    return scale, GI, L


def _grid_index_of(qtype, L, max_level):
    """kmap lookup of final levels (the C code's last loop; it aborts on an off-grid point)."""
    kmap, _, values, _, shifts, _ = _device_tables(qtype, max_level, L.device.type)
    gw = values.shape[1]
    S = L.shape[1]
    u = ((L & ((1 << _grid(qtype).bits) - 1)).view(32 // gw, gw, S) << shifts.view(1, gw, 1)).sum(1)
    gi = kmap[u]
    if bool((gi < 0).any()):
        raise RuntimeError(f"{qtype.name}: a point off the grid after the search (ggml aborts here too)")
    return gi


def _super_scales(scales: torch.Tensor, nb: int, fudge: float | None):
    """d = max_scale/31 (fp16, times ``fudge`` if given) and the 4-bit sub-block scales."""
    sc = scales.view(nb, 8)
    max_scale = sc.amax(1)
    d = div(max_scale, 31.0)
    dstore = d * f32(fudge) if fudge is not None else d
    id_ = rdiv(1.0, d).unsqueeze(1)
    l = nearest_int((id_ * sc - 1) * 0.5).clamp(0, 15).to(torch.int64)
    return max_scale, dstore, l


def _prepare(x: torch.Tensor, qw: torch.Tensor | None, sigma_mul: int):
    nb = x.shape[0]
    Xs = x.t().contiguous()  # (256, nb)
    sumx2 = _seq_sum(Xs * Xs)
    sigma2 = div(sumx2 * sigma_mul if sigma_mul != 1 else sumx2, float(QK_K))
    X = _elem_major(x, 32)
    QW = None if qw is None else _elem_major(qw.expand(nb, QK_K).to(_F32), 32)
    W = _weights(X, QW, sigma2.repeat_interleave(8).unsqueeze(0))
    return nb, X, W, sqrt_f32(W)


def _u32_bytes(v: torch.Tensor) -> torch.Tensor:
    """(…, k) int64 holding uint32 values -> (…, 4k) little-endian bytes."""
    b = torch.stack([(v >> (8 * j)) & 255 for j in range(4)], -1)
    return b.reshape(*v.shape[:-1], -1).to(torch.uint8)


# --------------------------------------------------------------------------- IQ2_XXS

def quantize_iq2_xxs(x: torch.Tensor, qw: torch.Tensor | None = None) -> torch.Tensor:
    """(nb, 256) float32 (and importance (nb or 1, 256)) -> (nb, 66) uint8 IQ2_XXS blocks."""
    if qw is None:
        raise ValueError("IQ2_XXS needs importance weights (an imatrix), as in ggml")
    kmax = 3
    nb, X, W, waux = _prepare(x, qw, 1)
    S = X.shape[1]
    xval, signs = _signs(X, W)
    mx = xval.amax(0)
    alive = mx >= GROUP_MAX_EPS
    qscale = _make_qp_quants(kmax + 1, xval, W)
    eff_max = qscale * kmax
    alive &= eff_max > 0
    eff = torch.where(alive, eff_max, torch.ones_like(eff_max))
    cands = [(f32(5 + f32(f32(is_) * f32(0.1))), eff) for is_ in range(-6, 7)]
    scale, _, L = _grid_search(T.IQ2_XXS, X, W, xval, waux, qscale, kmax - 1, cands, refit_all=True)
    scale, signs = _flip_negative(scale, signs)
    gi = _grid_index_of(T.IQ2_XXS, L, kmax - 1)  # (4, S)
    scale = torch.where(alive, scale, torch.zeros_like(scale))
    q0 = (gi << (8 * torch.arange(4, device=x.device)).view(4, 1)).sum(0)
    q1 = (signs << (7 * torch.arange(4, device=x.device)).view(4, 1)).sum(0)
    q0 = torch.where(alive, q0, torch.zeros_like(q0))
    q1 = torch.where(alive, q1, torch.zeros_like(q1))
    max_scale, d, l = _super_scales(scale, nb, None)
    q1 = q1.view(nb, 8) | (l << 28)
    q = torch.stack([q0.view(nb, 8), q1], -1).reshape(nb, 16)
    empty = (max_scale == 0).unsqueeze(1)
    q = torch.where(empty, torch.zeros_like(q), q)
    d = torch.where(empty.squeeze(1), torch.zeros_like(d), d)
    return torch.cat([fp16_bits(d), _u32_bytes(q)], 1)


def _flip_negative(scale, signs):
    negs = scale < 0
    scale = torch.where(negs, -scale, scale)
    signs = torch.where(negs.unsqueeze(0), (~signs) & 127, signs)
    return scale, signs


# --------------------------------------------------------------------------- IQ3_XXS

def quantize_iq3_xxs(x: torch.Tensor, qw: torch.Tensor | None = None) -> torch.Tensor:
    """(nb, 256) float32 (and optional importance) -> (nb, 98) uint8 IQ3_XXS blocks."""
    kmax = 8
    nb, X, W, waux = _prepare(x, qw, 2)
    xval, signs = _signs(X, W)
    mx = xval.amax(0)
    alive = mx >= GROUP_MAX_EPS_IQ3_XXS
    mxs = torch.where(alive, mx, torch.ones_like(mx))
    start = div(mxs, float(2 * kmax - 1))
    cands = [(f32(15 + f32(f32(is_) * f32(0.2))), mxs) for is_ in range(-15, 16)]
    scale, _, L = _grid_search(T.IQ3_XXS, X, W, xval, waux, start, kmax - 1, cands, refit_all=False)
    scale, signs = _flip_negative(scale, signs)
    gi = _grid_index_of(T.IQ3_XXS, L, kmax - 1)  # (8, S)
    scale = torch.where(alive, scale, torch.zeros_like(scale))
    q3 = torch.where(alive.unsqueeze(0), gi, torch.zeros_like(gi))  # (8, S)
    ss = (signs << (7 * torch.arange(4, device=x.device)).view(4, 1)).sum(0)
    ss = torch.where(alive, ss, torch.zeros_like(ss))
    max_scale, d, l = _super_scales(scale, nb, 1.0125)
    ss = ss.view(nb, 8) | (l << 28)
    qs = q3.t().reshape(nb, 64)
    empty = (max_scale == 0).unsqueeze(1)
    body = torch.cat([qs.to(torch.uint8), _u32_bytes(ss)], 1)
    body = torch.where(empty, torch.zeros_like(body), body)
    d = torch.where(empty.squeeze(1), torch.zeros_like(d), d)
    return torch.cat([fp16_bits(d), body], 1)


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
