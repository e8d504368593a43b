"""GLM-4.5-Air (zai-org/GLM-4.5-Air, bf16; zai-org/GLM-4.5-Air-FP8) as released: Glm4MoeForCausalLM, 46 layers +
1 MTP layer stored as model.layers.46.

Shrunk: hidden 4096 -> 256, layers 46 -> 2 (+1 MTP), experts 128 -> 4, heads 96/8 -> 4/2 (head_dim 128 -> 64),
intermediate 10944 -> 512, moe_intermediate 1408 -> 256. Every other key as released.
"""

from . import fp8_block_scaled

RELEASE = "zai-org/GLM-4.5-Air"
SOURCES = [
    "https://huggingface.co/zai-org/GLM-4.5-Air/blob/main/config.json (keys and values)",
    "https://huggingface.co/zai-org/GLM-4.5-Air/blob/main/model.safetensors.index.json (tensor names, layer 46)",
    "transformers src/transformers/models/glm4_moe/modeling_glm4_moe.py (per-layer names, attention_bias)",
    "vllm/model_executor/models/glm4_moe_mtp.py (the MTP layer's eh_proj/enorm/hnorm/shared_head names)",
]
CONFIG = {
    "architectures": ["Glm4MoeForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "pad_token_id": 151329,
    "eos_token_id": [151329, 151336, 151338],
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 256,
    "partial_rotary_factor": 0.5,
    "initializer_range": 0.02,
    "intermediate_size": 512,
    "max_position_embeddings": 131072,
    "model_type": "glm4_moe",
    "moe_intermediate_size": 256,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "n_group": 1,
    "topk_group": 1,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "routed_scaling_factor": 1.0,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.54.0",
    "use_cache": True,
    "use_qk_norm": False,
    "vocab_size": 151552,
}
FORMS = {"bf16": None, "fp8": lambda folder: fp8_block_scaled(folder)}
DRAFTS = True


def tensors(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, v, d = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    nh, nkv, ff, mff = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"], \
        cfg["moe_intermediate_size"]
    n, ne = cfg["num_hidden_layers"], cfg["n_routed_experts"]
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for L in range(n + cfg["num_nextn_predict_layers"]):
        p = f"model.layers.{L}."
        out |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (nh * d, h), p + "self_attn.q_proj.bias": (nh * d,),
                p + "self_attn.k_proj.weight": (nkv * d, h), p + "self_attn.k_proj.bias": (nkv * d,),
                p + "self_attn.v_proj.weight": (nkv * d, h), p + "self_attn.v_proj.bias": (nkv * d,),
                p + "self_attn.o_proj.weight": (h, nh * d)}
        if L < cfg["first_k_dense_replace"]:
            out |= {p + "mlp.gate_proj.weight": (ff, h), p + "mlp.up_proj.weight": (ff, h),
                    p + "mlp.down_proj.weight": (h, ff)}
        else:
            out |= {p + "mlp.gate.weight": (ne, h), p + "mlp.gate.e_score_correction_bias": (ne,)}
            for e in range(ne):
                q = f"{p}mlp.experts.{e}."
                out |= {q + "gate_proj.weight": (mff, h), q + "up_proj.weight": (mff, h), q + "down_proj.weight": (h, mff)}
            sff = mff * cfg["n_shared_experts"]
            out |= {p + "mlp.shared_experts.gate_proj.weight": (sff, h), p + "mlp.shared_experts.up_proj.weight": (sff, h),
                    p + "mlp.shared_experts.down_proj.weight": (h, sff)}
        if L >= n:  # the MTP layer: NextN tensors beside a full MoE block
            out |= {p + "eh_proj.weight": (h, 2 * h), p + "enorm.weight": (h,), p + "hnorm.weight": (h,),
                    p + "embed_tokens.weight": (v, h), p + "shared_head.head.weight": (v, h),
                    p + "shared_head.norm.weight": (h,)}
    return out
