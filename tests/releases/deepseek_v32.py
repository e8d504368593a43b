"""DeepSeek-V3.2 as released (deepseek-ai/DeepSeek-V3.2-Exp, -V3.2, -V3.2-Speciale): DeepseekV32ForCausalLM in
FP8, DeepSeek-V3's layout plus DeepSeek Sparse Attention's lightning indexer in every layer, the MTP layer
(model.layers.61) included: ``self_attn.indexer.{wq_b, wk, k_norm.{weight,bias}, weights_proj}``.

Shrunk as deepseek_v3.py, and index_n_heads 64 -> 4, index_head_dim 128 -> 64, index_topk 2048 -> 64. Every
other key as released: the V3.1 key set (no auto_map: the release ships no modeling code; quantization_config
with "scale_fmt": "ue8m0") plus model_type deepseek_v32 and the three index_* keys.

Encoding: as DeepSeek-V3's (deepseek_v3.py), and the indexer's wq_b / wk e4m3 with their scales while
weights_proj and k_norm stay BF16. llama.cpp's DeepseekV32Model keeps the MTP layer: every cell is compared.
"""

from ._deepseek import SPECIALS, fp8_release, tensors as _tensors  # noqa: F401 (SPECIALS: the manifest's tokenizer)

RELEASE = "deepseek-ai/DeepSeek-V3.2-Exp"
SOURCES = [
    "https://huggingface.co/deepseek-ai/DeepSeek-V3.2-Exp/blob/main/config.json (the index_* keys and values, "
    "model_type; read from a checkpoint loader's module documentation that quotes it)",
    "https://huggingface.co/deepseek-ai/DeepSeek-V3.1-Base/blob/main/config.json (the rest of the key set, "
    "quantization_config with scale_fmt ue8m0; read from a verbatim copy in a fine-tuning guide)",
    "https://huggingface.co/deepseek-ai/DeepSeek-V3.2-Exp/blob/main/model.safetensors.index.json (indexer names; "
    "every .weight but weights_proj and k_norm has a weight_scale_inv sibling, per the same loader's notes)",
    "transformers src/transformers/models/deepseek_v32/modeling_deepseek_v32.py (DeepseekV32Indexer names)",
    "vllm/model_executor/models/deepseek_mtp.py (the MTP layer: a full decoder layer with its indexer)",
    "llama.cpp conversion/deepseek.py DeepseekV32Model (keeps the MTP layer; indexer metadata)",
]
CONFIG = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 256,
    "index_head_dim": 64,
    "index_n_heads": 4,
    "index_topk": 64,
    "initializer_range": 0.02,
    "intermediate_size": 512,
    "kv_lora_rank": 256,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v32",
    "moe_intermediate_size": 256,
    "moe_layer_freq": 1,
    "n_group": 2,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_key_value_heads": 4,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 256,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.44.2",
    "use_cache": True,
    "v_head_dim": 64,
    "vocab_size": 129280,
}
FORMS = {"fp8": fp8_release(keep=("eh_proj.weight", "shared_head.head.weight", "indexer.weights_proj.weight"))}
DRAFTS = True


def tensors(cfg: dict) -> dict[str, tuple[int, ...]]:
    return _tensors(cfg, indexed=lambda bid: True)
