"""Ling 3.0 (GGUF arch ``bailingmoe3``: inclusionAI/Ling-3.0-*), as llama.cpp's bailingmoe3 graph computes it.

The trunk is hybrid: Kimi delta attention (``kda.py``) in the blocks whose ``attention.head_count_kv`` is 0, gated
MLA in the others: DeepSeek's latent attention (``mla.py``, RoPE on adjacent pairs over the rope part, softmax scale
1/sqrt(key_length_mla)) whose heads' outputs are each multiplied by sigmoid(``attn_gate`` · x) before
``attn_output``. Norms ``attn_norm`` / ``ffn_norm``. FFN: dense SwiGLU in the ``leading_dense_block_count`` first
blocks, else MoE: sigmoid router scores, ``exp_probs_b`` selection bias, group-limited top-k, renormalisation,
``expert_weights_scale``, one shared expert, ungated. SwiGLU clamps per block (``swiglu_clamp_exp`` for the routed
experts, ``swiglu_clamp_shexp`` for the shared expert and the dense FFN: llama.cpp's build_ffn reads it for both).

The MTP block (``blk.{n_trunk}``) is a gated-MLA MoE block; the head's final norm is ``layer_output_norm`` (the
release's ``final_layernorm``), its embedding and output the trunk's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from gguf import ExpertGatingFuncType

from ...errors import InputError
from ..kda import KDAConfig, KimiDeltaAttention
from ..layers import DecoderBlock, MoE, MoEConfig, Packing, Rope, SwiGLU, rope_inv_freq, take_rows
from ..mla import MLA, MLAConfig
from ..model import RuntimeFamily
from ..weights import GGUFFile, Scope
from .common import mla_config, refuse_rope_scaling, routed_moe_config


@dataclass(frozen=True)
class BailingMoe3Config:
    vocab_size: int
    mla: MLAConfig
    kda: KDAConfig
    moe: MoEConfig
    n_dense_lead: int
    recurrent: tuple[bool, ...]  # per trunk block: KDA (True) or gated MLA
    swiglu_limits: tuple[float, ...]  # per block (MTP included): the routed experts'
    shared_swiglu_limits: tuple[float, ...]  # the shared expert's and the dense FFN's


class GatedMLA(MLA):
    """MLA whose heads' outputs are gated, each by one sigmoid(``attn_gate`` · x), before ``attn_output``."""

    def __init__(self, w: Scope, cfg: MLAConfig, rope: Rope):
        super().__init__(w, cfg, rope)
        self.out, self.wo = self.wo, torch.nn.Identity()  # MLA's forward passes the heads' outputs out ungated
        self.gate = w.linear("attn_gate")

    def _gated(self, heads: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = heads.shape
        gate = torch.sigmoid(self.gate(x))[..., None]  # [B, T, H, 1]
        return self.out((heads.view(B, T, self.cfg.n_heads, -1) * gate).view(B, T, -1))

    def forward_packed(self, x: torch.Tensor, packing: Packing) -> torch.Tensor:
        return self._gated(super().forward_packed(x, packing), x if packing.kept is None else x[:, packing.kept])

    def forward(self, x: torch.Tensor, start: int, cache, rows: torch.Tensor | None = None) -> torch.Tensor:
        return self._gated(super().forward(x, start, cache, rows), x if rows is None else take_rows(x, rows))


def per_block(g: GGUFFile, key: str) -> tuple[float, ...]:
    """A per-block float array of the file (0.0 for every block without one)."""
    values = g.value(key)
    n = g.n_trunk + g.n_mtp
    if values is None:
        return (0.0,) * n
    if not isinstance(values, (list, tuple)):
        return (float(values),) * n
    return tuple(float(v) for v in values[:n]) + (0.0,) * (n - len(values))


class BailingMoe3(RuntimeFamily):
    archs = ("bailingmoe3",)
    head_norm_name = "layer_output_norm.weight"

    def __init__(self, g: GGUFFile):
        super().__init__(g)
        if any(g.value("rope.dimension_sections") or ()):
            raise InputError(
                g.path, "multi-section RoPE (rope.dimension_sections) is not supported by the bailingmoe3 runtime"
            )
        refuse_rope_scaling(g)
        kv_heads = g.require("attention.head_count_kv")
        kv_heads = list(kv_heads) if isinstance(kv_heads, (list, tuple)) else [kv_heads] * (g.n_trunk + g.n_mtp)
        if len(kv_heads) < g.n_trunk:
            raise InputError(
                g.path, f"{g.arch}.attention.head_count_kv has {len(kv_heads)} entries for {g.n_trunk} trunk blocks"
            )
        n_heads, rope_dim = int(g.require("attention.head_count")), int(g.require("rope.dimension_count"))
        self.cfg = BailingMoe3Config(
            vocab_size=g.shape("token_embd.weight")[0],
            mla=mla_config(g, self.eps),
            kda=KDAConfig(
                n_heads=n_heads,
                head_dim=int(g.require("kda.head_dim")),
                conv_kernel=int(g.require("ssm.conv_kernel")),
                eps=self.eps,
                gate_lower_bound=float(g.require("kda.gate_lower_bound")),
            ),
            moe=routed_moe_config(g, ExpertGatingFuncType.SIGMOID),
            n_dense_lead=int(g.value("leading_dense_block_count", 0)),
            recurrent=tuple(int(n) == 0 for n in kv_heads[: g.n_trunk]),
            swiglu_limits=per_block(g, "swiglu_clamp_exp"),
            shared_swiglu_limits=per_block(g, "swiglu_clamp_shexp"),
        )
        self.rope = Rope(rope_inv_freq(rope_dim, float(g.value("rope.freq_base", 10000.0))), neox=False)

    def block(self, w: Scope, index: int) -> DecoderBlock:
        cfg = self.cfg
        recurrent = index < len(cfg.recurrent) and cfg.recurrent[index]
        mix = KimiDeltaAttention(w, cfg.kda) if recurrent else GatedMLA(w, cfg.mla, self.rope)
        shared_limit = cfg.shared_swiglu_limits[index]
        if index < cfg.n_dense_lead:
            ffn = SwiGLU(w, limit=shared_limit)
        else:
            ffn = MoE(w, replace(cfg.moe, swiglu_limit=cfg.swiglu_limits[index], shared_swiglu_limit=shared_limit))
        return DecoderBlock(w, mix, ffn, self.eps, ffn_norm="ffn_norm")
