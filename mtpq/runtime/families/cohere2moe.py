"""Cohere2 MoE (GGUF arch ``cohere2moe``: CohereLabs/North-Mini-Code), as llama.cpp's cohere2moe graph computes it.

Parallel blocks: one norm feeds attention and the FFN, out = (ffn(n) + x) + attn(n), n = attn_norm(x). Every norm
(blocks, final, the head's enorm / hnorm / shared_head_norm) is an RMSNorm when the file has a nonzero
``attention.layer_norm_rms_epsilon``, else a bias-free LayerNorm (``attention.layer_norm_epsilon``).

Attention: GQA without q/k norms. Sliding-window layers (``attention.sliding_window_pattern``: one flag per trunk
layer, or every n-th layer full from the first: llama.cpp's dense-first pattern, n = 4 by default) rotate q and k
(adjacent pairs: llama.cpp's ROPE_TYPE_NORM); full layers do not (NoPE), except the leading dense blocks, which
rotate. All rotations use ``rope.freq_base`` (llama.cpp's graph reads no ``rope.freq_base_swa``).

FFN: dense SwiGLU in the ``leading_dense_block_count`` first blocks, else MoE: router scores (sigmoid unless the file
names another gating function), no selection bias, optional renormalisation and scale, and shared experts averaged
with the routed output ((routed + shared) / 2). Logits, trunk's and head's, times ``logit_scale``.

The MTP block is a parallel block with full attention, RoPE and a MoE FFN; the head ties its embedding and output
to the trunk's unless it has its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import ExpertGatingFuncType
from torch import nn

from ...errors import InputError
from ..layers import Attention, AttnConfig, MoE, MoEConfig, Packing, Rope, SwiGLU, layer_norm, rms_norm, rope_inv_freq
from ..model import RuntimeFamily
from ..swa import SlidingWindowAttention
from ..weights import GGUFFile, Scope
from .common import gqa_config, routed_moe_config
from .glm4moe import rope_scaling_factor

NOPE = Rope(torch.empty(0))  # rotates nothing: the full-attention layers' "RoPE"


@dataclass(frozen=True)
class Cohere2MoeConfig:
    vocab_size: int
    attn: AttnConfig
    moe: MoEConfig
    n_dense_lead: int
    window: int  # attention.sliding_window
    sliding: tuple[bool, ...]  # per trunk block


def sliding_layers(g: GGUFFile) -> tuple[bool, ...]:
    """Which trunk blocks attend through the window, as llama.cpp's load_swa_pattern(n=4, dense_first) reads them."""
    pattern = g.value("attention.sliding_window_pattern", 4)
    if isinstance(pattern, (list, tuple)):
        if len(pattern) < g.n_trunk:
            raise InputError(
                g.path,
                f"{g.arch}.attention.sliding_window_pattern has {len(pattern)} entries for {g.n_trunk} trunk blocks",
            )
        return tuple(bool(p) for p in pattern[: g.n_trunk])
    n = int(pattern)
    return tuple(n == 0 or i % n != 0 for i in range(g.n_trunk))


class ParallelBlock(nn.Module):
    """Cohere's residual block: out = (ffn(n) + x) + mix(n), n = norm(x), in llama.cpp's order of additions."""

    def __init__(self, w: Scope, mix: nn.Module, ffn: nn.Module, eps: float, norm):
        super().__init__()
        self.eps, self.norm = eps, norm
        self.attn_norm, self.attn, self.ffn = w.tensor("attn_norm"), mix, ffn

    def new_cache(self):
        return self.attn.new_cache()

    def forward(self, x: torch.Tensor, start: int, cache, packing: Packing | None = None) -> torch.Tensor:
        """With ``packing`` (x [1, N, H], uncached): outputs for its kept rows only (see layers.DecoderBlock)."""
        normed = self.norm(x, self.attn_norm, self.eps)
        mixed = self.attn(normed, start, cache) if packing is None else self.attn.forward_packed(normed, packing)
        if packing is not None and packing.kept is not None:
            x, normed = x[:, packing.kept], normed[:, packing.kept]
        return (self.ffn(normed) + x) + mixed


class SharedAveraged(nn.Module):
    """A MoE whose routed and shared outputs are averaged, not summed (llama.cpp scales their sum by 0.5)."""

    def __init__(self, moe: MoE):
        super().__init__()
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x) * 0.5


class Cohere2Moe(RuntimeFamily):
    archs = ("cohere2moe",)

    def __init__(self, g: GGUFFile):  # (no super().__init__: the rms epsilon is optional here)
        self.file = g
        rms_eps = float(g.value("attention.layer_norm_rms_epsilon", 0.0) or 0.0)
        if rms_eps:
            self.eps, self.norm = rms_eps, rms_norm
        else:
            self.eps, self.norm = float(g.require("attention.layer_norm_epsilon")), layer_norm
        self.logit_scale = float(g.require("logit_scale")) or 1.0  # llama.cpp: 0 scales nothing
        self.cfg = Cohere2MoeConfig(
            vocab_size=g.shape("token_embd.weight")[0],
            attn=gqa_config(g, self.eps),
            moe=routed_moe_config(g, ExpertGatingFuncType.SIGMOID),
            n_dense_lead=int(g.value("leading_dense_block_count", 0)),
            window=int(g.require("attention.sliding_window")),
            sliding=sliding_layers(g),
        )
        rope_dim = int(g.value("rope.dimension_count", self.cfg.attn.head_dim))
        base = float(g.value("rope.freq_base", 10000.0))
        self.rope = Rope(rope_inv_freq(rope_dim, base, rope_scaling_factor(g)), neox=False)

    def block(self, w: Scope, index: int) -> ParallelBlock:
        cfg = self.cfg
        if index < len(cfg.sliding) and cfg.sliding[index]:
            mix = SlidingWindowAttention(w, cfg.attn, self.rope, cfg.window)
        else:  # full attention: NoPE, but for the leading dense blocks and the MTP block
            rotates = index < cfg.n_dense_lead or index >= len(cfg.sliding)
            mix = Attention(w, cfg.attn, self.rope if rotates else NOPE)
        if index < cfg.n_dense_lead:
            ffn = SwiGLU(w)
        else:
            moe = MoE(w, cfg.moe)
            ffn = SharedAveraged(moe) if moe.shared is not None else moe
        return ParallelBlock(w, mix, ffn, self.eps, self.norm)
