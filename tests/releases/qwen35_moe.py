"""Qwen3.5 MoE (Qwen/Qwen3.5-397B-A17B, bf16; Qwen/Qwen3.5-397B-A17B-FP8) as released:
Qwen3_5MoeForConditionalGeneration, Qwen3.5's hybrid text model (see qwen35.py) with an MoE block in every layer
(512 experts, 10 per token, one shared expert with a sigmoid gate), experts stored one by one, the MTP layer an MoE
block too; a vision tower beside it.

Forms: ``bf16``; ``fp8`` (128x128 block-scaled, as the -FP8 release); ``tf5`` the config as transformers 5 saves it.

Shrunk: hidden 4096 -> 256, layers 60 -> 4, heads 32/2 -> 4/2 (head_dim 256 -> 64), linear-attention heads
16/64 -> 2/4 (dims 128 -> 64), experts 512 -> 4 (10 -> 2 per token), moe/shared intermediate 1024 -> 256, the
vision tower as qwen35.py. Every other key as released.
"""

from . import transformers_saved, variant
from ._qwen35 import fp8, tensors  # noqa: F401  (the manifest's tensors)
from .qwen35 import CONFIG as _QWEN35  # noqa: F401  (SPECIALS: the Qwen tokenizer's)
from .qwen35 import VISION

RELEASE = "Qwen/Qwen3.5-397B-A17B"
SOURCES = [
    "https://huggingface.co/Qwen/Qwen3.5-397B-A17B/blob/main/config.json (keys and values)",
    "https://huggingface.co/Qwen/Qwen3.5-397B-A17B/blob/main/model.safetensors.index.json (per-expert tensors,"
    " mtp.*, model.visual.*)",
    "https://huggingface.co/Qwen/Qwen3.5-397B-A17B-FP8/blob/main/config.json (quantization_config)",
    "transformers src/transformers/models/qwen3_5_moe/modeling_qwen3_5_moe.py; conversion_mapping.py (qwen3_5_moe_text"
    " = qwen2_moe's per-expert -> fused mapping: the files store experts one by one)",
    "vllm/model_executor/models/qwen3_5_mtp.py (the MTP layer's MoE block, per-expert or fused)",
    "llama.cpp conversion/qwen.py Qwen3_5MoeTextModel",
]
# Qwen3.5's config.json (qwen35.py) with an MoE block in every layer: the MoE keys for intermediate_size, no
# text-level tie_word_embeddings, the MoE model types
CONFIG = variant(
    _QWEN35,
    {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": variant(
            _QWEN35["text_config"],
            {
                "model_type": "qwen3_5_moe_text",
                "moe_intermediate_size": 256,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "router_aux_loss_coef": 0.001,
                "shared_expert_intermediate_size": 256,
            },
            drop=("intermediate_size", "tie_word_embeddings"),
        ),
        "vision_config": {**VISION, "model_type": "qwen3_5_moe"},
    },
)
FORMS = {"bf16": None, "fp8": fp8, "tf5": transformers_saved}
DRAFTS = True
