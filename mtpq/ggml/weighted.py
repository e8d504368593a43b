"""ggml-exact quantization WITH an importance matrix (``llama-quantize --imatrix``).

With importance weights ``qw`` (one per column of the matrix, from an imatrix
file) ``ggml_quantize_chunk`` leaves the reference quantizers for
``quantize_row_*_impl``: the same block layouts, other searches.  This module
reproduces them byte for byte, reusing the vectorised search routines of
:mod:`mtpq.ggml.search` (same float rules: see :mod:`mtpq.ggml.cfloat`
and :mod:`mtpq.ggml.legacy`):

* Q4_0 / Q5_0: ``make_qx_quants(32, 8|16, x, L, 1, w)``, the levels as found;
* Q4_1 / Q5_1: ``make_qkx3_quants(32, 15|31, w, -0.9, 0.05, 36)``;
* Q2_K: ``make_qkx3_quants(16, 3, ...)`` and ``make_qp_quants`` for the 4-bit
  scales and mins; Q4_K / Q5_K the same on 32-element sub-blocks, 6-bit codes;
* Q3_K: weighted ``make_qx_quants`` for the levels and for the 6-bit scales;
* Q6_K: the reference search with ``qw`` itself as the weights;
* IQ4_NL / IQ4_XS: ``quantize_row_iq4_nl_impl`` with weights.

Everywhere but Q6_K the weights are ``w = qw * sqrtf(sigma2 + x*x)``, where
sigma2 is the mean square (times 2 for Q3_K-Q5_K and IQ4) of the super-block,
or of the whole ROW for the legacy types: those kernels take the row's
``sum_x2`` per block from the caller (:func:`mtpq.ggml.kernels.quantize`
cuts chunks inside rows).  Q8_0 has no importance path in ggml.

make_qkx3_quants with weights is make_qkx2_quants (search's
``_make_qkx2_quants``) with other step constants; ``max <= min`` vs
``max == min`` only differ for NaN, which never gets here.
"""

from __future__ import annotations

import torch

from . import kquants as kq
from .cfloat import _cat, _from_sub_blocks, _seq_sum, _sub_blocks
from .iq4 import quantize_iq4_nl as _iq4_nl, quantize_iq4_xs as _iq4_xs
from .search import _final_levels, _make_qkx2_quants, _make_qx_quants_rmse1, make_qp_quants
from .legacy import _qh_pack, div, fp16_bits, fp16_round, sqrt_f32, u8
from .npkquants import pack_2bit, pack_k4_scales

_F32 = torch.float32
QK_K = 256


# --------------------------------------------------------------------------- shared pieces

def _weights(X: torch.Tensor, QW: torch.Tensor, sigma2: torch.Tensor) -> torch.Tensor:
    """``qw * sqrtf(sigma2 + x*x)`` with every op rounded separately (sigma2 broadcast (1, n_sub))."""
    return QW * sqrt_f32(sigma2 + X * X)


_SUB_CACHE: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _qw_sub_blocks(qw: torch.Tensor, n: int) -> torch.Tensor:
    """``_sub_blocks(qw, n)``, kept for the next chunk: the facade hands every chunk of
    the same shape the same weights tensor, so its transpose is made once."""
    hit = _SUB_CACHE.get((id(qw), n))
    if hit is not None and hit[0] is qw:
        return hit[1]
    out = _sub_blocks(qw, n)
    if len(_SUB_CACHE) >= 4:
        _SUB_CACHE.clear()
    _SUB_CACHE[(id(qw), n)] = (qw, out)  # holding qw keeps its id from being reused
    return out


def _super_sigma2(x: torch.Tensor, n: int, twice: bool) -> torch.Tensor:
    """Per super-block of ``n`` values (rows of ``x``): ``[2*]sum_x2/n``, the sum in C order."""
    xt = _sub_blocks(x, n)  # (n, nb): one row per position
    s = _seq_sum(xt * xt)
    return div(s * 2.0 if twice else s, float(n))


def _per_sub(v: torch.Tensor, per: int) -> torch.Tensor:
    """(nb,) per super-block -> (1, nb*per) per sub-block (column order of cfloat._sub_blocks)."""
    return v.repeat_interleave(per)[None]


def _two_columns(*mats: torch.Tensor) -> tuple[list[torch.Tensor], bool]:
    """The search routines sum along columns with numpy, which sums a lone column pairwise
    (not in C order): a single column is doubled, and the caller keeps the first result."""
    if mats[0].shape[1] != 1:
        return list(mats), False
    return [torch.cat([M, M], dim=1) for M in mats], True


def _qp_scales_and_mins(SM: torch.Tensor, swc: torch.Tensor, nb: int, nmax: int):
    """make_qp_quants of the sub-block scales and of the mins (both weighted by sw) in one
    call on side-by-side columns: the columns are independent, and the per-op cost halves."""
    d, L = make_qp_quants(torch.cat([_cols(SM[0], nb), _cols(SM[1], nb)], dim=1), nmax, torch.cat([swc, swc], dim=1))
    return (d[:nb], d[nb:]), (L[:, :nb], L[:, nb:])


def _cols(T: torch.Tensor, nb: int) -> torch.Tensor:
    """A per-sub-block vector (nb*k,) in cfloat._sub_blocks order -> (k, nb): row j = sub-block j."""
    return T.reshape(nb, -1).t().contiguous()


# --------------------------------------------------------------------------- K-quants

def quantize_q2_k(x: torch.Tensor, qw: torch.Tensor) -> torch.Tensor:
    nb = x.shape[0]
    X, QW = _sub_blocks(x, 16), _qw_sub_blocks(qw, 16)
    sigma2 = _super_sigma2(x, QK_K, twice=False)
    W = _weights(X, QW, _per_sub(sigma2, 16))
    sw = _seq_sum(W)
    SM, levels = _make_qkx2_quants(X, W, 3, -0.9, 0.05, 36, False)
    (dm, mm), (Ls, Lm) = _qp_scales_and_mins(SM, _cols(sw, nb), nb, 15)
    sbyte = u8(Ls.t() | (Lm.t() << 4)).to(torch.int32)  # (nb, 16)
    d, dmin = fp16_round(dm), fp16_round(mm)
    dl = (d[:, None] * (sbyte & 0xF).to(_F32)).reshape(-1)
    ml = (dmin[:, None] * (sbyte >> 4).to(_F32)).reshape(-1)
    L = _final_levels(X + ml[None], dl, 0, 3, 0, levels)
    qs = u8(pack_2bit(_from_sub_blocks(L, nb)))
    return torch.cat([u8(sbyte), qs, fp16_bits(dm), fp16_bits(mm)], dim=1)


def quantize_q3_k(x: torch.Tensor, qw: torch.Tensor) -> torch.Tensor:
    nb = x.shape[0]
    X, QW = _sub_blocks(x, 16), _qw_sub_blocks(qw, 16)
    sigma2 = _super_sigma2(x, QK_K, twice=True)
    W = _weights(X, QW, _per_sub(sigma2, 16))
    sw = _seq_sum(W)
    scales, levels = _make_qx_quants_rmse1(X, 4, W)
    (SC, SW), one = _two_columns(_cols(scales, nb), _cols(sw, nb))
    d_block, ls_levels = _make_qx_quants_rmse1(SC, 32, SW)
    ls = ls_levels().to(torch.int32).t()[:nb]  # (nb, 16) in [0, 63]: Ls[j] = l + 32
    d_block = d_block[:nb]
    sb_low = (ls[:, :8] & 0xF) | ((ls[:, 8:] & 0xF) << 4)
    hi = (ls >> 4).view(nb, 4, 4)
    sb_high = hi[:, 0] | (hi[:, 1] << 2) | (hi[:, 2] << 4) | (hi[:, 3] << 6)
    sb = u8(torch.cat([sb_low, sb_high], dim=1))
    d = fp16_round(d_block)
    dl = (d[:, None] * (ls - 32).to(_F32)).reshape(-1)
    L = _final_levels(X, dl, -4, 3, 4, levels).to(torch.int32)
    Lb = _from_sub_blocks(L, nb)
    high = (Lb > 3).to(torch.int32)
    Lb = Lb - 4 * high
    hmask = u8((high.view(nb, 8, 32) << torch.arange(8, device=x.device, dtype=torch.int32)[None, :, None]).sum(1))
    return torch.cat([hmask, u8(pack_2bit(Lb)), sb, fp16_bits(d_block)], dim=1)


def _quantize_q45_k(x: torch.Tensor, qw: torch.Tensor, nmax: int, clamp63: bool):
    nb = x.shape[0]
    X, QW = _sub_blocks(x, 32), _qw_sub_blocks(qw, 32)
    sigma2 = _super_sigma2(x, QK_K, twice=True)
    W = _weights(X, QW, _per_sub(sigma2, 8))
    sw = _seq_sum(W)
    SM, levels = _make_qkx2_quants(X, W, nmax, -0.9, 0.05, 36, False)
    (d_block, m_block), (Ls, Lm) = _qp_scales_and_mins(SM, _cols(sw, nb), nb, 63)
    ls, lm = Ls.t(), Lm.t()
    if clamp63:
        ls, lm = ls.clamp(max=63), lm.clamp(max=63)
    packed = u8(_cat(pack_k4_scales(ls, lm)))
    sc, mn = kq._k4_scale_min(packed)  # what the C code reads back (get_scale_min_k4)
    dl = (fp16_round(d_block)[:, None] * sc.to(_F32)).reshape(-1)
    ml = (fp16_round(m_block)[:, None] * mn.to(_F32)).reshape(-1)
    L = _final_levels(X + ml[None], dl, 0, nmax, 0, levels)
    head = torch.cat([fp16_bits(d_block), fp16_bits(m_block), packed], dim=1)
    return head, _from_sub_blocks(L, nb)


def quantize_q4_k(x: torch.Tensor, qw: torch.Tensor) -> torch.Tensor:
    head, Lb = _quantize_q45_k(x, qw, 15, clamp63=False)
    q = Lb.view(-1, 4, 2, 32)
    return torch.cat([head, u8(q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)], dim=1)


def quantize_q5_k(x: torch.Tensor, qw: torch.Tensor) -> torch.Tensor:
    head, Lb = _quantize_q45_k(x, qw, 31, clamp63=True)
    q = Lb.view(-1, 4, 2, 32)
    lo, hi = q & 0xF, q >> 4
    qs = u8(lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(-1, 128)
    shifts = (2 * torch.arange(4, device=x.device, dtype=torch.int32)).view(1, 4, 1)
    qh = u8(((hi[:, :, 0].to(torch.int32) << shifts) | (hi[:, :, 1].to(torch.int32) << (shifts + 1))).sum(1))
    return torch.cat([head, qh, qs], dim=1)


def quantize_q6_k(x: torch.Tensor, qw: torch.Tensor) -> torch.Tensor:
    return kq.quantize_q6_k(x, qw_sub=_qw_sub_blocks(qw, 16))


# --------------------------------------------------------------------------- IQ4

def quantize_iq4_nl(x: torch.Tensor, qw: torch.Tensor) -> torch.Tensor:
    X = x.t().contiguous()  # (32, nb)
    sigma2 = _seq_sum(X * X) * 0.0625  # sigma2 *= 2.f/32
    return _iq4_nl(x, _weights(X, qw.t().contiguous(), sigma2[None]))


def quantize_iq4_xs(x: torch.Tensor, qw: torch.Tensor) -> torch.Tensor:
    X, QW = _sub_blocks(x, 32), _qw_sub_blocks(qw, 32)
    xt = _sub_blocks(x, QK_K)
    sigma2 = _seq_sum(xt * xt) * 0.0078125  # sigma2 *= 2.f/256
    W = _weights(X, QW, _per_sub(sigma2, 8))
    return _iq4_xs(x, W)


# --------------------------------------------------------------------------- legacy (sigma2 of the row)

def _legacy_weights(x: torch.Tensor, qw: torch.Tensor, sigma2: torch.Tensor):
    X, QW = x.t().contiguous(), qw.t().contiguous()  # (32, nb)
    return X, _weights(X, QW, sigma2[None])


def _pack_nibbles(L: torch.Tensor) -> torch.Tensor:
    """(nb, 32) levels -> (nb, 16): qs[j] = L[j] | L[j+16] << 4 (low 4 bits each)."""
    L = L.to(torch.int32)
    return u8((L[:, :16] & 0xF) | ((L[:, 16:] & 0xF) << 4))


def _qx_legacy(x, qw, sigma2, nmax):
    (X, W), one = _two_columns(*_legacy_weights(x, qw, sigma2))
    d, levels = _make_qx_quants_rmse1(X, nmax, W)
    L = levels().t().to(torch.int32)
    return (d[:1], L[:1]) if one else (d, L)


def _qkx3_legacy(x, qw, sigma2, nmax):
    (X, W), one = _two_columns(*_legacy_weights(x, qw, sigma2))
    SM, levels = _make_qkx2_quants(X, W, nmax, -0.9, 0.05, 36, False, zero_sign=True)
    L = levels().t().to(torch.int32)
    return (SM[0, :1], -SM[1, :1], L[:1]) if one else (SM[0], -SM[1], L)


def quantize_q4_0(x, qw, sigma2):
    d, L = _qx_legacy(x, qw, sigma2, 8)
    return torch.cat([fp16_bits(d), _pack_nibbles(L)], dim=1)


def quantize_q5_0(x, qw, sigma2):
    d, L = _qx_legacy(x, qw, sigma2, 16)
    return torch.cat([fp16_bits(d), _qh_pack(L >> 4), _pack_nibbles(L)], dim=1)


def quantize_q4_1(x, qw, sigma2):
    d, m, L = _qkx3_legacy(x, qw, sigma2, 15)
    return torch.cat([fp16_bits(d), fp16_bits(m), _pack_nibbles(L)], dim=1)


def quantize_q5_1(x, qw, sigma2):
    d, m, L = _qkx3_legacy(x, qw, sigma2, 31)
    return torch.cat([fp16_bits(d), fp16_bits(m), _qh_pack(L >> 4), _pack_nibbles(L)], dim=1)
