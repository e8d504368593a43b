"""MiMo-V2.5 (XiaomiMiMo/MiMo-V2.5) as released: MiMoV2ForCausalLM (model_type mimo_v2, remote code: transformers
does not know it, so llama.cpp's converter reads config.json as stored), the MiMo-V2-Flash backbone with one
fused ``self_attn.qkv_proj`` per layer in FP8, its rows sharded over num_key_value_heads (4) tensor-parallel
ranks, each rank [Q_r | K_r | V_r] in its own 128-row scale tiles (the release: full layers [13568, 4096] with
scales [108, 32] = 4 x 27, sliding ones [14848, 4096] with [116, 32] = 4 x 29, although those have 8 KV heads);
o_proj, eh_proj and the norms bf16, the router float32; a vision tower (``visual.*``) and an audio encoder
(``audio_encoder.*``, ``speech_embeddings.*``) beside the text model, for llama.cpp's mmproj file. 3 MTP layers.

Forms: "fp8" as released; "mxfp4" its routed experts in OCP MXFP4 (U8 ``weight`` + U8 E8M0 ``weight_scale``,
``quantization_config.store_dtype: mxfp4``, ``mxfp4_block_size: 32``, the router bf16 with
``moe_router_dtype: bfloat16``), as the MiMo-V2.x-Flash MXFP4 checkpoint transcribed below stores them and
llama.cpp's conversion/mimo.py reads them.

Shrunk: hidden 4096 -> 256, layers 48 -> 4 (pattern [0, 1, 1, 0], dense first layer), experts 256 -> 4 (top 8 ->
2), heads 64 -> 16 (KV 4 full / 8 sliding kept), head_dim 192 -> 48, v_head_dim 128 -> 32 (so, as in the release,
the per-rank scale tiles of 4 and 8 ranks differ in count), intermediate 16384 -> 512, moe_intermediate 2048 ->
256; the towers' widths and depths likewise. Every other key as released.
"""

from tests.builders.tiny_mimo2 import SPECIALS  # noqa: F401  (the manifest's tokenizer: MiMo's)

from . import _mimo, variant

RELEASE = "XiaomiMiMo/MiMo-V2.5"
SOURCES = [
    "XiaomiMiMo/MiMo-V2.5 config.json as stored and its weight listing (every tensor name, shape and dtype, "
    "model_pp0_ep0_shard*.safetensors + model_mtp.safetensors), transcribed in a public model report "
    "('模型信息报告 /nfs/.../XiaomiMiMo/MiMo-V2.5')",
    "https://huggingface.co/XiaomiMiMo/MiMo-V2.5 (model card: the MiMo-V2-Flash backbone, ViT + audio encoder, "
    "3 MTP layers)",
    "vllm-project/vllm vllm/model_executor/models/mimo_v2_mtp.py (fused qkv_proj 'pre-sharded at "
    "config.num_key_value_heads chunks of [Q_c | K_c | V_c] ... 4 x 29 = 116 rows for MiMo-V2.5'; the MTP layer "
    "layout) and mimo_v2.py (_shard_fp8_qkv_proj; MiMoV2ForCausalLM)",
    "sgl-project/sglang python/sglang/srt/configs/model_config.py (get_mimo_v2_fused_qkv_expected_tp_size: "
    "attention_projection_layout fused_qkv -> num_key_value_heads) and python/sglang/srt/models/mimo_v2.py",
    "llama.cpp conversion/mimo.py (MimoV2Model: per-rank qkv dequant, store_dtype mxfp4 experts; "
    "MiMoV2VisionAudioModel: the towers go to the mmproj file)",
    "XiaomiMiMo/MiMo-V2.6-Flash-RL config.json (a MiMo-V2.x-Flash MXFP4 config, as transcribed in a C++ test "
    "fixture: quantization_config {store_dtype mxfp4, mxfp4_block_size 32}, moe_router_dtype bfloat16)",
]
# the release's keys beside the backbone every MiMo-V2 manifest shrinks alike (_mimo.SHARED_CONFIG)
CONFIG = variant(
    _mimo.SHARED_CONFIG,
    {
        "architectures": ["MiMoV2ForCausalLM"],
        "auto_map": _mimo.auto_map("mimo_v2", "MiMoV2"),
        "attention_value_scale": 0.707,
        "attention_projection_layout": "fused_qkv",
        "audio_config": {
            "add_post_norm": True,
            "audio_channels": 2,
            "audio_segment_size": 6000,
            "group_size": 4,
            "input_full_attention": True,
            "input_local_attn_heads": 2,
            "input_local_dim": 32,
            "input_local_head_dim": 16,
            "input_local_hidden_dropout": 0.0,
            "input_local_intermediate_size": 64,
            "input_local_layers": 1,
            "out_hidden_size": 256,
            "partial_rotary_factor": 1.0,
            "projection_layers": 2,
            "rope_theta": 640000,
            "speech_vocab_size": "16",
            "speech_zeroemb_idx": "8",
        },
        "dtype": "bfloat16",
        "eos_token_id": 151645,
        "hybrid_block_size": None,
        "image_token_id": 151655,
        "max_position_embeddings": 1048576,
        "model_type": "mimo_v2",
        "num_key_value_heads": 4,
        "pad_token_id": 151643,
        "processor_config": {
            "audio_avg_pooler": 2,
            "audio_channels": 2,
            "audio_end_token_id": 151674,
            "audio_fmax": None,
            "audio_fmin": 0,
            "audio_group_size": 4,
            "audio_hop_length": 240,
            "audio_input_id_per_second": 25.0,
            "audio_kernel_size": 3,
            "audio_n_mels": 128,
            "audio_nfft": 960,
            "audio_sampling_rate": 24000,
            "audio_segment_size": 6000,
            "audio_start_token_id": 151673,
            "audio_stride_size": 2,
            "audio_token_id": 151669,
            "audio_window_size": 960,
            "audio_zeroemb_idx": [8, 8],
            "fps": 1.0,
            "image_max_pixels": 8388608,
            "image_min_pixels": 8192,
            "image_token_id": 151655,
            "max_frames": 3600,
            "merge_size": 2,
            "min_frames": None,
            "num_frames": None,
            "pad_token_id": 151643,
            "patch_size": 16,
            "rope_type": "rope",
            "temporal_compression_ratio": 1,
            "temporal_patch_size": 2,
            "use_per_grid_t_timestamps": False,
            "use_video_timestamps": True,
            "video_audio_interleave_length": 0.0,
            "video_end_token_id": 151671,
            "video_max_pixels": 8388608,
            "video_min_pixels": 8192,
            "video_process_num_threads": 16,
            "video_start_token_id": 151670,
            "video_token_id": 151656,
            "video_tokens_per_second": 2,
            "video_total_max_pixels": 268435456,
            "vision_end_token_id": 151653,
            "vision_start_token_id": 151652,
        },
        "rope_scaling": {"rope_type": "default", "type": "default"},
        "rope_theta": 10000000,
        "transformers_version": "4.57.1",
        "video_token_id": 151656,
        "vision_config": {
            "depth": 2,
            "fullatt_block_indexes": [0],
            "hidden_act": "silu",
            "hidden_size": 64,
            "in_chans": 3,
            "intermediate_size": 128,
            "num_heads": 4,
            "num_key_value_heads": 2,
            "num_query_groups": 2,
            "out_hidden_size": 256,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "spatial_patch_size": 16,
            "temporal_patch_size": 2,
            "tokens_per_second": 2,
            "use_sink": True,
            "visual_token_window_size": 64,
            "vit_window_attn_types": [-1, 0],
            "window_size": 128,
        },
        "vision_end_token_id": 151653,
        "vision_model_type": "mimovl",
        "vision_start_token_id": 151652,
    },
    first=(
        "architectures",
        "auto_map",
        "attention_bias",
        "attention_chunk_size",
        "attention_dropout",
        "attention_value_scale",
        "attention_projection_layout",
        "add_full_attention_sink_bias",
        "add_swa_attention_sink_bias",
        "audio_config",
        "swa_num_key_value_heads",
        "swa_num_attention_heads",
        "swa_head_dim",
        "swa_v_head_dim",
        "dtype",
        "eos_token_id",
    ),
)  # the release's order: these keys first


def _fp8_config(cfg: dict) -> dict:
    return {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "store_dtype": "fp8",
        "ignored_layers": _mimo.ignored_o_proj(cfg),
        "weight_block_size": [128, 128],
    }


def _mxfp4_config(cfg: dict) -> dict:
    return {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "mxfp4_block_size": 32,
        "quant_method": "fp8",
        "store_dtype": "mxfp4",
        "weight_block_size": [128, 128],
        "ignored_layers": _mimo.ignored_o_proj(cfg),
    }


FORMS = {
    "fp8": _mimo.fp8_form(_fp8_config),
    "mxfp4": _mimo.fp8_form(_mxfp4_config, mxfp4=True, moe_router_dtype="bfloat16"),
}
DRAFTS = True  # llama.cpp's mimo2 MTP graph (fused attn_qkv)


def towers(cfg: dict) -> dict[str, tuple[int, ...]]:
    """The vision tower and the audio encoder, named as released (llama.cpp's mmproj file takes them)."""
    vc, ac = cfg["vision_config"], cfg["audio_config"]
    vh, vff, heads, vkv = vc["hidden_size"], vc["intermediate_size"], vc["num_heads"], vc["num_key_value_heads"]
    qk = 64  # qk_channels: llama.cpp's default, absent from the release's vision_config
    merged = vh * vc["spatial_merge_size"] ** 2
    out = {
        "visual.patch_embed.proj.weight": (
            vh,
            vc["in_chans"],
            vc["temporal_patch_size"],
            vc["patch_size"],
            vc["patch_size"],
        ),
        "visual.merger.ln_q.weight": (vh,),
        "visual.merger.mlp.0.weight": (merged, merged),
        "visual.merger.mlp.2.weight": (vc["out_hidden_size"], merged),
    }
    for b in range(vc["depth"]):
        p = f"visual.blocks.{b}."
        out |= {
            p + "attn.qkv.weight": ((heads + 2 * vkv) * qk, vh),
            p + "attn.qkv.bias": ((heads + 2 * vkv) * qk,),
            p + "attn.proj.weight": (vh, heads * qk),
            p + "attn.proj.bias": (vh,),
            p + "mlp.gate_proj.weight": (vff, vh),
            p + "mlp.gate_proj.bias": (vff,),
            p + "mlp.up_proj.weight": (vff, vh),
            p + "mlp.up_proj.bias": (vff,),
            p + "mlp.down_proj.weight": (vh, vff),
            p + "mlp.down_proj.bias": (vh,),
            p + "norm1.weight": (vh,),
            p + "norm2.weight": (vh,),
        }
        if vc["vit_window_attn_types"][b] != -1:  # window-attention blocks carry sinks
            out[p + "attn.sinks"] = (heads,)
    d, aff = ac["input_local_dim"], ac["input_local_intermediate_size"]
    for i in range(ac["input_local_layers"]):
        p = f"audio_encoder.input_local_transformer.layers.{i}."
        out |= {
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
            p + "mlp.gate_proj.weight": (aff, d),
            p + "mlp.up_proj.weight": (aff, d),
            p + "mlp.down_proj.weight": (d, aff),
            p + "self_attn.o_proj.weight": (d, d),
        }
        for x in "qkv":
            out |= {p + f"self_attn.{x}_proj.weight": (d, d), p + f"self_attn.{x}_proj.bias": (d,)}
    grouped = d * ac["group_size"]
    out |= {
        "audio_encoder.input_local_transformer.norm.weight": (d,),
        "audio_encoder.projection.mlp.0.weight": (4 * ac["out_hidden_size"], grouped),
        "audio_encoder.projection.mlp.2.weight": (ac["out_hidden_size"], 4 * ac["out_hidden_size"]),
    }
    for c in range(ac["audio_channels"]):
        out[f"speech_embeddings.{c}.weight"] = (int(ac["speech_vocab_size"]), d)
    return out


def tensors(cfg: dict) -> dict[str, tuple[int, ...]]:
    return _mimo.text_tensors(cfg, fused_qkv=True) | towers(cfg)
