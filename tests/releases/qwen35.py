"""Qwen3.5 dense (Qwen/Qwen3.5-27B, bf16; Qwen/Qwen3.5-27B-FP8) as released: Qwen3_5ForConditionalGeneration, the
text model under ``model.language_model.`` (64 layers: 3 Gated DeltaNet + 1 gated attention, repeated), a vision
tower under ``model.visual.``, the MTP head under ``mtp.`` (one layer). The text config nests under
``text_config`` with ``rope_parameters`` (MRoPE sections, partial rotary factor) and ``layer_types``.

Forms: ``bf16``; ``fp8`` as the -FP8 release ships it (128x128 block-scaled e4m3, the vision tower, routers and
small linear-attention projections in ``modules_to_not_convert``); ``tf5`` the config as transformers 5 saves it.

Shrunk: hidden 5120 -> 256, layers 64 -> 4, heads 24/4 -> 4/2 (head_dim 256 -> 64), intermediate 17408 -> 512,
linear-attention heads 16/48 -> 2/4 (dims 128 -> 64), mrope_section [11, 11, 10] -> [3, 3, 2] (a quarter of
head_dim rotates); vision depth 27 -> 1, hidden 1152 -> 64, intermediate 4304 -> 128, heads 16 -> 2,
position embeddings 2304 -> 16, out_hidden 5120 -> 256. Every other key as released.
"""

from . import transformers_saved, variant
from ._qwen35 import SHARED_TEXT, fp8, tensors  # noqa: F401  (the manifest's tensors)

RELEASE = "Qwen/Qwen3.5-27B"
SOURCES = [
    "https://huggingface.co/Qwen/Qwen3.5-27B/blob/main/config.json (keys and values)",
    "https://huggingface.co/Qwen/Qwen3.5-27B/blob/main/model.safetensors.index.json (model.language_model.*, mtp.*,"
    " model.visual.*)",
    "https://huggingface.co/Qwen/Qwen3.5-27B-FP8/blob/main/config.json (quantization_config)",
    "transformers src/transformers/models/qwen3_5/modeling_qwen3_5.py (per-layer names, Qwen3_5VisionModel)",
    "vllm/model_executor/models/qwen3_5_mtp.py (mtp.fc / pre_fc_norm_* / norm / layers.*)",
    "llama.cpp conversion/qwen.py Qwen3_5TextModel (_QwenMtpMixin, _Qwen35MRopeMixin)",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]
VISION = {
    "deepstack_visual_indexes": [],
    "depth": 1,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 64,
    "in_channels": 3,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "model_type": "qwen3_5",
    "num_heads": 2,
    "num_position_embeddings": 16,
    "out_hidden_size": 256,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
ROPE = {
    "mrope_interleaved": True,
    "mrope_section": [3, 3, 2],
    "rope_type": "default",
    "rope_theta": 10000000,
    "partial_rotary_factor": 0.25,
}
CONFIG = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "image_token_id": 248056,
    "model_type": "qwen3_5",
    "text_config": {
        **variant(
            SHARED_TEXT,
            {
                "attn_output_gate": True,
                "dtype": "bfloat16",
                "eos_token_id": 248044,
                "initializer_range": 0.02,
                "intermediate_size": 512,
                "layer_types": LAYER_TYPES,
                "mlp_only_layers": [],
                "model_type": "qwen3_5_text",
                "mtp_num_hidden_layers": 1,
                "mtp_use_dedicated_embeddings": False,
                "tie_word_embeddings": False,
                "vocab_size": 248320,
            },
        ),
        "mamba_ssm_dtype": "float32",
        "rope_parameters": ROPE,
    },  # these two last, as released
    "tie_word_embeddings": False,
    "transformers_version": "4.57.0.dev0",
    "video_token_id": 248057,
    "vision_config": VISION,
    "vision_end_token_id": 248054,
    "vision_start_token_id": 248053,
}
FORMS = {"bf16": None, "fp8": fp8, "tf5": transformers_saved}
DRAFTS = True
