"""A tiny Nemotron-h MoE checkpoint (``NemotronHForCausalLM`` with experts, Nemotron 3) with its MTP head.

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

from tests.builders.tiny import (
    finish_checkpoint,
    rand_attention,
    rand_ends,
    rand_norm,
    rand_router,
    rand_weight,
    release_config,
    start_checkpoint,
)

SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def config(vocab: int, **over) -> dict:
    return release_config("nemotron_h_moe", vocab_size=vocab, **over)


def _mamba(p: str, cfg: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    h, n_heads, d_state, groups = cfg["hidden_size"], cfg["mamba_num_heads"], cfg["ssm_state_size"], cfg["n_groups"]
    d_inner = n_heads * cfg["mamba_head_dim"]
    conv_dim = d_inner + 2 * groups * d_state
    return {
        p + "in_proj.weight": rand_weight(2 * d_inner + 2 * groups * d_state + n_heads, h, gen=gen),
        p + "conv1d.weight": rand_weight(conv_dim, 1, cfg["conv_kernel"], gen=gen, scale=0.3),
        p + "conv1d.bias": rand_weight(conv_dim, gen=gen, scale=0.1),
        p + "dt_bias": rand_weight(n_heads, gen=gen, scale=0.5),
        p + "A_log": torch.log(torch.arange(1, n_heads + 1, dtype=torch.float32)),
        p + "D": 1.0 + rand_weight(n_heads, gen=gen, scale=0.1),
        p + "norm.weight": rand_norm(d_inner, gen),
        p + "out_proj.weight": rand_weight(h, d_inner, gen=gen),
    }


def _attention(p: str, cfg: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return rand_attention(
        p, cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], gen
    )


def _moe(p: str, cfg: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    h, n_exp, ff = cfg["hidden_size"], cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    sff = cfg["moe_shared_expert_intermediate_size"]
    t = {
        **rand_router(p + "gate.weight", n_exp, h, gen, bias=p + "gate.e_score_correction_bias"),
        p + "shared_experts.up_proj.weight": rand_weight(sff, h, gen=gen),
        p + "shared_experts.down_proj.weight": rand_weight(h, sff, gen=gen),
    }
    for e in range(n_exp):
        t[f"{p}experts.{e}.up_proj.weight"] = rand_weight(ff, h, gen=gen)
        t[f"{p}experts.{e}.down_proj.weight"] = rand_weight(h, ff, gen=gen)
    return t


_MIXERS = {"M": _mamba, "*": _attention, "E": _moe}


def _layers(prefix: str, pattern: str, cfg: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The layers ``prefix + "{i}."`` of a hybrid pattern (M, *, E): each a ``norm`` and its ``mixer.*``."""
    t = {}
    for i, kind in enumerate(pattern):
        p = f"{prefix}{i}."
        t[p + "norm.weight"] = rand_norm(cfg["hidden_size"], gen)
        t.update(_MIXERS[kind](p + "mixer.", cfg, gen))
    return t


def nemotron_h_moe(
    folder: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32, n_shards: int = 2, with_mtp: bool = True, **over
) -> Path:
    folder, _, cfg, gen = start_checkpoint(folder, config, SPECIALS, seed, **over)
    h = cfg["hidden_size"]
    sd = rand_ends(cfg, gen, embed="backbone.embeddings.weight", final_norm="backbone.norm_f.weight")
    sd.update(_layers("backbone.layers.", cfg["hybrid_override_pattern"], cfg, gen))
    if with_mtp:
        sd.update(_layers("mtp.layers.", cfg["mtp_hybrid_override_pattern"], cfg, gen))
        sd.update(
            {
                "mtp.layers.0.enorm.weight": rand_norm(h, gen),
                "mtp.layers.0.hnorm.weight": rand_norm(h, gen),
                "mtp.layers.0.eh_proj.weight": rand_weight(h, 2 * h, gen=gen),
                "mtp.layers.1.final_layernorm.weight": rand_norm(h, gen),
            }
        )
    return finish_checkpoint(folder, cfg, sd, dtype, n_shards)
