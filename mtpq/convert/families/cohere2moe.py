"""Cohere2 MoE (``Cohere2MoeForCausalLM``, CohereLabs/North-Mini-Code-1.0) -> GGUF arch ``cohere2moe``.

Trunk: parallel blocks (one ``input_layernorm`` feeds attention and the MLP; a
bias-free LayerNorm, or RMSNorm when ``rms_norm_eps`` is set), GQA attention,
sliding-window and full layers (``layer_types``, stored or as transformers derives
them from ``sliding_window_pattern``), dense prefix layers
(``mlp_layer_types`` / ``first_k_dense_replace``, ``prefix_dense_intermediate_size``
wide), then MoE layers: router ``mlp.gate``, per-expert ``mlp.experts.{e}.*``
stacked into ``*_exps`` (``intermediate_size`` wide) and shared experts
``mlp.shared_experts.*`` (averaged with the routed output). Logits are scaled by
``logit_scale``; embeddings are tied (no ``lm_head``).

The MTP block is ``model.layers.{num_hidden_layers}``: ``eh_proj``/``enorm``/``hnorm``
(and optionally ``embed_tokens``, ``shared_head.{head,norm}``) plus a full-attention
MoE block, as llama.cpp's converter (conversion/command_r.py) keeps it and
src/models/cohere2moe.cpp runs it. Attention/MLP biases, which llama.cpp's graph
lacks, are dropped when zero and refused otherwise (as llama.cpp's converter does).

The pip ``gguf`` (0.19) mtpq depends on predates ``cohere2moe``: the GGUF names are
written out below from llama.cpp's gguf-py (constants.py MODEL_ARCH.COHERE2MOE,
tensor_mapping.py), with gguf-py's MODEL_TENSOR kinds for the name templates.
"""

from __future__ import annotations

from typing import Iterator

import gguf
from gguf import MODEL_TENSOR as K
from gguf import GGUFWriter

from ...errors import InputError
from .. import validate as V
from ..base import LLAMA_BLOCK_NAMES, LLAMA_TOP_NAMES, ConvertFamily, Emit, name_from_tables, weight_table
from ..validate import Expected

_BLOCK_NAMES: dict[str, K] = {  # name inside ``model.layers.{N}.`` (".weight" dropped) -> GGUF kind
    **LLAMA_BLOCK_NAMES,
    "mlp.gate": K.FFN_GATE_INP,
    "mlp.shared_experts.gate_proj": K.FFN_GATE_SHEXP,
    "mlp.shared_experts.up_proj": K.FFN_UP_SHEXP,
    "mlp.shared_experts.down_proj": K.FFN_DOWN_SHEXP,
}
_WEIGHTS = weight_table(_BLOCK_NAMES)


class Cohere2Moe(ConvertFamily):
    hf_architectures = ("Cohere2MoeForCausalLM",)
    arch = "cohere2moe"
    # layer_types is not required as stored: transformers derives it (from sliding_window_pattern and the dense
    # prefix), and llama.cpp's converter reads that derived view
    required_hparams = (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "head_dim",
        "intermediate_size",
        "num_experts",
        "logit_scale",
        "sliding_window",
    )
    expert_count_keys = ("num_experts",)

    def __init__(self, ckpt):
        super().__init__(ckpt)
        hp, cfg = self.hparams, ckpt.folder / "config.json"
        if hp.get("num_shared_experts") and hp.get("shared_expert_combination_strategy", "average") != "average":
            raise InputError(cfg, "shared_expert_combination_strategy must be 'average' (llama.cpp's graph averages)")
        if hp.get("layer_types") is None:  # neither stored nor derived (transformers could not read config.json)
            raise InputError(cfg, "missing layer_types (needed to convert Cohere2MoeForCausalLM)")
        if len(hp["layer_types"]) != self.n_trunk:
            raise InputError(cfg, f"layer_types has {len(hp['layer_types'])} entries for {self.n_trunk} layers")

    def map_name(self, hf_name: str, n_blocks: int | None = None) -> str | None:
        return name_from_tables(hf_name, LLAMA_TOP_NAMES, lambda bid: _WEIGHTS)  # biases: see modify()

    def modify(self, bid: int, rest: str, hf: str) -> list[Emit] | None:
        if rest.endswith(".bias"):  # tiny 1-D tensors: checked now, before anything is written
            if self.ckpt.load(hf).any():
                raise InputError(self.ckpt.stored[hf].file, f"{hf} is not zero; llama.cpp's cohere2moe has no biases")
            return []
        return None

    def _n_dense(self) -> int:
        types = self.hparams.get("mlp_layer_types")
        if types is not None:
            return next((i for i, t in enumerate(types) if t != "dense"), len(types))
        return int(self.hparams.get("first_k_dense_replace") or 0)

    def expected_tensors(self, keep_mtp: bool) -> Iterator[Expected]:
        hp = self.hparams
        h, vocab, nh, hd = hp["hidden_size"], hp["vocab_size"], hp["num_attention_heads"], hp["head_dim"]
        n_exp, ff = hp["num_experts"], hp["intermediate_size"]
        yield from V.embeddings(h, vocab, tied=bool(hp.get("tie_word_embeddings", True)))
        for bid in range(self.n_trunk + (self.n_mtp if keep_mtp else 0)):
            p = f"model.layers.{bid}."
            yield from V.norms(p, h, "input_layernorm")
            yield from V.attention(
                p + "self_attn.", h, nh, hp.get("num_key_value_heads") or nh, hd, bias=bool(hp.get("attention_bias"))
            )
            if hp.get("attention_bias"):  # o_proj has one too (Cohere2MoeAttention)
                yield Expected(p + "self_attn.o_proj.bias", (h,))
            if bid < self._n_dense():
                yield from V.dense_ffn(p + "mlp.", h, self.hp("prefix_dense_intermediate_size", "intermediate_size"))
            else:
                yield Expected(p + "mlp.gate.weight", (n_exp, h))
                yield from V.routed_experts(p + "mlp.experts.", h, n_exp, ff)
                if n_shared := int(hp.get("num_shared_experts") or 0):
                    yield from V.dense_ffn(p + "mlp.shared_experts.", h, ff * n_shared)
            if bid >= self.n_trunk:
                yield Expected(p + "eh_proj.weight", (h, 2 * h))
                yield from V.norms(p, h, "enorm", "hnorm")
                yield Expected(p + "shared_head.norm.weight", (h,), optional=True)  # else output_norm
                yield Expected(p + "embed_tokens.weight", (vocab, h), optional=True)
                yield Expected(p + "shared_head.head.weight", (vocab, h), optional=True)

    def set_metadata(self, w: GGUFWriter) -> None:
        hp = self.hparams  # as conversion/command_r.py Cohere2MoeModel.set_gguf_parameters
        if (v := self.hp("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon")) is not None:
            w.add_layer_norm_eps(v)  # TextModel writes it; the base here knows only rms_norm_eps
        ff = hp["intermediate_size"]
        w.add_logit_scale(hp["logit_scale"])
        w.add_sliding_window(hp["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in hp["layer_types"]])
        w.add_vocab_size(hp["vocab_size"])
        w.add_expert_feed_forward_length(ff)
        w.add_leading_dense_block_count(self._n_dense())
        w.add_expert_weights_norm(hp.get("norm_topk_prob", False))
        if (n_shared := hp.get("num_shared_experts", 0)) > 0:
            w.add_expert_shared_count(n_shared)
            w.add_expert_shared_feed_forward_length(ff * n_shared)
        w.add_rope_dimension_count(hp["head_dim"])
        w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
