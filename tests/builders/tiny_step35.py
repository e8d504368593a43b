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
    release_config,
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LAYER_TYPES = release_config("step35")["layer_types"]  # the blocks' attention: trunk, then the MTP blocks
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
    return release_config("step35", vocab_size=vocab, **over)


def _zero_centred(n: int, gen: torch.Generator) -> torch.Tensor:
    return 0.1 * torch.randn(n, generator=gen)


def _heads(cfg: dict, layer_type: str) -> tuple[int, int]:
    """(q heads, kv groups) of a layer type: ``attention_other_setting``'s for its type, the top level's else."""
    other = cfg["attention_other_setting"]
    keys = other if layer_type == other["attention_type"] else cfg
    return keys["num_attention_heads"], keys["num_attention_groups"]


def block_tensors(bid: int, cfg: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    p, h, hd = f"model.layers.{bid}.", cfg["hidden_size"], cfg["head_dim"]
    n_head, n_kv = _heads(cfg, cfg["layer_types"][bid])
    n_exp, moe_ff = cfg["moe_num_experts"], cfg["moe_intermediate_size"]
    t = {
        **rand_block_norms(p, h, gen, norm=_zero_centred),
        **rand_attention(p + "self_attn.", h, n_head, n_kv, hd, gen),
        **rand_qk_norms(p + "self_attn.", hd, gen, norm=_zero_centred),
        p + "self_attn.g_proj.weight": rand_weight(n_head, h, gen=gen),
    }
    moe = 0 < bid < cfg["num_hidden_layers"]
    if moe:
        t.update(
            {
                **rand_router(p + "moe.gate.weight", n_exp, h, gen, bias=p + "moe.router_bias"),
                p + "moe.gate_proj.weight": rand_weight(n_exp, moe_ff, h, gen=gen),
                p + "moe.up_proj.weight": rand_weight(n_exp, moe_ff, h, gen=gen),
                p + "moe.down_proj.weight": rand_weight(n_exp, h, moe_ff, gen=gen),
                **rand_mlp(p + "share_expert.", cfg["share_expert_dim"], h, gen),
            }
        )
    else:  # the leading dense layer and the MTP blocks
        t.update(rand_mlp(p + "mlp.", cfg["intermediate_size"], h, gen))
    if bid >= cfg["num_hidden_layers"]:
        t.update(rand_nextn(p, h, gen, "transformer.shared_head.norm", norm=_zero_centred))
        t[p + "transformer.shared_head.output.weight"] = rand_weight(cfg["vocab_size"], h, gen=gen)
    return t


def step35(folder: Path, **over) -> Path:
    """block_checkpoint's seed (0), dtype (float32), n_shards (2), with_mtp (True); other keywords: config()'s."""
    return block_checkpoint(folder, config, SPECIALS, block_tensors, norm=_zero_centred, **over)


VISION_TOWER = {
    "vision_model.positional_embedding": (4, 64),
    "vision_model.vit_downsampler1.weight": (64, 64),
    "vision_model.transformer.layers.0.attn.in_proj_weight": (192, 64),
    "vit_large_projector.weight": (256, 64),  # to the text model's hidden size
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
