"""ggml-exact K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) in torch, for every device (numpy's on CPU).

Reproduces byte for byte what ``ggml_quantize_chunk`` produces without an
importance matrix: ``quantize_row_q{2..6}_K_ref`` (with ``make_qkx2_quants``,
``make_q3_quants`` and ``make_qx_quants``, in :mod:`.search`), and the
dequantizers.  The float rules are in :mod:`.cfloat` and :mod:`.legacy`;
docs/notes/quantize.md records what made these kernels fast (about
0.9x ggml's time on one core) and what was tried and dropped.

With an importance matrix ggml runs other searches (``quantize_row_*_impl``);
:mod:`mtpq.ggml.weighted` builds them from the same routines.  IQ4_NL /
IQ4_XS are in :mod:`.iq4`.
"""

from __future__ import annotations

import numpy as np
import torch

from . import npkquants
from .cfloat import (
    _F32, _GROUP_MAX_EPS, QK_K, _cat, _from_sub_blocks, _pos_max, _select, _sub_blocks, _zeros,
)
from .legacy import div, first_absmax, fp16_bits, fp16_round, from_fp16_bytes, nearest_int, rdiv, sqrt_f32, u8, wrap_i8
from .npkquants import pack_2bit, pack_k4_scales, pack_q3_scales
from .search import _final_levels, _make_q3_quants, _make_qkx2_quants, _make_qx_quants_rmse1
from . import vecops  # vecops.numpy_path looked up at call time: tests switch it off to run the torch code on CPU
from .vecops import _TorchVec as v, _first_absmax_cols

__all__ = [
    "quantize_q2_k", "quantize_q3_k", "quantize_q4_k", "quantize_q5_k", "quantize_q6_k",
    "dequantize_q2_k", "dequantize_q3_k", "dequantize_q4_k", "dequantize_q5_k", "dequantize_q6_k",
]


@vecops.cpu_runs(npkquants.quantize_q2_k)
def quantize_q2_k(x: torch.Tensor) -> torch.Tensor:
    nb = x.shape[0]
    X = _sub_blocks(x, 16)
    SM, levels = _make_qkx2_quants(X, X.abs(), 3, -0.5, 0.1, 15, True)
    S, M = SM.view(2, nb, 16)
    max_scale = _pos_max(S, 1)
    max_min = _pos_max(M, 1)
    sp = max_scale > 0
    mp = max_min > 0
    z = _zeros(max_scale)
    lsc = torch.where(sp[:, None], nearest_int(rdiv(15.0, max_scale)[:, None] * S), 0)
    lmn = nearest_int(rdiv(15.0, max_min)[:, None] * M)
    sbyte = torch.where(mp[:, None], (lsc | (lmn << 4)), lsc) & 0xFF
    d = torch.where(sp, fp16_round(div(max_scale, 15.0)), z)
    dmin = torch.where(mp, fp16_round(div(max_min, 15.0)), z)

    dl = (d[:, None] * (sbyte & 0xF).to(_F32)).reshape(-1)
    ml = (dmin[:, None] * (sbyte >> 4).to(_F32)).reshape(-1)
    L = _final_levels(X + ml[None], dl, 0, 3, 0, levels)
    qs = u8(pack_2bit(_from_sub_blocks(L, nb)))
    return torch.cat([u8(sbyte), qs, fp16_bits(d), fp16_bits(dmin)], dim=1)


@vecops.cpu_runs(npkquants.quantize_q3_k)
def quantize_q3_k(x: torch.Tensor) -> torch.Tensor:
    nb = x.shape[0]
    X = _sub_blocks(x, 16)
    scales, L = _make_q3_quants(X, 4)
    S = scales.view(nb, 16)
    _, max_scale = first_absmax(S, 1)
    nz = max_scale != 0
    iscale = rdiv(-32.0, max_scale)
    ls = torch.clamp(wrap_i8(nearest_int(iscale[:, None] * S)), -32, 31) + 32
    ls = torch.where(nz[:, None], ls, 0)  # memset(scales, 0) when max_scale == 0
    d = torch.where(nz, fp16_round(rdiv(1.0, iscale)), _zeros(max_scale))
    sb = u8(torch.cat(pack_q3_scales(ls), dim=1))

    dl = (d[:, None] * (ls - 32).to(_F32)).reshape(-1)
    Lq = torch.clamp(nearest_int(torch.div(X, dl[None])), -4, 3) + 4
    L = _select(dl != 0, Lq, L)
    Lb = _from_sub_blocks(L, nb)
    high = (Lb > 3).to(torch.int32)
    Lb = Lb - 4 * high
    hmask = u8((high.view(nb, 8, 32) << torch.arange(8, device=x.device, dtype=torch.int32)[None, :, None]).sum(1))
    return torch.cat([hmask, u8(pack_2bit(Lb)), sb, fp16_bits(d)], dim=1)


def _quantize_q45_k(x: torch.Tensor, nmax: int, rmin: float, nstep: int):
    nb = x.shape[0]
    X = _sub_blocks(x, 32)
    Xa = v.arr(X)
    sum_x2 = v.t(v.dot(Xa, Xa, v.empty(X.shape[1], X)))
    av_x = sqrt_f32(div(sum_x2, 32.0))
    W = torch.abs(X).add_(av_x[None])  # av_x + |x|
    SM, levels = _make_qkx2_quants(X, W, nmax, rmin, 0.1, nstep, False)
    # scales and mins side by side: (2, nb, 8), then (2, nb) maxima, 6-bit codes, fp16 d and
    # dmin
    SM = v.vec(SM).reshape(2, nb, 8)
    with np.errstate(all="ignore"):
        max_sm = _pos_max(SM, 2)
        inv = v.where(max_sm > 0, rdiv(63.0, max_sm), 0.0)
        lsm = v.imin(nearest_int(inv[:, :, None] * SM) & 0xFF, 63)
        dd = fp16_round(div(max_sm, 63.0))
        dlml = v.t((dd[:, :, None] * v.f32(lsm)).reshape(2, -1))
    L = _final_levels(X + dlml[1][None], dlml[0], 0, nmax, 0, levels)
    head = v.t(_cat([fp16_bits(dd[0]), fp16_bits(dd[1]), u8(_cat(pack_k4_scales(lsm[0], lsm[1])))]))
    return head, _from_sub_blocks(L, nb)


@vecops.cpu_runs(npkquants.quantize_q4_k)
def quantize_q4_k(x: torch.Tensor) -> torch.Tensor:
    head, Lb = _quantize_q45_k(x, 15, -1.0, 20)
    q = Lb.view(-1, 4, 2, 32)
    qs = u8(q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    return torch.cat([head, qs], dim=1)


@vecops.cpu_runs(npkquants.quantize_q5_k)
def quantize_q5_k(x: torch.Tensor) -> torch.Tensor:
    head, Lb = _quantize_q45_k(x, 31, -0.5, 15)
    q = Lb.view(-1, 4, 2, 32)
    lo, hi = q & 0xF, q >> 4  # hi in {0,1}
    qs = u8(lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(-1, 128)
    shifts = (2 * torch.arange(4, device=x.device, dtype=torch.int32)).view(1, 4, 1)
    qh = u8(((hi[:, :, 0] << shifts) | (hi[:, :, 1] << (shifts + 1))).sum(1))
    return torch.cat([head, qh, qs], dim=1)


@vecops.cpu_runs(npkquants.quantize_q6_k)
def quantize_q6_k(x: torch.Tensor, qw_sub: torch.Tensor | None = None) -> torch.Tensor:
    """``quantize_row_q6_K_ref``, or ``quantize_row_q6_K_impl`` with importance weights
    ``qw_sub`` (in the layout of ``_sub_blocks(x, 16)``): the same search with them as its weights."""
    nb = x.shape[0]
    X = _sub_blocks(x, 16)
    scales, levels = _make_qx_quants_rmse1(X, 32, qw_sub)
    # per super-block arithmetic and packing
    S = v.vec(scales).reshape(nb, 16)
    amax, max_scale = _first_absmax_cols(v.t(v.contig(S.T)), v)[:2]
    zero = amax < _GROUP_MAX_EPS
    with np.errstate(all="ignore"):  # all-zero super-blocks: inf/NaN as in C, zeroed below
        iscale = rdiv(-128.0, max_scale)
        d = fp16_round(rdiv(1.0, iscale))
        sc = wrap_i8(v.imin(nearest_int(iscale[:, None] * S), 127))
        dl = (d[:, None] * v.f32(sc)).reshape(-1)
    L = _from_sub_blocks(_final_levels(X, v.t(dl), -32, 31, 32, levels), nb)
    # element 128h + 32g + t; the 32-value groups g and g+2 share bytes: [b, h, g // 2, g % 2, t]
    q = v.vec(L).reshape(nb, 2, 2, 2, 32)
    lo, hi = q & 0xF, q >> 4
    ql = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(nb, 128)  # g | g+2 << 4, for g = 0, 1
    h2 = hi[:, :, 0] | (hi[:, :, 1] << 4)  # g | g+2 << 4
    qh = (h2[:, :, 0] | (h2[:, :, 1] << 2)).reshape(nb, 64)  # g=0 | g=1 << 2 | g=2 << 4 | g=3 << 6
    out = _cat([ql, qh, u8(sc), fp16_bits(d)])
    if v.any(zero):
        out[zero] = 0  # memset(0) for an all-zero super-block
    return v.t(out)


# --------------------------------------------------------------------------- dequantizers

def _unpack_2bit(qs: torch.Tensor) -> torch.Tensor:
    """(nb, 64) -> (nb, 256) 2-bit values in element order."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=qs.device).view(1, 1, 4, 1)
    return ((qs.view(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, QK_K)


def dequantize_q2_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    sc = b[:, :16]
    d = from_fp16_bytes(b[:, 80:82])
    dmin = from_fp16_bytes(b[:, 82:84])
    dl = (d[:, None] * (sc & 0xF).to(_F32)).view(nb, 16, 1)
    ml = (dmin[:, None] * (sc >> 4).to(_F32)).view(nb, 16, 1)
    q = _unpack_2bit(b[:, 16:80]).view(nb, 16, 16).to(_F32)
    return (dl * q - ml).view(nb, QK_K)


def dequantize_q3_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    hmask = b[:, :32]
    sb = b[:, 96:108]
    d = from_fp16_bytes(b[:, 108:110])
    low = torch.cat([sb[:, :8] & 0xF, sb[:, :8] >> 4], dim=1)  # j = 0..15
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device)
    high = ((sb[:, 8:12].unsqueeze(1) >> shifts.view(1, 4, 1)) & 3).reshape(nb, 16)  # j = 4g + k
    sc = (low | (high << 4)).to(torch.int16) - 32
    dl = (d[:, None] * sc.to(_F32)).view(nb, 16, 1)
    ql = _unpack_2bit(b[:, 32:96]).to(torch.int16)
    bit = torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)
    hb = ((hmask.unsqueeze(1) >> bit) & 1).reshape(nb, QK_K)
    q = (ql - 4 * (1 - hb.to(torch.int16))).to(_F32).view(nb, 16, 16)
    return (dl * q).view(nb, QK_K)


def _k4_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


def dequantize_q4_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    d = from_fp16_bytes(b[:, 0:2])
    dmin = from_fp16_bytes(b[:, 2:4])
    sc, mn = _k4_scale_min(b[:, 4:16])
    dl = (d[:, None] * sc.to(_F32)).view(nb, 8, 1)
    ml = (dmin[:, None] * mn.to(_F32)).view(nb, 8, 1)
    qs = b[:, 16:].view(nb, 4, 1, 32)
    q = torch.cat([qs & 0xF, qs >> 4], dim=2).view(nb, 8, 32).to(_F32)
    return (dl * q - ml).view(nb, QK_K)


def dequantize_q5_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    d = from_fp16_bytes(b[:, 0:2])
    dmin = from_fp16_bytes(b[:, 2:4])
    sc, mn = _k4_scale_min(b[:, 4:16])
    dl = (d[:, None] * sc.to(_F32)).view(nb, 8, 1)
    ml = (dmin[:, None] * mn.to(_F32)).view(nb, 8, 1)
    qh = b[:, 16:48]
    qs = b[:, 48:].view(nb, 4, 1, 32)
    ql = torch.cat([qs & 0xF, qs >> 4], dim=2).view(nb, 8, 32)
    hb = (qh.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)) & 1
    q = (ql | (hb << 4)).to(_F32)
    return (dl * q - ml).view(nb, QK_K)


def dequantize_q6_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    ql = b[:, :128].view(nb, 2, 1, 64)
    qh = b[:, 128:192].view(nb, 2, 1, 32)
    sc = b[:, 192:208].contiguous().view(torch.int8).to(_F32)
    d = from_fp16_bytes(b[:, 208:210])
    lo = torch.cat([ql & 0xF, ql >> 4], dim=2).view(nb, 2, 4, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)
    hi = (qh >> shifts) & 3
    q = ((lo | (hi << 4)).to(torch.int16) - 32).to(_F32).view(nb, 16, 16)
    dl = (d[:, None] * sc).view(nb, 16, 1)
    return (dl * q).view(nb, QK_K)
