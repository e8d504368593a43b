"""ggml-exact legacy block quantizers (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) in torch.

Every function here reproduces, byte for byte, ggml's reference quantizers
(``quantize_row_*_ref`` in ``ggml/src/ggml-quants.c``), which is what
``ggml_quantize_chunk`` -- and therefore ``llama-quantize`` -- runs when no
importance matrix is given.  The shared float helpers at the top are also used
by the K-quant, IQ4 and i-quant kernels.

Rules followed to stay bit-exact with the C code (compiled without FMA, see
``tests/ggml/test_quant_kernels.py``):

* every arithmetic step is a separate IEEE float32 torch op, in the C order;
  float32 add/sub/mul/div/sqrt are correctly rounded on every torch backend, so
  the results are identical as long as no op is fused or reassociated;
* division always goes through :func:`div` / :func:`rdiv`: ``c / tensor`` in
  torch is ``tensor.reciprocal() * c`` and CUDA turns ``tensor / python_float``
  into a multiplication by the reciprocal -- both differ from IEEE division;
* float -> int conversions mimic x86 ``cvttss2si`` (what gcc emits for
  ``(int8_t)f``): truncation, and ``INT_MIN`` (low byte 0) for NaN / inf,
  then two's-complement wrap to the narrow C type;
* ``nearest_int`` is emulated with the very same 12582912 bit trick.

Kernels take a float32 tensor of blocks, shape ``(n_blocks, block_size)``, on
any device, and return a uint8 tensor ``(n_blocks, type_size)`` on that device.
Dequantizers take ``(n_blocks, type_size)`` uint8 and return float32
``(n_blocks, block_size)``, computed in the same op order as gguf-py's
``gguf.quants`` (and ggml's ``dequantize_row_*``) so results match exactly.
"""

from __future__ import annotations

import numpy as np
import torch

from . import cnumpy
from .cnumpy import MAGIC as _MAGIC, f32, wrap_i8  # noqa: F401  (f32, wrap_i8: the kernels import them from here)

__all__ = [
    "quantize_q8_0", "quantize_q4_0", "quantize_q4_1", "quantize_q5_0", "quantize_q5_1",
    "dequantize_q8_0", "dequantize_q4_0", "dequantize_q4_1", "dequantize_q5_0", "dequantize_q5_1",
]

_F32 = torch.float32


# --------------------------------------------------------------------------- helpers

def cst(v: float, ref: torch.Tensor) -> torch.Tensor:
    """0-dim float32 tensor on ``ref``'s device (never a CPU scalar on CUDA)."""
    return torch.full((), v, dtype=_F32, device=ref.device)


def div(a: torch.Tensor, b: torch.Tensor | float) -> torch.Tensor:
    """IEEE float32 ``a / b`` (``b`` may be a Python number)."""
    if isinstance(a, np.ndarray):
        return np.divide(a, np.float32(b) if isinstance(b, (int, float)) else b)
    if not isinstance(b, torch.Tensor):
        b = cst(b, a)
    return torch.div(a, b)


# The helpers below also take numpy arrays (float32 / int32), for the K-quants'
# per-block scale arithmetic on CPU: at a few hundred values a numpy op costs a
# third of a torch op.  The float rules are the same.

def rdiv(a: float, b: torch.Tensor, out=None) -> torch.Tensor:
    """IEEE float32 ``a / b`` for a constant numerator (into ``out`` if given)."""
    if isinstance(b, np.ndarray):
        return cnumpy.rdiv(a, b, out=out)
    return torch.div(cst(a, b), b, out=out)


def nearest_int(f: torch.Tensor) -> torch.Tensor:
    """ggml's ``nearest_int``: ``(bits(f + 12582912.f) & 0x7fffff) - 0x400000`` (int32)."""
    if isinstance(f, np.ndarray):
        return cnumpy.nearest_int(f)
    v = (f + _MAGIC).view(torch.int32)
    return (v & 0x007FFFFF) - 0x00400000


def trunc_small(f: torch.Tensor) -> torch.Tensor:
    """C ``(int8_t)f`` / ``(uint8_t)f`` where f is either small (|f| < 128) or non-finite.

    That is the situation of every legacy quantizer: a finite ``id = 1/d`` keeps
    |x*id| within the block range, and ``id`` is inf only for deep-subnormal
    scales.  Non-finite values convert to INT_MIN on x86, whose low byte is 0, so
    they become 0, which is what the wrap to the narrow C type gives.
    """
    return torch.nan_to_num(f, nan=0.0, posinf=0.0, neginf=0.0).to(torch.int32)


def fp16_bits(x: torch.Tensor) -> torch.Tensor:
    """IEEE round-to-nearest-even fp16 of float32 ``x`` (shape (N,)) as (N, 2) little-endian bytes."""
    if isinstance(x, np.ndarray):
        return cnumpy.fp16_bits(x)
    return x.to(torch.float16).contiguous().view(torch.uint8).view(-1, 2)


def fp16_round(x: torch.Tensor) -> torch.Tensor:
    """``GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(x))``."""
    if isinstance(x, np.ndarray):
        return cnumpy.fp16_round(x)
    return x.to(torch.float16).to(_F32)


def u8(v: torch.Tensor) -> torch.Tensor:
    """Store an int tensor into a C ``uint8_t`` (wrap)."""
    if isinstance(v, np.ndarray):
        return cnumpy.u8(v)
    return v if v.dtype == torch.uint8 else (v & 0xFF).to(torch.uint8)


def roundf(x: torch.Tensor) -> torch.Tensor:
    """C ``roundf`` (round half away from zero) of finite ``x``, exactly."""
    t = x.trunc()
    half = ((x - t).abs() >= 0.5).to(x.dtype)  # x - t is exact
    return t + x.sign() * half


def first_absmax(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """C loop ``if (fabsf(v) > amax) { amax = fabsf(v); max = v; }`` starting at 0.

    Returns (amax, max); ``max`` is +0.0 when every element is zero.  NaNs
    (scales of overflowed K-quant sub-blocks) are skipped, as the C compare does.
    """
    a = torch.nan_to_num(x.abs(), nan=0.0)
    amax, idx = a.max(dim=dim)  # first index of the maximum
    mx = x.gather(dim, idx.unsqueeze(dim)).squeeze(dim)
    mx = torch.where(amax > 0, mx, torch.zeros((), dtype=_F32, device=x.device))
    return amax, mx


def sqrt_f32(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 ``sqrtf`` of finite ``x >= 0``.

    torch's float32 CPU ``sqrt`` is not correctly rounded (off by one ulp now
    and then).  numpy's is (the hardware instruction, IEEE-exact; checked
    against the float64 root in the tests), so CPU tensors use it.  Elsewhere
    take the float64 root, round it, and settle the rounding with an exact
    float64 midpoint test (a float32 root is never a tie).
    """
    if x.device.type == "cpu":
        return torch.from_numpy(np.sqrt(x.numpy()))
    return _sqrt_f32_by_float64(x)


def _sqrt_f32_by_float64(x: torch.Tensor) -> torch.Tensor:
    s = torch.sqrt(x.to(torch.float64)).to(_F32)
    xd = x.to(torch.float64)
    sd = s.to(torch.float64)
    up = torch.nextafter(s, torch.full((), float("inf"), dtype=_F32, device=x.device))
    dn = torch.nextafter(s, torch.zeros((), dtype=_F32, device=x.device))
    mid_up = (sd + up.to(torch.float64)) * 0.5  # 25 significant bits: its square is exact
    mid_dn = (sd + dn.to(torch.float64)) * 0.5
    s = torch.where(xd > mid_up * mid_up, up, s)
    return torch.where(xd < mid_dn * mid_dn, dn, s)


def first_min(x: torch.Tensor, dim: int) -> torch.Tensor:
    """C ``if (v < min) min = v;`` scan: the first minimal element (keeps the sign of a zero)."""
    return x.gather(dim, x.argmin(dim=dim, keepdim=True)).squeeze(dim)


def first_max(x: torch.Tensor, dim: int) -> torch.Tensor:
    """C ``if (v > max) max = v;`` scan: the first maximal element (keeps the sign of a zero)."""
    return x.gather(dim, x.argmax(dim=dim, keepdim=True)).squeeze(dim)


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


def _qh_pack(hi: torch.Tensor) -> torch.Tensor:
    """(N, 32) bits (int) -> (N, 4) little-endian bytes of the uint32 bit mask: neighbouring bits ORed
    together in three halving steps, in uint8 (a shifted sum over int32 cost Q5_0 a third of its time)."""
    b = u8(hi).reshape(-1, 4, 8)
    b = b[..., 0::2] | (b[..., 1::2] << 1)
    b = b[..., 0::2] | (b[..., 1::2] << 2)
    return (b[..., 0] | (b[..., 1] << 4)).reshape(-1, 4)


# --------------------------------------------------------------------------- quantizers

_BELOW_HALF = float(np.nextafter(np.float32(0.5), np.float32(0.0)))  # 0.49999997f


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    amax = x.abs().amax(dim=1)
    d = div(amax, 127.0)
    idv = torch.where(d != 0, rdiv(1.0, d), torch.zeros_like(d))
    out = torch.empty((x.shape[0], 34), dtype=torch.uint8, device=x.device)
    out[:, :2] = fp16_bits(d)
    v = x * idv[:, None]
    if bool(torch.isinf(idv).any()):  # 1/d overflowed (deep-subnormal d): inf/NaN products store 0
        out[:, 2:] = u8(trunc_small(roundf(torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0))))
        return out
    # roundf(v) == trunc(v + copysign(0.49999997f, v)) for every float32 (checked exhaustively
    # for |v| <= 128; |v| <= 127 here), and the result fits int8: 3 passes instead of 8
    v += torch.copysign(cst(_BELOW_HALF, v), v)
    out[:, 2:] = v.trunc_().to(torch.int8).view(torch.uint8)
    return out


def _row_min_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's min and max. Rows of 32 (a legacy block) by halving: elementwise min/max of the two
    halves, five times, is twice as fast as torch's reduction over such short rows (NaN propagates both
    ways)."""
    w = x.shape[1]
    if w & (w - 1):
        return torch.aminmax(x, dim=1)
    lo = hi = x
    while w > 1:
        w //= 2
        lo, hi = torch.minimum(lo[:, :w], lo[:, w:2 * w]), torch.maximum(hi[:, :w], hi[:, w:2 * w])
    return lo[:, 0], hi[:, 0]


def _first_absmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``max`` of :func:`first_absmax` along the rows from one min/max pass: the first element of largest
    |x| is +amax or -amax, and only a row holding both (or a NaN) needs the index scan."""
    lo, hi = _row_min_max(x)
    amax = torch.maximum(hi, -lo)
    if bool(((hi == amax) & (lo == -amax) & (amax > 0) | (amax != amax)).any()):
        return first_absmax(x, 1)[1]
    return torch.where(amax > 0, torch.where(hi == amax, hi, lo), torch.zeros((), dtype=_F32, device=x.device))


def _absmax_signed_scale(x: torch.Tensor, divisor: float) -> tuple[torch.Tensor, torch.Tensor]:
    d = div(_first_absmax_rows(x), divisor)
    idv = torch.where(d != 0, rdiv(1.0, d), torch.zeros_like(d))
    return d, idv


def _levels_plus(x: torch.Tensor, idv: torch.Tensor, offset: float, top: int) -> torch.Tensor:
    """``MIN(top, (int8_t)(x*id + offset))`` as uint8, for the signed legacy types (offset = nmax + 0.5).
    With a finite ``id`` every ``x*id + offset`` lies in [0.5, 2*offset]: truncated straight to uint8, in
    place; a deep-subnormal scale (``id`` inf) takes the general path (non-finite values store 0)."""
    v = x * idv[:, None]
    v.add_(offset)  # two roundings, as C's x*id + offset (no fused multiply-add)
    if bool(torch.isinf(idv).any()):
        return u8(torch.clamp(trunc_small(v), max=top))
    return v.to(torch.uint8).clamp_(max=top)


def quantize_q4_0(x: torch.Tensor) -> torch.Tensor:
    d, idv = _absmax_signed_scale(x, -8.0)
    q = _levels_plus(x, idv, 8.5, 15)
    qs = q[:, :16] | (q[:, 16:] << 4)
    return torch.cat([fp16_bits(d), qs], dim=1)


def quantize_q5_0(x: torch.Tensor) -> torch.Tensor:
    d, idv = _absmax_signed_scale(x, -16.0)
    q = _levels_plus(x, idv, 16.5, 31)
    qs = (q[:, :16] & 0x0F) | ((q[:, 16:] & 0x0F) << 4)
    qh = _qh_pack((q & 0x10) >> 4)
    return torch.cat([fp16_bits(d), qh, qs], dim=1)


def _minmax_scale(x: torch.Tensor, nmax: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mn = first_min(x, 1)  # -0.0 vs 0.0 matters: it ends up in the fp16 bytes
    mx = first_max(x, 1)
    d = div(mx - mn, nmax)
    idv = torch.where(d != 0, rdiv(1.0, d), torch.zeros_like(d))
    return mn, d, idv


def quantize_q4_1(x: torch.Tensor) -> torch.Tensor:
    mn, d, idv = _minmax_scale(x, 15.0)
    v = (x - mn[:, None]) * idv[:, None] + 0.5
    q = u8(torch.clamp(trunc_small(v), max=15))
    qs = q[:, :16] | (q[:, 16:] << 4)
    return torch.cat([fp16_bits(d), fp16_bits(mn), qs], dim=1)


def quantize_q5_1(x: torch.Tensor) -> torch.Tensor:
    mn, d, idv = _minmax_scale(x, 31.0)
    v = (x - mn[:, None]) * idv[:, None] + 0.5
    q = trunc_small(v)  # (uint8_t)(x0 + 0.5f), no clamp in ggml (x0 + 0.5 < 32 anyway)
    qs = u8((q[:, :16] & 0x0F) | ((q[:, 16:] & 0x0F) << 4))
    qh = _qh_pack((q & 0x10) >> 4)
    return torch.cat([fp16_bits(d), fp16_bits(mn), qh, qs], dim=1)


# --------------------------------------------------------------------------- dequantizers

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
