"""What the Step release manifests (step35_flash, step37_flash) share: the text model's config.json as released
(remote-code format, model_type step3p5), its tensor names, and the FP8 encoding the -FP8 releases ship.

Config (stepfun-ai/Step-3.5-Flash; Step-3.7-Flash's text_config): GQA with a head-wise sigmoid gate, 3:1 sliding
(window 512, 96 heads) to full (64 heads) attention, 8 KV groups, head_dim 128; ``rope_theta`` per layer (5e6 full,
1e4 sliding), ``partial_rotary_factors`` (0.5 full, 1.0 sliding), Llama-3 RoPE scaling (factor 2 over 131072
positions) on full-attention layers only (``yarn_only_types``); dense layers 0-2 then 288-expert MoE (top 8,
sigmoid router with bias, x3.0, one shared expert) per ``moe_layers_enum``; SwiGLU clamps on the last MoE layers
(7.0 routed at 43-44, 16.0 shared at 44); 3 MTP layers 45-47. Every per-layer list has num_hidden_layers + 3
entries: the MTP layers are sliding-attention, dense-MLP blocks.

Tensors: ``model.layers.N.`` input_layernorm, post_attention_layernorm, self_attn.{q,k,v,o}_proj, q_norm, k_norm,
g_proj [heads, hidden]; then mlp.{gate,up,down}_proj (dense) or moe.gate [E, hidden], moe.router_bias [E],
moe.{gate,up,down}_proj stacked [E, rows, cols] and share_expert.{gate,up,down}_proj. MTP layer ``model.layers.
{N+i}.``: eh_proj, enorm, hnorm, transformer.shared_head.{norm,output} beside a dense block named as the trunk's
(the shared embedding is the trunk's ``model.embed_tokens``). Norms zero-centred.

FP8 (-FP8 releases): the routed experts only, each stacked tensor e4m3 with ``weight_scale_inv`` [E, rows/128,
cols/128] (128x128 tiles per expert); router, shared expert, attention (g_proj included), dense MLPs, MTP layers,
embeddings and norms stay bf16.

Shrunk: hidden 4096 -> 256, trunk 45 -> 4 layers (full, then 3 sliding; dense layer 0, MoE 1-3), heads 64 / 96
-> 4 / 6 (KV 8 -> 2; head_dim 128 kept, so rope_freqs has the release's 64 entries), experts 288 -> 4 (top 8 ->
2), intermediate 11264 -> 512, moe_intermediate / share_expert 1280 -> 256; the clamps move with the last MoE
layers. Positions, RoPE and every other key as released.

The config.json itself could not be fetched: keys are those the loaders in SOURCES read from it and the config
transcriptions in public tests (Megatron-Bridge test_step37_config_load_and_roundtrip, ATOM and aiconfigurator
Step3.7 config fixtures) carry; values as they give them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.builders.tiny_step35 import RELEASE_ROPE_SCALING

from . import attention, block_norms, mlp, nextn, set_config, trunk

N_TRUNK, N_MTP = 4, 3
LAYER_TYPES = ["full_attention"] + ["sliding_attention"] * 3 + ["sliding_attention"] * N_MTP
N_ALL = N_TRUNK + N_MTP

SOURCES = [
    "llama.cpp conversion/step3.py (Step35Model: config keys read raw, per-layer arrays padded over the MTP "
    "layers, transformer.shared_head.{norm,output} of the MTP layers, moe.router_bias, stacked moe.*_proj; "
    "generate_extra_tensors: llama3 rope_freqs) and src/models/step35.cpp",
    "vllm-project/vllm vllm/model_executor/models/step3p5.py (Step3p5Attention: per-layer rope_theta, "
    "yarn_only_types drops rope_scaling on other layer types, attention_other_setting's attention_type / "
    "num_attention_heads / num_attention_groups / head_dim, use_rope_layers; moe_layers_enum; need_fp32_gate, "
    "use_moe_router_bias, swiglu_limits[_shared]; stacked .moe.{gate,up,down}_proj.weight) and step3p5_mtp.py "
    "(MTP layers at num_hidden_layers + i: enorm, hnorm, eh_proj, transformer.shared_head.output -> head)",
    "vllm-project/vllm vllm/transformers_utils/configs/step3p5.py (Step3p5Config: the release's config keys: "
    "max_seq_len, moe_every_n_layer, use_moe, moe_layer_offset, att_impl_type, use_head_wise_attn_gate, "
    "need_fp32_gate, layer_types, use_rope_layers, yarn_only_types, attention_other_setting, ...)",
    "NVIDIA-NeMo/Megatron-Bridge src/megatron/bridge/models/stepfun/step35_bridge.py (stepfun-ai/Step-3.5-Flash: "
    "per-layer rope_theta, attention_other_setting with true_head_dim, moe_layers_enum, MTP layers 45-47 dense, "
    "g_proj in every layer, model.layers.{45..47}.transformer.shared_head.{norm,output}) and its unit test of the "
    "vendored release config (model_type step3p5, use_moe, moe_router_activation sigmoid, use_moe_router_bias, "
    "need_fp32_gate, use_head_wise_attn_gate, full attention every 4th layer, yarn_only_types [full_attention], "
    "rope_theta 4-cycle from 5e6 / 1e4, swiglu_limits 7 at 43-44, swiglu_limits_shared 16 at 44)",
    "transformers 5.24 models/step3p7/configuration_step3p7.py (Step3p7TextConfig: model_type step3p5; 'legacy "
    "hub configs pad these per-layer lists with num_nextn_predict_layers trailing MTP entries', rope_scaling "
    "applied to full_attention only) and conversion_mapping.py 'step3p7' (hub names moe.gate, moe.router_bias, "
    "moe.{gate,up,down}_proj.weight[_scale_inv], share_expert)",
    "NVIDIA/TensorRT-LLM pull 14759 (Step-3.7-Flash-FP8: 'Only the routed experts are FP8 (F8_E4M3, block "
    "[128,128], with weight_scale_inv); the router/shared-expert/attention/dense layers stay bf16', the scales "
    "stacked moe.{gate,up,down}_proj.weight_scale_inv)",
    "https://fast.hugflare.com/stepfun-ai/Step-3.5-Flash-Int4 and the same mirror's model cards of "
    "tacos4me/Step-3.5-Flash-NVFP4 and nameistoken/Step-3.5-Flash-Quark-W8A8-INT8 (45 layers + MTP 45-47, 288 "
    "experts top 8, moe_intermediate 1280, dense intermediate 11264, 64 heads / 8 KV groups / head_dim 128, SWA "
    "window 512 at 3:1, vocab 128896, 262144 context with llama3-style RoPE scaling)",
]


def text_config(**over) -> dict:
    """The text model's config.json keys as released, shrunk (see the module docstring)."""
    cfg = {
        "architectures": ["Step3p5ForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_step3p5.Step3p5Config",
            "AutoModelForCausalLM": "modeling_step3p5.Step3p5ForCausalLM",
        },
        "model_type": "step3p5",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_attention_groups": 2,
        "num_hidden_layers": N_TRUNK,
        "head_dim": 128,
        "max_seq_len": 262144,
        "max_position_embeddings": 262144,
        "vocab_size": 128896,
        "rms_norm_eps": 1e-05,
        "torch_dtype": "bfloat16",
        "use_moe": True,
        "moe_num_experts": 4,
        "moe_top_k": 2,
        "moe_intermediate_size": 256,
        "share_expert_dim": 256,
        "moe_layer_offset": 0,
        "moe_every_n_layer": 1,
        "moe_layers_enum": ",".join(str(i) for i in range(1, N_TRUNK)),
        "moe_router_activation": "sigmoid",
        "moe_router_scaling_factor": 3.0,
        "use_moe_router_bias": True,
        "need_fp32_gate": True,
        "norm_expert_weight": True,
        "att_impl_type": "GQA",
        "use_head_wise_attn_gate": True,
        "use_qk_norm": True,
        "zero_centered": True,
        "sliding_window": 512,
        "layer_types": LAYER_TYPES,
        "attention_other_setting": {
            "attention_type": "sliding_attention",
            "num_attention_heads": 6,
            "num_attention_groups": 2,
            "head_dim": 128,
            "true_head_dim": 128,
        },
        "use_rope_layers": [],
        "rope_theta": [5000000.0 if t == "full_attention" else 10000.0 for t in LAYER_TYPES],
        "partial_rotary_factors": [0.5 if t == "full_attention" else 1.0 for t in LAYER_TYPES],
        **RELEASE_ROPE_SCALING,
        # the release clamps its last two MoE layers' experts (7.0) and the last one's shared expert (16.0)
        "swiglu_limits": [0.0] * (N_TRUNK - 2) + [7.0, 7.0] + [0.0] * N_MTP,
        "swiglu_limits_shared": [0.0] * (N_TRUNK - 1) + [16.0] + [0.0] * N_MTP,
        "num_nextn_predict_layers": N_MTP,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": [1, 2, 128007],
    }
    cfg.update(over)
    return cfg


def text_tensors(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of the language model, named and shaped as the releases store them (bf16 form)."""
    h, vocab, d = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    n = cfg["num_hidden_layers"]
    moe = {int(i) for i in cfg["moe_layers_enum"].split(",")}
    other = cfg["attention_other_setting"]
    out = trunk(vocab, h)
    for L in range(n + cfg["num_nextn_predict_layers"]):
        p = f"model.layers.{L}."
        swa = cfg["layer_types"][L] == other["attention_type"]
        nh, nkv = (
            (other["num_attention_heads"], other["num_attention_groups"])
            if swa
            else (cfg["num_attention_heads"], cfg["num_attention_groups"])
        )
        out |= block_norms(p, h) | attention(p + "self_attn.", h, nh, nkv, d, qk_norm=True)
        out[p + "self_attn.g_proj.weight"] = (nh, h)
        if L in moe:
            ne, ff, sff = cfg["moe_num_experts"], cfg["moe_intermediate_size"], cfg["share_expert_dim"]
            out |= {
                p + "moe.gate.weight": (ne, h),
                p + "moe.router_bias": (ne,),
                p + "moe.gate_proj.weight": (ne, ff, h),
                p + "moe.up_proj.weight": (ne, ff, h),
                p + "moe.down_proj.weight": (ne, h, ff),
            } | mlp(p + "share_expert.", sff, h)
        else:
            out |= mlp(p + "mlp.", cfg["intermediate_size"], h)
        if L >= n:
            out |= nextn(p, h, "transformer.shared_head.norm") | {
                p + "transformer.shared_head.output.weight": (vocab, h)
            }
    return out


def fp8_routed_experts(folder: Path, block: int = 128) -> None:
    """The -FP8 release form: every stacked routed-expert tensor (``moe.{gate,up,down}_proj.weight``) e4m3 with a
    ``weight_scale_inv`` of 128x128 tiles per expert (w = q * s); everything else stays as stored."""
    from safetensors.torch import load_file, save_file

    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(folder / shard))
        for name in [
            n for n in tensors if n.endswith((".moe.gate_proj.weight", ".moe.up_proj.weight", ".moe.down_proj.weight"))
        ]:
            w = tensors[name].float()
            e, r, c = w.shape
            tiles = w.reshape(e, r // block, block, c // block, block)
            s = tiles.abs().amax(dim=(2, 4)).clamp(min=1e-12) / fp8_max  # [E, r/128, c/128]
            q = (tiles / s[:, :, None, :, None]).reshape(e, r, c)
            tensors[name] = q.to(torch.float8_e4m3fn)
            tensors[name + "_scale_inv"] = s
            index["weight_map"][name + "_scale_inv"] = shard
        save_file(tensors, str(folder / shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index, indent=2))
    set_config(
        folder,
        quantization_config={
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [block, block],
        },
    )
