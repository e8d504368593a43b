"""DeepSeek-V3 / R1 (GGUF arch ``deepseek2``), as llama.cpp's deepseek2 graph and transformers' DeepseekV3.

Blocks: MLA attention (``mla.py``) with YaRN RoPE on the rope part of each head; the first
``leading_dense_block_count`` blocks have a dense SwiGLU FFN, the rest (and the MTP block) MoE:
sigmoid router scores (softmax when the GGUF names no gating function: llama.cpp's default for
DeepSeek-V2), ``exp_probs_b`` correction bias, group-limited top-k, optional renormalisation,
``expert_weights_scale``, shared experts. Norms: ``attn_norm`` and ``ffn_norm``.
The MTP block (blk.{n_trunk}: ``nextn.*`` plus a full MLA + MoE block) is the generic NextN head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from gguf import ExpertGatingFuncType
from torch import nn

from ...errors import InputError
from ..layers import DecoderBlock, MoE, MoEConfig, Rope, SwiGLU, rope_inv_freq
from ..mla import MLA, MLAConfig, yarn_mla_scales
from ..model import RuntimeFamily
from ..weights import GGUFFile, Scope
from .common import mla_config, routed_moe_config, yarn_rope


@dataclass(frozen=True)
class Deepseek2Config:
    vocab_size: int
    mla: MLAConfig
    moe: MoEConfig
    n_dense_lead: int
    rope_scale: float  # cos/sin multiplier (YaRN's attention factor as llama.cpp applies it)


class Deepseek2(RuntimeFamily):
    archs = ("deepseek2",)
    default_gating: ClassVar[ExpertGatingFuncType] = ExpertGatingFuncType.SOFTMAX  # llama.cpp's for DeepSeek-V2
    # YaRN as llama.cpp's loader reads it: whether it reads rope.scaling.yarn_log_multiplier (mscale_all_dim),
    # and the config.json mscale it assumes (None: equal to mscale_all_dim)
    reads_yarn_log_mul: ClassVar[bool] = True
    yarn_mscale: ClassVar[float | None] = None

    def __init__(self, g: GGUFFile):
        super().__init__(g)
        if g.value("attention.temperature_scale"):
            raise InputError(
                g.path, "attention temperature scaling (Mistral-Large style) is not supported by the deepseek2 runtime"
            )
        rope_dim = int(g.require("rope.dimension_count"))
        base = float(g.value("rope.freq_base", 10000.0))
        inv_freq, factor = self._rope_schedule(g, rope_dim, base)
        rope_scale, softmax_mul = self._yarn_scales(g, factor)
        self.cfg = Deepseek2Config(
            vocab_size=g.shape("token_embd.weight")[0],
            mla=mla_config(g, self.eps, softmax_mul),
            moe=routed_moe_config(g, self.default_gating),
            n_dense_lead=int(g.value("leading_dense_block_count", 0)),
            rope_scale=rope_scale,
        )
        self.rope = Rope(inv_freq, neox=False, mscale=rope_scale)  # adjacent pairs: llama.cpp's ROPE_TYPE_NORM

    def _yarn_scales(self, g: GGUFFile, factor: float) -> tuple[float, float]:
        """(cos/sin multiplier, softmax-scale multiplier): :func:`yarn_mla_scales` as llama.cpp reads the GGUF."""
        log_mul = g.value("rope.scaling.yarn_log_multiplier") if self.reads_yarn_log_mul else None
        # llama.cpp stores 0.1 * mscale_all_dim and divides in float32 on load
        mscale_all_dim = float(np.float32(log_mul) / np.float32(0.1)) if log_mul else None
        return yarn_mla_scales(
            factor, mscale_all_dim, float(g.value("rope.scaling.attn_factor", 1.0) or 1.0), mscale=self.yarn_mscale
        )

    @staticmethod
    def _rope_schedule(g: GGUFFile, dim: int, base: float):
        """(inverse frequencies, YaRN factor or 1)."""
        scaling = g.value("rope.scaling.type", "none")
        if scaling in ("none", None):
            return rope_inv_freq(dim, base), 1.0
        if scaling != "yarn":
            raise InputError(g.path, f"rope scaling {scaling!r} is not supported by the {g.arch} runtime")
        return yarn_rope(g, dim, base)

    def block(self, w: Scope, index: int) -> DecoderBlock:
        if not w.has("attn_k_b"):
            raise InputError(
                self.file.path,
                f"{w.prefix}attn_k_b/attn_v_b missing (a legacy GGUF with an unsplit attn_kv_b? reconvert it)",
            )
        # as llama.cpp: dense by index; MTP blocks sit past the lead and are always MoE
        ffn = SwiGLU(w) if index < self.cfg.n_dense_lead else MoE(w, self.cfg.moe)
        return DecoderBlock(w, self.attention(w, index), ffn, self.eps, ffn_norm="ffn_norm")

    def attention(self, w: Scope, index: int) -> nn.Module:
        """Block ``index``'s sequence mixer: MLA."""
        return MLA(w, self.cfg.mla, self.rope)
