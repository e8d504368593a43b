"""Step-3.5-Flash / Step-3.7-Flash (GGUF arch ``step35``), as llama.cpp's step35 graph and its MTP graph compute them.

Blocks: GQA with per-head q/k RMSNorm and a head-wise sigmoid gate (``attn_gate``), its head count per block;
sliding-window blocks (``attention.sliding_window_pattern``) attend within ``attention.sliding_window``, rotate
``rope.dimension_count_swa`` dims (default: every dim of a head) at ``rope.freq_base_swa``; full-attention blocks
rotate half of ``rope.dimension_count`` (default: the head size) at ``rope.freq_base``, their frequencies divided
by the first entries of ``rope_freqs`` (Llama-3 scaling, full-attention blocks only). RoPE in NeoX order.
FFN: dense SwiGLU where the block has no router, else sigmoid-routed experts (``exp_probs_b`` correction bias,
renormalised, times ``expert_weights_scale``) plus a shared expert; ``swiglu_clamp_exp`` / ``swiglu_clamp_shexp``
clamp the routed / shared (and dense) SwiGLU per block. Norms ``attn_norm`` and ``ffn_norm``.

The three MTP blocks (``blk.{n_trunk + i}``, sliding-window, dense in the releases) are NextN heads fed the trunk's
state before ``output_norm``; they draft chained (model.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from gguf import ExpertGatingFuncType

from ..layers import DecoderBlock, MoE, Rope, SwiGLU, rope_inv_freq
from ..model import RuntimeFamily
from ..swa import WindowedAttention
from ..weights import GGUFFile, Scope
from .common import WindowedModelConfig, per_layer, refuse_rope_scaling, routed_moe_config, windowed_configs


@dataclass(frozen=True)
class Step35Config(WindowedModelConfig):
    clamp_exp: list[float]  # per block: the routed experts' SwiGLU clamp (0: none)
    clamp_shexp: list[float]  # the shared expert's (and a dense FFN's)


class Step35(RuntimeFamily):
    archs = ("step35",)
    nextn_state = "pre_norm"  # llama.cpp's step35 graphs: h_nextn before output_norm / shared_head_norm

    def __init__(self, g: GGUFFile):
        super().__init__(g)
        refuse_rope_scaling(g, " (the releases scale through rope_freqs)")
        n = g.n_trunk + g.n_mtp
        attn, sliding = windowed_configs(g, self.eps)
        self.cfg = Step35Config(
            vocab_size=g.shape("token_embd.weight")[0],
            attn=attn,
            sliding=sliding,
            moe=routed_moe_config(g, ExpertGatingFuncType.SIGMOID),
            clamp_exp=[float(x) for x in per_layer(g, "swiglu_clamp_exp", n, 0.0)],
            clamp_shexp=[float(x) for x in per_layer(g, "swiglu_clamp_shexp", n, 0.0)],
        )
        # llama.cpp: full-attention blocks rotate half of rope.dimension_count; sliding ones the unhalved count
        n_rot = int(g.value("rope.dimension_count", attn[0].head_dim))
        n_rot_swa = int(g.value("rope.dimension_count_swa", n_rot))
        full = rope_inv_freq(n_rot // 2, float(g.value("rope.freq_base", 10000.0)))
        if "rope_freqs.weight" in g:
            factors = torch.from_numpy(np.array(g.tensors["rope_freqs.weight"].data, dtype=np.float32))
            full = full / factors[: full.numel()]
        self.ropes = {
            False: Rope(full, neox=True),
            True: Rope(rope_inv_freq(n_rot_swa, float(g.value("rope.freq_base_swa", 10000.0))), neox=True),
        }

    def block(self, w: Scope, index: int) -> DecoderBlock:
        cfg = self.cfg
        attn = WindowedAttention(w, cfg.attn[index], self.ropes[cfg.sliding[index]])
        if w.has("ffn_gate_inp"):
            ffn = MoE(
                w, replace(cfg.moe, swiglu_limit=cfg.clamp_exp[index], shared_swiglu_limit=cfg.clamp_shexp[index])
            )
        else:
            ffn = SwiGLU(w, limit=cfg.clamp_shexp[index])  # llama.cpp's build_ffn clamps with the shared limit
        return DecoderBlock(w, attn, ffn, self.eps, ffn_norm="ffn_norm")
