"""Hy3 (GGUF arch ``hy_v3``), as llama.cpp's hy_v3 graph computes it.

GLM-4.5's block (families/glm4moe.py) under other norm names: GQA with per-head q/k RMSNorm and RoPE in NeoX order
over the whole head, ``attn_norm`` / ``ffn_norm``; a dense SwiGLU FFN where the block has no router (the leading
dense blocks), else MoE: sigmoid router scores, ``exp_probs_b`` selection bias, renormalised top-k times
``expert_weights_scale``, plus one shared expert, ungated. The MTP block is the same decoder block; the head's
final norm is ``nextn.shared_head_norm`` (the release's ``final_layernorm``), its embedding and output the trunk's.
"""

from __future__ import annotations

from ..layers import Attention, DecoderBlock, MoE, SwiGLU
from ..weights import Scope
from .glm4moe import Glm4Moe


class HyV3(Glm4Moe):
    archs = ("hy_v3",)

    def block(self, w: Scope, index: int) -> DecoderBlock:
        ffn = MoE(w, self.cfg.moe) if w.has("ffn_gate_inp") else SwiGLU(w)
        return DecoderBlock(w, Attention(w, self.cfg.attn, self.rope), ffn, self.eps, ffn_norm="ffn_norm")
