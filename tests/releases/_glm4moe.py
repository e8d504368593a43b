"""The tensors of a GLM-4.5-family release (``Glm4MoeForCausalLM``), shared by the glm4moe manifests.

Per layer (transformers' modeling_glm4_moe.py, the releases' safetensors indexes): biased q/k/v projections,
q/k RMSNorms where ``use_qk_norm``, dense MLP in the first ``first_k_dense_replace`` layers, else a sigmoid router
with its correction bias, per-expert projections and shared experts. The MTP layer ``model.layers.{N}`` adds
``eh_proj``/``enorm``/``hnorm``/``shared_head.norm`` (vLLM's glm4_moe_mtp.py) and, except in GLM-4.6/4.7 whose
head shares the trunk's, ``embed_tokens`` and ``shared_head.head``.
"""

from __future__ import annotations

from . import attention, block_norms, nextn, trunk
from ._deepseek import ffn


def tensors(cfg: dict, own_head: bool = True) -> dict[str, tuple[int, ...]]:
    h, v, d = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    nh, nkv, n = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    out = trunk(v, h)
    for L in range(n + cfg["num_nextn_predict_layers"]):
        p = f"model.layers.{L}."
        out |= block_norms(p, h)
        out |= attention(p + "self_attn.", h, nh, nkv, d, bias=True, qk_norm=bool(cfg.get("use_qk_norm")))
        out |= ffn(cfg, p + "mlp.", L)  # DeepSeek-V3's MoE block
        if L >= n:  # the MTP layer: NextN tensors beside a full MoE block
            out |= nextn(p, h, "shared_head.norm")
            if own_head:
                out |= {p + "embed_tokens.weight": (v, h), p + "shared_head.head.weight": (v, h)}
    return out
