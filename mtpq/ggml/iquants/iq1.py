"""IQ1_S and IQ1_M: the ternary types' scan over sorted sums, snap and refit."""

from __future__ import annotations

import numpy as np
import torch

from ..legacy import div, f32, fp16_bits, nearest_int, rdiv, sqrt_f32
from ..cfloat import _seq_sum
from .tables import _device_tables, _F32, QK_K, T
from .search import _col, _elem_major, _le_bytes, _nearest_neighbours, _shifted


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
