"""Routed experts stored as OCP MXFP4, for the families whose releases ship them (MiMo-V2.5's
``store_dtype: mxfp4``, Ling 3.0's FP8 release with ``routed_experts_quant_method: mxfp4``).

Each expert weight is packed E2M1 codes, U8 [rows, values / 2] (value 2i in the low nibble), beside one E8M0
exponent byte per 32 values, U8 [rows, values / 32] (the name of that companion differs per release). The bits
are moved, not requantized, into ggml's ``block_mxfp4`` (ggml/mxfp4.py), and the stacked tensor stays MXFP4
whatever the outtype (general.file_type MOSTLY_MXFP4_MOE), as llama.cpp's converters do it
(conversion/base.py ``repack_mxfp4_blocks``, used by its mimo, deepseek4 and kimi_k3 converters). This mixin
finds, checks and routes the expert weights; the stacking is base.mxfp4_stack (deepseek4's FP4 experts use it too).
"""

from __future__ import annotations

import re
from typing import Iterator

import gguf
from gguf import GGMLQuantizationType as T

from ..errors import InputError
from .base import Emit, mxfp4_stack

GROUP = 32  # values per E8M0 scale, in the checkpoint and in ggml's block_mxfp4
EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


class Mxfp4Experts:
    """Mixin (listed before :class:`~.base.ConvertFamily`): a family whose per-expert gate/up/down weights may be MXFP4.
    The family's ``__init__`` calls :meth:`find_mxfp4_experts` once it has read config.json's declaration."""

    mxfp4: dict[str, str] = {}  # MXFP4 expert weight -> its E8M0 scale tensor

    def find_mxfp4_experts(self, scale_suffix: str, group: object, group_key: str) -> None:
        """Every U8 expert weight (with its ``<name><scale_suffix>`` scale), checked; ``group`` is the group size
        config.json declares under ``group_key`` (ggml's MXFP4 has no other)."""
        if group != GROUP:
            raise InputError(
                self.ckpt.folder / "config.json", f"{group_key} {group!r}: ggml's MXFP4 groups {GROUP} values"
            )
        self.mxfp4 = {
            n: self._mxfp4_scale(n, n + scale_suffix)
            for n in self.ckpt.names()
            if EXPERT.match(n) and self.ckpt.source_dtype(n) == "U8"
        }

    def _mxfp4_scale(self, hf: str, scale_name: str) -> str:
        """The scale of an MXFP4 expert weight, checked: uint8 [rows, values / 32]."""
        st, scale = self.ckpt.stored[hf], self.ckpt.stored.get(scale_name)
        if len(st.shape) != 2 or (2 * st.shape[1]) % GROUP:
            raise InputError(
                st.file,
                f"MXFP4 tensor {hf} has shape {list(st.shape)}: expected [rows, values / 2] "
                f"with values a multiple of {GROUP}",
            )
        want = [st.shape[0], 2 * st.shape[1] // GROUP]
        if scale is None:
            raise InputError(st.file, f"MXFP4 tensor {hf} has no {scale_name}")
        if scale.dtype != "U8" or list(scale.shape) != want:
            raise InputError(
                scale.file,
                f"{scale.name} is {scale.dtype} {list(scale.shape)}, expected U8 {want} "
                f"(one E8M0 exponent per {GROUP} values of {hf})",
            )
        return scale.name

    @property
    def own_encodings(self) -> frozenset[str]:
        return frozenset(self.mxfp4)

    def file_type(self, outtype: T) -> gguf.LlamaFileType:
        return gguf.LlamaFileType.MOSTLY_MXFP4_MOE if self.mxfp4 else super().file_type(outtype)

    def logical_shape(self, hf_name: str) -> tuple[int, ...]:
        if hf_name in self.mxfp4:  # two E2M1 codes per byte
            rows, packed = self.ckpt.shape(hf_name)
            return rows, 2 * packed
        return super().logical_shape(hf_name)

    def stack_experts(self, prefix: str, n_experts: int, used: list[str], bid: int | None = None) -> Iterator[Emit]:
        parts = {
            proj: [f"{prefix}{self.per_expert_infix}{e}.{proj}.weight" for e in range(n_experts)]
            for proj in ("gate_proj", "up_proj", "down_proj")
        }
        packed = sum(n in self.mxfp4 for names in parts.values() for n in names)
        if not packed:
            yield from super().stack_experts(prefix, n_experts, used, bid)
            return
        if packed != 3 * n_experts:
            raise InputError(
                self.ckpt.folder,
                f"{prefix}mlp.experts: {packed} of {3 * n_experts} expert tensors "
                "are MXFP4; a stack is all MXFP4 or none",
            )
        for proj, names in parts.items():
            used.extend(names)
            yield self._mxfp4_stack(
                self.map_name(f"{self.block_prefix}{bid}.{self.per_expert_infix}{proj}.weight"), names
            )

    def _mxfp4_stack(self, name: str, parts: list[str]) -> Emit:
        """Experts stacked as ggml MXFP4 blocks: the checkpoint's bits, moved."""
        return mxfp4_stack(self.ckpt, name, [(hf, self.mxfp4[hf]) for hf in parts])
