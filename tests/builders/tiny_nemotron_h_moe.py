"""A tiny Nemotron-H MoE checkpoint (``NemotronHForCausalLM`` with experts, Nemotron 3) with its MTP head.

Config keys and tensor names follow the releases (NVIDIA Nemotron 3 Nano/Super:
``hybrid_override_pattern`` with M = Mamba2, * = attention, E = MoE, and
``mtp_hybrid_override_pattern: "*E"``), as transformers' NemotronHConfig and
llama.cpp's converter (conversion/nemotron.py) read them:
- ``backbone.embeddings``, ``backbone.layers.{i}.norm`` + ``.mixer.*``, ``backbone.norm_f``, ``lm_head``;
- Mamba2 mixers: ``in_proj``, ``conv1d`` (+bias), ``dt_bias``, ``A_log``, ``D``, grouped ``norm``, ``out_proj``;
- MoE mixers: sigmoid router ``gate`` + ``gate.e_score_correction_bias``, ReLU^2 experts
  ``experts.{e}.{up,down}_proj`` (no gate projection), ``shared_experts.{up,down}_proj``;
- the MTP head, two sub-layers folded by llama.cpp into one block: ``mtp.layers.0``
  (``enorm``, ``hnorm``, ``eh_proj``, ``norm``, attention ``mixer.*``) and ``mtp.layers.1``
  (``norm``, MoE ``mixer.*``, ``final_layernorm``).
Weights are random (fixed seed), sized so every weight row is a multiple of 256.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.builders.tiny import finish_checkpoint, rand_attention, rand_norm, rand_router, rand_weight, start_checkpoint

SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
H = 256


def config(vocab: int, **over) -> dict:
    cfg = dict(
        architectures=["NemotronHForCausalLM"],
        model_type="nemotron_h",
        vocab_size=vocab,
        hidden_size=H,
        hybrid_override_pattern="ME*E",
        num_hidden_layers=4,
        tie_word_embeddings=False,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        attention_bias=False,
        mlp_bias=False,
        mlp_hidden_act="relu2",
        intermediate_size=512,
        ssm_state_size=64,
        mamba_num_heads=8,
        mamba_head_dim=64,
        n_groups=2,
        conv_kernel=4,
        expand=2,
        use_conv_bias=True,
        mamba_proj_bias=False,
        chunk_size=128,
        mamba_hidden_act="silu",
        time_step_min=0.001,
        time_step_max=0.1,
        time_step_floor=1e-4,
        time_step_limit=[0.0, float("inf")],
        n_routed_experts=4,
        n_shared_experts=1,
        moe_intermediate_size=256,
        moe_shared_expert_intermediate_size=256,
        num_experts_per_tok=2,
        routed_scaling_factor=2.5,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        num_nextn_predict_layers=1,
        mtp_hybrid_override_pattern="*E",
        layer_norm_epsilon=1e-5,
        rescale_prenorm_residual=True,
        residual_in_fp32=False,
        use_bias=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    cfg.update(over)
    return cfg


def _mamba(p: str, cfg: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    n_heads, d_state, groups = cfg["mamba_num_heads"], cfg["ssm_state_size"], cfg["n_groups"]
    d_inner = n_heads * cfg["mamba_head_dim"]
    conv_dim = d_inner + 2 * groups * d_state
    return {
        p + "in_proj.weight": rand_weight(2 * d_inner + 2 * groups * d_state + n_heads, H, gen=gen),
        p + "conv1d.weight": rand_weight(conv_dim, 1, cfg["conv_kernel"], gen=gen, scale=0.3),
        p + "conv1d.bias": rand_weight(conv_dim, gen=gen, scale=0.1),
        p + "dt_bias": rand_weight(n_heads, gen=gen, scale=0.5),
        p + "A_log": torch.log(torch.arange(1, n_heads + 1, dtype=torch.float32)),
        p + "D": 1.0 + rand_weight(n_heads, gen=gen, scale=0.1),
        p + "norm.weight": rand_norm(d_inner, gen),
        p + "out_proj.weight": rand_weight(H, d_inner, gen=gen),
    }


def _attention(p: str, cfg: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return rand_attention(p, H, cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], gen)


def _moe(p: str, cfg: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    n_exp, ff, sff = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["moe_shared_expert_intermediate_size"]
    t = {
        **rand_router(p + "gate.weight", n_exp, H, gen, bias=p + "gate.e_score_correction_bias"),
        p + "shared_experts.up_proj.weight": rand_weight(sff, H, gen=gen),
        p + "shared_experts.down_proj.weight": rand_weight(H, sff, gen=gen),
    }
    for e in range(n_exp):
        t[f"{p}experts.{e}.up_proj.weight"] = rand_weight(ff, H, gen=gen)
        t[f"{p}experts.{e}.down_proj.weight"] = rand_weight(H, ff, gen=gen)
    return t


_MIXERS = {"M": _mamba, "*": _attention, "E": _moe}


def _layers(prefix: str, pattern: str, cfg: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The layers ``prefix + "{i}."`` of a hybrid pattern (M, *, E): each a ``norm`` and its ``mixer.*``."""
    t = {}
    for i, kind in enumerate(pattern):
        p = f"{prefix}{i}."
        t[p + "norm.weight"] = rand_norm(H, gen)
        t.update(_MIXERS[kind](p + "mixer.", cfg, gen))
    return t


def nemotron_h_moe(
    folder: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32, n_shards: int = 2, with_mtp: bool = True, **over
) -> Path:
    folder, vocab, cfg, gen = start_checkpoint(folder, config, SPECIALS, seed, **over)
    sd = {
        "backbone.embeddings.weight": rand_weight(vocab, H, gen=gen),
        "backbone.norm_f.weight": rand_norm(H, gen),
        "lm_head.weight": rand_weight(vocab, H, gen=gen),
    }
    sd.update(_layers("backbone.layers.", cfg["hybrid_override_pattern"], cfg, gen))
    if with_mtp:
        sd.update(_layers("mtp.layers.", cfg["mtp_hybrid_override_pattern"], cfg, gen))
        sd.update(
            {
                "mtp.layers.0.enorm.weight": rand_norm(H, gen),
                "mtp.layers.0.hnorm.weight": rand_norm(H, gen),
                "mtp.layers.0.eh_proj.weight": rand_weight(H, 2 * H, gen=gen),
                "mtp.layers.1.final_layernorm.weight": rand_norm(H, gen),
            }
        )
    return finish_checkpoint(folder, cfg, sd, dtype, n_shards)
