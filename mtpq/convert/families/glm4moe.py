"""GLM-4.5 / 4.6 / 4.7 (``Glm4MoeForCausalLM``) -> GGUF arch ``glm4moe``.

Trunk: dense first layers (``first_k_dense_replace``), then MoE layers with a
sigmoid router + correction bias, routed experts stacked into 3-D tensors and a
shared expert. The MTP block is ``model.layers.{num_hidden_layers}``: the
``eh_proj``/``enorm``/``hnorm``/``shared_head`` tensors plus a full decoder
block. GLM-4.6 checkpoints omit the head's ``embed_tokens`` and
``shared_head.head`` (tied to the trunk's): they are simply not written and the
runtime falls back to ``token_embd``/``output``.

Everything about the tensors is the base's declaration defaults: blocks at
``model.layers.{N}``, experts ``mlp.experts.{e}.*`` stacked, gguf-py's names.
"""

from __future__ import annotations

from typing import Iterator

import gguf
from gguf import GGUFWriter

from .. import validate as V
from ..base import ConvertFamily
from ..validate import Expected


class Glm4Moe(ConvertFamily):
    hf_architectures = ("Glm4MoeForCausalLM",)
    arch = "glm4moe"
    required_hparams = ConvertFamily.required_hparams + (
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "n_routed_experts",
        "moe_intermediate_size",
    )

    def expected_tensors(self, keep_mtp: bool) -> Iterator[Expected]:
        hp = self.hparams
        h, nh = hp["hidden_size"], hp["num_attention_heads"]
        hd = hp.get("head_dim") or h // nh

        def attention(p: str) -> list[Expected]:
            return V.attention(
                p + "self_attn.",
                h,
                nh,
                hp["num_key_value_heads"],
                hd,
                bias=bool(hp.get("attention_bias")),
                qk_norm=bool(hp.get("use_qk_norm")),
            )

        return V.deepseek_layout(
            self.hparams,
            self.n_trunk,
            self.blocks_checked(keep_mtp),
            attention,
            moe_ff=hp["moe_intermediate_size"],
            router_bias=True,
        )

    def set_metadata(self, w: GGUFWriter) -> None:
        hp = self.hparams
        head_dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
        partial = self.rope_parameters.get("partial_rotary_factor", hp.get("partial_rotary_factor", 0.5))
        w.add_rope_dimension_count(int(head_dim * partial))
        if (v := hp.get("moe_intermediate_size")) is not None:
            w.add_expert_feed_forward_length(v)
        if (v := hp.get("n_shared_experts")) is not None:
            w.add_expert_shared_count(v)
        if (v := hp.get("first_k_dense_replace")) is not None:
            w.add_leading_dense_block_count(v)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        if (v := hp.get("routed_scaling_factor")) is not None:
            w.add_expert_weights_scale(v)
        if (v := hp.get("norm_topk_prob")) is not None:
            w.add_expert_weights_norm(v)

    def write_vocab(self, w: GGUFWriter) -> None:
        from ..vocab import write_bpe_vocab

        # GLM's special ids, as llama.cpp's _set_vocab_glm sets them (skipped when a tokenizer lacks them)
        special = {"bos": "[gMASK]", "eot": "<|user|>", "unk": "<|endoftext|>", "eom": "<|observation|>"}
        write_bpe_vocab(w, self.ckpt.folder, self.vocab_size(), special)
