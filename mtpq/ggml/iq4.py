"""ggml-exact IQ4_NL / IQ4_XS in torch, for every device (numpy's on CPU: :mod:`.npiq4`).

``quantize_iq4_nl`` / ``quantize_iq4_xs`` (``quantize_row_iq4_nl_impl`` with
``ntry = 7``), with or without importance weights (see :mod:`.weighted`),
and their dequantizers.  Float rules: :mod:`.cfloat`, :mod:`.legacy`.
"""

from __future__ import annotations

import torch

from .cfloat import _F32, _GROUP_MAX_EPS, QK_K, _seq_sum, _sub_blocks, _zeros
from . import npiq4, vecops
from .legacy import cst, div, first_absmax, fp16_bits, from_fp16_bytes, nearest_int, rdiv, u8
from .npiq4 import IQ4_LUT as _IQ4_LUT, KVALUES_IQ4NL

__all__ = ["quantize_iq4_nl", "quantize_iq4_xs", "dequantize_iq4_nl", "dequantize_iq4_xs"]

def _kvalues(device) -> torch.Tensor:
    return torch.tensor(KVALUES_IQ4NL, dtype=_F32, device=device)


def _iq4_slot(v: torch.Tensor) -> torch.Tensor:
    """Flat int64 row index into the 512-entry tables for each value of ``v``."""
    t = torch.clamp((v * 2.0).floor_(), -256.0, 255.0)
    t = torch.nan_to_num(t, nan=255.0)  # NaN: ggml's search ends on the top value
    return (t + 256.0).to(torch.int64).reshape(-1)


def _best_index_iq4(v: torch.Tensor) -> torch.Tensor:
    """``best_index_int8(16, kvalues_iq4nl, v)`` (int64 indices, shape of ``v``)."""
    lut = torch.tensor(_IQ4_LUT, dtype=torch.int64, device=v.device)
    return lut.index_select(0, _iq4_slot(v)).view(v.shape)


def _iq4_values(v: torch.Tensor) -> torch.Tensor:
    """``kvalues_iq4nl[best_index_int8(...)]`` as float32."""
    lut = torch.tensor([KVALUES_IQ4NL[i] for i in _IQ4_LUT], dtype=_F32, device=v.device)
    return lut.index_select(0, _iq4_slot(v)).view(v.shape)


def _iq4_block_scales(X: torch.Tensor, ntry: int, W: torch.Tensor | None = None) -> torch.Tensor:
    """Per 32-element block part of ``quantize_row_iq4_nl_impl``; ``W`` the weights
    (``qw * sqrtf(sigma2 + x*x)`` with an importance matrix), x*x when None.

    Returns the scale d of every block (column of ``X``); the first-pass levels
    are not needed: ggml recomputes them afterwards when ntry > 0.
    """
    amax, mx = first_absmax(X, 0)
    zero = amax < _GROUP_MAX_EPS
    if W is None:
        W = X * X
    d0 = torch.div(-mx, cst(-127.0, X))
    id0 = rdiv(1.0, d0)
    consts = [float(i - 127) for i in range(-ntry, ntry + 1)]
    idc = torch.div(torch.tensor(consts, dtype=_F32, device=X.device)[:, None], mx[None])
    ids = torch.cat([id0[None], idc], dim=0)  # (nc, ns)
    Q = _iq4_values(ids[:, None, :] * X[None])  # (nc, n, ns)
    n = X.shape[0]
    P = torch.empty((n, 2) + ids.shape, dtype=_F32, device=X.device)
    WQ = torch.mul(W[None], Q, out=P[:, 1].transpose(0, 1))
    torch.mul(WQ, X[None], out=P[:, 0].transpose(0, 1))  # w*q*x
    torch.mul(WQ, Q, out=P[:, 1].transpose(0, 1))  # w*q*q (in place over w*q)
    del Q
    sums = _seq_sum(P)
    sumqx, sumq2 = sums[0], sums[1]
    del P
    d = torch.where(sumq2[0] > 0, torch.div(sumqx[0], sumq2[0]), _zeros(mx))
    best = d * sumqx[0]
    for k in range(1, len(consts) + 1):
        sqx, sq2 = sumqx[k], sumq2[k]
        better = (sq2 > 0) & (sqx * sqx > best * sq2)
        nd = torch.div(sqx, sq2)
        d = torch.where(better, nd, d)
        best = torch.where(better, nd * sqx, best)
    return torch.where(zero, _zeros(d), d)


def _pack_iq4(L: torch.Tensor) -> torch.Tensor:
    """(nb, 32*k) indices -> (nb, 16*k): q[16i+j] = L[32i+j] | L[32i+16+j] << 4."""
    q = L.view(L.shape[0], -1, 2, 16)
    return u8(q[:, :, 0] | (q[:, :, 1] << 4)).reshape(L.shape[0], -1)


@vecops.cpu_runs(npiq4.quantize_iq4_nl)
def quantize_iq4_nl(x: torch.Tensor, W: torch.Tensor | None = None) -> torch.Tensor:
    """``W``: the weights in the layout of ``x.t()`` (see :mod:`.weighted`), x*x when None."""
    X = x.t().contiguous()  # (32, nb)
    d = _iq4_block_scales(X, 7, W)
    idv = torch.where(d != 0, rdiv(1.0, d), _zeros(d))
    L = _best_index_iq4(idv[:, None] * x)
    return torch.cat([fp16_bits(d), _pack_iq4(L)], dim=1)


@vecops.cpu_runs(npiq4.quantize_iq4_xs)
def quantize_iq4_xs(x: torch.Tensor, W: torch.Tensor | None = None) -> torch.Tensor:
    """``W``: the weights in the layout of ``_sub_blocks(x, 32)``, x*x when None."""
    nb = x.shape[0]
    X = _sub_blocks(x, 32)
    scales = _iq4_block_scales(X, 7, W)
    S = scales.view(nb, 8)
    _, max_scale = first_absmax(S, 1)
    d = div(-max_scale, 32.0)  # float d = -max_scale/32;  (-0.0 for an all-zero super-block)
    idv = torch.where(d != 0, rdiv(1.0, d), _zeros(d))
    l = torch.clamp(nearest_int(idv[:, None] * S), -32, 31)
    dl = d[:, None] * l.to(_F32)
    idl = torch.where(dl != 0, rdiv(1.0, dl), _zeros(dl))
    L = _best_index_iq4(idl.repeat_interleave(32, dim=1) * x)
    l = l + 32
    lo = l & 0xF
    scales_l = u8(lo[:, 0::2] | (lo[:, 1::2] << 4))
    sh = ((l >> 4) << (2 * torch.arange(8, device=x.device, dtype=torch.int32))).sum(1)
    scales_h = u8(torch.stack([sh, sh >> 8], dim=1))
    return torch.cat([fp16_bits(d), scales_h, scales_l, _pack_iq4(L)], dim=1)


# --------------------------------------------------------------------------- dequantizers

def dequantize_iq4_nl(b: torch.Tensor) -> torch.Tensor:
    kv = _kvalues(b.device)
    d = from_fp16_bytes(b[:, :2])
    qs = b[:, 2:18]
    q = kv[torch.cat([qs & 0xF, qs >> 4], dim=1).long()]
    return d[:, None] * q


def dequantize_iq4_xs(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    kv = _kvalues(b.device)
    d = from_fp16_bytes(b[:, :2])
    sh = b[:, 2:4].to(torch.int32)
    sh = sh[:, 0] | (sh[:, 1] << 8)
    sl = b[:, 4:8]
    lo = torch.stack([sl & 0xF, sl >> 4], dim=2).reshape(nb, 8).to(torch.int32)
    hi = (sh[:, None] >> (2 * torch.arange(8, device=b.device, dtype=torch.int32))) & 3
    sc = (lo | (hi << 4)) - 32
    dl = (d[:, None] * sc.to(_F32)).view(nb, 8, 1)
    qs = b[:, 8:].view(nb, 8, 1, 16)
    idx = torch.cat([qs & 0xF, qs >> 4], dim=2).view(nb, 8, 32).long()
    return (dl * kv[idx]).view(nb, QK_K)
