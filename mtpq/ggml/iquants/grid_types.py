"""IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S: each type's blocks packed from the grid search."""

from __future__ import annotations

import torch

from ..legacy import f32
from .search import (
    _col, _finish, _IQ2_S, _IQ2_XS, _IQ2_XXS, _IQ3_S, _IQ3_XXS, _le_bytes, _search, _shifted, _super_scales,
    _zero_dead,
)


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
