"""What the MiMo-V2 release manifests (mimo_v2_flash, mimo_v25, mimo_v25_pro) share: the per-layer tensor
names every MiMo-V2 release stores, and the FP8 / MXFP4 encodings they ship in.

Per trunk layer ``model.layers.N.``: input_layernorm, post_attention_layernorm, self_attn.{q,k,v}_proj (V2-Flash)
or self_attn.qkv_proj (V2.5, V2.5-Pro), self_attn.o_proj, self_attn.attention_sink_bias on sliding-window layers
(``add_swa_attention_sink_bias``; none on full ones), then mlp.{gate,up,down}_proj (``moe_layer_freq`` 0) or
mlp.gate.weight + mlp.gate.e_score_correction_bias + mlp.experts.E.{gate,up,down}_proj. Per MTP layer
``model.mtp.layers.i.`` (3 in every release): enorm, hnorm, eh_proj, input_layernorm, the same attention as a
sliding-window layer (sink included), pre_mlp_layernorm, a dense mlp and final_layernorm.

FP8 as released: q/k/v (or the fused qkv) and every MLP projection e4m3 with 128x128 ``weight_scale_inv``
tiles, the fused qkv_proj tiled per tensor-parallel rank over ``num_key_value_heads`` ranks; o_proj, eh_proj,
embeddings, lm_head and norms bf16 (``ignored_layers`` lists the o_proj of every layer), the router float32.

Sources: the V2.5 / V2.5-Pro weight listings and the loaders cited in the manifests.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

import torch

from . import experts, mlp, nextn, trunk

# The config.json keys every MiMo-V2 manifest holds with the same values: the backbone's shrunk sizes (hidden 256,
# 4 layers in pattern [0, 1, 1, 0], 4 experts, heads 16 with head_dim 48 / v_head_dim 32) and its fixed choices;
# each manifest adds its release's own keys with ``variant``.
SHARED_CONFIG = {
    "add_full_attention_sink_bias": False,
    "add_swa_attention_sink_bias": True,
    "attention_bias": False,
    "attention_chunk_size": 128,
    "attention_dropout": 0.0,
    "head_dim": 48,
    "hidden_act": "silu",
    "hidden_size": 256,
    "hybrid_layer_pattern": [0, 1, 1, 0],
    "initializer_range": 0.02,
    "intermediate_size": 512,
    "layernorm_epsilon": 1e-05,
    "moe_intermediate_size": 256,
    "moe_layer_freq": [0, 1, 1, 1],
    "n_group": 1,
    "n_routed_experts": 4,
    "n_shared_experts": None,
    "norm_topk_prob": True,
    "num_attention_heads": 16,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 4,
    "partial_rotary_factor": 0.334,
    "routed_scaling_factor": None,
    "scoring_func": "sigmoid",
    "sliding_window": 128,
    "sliding_window_size": 128,
    "swa_head_dim": 48,
    "swa_num_attention_heads": 16,
    "swa_num_key_value_heads": 8,
    "swa_rope_theta": 10000,
    "swa_v_head_dim": 32,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "use_cache": True,
    "v_head_dim": 32,
    "vocab_size": 152576,
}
N_MTP = 3  # every MiMo-V2 release ships 3 MTP layers (llama.cpp's conversion/mimo.py hardcodes 3)
FP8_LINEAR = re.compile(
    r"^model\.(?:mtp\.)?layers\.\d+\.(?:self_attn\.(?:q|k|v|qkv)_proj"
    r"|mlp\.(?:experts\.\d+\.)?(?:gate|up|down)_proj)\.weight$"
)
ROUTED_EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(?:gate|up|down)_proj\.weight$")
ROUTER = re.compile(r"^model\.layers\.\d+\.mlp\.gate\.(?:weight|e_score_correction_bias)$")


def auto_map(module: str, prefix: str) -> dict[str, str]:
    """config.json's ``auto_map`` to the release's remote code (``configuration_{module}.{prefix}Config``, ...)."""
    return {
        "AutoConfig": f"configuration_{module}.{prefix}Config",
        "AutoModel": f"modeling_{module}.{prefix}Model",
        "AutoModelForCausalLM": f"modeling_{module}.{prefix}ForCausalLM",
    }


def text_tensors(cfg: dict, fused_qkv: bool) -> dict[str, tuple[int, ...]]:
    """Every tensor of the language model, named and shaped as the releases store them (bf16 form)."""
    h, vocab, n = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    n_head, d, dv = cfg["num_attention_heads"], cfg["head_dim"], cfg["v_head_dim"]
    out = trunk(vocab, h)
    for L in range(n + N_MTP):
        mtp = L >= n
        p = f"model.mtp.layers.{L - n}." if mtp else f"model.layers.{L}."
        swa = mtp or cfg["hybrid_layer_pattern"][L] == 1
        n_kv = cfg["swa_num_key_value_heads" if swa else "num_key_value_heads"]
        out[p + "input_layernorm.weight"] = (h,)
        out[p + ("pre_mlp_layernorm" if mtp else "post_attention_layernorm") + ".weight"] = (h,)
        if fused_qkv:
            out[p + "self_attn.qkv_proj.weight"] = (n_head * d + n_kv * (d + dv), h)
        else:
            out |= {
                p + "self_attn.q_proj.weight": (n_head * d, h),
                p + "self_attn.k_proj.weight": (n_kv * d, h),
                p + "self_attn.v_proj.weight": (n_kv * dv, h),
            }
        out[p + "self_attn.o_proj.weight"] = (h, n_head * dv)
        if cfg["add_swa_attention_sink_bias" if swa else "add_full_attention_sink_bias"]:
            out[p + "self_attn.attention_sink_bias"] = (n_head,)
        if not mtp and cfg["moe_layer_freq"][L]:
            ne, ff = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
            out |= {p + "mlp.gate.weight": (ne, h), p + "mlp.gate.e_score_correction_bias": (ne,)}
            out |= experts(p + "mlp.experts.", ne, ff, h)
        else:
            out |= mlp(p + "mlp.", cfg["intermediate_size"], h)
        if mtp:
            out |= nextn(p, h, "final_layernorm")
    return out


def ignored_o_proj(cfg: dict) -> list[str]:
    """quantization_config.ignored_layers as released: every trunk layer's o_proj, and the MTP one's."""
    return [f"model.layers.{i}.self_attn.o_proj" for i in range(cfg["num_hidden_layers"])] + [
        "model.decoder.self_attn.o_proj"
    ]


def fp8_form(quantization_config: Callable[[dict], dict], mxfp4: bool = False, **config_keys) -> Callable[[Path], None]:
    """The encoder of a release's FP8 form: the projections FP8 (a fused qkv_proj tiled per rank over
    num_key_value_heads ranks), the router float32; ``mxfp4``: the routed experts OCP MXFP4 instead (U8
    ``weight`` + U8 E8M0 ``weight_scale``) and the router left bf16; config.json gets
    ``quantization_config(cfg)`` and ``config_keys``."""

    def encode(folder: Path) -> None:
        from safetensors.torch import load_file, save_file

        from tests.builders.tiny_mimo2 import fp8_rank_tiles, to_mxfp4

        cfg = json.loads((folder / "config.json").read_text())
        tp = cfg["num_key_value_heads"]
        index_path = folder / "model.safetensors.index.json"
        index = json.loads(index_path.read_text())
        for shard in sorted(set(index["weight_map"].values())):
            out = {}
            for name, w in load_file(str(folder / shard)).items():
                if mxfp4 and ROUTED_EXPERT.match(name):
                    out[name], out[name + "_scale"] = to_mxfp4(w.float())
                    index["weight_map"][name + "_scale"] = shard
                elif FP8_LINEAR.match(name):
                    ranks = list(w.chunk(tp)) if name.endswith("qkv_proj.weight") else [w]
                    out[name], out[name + "_scale_inv"] = fp8_rank_tiles(ranks)
                    index["weight_map"][name + "_scale_inv"] = shard
                elif ROUTER.match(name) and not mxfp4:
                    out[name] = w.to(torch.float32)
                else:
                    out[name] = w
            save_file(out, str(folder / shard), metadata={"format": "pt"})
        index_path.write_text(json.dumps(index, indent=2))
        cfg["quantization_config"] = quantization_config(cfg)
        cfg.update(config_keys)
        (folder / "config.json").write_text(json.dumps(cfg, indent=2))

    return encode
