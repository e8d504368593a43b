"""What the DeepSeek-V3-shaped release manifests share (deepseek_v3*, deepseek_v32, glm5, glm47_flash): the
checkpoint layout and the encodings the releases store it in.

Layout (transformers' modeling_deepseek_v3.py / modeling_glm_moe_dsa.py / modeling_glm4_moe_lite.py, and the
released safetensors indexes cited by each manifest): ``model.layers.N.`` blocks, the first
``first_k_dense_replace`` with a dense MLP and the rest MoE (router ``mlp.gate.weight`` with its
``e_score_correction_bias``, per-expert projections, one shared expert); MLA attention with ``q_a``/``q_b``
(``q_a_layernorm``), ``kv_a_proj_with_mqa`` (``kv_a_layernorm``), ``kv_b_proj``, ``o_proj``; the MTP layer(s)
appended at ``num_hidden_layers`` as full MoE blocks beside ``eh_proj``, ``enorm``, ``hnorm``, their own
``embed_tokens`` and ``shared_head.{head,norm}`` (vLLM deepseek_mtp.py: DeepSeekMultiTokenPredictorLayer).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from . import LlamaCppRefuses, LlamaCppWritesOurs, block_norms, experts, fp8_block_scaled, mlp, nextn, trunk

# DeepSeek's tokenizer specials; BOS first so that the release's bos_token_id 0 / eos_token_id 1 name them
SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]

# The FP8 encoding DeepSeek declares from V3.2 on: e4m3 in 128x128 blocks, power-of-two (ue8m0) scales
FP8_UE8M0_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
}

# The config.json keys every DeepSeek-V3-shaped manifest holds with the same values: the sizes they are all shrunk
# to (hidden 256, 2 layers + 1 MTP, 4 experts, MLA ranks 256, qk_nope/rope/v 64/32/64) and the layout's fixed
# choices; each manifest adds its release's own keys with ``variant``.
SHARED_CONFIG = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 256,
    "intermediate_size": 512,
    "kv_lora_rank": 256,
    "moe_intermediate_size": 256,
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
    "tie_word_embeddings": False,
    "topk_group": 1,
    "use_cache": True,
    "v_head_dim": 64,
}

DROPS_MTP = (
    "llama.cpp's deepseek2 converter drops the MTP layer (DeepseekV2Model.skip_mtp) and refuses --mtp / "
    "--no-mtp for DeepseekV3ForCausalLM; mtpq keeps the layer (its trunk-only file is compared with "
    "llama.cpp's default one)"
)


def drops_mtp_layer(forms, reason: str = DROPS_MTP) -> dict:
    """The DIFFERS of a DeepseekV3ForCausalLM release: llama.cpp's default file is mtpq's --no-mtp one and its
    converter refuses --mtp (with LLAMA_CPP_MODE mapping mtpq's --no-mtp onto llama.cpp's default)."""
    refused = r"--mtp / --no-nextn are not supported for DeepseekV3ForCausalLM"
    return {
        **{(form, None): LlamaCppWritesOurs(reason, "--no-mtp") for form in forms},
        **{(form, "--mtp"): LlamaCppRefuses(reason, refused) for form in forms},
    }


INDEXER = (
    "self_attn.indexer.wq_b.weight",
    "self_attn.indexer.wk.weight",
    "self_attn.indexer.k_norm.weight",
    "self_attn.indexer.k_norm.bias",
    "self_attn.indexer.weights_proj.weight",
)


def ffn(cfg: dict, p: str, L: int) -> dict[str, tuple[int, ...]]:
    """Block L's MLP under ``p``: dense in the first ``first_k_dense_replace`` blocks, else the MoE block (router
    ``gate.weight`` with its ``e_score_correction_bias``, experts one by one, shared experts); GLM-4.5's too."""
    h, ne, mff = cfg["hidden_size"], cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    if L < cfg["first_k_dense_replace"]:
        return mlp(p, cfg["intermediate_size"], h)
    return (
        {p + "gate.weight": (ne, h), p + "gate.e_score_correction_bias": (ne,)}
        | experts(p + "experts.", ne, mff, h)
        | mlp(p + "shared_experts.", mff * cfg["n_shared_experts"], h)
    )


def tensors(cfg: dict, indexed: Callable[[int], bool] = lambda bid: False) -> dict[str, tuple[int, ...]]:
    """Every stored tensor of a DeepSeek-V3-shaped checkpoint; ``indexed(bid)``: block bid carries the sparse
    attention's lightning indexer (DeepSeek-V3.2, GLM-5)."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    nh, nope, rope, vd = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    ql, kvl, n = cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["num_hidden_layers"]
    out = trunk(v, h)
    for L in range(n + cfg["num_nextn_predict_layers"]):
        p = f"model.layers.{L}."
        out |= block_norms(p, h)
        out |= {
            p + "self_attn.q_a_proj.weight": (ql, h),
            p + "self_attn.q_a_layernorm.weight": (ql,),
            p + "self_attn.q_b_proj.weight": (nh * (nope + rope), ql),
            p + "self_attn.kv_a_proj_with_mqa.weight": (kvl + rope, h),
            p + "self_attn.kv_a_layernorm.weight": (kvl,),
            p + "self_attn.kv_b_proj.weight": (nh * (nope + vd), kvl),
            p + "self_attn.o_proj.weight": (h, nh * vd),
        }
        if indexed(L):
            heads, dim = cfg["index_n_heads"], cfg["index_head_dim"]
            out |= dict(zip((p + k for k in INDEXER), ((heads * dim, ql), (dim, h), (dim,), (dim,), (heads, h))))
        out |= ffn(cfg, p + "mlp.", L)
        if L >= n:
            out |= nextn(p, h) | {
                p + "embed_tokens.weight": (v, h),
                p + "shared_head.head.weight": (v, h),
                p + "shared_head.norm.weight": (h,),
            }
    return out


def _rewrite(folder: Path, change: Callable[[str, torch.Tensor], torch.Tensor | None]) -> None:
    """Each stored tensor through ``change`` (None: dropped), the index kept consistent."""
    from safetensors.torch import load_file, save_file

    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for shard in sorted(set(index["weight_map"].values())):
        out = {}
        for name, t in load_file(str(folder / shard)).items():
            if (new := change(name, t)) is None:
                del index["weight_map"][name]
            else:
                out[name] = new
        save_file(out, str(folder / shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index, indent=2))


def f32(*suffixes: str):
    """An encoder storing the tensors whose names end with ``suffixes`` in F32 (the rest as built): the
    routers' correction bias as DeepSeek's releases store it, or the routers as transformers 5 saves them
    (``_keep_in_fp32_modules_strict``: gate.weight and e_score_correction_bias)."""

    def encode(folder: Path) -> None:
        _rewrite(folder, lambda name, t: t.float() if name.endswith(suffixes) else t)

    return encode


def fp8_release(keep: tuple[str, ...] = (), **quantization_config):
    """The FP8 form DeepSeek ships (and GLM-5-FP8): every projection e4m3 with 128x128 ``weight_scale_inv``
    tiles, except the tensors whose names end with ``keep`` (stored bf16, no scale: DeepSeek-V3's eh_proj and
    shared_head.head, V3.2's indexer weights_proj), embeddings, norms and routers; the correction bias F32."""

    def encode(folder: Path) -> None:
        from safetensors.torch import load_file

        index = json.loads((folder / "model.safetensors.index.json").read_text())
        kept = {}
        for shard in sorted(set(index["weight_map"].values())):
            kept.update({n: t for n, t in load_file(str(folder / shard)).items() if n.endswith(keep)})
        fp8_block_scaled(folder, **quantization_config)

        def restore(name: str, t: torch.Tensor) -> torch.Tensor | None:
            if name in kept:
                return kept[name]
            if name.endswith("_scale_inv") and name[: -len("_scale_inv")] in kept:
                return None
            return t.float() if name.endswith("e_score_correction_bias") else t

        _rewrite(folder, restore)

    return encode
