"""Dequantization of every i-quant type, vectorised over blocks (CUDA-capable)."""

from __future__ import annotations

import functools

import numpy as np
import torch
from gguf import quants as gq

from ..legacy import f32, from_fp16_bytes
from .tables import _F32, QK_K
from .iq1 import IQ1_DELTA


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
