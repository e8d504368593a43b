"""The one idea of the house: a plan is metadata plus a stream of named tensors.

convert builds a plan from an HF checkpoint, quantize from a GGUF with new
types, graft from two GGUFs, extract-mtp keeps the MTP subset. One writer
(:func:`mtpq.gguf_io.write_plan`) streams any plan to disk, tensor by tensor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType
from gguf.gguf_writer import GGUFValue

if TYPE_CHECKING:  # torch only when something computes: `inspect` and `--dry-run` start in well under a second
    import torch


class Role(str, Enum):
    """What a tensor is for. The precision policy decides types by role."""

    MTP = "mtp"  # anything inside an MTP block: nextn.* AND the block's attention/FFN/experts
    TOKEN_EMBD = "token_embd"
    OUTPUT = "output"
    ATTN = "attn"
    FFN = "ffn"
    FFN_EXPS = "ffn_exps"  # stacked routed experts (3-D)
    ROUTER = "router"  # ffn_gate_inp: never quantized below f32 by llama-quantize
    SSM = "ssm"  # linear-attention / state-space tensors
    NORM = "norm"  # 1-D tensors: norms, biases, scales
    OTHER = "other"


_BLOCK = re.compile(r"^blk\.(\d+)\.")


def block_index(name: str) -> int | None:
    """``blk.12.attn_q.weight`` -> 12; tensors outside blocks -> None."""
    m = _BLOCK.match(name)
    return int(m.group(1)) if m else None


def tensor_kind(name: str) -> str:
    """The name without block prefix and ``.weight``: ``blk.3.ffn_down_exps.weight`` -> ``ffn_down_exps``."""
    kind = _BLOCK.sub("", name)
    return kind[: -len(".weight")] if kind.endswith(".weight") else kind


# The top-level tensors a head-only file (``convert --mtp-only``, ``extract-mtp``) keeps beside the MTP blocks, as
# llama.cpp's converter writes it with --mtp: what llama.cpp's MTP graph reads outside the blocks, by GGUF arch.
# Plain data (no torch): graft and extract-mtp read it without importing the converter's families.
MTP_ONLY_KEEP = ("token_embd.weight", "output_norm.weight", "output.weight")
_MTP_ONLY_EXTRA = {
    "step35": ("rope_freqs.weight",),  # per-layer RoPE frequencies, the head's layer among them
    "deepseek4": ("output_hc_fn.weight", "output_hc_base.weight", "output_hc_scale.weight"),  # the head's own
}  # output hyper-connection


def mtp_only_keep(arch: str) -> tuple[str, ...]:
    """The top-level tensors a head-only file of GGUF arch ``arch`` keeps."""
    return MTP_ONLY_KEEP + _MTP_ONLY_EXTRA.get(arch, ())


def classify(name: str, shape: tuple[int, ...], n_trunk_layers: int) -> Role:
    """Role of a GGUF tensor. Blocks numbered >= n_trunk_layers are MTP blocks."""
    bid = block_index(name)
    if bid is not None and bid >= n_trunk_layers:
        return Role.MTP
    if len(shape) <= 1:
        return Role.NORM
    kind = tensor_kind(name)
    rules = (  # the first that holds decides
        (Role.TOKEN_EMBD, name.startswith("token_embd")),
        (Role.OUTPUT, name.startswith("output")),
        (Role.ROUTER, kind.startswith("ffn_gate_inp")),
        (Role.FFN_EXPS, kind.endswith("_exps")),
        (Role.FFN, kind.startswith("ffn")),
        (Role.ATTN, kind.startswith("attn")),
        (Role.SSM, kind.startswith("ssm")),
    )
    return next((role for role, holds in rules if holds), Role.OTHER)


@dataclass
class TensorSpec:
    """One tensor of a plan. Nothing is read until the writer calls ``load``.

    ``shape`` is in torch order (rows..., row length); the row length is GGUF's ne[0].
    ``load`` returns float values (dequantized if the source is quantized).
    ``load_raw`` (GGUF sources only) returns the stored bytes in ``source_type``,
    so that a tensor whose type does not change is copied byte for byte.
    """

    name: str
    shape: tuple[int, ...]
    role: Role
    ggml_type: GGMLQuantizationType
    load: Callable[[], torch.Tensor]
    source: str
    source_type: GGMLQuantizationType | None = None
    load_raw: Callable[[], np.ndarray] | None = None
    reason: str = ""  # why ggml_type was chosen (the policy's explanation)
    # importance weights from an imatrix, (n_mat, row length) float32 (one row per expert), or None
    importance: "np.ndarray | None" = None
    # the shard of a split GGUF it was read from (0: the first, or an unsplit file): the layout --keep-split keeps
    shard: int = 0
    # rows r0:r1 along dim 0 (experts of a stack, rows of a matrix) as float values, like ``load``'s (GGUF sources):
    # a big tensor is then encoded slab by slab, never held whole in float32
    load_rows: Callable[[int, int], torch.Tensor] | None = None
    input_name: str | None = None  # the name it had in the input, when renamed (--prune-layers renumbers blocks)
    # (file, byte offset) of the stored values (GGUF sources: ``load_raw``'s bytes, C order): a float tensor is
    # quantized by workers reading their chunks from there (mtpq.ggml.from_file)
    stored_at: "tuple[Path, int] | None" = None

    def with_type(self, ggml_type: GGMLQuantizationType, reason: str) -> "TensorSpec":
        return replace(self, ggml_type=ggml_type, reason=reason)

    def with_values(self, load: Callable[[], torch.Tensor]) -> "TensorSpec":
        """The same tensor with other values: every reader of the stored ones (raw bytes, rows, file offset)
        dropped, so the writer cannot take the stored values instead of ``load``'s."""
        return replace(self, load=load, load_raw=None, load_rows=None, stored_at=None, source_type=None)

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class Plan:
    """Everything needed to write one GGUF file."""

    arch: str
    kv: dict[str, GGUFValue]  # metadata, without general.architecture (the writer adds it)
    tensors: list[TensorSpec]
    inputs: list[Path] = field(default_factory=list)  # files read: never overwritten
    n_trunk_layers: int = 0
    n_mtp_layers: int = 0

    def kv_value(self, key: str, default=None):
        v = self.kv.get(key)
        return default if v is None else v.value

    def set_kv(self, key: str, value, vtype: GGUFValueType, sub_type: GGUFValueType | None = None) -> None:
        self.kv[key] = GGUFValue(value, vtype, sub_type)

    def drop_kv(self, key: str) -> None:
        self.kv.pop(key, None)
