"""GGUF names llama.cpp's converter gives the HF tensors that Llama-style MoE checkpoints with a DeepSeek-style
MTP block share (written out by hand from gguf-py's tensor map: the tests do not ask the code under test)."""

from __future__ import annotations

TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# name inside ``model.layers.{N}.`` -> name inside ``blk.{N}.``: dense FFN, router, shared experts, NextN head
FFN_MOE_NEXTN_NAMES = {
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    "eh_proj.weight": "nextn.eh_proj.weight",
    "enorm.weight": "nextn.enorm.weight",
    "hnorm.weight": "nextn.hnorm.weight",
    "embed_tokens.weight": "nextn.embed_tokens.weight",
    "shared_head.head.weight": "nextn.shared_head_head.weight",
    "shared_head.norm.weight": "nextn.shared_head_norm.weight",
}
