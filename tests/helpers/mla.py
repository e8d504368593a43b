"""What llama.cpp's converter writes for DeepSeek-style MLA checkpoints (deepseek2, deepseek32, glm_dsa):
GGUF names written out by hand from gguf-py's tensor map, and kv_b_proj split per head into k_b / v_b."""

from __future__ import annotations

import re

import torch

from tests.helpers.familycheck import Experts
from tests.helpers.names import FFN_MOE_NEXTN_NAMES, TOP_NAMES

LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    **FFN_MOE_NEXTN_NAMES,
}
INDEXER_NAMES = {  # DeepSeek-V3.2's / GLM-5's sparse-attention indexer
    "self_attn.indexer.wq_b.weight": "indexer.attn_q_b.weight",
    "self_attn.indexer.wk.weight": "indexer.attn_k.weight",
    "self_attn.indexer.k_norm.weight": "indexer.k_norm.weight",
    "self_attn.indexer.k_norm.bias": "indexer.k_norm.bias",
    "self_attn.indexer.weights_proj.weight": "indexer.proj.weight",
}


def split_kv_b(kv_b: torch.Tensor, n_head: int, nope: int, v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """attn_k_b [n_head, kv_lora, nope] and attn_v_b [n_head, v, kv_lora], head by head from kv_b's rows
    (per head: nope rows, the k part, transposed; then v rows)."""
    k_b, v_b = [], []
    for h in range(n_head):
        rows = kv_b[h * (nope + v) : (h + 1) * (nope + v)]
        k_b.append(rows[:nope].T)
        v_b.append(rows[nope:])
    return torch.stack(k_b), torch.stack(v_b)


def expected_mla_gguf(tensors: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """GGUF name -> float32 values, derived from (dequantized) HF tensors by the documented transforms; ``cfg``:
    the checkpoint's config (head counts and dims for the kv_b split). FP8 scales are left out."""
    n_head, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    exp: dict[str, torch.Tensor] = {}
    experts = Experts()
    for name, t in tensors.items():
        t = t.float()
        if name.endswith("_scale_inv"):
            continue
        if name in TOP_NAMES:
            exp[TOP_NAMES[name]] = t
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        bid, rest = int(m[1]), m[2]
        if experts.take(exp, bid, rest, t):
            pass
        elif rest == "self_attn.kv_b_proj.weight":
            exp[f"blk.{bid}.attn_k_b.weight"], exp[f"blk.{bid}.attn_v_b.weight"] = split_kv_b(t, n_head, nope, v)
        else:
            exp[f"blk.{bid}.{LAYER_NAMES.get(rest) or INDEXER_NAMES[rest]}"] = t
    return {**exp, **experts.stacked()}
