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
)

SPECIALS = ["<|endoftext|>", "<role>", "</role>"]
H = 256


def config(vocab: int, **over) -> dict:
    cfg = dict(
        architectures=["BailingMoeV3ForCausalLM"],
        model_type="bailing_moe_v3",
        vocab_size=vocab,
        hidden_size=H,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=64,
        layer_group_size=2,
        short_conv_kernel_size=4,
        no_kda_lora=True,
        kda_safe_gate=True,
        kda_lower_bound=-5.0,
        gated_attention_proj_granularity_type="head_wise",
        q_lora_rank=None,
        kv_lora_rank=256,
        qk_nope_head_dim=64,
        qk_rope_head_dim=64,
        v_head_dim=64,
        num_experts=4,
        num_experts_per_tok=2,
        num_shared_experts=1,
        moe_intermediate_size=256,
        moe_shared_expert_intermediate_size=256,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        score_function="sigmoid",
        n_group=1,
        topk_group=1,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        rope_theta=600000.0,
        use_bias=False,
        tie_word_embeddings=False,
        num_nextn_predict_layers=1,
        bos_token_id=1,
        eos_token_id=0,
        pad_token_id=0,
    )
    cfg.update(over)
    return cfg


def is_full_attention(bid: int, cfg: dict) -> bool:
    n, g = cfg["num_hidden_layers"], cfg["layer_group_size"]
    return bid >= n or (bid + 1) % g == 0 or bid >= n // g * g


def _kda(p: str, cfg: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    nh, hd, k = cfg["num_attention_heads"], cfg["head_dim"], cfg["short_conv_kernel_size"]
    d = nh * hd
    t = {p + f"{x}_proj.weight": rand_weight(d, H, gen=gen) for x in ("q", "k", "v", "f", "g")}
    t.update({p + f"{x}_conv1d.weight": rand_weight(d, 1, k, gen=gen, scale=0.3) for x in ("q", "k", "v")})
    t.update(
        {
            p + "b_proj.weight": rand_weight(nh, H, gen=gen),
            p + "A_log": torch.log(torch.linspace(1, 8, nh)),
            p + "dt_bias": rand_weight(d, gen=gen, scale=0.5),
            p + "o_norm.weight": rand_norm(hd, gen),
            p + "o_proj.weight": rand_weight(H, d, gen=gen),
        }
    )
    return t


def _mla(p: str, cfg: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    nh, nope, rope, v, kv = (
        cfg[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank")
    )
    t = {
        p + "kv_a_proj_with_mqa.weight": rand_weight(kv + rope, H, gen=gen),
        p + "kv_a_layernorm.weight": rand_norm(kv, gen),
        p + "kv_b_proj.weight": rand_weight(nh * (nope + v), kv, gen=gen),
        p + "g_proj.weight": rand_weight(nh, H, gen=gen),
        p + "dense.weight": rand_weight(H, nh * v, gen=gen),
    }
    if (q_lora := cfg["q_lora_rank"]) is None:
        t[p + "q_proj.weight"] = rand_weight(nh * (nope + rope), H, gen=gen)
    else:
        t.update(
            {
                p + "q_a_proj.weight": rand_weight(q_lora, H, gen=gen),
                p + "q_a_layernorm.weight": rand_norm(q_lora, gen),
                p + "q_b_proj.weight": rand_weight(nh * (nope + rope), q_lora, gen=gen),
            }
        )
    return t


def _mlp(p: str, cfg: dict, bid: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    if bid < cfg["first_k_dense_replace"]:
        return rand_mlp(p, cfg["intermediate_size"], H, gen)
    n_exp, ff = cfg["num_experts"], cfg["moe_intermediate_size"]
    sff = cfg["moe_shared_expert_intermediate_size"] * cfg["num_shared_experts"]
    t = rand_router(p + "gate.weight", n_exp, H, gen, bias=p + "gate.expert_bias")
    t.update(rand_mlp(p + "shared_experts.", sff, H, gen))
    return t | rand_experts(p + "experts.", n_exp, ff, H, gen)


def _block(bid: int, cfg: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    p = f"model.layers.{bid}."
    t = rand_block_norms(p, H, gen)
    t.update((_mla if is_full_attention(bid, cfg) else _kda)(p + "attention.", cfg, gen))
    t.update(_mlp(p + "mlp.", cfg, bid, gen))
    if bid >= cfg["num_hidden_layers"]:
        t.update(rand_nextn(p, H, gen, "final_layernorm"))
    return t


def bailingmoe3(folder: Path, **over) -> Path:
    """block_checkpoint's seed (0), dtype (float32), n_shards (2), with_mtp (True); other keywords: config()'s."""
    return block_checkpoint(folder, config, SPECIALS, _block, H, embed="model.word_embeddings.weight", **over)
