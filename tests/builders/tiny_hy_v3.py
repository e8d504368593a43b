"""A tiny Hy3 checkpoint (``HYV3ForCausalLM``, tencent/Hy3) with its MTP layer appended past the trunk.

Names and config keys follow the release (tencent/Hy3's safetensors index and
config.json, which transformers' hy_v3 conversion mapping renames on load):
- GQA attention with q/k norms; layer 0 dense (``mlp.{gate,up,down}_proj``,
  ``first_k_dense_replace: 1``), the others MoE: a sigmoid router
  ``mlp.router.gate``, a selection bias ``mlp.expert_bias``, per-expert
  ``mlp.experts.{e}.*`` and one shared expert ``mlp.shared_mlp.*``;
- the MTP layer ``model.layers.{N}``: ``eh_proj``, ``enorm``, ``hnorm``,
  ``final_layernorm`` (applied before the shared lm_head) plus a full MoE
  decoder block. No ``embed_tokens`` / ``shared_head.head`` of its own: the
  head shares the trunk's.
Weights are random (fixed seed), sized so every weight row is a multiple of 256.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.builders.tiny import (
    block_checkpoint,
    rand_attention,
    rand_block_norms,
    rand_mlp,
    rand_moe,
    rand_nextn,
    rand_qk_norms,
    release_config,
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MOE_NAMES = dict(gate="router.gate.weight", bias="expert_bias", shared="shared_mlp.")  # under mlp., as released


def config(vocab: int, **over) -> dict:
    return release_config("hy_v3", vocab_size=vocab, **over)


def block_tensors(bid: int, cfg: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    p, h = f"model.layers.{bid}.", cfg["hidden_size"]
    nh, nkv, hd, n_exp = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["num_experts"]
    ff, moe_ff = cfg["intermediate_size"], cfg["moe_intermediate_size"]
    t = rand_block_norms(p, h, gen) | rand_attention(p + "self_attn.", h, nh, nkv, hd, gen)
    t |= rand_qk_norms(p + "self_attn.", hd, gen)
    if bid < cfg["first_k_dense_replace"]:
        t.update(rand_mlp(p + "mlp.", ff, h, gen))
    else:  # MoE, the MTP layer too
        t |= rand_moe(p + "mlp.", n_exp, moe_ff, h, gen, shared_ff=moe_ff * cfg["num_shared_experts"], **MOE_NAMES)
    if bid >= cfg["num_hidden_layers"]:
        t.update(rand_nextn(p, h, gen, "final_layernorm"))
    return t


def hy_v3(folder: Path, **over) -> Path:
    """block_checkpoint's seed (0), dtype (float32), n_shards (2), with_mtp (True); other keywords: config()'s."""
    return block_checkpoint(folder, config, SPECIALS, block_tensors, **over)
