"""Ling 3.0 (inclusionAI/Ling-3.0-flash; BailingMoeV3ForCausalLM, ``model_type: bailing_hybrid``) as released, with
its FP8 forms: block-scaled e4m3 with power-of-two (``scale_fmt: ue8m0``) float32 ``weight_scale_inv`` tiles, and
the FP8 release whose routed experts are OCP MXFP4 (``routed_experts_quant_method: mxfp4``: each expert weight
packed E2M1 codes, U8 [rows, cols / 2], with one E8M0 exponent byte per 32 values, U8 [rows, cols / 32], stored
under ``weight_scale_inv``; everything else FP8 as above).

Trunk: Kimi delta attention (KDA) layers and, closing every ``layer_group_size`` group and the tail, gated MLA
layers (direct ``q_proj``: Flash has no q LoRA); ``first_k_dense_replace`` dense layers, then MoE. The MTP layer
``model.layers.{num_hidden_layers}`` is an MLA + MoE block with ``eh_proj``/``enorm``/``hnorm``/``final_layernorm``.

Shrunk: hidden 2560 -> 512, layers 42 -> 4 (layer_group_size 6 -> 4: three KDA layers, then MLA), experts 512 -> 4
(8 -> 2 per token, n_group 8 -> 2, topk_group 4 -> 1), intermediate 6144 -> 512, expert and shared widths
768 -> 256, heads 32 -> 4 (head_dims as released), the 42 swiglu limits -> 4 (same shape: trailing layers
clamped). Every other key as released.

Forms: ``bf16``; ``fp8`` (block-scaled e4m3 everywhere); ``fp8_mxfp4`` (the routed experts MXFP4).
Also read, from MaxText's Ling3 checkpoint hooks (their location was not recorded, so not in SOURCES): the HF
``A_log`` shape [1, 1, n_head, 1] and ``conv1d`` [d, 1, kernel].
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from . import LlamaCppDiffersIn, block_norms, experts, mlp, nextn, set_config, trunk

RELEASE = "inclusionAI/Ling-3.0-flash"
SOURCES = [
    "https://huggingface.co/inclusionAI/Ling-3.0-flash/blob/main/config.json (keys and values, as mirrored by "
    "engine tests: a Rust config test 'bailing_hybrid_maps_ling_kda_mla_moe_and_nextn_contract' with the Flash "
    "values and swiglu limit lists; Megatron-Bridge's bailing_moe3 bridge (Flash signature: 42 layers, group 6, "
    "first_k_dense_replace 2, hidden 2560, 512 experts, q_lora_rank null, 1 MTP layer, mtp_use_kda false); "
    "the Ling-3.0-tiny config.json (the same key set) mirrored in an Edge0 Swift test)",
    "transformers src/transformers/models/bailing_hybrid/configuration_bailing_hybrid.py (model_type "
    "bailing_hybrid, checkpoint inclusionAI/Ling-3.0-Flash)",
    "vllm/model_executor/models/bailing_moe_v3.py (tensor names; FP8: weight_block_size, scale_fmt ue8m0, "
    "routed_experts_quant_method mxfp4 with expert scales under weight_scale_inv; ignored layers matched by "
    "suffix, e.g. b_proj) and bailing_moe_v3_mtp.py (the MTP layer: same quant config, experts included)",
    "vLLM tests/models/test_bailing_moe_v3_vl.py (_LING_MXFP4_QUANT_CONFIG: the quantization_config keys)",
    "llama.cpp conversion/bailingmoe3.py + gguf-py tensor_mapping.py (names it maps; MXFP4 not handled there)",
]
CONFIG = {
    "architectures": ["BailingMoeV3ForCausalLM"],
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_bailing_moe_v3.BailingMoeV3Config",
        "AutoModel": "modeling_bailing_moe_v3.BailingMoeV3Model",
        "AutoModelForCausalLM": "modeling_bailing_moe_v3.BailingMoeV3ForCausalLM",
    },
    "dtype": "bfloat16",
    "embedding_dropout": 0.0,
    "eos_token_id": 156895,
    "expert_swiglu_limit_list": [0, 0, 0, 4],
    "first_k_dense_replace": 2,
    "gated_attention_proj_granularity_type": "head_wise",
    "group_norm_size": 1,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 512,
    "initializer_range": 0.02,
    "intermediate_size": 512,
    "kda_lower_bound": -5.0,
    "kda_safe_gate": True,
    "kv_lora_rank": 512,
    "layer_group_size": 4,
    "linear_silu": True,
    "max_position_embeddings": 262144,
    "max_window_layers": 28,
    "model_type": "bailing_hybrid",
    "moe_intermediate_size": 256,
    "moe_router_enable_expert_bias": True,
    "moe_shared_expert_intermediate_size": 256,
    "mtp_loss_scaling_factor": 0,
    "mtp_use_kda": False,
    "n_group": 2,
    "no_kda_lora": True,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 4,
    "num_key_value_heads": 4,
    "num_kv_heads_for_linear_attn": 0,
    "num_nextn_predict_layers": 1,
    "num_shared_experts": 1,
    "output_dropout": 0.0,
    "output_router_logits": False,
    "pad_token_id": 156892,
    "partial_rotary_factor": 0.5,
    "q_lora_rank": None,
    "qk_head_dim": 192,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_interleave": True,
    "rope_scaling": None,
    "rope_theta": 6000000,
    "rotary_dim": 64,
    "routed_scaling_factor": 2.5,
    "router_dtype": "fp32",
    "scale_router_input": False,
    "score_function": "sigmoid",
    "scoring_func": "sigmoid",
    "share_expert_swiglu_limit_list": [0, 0, 5, 7],
    "short_conv_kernel_size": 4,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "transformers_version": "4.57.1",
    "up_proj_norm": False,
    "use_bias": False,
    "use_cache": True,
    "use_kda_lora": False,
    "use_mla_nope": False,
    "use_nGPT": False,
    "use_qk_norm": True,
    "use_qkv_bias": False,
    "v_head_dim": 128,
    "value_norm": False,
    "vocab_size": 157184,
}
SPECIALS = ["<|endoftext|>", "<role>", "</role>"]
DRAFTS = True
# transformers 5.24 knows bailing_hybrid, and its config class rewrites the keys llama.cpp's bailingmoe3 converter
# reads: norm_topk_prob -> moe_renormalize, n_group -> num_expert_group, num_experts_per_tok ->
# num_experts_per_token, and head_dim (KDA's, 128) becomes qk_rope_head_dim (64). Through that view llama.cpp stops
# with KeyError 'norm_topk_prob'; with a transformers that does not know the type (before 5.24) it reads config.json
# as stored, which is the view compared here.
LLAMA_CPP_RAW_CONFIG = True


def _full_attention(bid: int, cfg: dict) -> bool:
    n, g = cfg["num_hidden_layers"], cfg["layer_group_size"]
    return bid >= n or (bid + 1) % g == 0 or bid >= n // g * g


def tensors(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, v, nh = cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"]
    nope, rope, vd, kv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    d, k = nh * cfg["head_dim"], cfg["short_conv_kernel_size"]
    out = trunk(v, h, embed="model.word_embeddings.weight")
    n = cfg["num_hidden_layers"]
    for bid in range(n + cfg["num_nextn_predict_layers"]):
        p, a, m = f"model.layers.{bid}.", f"model.layers.{bid}.attention.", f"model.layers.{bid}.mlp."
        out |= block_norms(p, h)
        if _full_attention(bid, cfg):  # gated MLA, direct q_proj (q_lora_rank null)
            out |= {
                a + "q_proj.weight": (nh * (nope + rope), h),
                a + "kv_a_proj_with_mqa.weight": (kv + rope, h),
                a + "kv_a_layernorm.weight": (kv,),
                a + "kv_b_proj.weight": (nh * (nope + vd), kv),
                a + "g_proj.weight": (nh, h),
                a + "dense.weight": (h, nh * vd),
            }
        else:  # KDA
            out |= {a + f"{x}_proj.weight": (d, h) for x in ("q", "k", "v", "f", "g")}
            out |= {a + f"{x}_conv1d.weight": (d, 1, k) for x in ("q", "k", "v")}
            out |= {
                a + "b_proj.weight": (nh, h),
                a + "A_log": (1, 1, nh, 1),
                a + "dt_bias": (d,),
                a + "o_norm.weight": (cfg["head_dim"],),
                a + "o_proj.weight": (h, d),
            }
        if bid < cfg["first_k_dense_replace"]:
            ff = cfg["intermediate_size"]
            out |= mlp(m, ff, h)
        else:
            ne, ff = cfg["num_experts"], cfg["moe_intermediate_size"]
            sff = cfg["moe_shared_expert_intermediate_size"] * cfg["num_shared_experts"]
            out |= {m + "gate.weight": (ne, h), m + "gate.expert_bias": (ne,)} | mlp(m + "shared_experts.", sff, h)
            out |= experts(m + "experts.", ne, ff, h)
        if bid >= n:
            out |= nextn(p, h, "final_layernorm")
    return out


_EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _fp8_ue8m0(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes and float32 tile scales rounded up to powers of two (``scale_fmt: ue8m0``)."""
    rows, cols = w.shape
    tr, tc = -(-rows // block), -(-cols // block)
    padded = torch.zeros(tr * block, tc * block)
    padded[:rows, :cols] = w.float()
    amax = padded.reshape(tr, block, tc, block).abs().amax(dim=(1, 3)).clamp(min=1e-12)
    s = torch.exp2(torch.ceil(torch.log2(amax / torch.finfo(torch.float8_e4m3fn).max)))
    q = w.float() / s.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return q.to(torch.float8_e4m3fn), s


def _mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MXFP4: E2M1 codes two per byte (element 2i in the low nibble) and one E8M0 byte per 32 values."""
    rows, cols = w.shape
    groups = w.float().reshape(rows, cols // 32, 32)
    e = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2.0**-100) / 6.0)).clamp(-127, 127)
    codes = (((groups / torch.exp2(e)[..., None])[..., None] - _E2M1).abs().argmin(-1)).to(torch.uint8)
    codes = codes.reshape(rows, cols)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), (e + 127).to(torch.uint8)


def _fp8(folder: Path, mxfp4_experts: bool) -> None:
    from safetensors.torch import load_file, save_file

    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for shard in sorted(set(index["weight_map"].values())):
        out = {}
        for name, w in load_file(str(folder / shard)).items():
            quantized = (
                name.startswith("model.layers.")
                and w.dim() == 2
                and "norm" not in name
                and not name.endswith((".mlp.gate.weight", ".b_proj.weight"))
            )  # b_proj: not converted
            if not quantized:
                out[name] = w
                continue
            out[name], out[name + "_scale_inv"] = (_mxfp4 if mxfp4_experts and _EXPERT.match(name) else _fp8_ue8m0)(w)
            index["weight_map"][name + "_scale_inv"] = shard
        save_file(out, str(folder / shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index, indent=2))
    qc = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "scale_fmt": "ue8m0",
        "modules_to_not_convert": ["lm_head", "b_proj"],
    }
    if mxfp4_experts:
        qc |= {"routed_experts_quant_method": "mxfp4", "routed_experts_group_size": 32}
    set_config(folder, quantization_config=qc)


_NO_MXFP4_IN_LLAMA_CPP = (
    "llama.cpp's bailingmoe3 converter has no MXFP4 path: its FP8 dequantization multiplies the packed E2M1 bytes "
    "by the E8M0 exponent bytes as numbers and writes the routed experts at half their width with meaningless "
    "values (a file its own loader refuses: 'ffn_gate_exps has wrong shape'); mtpq moves the bits into ggml MXFP4 "
    "blocks, as llama.cpp's mimo/deepseek4/kimi_k3 converters do (repack_mxfp4_blocks; bytes checked in "
    "tests/convert/test_convert_bailingmoe3.py)"
)
DIFFERS = {
    ("fp8_mxfp4", mode): LlamaCppDiffersIn(
        _NO_MXFP4_IN_LLAMA_CPP,
        r"\.ffn_(gate|up|down)_exps\.weight$",
        ours="MXFP4",
        theirs="F32",
        their_width=0.5,
        keys=("general.file_type", "general.size_label"),
    )
    for mode in (None, "--no-mtp", "--mtp")
}
FORMS = {"bf16": None, "fp8": lambda folder: _fp8(folder, False), "fp8_mxfp4": lambda folder: _fp8(folder, True)}
