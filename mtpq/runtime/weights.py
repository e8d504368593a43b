"""Weights read straight from a GGUF file, kept in their GGUF type on the device.

A quantized tensor (Q8_0, Q4_K, ...) stays as its raw GGUF bytes (a uint8 tensor
on the device) and is dequantized on the fly, at each use, by
:func:`mtpq.quantize.kernels.dequantize`; so a Q4 model needs Q4 memory plus one
dequantized matrix at a time. F32/F16/BF16 tensors are converted once to the
compute dtype.

- :class:`GGUFFile`: the metadata (plain Python values) and tensors of one file.
- :class:`QWeight`: one weight (2-D matrix or 3-D stack of experts) in its GGUF type;
  ``dequant()`` gives the float matrix, ``dequant(e)`` one expert's, ``rows(ids)``
  the rows of an embedding table (rows of a quantized matrix are independent blocks).
- :class:`QuantLinear`: ``y = x @ W.T (+ b)`` with ``W`` a :class:`QWeight`.

Shapes are torch order throughout: ``(rows, row_length)``; GGUF's ne[0] is the row length.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from ..errors import InputError
from ..gguf_io import open_gguf

FLOAT_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
DEQUANT_CHUNK = 1 << 26  # elements dequantized at once by QuantLinear: bounds the transient float copy


class GGUFFile:
    """A GGUF file opened (memory-mapped) with gguf-py's GGUFReader."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.reader = open_gguf(self.path)
        self.kv: dict[str, Any] = {}
        for name, fld in self.reader.fields.items():
            if name.startswith("GGUF."):
                continue
            self.kv[name] = fld.contents()
        self.arch: str = self.kv.get("general.architecture", "")
        if not self.arch:
            raise InputError(self.path, "GGUF has no general.architecture")
        self.tensors = {t.name: t for t in self.reader.tensors}

    def value(self, key: str, default: Any = None) -> Any:
        """Metadata value; ``key`` without a dot prefix is taken as ``{arch}.key``."""
        full = key if key.startswith(("general.", "tokenizer.")) else f"{self.arch}.{key}"
        return self.kv.get(full, default)

    def require(self, key: str) -> Any:
        v = self.value(key)
        if v is None:
            raise InputError(self.path, f"missing metadata {self.arch}.{key}")
        return v

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self.tensors[name].shape.tolist()))

    def qtype(self, name: str) -> GGMLQuantizationType:
        return GGMLQuantizationType(self.tensors[name].tensor_type)

    def weight(self, name: str, device: torch.device | str, dtype: torch.dtype) -> "QWeight":
        if name not in self.tensors:
            raise InputError(self.path, f"missing tensor {name}")
        return QWeight.from_reader(self.tensors[name], self.shape(name), device, dtype)

    def float_tensor(self, name: str, device: torch.device | str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A (usually 1-D) tensor fully dequantized to ``dtype``: norms, biases, routers."""
        return self.weight(name, device, dtype).dequant().to(dtype)

    def optional(self, name: str, device, dtype) -> torch.Tensor | None:
        return self.float_tensor(name, device, dtype) if name in self.tensors else None


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

    def __init__(self, qtype: GGMLQuantizationType, shape: tuple[int, ...], data: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.qtype = qtype
        self.shape = tuple(shape)
        self.dtype = dtype
        # raw: uint8 [..., rows, bytes_per_row] (quantized) or float [..., rows, cols]
        self.register_buffer("data", data, persistent=False)

    @classmethod
    def from_reader(cls, t, shape: tuple[int, ...], device, dtype: torch.dtype) -> "QWeight":
        qtype = GGMLQuantizationType(t.tensor_type)
        if qtype in FLOAT_TYPES:
            data = _float_from_reader(t.data, qtype, shape).to(device=device, dtype=dtype)
        else:
            raw = np.array(t.data, copy=True, order="C").view(np.uint8)
            data = torch.from_numpy(raw.reshape(*shape[:-1], -1)).to(device)
        return cls(qtype, shape, data, dtype)

    @property
    def quantized(self) -> bool:
        return self.qtype not in FLOAT_TYPES

    def _dequant(self, raw: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        from ..quantize.kernels import dequantize  # the house's torch kernels (CUDA-capable)

        return dequantize(raw, self.qtype, shape).to(device=raw.device, dtype=self.dtype)

    def dequant(self, expert: int | None = None) -> torch.Tensor:
        """The float matrix (or expert ``expert``'s matrix of a 3-D stack)."""
        if expert is None:
            return self._dequant(self.data, self.shape) if self.quantized else self.data
        if not self.quantized:
            return self.data[expert]
        return self._dequant(self.data[expert], self.shape[1:])

    def row_range(self, start: int, stop: int) -> torch.Tensor:
        """Rows start..stop-1 of a 2-D weight as floats."""
        if not self.quantized:
            return self.data[start:stop]
        return self._dequant(self.data[start:stop], (stop - start, self.shape[-1]))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of a 2-D table (embedding lookup) without dequantizing the whole table."""
        if not self.quantized:
            return F.embedding(ids, self.data)
        flat = ids.reshape(-1)
        picked = self._dequant(self.data[flat], (flat.numel(), self.shape[-1]))
        return picked.reshape(*ids.shape, self.shape[-1])

    def extra_repr(self) -> str:
        return f"{self.qtype.name}, shape={self.shape}"


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
        bias = None if self.bias is None else self.bias.to(x.dtype)
        rows, cols = w.shape
        if not w.quantized or rows * cols <= DEQUANT_CHUNK:
            return F.linear(x, w.dequant().to(x.dtype), bias)
        # a big quantized matrix (the LM head: vocab x hidden) is decoded a slab of rows at a time
        step = max(1, DEQUANT_CHUNK // cols)
        out = torch.cat([F.linear(x, w.row_range(r, min(rows, r + step)).to(x.dtype)) for r in range(0, rows, step)],
                        dim=-1)
        return out if bias is None else out + bias
