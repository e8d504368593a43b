"""A tiny DeepSeek-V3.2 checkpoint (``DeepseekV32ForCausalLM``) with its MTP layer.

As tests/builders/tiny_deepseek2.py builds DeepSeek-V3: transformers' own
``DeepseekV32ForCausalLM`` (random init, fixed seed) is built with
``num_hidden_layers + 1`` layers and saved with ``num_hidden_layers``, so the extra
layer becomes the MTP block ``model.layers.{n}.*`` with exactly the names and shapes
of a real decoder layer -- its lightning indexer (``self_attn.indexer.{wq_b, wk,
k_norm.{weight,bias}, weights_proj}``) included; the MTP-only tensors are added
under DeepSeek's names.

config.json is written as the V3.2 release has it (``rope_scaling`` with
``"type": "yarn"``, top-level ``rope_theta``, no ``layer_types`` /
``mlp_layer_types``, which transformers derives). Sizes: hidden 256, q_lora 256,
4 indexer heads of 64 (wq_b rows 256 long), ``index_topk`` 4 so that on any prompt
longer than 4 tokens the indexer really drops keys.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.builders.tiny import hf_checkpoint, mtp_last_layer
from tests.builders.tiny_deepseek2 import SPECIALS, deepseek_v3_config, use_bos


def deepseek_v32_config(**over) -> dict:
    return deepseek_v3_config(**{"index_n_heads": 4, "index_head_dim": 64, "index_topk": 4, **over})


def _is_norm_weight(name: str) -> bool:
    return name.endswith("norm.weight")  # the indexer's k_norm bias is no norm weight


def deepseek_v32(folder: Path, **over) -> Path:
    """Write the tiny checkpoint to ``folder`` and return it.

    ``positive_index_weights``: the indexer's per-head weights (``weights_proj``) made positive, so that a
    key scores exactly 0 only when every head's ReLU(q.k) is 0; with many heads (``index_n_heads=16``) that
    practically never happens, and engines cannot disagree on how to break ties at the top-k boundary.
    seed (0), dtype (bfloat16), n_shards (2): hf_checkpoint's; other keywords: deepseek_v32_config()'s.
    """
    return use_bos(hf_checkpoint(folder, SPECIALS, _state, **over))


def _state(seed: int, positive_index_weights: bool = False, **config_over) -> tuple[dict[str, torch.Tensor], dict]:
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    params = deepseek_v32_config(**config_over)
    sd, config = mtp_last_layer(DeepseekV32ForCausalLM, DeepseekV32Config, params, seed, is_norm=_is_norm_weight)
    if positive_index_weights:
        sd.update({k: v.abs() for k, v in sd.items() if k.endswith("indexer.weights_proj.weight")})
    for key in ("layer_types", "mlp_layer_types", "rope_parameters", "head_dim", "qk_head_dim"):
        config.pop(key, None)
    rope = dict(params["rope_parameters"])  # as the V3.2 release writes it
    config.update(rope_theta=rope.pop("rope_theta"), rope_scaling={"type": rope.pop("rope_type"), **rope})
    return sd, config
