"""Hy3 (``HYV3ForCausalLM``, tencent/Hy3) -> GGUF arch ``hy_v3``.

Trunk: GQA attention with q/k norms; dense first layers (``mlp_layer_types``, or
``first_k_dense_replace``, or transformers' default: layer 0), then MoE layers: a sigmoid router ``mlp.router.gate``
with a selection bias ``mlp.expert_bias`` (GGUF ``exp_probs_b``, written without
a ``.bias`` suffix, as llama.cpp's converter names it and src/models/hy-v3.cpp
loads it), per-expert ``mlp.experts.{e}.*`` stacked into ``*_exps`` and a shared
expert ``mlp.shared_mlp.*``.

The MTP block is ``model.layers.{num_hidden_layers}`` (one in the release): the
``eh_proj``/``enorm``/``hnorm`` tensors, ``final_layernorm`` (the norm before the
shared lm_head -> ``nextn.shared_head_norm``) and a full MoE decoder block. It
has no ``embed_tokens`` / ``shared_head.head`` of its own (llama.cpp falls back
to the trunk's). llama.cpp's converter keeps this block too (conversion/hunyuan.py).

The pip ``gguf`` (0.19) mtpq depends on predates the ``hy_v3`` architecture, so
gguf-py's name map cannot be asked: the GGUF names are written out below from
llama.cpp's gguf-py (constants.py MODEL_ARCH.HY_V3, tensor_mapping.py), using
gguf-py's MODEL_TENSOR kinds for the name templates.
"""

from __future__ import annotations

from typing import Iterator

import gguf
from gguf import MODEL_TENSOR as K
from gguf import GGUFWriter

from .. import validate as V
from ..base import LLAMA_BLOCK_NAMES, LLAMA_TOP_NAMES, NEXTN_TENSORS, ConvertFamily, name_from_tables, weight_table
from ..validate import Expected

# name inside ``model.layers.{N}.`` (".weight" dropped) -> GGUF kind; the stacked expert names are the base loop's
_WEIGHT_NAMES: dict[str, K] = {
    **LLAMA_BLOCK_NAMES,
    "post_attention_layernorm": K.FFN_NORM,
    "self_attn.q_norm": K.ATTN_Q_NORM,
    "self_attn.k_norm": K.ATTN_K_NORM,
    "mlp.router.gate": K.FFN_GATE_INP,
    "mlp.shared_mlp.gate_proj": K.FFN_GATE_SHEXP,
    "mlp.shared_mlp.up_proj": K.FFN_UP_SHEXP,
    "mlp.shared_mlp.down_proj": K.FFN_DOWN_SHEXP,
}
_BLOCK_NAMES: dict[str, tuple[K, str]] = {
    **weight_table(_WEIGHT_NAMES),
    "mlp.expert_bias": (K.FFN_EXP_PROBS_B, ""),  # llama.cpp: tn(LLM_TENSOR_FFN_EXP_PROBS_B, i), no suffix
}


class HyV3(ConvertFamily):
    hf_architectures = ("HYV3ForCausalLM",)
    arch = "hy_v3"
    required_hparams = ConvertFamily.required_hparams + (
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "moe_intermediate_size",
    )
    expert_count_keys = ("num_experts", "num_local_experts")
    nextn_tensors = {**NEXTN_TENSORS, "final_layernorm.weight": K.NEXTN_SHARED_HEAD_NORM}

    def map_name(self, hf_name: str, n_blocks: int | None = None) -> str | None:
        return name_from_tables(hf_name, LLAMA_TOP_NAMES, lambda bid: _BLOCK_NAMES)

    def _is_dense(self, bid: int) -> bool:
        # config.json's own keys first: transformers derives mlp_layer_types (layer 0 dense) without reading a stored
        # first_k_dense_replace, which the release's engine (vLLM's hy_v3.py) builds its dense layers from
        stored = self.ckpt.config
        types = stored.get("mlp_layer_types")
        if types is None and stored.get("first_k_dense_replace") is None:
            types = self.hparams.get("mlp_layer_types")  # neither stored: transformers' default
        if types is not None and bid < len(types):
            return types[bid] == "dense"
        return bid < int(stored.get("first_k_dense_replace") or 0)

    def expected_tensors(self, keep_mtp: bool) -> Iterator[Expected]:
        hp = self.hparams
        h, vocab, nh = hp["hidden_size"], hp["vocab_size"], hp["num_attention_heads"]
        hd = hp.get("head_dim") or h // nh
        n_exp, ff = self.hp(*self.expert_count_keys), hp["moe_intermediate_size"]
        yield from V.embeddings(h, vocab, tied=bool(hp.get("tie_word_embeddings")))
        for bid in range(self.n_trunk + (self.n_mtp if keep_mtp else 0)):
            p = f"model.layers.{bid}."
            yield from V.norms(p, h, "input_layernorm", "post_attention_layernorm")
            # q/k norms are unconditional in the model (no config switch)
            yield from V.attention(
                p + "self_attn.",
                h,
                nh,
                hp["num_key_value_heads"],
                hd,
                bias=bool(hp.get("attention_bias")),
                qk_norm=True,
            )
            if self._is_dense(bid) or not n_exp:
                yield from V.dense_ffn(p + "mlp.", h, hp["intermediate_size"])
            else:
                yield Expected(p + "mlp.router.gate.weight", (n_exp, h))
                yield Expected(p + "mlp.expert_bias", (n_exp,))
                yield from V.routed_experts(p + "mlp.experts.", h, n_exp, ff)
                if n_shared := int(hp.get("num_shared_experts", 1) or 0):
                    yield from V.dense_ffn(p + "mlp.shared_mlp.", h, ff * n_shared)
            if bid >= self.n_trunk:
                yield Expected(p + "eh_proj.weight", (h, 2 * h))
                yield from V.norms(p, h, "enorm", "hnorm", "final_layernorm")

    def set_metadata(self, w: GGUFWriter) -> None:
        hp = self.hparams  # as conversion/hunyuan.py HYV3Model.set_gguf_parameters
        ff = hp["moe_intermediate_size"]
        w.add_expert_feed_forward_length(ff)
        w.add_expert_shared_feed_forward_length(ff * hp.get("num_shared_experts", 1))
        w.add_expert_weights_norm(hp.get("route_norm", True))
        w.add_expert_weights_scale(float(hp.get("router_scaling_factor", 1.0)))
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
