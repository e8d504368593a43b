"""Cohere2 MoE (CohereLabs/North-Mini-Code-1.0) as released: Cohere2MoeForCausalLM, parallel blocks (one RMSNorm
``input_layernorm`` feeds attention and the MLP), sliding-window layers with a full-attention layer every
``sliding_window_pattern``-th (the dense prefix full, ``prefix_dense_sliding_window_pattern: 1``), a dense first
layer (``first_k_dense_replace``, ``prefix_dense_intermediate_size`` wide), then MoE layers (sigmoid router
``mlp.gate``, per-expert projections); tied embeddings; one MTP layer ``model.layers.{N}`` (``eh_proj`` / ``enorm`` /
``hnorm`` / ``shared_head.norm`` beside a full MoE block).

Forms: ``bf16``; ``no_layer_types`` a config that omits ``layer_types`` (transformers derives them from
``sliding_window_pattern`` and ``first_k_dense_replace``, and llama.cpp's converter reads that derived view);
``tf5`` the config as transformers 5 saves it (``mlp_layer_types``, ``rope_parameters``).

Shrunk: hidden 2048 -> 256, layers 40 -> 5 (+1 MTP; the fifth is the first full-attention layer past the dense
prefix, which has no RoPE), heads 32/4 -> 4/2 (head_dim 128 -> 64), experts 128 -> 4
(8 -> 2 per token), expert width 768 -> 256, dense prefix width 3072 -> 512. Every other key as released.
"""

from . import LlamaCppRefuses, attention, experts, mlp, nextn, transformers_saved, trunk, without

RELEASE = "CohereLabs/North-Mini-Code-1.0"
SOURCES = [
    "https://huggingface.co/CohereLabs/North-Mini-Code-1.0/blob/main/config.json (keys and values, as quoted by"
    " third-party loaders' fixtures: use_parallel_block, use_gated_activation, expert_selection_fn sigmoid, ...)",
    "transformers src/transformers/models/cohere2_moe/configuration_cohere2_moe.py (layer_types / mlp_layer_types"
    " derived from sliding_window_pattern, prefix_dense_sliding_window_pattern, first_k_dense_replace)",
    "transformers src/transformers/models/cohere2_moe/modeling_cohere2_moe.py (per-layer names)",
    "llama.cpp conversion/command_r.py Cohere2MoeModel; src/models/cohere2moe.cpp (the MTP layer's nextn tensors)",
]
SPECIALS = ["<|END_OF_TURN_TOKEN|>", "<BOS_TOKEN>", "<|START_OF_TURN_TOKEN|>"]
N_LAYERS = 5
CONFIG = {
    "architectures": ["Cohere2MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 5,
    "eos_token_id": 255001,
    "expert_selection_fn": "sigmoid",
    "first_k_dense_replace": 1,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 256,
    "initializer_range": 0.02,
    "intermediate_size": 256,
    "layer_types": ["full_attention"]
    + ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(N_LAYERS - 1)],
    "logit_scale": 1.0,
    "max_position_embeddings": 500000,
    "model_type": "cohere2_moe",
    "norm_topk_prob": False,
    "num_attention_heads": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": N_LAYERS,
    "num_key_value_heads": 2,
    "num_nextn_predict_layers": 1,
    "num_shared_experts": 0,
    "pad_token_id": 0,
    "prefix_dense_intermediate_size": 512,
    "prefix_dense_sliding_window_pattern": 1,
    "rms_norm_eps": 1e-06,
    "rope_theta": 50000.0,
    "sliding_window": 4096,
    "sliding_window_pattern": 4,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_gated_activation": True,
    "use_parallel_block": True,
    "use_qk_norm": False,
    "vocab_size": 262144,
}
FORMS = {"bf16": None, "no_layer_types": without("layer_types"), "tf5": transformers_saved}
DRAFTS = True


# llama.cpp's converter refuses --no-mtp / --mtp for Cohere2MoeForCausalLM ("not supported"); mtpq writes the full
# file's trunk / MTP block (tests/convert/test_convert_cohere2moe.py checks both against llama.cpp's full file)
DIFFERS = {
    (form, mode): LlamaCppRefuses(
        "llama.cpp's converter does not support --no-mtp / --mtp for "
        "Cohere2MoeForCausalLM; mtpq writes the parts of its full file",
        r"--mtp / --no-nextn are not supported for Cohere2MoeForCausalLM",
    )
    for form in FORMS
    for mode in ("--no-mtp", "--mtp")
}


def tensors(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, v, d = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    nh, nkv, ne = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_experts"]
    eff, dff, n = cfg["intermediate_size"], cfg["prefix_dense_intermediate_size"], cfg["num_hidden_layers"]
    out = trunk(v, h, lm_head=False)  # tied embeddings
    for L in range(n + cfg["num_nextn_predict_layers"]):
        p = f"model.layers.{L}."
        out[p + "input_layernorm.weight"] = (h,)  # one norm: parallel attention and MLP
        out |= attention(p + "self_attn.", h, nh, nkv, d)
        if L < cfg["first_k_dense_replace"]:
            out |= mlp(p + "mlp.", dff, h)
        else:
            out |= {p + "mlp.gate.weight": (ne, h)} | experts(p + "mlp.experts.", ne, eff, h)
        if L >= n:
            out |= nextn(p, h, "shared_head.norm")
    return out
