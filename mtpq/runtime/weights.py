"""Weights read straight from a GGUF file, kept in their GGUF type on the device.

A quantized tensor (Q8_0, Q4_K, ...) stays as its raw GGUF bytes (a uint8 tensor
on the device) and is dequantized on the fly, at each use, by
:func:`mtpq.runtime.dequant.dequantize`; so a Q4 model needs Q4 memory plus one
dequantized matrix at a time. F32 tensors (and any float tensor already in the compute
dtype) are used as they are. F16/BF16 tensors under a wider compute dtype stay in their
16 bits and are widened at each use into a buffer reused from call to call
(:func:`widened`): the values are exactly those of a one-time conversion, but a decoding
step reads half the bytes, and on a small model reading the weights is what a step costs
(a 16 MB f32 working set streams at ~4 GB/s on a loaded core; widening f16 into a hot
buffer runs the same matrices ~2x faster).

A small model (its quantized weights at most :data:`KEEP_DEQUANTIZED_BYTES` once dequantized) keeps each
matrix after its first dequantization: decoding one token at a time otherwise spends most of each step
dequantizing again (~70 % of `mtpq accept` on the demo's Q4_K_M). Same bytes, same values.

- :class:`Weights` / :class:`Scope`: a GGUF's tensors bound once to a device and dtype, seen under a
  name prefix (``blk.3.``), so modules are built as ``Attention(scope, ...)``.
- :class:`QWeight`: one weight (2-D matrix or 3-D stack of experts) in its GGUF type;
  ``dequant()`` gives the float matrix, ``dequant(e)`` one expert's, ``rows(ids)``
  the rows of an embedding table (rows of a quantized matrix are independent blocks).
- :class:`QuantLinear`: ``y = x @ W.T (+ b)`` with ``W`` a :class:`QWeight`.

Shapes are torch order throughout: ``(rows, row_length)``; GGUF's ne[0] is the row length.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from ..errors import InputError
from ..ggml.types import FLOAT_TYPES
from ..gguf_io import GGUFFile  # noqa: F401  (GGUFFile: the package's one reader)

DEQUANT_CHUNK = 1 << 26  # elements dequantized at once by QuantLinear: bounds the transient float copy
# a model whose quantized weights dequantize to at most this many bytes keeps them dequantized after first use
# (the demo's: ~60 MB in f32); bigger models dequantize at each use, in Q4 memory plus one matrix
KEEP_DEQUANTIZED_BYTES = 1 << 30


class Weights:
    """The tensors of one GGUF bound once to a device and compute dtype.

    Modules take a :class:`Scope` (``weights.at("blk.3.")``) instead of threading
    ``(file, prefix, device, dtype)`` through every constructor.
    """

    def __init__(self, g: GGUFFile, device: torch.device | str, dtype: torch.dtype, round_inputs: bool = False):
        self.file, self.device, self.dtype = g, torch.device(device), dtype
        self.pool: dict = {}  # widening buffers shared by this model's weights (see widened)
        self.round_inputs = round_inputs  # llama.cpp's CPU numerics (see vec_dot_input)
        quantized_values = sum(
            int(np.prod(t.shape, dtype=np.int64)) for t in g.tensors.values() if t.tensor_type not in FLOAT_TYPES
        )
        self.keep_dequantized = quantized_values * dtype.itemsize <= KEEP_DEQUANTIZED_BYTES

    def at(self, prefix: str = "") -> "Scope":
        return Scope(self, prefix)


def widened(t: torch.Tensor, dtype: torch.dtype, pool: dict) -> torch.Tensor:
    """``t`` as ``dtype``: ``t`` itself when it already is, else copied into ``pool``'s buffer of that shape.

    The buffer is reused by the next call with the same shape, so use the result at once (one GEMM)
    and keep nothing that aliases it. Reusing it matters: a fresh multi-megabyte tensor per call
    costs page faults that take longer than the GEMM."""
    if t.dtype == dtype:
        return t
    key = (tuple(t.shape), dtype, t.device)
    buf = pool.get(key)
    if buf is None:
        with torch.inference_mode(False):  # a normal tensor: writable inside and outside inference mode
            buf = pool[key] = torch.empty(t.shape, dtype=dtype, device=t.device)
    return buf.copy_(t)


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without a dispatcher call when it is already ``dtype`` (the common case, per op)."""
    return t if t.dtype == dtype else t.to(dtype)


def _full_name(prefix: str, name: str) -> str:
    """``attn_q`` -> ``{prefix}attn_q.weight``; a name with a dot (``exp_probs_b.bias``) is taken as is."""
    return prefix + (name if "." in name else name + ".weight")


class Scope:
    """A view of :class:`Weights` under one name prefix (``blk.N.``, ``blk.N.nextn.`` or the top level)."""

    def __init__(self, weights: Weights, prefix: str):
        self.weights, self.prefix = weights, prefix

    @property
    def file(self) -> GGUFFile:
        return self.weights.file

    def at(self, prefix: str) -> "Scope":
        return Scope(self.weights, self.prefix + prefix)

    def name(self, name: str) -> str:
        full = _full_name(self.prefix, name)
        if full not in self.file and self.prefix + name in self.file:  # stored without a suffix (ssm_a)
            return self.prefix + name
        return full

    def has(self, name: str) -> bool:
        return self.name(name) in self.file

    def shape(self, name: str) -> tuple[int, ...]:
        return self.file.shape(self.name(name))

    def qweight(self, name: str) -> "QWeight":
        """A weight kept in its GGUF type (matrices, expert stacks, embedding tables)."""
        full = self.name(name)
        if full not in self.file:
            raise InputError(self.file.path, f"missing tensor {full}")
        t = self.file.tensors[full]
        q = QWeight.from_reader(
            t, self.file.shape(full), self.weights.device, self.weights.dtype, pool=self.weights.pool
        )
        q.round_inputs = self.weights.round_inputs
        if self.weights.keep_dequantized and q.quantized:
            q.kept = {}
        return q

    def linear(self, name: str, bias: bool = True) -> "QuantLinear":
        """``{name}.weight`` as a linear layer, with ``{name}.bias`` when the file has one (and bias=True)."""
        b = self.optional(name + ".bias") if bias else None
        return QuantLinear(self.qweight(name), b)

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A tensor fully dequantized (norms, biases, routers); ``dtype`` defaults to the compute dtype."""
        return self.qweight(name).dequant().to(dtype or self.weights.dtype)

    def optional(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        return self.tensor(name, dtype) if self.has(name) else None


def _float_from_reader(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    if qtype == GGMLQuantizationType.BF16:  # numpy has no bfloat16: widen the 16 bits to the top of an f32
        bits = torch.from_numpy(np.asarray(data).view(np.uint16).astype(np.int32) << 16)
        return bits.view(torch.float32).reshape(shape)
    return torch.from_numpy(np.array(data, copy=True, order="C")).reshape(shape)  # a copy: memmaps are read-only


class QWeight(nn.Module):
    """One GGUF weight on the device: raw bytes for quantized types, a float tensor otherwise.

    For 3-D tensors (stacked experts ``(n_expert, rows, cols)``) ``dequant(e)`` returns expert ``e``
    only, so a MoE layer dequantizes just the experts a token is routed to.
    """

    def __init__(
        self,
        qtype: GGMLQuantizationType,
        shape: tuple[int, ...],
        data: torch.Tensor,
        dtype: torch.dtype,
        name: str = "",
        pool: dict | None = None,
    ):
        super().__init__()
        self.name = name  # the GGUF tensor name (importance statistics are keyed by it)
        self.qtype = qtype
        self.shape = tuple(shape)
        self.dtype = dtype
        self.pool = {} if pool is None else pool  # widening buffers (see widened)
        # raw: uint8 [..., rows, bytes_per_row] (quantized), float [..., rows, cols] in the compute dtype,
        # or (narrow) f16/bf16 under a wider compute dtype
        self.register_buffer("data", data, persistent=False)
        self.round_inputs = False  # True: inputs rounded as llama.cpp's CPU backend rounds them (vec_dot_input)
        # a small model's quantized weight: its dequantized matrices by expert (key None: the whole); see top
        self.kept: dict | None = None

    def input(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as this weight's matrix products see it: as it is, or (``round_inputs``) rounded to the
        type llama.cpp's CPU backend converts activations to before its dot products with this weight."""
        return vec_dot_input(x, self.qtype) if self.round_inputs else x

    @classmethod
    def from_reader(cls, t, shape: tuple[int, ...], device, dtype: torch.dtype, pool: dict | None = None) -> "QWeight":
        qtype = GGMLQuantizationType(t.tensor_type)
        if qtype in FLOAT_TYPES:
            data = _float_from_reader(t.data, qtype, shape)
            keep = _NARROW.get(qtype)  # 16-bit weights stay 16-bit under a wider compute dtype (widened at use)
            if keep is None or dtype.itemsize <= keep.itemsize:
                keep = dtype
            data = data.to(device=device, dtype=keep)
        else:
            raw = np.array(t.data, copy=True, order="C").view(np.uint8)
            data = torch.from_numpy(raw.reshape(*shape[:-1], -1)).to(device)
        return cls(qtype, shape, data, dtype, name=t.name, pool=pool)

    @property
    def quantized(self) -> bool:
        return self.qtype not in FLOAT_TYPES

    @property
    def narrow(self) -> bool:
        """A float weight kept in a narrower dtype than the compute dtype."""
        return not self.quantized and self.data.dtype != self.dtype

    def matrix(self, expert: int | None = None) -> torch.Tensor:
        """Like :meth:`dequant` for immediate use in one GEMM: a narrow float weight comes back in a reused
        buffer (see :func:`widened`), valid until the next widening of that shape."""
        if self.quantized:
            return self.dequant(expert)
        return widened(self.data if expert is None else self.data[expert], self.dtype, self.pool)

    def dequant_bytes(self, raw: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        from .dequant import dequantize  # torch, on the weight's device (CUDA included)

        return dequantize(raw, self.qtype, shape).to(device=raw.device, dtype=self.dtype)

    def dequant(self, expert: int | None = None) -> torch.Tensor:
        """The float matrix (or expert ``expert``'s matrix of a 3-D stack). Read-only when ``kept``."""
        if self.kept is not None:
            m = self.kept.get(expert)
            if m is None:
                m = self.kept[expert] = self._dequant(expert)
            return m
        return self._dequant(expert)

    def _dequant(self, expert: int | None) -> torch.Tensor:
        if expert is None:
            return self.dequant_bytes(self.data, self.shape) if self.quantized else self.data.to(self.dtype)
        if not self.quantized:
            return self.data[expert].to(self.dtype)
        return self.dequant_bytes(self.data[expert], self.shape[1:])

    def row_range(self, start: int, stop: int) -> torch.Tensor:
        """Rows start..stop-1 of a 2-D weight as floats (a narrow weight's in a reused buffer, see matrix)."""
        if not self.quantized:
            return widened(self.data[start:stop], self.dtype, self.pool)
        if self.kept is not None:
            return self.dequant()[start:stop]
        return self.dequant_bytes(self.data[start:stop], (stop - start, self.shape[-1]))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of a 2-D table (embedding lookup) without dequantizing the whole table."""
        if not self.quantized:
            return as_dtype(F.embedding(ids, self.data), self.dtype)
        if self.kept is not None:
            return F.embedding(ids, self.dequant())
        flat = ids.reshape(-1)
        picked = self.dequant_bytes(self.data[flat], (flat.numel(), self.shape[-1]))
        return picked.reshape(*ids.shape, self.shape[-1])

    def extra_repr(self) -> str:
        return f"{self.qtype.name}, shape={self.shape}"


_NARROW = {GGMLQuantizationType.F16: torch.float16, GGMLQuantizationType.BF16: torch.bfloat16}

# Set by mtpq.runtime.importance while it collects importance statistics: called as
# observer(weight name, expert index or None, the input rows the weight multiplies).
observer = None


class QuantLinear(nn.Module):
    """A linear layer whose weight stays in its GGUF type: y = x W^T + b."""

    def __init__(self, weight: QWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = weight
        self.register_buffer("bias", bias, persistent=False)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if observer is not None:
            observer(w.name, None, x)
        x = w.input(x)
        bias = None if self.bias is None else as_dtype(self.bias, x.dtype)
        rows, cols = w.shape
        if not (w.quantized or w.narrow) or rows * cols <= DEQUANT_CHUNK:
            return F.linear(x, as_dtype(w.matrix(), x.dtype), bias)
        # a big quantized or narrow matrix (the LM head: vocab x hidden) is decoded a slab of rows at a time
        step = max(1, DEQUANT_CHUNK // cols)
        out = torch.cat(
            [F.linear(x, w.row_range(r, min(rows, r + step)).to(x.dtype)) for r in range(0, rows, step)], dim=-1
        )
        return out if bias is None else out + bias


class FusedLinear(nn.Module):
    """Linear layers that read the same input, as one GEMM when every weight is a float matrix of one
    dtype: ``q, k, v = FusedLinear(wq, wk, wv)(x)``. On small models the per-call overhead of a GEMM,
    not its arithmetic, is what costs. The parts keep working on their own: their weights become views
    into the fused matrix (no second copy). Quantized parts stay separate calls (each dequantizes its
    own bytes)."""

    def __init__(self, *parts: QuantLinear):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.sizes = [p.out_features for p in parts]
        ws = [p.weight for p in parts]
        fusable = all(not w.quantized and w.data.dim() == 2 for w in ws) and len({w.data.dtype for w in ws}) == 1
        self.fused = fusable and len(parts) > 1
        if not self.fused:
            return
        weight = torch.cat([w.data for w in ws])  # in the parts' own dtype (narrow stays narrow)
        biases = [p.bias for p in parts]
        bias = (
            None
            if all(b is None for b in biases)
            else torch.cat(
                [
                    b.to(ws[0].dtype) if b is not None else weight.new_zeros(n, dtype=ws[0].dtype)
                    for b, n in zip(biases, self.sizes)
                ]
            )
        )  # biases in the compute dtype, even when the weights are narrow
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.pool = ws[0].pool
        row = 0
        for p, n in zip(parts, self.sizes):  # the parts now view the fused matrix
            p.weight.data = weight[row : row + n]
            row += n

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not self.fused:
            return tuple(p(x) for p in self.parts)
        if observer is not None:
            for p in self.parts:
                observer(p.weight.name, None, x)
        bias = None if self.bias is None else as_dtype(self.bias, x.dtype)
        x = self.parts[0].weight.input(x)  # (fused parts share one float dtype, so one rounding)
        return F.linear(x, widened(self.weight, x.dtype, self.pool), bias).split(self.sizes, dim=-1)


# ----------------------------------------------------------------------------- llama.cpp's CPU numerics

_KQ = {
    GGMLQuantizationType[n]
    for n in (
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "IQ2_XXS",
        "IQ2_XS",
        "IQ2_S",
        "IQ3_XXS",
        "IQ3_S",
        "IQ1_S",
        "IQ1_M",
        "IQ4_XS",
    )
}
_Q8_0 = {GGMLQuantizationType[n] for n in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "MXFP4")}


def vec_dot_input(x: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """The values llama.cpp's CPU backend multiplies a weight of ``qtype`` with: it first converts the
    activations to the weight type's ``vec_dot_type`` (ggml-cpu.c's type traits): Q8_K blocks of 256 for
    k-quants and i-quants, Q8_0/Q8_1 blocks of 32 for the legacy types, f16/bf16 for 16-bit weights. A quant's
    KLD as llama-perplexity reports it includes that rounding, so ``mtpq compare`` reproduces it."""
    if qtype in _KQ and x.shape[-1] % 256 == 0:
        return _q8_k(x)
    if qtype in _Q8_0 and x.shape[-1] % 32 == 0:
        return _q8_0(x)
    if qtype == GGMLQuantizationType.F16:
        return x.to(torch.float16).to(x.dtype)
    if qtype == GGMLQuantizationType.BF16:
        return x.to(torch.bfloat16).to(x.dtype)
    return x


def _q8_k(x: torch.Tensor) -> torch.Tensor:
    """quantize_row_q8_K_ref: per 256 values the one of largest magnitude m; q = nearest(-127/m * x) <= 127,
    value q / (-127/m) (the scale kept in f32)."""
    b = x.float().reshape(-1, 256)
    m = b.gather(-1, b.abs().argmax(-1, keepdim=True))
    iscale = torch.where(m == 0, torch.zeros_like(m), -127.0 / m)
    q = torch.round(iscale * b).clamp(max=127)  # torch.round: half to even, as ggml's nearest_int
    d = torch.where(m == 0, torch.zeros_like(m), 1.0 / iscale)
    return (q * d).reshape(x.shape).to(x.dtype)


def _q8_0(x: torch.Tensor) -> torch.Tensor:
    """quantize_row_q8_0 (AVX2): per 32 values d = amax / 127 kept as f16, q = round(x * 127 / amax)."""
    b = x.float().reshape(-1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    inv = torch.where(amax == 0, torch.zeros_like(amax), 127.0 / amax)
    q = torch.round(b * inv)
    return (q * (amax / 127.0).to(torch.float16).float()).reshape(x.shape).to(x.dtype)
