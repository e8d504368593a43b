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

from pathlib import Path

import torch

from tests.builders.tiny import hf_checkpoint, mtp_last_layer, release_config


def glm_dsa_config(**over) -> dict:
    """GLM-5.2's config.json keys at tiny sizes (configs/glm_dsa.json): 4 trunk layers, the first dense, indexers
    full/full/shared/full."""
    return release_config("glm_dsa", **over)


def glm4_moe_lite_config(**over) -> dict:
    """GLM-4.7-Flash's config.json keys at tiny sizes (configs/glm4_moe_lite.json: no scoring_func, top-level
    rope_theta, as released)."""
    return release_config("glm4_moe_lite", **over)


def glm_dsa(folder: Path, **over) -> Path:
    """Write a tiny GLM-5.x checkpoint; ``mtp_indexer=False`` stores the MTP block without an indexer,
    ``indexer_types=None`` writes a GLM-5 / 5.1 config (no indexer_types: every layer has an indexer).
    seed (0), dtype (bfloat16), n_shards (2): hf_checkpoint's; other keywords: glm_dsa_config()'s."""
    return hf_checkpoint(folder, None, _glm_dsa_state, **over)  # GLM's special tokens ([gMASK], <|user|>, ...)


def glm4_moe_lite(folder: Path, **over) -> Path:
    """Write a tiny GLM-4.7-Flash checkpoint; seed (0), dtype (bfloat16), n_shards (2): hf_checkpoint's; other
    keywords: glm4_moe_lite_config()'s."""
    return hf_checkpoint(folder, None, _glm4_moe_lite_state, **over)


def _glm_dsa_state(seed: int, mtp_indexer: bool = True, **config_over) -> tuple[dict[str, torch.Tensor], dict]:
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    params = glm_dsa_config(**config_over)
    types = params.get("indexer_types")
    over = {"indexer_types": list(types) + ["full" if mtp_indexer else "shared"]} if types is not None else {}
    sd, config = _state(GlmMoeDsaConfig, GlmMoeDsaForCausalLM, params, seed, **over)
    if types is None:  # GLM-5 / 5.1: config.json lists none (every layer runs its indexer)
        del config["indexer_types"]
    return sd, config


def _glm4_moe_lite_state(seed: int, **config_over) -> tuple[dict[str, torch.Tensor], dict]:
    from transformers import Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM

    return _state(Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM, glm4_moe_lite_config(**config_over), seed)


def _state(config_cls, model_cls, params: dict, seed: int, **build) -> tuple[dict[str, torch.Tensor], dict]:
    sd, config = mtp_last_layer(model_cls, config_cls, params, seed, **build)
    n = params["num_hidden_layers"]
    for key in ("indexer_types", "mlp_layer_types", "layer_types"):
        if isinstance(config.get(key), list):
            config[key] = config[key][:n]
    return sd, config
