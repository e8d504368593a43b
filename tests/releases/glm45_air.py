"""GLM-4.5-Air (zai-org/GLM-4.5-Air, bf16; zai-org/GLM-4.5-Air-FP8) as released: Glm4MoeForCausalLM, 46 layers +
1 MTP layer stored as model.layers.46.

Shrunk: hidden 4096 -> 256, layers 46 -> 2 (+1 MTP), experts 128 -> 4, heads 96/8 -> 4/2 (head_dim 128 -> 64),
intermediate 10944 -> 512, moe_intermediate 1408 -> 256. Every other key as released.
"""

from . import fp8_block_scaled
from ._glm4moe import tensors  # noqa: F401  (the manifest's tensors: GLM-4.5's layout)

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

