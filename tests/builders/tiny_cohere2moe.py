"""A tiny Cohere2 MoE checkpoint (``Cohere2MoeForCausalLM``, CohereLabs/North-Mini-Code-1.0) with an MTP layer.

Config keys are transformers' Cohere2MoeConfig's (``cohere2_moe``); tensor names are
the ones its modeling code and llama.cpp's converter (conversion/command_r.py,
gguf-py's tensor map) read:
- parallel blocks: one ``input_layernorm`` (a bias-free LayerNorm, ``layer_norm_eps``,
  as ``rms_norm_eps: null`` selects) feeds attention and the MLP;
- dense prefix layers (``mlp_layer_types``) with ``prefix_dense_intermediate_size``,
  then MoE layers: router ``mlp.gate``, per-expert ``mlp.experts.{e}.*`` and shared
  experts ``mlp.shared_experts.*`` (``intermediate_size * num_shared_experts`` wide);
- sliding/full attention by ``layer_types``; tied embeddings (no ``lm_head``);
- the MTP layer ``model.layers.{N}``: DeepSeek-style ``eh_proj``/``enorm``/``hnorm``/
  ``shared_head.norm`` plus a full-attention MoE block, as llama.cpp's
  src/models/cohere2moe.cpp loads it (transformers' model does not run it).
Weights are random (fixed seed), sized so every weight row is a multiple of 256.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.builders.tiny import (
    block_checkpoint,
    rand_attention,
    rand_mlp,
    rand_moe,
    rand_nextn,
    rand_norm,
    release_config,
)

SPECIALS = ["<|END_OF_TURN_TOKEN|>", "<BOS_TOKEN>", "<|START_OF_TURN_TOKEN|>"]


def config(vocab: int, **over) -> dict:
    """configs/cohere2moe.json, its per-layer ``layer_types`` / ``mlp_layer_types`` following ``num_hidden_layers``
    (every 4th layer full attention, the first dense), as the release's do."""
    cfg = release_config("cohere2moe", vocab_size=vocab)
    n = over.get("num_hidden_layers", cfg["num_hidden_layers"])
    cfg.update(
        layer_types=["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n)],
        mlp_layer_types=["dense"] + ["sparse"] * (n - 1),
    )
    cfg.update(over)
    return cfg


def block_tensors(bid: int, cfg: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    p, h = f"model.layers.{bid}.", cfg["hidden_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    t = {p + "input_layernorm.weight": rand_norm(h, gen)} | rand_attention(p + "self_attn.", h, nh, nkv, hd, gen)
    if cfg["attention_bias"]:  # zero, as Cohere ships them (llama.cpp drops zero biases)
        t.update(
            {
                p + f"self_attn.{x}_proj.bias": torch.zeros(n)
                for x, n in (("q", nh * hd), ("k", nkv * hd), ("v", nkv * hd), ("o", h))
            }
        )
    types = cfg["mlp_layer_types"]
    if bid < len(types) and types[bid] == "dense":
        t.update(rand_mlp(p + "mlp.", cfg["prefix_dense_intermediate_size"], h, gen))
    else:  # MoE, the MTP layer too
        ff, n_shared = cfg["intermediate_size"], cfg["num_shared_experts"]
        shared = "shared_experts." if n_shared else None
        t.update(rand_moe(p + "mlp.", cfg["num_experts"], ff, h, gen, shared=shared, shared_ff=ff * n_shared))
    if bid >= cfg["num_hidden_layers"]:
        t.update(rand_nextn(p, h, gen, "shared_head.norm"))
    return t


def cohere2moe(folder: Path, **over) -> Path:
    """block_checkpoint's seed (0), dtype (float32), n_shards (2), with_mtp (True); other keywords: config()'s."""
    return block_checkpoint(folder, config, SPECIALS, block_tensors, **over)
