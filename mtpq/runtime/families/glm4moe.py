"""GLM-4.5 / 4.6 / 4.7 (GGUF arch ``glm4moe``), as llama.cpp's glm4moe and transformers' Glm4Moe.

Blocks: GQA attention with optional q/k biases and per-head q/k RMSNorm, RoPE in NeoX
order on the first ``rope.dimension_count`` dims of each head; the first
``leading_dense_block_count`` blocks have a dense SwiGLU FFN, the rest (and the MTP block)
MoE: sigmoid router scores, ``exp_probs_b`` correction bias, group-limited top-k,
optional renormalisation, ``expert_weights_scale``, a shared expert.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import ExpertGatingFuncType

from ...errors import InputError
from ..layers import Attention, AttnConfig, DecoderBlock, MoE, MoEConfig, Rope, SwiGLU, rope_inv_freq
from ..model import RuntimeFamily
from ..weights import GGUFFile, Scope
from .common import gqa_config, routed_moe_config


@dataclass(frozen=True)
class Glm4MoeConfig:
    vocab_size: int
    attn: AttnConfig
    moe: MoEConfig
    n_dense_lead: int


def rope_scaling_factor(g: GGUFFile) -> float:
    """Linear RoPE scaling (the only kind GLM checkpoints use); anything else is refused, not ignored."""
    scaling = g.value("rope.scaling.type", "none")
    if scaling == "linear":
        return float(g.require("rope.scaling.factor"))
    if scaling not in ("none", None):
        raise InputError(g.path, f"rope scaling {scaling!r} is not supported by the {g.arch} runtime")
    return 1.0


class Glm4Moe(RuntimeFamily):
    archs = ("glm4moe",)

    def __init__(self, g: GGUFFile):
        super().__init__(g)
        self.cfg = Glm4MoeConfig(
            vocab_size=g.shape("token_embd.weight")[0],
            attn=gqa_config(g, self.eps),
            moe=routed_moe_config(g, ExpertGatingFuncType.SIGMOID),
            n_dense_lead=int(g.value("leading_dense_block_count", 0)),
        )
        rope_dim = int(g.value("rope.dimension_count", self.cfg.attn.head_dim))
        self.rope = Rope(rope_inv_freq(rope_dim, float(g.value("rope.freq_base", 10000.0)), rope_scaling_factor(g)))

    def block(self, w: Scope, index: int) -> DecoderBlock:
        # MoE wherever a router exists: dense lead blocks have none, MTP blocks always have one
        ffn = MoE(w, self.cfg.moe) if w.has("ffn_gate_inp") else SwiGLU(w)
        return DecoderBlock(w, Attention(w, self.cfg.attn, self.rope), ffn, self.eps)
