"""GLM-4.5 (zai-org/GLM-4.5, bf16; zai-org/GLM-4.5-FP8) as released: Glm4MoeForCausalLM, 92 layers + 1 MTP layer
stored as model.layers.92, q/k RMSNorms (``use_qk_norm``), saved by transformers 4.54 (``rope_scaling: null`` beside
``rope_theta``; ``partial_rotary_factor`` and ``torch_dtype`` at the top level).

Forms: ``bf16``; ``fp8`` as GLM-4.5-FP8 ships it (llm-compressor's compressed-tensors, FP8 weights with a per-channel
``weight_scale``); ``tf5`` the same config saved by transformers 5 (``rope_parameters``, ``dtype``: what a
fine-tune written by ``save_pretrained`` holds).

Shrunk: hidden 5120 -> 256, layers 92 -> 2 (+1 MTP), first_k_dense_replace 3 -> 1, experts 160 -> 4 (8 -> 2 per
token), heads 96/8 -> 4/2 (head_dim 128 -> 64), intermediate 12288 -> 512, moe_intermediate 1536 -> 256. Every
other key as released.
"""

from . import fp8_per_channel, transformers_saved
from ._glm4moe import tensors  # noqa: F401  (the manifest's tensors)

RELEASE = "zai-org/GLM-4.5"
SOURCES = [
    "https://huggingface.co/zai-org/GLM-4.5/blob/main/config.json (keys and values)",
    "https://huggingface.co/zai-org/GLM-4.5/blob/main/model.safetensors.index.json (tensor names, layer 92)",
    "https://huggingface.co/zai-org/GLM-4.5-FP8/blob/main/config.json (compressed-tensors quantization_config)",
    "transformers src/transformers/models/glm4_moe/modeling_glm4_moe.py (per-layer names, q_norm/k_norm)",
    "vllm/model_executor/models/glm4_moe_mtp.py (the MTP layer's eh_proj/enorm/hnorm/shared_head names)",
    "llama.cpp conversion/glm.py Glm4MoeModel; conversion/base.py (compressed-tensors 'channel' dequantization)",
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
    "routed_scaling_factor": 2.5,
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
    "use_qk_norm": True,
    "vocab_size": 151552,
}
FORMS = {"bf16": None, "fp8": fp8_per_channel, "tf5": transformers_saved}
DRAFTS = True
