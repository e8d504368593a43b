"""Ling 3.0 (``BailingMoeV3ForCausalLM``, inclusionAI/Ling-3.0-*) -> GGUF arch ``bailingmoe3``.

Trunk: hybrid attention under ``model.layers.{i}.attention.`` -- Kimi delta attention
(KDA) layers, and every ``layer_group_size``-th layer (plus the tail) a gated MLA
layer; dense first layers (``first_k_dense_replace``), then MoE (sigmoid router
``mlp.gate`` + ``mlp.gate.expert_bias``, per-expert ``mlp.experts.{e}.*`` stacked,
``mlp.shared_experts.*``). Embeddings are ``model.word_embeddings``.

Transforms, as llama.cpp's converter (conversion/bailingmoe3.py) does them: KDA's
``{q,k,v}_conv1d`` -> [1, d, 1, kernel]; ``A_log`` -> ``ssm_a`` = exp(A_log) as
[n_head, 1]; ``dt_bias`` -> ``ssm_dt.bias``; ``f_proj`` -> ``ssm_f_a``; ``g_proj`` ->
``ssm_g_a`` in KDA layers but the head-wise ``attn_gate`` in MLA layers; MLA's
``kv_b_proj`` split per head into ``attn_k_b`` (transposed) and ``attn_v_b``.

The MTP layer ``model.layers.{num_hidden_layers}`` (always full attention, MoE):
``eh_proj``/``enorm``/``hnorm`` (-> ``nextn.*``) and ``final_layernorm`` (->
``layer_output_norm``, which src/models/bailingmoe3.cpp uses as the head's norm).

Ling 3.0's FP8 release with ``quantization_config.routed_experts_quant_method: mxfp4``
stores its routed experts as OCP MXFP4 (E8M0 scales under ``weight_scale_inv``): kept as
ggml MXFP4 blocks (mxfp4_experts.py). llama.cpp's bailingmoe3 converter has no MXFP4
path (its FP8 dequantization multiplies the packed codes by the exponent bytes and
writes half-width experts); mtpq writes what its mimo/deepseek4 converters write.

The pip ``gguf`` (0.19) mtpq depends on predates ``bailingmoe3``: GGUF names are
written out below from llama.cpp's gguf-py (constants.py, tensor_mapping.py), and the
``kda.safe_gate`` / ``kda.gate_lower_bound`` keys, which its GGUFWriter lacks, are
written by name.
"""

from __future__ import annotations

import re
from typing import Iterator

import torch
from gguf import MODEL_TENSOR as K
from gguf import GGUFWriter

from ...errors import InputError
from .. import validate as V
from ..base import (
    BlockSelection,
    ConvertFamily,
    Emit,
    as_llama_cpp_reads,
    check_unused,
    gguf_name,
    name_from_tables,
    weight_table,
)
from ..mxfp4_experts import GROUP as MXFP4_GROUP
from ..mxfp4_experts import Mxfp4Experts
from ..validate import Expected

# name inside ``model.layers.{N}.`` -> (GGUF kind, suffix); KDA/MLA-specific names are resolved in _name()
_COMMON: dict[str, tuple[K, str]] = {
    **weight_table(
        {
            "input_layernorm": K.ATTN_NORM,
            "post_attention_layernorm": K.FFN_NORM,
            "mlp.gate_proj": K.FFN_GATE,
            "mlp.up_proj": K.FFN_UP,
            "mlp.down_proj": K.FFN_DOWN,
            "mlp.gate": K.FFN_GATE_INP,
            "mlp.shared_experts.gate_proj": K.FFN_GATE_SHEXP,
            "mlp.shared_experts.up_proj": K.FFN_UP_SHEXP,
            "mlp.shared_experts.down_proj": K.FFN_DOWN_SHEXP,
            "mlp.experts.gate_proj": K.FFN_GATE_EXP,
            "mlp.experts.up_proj": K.FFN_UP_EXP,
            "mlp.experts.down_proj": K.FFN_DOWN_EXP,
            "attention.q_proj": K.ATTN_Q,
        }
    ),
    "mlp.gate.expert_bias": (K.FFN_EXP_PROBS_B, ".bias"),
}
_KDA: dict[str, tuple[K, str]] = {
    **weight_table(
        {
            "attention.k_proj": K.ATTN_K,
            "attention.v_proj": K.ATTN_V,
            "attention.q_conv1d": K.SSM_CONV1D_Q,
            "attention.k_conv1d": K.SSM_CONV1D_K,
            "attention.v_conv1d": K.SSM_CONV1D_V,
            "attention.f_proj": K.SSM_F_A,
            "attention.b_proj": K.SSM_BETA,
            "attention.g_proj": K.SSM_G_A,
            "attention.o_norm": K.SSM_NORM,
            "attention.o_proj": K.ATTN_OUT,
        }
    ),
    "attention.A_log": (K.SSM_A, ""),
    "attention.dt_bias": (K.SSM_DT, ".bias"),
}
_MLA = weight_table(
    {
        "attention.q_a_proj": K.ATTN_Q_A,
        "attention.q_a_layernorm": K.ATTN_Q_A_NORM,
        "attention.q_b_proj": K.ATTN_Q_B,
        "attention.kv_a_proj_with_mqa": K.ATTN_KV_A_MQA,
        "attention.kv_a_layernorm": K.ATTN_KV_A_NORM,
        "attention.g_proj": K.ATTN_GATE,
        "attention.dense": K.ATTN_OUT,
    }
)
_NEXTN = weight_table(
    {"eh_proj": K.NEXTN_EH_PROJ, "enorm": K.NEXTN_ENORM, "hnorm": K.NEXTN_HNORM, "final_layernorm": K.LAYER_OUT_NORM}
)
_TOP = {"model.word_embeddings.weight": K.TOKEN_EMBD, "model.norm.weight": K.OUTPUT_NORM, "lm_head.weight": K.OUTPUT}
_REQUIRED = (
    "layer_group_size",
    "short_conv_kernel_size",
    "head_dim",
    "kda_lower_bound",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "num_experts",
    "moe_intermediate_size",
    "moe_shared_expert_intermediate_size",
    "first_k_dense_replace",
    "routed_scaling_factor",
    "norm_topk_prob",
)


class BailingMoe3(Mxfp4Experts, ConvertFamily):
    hf_architectures = ("BailingMoeV3ForCausalLM",)
    arch = "bailingmoe3"
    required_hparams = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", *_REQUIRED)
    expert_count_keys = ("num_experts",)
    # the KDA short convolutions stay F32 (ggml's ssm_conv takes f32 weights only; llama.cpp's converter agrees)
    f32_kinds = (*ConvertFamily.f32_kinds, "ssm_conv1d_q", "ssm_conv1d_k", "ssm_conv1d_v")

    def __init__(self, ckpt):
        super().__init__(ckpt)
        hp, cfg = self.hparams, ckpt.folder / "config.json"
        # the variants llama.cpp's graph runs (its converter refuses the others the same way)
        if not hp.get("no_kda_lora", False):
            raise InputError(cfg, "KDA LoRA projections (no_kda_lora false) are not supported")
        if not hp.get("kda_safe_gate", False):
            raise InputError(cfg, "non-safe KDA gates (kda_safe_gate false) are not supported")
        if hp.get("gated_attention_proj_granularity_type") != "head_wise":
            raise InputError(cfg, "gated_attention_proj_granularity_type must be 'head_wise'")
        if self.n_mtp > 1:
            raise InputError(cfg, "num_nextn_predict_layers > 1: llama.cpp's bailingmoe3 runs one MTP layer")
        qc = hp.get("quantization_config")
        if isinstance(qc, dict) and (method := qc.get("routed_experts_quant_method")) is not None:
            if method != "mxfp4":  # vLLM's Ling loader knows no other either
                raise InputError(
                    cfg, f"quantization_config.routed_experts_quant_method {method!r} is not supported (mxfp4 only)"
                )
            self.find_mxfp4_experts(
                "_scale_inv",
                qc.get("routed_experts_group_size", MXFP4_GROUP),
                "quantization_config.routed_experts_group_size",
            )

    def is_full_attention(self, bid: int) -> bool:
        n, g = self.n_trunk, int(self.hparams["layer_group_size"])
        return bid >= n or (bid + 1) % g == 0 or bid >= n // g * g

    # -- metadata ----------------------------------------------------------------------

    def set_common_metadata(self, w: GGUFWriter, n_blocks: int) -> None:
        self._n_blocks = n_blocks
        super().set_common_metadata(w, n_blocks)

    def set_metadata(self, w: GGUFWriter) -> None:
        hp, arch = self.hparams, self.arch  # as conversion/bailingmoe3.py set_gguf_parameters
        kv_lora, nope, rope = hp["kv_lora_rank"], hp["qk_nope_head_dim"], hp["qk_rope_head_dim"]
        for key in ("attention.head_count_kv", "attention.key_length"):
            w.kv_data[0].pop(f"{arch}.{key}", None)  # replaced below, as llama.cpp's later writers do
        w.add_head_count_kv([1 if self.is_full_attention(i) else 0 for i in range(self._n_blocks)])
        w.add_vocab_size(hp["vocab_size"])
        w.add_ssm_conv_kernel(hp["short_conv_kernel_size"])
        w.add_kda_head_dim(hp["head_dim"])
        w.add_bool(f"{arch}.kda.safe_gate", bool(hp["kda_safe_gate"]))  # no GGUFWriter helper in gguf 0.19
        w.add_float32(f"{arch}.kda.gate_lower_bound", float(hp["kda_lower_bound"]))
        if (q_lora := hp.get("q_lora_rank")) is not None:
            w.add_q_lora_rank(q_lora)
        w.add_kv_lora_rank(kv_lora)
        w.add_rope_dimension_count(rope)
        w.add_key_length(kv_lora + rope)
        w.add_key_length_mla(nope + rope)
        w.add_value_length_mla(hp["v_head_dim"])
        w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(hp["moe_shared_expert_intermediate_size"])
        w.add_expert_shared_count(hp.get("num_shared_experts", 1))
        w.add_leading_dense_block_count(hp["first_k_dense_replace"])
        w.add_expert_weights_scale(hp["routed_scaling_factor"])
        w.add_expert_weights_norm(hp["norm_topk_prob"])
        n = self._n_blocks
        for key, add in (
            ("expert_swiglu_limit_list", w.add_swiglu_clamp_exp),
            ("share_expert_swiglu_limit_list", w.add_swiglu_clamp_shexp),
        ):
            if (values := hp.get(key)) is not None:  # MTP and missing entries: 0.0 (no clamp)
                values = [0.0 if v is None else float(v) for v in values[:n]]
                add(values + [0.0] * (n - len(values)))

    # -- tensors -----------------------------------------------------------------------

    def map_name(self, hf_name: str, n_blocks: int | None = None) -> str | None:
        return name_from_tables(
            hf_name,
            _TOP,
            lambda bid: {
                **_COMMON,
                **(_MLA if self.is_full_attention(bid) else _KDA),
                **(_NEXTN if bid >= self.n_trunk else {}),
            },
        )

    def tensors(self) -> Iterator[Emit]:
        """The base's loop, but with ``model.word_embeddings`` and MLA's kv_b split."""
        used: list[str] = []
        n_blocks = self.n_trunk + self.n_mtp

        def one(hf: str) -> Emit:
            used.append(hf)
            name = self.map_name(hf)
            transform, shape = self._transform(name, tuple(self.ckpt.shape(hf)))
            return self.emit(name, hf, transform, shape)

        self.expect_shape(
            self.require("model.word_embeddings.weight"), (self.hparams["vocab_size"], self.hparams["hidden_size"])
        )
        yield one("model.word_embeddings.weight")
        names = self.ckpt.names()
        for bid in range(n_blocks):
            p = f"model.layers.{bid}."
            mine = [n for n in names if n.startswith(p)]
            if not mine:
                if bid >= self.n_trunk and self.block_selection is BlockSelection.DROP:
                    continue
                hint = " (convert the trunk alone with --no-mtp)" if bid >= self.n_trunk else ""
                raise InputError(
                    self.ckpt.folder,
                    f"no tensors for layer {bid} (config.json has {self.n_trunk} layers + {self.n_mtp} MTP){hint}",
                )
            for hf in mine:
                rest = hf[len(p) :]
                if rest.startswith("mlp.experts."):
                    continue
                if rest == "attention.kv_b_proj.weight":
                    used.append(hf)
                    yield from self._split_kv_b(bid, hf)
                elif self.map_name(hf) is not None:
                    yield one(hf)
            if any(n.startswith(p + "mlp.experts.") for n in mine):
                yield from self.stack_experts(p, int(self.hparams["num_experts"]), used, bid)
        yield one(self.require("model.norm.weight"))
        if "lm_head.weight" in self.ckpt:
            yield one("lm_head.weight")
        check_unused(self.ckpt, used)

    def _transform(self, name: str, shape: tuple[int, ...]):
        kind = re.sub(r"^blk\.\d+\.", "", name)
        if kind.startswith("ssm_conv1d_"):  # [d, 1, k] or [d, k] -> [1, d, 1, k]
            return (lambda t: t.reshape(1, shape[0], 1, shape[-1])), (1, shape[0], 1, shape[-1])
        if kind == "ssm_a":
            n = 1
            for d in shape:
                n *= d
            return (lambda t: torch.exp(as_llama_cpp_reads(t)).reshape(-1, 1)), (n, 1)
        return None, shape

    def _split_kv_b(self, bid: int, hf: str) -> Iterator[Emit]:
        """kv_b_proj -> attn_k_b (k part, transposed) and attn_v_b, per head, as llama.cpp's MLA wants them."""
        hp = self.hparams
        n_head, nope, v, kv_lora = (
            hp["num_attention_heads"],
            hp["qk_nope_head_dim"],
            hp["v_head_dim"],
            hp["kv_lora_rank"],
        )
        self.expect_shape(hf, (n_head * (nope + v), kv_lora))
        yield self.emit(
            gguf_name(K.ATTN_K_B, bid),
            hf,
            lambda w: w.reshape(n_head, nope + v, kv_lora)[:, :nope, :].transpose(1, 2).contiguous(),
            shape=(n_head, kv_lora, nope),
        )
        yield self.emit(
            gguf_name(K.ATTN_V_B, bid),
            hf,
            lambda w: w.reshape(n_head, nope + v, kv_lora)[:, nope:, :].contiguous(),
            shape=(n_head, v, kv_lora),
        )

    def expected_tensors(self, keep_mtp: bool) -> Iterator[Expected]:
        hp = self.hparams
        h, vocab, nh = hp["hidden_size"], hp["vocab_size"], hp["num_attention_heads"]
        hd, k = hp["head_dim"], hp["short_conv_kernel_size"]
        nope, rope, v, kv_lora = hp["qk_nope_head_dim"], hp["qk_rope_head_dim"], hp["v_head_dim"], hp["kv_lora_rank"]
        n_exp, ff = hp["num_experts"], hp["moe_intermediate_size"]
        yield Expected("model.word_embeddings.weight", (vocab, h))
        yield Expected("model.norm.weight", (h,))
        yield Expected("lm_head.weight", (vocab, h), optional=bool(hp.get("tie_word_embeddings")))
        for bid in range(self.n_trunk + (self.n_mtp if keep_mtp else 0)):
            p = f"model.layers.{bid}."
            a = p + "attention."
            yield from V.norms(p, h, "input_layernorm", "post_attention_layernorm")
            if self.is_full_attention(bid):
                if (q_lora := hp.get("q_lora_rank")) is None:
                    yield Expected(a + "q_proj.weight", (nh * (nope + rope), h))
                else:
                    yield from (
                        Expected(a + "q_a_proj.weight", (q_lora, h)),
                        Expected(a + "q_a_layernorm.weight", (q_lora,)),
                        Expected(a + "q_b_proj.weight", (nh * (nope + rope), q_lora)),
                    )
                yield from (
                    Expected(a + "kv_a_proj_with_mqa.weight", (kv_lora + rope, h)),
                    Expected(a + "kv_a_layernorm.weight", (kv_lora,)),
                    Expected(a + "kv_b_proj.weight", (nh * (nope + v), kv_lora)),
                    Expected(a + "g_proj.weight", (nh, h)),
                    Expected(a + "dense.weight", (h, nh * v)),
                )
            else:
                d = nh * hd
                yield from (Expected(a + f"{x}_proj.weight", (d, h)) for x in ("q", "k", "v", "f", "g"))
                yield from (Expected(a + f"{x}_conv1d.weight", (d, 1, k)) for x in ("q", "k", "v"))
                yield from (
                    Expected(a + "b_proj.weight", (nh, h)),
                    Expected(a + "dt_bias", (d,)),
                    Expected(a + "o_norm.weight", (hd,)),
                    Expected(a + "o_proj.weight", (h, d)),
                )
                if self.resolve(a + "A_log") is not None:
                    yield Expected(a + "A_log", tuple(self.ckpt.shape(a + "A_log")))  # [n_head] or [1, 1, n_head, 1]
                else:
                    yield Expected(a + "A_log", (nh,))
            if bid < hp["first_k_dense_replace"]:
                yield from V.dense_ffn(p + "mlp.", h, hp["intermediate_size"])
            else:
                yield Expected(p + "mlp.gate.weight", (n_exp, h))
                yield Expected(p + "mlp.gate.expert_bias", (n_exp,))
                yield from V.routed_experts(p + "mlp.experts.", h, n_exp, ff)
                yield from V.dense_ffn(
                    p + "mlp.shared_experts.",
                    h,
                    hp["moe_shared_expert_intermediate_size"] * hp.get("num_shared_experts", 1),
                )
            if bid >= self.n_trunk:
                yield Expected(p + "eh_proj.weight", (h, 2 * h))
                yield from V.norms(p, h, "enorm", "hnorm", "final_layernorm")
