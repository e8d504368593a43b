"""A tiny Step3.5 Flash checkpoint (``Step3p5ForCausalLM``) with its MTP layers appended past the trunk.

Names and config keys follow the release (stepfun-ai/Step-3.5-Flash) as llama.cpp's
converter (conversion/step3.py) and gguf-py's tensor map read them:
- layer 0 dense (``mlp.*``), the others MoE (``moe_layers_enum``): router
  ``moe.gate``, selection bias ``moe.router_bias``, experts stored stacked
  ``moe.{gate,up,down}_proj`` [E, rows, cols], shared expert ``share_expert.*``;
- attention with q/k norms and a head-wise gate ``self_attn.g_proj`` [n_head, hidden];
  full and sliding layers have different head counts (``attention_other_setting``);
- MTP blocks ``model.layers.{N+i}``: ``eh_proj``, ``enorm``, ``hnorm``,
  ``transformer.shared_head.{norm,output}`` and a dense sliding-attention block;
- ``rope_theta`` per layer, ``layer_types`` / ``partial_rotary_factors`` covering
  the MTP blocks, ``swiglu_limits`` shorter than the block count (padded by converters).
Weights are random (fixed seed); norms are zero-centred, as in the release.
No transformers class is needed: the converter only reads names, shapes and config.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.builders.tiny import (
    block_checkpoint,
    rand_attention,
    rand_block_norms,
    rand_mlp,
    rand_nextn,
    rand_qk_norms,
    rand_router,
    rand_weight,
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
N_TRUNK, N_MTP = 3, 2
H, HEAD_DIM, FF, MOE_FF, SHARE_FF, N_EXP = 256, 64, 512, 256, 256, 4
HEADS = {"full_attention": (4, 2), "sliding_attention": (8, 2)}  # (q heads, kv groups)
LAYER_TYPES = ["full_attention", "sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
# the releases' RoPE scaling (stepfun-ai/Step-3.5-Flash and Step-3.7-Flash config.json): Llama-3's, on the
# full-attention layers only
RELEASE_ROPE_SCALING = {
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 2.0,
        "original_max_position_embeddings": 131072,
        "low_freq_factor": 1.0,
        "high_freq_factor": 32.0,
    },
    "yarn_only_types": ["full_attention"],
}


def config(vocab: int, **over) -> dict:
    cfg = dict(
        architectures=["Step3p5ForCausalLM"],
        model_type="step3p5",
        vocab_size=vocab,
        hidden_size=H,
        intermediate_size=FF,
        num_hidden_layers=N_TRUNK,
        num_attention_heads=HEADS["full_attention"][0],
        num_attention_groups=HEADS["full_attention"][1],
        head_dim=HEAD_DIM,
        attention_other_setting={
            "attention_type": "sliding_attention",
            "num_attention_heads": HEADS["sliding_attention"][0],
            "num_attention_groups": HEADS["sliding_attention"][1],
            "head_dim": HEAD_DIM,
            "true_head_dim": HEAD_DIM,
        },
        sliding_window=16,
        layer_types=LAYER_TYPES,
        partial_rotary_factors=[1.0 if t == "sliding_attention" else 0.5 for t in LAYER_TYPES],
        rope_theta=[1000000.0 if t == "full_attention" else 10000.0 for t in LAYER_TYPES],
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        moe_num_experts=N_EXP,
        moe_top_k=2,
        moe_intermediate_size=MOE_FF,
        share_expert_dim=SHARE_FF,
        moe_layers_enum=",".join(str(i) for i in range(1, N_TRUNK)),
        moe_every_n_layer=1,
        moe_router_activation="sigmoid",
        moe_router_scaling_factor=3.0,
        norm_expert_weight=True,
        use_head_wise_attn_gate=True,
        use_moe_router_bias=True,
        swiglu_limits=[None, 7.0, 7.0],
        swiglu_limits_shared=[None, 16.0, 16.0],
        num_nextn_predict_layers=N_MTP,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=0,
    )
    cfg.update(over)
    return cfg


def _zero_centred(n: int, gen: torch.Generator) -> torch.Tensor:
    return 0.1 * torch.randn(n, generator=gen)


def block_tensors(bid: int, cfg: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    p = f"model.layers.{bid}."
    n_head, n_kv = HEADS[cfg["layer_types"][bid]]
    t = {
        **rand_block_norms(p, H, gen, norm=_zero_centred),
        **rand_attention(p + "self_attn.", H, n_head, n_kv, HEAD_DIM, gen),
        **rand_qk_norms(p + "self_attn.", HEAD_DIM, gen, norm=_zero_centred),
        p + "self_attn.g_proj.weight": rand_weight(n_head, H, gen=gen),
    }
    moe = 0 < bid < cfg["num_hidden_layers"]
    if moe:
        t.update(
            {
                **rand_router(p + "moe.gate.weight", N_EXP, H, gen, bias=p + "moe.router_bias"),
                p + "moe.gate_proj.weight": rand_weight(N_EXP, MOE_FF, H, gen=gen),
                p + "moe.up_proj.weight": rand_weight(N_EXP, MOE_FF, H, gen=gen),
                p + "moe.down_proj.weight": rand_weight(N_EXP, H, MOE_FF, gen=gen),
                **rand_mlp(p + "share_expert.", SHARE_FF, H, gen),
            }
        )
    else:  # the leading dense layer and the MTP blocks
        t.update(rand_mlp(p + "mlp.", FF, H, gen))
    if bid >= cfg["num_hidden_layers"]:
        t.update(rand_nextn(p, H, gen, "transformer.shared_head.norm", norm=_zero_centred))
        t[p + "transformer.shared_head.output.weight"] = rand_weight(cfg["vocab_size"], H, gen=gen)
    return t


def step35(folder: Path, **over) -> Path:
    """block_checkpoint's seed (0), dtype (float32), n_shards (2), with_mtp (True); other keywords: config()'s."""
    return block_checkpoint(folder, config, SPECIALS, block_tensors, H, norm=_zero_centred, **over)


VISION_TOWER = {
    "vision_model.positional_embedding": (4, 64),
    "vision_model.vit_downsampler1.weight": (64, 64),
    "vision_model.transformer.layers.0.attn.in_proj_weight": (192, 64),
    "vit_large_projector.weight": (H, 64),
}


def as_step37(folder: Path, nested: bool = True) -> Path:
    """Rewrite a step35() checkpoint in place into Step3.7 Flash's layout (``Step3p7ForConditionalGeneration``):
    the text model's hparams under ``text_config`` (or, ``nested=False``, left at the top) beside a
    ``vision_config``, and a vision tower (``vision_model.*``, ``vit_large_projector``) stored beside the
    text tensors, as llama.cpp's conversion/step3.py reads the release (the tower goes to its mmproj file)."""
    import json

    from tests.helpers.familycheck import add_tensors

    cfg = json.loads((folder / "config.json").read_text())
    vision = {"hidden_size": 64, "num_hidden_layers": 1}
    if nested:
        text = {k: v for k, v in cfg.items() if k != "architectures"}
        cfg = {"model_type": "step3p7", "text_config": text, "vision_config": vision}
    else:
        cfg["vision_config"] = vision
    cfg["architectures"] = ["Step3p7ForConditionalGeneration"]
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = torch.Generator().manual_seed(7)
    add_tensors(folder, {name: torch.randn(shape, generator=gen) for name, shape in VISION_TOWER.items()})
    return folder
