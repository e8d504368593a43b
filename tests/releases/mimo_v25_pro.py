"""MiMo-V2.5-Pro (XiaomiMiMo/MiMo-V2.5-Pro) as released: MiMoV2ForCausalLM (model_type mimo_v2, remote code), text
only (no towers), 70 layers + 3 MTP layers, the fused FP8 ``self_attn.qkv_proj`` sharded over num_key_value_heads
(8) tensor-parallel ranks (the release: [27136, 6144] with scales [216, 48] = 8 x 27), o_proj / eh_proj / norms
bf16, the router float32, attention_value_scale 0.612.

Shrunk: hidden 6144 -> 256, layers 70 -> 4 (pattern [0, 1, 1, 0], dense first layer), experts 384 -> 4 (top 8 ->
2), heads 128 -> 16 (KV 8 / 8 kept), head_dim 192 -> 48, v_head_dim 128 -> 32, intermediate 16384 -> 512,
moe_intermediate 2048 -> 256. Every other key as released.
"""

from tests.builders.tiny_mimo2 import SPECIALS  # noqa: F401  (the manifest's tokenizer: MiMo's)

from . import _mimo, variant

RELEASE = "XiaomiMiMo/MiMo-V2.5-Pro"
SOURCES = [
    "XiaomiMiMo/MiMo-V2.5-Pro config.json as stored and its weight listing (every tensor name, shape and dtype, "
    "34 safetensors files + model_mtp.safetensors), transcribed in a public model report "
    "('模型信息报告 /nfs/.../XiaomiMiMo/MiMo-V2.5-Pro')",
    "vllm-project/vllm vllm/model_executor/models/mimo_v2_mtp.py ('Pro: fused qkv_proj', ckpt_tp = "
    "config.num_key_value_heads) and mimo_v2.py (MiMoV2ForCausalLM, _shard_fp8_qkv_proj)",
    "sgl-project/sglang python/sglang/srt/configs/model_config.py (get_mimo_v2_fused_qkv_expected_tp_size)",
    "llama.cpp conversion/mimo.py (MimoV2Model: 'V2.5-Pro (TP=8) ship qkv_proj sharded across TP ranks')",
]
# the release's keys beside the backbone every MiMo-V2 manifest shrinks alike (_mimo.SHARED_CONFIG)
CONFIG = variant(
    _mimo.SHARED_CONFIG,
    {
        "architectures": ["MiMoV2ForCausalLM"],
        "auto_map": _mimo.auto_map("mimo_v2", "MiMoV2"),
        "attention_projection_layout": "fused_qkv",
        "attention_value_scale": 0.612,
        "max_position_embeddings": 1048576,
        "model_type": "mimo_v2",
        "num_key_value_heads": 8,
        "rope_theta": 10000000,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.1",
    },
    first=("architectures", "auto_map"),
)  # listed first in the release


def _quantization_config(cfg: dict) -> dict:
    return {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
        "ignored_layers": _mimo.ignored_o_proj(cfg),
    }


FORMS = {"fp8": _mimo.fp8_form(_quantization_config)}
DRAFTS = True  # llama.cpp's mimo2 MTP graph (fused attn_qkv)


def tensors(cfg: dict) -> dict[str, tuple[int, ...]]:
    return _mimo.text_tensors(cfg, fused_qkv=True)
