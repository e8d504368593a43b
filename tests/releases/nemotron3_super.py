"""NVIDIA Nemotron 3 Super (nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16, and its -FP8) as released:
NemotronHForCausalLM with LatentMoE (``moe_latent_size``: every MoE mixer projects the hidden state down with
``fc1_latent_proj`` before the routed experts and back up with ``fc2_latent_proj`` after them; the shared expert
and the router work on the full hidden state) and one MTP head stored apart as ``mtp.layers.0`` (attention, with
``enorm``/``hnorm``/``eh_proj``) and ``mtp.layers.1`` (LatentMoE, with ``final_layernorm``).

Nemotron 3 Nano (NVIDIA-Nemotron-3-Nano-30B-A3B) has no MTP head (no ``num_nextn_predict_layers``) and no latent
projections, so it has no manifest here. Nemotron 3 Ultra is not published.

Shrunk: hidden 4096 -> 512, layers 88 ("MEMEMEM*E...") -> 4 ("ME*E"), experts 512 -> 4 (22 -> 2 per token),
moe_latent 1024 -> 256, moe_intermediate 2688 -> 256, shared expert 5376 -> 512, attention heads 32 -> 4 (kv 2,
head_dim 128 as released), Mamba heads 128 -> 8 (head_dim 64 as released), n_groups 8 -> 2. Every other key as
released (the BF16 release's config.json is the NVFP4 one's without quantization_config).

The FP8 form is ModelOpt's per-tensor FP8 (``quant_method: modelopt``, ``quant_algo: FP8``): each quantized
Linear stores an e4m3 ``weight`` with a scalar float32 ``weight_scale`` and ``input_scale`` (the Mamba layer 0 of
the FP8 release: in_proj and out_proj, 4 scales), attention k/v projections their FP8 KV-cache ``k_scale`` /
``v_scale``; embeddings, lm_head, routers, norms, convolutions and the MTP layers (which the NVFP4 release's
quantized_layers map leaves out too) stay bf16.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

RELEASE = "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16"
SOURCES = [
    "https://huggingface.co/nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-NVFP4/blob/main/config.json (every key and "
    "value; mirrored verbatim in a C++ test fixture, transcribed at revision 4f0cf9da)",
    "https://huggingface.co/nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16/blob/main/config.json (Nano: no "
    "num_nextn_predict_layers, no moe_latent_size: no MTP head)",
    "transformers src/transformers/models/nemotron_h/modeling_nemotron_h.py (NemotronHMoE: fc1_latent_proj "
    "[latent, hidden], fc2_latent_proj [hidden, latent], experts on the latent width; mixer tensor names)",
    "vllm/model_executor/models/nemotron_h_mtp.py (mtp.layers.{0,1}: enorm/hnorm/eh_proj on the first, "
    "final_layernorm on the last, the MoE sub-layer a full NemotronHMoE: latent projections included)",
    "llama.cpp conversion/nemotron.py + gguf-py tensor_mapping.py (fc1/fc2_latent_proj -> ffn_latent_down/up, "
    "nemotron_h_moe.moe_latent_size) and conversion/base.py (modelopt: weight_scale, input_scale, k/v_scale)",
    "https://huggingface.co/nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-FP8 (ModelOpt FP8: per-tensor weight_scale "
    "and input_scale, as read by a ModelOpt scale-remap probe of its layer 0)",
]
CONFIG = {
    "architectures": ["NemotronHForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_nemotron_h.NemotronHConfig",
        "AutoModelForCausalLM": "modeling_nemotron_h.NemotronHForCausalLM",
    },
    "bos_token_id": 1,
    "chunk_size": 128,
    "conv_kernel": 4,
    "dtype": "bfloat16",
    "eos_token_id": 2,
    "expand": 2,
    "head_dim": 128,
    "hidden_dropout": 0.0,
    "hidden_size": 512,
    "hybrid_override_pattern": "ME*E",
    "initializer_range": 0.02,
    "intermediate_size": 256,
    "layer_norm_epsilon": 1e-05,
    "mamba_head_dim": 64,
    "mamba_hidden_act": "silu",
    "mamba_num_heads": 8,
    "mamba_proj_bias": False,
    "mamba_ssm_cache_dtype": "float32",
    "max_position_embeddings": 262144,
    "mlp_bias": False,
    "mlp_hidden_act": "relu2",
    "model_type": "nemotron_h",
    "moe_intermediate_size": 256,
    "moe_latent_size": 256,
    "moe_shared_expert_intermediate_size": 512,
    "moe_shared_expert_overlap": False,
    "mtp_hybrid_override_pattern": "*E",
    "n_group": 1,
    "n_groups": 2,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "norm_eps": 1e-05,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "num_logits_to_keep": 1,
    "num_nextn_predict_layers": 1,
    "pad_token_id": 0,
    "partial_rotary_factor": 1.0,
    "rescale_prenorm_residual": True,
    "residual_in_fp32": False,
    "rope_theta": 10000,
    "routed_scaling_factor": 5.0,
    "sliding_window": None,
    "ssm_state_size": 128,
    "tie_word_embeddings": False,
    "time_step_floor": 0.0001,
    "time_step_max": 0.1,
    "time_step_min": 0.001,
    "topk_group": 1,
    "transformers_version": "4.57.6",
    "use_bias": False,
    "use_cache": True,
    "use_conv_bias": True,
    "use_mamba_kernels": True,
    "vocab_size": 131072,
}
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
DRAFTS = True


def _mixer(p: str, kind: str, cfg: dict) -> dict[str, tuple[int, ...]]:
    h = cfg["hidden_size"]
    if kind == "M":
        nh, groups, state = cfg["mamba_num_heads"], cfg["n_groups"], cfg["ssm_state_size"]
        d_inner = nh * cfg["mamba_head_dim"]
        conv = d_inner + 2 * groups * state
        return {
            p + "in_proj.weight": (2 * d_inner + 2 * groups * state + nh, h),
            p + "conv1d.weight": (conv, 1, cfg["conv_kernel"]),
            p + "conv1d.bias": (conv,),
            p + "dt_bias": (nh,),
            p + "A_log": (nh,),
            p + "D": (nh,),
            p + "norm.weight": (d_inner,),
            p + "out_proj.weight": (h, d_inner),
        }
    if kind == "*":
        nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        return {
            p + "q_proj.weight": (nh * d, h),
            p + "k_proj.weight": (nkv * d, h),
            p + "v_proj.weight": (nkv * d, h),
            p + "o_proj.weight": (h, nh * d),
        }
    ne, ff, latent = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["moe_latent_size"]
    sff = cfg["moe_shared_expert_intermediate_size"]
    out = {
        p + "gate.weight": (ne, h),
        p + "gate.e_score_correction_bias": (ne,),
        p + "fc1_latent_proj.weight": (latent, h),
        p + "fc2_latent_proj.weight": (h, latent),
        p + "shared_experts.up_proj.weight": (sff, h),
        p + "shared_experts.down_proj.weight": (h, sff),
    }
    for e in range(ne):  # the routed experts work on the latent width
        out |= {f"{p}experts.{e}.up_proj.weight": (ff, latent), f"{p}experts.{e}.down_proj.weight": (latent, ff)}
    return out


def tensors(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    out = {"backbone.embeddings.weight": (v, h), "backbone.norm_f.weight": (h,), "lm_head.weight": (v, h)}
    for i, kind in enumerate(cfg["hybrid_override_pattern"]):
        out |= {f"backbone.layers.{i}.norm.weight": (h,)} | _mixer(f"backbone.layers.{i}.mixer.", kind, cfg)
    for j, kind in enumerate(cfg["mtp_hybrid_override_pattern"]):
        out |= {f"mtp.layers.{j}.norm.weight": (h,)} | _mixer(f"mtp.layers.{j}.mixer.", kind, cfg)
    out |= {
        "mtp.layers.0.enorm.weight": (h,),
        "mtp.layers.0.hnorm.weight": (h,),
        "mtp.layers.0.eh_proj.weight": (h, 2 * h),
        "mtp.layers.1.final_layernorm.weight": (h,),
    }
    return out


_FP8_LINEARS = (
    "in_proj.weight",
    "out_proj.weight",
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "o_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
    "fc1_latent_proj.weight",
    "fc2_latent_proj.weight",
)


def modelopt_fp8(folder: Path) -> None:
    """The -FP8 release's encoding: ModelOpt per-tensor e4m3 for the trunk's Linear layers (scalar float32
    ``weight_scale`` = amax / 448 and ``input_scale``), FP8 KV-cache scales on attention; the rest bf16."""
    from safetensors.torch import load_file, save_file

    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    gen = torch.Generator().manual_seed(1)
    for shard in sorted(set(index["weight_map"].values())):
        out = {}
        for name, w in load_file(str(folder / shard)).items():
            if not (name.startswith("backbone.layers.") and name.endswith(_FP8_LINEARS)):
                out[name] = w
                continue
            base = name[: -len(".weight")]
            s = w.float().abs().max().clamp(min=1e-12) / fp8_max
            out[name] = (w.float() / s).to(torch.float8_e4m3fn)
            extra = {base + ".weight_scale": s, base + ".input_scale": 0.01 + torch.rand((), generator=gen)}
            if name.endswith(("k_proj.weight", "v_proj.weight")):
                extra[base + "." + name.rsplit(".", 2)[-2][0] + "_scale"] = torch.rand((), generator=gen) + 0.5
            out |= {k: t.to(torch.float32).reshape(()) for k, t in extra.items()}
            index["weight_map"] |= dict.fromkeys(extra, shard)
        save_file(out, str(folder / shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index, indent=2))
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = {
        "quant_method": "modelopt",
        "quant_algo": "FP8",
        "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"},
        "ignore": ["lm_head", "backbone.embeddings", "mtp*", "*.mixer.gate", "*.conv1d"],
        "producer": {"name": "modelopt", "version": "0.43.0"},
    }
    cfg_path.write_text(json.dumps(cfg, indent=2))


FORMS = {"bf16": None, "fp8": modelopt_fp8}
