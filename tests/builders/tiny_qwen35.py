"""Tiny Qwen3.5 / Qwen3.6 checkpoints (dense and MoE) that tests build for themselves.

The trunk comes from transformers' own classes (``Qwen3_5ForCausalLM``,
``Qwen3_5MoeForCausalLM`` or the ``...ForConditionalGeneration`` variants, whose
text tensors live under ``model.language_model.`` next to a ``model.visual.``
tower), saved the way ``save_pretrained`` writes them (per-expert MoE tensors,
as transformers' checkpoint conversion map expects real Qwen3.5-MoE
checkpoints to be). The MTP head is added under the real checkpoint names
(``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``,
``mtp.norm``, ``mtp.layers.0.*``; vLLM's qwen3_5_mtp and llama.cpp's
conversion/qwen.py read these), its block's names and shapes taken from
transformers' full-attention decoder layer.

``fused_experts=True`` stores the trunk's routed experts fused
(``mlp.experts.gate_up_proj`` [E, 2F, H] + ``mlp.experts.down_proj`` [E, H, F]),
the other layout llama.cpp's converter accepts; ``mtp_fused_experts`` chooses
the MTP block's layout independently (default: same as the trunk).

Sizes follow DESIGN.md (hidden 256, rows multiples of 256). The linear
attention has 2 key heads and 4 value heads, so the V-head reordering that
llama.cpp applies (grouped -> tiled) is exercised; zero-centred norms, A_log
and dt_bias get informative random values.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.builders.tiny import hf_checkpoint, hf_state_dict, rand_experts, release_config, seeded_model

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def text_config(moe: bool, **over) -> dict:
    """The text model's config.json keys at tiny sizes (configs/qwen35.json, MoE: configs/qwen35_moe.json): the
    hybrid (gated DeltaNet + gated attention) layout as Qwen3.5 and Qwen3-Next name it, interleaved M-RoPE whose
    sections sum to rotary_dim / 2 (64 * 0.25 / 2)."""
    return release_config("qwen35_moe" if moe else "qwen35", **over)


def qwen35(folder: Path, **over) -> Path:
    """Write a tiny Qwen3.5 checkpoint (4 layers: 3 linear-attention + 1 full-attention, + 1 MTP layer).

    ``moe`` (False): the MoE text model; ``conditional`` (False): the ``...ForConditionalGeneration`` layout;
    ``fused_experts`` (False), ``mtp_fused_experts`` (None): as above; ``with_mtp`` (True). seed (0), dtype
    (bfloat16), n_shards (2): hf_checkpoint's; other keywords: text_config()'s.
    """
    return hf_checkpoint(folder, QWEN_SPECIALS, _state, **over)


def _state(
    seed: int,
    moe: bool = False,
    conditional: bool = False,
    fused_experts: bool = False,
    mtp_fused_experts: bool | None = None,
    with_mtp: bool = True,
    **config_over,
) -> tuple[dict[str, torch.Tensor], dict]:
    import transformers as tf

    tcfg = text_config(moe, **config_over)
    if conditional:
        cfg_cls = tf.Qwen3_5MoeConfig if moe else tf.Qwen3_5Config
        vision = release_config("qwen35_vision")  # the vision tower's config.json keys at tiny sizes
        cfg = cfg_cls(text_config=tcfg, vision_config=vision, tie_word_embeddings=tcfg["tie_word_embeddings"])
        model_cls = tf.Qwen3_5MoeForConditionalGeneration if moe else tf.Qwen3_5ForConditionalGeneration
        text = cfg.text_config
    else:
        cfg = (tf.Qwen3_5MoeTextConfig if moe else tf.Qwen3_5TextConfig)(**tcfg)
        model_cls = tf.Qwen3_5MoeForCausalLM if moe else tf.Qwen3_5ForCausalLM
        text = cfg
    sd, gen = informative_state_dict(model_cls, cfg, seed, lambda name: "language_model." in name or not conditional)
    if fused_experts:
        sd = fuse_experts(sd, text.num_experts)
    if with_mtp:
        fused_mtp = fused_experts if mtp_fused_experts is None else mtp_fused_experts
        sd.update(mtp_tensors(text, moe, gen, fused=fused_mtp))

    config = cfg.to_dict()
    config["architectures"] = [model_cls.__name__]
    sub = config["text_config"] if conditional else config
    if with_mtp:  # as the real config.json files declare it (transformers' config class drops unknown keys)
        sub["mtp_num_hidden_layers"] = 1
        sub["mtp_use_dedicated_embeddings"] = False
    return sd, config


def informative_state_dict(model_cls, cfg, seed: int, keep=lambda name: True):
    """(the state dict save_pretrained writes for a seeded random ``model_cls(cfg)``, every 1-D tensor ``keep``
    accepts made informative (informative_1d); the generator for further tensors)."""
    model, gen = seeded_model(model_cls, cfg, seed)
    sd = hf_state_dict(model)
    for name, t in sd.items():
        if t.dim() == 1 and keep(name):
            sd[name] = informative_1d(name, t.numel(), gen)
    return sd, gen


def informative_1d(name: str, n: int, gen: torch.Generator) -> torch.Tensor:
    """Random init leaves norms at 0 (zero-centred) or 1 and dt_bias at 1: make every 1-D tensor distinct."""
    if name.endswith("linear_attn.norm.weight"):  # gated RMSNorm: plain weight, around 1
        return 1.0 + 0.1 * torch.randn(n, generator=gen)
    if name.endswith("A_log"):
        return torch.empty(n).uniform_(0.01, 16, generator=gen).log()
    if name.endswith("dt_bias"):
        return 1.0 + 0.5 * torch.randn(n, generator=gen)
    return 0.1 * torch.randn(n, generator=gen)  # zero-centred RMSNorm weights: y = x_hat * (1 + w)


def fuse_experts(sd: dict[str, torch.Tensor], n_experts: int) -> dict[str, torch.Tensor]:
    """Per-expert tensors -> ``mlp.experts.gate_up_proj`` [E, 2F, H] and ``mlp.experts.down_proj`` [E, H, F]."""
    out = {k: v for k, v in sd.items() if ".mlp.experts." not in k}
    prefixes = sorted({k.split(".mlp.experts.")[0] for k in sd if ".mlp.experts." in k})
    for p in prefixes:
        e = range(n_experts)
        gate = torch.stack([sd[f"{p}.mlp.experts.{i}.gate_proj.weight"] for i in e])
        up = torch.stack([sd[f"{p}.mlp.experts.{i}.up_proj.weight"] for i in e])
        out[f"{p}.mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        out[f"{p}.mlp.experts.down_proj"] = torch.stack([sd[f"{p}.mlp.experts.{i}.down_proj.weight"] for i in e])
    return out


def mtp_tensors(text_cfg, moe: bool, gen: torch.Generator, fused: bool = False) -> dict[str, torch.Tensor]:
    """The MTP head under Qwen3.5's checkpoint names, values random (transformers does not run this head).

    The block is a full-attention decoder layer: names and shapes come from transformers' own layer.
    """
    import transformers.models.qwen3_5.modeling_qwen3_5 as dense
    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as sparse

    layer_cls = sparse.Qwen3_5MoeDecoderLayer if moe else dense.Qwen3_5DecoderLayer
    return mtp_head_tensors(layer_cls, text_cfg, gen, moe, fused)


def mtp_head_tensors(
    layer_cls, text_cfg, gen: torch.Generator, moe: bool, fused: bool = False
) -> dict[str, torch.Tensor]:
    """A Qwen MTP head (Qwen3.5, Qwen3-Next: ``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``,
    ``mtp.norm``, ``mtp.layers.0.*``), random values: the block is ``layer_cls`` built as a full-attention layer
    (its names and shapes), 1-D tensors ~0.1 N(0, 1), matrices ~0.02 N(0, 1); with ``moe`` its routed experts are
    drawn per expert (``fused``: stored as fuse_experts does) in place of the module's own."""
    import copy

    h = text_cfg.hidden_size
    cfg = copy.deepcopy(text_cfg)
    cfg.layer_types = ["full_attention"]
    layer = layer_cls(cfg, 0)
    t: dict[str, torch.Tensor] = {}
    for name, p in layer.state_dict().items():
        if name.startswith("mlp.experts."):  # fused in the module; drawn per expert below
            continue
        t["mtp.layers.0." + name] = (
            0.1 * torch.randn(p.shape, generator=gen) if p.dim() == 1 else 0.02 * torch.randn(p.shape, generator=gen)
        )
    if moe:
        per = rand_experts("mtp.layers.0.mlp.experts.", cfg.num_experts, cfg.moe_intermediate_size, h, gen)
        t.update(fuse_experts(per, cfg.num_experts) if fused else per)
    t["mtp.fc.weight"] = 0.02 * torch.randn(h, 2 * h, generator=gen)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        t[f"mtp.{norm}.weight"] = 0.1 * torch.randn(h, generator=gen)
    return t


def read_config(folder: Path) -> dict:
    """The text hparams of a tiny checkpoint (text_config merged over the top level, as converters read it)."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    return {**cfg, **cfg.get("text_config", {})}
