"""Tiny GLM-5.x (``GlmMoeDsaForCausalLM``) and GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``) checkpoints.

As tests/builders/tiny_deepseek2.py does for DeepSeek-V3: weights come from transformers'
own model classes (random init, fixed seed), built with ``num_hidden_layers + 1``
layers and saved with ``num_hidden_layers`` in config.json, so the extra (MoE)
layer becomes the MTP block ``model.layers.{n}.*`` with exactly the names and
shapes transformers gives a decoder layer; the MTP-only tensors (``eh_proj``,
``enorm``, ``hnorm``, ``embed_tokens``, ``shared_head.{head,norm}``) are added
under the releases' names. Per-layer lists in the config (``indexer_types``,
``mlp_layer_types``, ``layer_types``) are cut back to the trunk's layers, as the
releases store them.

GLM-5.2's sparse-attention indexer: layers whose ``indexer_types`` entry is
"full" carry ``self_attn.indexer.{wq_b, wk, k_norm, weights_proj}``, "shared" ones
none (the tiny default mixes both); the MTP layer has one.

Sizes keep weight rows multiples of 256 (hidden 256, q/kv lora ranks 256, 4 heads
x v_head_dim 64, FFN/expert widths 256/512); the configs' other keys are the
releases' (sigmoid router with ``noaux_tc`` correction bias, GLM's special tokens).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.builders.tiny import finish_checkpoint, mtp_last_layer, start_folder
from tests.builders.tiny_deepseek2 import MLA

_MLA = dict(MLA, n_routed_experts=4, n_group=1, rms_norm_eps=1e-5, topk_method="noaux_tc")  # GLM-5.x's, 4.7-Flash's


def glm_dsa_config(**over) -> dict:
    """GLM-5.2's config.json keys at tiny sizes: 4 trunk layers, the first dense, indexers full/full/shared/full."""
    cfg = dict(
        _MLA,
        num_hidden_layers=4,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        scoring_func="sigmoid",
        max_position_embeddings=4096,
        rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
        index_n_heads=4,
        index_head_dim=64,
        index_topk=64,
        indexer_types=["full", "full", "shared", "full"],
    )
    cfg.update(over)
    return cfg


def glm4_moe_lite_config(**over) -> dict:
    """GLM-4.7-Flash's config.json keys at tiny sizes (no scoring_func, top-level rope_theta, as released)."""
    cfg = dict(
        _MLA,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        routed_scaling_factor=1.8,
        max_position_embeddings=4096,
        rope_theta=1000000.0,
        partial_rotary_factor=1.0,
    )
    cfg.update(over)
    return cfg


def glm_dsa(
    folder: Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    n_shards: int = 2,
    mtp_indexer: bool = True,
    **config_over,
) -> Path:
    """Write a tiny GLM-5.x checkpoint; ``mtp_indexer=False`` stores the MTP block without an indexer,
    ``indexer_types=None`` writes a GLM-5 / 5.1 config (no indexer_types: every layer has an indexer)."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    params = glm_dsa_config(**config_over)
    types = params.get("indexer_types")
    over = {"indexer_types": list(types) + ["full" if mtp_indexer else "shared"]} if types is not None else {}
    folder = _build(folder, GlmMoeDsaConfig, GlmMoeDsaForCausalLM, params, seed, dtype, n_shards, **over)
    if types is None:  # GLM-5 / 5.1: config.json lists none (every layer runs its indexer)
        path = folder / "config.json"
        config = json.loads(path.read_text())
        del config["indexer_types"]
        path.write_text(json.dumps(config, indent=2))
    return folder


def glm4_moe_lite(
    folder: Path, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16, n_shards: int = 2, **config_over
) -> Path:
    from transformers import Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM

    params = glm4_moe_lite_config(**config_over)
    return _build(folder, Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM, params, seed, dtype, n_shards)


def _build(folder, config_cls, model_cls, params: dict, seed: int, dtype, n_shards, **build) -> Path:
    folder, _ = start_folder(folder)  # GLM's special tokens ([gMASK], <|user|>, ...)
    sd, config = mtp_last_layer(model_cls, config_cls, params, seed, **build)
    n = params["num_hidden_layers"]
    for key in ("indexer_types", "mlp_layer_types", "layer_types"):
        if isinstance(config.get(key), list):
            config[key] = config[key][:n]
    return finish_checkpoint(folder, config, sd, dtype, n_shards)
