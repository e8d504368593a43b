"""DeepSeek-V3 saved by transformers 4.x (fine-tunes, merges, conversions written by ``save_pretrained``):
DeepseekV3ForCausalLM in bf16, its config.json as transformers 4.57's DeepseekV3Config writes it.

That class has no ``topk_method`` nor ``scoring_func`` (DeepSeek's remote config had both), so a config built
from its own parameters -- the release's values, ``num_nextn_predict_layers`` kept as an extra key, which
4.x's PretrainedConfig stores and writes -- is saved without them, while its router
(DeepseekV3TopkRouter) always registers ``e_score_correction_bias`` as a persistent buffer, saved in the
model's dtype. The keys below are what ``DeepseekV3Config(...).save_pretrained`` wrote under transformers
4.57.1 (``rope_scaling`` with "rope_type" beside "type", floats for factor/beta_*, ``head_dim`` =
qk_rope_head_dim, ``qk_head_dim``, ``rope_interleave``), with ``architectures`` and ``dtype`` as a model's
save adds them. Shrunk as deepseek_v3.py.

Where the two converters differ: llama.cpp's deepseek2 converter drops the MTP layer (see deepseek_v3.py),
and with no ``scoring_func`` it writes no ``expert_gating_func``, so its loader routes these models with
softmax; transformers' DeepseekV3 always routes with sigmoid, which mtpq writes.
"""

from ._deepseek import SPECIALS, tensors as _tensors  # noqa: F401 (SPECIALS: the manifest's tokenizer)

RELEASE = "deepseek-ai/DeepSeek-V3 (saved by transformers 4.x)"
SOURCES = [
    "transformers 4.57.1 src/transformers/models/deepseek_v3/configuration_deepseek_v3.py (the keys it writes: "
    "DeepseekV3Config(...).save_pretrained run under 4.57.1; no topk_method / scoring_func attributes)",
    "transformers 4.57.1 src/transformers/models/deepseek_v3/modeling_deepseek_v3.py (DeepseekV3TopkRouter "
    "register_buffer('e_score_correction_bias'); _keys_to_ignore_on_load_unexpected model.layers.61.*)",
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
    "pretraining_tp": 1,
    "q_lora_rank": 256,
    "qk_head_dim": 96,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "rms_norm_eps": 1e-06,
    "rope_interleave": True,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn", "type": "yarn"},
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "transformers_version": "4.57.1",
    "use_cache": True,
    "v_head_dim": 64,
    "vocab_size": 129280,
}
FORMS = {"bf16": None}
LLAMA_CPP_MODE = {"--no-mtp": None}  # as deepseek_v3.py
_DROPS = ("llama.cpp's deepseek2 converter drops the MTP layer (DeepseekV2Model.skip_mtp) and refuses --mtp / "
          "--no-mtp for DeepseekV3ForCausalLM; mtpq keeps the layer (its trunk-only file is compared with "
          "llama.cpp's default one)")
DIFFERS_KEYS = {"deepseek2.expert_gating_func": "config.json names no scoring_func: llama.cpp's converter writes "
                "no gating function and its loader then routes deepseek2 with softmax; transformers' "
                "DeepseekV3 routes with sigmoid, which mtpq writes"}
_DROPS += "; and expert_gating_func, as DIFFERS_KEYS says"
DIFFERS = {(form, mode): _DROPS for form in FORMS for mode in (None, "--mtp")}
DRAFTS = True


def tensors(cfg: dict) -> dict[str, tuple[int, ...]]:
    return _tensors(cfg)
