"""DeepSeek-V3 / R1 (``DeepseekV3ForCausalLM``) -> GGUF arch ``deepseek2``.

Trunk: MLA attention (``q_a_proj``/``q_a_layernorm``/``q_b_proj``, or a plain
``q_proj`` when ``q_lora_rank`` is null; ``kv_a_proj_with_mqa``,
``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``), dense first layers
(``first_k_dense_replace``), then MoE layers with a grouped sigmoid router plus
correction bias, routed experts stacked into 3-D tensors and shared experts.

MLA as llama.cpp writes it (absorption): ``kv_b_proj`` [n_head*(nope+v), kv_lora]
is NOT written; it is split per head into
  ``attn_k_b`` = k part transposed, torch shape [n_head, kv_lora, nope]
  ``attn_v_b`` = v part,            torch shape [n_head, v, kv_lora]
and ``head_count_kv`` is 1 (MLA runs as MQA over the compressed cache).

The MTP block is ``model.layers.{num_hidden_layers}`` (61 in DeepSeek-V3):
``eh_proj``/``enorm``/``hnorm``/``embed_tokens``/``shared_head.{head,norm}`` ->
``blk.N.nextn.*`` plus a full MLA + MoE decoder block named as the trunk's.
llama.cpp's converter drops this block for deepseek2; its loader reads it
(``blk.N.nextn.*``, counted in ``block_count``) and drafts with it.
"""

from __future__ import annotations

from typing import Iterator

import gguf
import torch
from gguf import MODEL_TENSOR as MT
from gguf import GGUFWriter

from .. import validate as V
from ..base import ConvertFamily, Emit, gguf_name
from ..validate import Expected

_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "num_attention_heads",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
)


class DeepseekV3(ConvertFamily):
    hf_architectures = ("DeepseekV3ForCausalLM",)
    arch = "deepseek2"

    drop_tied_output = True
    required_hparams = ("num_hidden_layers", "intermediate_size") + _REQUIRED

    def expected_tensors(self, keep_mtp: bool) -> Iterator[Expected]:
        def attention(p: str) -> Iterator[Expected]:
            return (Expected(p + rest, shape) for rest, shape in self.mla_shapes().items())

        moe_ff = self.hp("moe_intermediate_size", "intermediate_size")
        return V.deepseek_layout(
            self.hparams,
            self.n_trunk,
            self.blocks_checked(keep_mtp),
            attention,
            moe_ff=moe_ff,
            router_bias=self.router_bias(),
        )

    def router_bias(self) -> bool | None:
        """Whether the routers store ``e_score_correction_bias``, as the reference implementations create it:
        transformers' DeepseekV3 (and GLM-4.7-Flash, GLM-5, V3.2) router always has one, so a config.json
        saved by transformers, which has no ``topk_method``, comes with it; DeepSeek's own remote code creates it
        for ``topk_method`` "noaux_tc", its default. Any other ``topk_method``: one reference creates it, the other
        does not, so either is accepted."""
        return True if self.hparams.get("topk_method", "noaux_tc") == "noaux_tc" else None

    @property
    def rope_parameters(self) -> dict:
        rp = super().rope_parameters
        if "rope_type" not in rp and "type" in rp:  # DeepSeek-V3's config.json says {"type": "yarn"}
            rp["rope_type"] = rp["type"]
        return rp

    # -- metadata -----------------------------------------------------------------------

    def _replace(self, w: GGUFWriter, key: str) -> None:
        """Forget a key the common hparams wrote, so the MLA value replaces it without a duplicate warning."""
        w.kv_data[0].pop(key.format(arch=self.arch), None)

    def set_metadata(self, w: GGUFWriter) -> None:
        hp, K = self.hparams, gguf.Keys
        kv_lora, rope = hp["kv_lora_rank"], hp["qk_rope_head_dim"]
        # MLA runs as MQA with one wide (kv_lora + rope) head; head_dim in transformers' config is the rope part
        for key in (K.Attention.HEAD_COUNT_KV, K.Attention.KEY_LENGTH, K.Attention.VALUE_LENGTH):
            self._replace(w, key)
        w.add_head_count_kv(1)
        has_moe = hp.get("n_routed_experts") is not None
        dense = hp.get("first_k_dense_replace")
        w.add_leading_dense_block_count(dense if dense is not None else (0 if has_moe else self.n_trunk))
        w.add_vocab_size(hp["vocab_size"])
        if hp.get("q_lora_rank") is not None:
            w.add_q_lora_rank(hp["q_lora_rank"])
        w.add_kv_lora_rank(kv_lora)
        w.add_key_length(kv_lora + rope)
        w.add_value_length(kv_lora)
        w.add_key_length_mla(hp["qk_nope_head_dim"] + rope)
        w.add_value_length_mla(hp["v_head_dim"])
        w.add_expert_feed_forward_length(self.hp("moe_intermediate_size", "intermediate_size"))
        w.add_expert_shared_count(hp.get("n_shared_experts") or 0)
        if (v := hp.get("routed_scaling_factor")) is not None:
            w.add_expert_weights_scale(v)
        if hp.get("norm_topk_prob"):
            w.add_expert_weights_norm(True)
        key = K.LLM.EXPERT_GATING_FUNC.format(arch=self.arch)
        if key not in w.kv_data[0]:
            # DeepSeek-V3 always routes with sigmoid; without this key llama.cpp's loader assumes softmax (V2)
            w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_rope_dimension_count(rope)
        self.set_yarn(w)

    def set_yarn(self, w: GGUFWriter) -> None:
        """The yarn details llama.cpp's converter writes besides type/factor/original context."""
        rp, K = self.rope_parameters, gguf.Keys.Rope
        if rp.get("rope_type") == "yarn" and rp.get("factor") is not None:
            extra = (
                (K.SCALING_YARN_EXT_FACTOR, rp.get("extrapolation_factor"), w.add_rope_scaling_yarn_ext_factor),
                (
                    K.SCALING_YARN_ATTN_FACTOR,
                    rp.get("attention_factor", rp.get("attn_factor")),
                    w.add_rope_scaling_yarn_attn_factor,
                ),
                (K.SCALING_YARN_BETA_FAST, rp.get("beta_fast"), w.add_rope_scaling_yarn_beta_fast),
                (K.SCALING_YARN_BETA_SLOW, rp.get("beta_slow"), w.add_rope_scaling_yarn_beta_slow),
            )
            for key, value, add in extra:
                if value is not None and key.format(arch=self.arch) not in w.kv_data[0]:
                    add(value)
        if (v := rp.get("mscale_all_dim")) is not None:
            # llama.cpp stores 0.1 * mscale_all_dim here and its deepseek2 loader divides by 0.1 again
            w.add_rope_scaling_yarn_log_mul(0.1 * v)

    # -- tensors: the base's per-layer loop, with MLA's shape checks and kv_b split ------------

    def check_block(self, bid: int, prefix: str) -> None:
        self._check_mla_shapes(prefix)

    def modify(self, bid: int, rest: str, hf: str) -> Iterator[Emit] | None:
        if rest == "self_attn.kv_b_proj.weight":
            return self._split_kv_b(bid, hf)
        return None

    def _check_mla_shapes(self, p: str) -> None:
        for rest, shape in self.mla_shapes().items():
            if not rest.endswith("layernorm.weight"):
                self.expect_shape(self.require(p + rest), shape)

    def mla_shapes(self) -> dict[str, tuple[int, ...]]:
        """The attention tensors of one MLA layer (names after ``model.layers.N.``) and their shapes."""
        hp = self.hparams
        n_head, rope, nope = hp["num_attention_heads"], hp["qk_rope_head_dim"], hp["qk_nope_head_dim"]
        kv_lora, hidden = hp["kv_lora_rank"], hp["hidden_size"]
        want = {
            "self_attn.kv_a_proj_with_mqa.weight": (kv_lora + rope, hidden),
            "self_attn.kv_b_proj.weight": (n_head * (nope + hp["v_head_dim"]), kv_lora),
            "self_attn.o_proj.weight": (hidden, n_head * hp["v_head_dim"]),
        }
        if hp.get("q_lora_rank") is None:
            want["self_attn.q_proj.weight"] = (n_head * (nope + rope), hidden)
        else:
            want["self_attn.q_a_proj.weight"] = (hp["q_lora_rank"], hidden)
            want["self_attn.q_b_proj.weight"] = (n_head * (nope + rope), hp["q_lora_rank"])
            want["self_attn.q_a_layernorm.weight"] = (hp["q_lora_rank"],)
        want["self_attn.kv_a_layernorm.weight"] = (kv_lora,)
        return want

    def _split_kv_b(self, bid: int, hf: str) -> Iterator[Emit]:
        """kv_b_proj -> attn_k_b (k part, transposed) and attn_v_b, as llama.cpp's MLA absorption wants them."""
        hp = self.hparams
        n_head, nope, v = hp["num_attention_heads"], hp["qk_nope_head_dim"], hp["v_head_dim"]
        kv_lora = hp["kv_lora_rank"]

        def k_b(w: torch.Tensor) -> torch.Tensor:
            return w.reshape(n_head, nope + v, kv_lora)[:, :nope, :].transpose(1, 2).contiguous()

        def v_b(w: torch.Tensor) -> torch.Tensor:
            return w.reshape(n_head, nope + v, kv_lora)[:, nope:, :].contiguous()

        yield self.emit(gguf_name(MT.ATTN_K_B, bid), hf, k_b, shape=(n_head, kv_lora, nope))
        yield self.emit(gguf_name(MT.ATTN_V_B, bid), hf, v_b, shape=(n_head, v, kv_lora))
