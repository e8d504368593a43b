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
    "quantize_iq2_xxs", "quantize_iq2_xs", "quantize_iq2_s", "quantize_iq3_xxs", "quantize_iq3_s",
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
    # (bits per lattice coordinate, nwant) as in iq2xs_init_impl / iq3xs_init_impl
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
    n, S = xval.shape
    ng = n // gw
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
    lv = lv.permute(0, 2, 1).reshape(n, S)
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
        start = _make_qp_quants(kmax + 1, xval, W)
        eff = start * kmax
        alive &= eff > 0
        denom = torch.where(alive, eff, torch.ones_like(eff))
    else:
        start = div(mxs, float(2 * kmax - 1))
        denom = mxs
    ids = [f32((2 * kmax - 1) + f32(f32(i) * f32(spec.step))) for i in range(-spec.steps, spec.steps + 1)]
    qtype, max_level = spec.qtype, kmax - 1
    ng = n // _grid(qtype).gw
    gw = _grid(qtype).gw
    best = torch.zeros(S, dtype=_F32, device=X.device)
    scale = start.clone()
    L = torch.zeros((n, S), dtype=torch.int64, device=X.device)
    on_grid = torch.full((ng, S), spec.on_grid0, dtype=torch.bool, device=X.device)
    for num in ids:
        id_ = rdiv(num, denom)
        La, _, on = _round_groups(qtype, xval, waux, id_, rdiv(1.0, id_), max_level)
        sumqx, sumq2 = _sums(W, xval, La)
        take = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        new_scale = div(sumqx, sumq2)
        scale = torch.where(take, new_scale, scale)
        best = torch.where(take, new_scale * sumqx, best)
        L = torch.where(take, La, L)
        on_grid = torch.where(take, on, on_grid)
    pos = scale > 0
    if spec.refit == "all":  # IQ2_XXS: every group, whenever scale > 0
        need = pos
        mask = need.unsqueeze(0).expand(ng, S)
    elif spec.refit == "all_if_off":  # IQ3_S: every group, if any was off the grid
        need = pos & (~on_grid).any(0)
        mask = need.unsqueeze(0).expand(ng, S)
    else:  # only the groups that were off the grid
        need = pos & (~on_grid).any(0)
        mask = need.unsqueeze(0) & ~on_grid
    if bool(need.any()):
        Lr, _, _ = _round_groups(qtype, xval, waux, rdiv(1.0, scale), scale, max_level, mask)
        L = torch.where(mask.unsqueeze(1).expand(ng, gw, S).reshape(n, S), Lr, L)
        sumqx, sumq2 = _sums(W, xval, L)
        scale = torch.where(need & (sumq2 > 0), div(sumqx, sumq2), scale)
    negs = scale < 0  # "should never happen": flip the scale and the signs
    scale = torch.where(negs, -scale, scale)
    signs = torch.where(negs.unsqueeze(0), (~signs) & spec.flip_mask, signs)
    gi = _grid_index_of(qtype, L, max_level)
    scale = torch.where(alive, scale, torch.zeros_like(scale))
    return nb, scale, gi, signs, alive


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
