"""MiMo-V2-Flash / MiMo-V2.5 / V2.5-Pro (GGUF arch ``mimo2``), as llama.cpp's mimo2 graph and its MTP graph
compute them.

Blocks: GQA from one fused ``attn_qkv`` ([q | k | v] rows; V2-Flash: ``attn_q`` / ``attn_k`` / ``attn_v``), keys
``attention.key_length`` wide, values ``attention.value_length``; KV heads per block; sliding-window blocks
(``attention.sliding_window_pattern``) attend within ``attention.sliding_window`` at ``rope.freq_base_swa``, full
ones at ``rope.freq_base``; every block rotates block 0's ``rope.dimension_count`` dims (the graph's one n_rot),
NeoX order. ``attn_sinks`` where the block has them; the attention output times ``attention.value_scale``.
FFN: dense SwiGLU where the block has no router, else sigmoid-routed experts (``exp_probs_b`` correction bias,
always renormalised, never scaled: llama.cpp's mimo2 graph fixes both). Norms ``attn_norm`` and ``ffn_norm``.

The three MTP blocks (``blk.{n_trunk + i}``: sliding-window attention with sinks, a dense FFN) are NextN heads
with [enorm(E x) ; hnorm(h)] as the other families, fed the trunk's state before ``output_norm``, normed by
``layer_output_norm`` before the trunk's ``output``; they draft chained (model.py).
"""

from __future__ import annotations

from ..layers import DecoderBlock, MoE, MoEConfig, Rope, SwiGLU, rope_inv_freq
from ..model import RuntimeFamily
from ..swa import WindowedAttention
from ..weights import GGUFFile, Scope
from .common import WindowedModelConfig, refuse_rope_scaling, windowed_configs


class Mimo2(RuntimeFamily):
    archs = ("mimo2",)
    nextn_state = "pre_norm"  # llama.cpp's mimo2 graphs: h_nextn before output_norm / the head's norm
    head_norm_name = "layer_output_norm.weight"  # the releases' final_layernorm

    def __init__(self, g: GGUFFile):
        super().__init__(g)
        refuse_rope_scaling(g)
        attn, sliding = windowed_configs(g, self.eps, float(g.value("attention.value_scale", 1.0) or 1.0))
        self.cfg = WindowedModelConfig(
            vocab_size=g.shape("token_embd.weight")[0],
            attn=attn,
            sliding=sliding,
            moe=MoEConfig(
                n_experts=int(g.value("expert_count", 0)),
                n_used=int(g.value("expert_used_count", 0)),
                gating="sigmoid",
                norm_topk=True,
                n_group=int(g.value("expert_group_count", 1) or 1),
                topk_group=int(g.value("expert_group_used_count", 1) or 1),
            ),
        )
        n_rot = int(g.value("rope.dimension_count", attn[0].head_dim))
        n_rot = int(g.value("rope.dimension_count_swa", n_rot)) if sliding[0] else n_rot
        self.ropes = {
            s: Rope(rope_inv_freq(n_rot, float(g.value(key, 10000.0))), neox=True)
            for s, key in ((False, "rope.freq_base"), (True, "rope.freq_base_swa"))
        }

    def block(self, w: Scope, index: int) -> DecoderBlock:
        cfg = self.cfg
        attn = WindowedAttention(w, cfg.attn[index], self.ropes[cfg.sliding[index]])
        ffn = MoE(w, cfg.moe) if w.has("ffn_gate_inp") else SwiGLU(w)
        return DecoderBlock(w, attn, ffn, self.eps, ffn_norm="ffn_norm")
