"""Hy3 (tencent/Hy3) as released: HYV3ForCausalLM, 80 layers + 1 MTP layer stored as model.layers.80, GQA with q/k
RMSNorms, layer 0 a dense MLP (``first_k_dense_replace: 1``), the others MoE: a sigmoid router ``mlp.router.gate``
with a selection bias ``mlp.expert_bias``, per-expert projections (``expert_hidden_dim`` wide) and one shared
expert ``mlp.shared_mlp.*``. The MTP layer: ``eh_proj`` / ``enorm`` / ``hnorm``, a full MoE block and
``final_layernorm`` (before the shared lm_head); no embedding or lm_head of its own.

Forms: ``bf16``; ``tf5`` the config as transformers 5 saves it (``mlp_layer_types`` derived); ``rope_theta`` RoPE as
4.x-style
configs spell it (a top-level ``rope_theta``, which vLLM's HYV3Config reads too); ``no_dense_keys`` a
config with neither ``first_k_dense_replace`` nor ``mlp_layer_types`` (transformers' HYV3Config then makes layer 0
dense, and so must a converter).

Shrunk: hidden 4096 -> 256, layers 80 -> 2 (+1 MTP), heads 64/8 -> 4/2 (head_dim 128 -> 64), intermediate 13312 ->
512, experts 192 -> 4 (8 -> 2 per token), expert width 1536 -> 256. Every other key as released.
"""

import json
from pathlib import Path

from . import attention, block_norms, experts, mlp, nextn, transformers_saved, trunk, without

RELEASE = "tencent/Hy3"
SOURCES = [
    "https://huggingface.co/tencent/Hy3/blob/main/config.json (keys and values)",
    "https://huggingface.co/tencent/Hy3/blob/main/model.safetensors.index.json (mlp.router.gate, mlp.expert_bias,"
    " mlp.shared_mlp.*, layer 80's eh_proj/enorm/hnorm/final_layernorm)",
    "vllm/transformers_utils/configs/hy_v3.py (every config key of the release; first_k_dense_replace required by"
    " vllm/model_executor/models/hy_v3.py)",
    "vllm/model_executor/models/hy_v3_mtp.py (the MTP layer's names)",
    "transformers src/transformers/models/hy_v3/configuration_hy_v3.py (mlp_layer_types default: layer 0 dense);"
    " conversion_mapping.py (hy_v3's renames of router.gate / expert_bias / shared_mlp)",
    "llama.cpp conversion/hunyuan.py HYV3Model (final_layernorm -> nextn.shared_head_norm)",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CONFIG = {
    "architectures": ["HYV3ForCausalLM"],
    "bos_token_id": 120000,
    "enable_attention_fp32_softmax": False,
    "enable_lm_head_fp32": True,
    "enable_moe_fp32_combine": False,
    "eos_token_id": [120025],
    "expert_hidden_dim": 256,
    "first_k_dense_replace": 1,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 256,
    "initializer_range": 0.006,
    "intermediate_size": 512,
    "max_position_embeddings": 262144,
    "model_type": "hy_v3",
    "moe_intermediate_size": 256,
    "moe_router_enable_expert_bias": True,
    "moe_router_use_sigmoid": True,
    "num_attention_heads": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "num_nextn_predict_layers": 1,
    "num_shared_experts": 1,
    "output_router_logits": False,
    "pad_token_id": 120002,
    "qk_norm": True,
    "rms_norm_eps": 1e-05,
    "rope_parameters": {"rope_theta": 11158840.0, "rope_type": "default"},
    "route_norm": True,
    "router_scaling_factor": 2.826,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "5.6.0",
    "use_cache": True,
    "use_grouped_mm": False,
    "vocab_size": 120832,
}


def _rope_theta(folder: Path) -> None:
    """RoPE spelled as transformers 4.x configs spell it: a top-level ``rope_theta``, no ``rope_parameters``."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
    path.write_text(json.dumps(cfg, indent=2))


FORMS = {
    "bf16": None,
    "tf5": transformers_saved,
    "rope_theta": _rope_theta,
    "no_dense_keys": without("first_k_dense_replace", "mlp_layer_types"),
}
DRAFTS = True


def tensors(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, v, d = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    nh, nkv, ff, eff = (
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["intermediate_size"],
        cfg["expert_hidden_dim"],
    )
    n, ne = cfg["num_hidden_layers"], cfg["num_experts"]
    out = trunk(v, h)
    for L in range(n + cfg["num_nextn_predict_layers"]):
        p = f"model.layers.{L}."
        out |= block_norms(p, h) | attention(p + "self_attn.", h, nh, nkv, d, qk_norm=True)
        if L < cfg.get("first_k_dense_replace", 1):
            out |= mlp(p + "mlp.", ff, h)
        else:
            out |= {p + "mlp.router.gate.weight": (ne, h), p + "mlp.expert_bias": (ne,)}
            out |= experts(p + "mlp.experts.", ne, eff, h)
            out |= mlp(p + "mlp.shared_mlp.", eff * cfg["num_shared_experts"], h)
        if L >= n:
            out |= nextn(p, h, "final_layernorm")
    return out
