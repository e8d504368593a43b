"""Tiny Qwen3-Next checkpoints (``Qwen3NextForCausalLM``) that tests build for themselves.

The trunk is transformers' own ``Qwen3NextForCausalLM`` (random init, fixed seed),
saved as ``save_pretrained`` writes it: per-expert MoE tensors, the fused
``linear_attn.in_proj_qkvz`` / ``in_proj_ba`` projections. The MTP head is added
under the release's names (``mtp.fc``, ``mtp.pre_fc_norm_embedding``,
``mtp.pre_fc_norm_hidden``, ``mtp.norm``, ``mtp.layers.0.*``; vLLM's
qwen3_next_mtp reads these), its block's names and shapes taken from transformers'
full-attention ``Qwen3NextDecoderLayer`` (an MoE block, like every layer).

``release_config=True`` (the default) writes config.json as the Qwen3-Next-80B-A3B
release has it: top-level ``rope_theta`` / ``partial_rotary_factor``,
``full_attention_interval`` and no ``layer_types``, no ``mtp_num_hidden_layers``.
``release_config=False`` keeps transformers 5's ``to_dict()`` (``layer_types``,
``rope_parameters``). ``fused_experts=True`` stores the trunk's experts fused.

Sizes follow DESIGN.md (hidden 256, weight rows multiples of 256); 2 key heads and
4 value heads, so the per-key-head interleaving of ``in_proj_qkvz`` matters.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.builders import tiny
from tests.builders.tiny_qwen35 import QWEN_SPECIALS, fuse_experts, informative_state_dict, mtp_head_tensors


def qwen3next_config(**over) -> dict:
    return tiny.release_config("qwen3next", **over)  # tiny.: qwen3next()'s release_config is a keyword


def qwen3next(folder: Path, **over) -> Path:
    """Write a tiny Qwen3-Next checkpoint (3 linear-attention + 1 full-attention layer, + 1 MTP layer).

    ``with_mtp`` (True), ``release_config`` (True), ``fused_experts`` (False): as above; seed (0), dtype (bfloat16),
    n_shards (2): hf_checkpoint's; other keywords: qwen3next_config()'s.
    """
    return tiny.hf_checkpoint(folder, QWEN_SPECIALS, _state, **over)


def _state(
    seed: int, with_mtp: bool = True, release_config: bool = True, fused_experts: bool = False, **config_over
) -> tuple[dict[str, torch.Tensor], dict]:
    import transformers as tf

    params = qwen3next_config(**config_over)
    cfg = tf.Qwen3NextConfig(**params)
    # random init leaves norms at 0 (zero-centred) or 1: informative_state_dict makes them informative
    sd, gen = informative_state_dict(tf.Qwen3NextForCausalLM, cfg, seed)
    if fused_experts:
        sd = fuse_experts(sd, cfg.num_experts)
    if with_mtp:
        sd.update(mtp_tensors(cfg, gen))

    config = cfg.to_dict()
    config["architectures"] = ["Qwen3NextForCausalLM"]
    if release_config:
        for key in ("layer_types", "rope_parameters"):
            config.pop(key, None)
        config.update(
            full_attention_interval=4,
            rope_theta=params["rope_theta"],
            rope_scaling=None,
            partial_rotary_factor=params["partial_rotary_factor"],
        )
    return sd, config


def mtp_tensors(cfg, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The MTP head under the release's names (experts stored per expert); random values (transformers does
    not run this head)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer

    return mtp_head_tensors(Qwen3NextDecoderLayer, cfg, gen, moe=True)


def read_config(folder: Path) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())
