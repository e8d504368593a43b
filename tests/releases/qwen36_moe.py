"""Qwen3.6 MoE (Qwen/Qwen3.6-35B-A3B, bf16; Qwen/Qwen3.6-35B-A3B-FP8) as released: Qwen3.5-MoE's architecture and
model type (see qwen35_moe.py), its config.json written by transformers 5 (``dtype`` at both levels, ``bos`` /
``eos`` / ``pad_token_id`` and ``output_router_logits`` in the text config, no ``initializer_range`` /
``mlp_only_layers``), 40 layers, 256 experts (8 per token).

Forms: ``bf16``; ``fp8`` (128x128 block-scaled). Shrunk as qwen35_moe.py (hidden 2048 -> 256, heads 16/2 -> 4/2,
linear-attention heads 16/32 -> 2/4, moe/shared intermediate 512 -> 256, vision out_hidden 2048 -> 256).
"""

from . import variant
from ._qwen35 import SHARED_TEXT, fp8, tensors  # noqa: F401  (the manifest's tensors)
from .qwen35 import LAYER_TYPES, ROPE, SPECIALS, VISION  # noqa: F401  (SPECIALS: the Qwen tokenizer's)

RELEASE = "Qwen/Qwen3.6-35B-A3B"
SOURCES = [
    "https://huggingface.co/Qwen/Qwen3.6-35B-A3B/blob/main/config.json (keys and values; as quoted in full, text and"
    " vision config, by third-party loaders' fixtures of the release)",
    "https://huggingface.co/Qwen/Qwen3.6-35B-A3B-FP8/blob/main/config.json (quantization_config)",
    "transformers docs/source/en/model_doc/qwen3_5_moe.md (Qwen3.6 shares Qwen3.5-MoE's model_type and classes)",
    "vllm/model_executor/models/qwen3_5_mtp.py; llama.cpp conversion/qwen.py Qwen3_5MoeTextModel",
]
CONFIG = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "dtype": "bfloat16",
    "image_token_id": 248056,
    "model_type": "qwen3_5_moe",
    "text_config": variant(
        SHARED_TEXT,
        {
            "attn_output_gate": True,
            "bos_token_id": 248044,
            "dtype": "bfloat16",
            "eos_token_id": 248044,
            "layer_types": LAYER_TYPES,
            "mamba_ssm_dtype": "float32",
            "model_type": "qwen3_5_moe_text",
            "moe_intermediate_size": 256,
            "mtp_num_hidden_layers": 1,
            "mtp_use_dedicated_embeddings": False,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "output_router_logits": False,
            "pad_token_id": None,
            "partial_rotary_factor": 0.25,
            "rope_parameters": ROPE,
            "shared_expert_intermediate_size": 256,
            "tie_word_embeddings": False,
            "vocab_size": 248320,
        },
    ),
    "tie_word_embeddings": False,
    "video_token_id": 248057,
    "vision_config": {
        k: v
        for k, v in {**VISION, "dtype": "bfloat16", "model_type": "qwen3_5_moe_vision"}.items()
        if k != "initializer_range"
    },
    "vision_end_token_id": 248054,
    "vision_start_token_id": 248053,
}
FORMS = {"bf16": None, "fp8": fp8}
DRAFTS = True
