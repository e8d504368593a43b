"""The runtime's dequantizers: a weight's GGUF bytes decoded in torch on the tensor's device (CUDA included),
the values of ``gguf.quants.dequantize`` (and of ggml's ``dequantize_row_*``), in the same op order.

Every type the runtime may load: the float types, the legacy, K-, IQ4 and grid i-quants, MXFP4. A type without
a torch decoder here (the ternary and 1-/2-bit types) is decoded by mtpq.ggml's CPU kernels and moved to the
device.
"""

from __future__ import annotations

import functools
from typing import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq

from ..ggml.types import FLOAT_TYPES

T = GGMLQuantizationType
_F32 = torch.float32
QK_K = 256
_IQ1_DELTA = 0.125
_DEQUANT_CHUNK = 1 << 24  # output elements per decoding step


def _f32(v: float) -> float:
    return float(np.float32(v))


@functools.cache
def _const(values: tuple | int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small constant tensor, made once per device: a fresh torch.tensor from a list would copy it to a GPU on
    every call, and that copy waits for the device (a host sync per decoded weight while drafting)."""
    return torch.tensor(values, dtype=dtype, device=device)


def from_fp16_bytes(b: torch.Tensor) -> torch.Tensor:
    """(N, 2) uint8 little-endian fp16 -> (N,) float32."""
    return b.contiguous().view(torch.float16).view(-1).to(_F32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(N, 16) packed bytes -> (N, 32) values: low nibbles then high nibbles."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _qh_bits(qh: torch.Tensor) -> torch.Tensor:
    """(N, 4) bytes of a little-endian uint32 -> (N, 32) bits as uint8."""
    shifts = torch.arange(8, device=qh.device, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(qh.shape[0], 32)


def dequantize_q8_0(b: torch.Tensor) -> torch.Tensor:
    d = from_fp16_bytes(b[:, :2])
    q = b[:, 2:].contiguous().view(torch.int8).to(_F32)
    return q * d[:, None]


def dequantize_q4_0(b: torch.Tensor) -> torch.Tensor:
    d = from_fp16_bytes(b[:, :2])
    q = (_nibbles(b[:, 2:]).to(torch.int16) - 8).to(_F32)
    return d[:, None] * q


def dequantize_q4_1(b: torch.Tensor) -> torch.Tensor:
    d = from_fp16_bytes(b[:, :2])
    m = from_fp16_bytes(b[:, 2:4])
    q = _nibbles(b[:, 4:]).to(_F32)
    return d[:, None] * q + m[:, None]


def dequantize_q5_0(b: torch.Tensor) -> torch.Tensor:
    d = from_fp16_bytes(b[:, :2])
    q = _nibbles(b[:, 6:]) | (_qh_bits(b[:, 2:6]) << 4)
    return d[:, None] * (q.to(torch.int16) - 16).to(_F32)


def dequantize_q5_1(b: torch.Tensor) -> torch.Tensor:
    d = from_fp16_bytes(b[:, :2])
    m = from_fp16_bytes(b[:, 2:4])
    q = (_nibbles(b[:, 8:]) | (_qh_bits(b[:, 4:8]) << 4)).to(_F32)
    return d[:, None] * q + m[:, None]


def _unpack_2bit(qs: torch.Tensor) -> torch.Tensor:
    """(nb, 64) -> (nb, 256) 2-bit values in element order."""
    shifts = _const((0, 2, 4, 6), torch.uint8, qs.device).view(1, 1, 4, 1)
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
    shifts = _const((0, 2, 4, 6), torch.uint8, b.device)
    high = ((sb[:, 8:12].unsqueeze(1) >> shifts.view(1, 4, 1)) & 3).reshape(nb, 16)  # j = 4g + k
    sc = (low | (high << 4)).to(torch.int16) - 32
    dl = (d[:, None] * sc.to(_F32)).view(nb, 16, 1)
    ql = _unpack_2bit(b[:, 32:96]).to(torch.int16)
    bit = torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)
    hb = ((hmask.unsqueeze(1) >> bit) & 1).reshape(nb, QK_K)
    q = (ql - 4 * (1 - hb.to(torch.int16))).to(_F32).view(nb, 16, 16)
    return (dl * q).view(nb, QK_K)


def _k4_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K blocks -> the 8 sub-blocks' scales d * sc and mins dmin * m, each (nb, 8, 1)."""
    nb = b.shape[0]
    d, dmin = from_fp16_bytes(b[:, 0:2]), from_fp16_bytes(b[:, 2:4])
    s = b[:, 4:16]
    ds, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([ds & 0x3F, (md & 0x0F) | ((ds >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return (d[:, None] * sc.to(_F32)).view(nb, 8, 1), (dmin[:, None] * mn.to(_F32)).view(nb, 8, 1)


def dequantize_q4_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    dl, ml = _k4_scales(b)
    qs = b[:, 16:].view(nb, 4, 1, 32)
    q = torch.cat([qs & 0xF, qs >> 4], dim=2).view(nb, 8, 32).to(_F32)
    return (dl * q - ml).view(nb, QK_K)


def dequantize_q5_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    dl, ml = _k4_scales(b)
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
    shifts = _const((0, 2, 4, 6), torch.uint8, b.device).view(1, 1, 4, 1)
    hi = (qh >> shifts) & 3
    q = ((lo | (hi << 4)).to(torch.int16) - 32).to(_F32).view(nb, 16, 16)
    dl = (d[:, None] * sc).view(nb, 16, 1)
    return (dl * q).view(nb, QK_K)


_KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _kvalues(device) -> torch.Tensor:
    return _const(_KVALUES_IQ4NL, _F32, device)


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


@functools.cache
def _dequant_tables(name: str, device: str):
    qcls = getattr(gq, name)
    qcls.init_grid()
    grid = torch.from_numpy(np.asarray(qcls.grid, dtype=np.float32).reshape(qcls.grid_shape).copy()).to(device)
    ksigns = torch.from_numpy(np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8).astype(np.int64)).to(device)
    return grid, ksigns


def _grid_block(b: torch.Tensor, name: str) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the grid-coded types (gguf-py class ``name``) start with: the block count n, their grid and sign tables
    on b's device, and the fp16 block scale d as (n, 1)."""
    n = b.shape[0]
    grid, ksigns = _dequant_tables(name, b.device.type)
    return n, grid, ksigns, from_fp16_bytes(b[:, :2]).view(n, 1)


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
    n, grid, ksigns, d = _grid_block(b, "IQ2_XXS")
    qs = _u32(b[:, 2:]).view(n, 8, 2)
    db = (d * (_f32(0.5) + (qs[..., 1] >> 28).to(_F32)) * _f32(0.25)).view(n, 8, 1, 1)
    sh = _const((0, 7, 14, 21), torch.int64, b.device)
    signs = _sign_factors((qs[..., 1:2] >> sh) & 127, ksigns)  # (n, 8, 4, 8)
    idx = torch.stack([(qs[..., 0] >> (8 * j)) & 255 for j in range(4)], -1)  # (n, 8, 4)
    g = grid[idx]  # (n, 8, 4, 8)
    return (db * g * signs).reshape(n, QK_K)


def dequantize_iq3_xxs(b: torch.Tensor) -> torch.Tensor:
    """(n, 98) uint8 -> (n, 256) float32, as gguf-py's IQ3_XXS."""
    n, grid, ksigns, d = _grid_block(b, "IQ3_XXS")
    qs = b[:, 2:66].to(torch.int64).view(n, 8, 8)
    sc = _u32(b[:, 66:98])  # (n, 8)
    db = (d * (_f32(0.5) + (sc >> 28).to(_F32)) * _f32(0.5)).view(n, 8, 1, 1)
    sh = _const((0, 7, 14, 21), torch.int64, b.device)
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
    n, grid, ksigns, d = _grid_block(b, "IQ2_XS")
    qs = b[:, 2:66].to(torch.int64).view(n, 32, 2)
    qs = qs[..., 0] | (qs[..., 1] << 8)  # (n, 32) uint16
    db = (d * (_f32(0.5) + _nibble_scales(b[:, 66:74])) * _f32(0.25)).view(n, 16, 1, 1)
    signs = _sign_factors(qs >> 9, ksigns).view(n, 16, 2, 8)
    g = grid[qs & 511].view(n, 16, 2, 8)
    return (db * g * signs).reshape(n, QK_K)


def dequantize_iq2_s(b: torch.Tensor) -> torch.Tensor:
    """(n, 82) uint8 -> (n, 256) float32, as gguf-py's IQ2_S."""
    n, grid, _, d = _grid_block(b, "IQ2_S")
    db = (d * (_f32(0.5) + _nibble_scales(b[:, 74:82])) * _f32(0.25)).view(n, 16, 1, 1)
    signs = _bit_signs(b[:, 34:66]).view(n, 16, 2, 8)
    qh = (b[:, 66:74].to(torch.int64).unsqueeze(-1) >> _const((0, 2, 4, 6), torch.int64, b.device)) & 3
    qs = b[:, 2:34].to(torch.int64) | (qh.reshape(n, 32) << 8)
    g = grid[qs].view(n, 16, 2, 8)
    return (db * g * signs).reshape(n, QK_K)


def dequantize_iq3_s(b: torch.Tensor) -> torch.Tensor:
    """(n, 110) uint8 -> (n, 256) float32, as gguf-py's IQ3_S."""
    n, grid, _, d = _grid_block(b, "IQ3_S")
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
    n, grid, _, d = _grid_block(b, "IQ1_S")
    qh = b[:, 34:50].to(torch.int64).view(n, 8, 2)
    qh = qh[..., 0] | (qh[..., 1] << 8)  # (n, 8) uint16
    dl = (d * (2 * ((qh >> 12) & 7) + 1).to(_F32)).view(n, 8, 1, 1)
    delta = torch.where((qh & 0x8000) == 0, _IQ1_DELTA, -_IQ1_DELTA).to(_F32).view(n, 8, 1, 1)
    hi = (qh.unsqueeze(-1) >> _const((0, 3, 6, 9), torch.int64, b.device)) & 7  # (n, 8, 4)
    qs = b[:, 2:34].to(torch.int64) | (hi.reshape(n, 32) << 8)
    g = grid[qs].view(n, 8, 4, 8)
    return (dl * (g + delta)).reshape(n, QK_K)


def dequantize_iq1_m(b: torch.Tensor) -> torch.Tensor:
    """(n, 56) uint8 -> (n, 256) float32, as gguf-py's IQ1_M."""
    n = b.shape[0]
    grid, _ = _dequant_tables("IQ1_M", b.device.type)
    sc = b[:, 48:56].to(torch.int64).view(n, 4, 2)
    sc = sc[..., 0] | (sc[..., 1] << 8)  # (n, 4) uint16
    dbits = ((sc & 0xF000) >> _const((12, 8, 4, 0), torch.int64, b.device)).sum(1)  # disjoint nibbles
    d = dbits.to(torch.int16).view(torch.float16).to(_F32).view(n, 1)
    s3 = (sc.unsqueeze(-1) >> _const((0, 3, 6, 9), torch.int64, b.device)) & 7
    dl = (d * (2 * s3.reshape(n, 16) + 1).to(_F32)).view(n, 16, 1, 1, 1)
    qh = b[:, 32:48].to(torch.int64)
    qh2 = qh.unsqueeze(-1) >> _const((0, 4), torch.int64, b.device)  # (n, 16, 2)
    qs = b[:, :32].to(torch.int64) | ((qh2 & 7).reshape(n, 32) << 8)
    delta = torch.where((qh2 & 8) == 0, _IQ1_DELTA, -_IQ1_DELTA).to(_F32).view(n, 8, 2, 2, 1)
    g = grid[qs].view(n, 8, 2, 2, 8)
    return (dl.view(n, 8, 2, 1, 1) * (g + delta)).reshape(n, QK_K)


_KVALUES = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 0.0, -1.0, -2.0, -3.0, -4.0, -6.0, -8.0, -12.0)


def dequantize_mxfp4(b: torch.Tensor) -> torch.Tensor:
    """uint8 blocks [n, 17] -> float32 values [n, 32]."""
    x = b[:, :1].to(torch.int32)
    # 2^(x - 128) as float32 bits: normal from x = 2 on, the two smallest are subnormal (as ggml builds them)
    bits = torch.where(x < 2, _const(0x00200000, torch.int32, b.device) << x, (x - 1) << 23)
    d = bits.view(torch.float32)
    qs = b[:, 1:]
    codes = torch.cat((qs & 0xF, qs >> 4), dim=1).long()
    return d * _const(tuple(_KVALUES), torch.float32, b.device)[codes]


_DECODERS: dict[T, Callable[[torch.Tensor], torch.Tensor]] = {
    T.Q8_0: dequantize_q8_0,
    T.Q4_0: dequantize_q4_0,
    T.Q4_1: dequantize_q4_1,
    T.Q5_0: dequantize_q5_0,
    T.Q5_1: dequantize_q5_1,
    T.Q2_K: dequantize_q2_k,
    T.Q3_K: dequantize_q3_k,
    T.Q4_K: dequantize_q4_k,
    T.Q5_K: dequantize_q5_k,
    T.Q6_K: dequantize_q6_k,
    T.IQ4_NL: dequantize_iq4_nl,
    T.IQ4_XS: dequantize_iq4_xs,
    T.IQ2_XXS: dequantize_iq2_xxs,
    T.IQ3_XXS: dequantize_iq3_xxs,
    T.IQ2_XS: dequantize_iq2_xs,
    T.IQ2_S: dequantize_iq2_s,
    T.IQ3_S: dequantize_iq3_s,
    T.IQ1_S: dequantize_iq1_s,
    T.IQ1_M: dequantize_iq1_m,
    T.MXFP4: dequantize_mxfp4,
}


def _as_torch(raw: np.ndarray | torch.Tensor) -> torch.Tensor:
    if isinstance(raw, torch.Tensor):
        return raw
    arr = np.asarray(raw)
    if not arr.flags.c_contiguous or not arr.flags.writeable:
        arr = np.array(arr, copy=True, order="C")  # torch refuses read-only memory (memmaps)
    return torch.from_numpy(arr)


def dequantize(raw: np.ndarray | torch.Tensor, qtype: GGMLQuantizationType, shape) -> torch.Tensor:
    """Decode ``raw`` (the GGUF bytes, any leading shape) into a float32 tensor of ``shape``, on ``raw``'s device
    (numpy input on CPU)."""
    qtype = GGMLQuantizationType(qtype)
    shape = tuple(int(s) for s in shape)
    n_el = int(np.prod(shape, dtype=np.int64))
    t = _as_torch(raw)
    if qtype in FLOAT_TYPES:
        if t.is_floating_point() and qtype != T.BF16 or qtype == T.BF16 and t.dtype == torch.bfloat16:
            return t.to(torch.float32).reshape(shape)
        u8 = t.contiguous().view(torch.uint8).reshape(-1)
        if qtype == T.F32:
            return u8.view(torch.float32).reshape(shape).clone()
        if qtype == T.F16:
            return u8.view(torch.float16).to(torch.float32).reshape(shape)
        return (u8.view(torch.int16).to(torch.int32) << 16).view(torch.float32).reshape(shape)
    bs, ts = GGML_QUANT_SIZES[qtype]
    if shape[-1] % bs:
        raise ValueError(f"dequantize: row length {shape[-1]} is not a multiple of the {qtype.name} block size {bs}")
    u8 = t.contiguous().view(torch.uint8).reshape(-1)
    nblocks = n_el // bs
    if u8.numel() != nblocks * ts:
        raise ValueError(f"dequantize: {u8.numel()} bytes given, {qtype.name} {shape} needs {nblocks * ts}")
    decode = _DECODERS.get(qtype)
    if decode is None:  # no torch decoder: mtpq.ggml's CPU kernels
        from ..ggml.engine import dequantize as on_cpu

        return torch.from_numpy(on_cpu(u8.cpu().numpy(), qtype, shape)).to(u8.device)
    b = u8.view(nblocks, ts)
    step = max(1, _DEQUANT_CHUNK // bs)
    if nblocks <= step:
        return decode(b).reshape(shape)
    out = torch.empty((nblocks, bs), dtype=torch.float32, device=b.device)
    for b0 in range(0, nblocks, step):
        out[b0 : b0 + step] = decode(b[b0 : b0 + step])
    return out.reshape(shape)
