"""MiMo-V2-Flash (XiaomiMiMo/MiMo-V2-Flash, and -Base) as released: MiMoV2FlashForCausalLM, 48 layers (hybrid:
full attention at 0 and every 6th, sliding window elsewhere) + 3 MTP layers under model.mtp.layers.i, split
q/k/v projections, shipped in block-scaled FP8 (e4m3, 128x128 ``weight_scale_inv``; o_proj, eh_proj and the
router not quantized). The "bf16" form is that checkpoint dequantized, as users (and the Neuron/Megatron
recipes) prepare it.

Shrunk: hidden 4096 -> 256, layers 48 -> 4 (pattern [0, 1, 1, 0], dense first layer), experts 256 -> 4 (top 8 ->
2), heads 64 -> 16 (KV 4 full / 8 sliding kept), head_dim 192 -> 48 and v_head_dim 128 -> 32 (rope 0.334 x 48
= 16, even as llama.cpp's CPU rope needs), intermediate 16384 -> 512, moe_intermediate 2048 -> 256. Every other
key as released.

The release's config.json itself was not found verbatim in the stored sources: its keys and values are those
transcribed from it by the engines' test fixtures below, cross-checked against MiMo-V2.5's config.json (the
same backbone: "Built upon the MiMo-V2-Flash backbone"); keys no transcription shows (token ids) are left out.

llama.cpp's converter reads it with LLAMA_CPP_RAW_CONFIG: transformers 5.24 knows ``mimo_v2_flash`` and its
MiMoV2FlashConfig fills ``rope_parameters`` with a nested per-layer-type default ({"full_attention": {...},
"sliding_attention": {...}}) where config.json has none, so llama.cpp's conversion/mimo.py stops with
KeyError 'partial_rotary_factor' on every MiMo-V2-Flash release; with transformers releases that do not know the
model type (<= 4.57, which the release names) it reads config.json as stored, which is what is compared.
"""

from tests.builders.tiny_mimo2 import SPECIALS  # noqa: F401  (the manifest's tokenizer: MiMo's)

from . import _mimo, variant

RELEASE = "XiaomiMiMo/MiMo-V2-Flash"
SOURCES = [
    "https://huggingface.co/XiaomiMiMo/MiMo-V2-Flash (model card: 309B/15B MoE, 5:1 SWA:GA hybrid, 128-token "
    "window, FP8 mixed precision, 3 MTP layers)",
    "NVIDIA-NeMo/Megatron-Bridge tests/unit_tests/models/mimo_v2_flash/test_mimo_v2_flash_bridge.py "
    "(_MIMO_V2_FLASH_CONFIG, the hub config's keys: sliding_window and sliding_window_size 128, attention_chunk_size "
    "128, swa_* heads, attention_value_scale 0.707, routed_scaling_factor null, rope_theta 5e6, swa_rope_theta 1e4, "
    "max_position_embeddings 262144, transformers_version 4.40.1) and its mimo_v2_flash_bridge.py (auto_map "
    "configuration_mimo_v2_flash.MiMoV2FlashConfig)",
    "transformers src/transformers/models/mimo_v2_flash/configuration_mimo_v2_flash.py (the 48-layer default "
    "pattern: full attention at 0 and every 6th layer; sliding_window = sliding_window_size + 1)",
    "sgl-project/sglang-jax python/sgl_jax/srt/models/mimo_v2_nextn.py (MiMo-V2-Flash / V2.5 / V2.5-Pro MTP draft: "
    "weight keys model.mtp.layers.i.{enorm, hnorm, eh_proj, input_layernorm, self_attn.{q,k,v,o}_proj, "
    "self_attn.attention_sink_bias, pre_mlp_layernorm, mlp.{gate,up,down}_proj, final_layernorm}; 'V2-Flash MTP "
    "ships split q/k/v'; 'o_proj is bf16 in the checkpoint (ignored_layers)')",
    "vllm-project/vllm vllm/model_executor/models/mimo_v2_mtp.py (the MTP layer layout, 'Flash: separate q_proj, "
    "k_proj, v_proj') and mimo_v2.py (MiMoV2FlashDecoderLayer: input_layernorm, post_attention_layernorm, sinks on "
    "sliding layers only, moe_layer_freq, mlp.gate + e_score_correction_bias, per-expert weights; MTP o_proj "
    "unquantized)",
    "llama.cpp conversion/mimo.py (MimoV2Model: the keys it reads, 3 MTP layers)",
]
# the release's keys beside the backbone every MiMo-V2 manifest shrinks alike (_mimo.SHARED_CONFIG)
CONFIG = variant(
    _mimo.SHARED_CONFIG,
    {
        "architectures": ["MiMoV2FlashForCausalLM"],
        "attention_value_scale": 0.707,
        "auto_map": _mimo.auto_map("mimo_v2_flash", "MiMoV2Flash"),
        "hybrid_block_size": None,
        "max_position_embeddings": 262144,
        "model_type": "mimo_v2_flash",
        "num_key_value_heads": 4,
        "rope_theta": 5000000,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.40.1",
    },
)


def _quantization_config(cfg: dict) -> dict:
    return {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "ignored_layers": _mimo.ignored_o_proj(cfg),
        "weight_block_size": [128, 128],
    }


FORMS = {"fp8": _mimo.fp8_form(_quantization_config), "bf16": None}
LLAMA_CPP_RAW_CONFIG = True  # see the module docstring
DRAFTS = False  # llama.cpp's mimo2 MTP graph needs the fused attn_qkv ("MIMO2 MTP requires fused attn_qkv")


def tensors(cfg: dict) -> dict[str, tuple[int, ...]]:
    return _mimo.text_tensors(cfg, fused_qkv=False)
