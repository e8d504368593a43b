"""The tensors of Qwen3.5 / Qwen3.6 (dense and MoE) and Qwen3-Next releases, shared by their manifests.

Trunk (transformers' modeling_qwen3_5.py / modeling_qwen3_5_moe.py / modeling_qwen3_next.py): every
``full_attention_interval``-th layer a gated attention (``q_proj`` rows hold [q; gate] per head, q/k RMSNorms),
the others a Gated DeltaNet (``linear_attn.*``: Qwen3.5 splits its input projection into ``in_proj_qkv`` /
``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``, Qwen3-Next fuses them into ``in_proj_qkvz`` / ``in_proj_ba``); a dense
MLP, or an MoE block (softmax router ``mlp.gate``, per-expert projections -- the releases store them per expert,
transformers' conversion mapping fuses them on load --, a shared expert and its sigmoid gate).
The MTP head (vLLM's qwen3_5_mtp.py / qwen3_next_mtp.py, llama.cpp's conversion/qwen.py): ``mtp.fc``,
``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.norm`` and ``mtp.layers.{i}.*`` (a
full-attention block with the trunk's MLP kind), at the top level beside the text model.
The ``*ForConditionalGeneration`` releases keep the text model under ``model.language_model.`` and a vision tower
under ``model.visual.`` (transformers' Qwen3_5VisionModel: patch embedding, position embedding, blocks, merger).
"""

from __future__ import annotations

import json
from pathlib import Path

from . import attention, block_norms, experts, fp8_block_scaled, mlp

# The text config keys every Qwen3.5 / 3.6 / Qwen3-Next manifest holds with the same values: the sizes they are all
# shrunk to (hidden 256, 4 layers, heads 4/2 of 64, linear-attention heads 2/4 of 64) and fixed choices; each
# manifest adds its release's own keys with ``variant``.
SHARED_TEXT = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "full_attention_interval": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_value_head_dim": 64,
    "max_position_embeddings": 262144,
    "num_attention_heads": 4,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "use_cache": True,
}


def text_config(cfg: dict) -> dict:
    return cfg.get("text_config") or cfg


def tensors(cfg: dict) -> dict[str, tuple[int, ...]]:
    t = text_config(cfg)
    conditional = "text_config" in cfg
    top = "model.language_model." if conditional else "model."
    h, v = t["hidden_size"], t["vocab_size"]
    out = {top + "embed_tokens.weight": (v, h), top + "norm.weight": (h,)}
    if not t.get("tie_word_embeddings", cfg.get("tie_word_embeddings")):
        out["lm_head.weight"] = (v, h)
    every = t.get("full_attention_interval", 4)
    types = t.get("layer_types") or [
        "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(t["num_hidden_layers"])
    ]
    for i, kind in enumerate(types):
        out |= _block(t, f"{top}layers.{i}.", kind == "full_attention")
    n_mtp = t.get("mtp_num_hidden_layers", 1)
    for i in range(n_mtp):
        out |= _block(t, f"mtp.layers.{i}.", True)
    out |= {
        "mtp.fc.weight": (h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.norm.weight": (h,),
    }
    if conditional:
        out |= _vision(cfg["vision_config"])
    return out


def _block(t: dict, p: str, full: bool) -> dict[str, tuple[int, ...]]:
    h = t["hidden_size"]
    out = block_norms(p, h)
    if full:  # gated attention: q_proj also holds the output gate
        nh, nkv, d = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
        out |= attention(p + "self_attn.", h, nh, nkv, d, qk_norm=True, gated=True)
    else:
        nk, nv = t["linear_num_key_heads"], t["linear_num_value_heads"]
        dk, dv, k = t["linear_key_head_dim"], t["linear_value_head_dim"], t["linear_conv_kernel_dim"]
        conv = 2 * nk * dk + nv * dv
        q = p + "linear_attn."
        out |= {
            q + "conv1d.weight": (conv, 1, k),
            q + "dt_bias": (nv,),
            q + "A_log": (nv,),
            q + "norm.weight": (dv,),
            q + "out_proj.weight": (h, nv * dv),
        }
        if t["model_type"] == "qwen3_next":
            out |= {q + "in_proj_qkvz.weight": (2 * nk * dk + 2 * nv * dv, h), q + "in_proj_ba.weight": (2 * nv, h)}
        else:
            out |= {
                q + "in_proj_qkv.weight": (conv, h),
                q + "in_proj_z.weight": (nv * dv, h),
                q + "in_proj_b.weight": (nv, h),
                q + "in_proj_a.weight": (nv, h),
            }
    if "num_experts" in t:
        ne, mff, sff = t["num_experts"], t["moe_intermediate_size"], t["shared_expert_intermediate_size"]
        out |= {p + "mlp.gate.weight": (ne, h), p + "mlp.shared_expert_gate.weight": (1, h)}
        out |= mlp(p + "mlp.shared_expert.", sff, h) | experts(p + "mlp.experts.", ne, mff, h)
    else:
        out |= mlp(p + "mlp.", t["intermediate_size"], h)
    return out


def _vision(vc: dict) -> dict[str, tuple[int, ...]]:
    h, ff, c, tp, ps = (
        vc["hidden_size"],
        vc["intermediate_size"],
        vc["in_channels"],
        vc["temporal_patch_size"],
        vc["patch_size"],
    )
    merged = h * vc["spatial_merge_size"] ** 2
    p = "model.visual."
    out = {
        p + "patch_embed.proj.weight": (h, c, tp, ps, ps),
        p + "patch_embed.proj.bias": (h,),
        p + "pos_embed.weight": (vc["num_position_embeddings"], h),
        p + "merger.norm.weight": (h,),
        p + "merger.norm.bias": (h,),
        p + "merger.linear_fc1.weight": (merged, merged),
        p + "merger.linear_fc1.bias": (merged,),
        p + "merger.linear_fc2.weight": (vc["out_hidden_size"], merged),
        p + "merger.linear_fc2.bias": (vc["out_hidden_size"],),
    }
    for i in range(vc["depth"]):
        b = f"{p}blocks.{i}."
        out |= {
            b + "norm1.weight": (h,),
            b + "norm1.bias": (h,),
            b + "norm2.weight": (h,),
            b + "norm2.bias": (h,),
            b + "attn.qkv.weight": (3 * h, h),
            b + "attn.qkv.bias": (3 * h,),
            b + "attn.proj.weight": (h, h),
            b + "attn.proj.bias": (h,),
            b + "mlp.linear_fc1.weight": (ff, h),
            b + "mlp.linear_fc1.bias": (ff,),
            b + "mlp.linear_fc2.weight": (h, ff),
            b + "mlp.linear_fc2.bias": (h,),
        }
    return out


def _not_converted(name: str) -> bool:
    """What the Qwen FP8 releases keep in bf16 (``modules_to_not_convert``): the vision tower, the routers and shared
    expert gates, the linear attention's small a/b (Qwen3-Next: ba) projections."""
    return (
        "visual." in name
        or name.endswith(("mlp.gate.weight", "shared_expert_gate.weight"))
        or ".linear_attn.in_proj_" in name
        and name.endswith(("_a.weight", "_b.weight", "_ba.weight"))
    )


def fp8(folder: Path) -> None:
    """The -FP8 releases' form: 128x128 block-scaled e4m3, ``modules_to_not_convert`` listing what stays bf16."""
    names = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    kept = sorted({n.removesuffix(".weight") for n in names if _not_converted(n) and n.endswith(".weight")})
    fp8_block_scaled(folder, keep=_not_converted, modules_to_not_convert=["lm_head", *kept])
