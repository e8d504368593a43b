"""A tiny Ling 3.0 checkpoint (``BailingMoeV3ForCausalLM``, inclusionAI/Ling-3.0-*) with its MTP layer.

Config keys and tensor names follow the release as llama.cpp's converter
(conversion/bailingmoe3.py, gguf-py's tensor map) and vLLM's bailing_moe_v3.py read them:
- ``model.word_embeddings``, ``model.norm``, ``lm_head``; per layer ``input_layernorm``,
  ``post_attention_layernorm``, the mixer under ``attention.`` and the MLP under ``mlp.``;
- Kimi-delta-attention (KDA) layers and, every ``layer_group_size``-th layer (and the
  tail), gated MLA layers: ``q_proj`` (or ``q_a_proj``/``q_a_layernorm``/``q_b_proj``),
  ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, head-wise ``g_proj``, ``dense``;
- KDA: ``q/k/v_proj``, ``q/k/v_conv1d`` [d, 1, kernel], ``b_proj`` (beta), ``f_proj``
  (forget gate, no LoRA), ``A_log``, ``dt_bias``, ``g_proj`` (output gate), ``o_norm``, ``o_proj``;
- dense first layers, then MoE: ``mlp.gate`` + ``mlp.gate.expert_bias``, per-expert
  ``mlp.experts.{e}.*``, ``mlp.shared_experts.*``;
- the MTP layer ``model.layers.{N}``: ``eh_proj``/``enorm``/``hnorm``/``final_layernorm`` and a
  full-attention (MLA) MoE block.
Weights are random (fixed seed); hidden and expert widths are multiples of 256.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.builders.tiny import (
    block_checkpoint,
    rand_block_norms,
    rand_experts,
    rand_mlp,
    rand_nextn,
    rand_norm,
    rand_router,
    rand_weight,
    release_config,
)

SPECIALS = ["<|endoftext|>", "<role>", "</role>"]


def config(vocab: int, **over) -> dict:
    return release_config("bailingmoe3", vocab_size=vocab, **over)


def is_full_attention(bid: int, cfg: dict) -> bool:
    n, g = cfg["num_hidden_layers"], cfg["layer_group_size"]
    return bid >= n or (bid + 1) % g == 0 or bid >= n // g * g


def _kda(p: str, cfg: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    h, nh, hd, k = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"], cfg["short_conv_kernel_size"]
    d = nh * hd
    t = {p + f"{x}_proj.weight": rand_weight(d, h, gen=gen) for x in ("q", "k", "v", "f", "g")}
    t.update({p + f"{x}_conv1d.weight": rand_weight(d, 1, k, gen=gen, scale=0.3) for x in ("q", "k", "v")})
    t.update(
        {
            p + "b_proj.weight": rand_weight(nh, h, gen=gen),
            p + "A_log": torch.log(torch.linspace(1, 8, nh)),
            p + "dt_bias": rand_weight(d, gen=gen, scale=0.5),
            p + "o_norm.weight": rand_norm(hd, gen),
            p + "o_proj.weight": rand_weight(h, d, gen=gen),
        }
    )
    return t


def _mla(p: str, cfg: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    h = cfg["hidden_size"]
    nh, nope, rope, v, kv = (
        cfg[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank")
    )
    t = {
        p + "kv_a_proj_with_mqa.weight": rand_weight(kv + rope, h, gen=gen),
        p + "kv_a_layernorm.weight": rand_norm(kv, gen),
        p + "kv_b_proj.weight": rand_weight(nh * (nope + v), kv, gen=gen),
        p + "g_proj.weight": rand_weight(nh, h, gen=gen),
        p + "dense.weight": rand_weight(h, nh * v, gen=gen),
    }
    if (q_lora := cfg["q_lora_rank"]) is None:
        t[p + "q_proj.weight"] = rand_weight(nh * (nope + rope), h, gen=gen)
    else:
        t.update(
            {
                p + "q_a_proj.weight": rand_weight(q_lora, h, gen=gen),
                p + "q_a_layernorm.weight": rand_norm(q_lora, gen),
                p + "q_b_proj.weight": rand_weight(nh * (nope + rope), q_lora, gen=gen),
            }
        )
    return t


def _mlp(p: str, cfg: dict, bid: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    h = cfg["hidden_size"]
    if bid < cfg["first_k_dense_replace"]:
        return rand_mlp(p, cfg["intermediate_size"], h, gen)
    n_exp, ff = cfg["num_experts"], cfg["moe_intermediate_size"]
    sff = cfg["moe_shared_expert_intermediate_size"] * cfg["num_shared_experts"]
    t = rand_router(p + "gate.weight", n_exp, h, gen, bias=p + "gate.expert_bias")
    t.update(rand_mlp(p + "shared_experts.", sff, h, gen))
    return t | rand_experts(p + "experts.", n_exp, ff, h, gen)


def _block(bid: int, cfg: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    p, h = f"model.layers.{bid}.", cfg["hidden_size"]
    t = rand_block_norms(p, h, gen)
    t.update((_mla if is_full_attention(bid, cfg) else _kda)(p + "attention.", cfg, gen))
    t.update(_mlp(p + "mlp.", cfg, bid, gen))
    if bid >= cfg["num_hidden_layers"]:
        t.update(rand_nextn(p, h, gen, "final_layernorm"))
    return t


def bailingmoe3(folder: Path, **over) -> Path:
    """block_checkpoint's seed (0), dtype (float32), n_shards (2), with_mtp (True); other keywords: config()'s."""
    return block_checkpoint(folder, config, SPECIALS, _block, embed="model.word_embeddings.weight", **over)
