"""DeepSeek-V3.2 (GGUF arch ``deepseek32``), as llama.cpp's deepseek32 graph computes it.

DeepSeek-V3 (:mod:`.deepseek2`: MLA, YaRN, a dense lead, sigmoid-routed experts with a correction bias and
groups, a shared expert) with DeepSeek Sparse Attention in every trunk block: a lightning indexer
(``blk.N.indexer.*``, ``attention.indexer.{head_count, key_length, top_k}``) picks the keys each query
attends to (``dsa.py``). The indexer's RoPE rotates NeoX halves, its keys' LayerNorm has epsilon 1e-6, and
YaRN takes config.json's mscale as 1 (llama.cpp's deepseek32 rules). The MTP block runs dense MLA + MoE,
as llama.cpp's MTP graph does (the block's own indexer is not used).
"""

from __future__ import annotations

from typing import ClassVar

from gguf import ExpertGatingFuncType
from torch import nn

from ...errors import InputError
from ..dsa import IndexerConfig, LightningIndexer, Selections, SparseMLA, hadamard
from ..layers import Rope
from ..mla import MLA
from ..weights import GGUFFile, Scope
from .deepseek2 import Deepseek2


class Deepseek32(Deepseek2):
    archs = ("deepseek32",)
    default_gating = ExpertGatingFuncType.SIGMOID
    indexer_neox: ClassVar[bool] = True  # the indexer's RoPE pair order (the main MLA rotates adjacent pairs)
    indexer_norm_eps: ClassVar[float] = 1e-6  # llama.cpp's f_norm_eps for the indexer keys' LayerNorm
    yarn_mscale = 1.0

    def __init__(self, g: GGUFFile):
        self.check_gating(g)
        g.require("attention.q_lora_rank")  # the indexer's queries start from MLA's query latent
        super().__init__(g)
        self.indexer_cfg = IndexerConfig(
            n_heads=int(g.require("attention.indexer.head_count")),
            head_dim=int(g.require("attention.indexer.key_length")),
            top_k=int(g.require("attention.indexer.top_k")),
            norm_eps=self.indexer_norm_eps,
        )
        if self.indexer_cfg.top_k < 1:
            raise InputError(g.path, f"{g.arch}.attention.indexer.top_k must be at least 1")
        try:
            hadamard(self.indexer_cfg.head_dim)
        except ValueError as e:
            raise InputError(g.path, f"{g.arch}.attention.indexer.key_length: {e}") from None
        if self.rope.dim > self.indexer_cfg.head_dim:
            raise InputError(
                g.path,
                f"{g.arch}.rope.dimension_count {self.rope.dim} exceeds the indexer's "
                f"key length {self.indexer_cfg.head_dim}",
            )
        # the model's RoPE (frequencies, YaRN, cos/sin factor) in the indexer's own pair order
        self.indexer_rope = Rope(self.rope.inv_freq, neox=self.indexer_neox, mscale=self.rope.mscale)
        self.full = self.indexer_layers(g)
        self.selections = Selections()

    @staticmethod
    def check_gating(g: GGUFFile) -> None:
        if g.value("expert_gating_func") is None:  # llama.cpp's deepseek32 loader requires the key
            raise InputError(g.path, f"missing {g.arch}.expert_gating_func")

    def indexer_layers(self, g: GGUFFile) -> tuple[bool, ...]:
        """Per trunk block: it runs its own indexer (every block of DeepSeek-V3.2)."""
        return (True,) * g.n_trunk

    def attention(self, w: Scope, index: int) -> nn.Module:
        if index >= self.file.n_trunk:  # llama.cpp's MTP graph: dense MLA
            return MLA(w, self.cfg.mla, self.rope)
        indexer = LightningIndexer(w, self.indexer_cfg, self.indexer_rope) if self.full[index] else None
        return SparseMLA(w, self.cfg.mla, self.rope, indexer, self.indexer_cfg.top_k, self.selections)
