"""Nemotron-H MoE (GGUF arch ``nemotron_h_moe``: Nemotron 3 Super), as llama.cpp's nemotron_h graph and its
nemotron_h_moe MTP graph compute it.

Every trunk block is ONE layer behind a pre-norm residual, x + layer(rms_norm(x, attn_norm)); which layer, llama.cpp
reads from the per-block metadata (the release's ``hybrid_override_pattern``, ``M``/``*``/``E``):

- ``head_count_kv[i] == 0`` and ``feed_forward_length[i] == 0``: Mamba-2 (``mamba2.py``);
- ``feed_forward_length[i] == 0``: GQA attention WITHOUT position encoding (llama.cpp's ROPE_TYPE_NONE for the
  architecture), no q/k norm, scale 1/sqrt(head size);
- otherwise a feed-forward layer: with a router, the LatentMoE -- sigmoid router scores on x, ``exp_probs_b``
  correction bias, group-limited top-k, renormalised, times ``expert_weights_scale``; non-gated experts
  relu(up h)^2 on h = latent_down(x), their sum through latent_up; plus a non-gated relu^2 shared expert on x --
  (``layers.MoE``); without one, a dense relu^2 MLP.

The MTP block (``blk.{n_trunk}``) folds the release's two MTP layers into one NextN block: u = eh_proj([enorm(E x) ;
hnorm(h)]), h = u + attention(rms_norm(u, attn_norm)), g = h + LatentMoE(rms_norm(h, post_attention_norm)), then
``shared_head_norm`` as a LayerNorm (mean removed, no bias; llama.cpp's LLM_NORM with
``attention.layer_norm_epsilon``) and the trunk's output. In an MTP context llama.cpp gives the head a plain KV cache
(no hybrid memory): the head's block is attention only, as here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gguf import ExpertGatingFuncType

from ...errors import InputError
from ..layers import Attention, AttnConfig, DecoderBlock, MoE, MoEConfig, PositionWise, SquaredReLU
from ..mamba2 import Mamba2, Mamba2Config
from ..model import RuntimeFamily
from ..weights import GGUFFile, Scope
from .common import routed_moe_config


@dataclass(frozen=True)
class NemotronHConfig:
    vocab_size: int
    mamba: Mamba2Config
    moe: MoEConfig
    kinds: tuple[str, ...]  # per trunk block: "mamba", "attention" or "ffn"


def per_block(g: GGUFFile, key: str, default=None) -> list[int]:
    """A metadata value llama.cpp reads per block (an array, or one number for every block)."""
    value = g.value(key, default)
    if value is None:
        raise InputError(g.path, f"missing metadata {g.arch}.{key}")
    values = [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)] * g.n_blocks
    if len(values) < g.n_blocks:
        raise InputError(g.path, f"{g.arch}.{key} has {len(values)} entries for {g.n_blocks} blocks")
    return values


def block_kinds(g: GGUFFile) -> tuple[str, ...]:
    """llama.cpp's rule: recurrent iff no kv heads and no FFN; attention iff no FFN; else a feed-forward layer."""
    kv, ff = per_block(g, "attention.head_count_kv"), per_block(g, "feed_forward_length")
    return tuple(
        "mamba" if kv[i] == 0 and ff[i] == 0 else "attention" if ff[i] == 0 else "ffn" for i in range(g.n_trunk)
    )


class NemotronHMoe(RuntimeFamily):
    archs = ("nemotron_h_moe",)
    layer_norm_head = True

    def __init__(self, g: GGUFFile):
        self.file = g
        # llama.cpp: the RMS epsilon falls back to the LayerNorm one, which the head's final norm uses
        self.head_eps = float(g.require("attention.layer_norm_epsilon"))
        self.eps = float(g.value("attention.layer_norm_rms_epsilon", self.head_eps))
        if g.value("attention.scale"):
            raise InputError(g.path, f"{g.arch}.attention.scale is not supported by the runtime")
        n_heads = int(g.require("ssm.time_step_rank"))
        self.cfg = NemotronHConfig(
            vocab_size=g.shape("token_embd.weight")[0],
            mamba=Mamba2Config(
                n_heads=n_heads,
                head_dim=int(g.require("ssm.inner_size")) // n_heads,
                d_state=int(g.require("ssm.state_size")),
                n_groups=int(g.require("ssm.group_count")),
                conv_kernel=int(g.require("ssm.conv_kernel")),
                eps=self.eps,
            ),
            # the graph routes with sigmoid scores whatever the file says
            moe=replace(routed_moe_config(g, ExpertGatingFuncType.SIGMOID), gating="sigmoid"),
            kinds=block_kinds(g),
        )
        self.n_heads, self.n_kv = per_block(g, "attention.head_count"), per_block(g, "attention.head_count_kv")
        self.n_used = per_block(g, "expert_used_count", 0)
        self.head_dim = int(g.require("attention.key_length"))

    def _attention(self, w: Scope, index: int) -> Attention:
        cfg = AttnConfig(self.n_heads[index], self.n_kv[index], self.head_dim, self.eps)
        return Attention(w, cfg, rope=None)

    def _ffn(self, w: Scope, index: int):
        if not w.has("ffn_gate_inp"):
            return SquaredReLU(w)
        return MoE(w, replace(self.cfg.moe, n_used=self.n_used[index]))

    def block(self, w: Scope, index: int) -> DecoderBlock:
        if index >= len(self.cfg.kinds):  # the MTP block: attention, then the MoE
            return DecoderBlock(w, self._attention(w, index), self._ffn(w, index), self.eps)
        kind = self.cfg.kinds[index]
        mix = (
            Mamba2(w, self.cfg.mamba)
            if kind == "mamba"
            else self._attention(w, index)
            if kind == "attention"
            else PositionWise(self._ffn(w, index))
        )
        return DecoderBlock(w, mix, None, self.eps)
