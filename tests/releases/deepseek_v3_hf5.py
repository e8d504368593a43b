"""DeepSeek-V3 saved by transformers 5.x (fine-tunes, merges, conversions written by ``save_pretrained``):
DeepseekV3ForCausalLM in bf16, its config.json as transformers 5.24's DeepseekV3Config writes it.

As in 4.x (deepseek_v3_hf4.py) the class has no ``topk_method`` nor ``scoring_func``, while its router always
holds ``e_score_correction_bias``; 5.x writes ``rope_parameters`` (rope_theta inside, no top-level
``rope_theta``), ``num_nextn_predict_layers`` from its own ``num_mtp_layers`` (default 1), ``pad_token_id``,
``output_router_logits``, and keeps the router in F32 (``_keep_in_fp32_modules_strict``: ``gate.weight`` and
``e_score_correction_bias`` are F32 in a model loaded in bf16, and saved so). The keys are what
``DeepseekV3Config(...).save_pretrained`` wrote under transformers 5.24.0, ``architectures`` and ``dtype`` as
a model's save adds them, and the F32 router tensors what ``from_pretrained(dtype=bfloat16).save_pretrained``
stored. Shrunk as deepseek_v3.py; the converters differ as for deepseek_v3_hf4.py.
"""

from ._deepseek import SPECIALS, f32, tensors as _tensors  # noqa: F401 (SPECIALS: the manifest's tokenizer)
from .deepseek_v3_hf4 import DIFFERS_KEYS, LLAMA_CPP_MODE, _DROPS  # noqa: F401 (the same knowing differences)

RELEASE = "deepseek-ai/DeepSeek-V3 (saved by transformers 5.x)"
SOURCES = [
    "transformers 5.24.0 src/transformers/models/deepseek_v3/configuration_deepseek_v3.py (the keys it writes: "
    "DeepseekV3Config(...).save_pretrained run under 5.24.0; num_mtp_layers -> num_nextn_predict_layers)",
    "transformers 5.24.0 src/transformers/models/deepseek_v3/modeling_deepseek_v3.py (DeepseekV3TopkRouter's "
    "e_score_correction_bias buffer; _keep_in_fp32_modules_strict = [e_score_correction_bias, gate.weight])",
    "https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json (the values)",
    "vllm/model_executor/models/deepseek_mtp.py (the MTP layer's tensor names)",
]
CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "dtype": "bfloat16",
    "eos_token_id": 1,
    "first_k_dense_replace": 1,
    "head_dim": 32,
    "hidden_act": "silu",
    "hidden_size": 256,
    "initializer_range": 0.02,
    "intermediate_size": 512,
    "kv_lora_rank": 256,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 256,
    "n_group": 2,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_key_value_heads": 4,
    "num_nextn_predict_layers": 1,
    "output_router_logits": False,
    "pad_token_id": None,
    "pretraining_tp": 1,
    "q_lora_rank": 256,
    "qk_head_dim": 96,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "rms_norm_eps": 1e-06,
    "rope_interleave": True,
    "rope_parameters": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                        "original_max_position_embeddings": 4096, "rope_theta": 10000, "rope_type": "yarn",
                        "type": "yarn"},
    "routed_scaling_factor": 2.5,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "transformers_version": "5.24.0",
    "use_cache": True,
    "v_head_dim": 64,
    "vocab_size": 129280,
}
FORMS = {"bf16": f32("mlp.gate.weight", "mlp.gate.e_score_correction_bias")}
DIFFERS = {(form, mode): _DROPS for form in FORMS for mode in (None, "--mtp")}
DRAFTS = True


def tensors(cfg: dict) -> dict[str, tuple[int, ...]]:
    return _tensors(cfg)
