"""Qwen3-Next (Qwen/Qwen3-Next-80B-A3B-Instruct, bf16; Qwen/Qwen3-Next-80B-A3B-Instruct-FP8) as released:
Qwen3NextForCausalLM, 48 layers (3 Gated DeltaNet with fused ``in_proj_qkvz`` / ``in_proj_ba`` + 1 gated
attention, repeated), an MoE block in every layer, the MTP head under ``mtp.`` with one MoE layer. Saved by
transformers 4.57: no ``layer_types`` (kinds follow ``full_attention_interval``), no ``mtp_num_hidden_layers``,
``rope_scaling: null`` beside ``rope_theta`` and ``partial_rotary_factor``.

Forms: ``bf16``; ``fp8`` (128x128 block-scaled, as the -FP8 release); ``tf5`` the config as transformers 5 saves it
(``layer_types``, ``rope_parameters``).

Shrunk: hidden 2048 -> 256, layers 48 -> 4, heads 16/2 -> 4/2 (head_dim 256 -> 64), intermediate 5120 -> 512,
linear-attention heads 16/32 -> 2/4 (dims 128 -> 64), experts 512 -> 4 (10 -> 2 per token), moe/shared
intermediate 512 -> 256. Every other key as released.
"""

from . import transformers_saved, variant
from ._qwen35 import SHARED_TEXT, fp8, tensors  # noqa: F401  (the manifest's tensors)
from .qwen35 import SPECIALS  # noqa: F401  (the Qwen tokenizer's)

RELEASE = "Qwen/Qwen3-Next-80B-A3B-Instruct"
SOURCES = [
    "https://huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct/blob/main/config.json (keys and values)",
    "https://huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct/blob/main/model.safetensors.index.json (in_proj_qkvz,"
    " in_proj_ba, per-expert tensors, mtp.*)",
    "https://huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct-FP8/blob/main/config.json (quantization_config)",
    "transformers src/transformers/models/qwen3_next/modeling_qwen3_next.py (per-layer names)",
    "vllm/model_executor/models/qwen3_next_mtp.py (mtp.fc / pre_fc_norm_* / norm / layers.0.*)",
    "llama.cpp conversion/qwen.py Qwen3NextModel (MTP layers counted from mtp.layers.*: the config has no count)",
]
CONFIG = variant(
    SHARED_TEXT,
    {
        "architectures": ["Qwen3NextForCausalLM"],
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151645,
        "initializer_range": 0.02,
        "intermediate_size": 512,
        "mlp_only_layers": [],
        "model_type": "qwen3_next",
        "moe_intermediate_size": 256,
        "norm_topk_prob": True,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "output_router_logits": False,
        "partial_rotary_factor": 0.25,
        "rope_scaling": None,
        "rope_theta": 10000000,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 256,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.0.dev0",
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
)
FORMS = {"bf16": None, "fp8": fp8, "tf5": transformers_saved}
DRAFTS = True
