"""GGUF names llama.cpp's converter gives the HF tensors that Llama-style MoE checkpoints with a DeepSeek-style
MTP block share, and those Qwen3-Next and Qwen3.5 share (written out by hand from gguf-py's tensor map: the
tests do not ask the code under test)."""

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

# Qwen3-Next and Qwen3.5 (gated delta-net and gated full-attention layers, one ``mtp.*`` block), as llama.cpp's
# conversion/qwen.py names them: name inside a layer -> name inside ``blk.{N}.``, the families' shared part
QWEN_GDN_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
# the MTP block's own tensors (outside ``mtp.layers.0``) -> name inside its ``blk.{N}.``
QWEN_MTP_HEAD_NAMES = {
    "mtp.fc.weight": "nextn.eh_proj.weight",
    "mtp.pre_fc_norm_embedding.weight": "nextn.enorm.weight",
    "mtp.pre_fc_norm_hidden.weight": "nextn.hnorm.weight",
    "mtp.norm.weight": "nextn.shared_head_norm.weight",
}
# RMSNorms computed as x_hat * (1 + w), which llama.cpp writes as 1 + w (name endings; the gated
# linear_attn.norm, x_hat * w, is not one)
QWEN_ZERO_CENTRED = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
    "model.norm.weight",
    "mtp.norm.weight",
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
)
