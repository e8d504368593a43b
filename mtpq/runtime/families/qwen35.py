"""Qwen3.5 / Qwen3.6, dense (GGUF arch ``qwen35``) and MoE (``qwen35moe``), as llama.cpp's qwen35 /
qwen35moe graphs and transformers' Qwen3_5(Moe)ForCausalLM compute them.

The trunk is hybrid: gated DeltaNet layers (``deltanet.py``) with a gated full-attention layer
where ``attention.recurrent_layers`` says false (else every ``full_attention_interval``-th layer,
llama.cpp's fallback). Full attention: ``attn_q`` yields [q | gate] per head, q/k RMSNorm per
head, RoPE in NeoX order on the first ``rope.dimension_count`` dims of each head. Qwen's RoPE is
multi-section (text/height/width positions per section of frequencies); for text every section
sees the same position, so it is the ordinary partial RoPE. FFN: dense SwiGLU, or (qwen35moe)
softmax-routed experts, top-k renormalised, plus a shared expert gated by
``sigmoid(ffn_gate_inp_shexp · x)``. Norm weights are used as stored: the converter already
folded Qwen's zero-centred ``1 + w`` (the gated ``ssm_norm`` never had it).

The MTP block (``blk.{n_trunk}``, llama.cpp's qwen35 MTP graph) is one gated full-attention block
with its own KV cache and the FFN of its trunk; the head ties its embedding and output to the
trunk's (``mtp.py`` falls back to them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...errors import InputError
from ..deltanet import DeltaNetConfig, GatedDeltaNet
from ..layers import Attention, AttnConfig, DecoderBlock, MoE, MoEConfig, Rope, SwiGLU, rope_inv_freq
from ..model import RuntimeFamily
from ..weights import GGUFFile, Scope
from .common import gqa_config


@dataclass(frozen=True)
class Qwen35Config:
    vocab_size: int
    attn: AttnConfig
    deltanet: DeltaNetConfig
    moe: MoEConfig | None  # None: dense
    recurrent: tuple[bool, ...]  # per trunk block: gated DeltaNet (True) or full attention


def recurrent_layers(g: GGUFFile) -> tuple[bool, ...]:
    """Which trunk blocks are DeltaNet: the explicit flags if the file has them, else llama.cpp's
    rule (block i is full attention when (i + 1) is a multiple of ``full_attention_interval``)."""
    flags = g.value("attention.recurrent_layers")
    if flags is not None:
        if len(flags) < g.n_trunk:
            raise InputError(
                g.path, f"{g.arch}.attention.recurrent_layers has {len(flags)} entries for {g.n_trunk} trunk blocks"
            )
        return tuple(bool(f) for f in flags[: g.n_trunk])
    interval = int(g.value("full_attention_interval", 4) or 4)
    return tuple((i + 1) % interval != 0 for i in range(g.n_trunk))


class Qwen35(RuntimeFamily):
    archs = ("qwen35", "qwen35moe")
    grouped_heads: ClassVar[bool] = False  # the DeltaNet's value-head order (tiled: the converter's for Qwen3.5)

    def __init__(self, g: GGUFFile):
        super().__init__(g)
        n_v = int(g.require("ssm.time_step_rank"))
        n_experts = int(g.value("expert_count", 0) or 0)
        self.cfg = Qwen35Config(
            vocab_size=g.shape("token_embd.weight")[0],
            attn=gqa_config(g, self.eps, gated=True),
            deltanet=DeltaNetConfig(
                n_k_heads=int(g.require("ssm.group_count")),
                n_v_heads=n_v,
                head_k_dim=int(g.require("ssm.state_size")),
                head_v_dim=int(g.require("ssm.inner_size")) // n_v,
                conv_kernel=int(g.require("ssm.conv_kernel")),
                eps=self.eps,
                grouped_heads=self.grouped_heads,
            ),
            moe=MoEConfig(
                n_experts=n_experts,
                n_used=int(g.require("expert_used_count")),
                gating="softmax",
                norm_topk=True,
                scale=float(g.value("expert_weights_scale", 1.0) or 1.0),
            )
            if n_experts
            else None,
            recurrent=recurrent_layers(g),
        )
        if g.value("rope.scaling.type", "none") not in ("none", None):
            raise InputError(
                g.path, f"rope scaling {g.value('rope.scaling.type')!r} is not supported by the {g.arch} runtime"
            )
        rope_dim = int(g.value("rope.dimension_count", self.cfg.attn.head_dim))
        self.rope = Rope(rope_inv_freq(rope_dim, float(g.value("rope.freq_base", 10000.0))), neox=True)

    def block(self, w: Scope, index: int) -> DecoderBlock:
        cfg = self.cfg
        is_mtp = index >= len(cfg.recurrent)
        mix = (
            GatedDeltaNet(w, cfg.deltanet) if not is_mtp and cfg.recurrent[index] else Attention(w, cfg.attn, self.rope)
        )
        if w.has("ffn_gate_inp"):
            if cfg.moe is None:
                raise InputError(
                    self.file.path, f"{w.name('ffn_gate_inp')} present but {self.file.arch}.expert_count is missing"
                )
            ffn = MoE(w, cfg.moe)
        else:
            ffn = SwiGLU(w)
        return DecoderBlock(w, mix, ffn, self.eps)
