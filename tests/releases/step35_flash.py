"""Step-3.5-Flash (stepfun-ai/Step-3.5-Flash, bf16; stepfun-ai/Step-3.5-Flash-FP8) as released:
Step3p5ForCausalLM (model_type step3p5, remote code), 45 layers + 3 MTP layers stored as model.layers.45-47,
Llama-3 RoPE scaling on the full-attention layers. The config keys, tensor names, FP8 encoding and how they are
shrunk: see _step.py.

llama.cpp's converter reads this config.json as stored (LLAMA_CPP_RAW_CONFIG): the transformers it pins for its
converter (4.57) does not know model_type step3p5. transformers 5 does, and its AutoConfig view renames the
release's keys (num_attention_groups -> num_key_value_heads, attention_other_setting -> num_sliding_attention_heads,
per-layer rope_theta -> rope_parameters) and cuts the per-layer lists to the trunk; llama.cpp's Step35Model then
stops with KeyError 'num_attention_groups'. So the reference reads the file as a user with llama.cpp's own
requirements installed does; mtpq reads it as stored too (Step35.stored_config).
"""

from . import _step

RELEASE = "stepfun-ai/Step-3.5-Flash"
SOURCES = [
    "https://huggingface.co/stepfun-ai/Step-3.5-Flash (model card: 196B MoE, MTP-3, 3:1 SWA, 256K context)",
    "https://huggingface.co/stepfun-ai/Step-3.5-Flash-FP8 (the FP8 release, served by vLLM's step3p5 loader)",
    *_step.SOURCES,
]
CONFIG = _step.text_config()
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
FORMS = {"bf16": None, "fp8": _step.fp8_routed_experts}
LLAMA_CPP_RAW_CONFIG = True
DRAFTS = True


def tensors(cfg: dict) -> dict[str, tuple[int, ...]]:
    return _step.text_tensors(cfg)
