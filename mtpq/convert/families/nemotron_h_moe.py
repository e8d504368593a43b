"""Nemotron-H MoE (``NemotronHForCausalLM`` with experts: NVIDIA Nemotron 3) -> GGUF arch ``nemotron_h_moe``.

Trunk: a hybrid stack under ``backbone.layers.{i}`` whose mixer kind comes from
``hybrid_override_pattern`` (M = Mamba2, * = attention, E = MoE; or the list
``layers_block_type``); every layer has one pre-norm ``norm`` (-> ``attn_norm``).
Mamba2 mixers are transformed as llama.cpp's Mamba2 converter does: ``A_log`` ->
``ssm_a`` = -exp(A_log) as [n_heads, 1], ``D`` -> [n_heads, 1], ``conv1d`` squeezed
to [channels, kernel], the gated ``norm`` split into ``n_groups`` rows. MoE mixers:
sigmoid router ``gate`` + ``gate.e_score_correction_bias``, ReLU^2 experts with
only ``up_proj``/``down_proj`` (stacked into ``ffn_{up,down}_exps``) and a shared
expert. Nemotron 3 Super's LatentMoE (``moe_latent_size``) adds ``fc1_latent_proj``
[latent, hidden] / ``fc2_latent_proj`` [hidden, latent] around the routed experts,
which then work on the latent width: ``ffn_latent_down`` / ``ffn_latent_up`` and the
``moe_latent_size`` key, as llama.cpp's converter writes them (its MTP block too).

The MTP head is stored apart, as two sub-layers (``mtp_hybrid_override_pattern``
"*E"), which llama.cpp's converter (conversion/nemotron.py) folds into ONE block
``blk.{N}``: ``mtp.layers.0`` = ``enorm``/``hnorm``/``eh_proj`` (-> ``nextn.*``),
``norm`` (-> ``attn_norm``) and the attention mixer; ``mtp.layers.1`` = ``norm``
(-> ``post_attention_norm``), the MoE mixer and ``final_layernorm`` (->
``nextn.shared_head_norm``). The per-layer metadata arrays count that block both
as an attention and as an MoE layer. Only one MTP layer is supported, as there.

Metadata follows llama.cpp's chain (TextModel -> Llama -> Granite -> GraniteMoe ->
GraniteHybrid -> NemotronH): no RoPE, so ``context_length`` is its fixed 2**20;
``rope.dimension_count`` is hidden_size / heads (Granite drops ``head_dim`` before
Llama computes it); the vocabulary is padded to a multiple of 8.

GGUF names are written out below (the pip gguf 0.19 knows the arch but not its
nextn/post-norm entries), from llama.cpp's gguf-py tensor map for nemotron_h_moe.
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
    Transform,
    add_hparams,
    as_llama_cpp_reads,
    check_unused,
    gguf_name,
)
from ..validate import Expected

_KINDS = {"M": "mamba", "*": "attention", "E": "moe", "-": "mlp"}
_LIST_KINDS = {
    "mamba": "mamba",
    "linear_attention": "mamba",
    "attention": "attention",
    "full_attention": "attention",
    "moe": "moe",
    "mlp": "mlp",
}
_MIXER: dict[str, tuple[K, str]] = {  # name inside ``...mixer.`` -> (GGUF kind, suffix)
    "in_proj.weight": (K.SSM_IN, ".weight"),
    "conv1d.weight": (K.SSM_CONV1D, ".weight"),
    "conv1d.bias": (K.SSM_CONV1D, ".bias"),
    "dt_bias": (K.SSM_DT, ".bias"),
    "A_log": (K.SSM_A, ""),
    "D": (K.SSM_D, ""),
    "norm.weight": (K.SSM_NORM, ".weight"),
    "out_proj.weight": (K.SSM_OUT, ".weight"),
    "q_proj.weight": (K.ATTN_Q, ".weight"),
    "k_proj.weight": (K.ATTN_K, ".weight"),
    "v_proj.weight": (K.ATTN_V, ".weight"),
    "o_proj.weight": (K.ATTN_OUT, ".weight"),
    "gate.weight": (K.FFN_GATE_INP, ".weight"),
    "gate.e_score_correction_bias": (K.FFN_EXP_PROBS_B, ".bias"),
    "shared_experts.up_proj.weight": (K.FFN_UP_SHEXP, ".weight"),
    "shared_experts.down_proj.weight": (K.FFN_DOWN_SHEXP, ".weight"),
    "fc1_latent_proj.weight": (K.MOE_LATENT_DOWN, ".weight"),
    "fc2_latent_proj.weight": (K.MOE_LATENT_UP, ".weight"),
}
_MTP_OWN: dict[str, K] = {  # the MTP sub-layers' own tensors -> GGUF kind (all ".weight")
    "mtp.layers.0.enorm.weight": K.NEXTN_ENORM,
    "mtp.layers.0.hnorm.weight": K.NEXTN_HNORM,
    "mtp.layers.0.eh_proj.weight": K.NEXTN_EH_PROJ,
    "mtp.layers.0.norm.weight": K.ATTN_NORM,
    "mtp.layers.1.norm.weight": K.ATTN_POST_NORM,
    "mtp.layers.1.final_layernorm.weight": K.NEXTN_SHARED_HEAD_NORM,
}


class NemotronHMoe(ConvertFamily):
    hf_architectures = ("NemotronHForCausalLM",)
    arch = "nemotron_h_moe"
    required_hparams = (
        "vocab_size",
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "n_routed_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "moe_shared_expert_intermediate_size",
        "mamba_num_heads",
        "mamba_head_dim",
        "n_groups",
        "ssm_state_size",
        "conv_kernel",
    )

    @staticmethod
    def text_config(config: dict) -> dict:
        hp = {**config, **(config.get("llm_config") or {})}
        # llama.cpp takes the layer count from the list (a stored pattern string is checked against the count
        # instead: transformers derives the list from it, so the list cannot disagree with it)
        if isinstance(hp.get("layers_block_type"), list) and not isinstance(hp.get("hybrid_override_pattern"), str):
            hp["num_hidden_layers"] = len(hp["layers_block_type"])
        return hp

    def __init__(self, ckpt):
        cfg = ckpt.folder / "config.json"
        if "num_experts_per_tok" not in ConvertFamily.text_config(ckpt.hparams):
            raise InputError(cfg, "a Nemotron-H without experts (arch nemotron_h) has no MTP head; not supported")
        super().__init__(ckpt)
        pattern = self.hparams.get("hybrid_override_pattern") or self.hparams.get("layers_block_type")
        self.kinds = self._kinds(pattern, "hybrid_override_pattern")
        if len(self.kinds) != self.n_trunk:
            raise InputError(
                cfg, f"hybrid_override_pattern has {len(self.kinds)} layers, num_hidden_layers {self.n_trunk}"
            )
        if self.n_mtp > 1:
            raise InputError(cfg, "num_nextn_predict_layers > 1: only one MTP layer is supported (as in llama.cpp)")
        mtp = self.hparams.get("mtp_hybrid_override_pattern") or self.hparams.get("mtp_layers_block_type") or "*E"
        if self.n_mtp and self._kinds(mtp, "mtp_hybrid_override_pattern") != ["attention", "moe"]:
            raise InputError(cfg, f"mtp_hybrid_override_pattern {mtp!r}: only '*E' (attention, then MoE) is supported")
        self.d_inner = int(self.hparams["mamba_num_heads"]) * int(self.hparams["mamba_head_dim"])

    def _kinds(self, pattern, key: str) -> list[str]:
        table = _KINDS if isinstance(pattern, str) else _LIST_KINDS
        try:
            return [table[k] for k in pattern]
        except (KeyError, TypeError):
            raise InputError(self.ckpt.folder / "config.json", f"{key} {pattern!r} has unknown layer kinds") from None

    def vocab_size(self) -> int:
        v = int(self.hparams["vocab_size"])  # llama.cpp pads it for models with Mamba layers
        return -(v // -8) * 8 if "mamba" in self.kinds else v

    # -- metadata ----------------------------------------------------------------------

    def set_common_metadata(self, w: GGUFWriter, n_blocks: int) -> None:
        self._n_blocks = n_blocks
        super().set_common_metadata(w, n_blocks)

    def set_metadata(self, w: GGUFWriter) -> None:
        hp, n = self.hparams, self._n_blocks
        kinds = self.kinds + ["mtp"] * (n - self.n_trunk)  # the MTP block counts as attention and MoE
        for key in (
            "context_length",
            "feed_forward_length",
            "attention.head_count_kv",
            "attention.key_length",
            "attention.value_length",
            "expert_count",
            "expert_group_count",
            "expert_used_count",
        ):
            w.kv_data[0].pop(f"{self.arch}.{key}", None)  # replaced below, as llama.cpp's later writers do
        w.add_context_length(2**20)  # no RoPE: llama.cpp's GraniteHybrid writes its fixed 2**20
        w.add_feed_forward_length([hp["moe_intermediate_size"] if k in ("moe", "mtp") else 0 for k in kinds])
        w.add_head_count_kv([hp["num_key_value_heads"] if k in ("attention", "mtp") else 0 for k in kinds])
        if (v := self.hp("layer_norm_epsilon", "layer_norm_eps", "norm_epsilon")) is not None:
            w.add_layer_norm_eps(v)
        w.add_vocab_size(self.vocab_size())
        w.add_rope_dimension_count(hp["hidden_size"] // hp["num_attention_heads"])
        add_hparams(
            w,
            hp,
            (
                ("add_ssm_conv_kernel", "conv_kernel"),
                ("add_ssm_state_size", "ssm_state_size"),
                ("add_ssm_group_count", "n_groups"),
            ),
        )
        w.add_ssm_inner_size(self.d_inner)
        w.add_ssm_time_step_rank(hp["mamba_num_heads"])
        w.add_rope_scaling_finetuned(False)
        add_hparams(
            w,
            hp,
            (
                ("add_key_length", "head_dim"),
                ("add_value_length", "head_dim"),
                ("add_expert_feed_forward_length", "moe_intermediate_size"),
                ("add_expert_shared_feed_forward_length", "moe_shared_expert_intermediate_size"),
                ("add_expert_count", "n_routed_experts"),
                ("add_expert_shared_count", "n_shared_experts"),
                ("add_expert_weights_norm", "norm_topk_prob"),
                ("add_expert_weights_scale", "routed_scaling_factor"),
                ("add_expert_group_count", "n_group"),
                ("add_expert_used_count", "num_experts_per_tok"),
            ),
        )
        if (latent := hp.get("moe_latent_size")) is not None:
            w.add_moe_latent_size(latent)

    # -- tensors -----------------------------------------------------------------------

    def expected_tensors(self, keep_mtp: bool) -> Iterator[Expected]:
        hp = self.hparams
        h, vocab = hp["hidden_size"], hp["vocab_size"]
        yield Expected("backbone.embeddings.weight", (vocab, h))
        yield Expected("backbone.norm_f.weight", (h,))
        yield Expected("lm_head.weight", (vocab, h), optional=bool(hp.get("tie_word_embeddings")))
        for i, kind in enumerate(self.kinds):
            p = f"backbone.layers.{i}."
            yield Expected(p + "norm.weight", (h,))
            yield from self._mixer(p + "mixer.", kind)
        if keep_mtp and self.n_mtp:
            yield from (
                Expected(name, (h, 2 * h) if kind is K.NEXTN_EH_PROJ else (h,)) for name, kind in _MTP_OWN.items()
            )
            yield from self._mixer("mtp.layers.0.mixer.", "attention")
            yield from self._mixer("mtp.layers.1.mixer.", "moe")

    def _mixer(self, p: str, kind: str) -> Iterator[Expected]:
        hp = self.hparams
        h = hp["hidden_size"]
        if kind == "mamba":
            n_heads, groups, d_state = hp["mamba_num_heads"], hp["n_groups"], hp["ssm_state_size"]
            conv = self.d_inner + 2 * groups * d_state
            yield Expected(p + "in_proj.weight", (2 * self.d_inner + 2 * groups * d_state + n_heads, h))
            yield Expected(p + "conv1d.weight", (conv, 1, hp["conv_kernel"]))
            yield Expected(p + "conv1d.bias", (conv,), optional=not hp.get("use_conv_bias", True))
            yield from (Expected(p + n, (n_heads,)) for n in ("dt_bias", "A_log", "D"))
            yield Expected(p + "norm.weight", (self.d_inner,))
            yield Expected(p + "out_proj.weight", (h, self.d_inner))
        elif kind == "attention":
            yield from V.attention(p, h, hp["num_attention_heads"], hp["num_key_value_heads"], hp["head_dim"])
        elif kind == "moe":
            n_exp, ff, sff = (
                hp["n_routed_experts"],
                hp["moe_intermediate_size"],
                hp["moe_shared_expert_intermediate_size"],
            )
            latent = hp.get("moe_latent_size")
            yield Expected(p + "gate.weight", (n_exp, h))
            yield Expected(p + "gate.e_score_correction_bias", (n_exp,))
            if latent is not None:  # LatentMoE: the routed experts work on the latent width
                yield Expected(p + "fc1_latent_proj.weight", (latent, h))
                yield Expected(p + "fc2_latent_proj.weight", (h, latent))
            width = h if latent is None else latent
            for e in range(n_exp):
                yield Expected(f"{p}experts.{e}.up_proj.weight", (ff, width))
                yield Expected(f"{p}experts.{e}.down_proj.weight", (width, ff))
            yield Expected(p + "shared_experts.up_proj.weight", (sff, h))
            yield Expected(p + "shared_experts.down_proj.weight", (h, sff))
        else:
            raise InputError(self.ckpt.folder / "config.json", f"layer kind {kind!r} ('-', dense MLP) is not supported")

    def tensors(self) -> Iterator[Emit]:
        used: list[str] = []

        def one(name: str, hf: str) -> Emit:
            used.append(hf)
            transform, shape = self._transform(name, tuple(self.ckpt.shape(hf)))
            return self.emit(name, hf, transform, shape)

        yield one(gguf_name(K.TOKEN_EMBD), self.require("backbone.embeddings.weight"))
        for i in range(self.n_trunk):
            yield from self._block(i, f"backbone.layers.{i}.", one, used)
        if self.n_mtp and any(n.startswith("mtp.") for n in self.ckpt.names()):
            bid = self.n_trunk
            for hf, kind in _MTP_OWN.items():
                yield one(gguf_name(kind, bid), self.require(hf))
            for j in (0, 1):
                yield from self._mixer_tensors(bid, f"mtp.layers.{j}.mixer.", one, used)
        elif self.n_mtp and self.block_selection is not BlockSelection.DROP:
            raise InputError(
                self.ckpt.folder,
                f"no tensors for the MTP layer (mtp.layers.*; config.json has "
                f"{self.n_mtp} MTP) (convert the trunk alone with --no-mtp)",
            )
        yield one(gguf_name(K.OUTPUT_NORM), self.require("backbone.norm_f.weight"))
        if "lm_head.weight" in self.ckpt:
            yield one(gguf_name(K.OUTPUT), "lm_head.weight")
        check_unused(self.ckpt, used)

    def _block(self, bid: int, p: str, one, used: list[str]) -> Iterator[Emit]:
        if not any(n.startswith(p) for n in self.ckpt.names()):
            raise InputError(self.ckpt.folder, f"no tensors for layer {bid} (config.json has {self.n_trunk} layers)")
        yield one(gguf_name(K.ATTN_NORM, bid), self.require(p + "norm.weight"))
        yield from self._mixer_tensors(bid, p + "mixer.", one, used)

    def _mixer_tensors(self, bid: int, p: str, one, used: list[str]) -> Iterator[Emit]:
        names = [n for n in self.ckpt.names() if n.startswith(p)]
        for hf in names:
            if (entry := _MIXER.get(hf[len(p) :])) is not None:
                yield one(gguf_name(entry[0], bid, entry[1]), hf)
        if any(n.startswith(p + "experts.") for n in names):
            for proj, kind in (("up_proj", K.FFN_UP_EXP), ("down_proj", K.FFN_DOWN_EXP)):
                parts = [f"{p}experts.{e}.{proj}.weight" for e in range(int(self.hparams["n_routed_experts"]))]
                used.extend(parts)
                yield self.stack(gguf_name(kind, bid), parts)

    def _transform(self, name: str, shape: tuple[int, ...]) -> tuple[Transform | None, tuple[int, ...]]:
        """llama.cpp's Mamba2 reshapes (values unchanged but for ssm_a = -exp(A_log))."""
        kind = re.sub(r"^blk\.\d+\.", "", name)
        if kind == "ssm_a":
            return (lambda t: -torch.exp(as_llama_cpp_reads(t)).reshape(-1, 1)), (shape[0], 1)
        if kind == "ssm_d":
            return (lambda t: t.reshape(-1, 1)), (shape[0], 1)
        if kind == "ssm_conv1d.weight":
            return (lambda t: t.squeeze(1)), (shape[0], shape[-1])
        if kind == "ssm_norm.weight":
            g = int(self.hparams["n_groups"])
            return (lambda t: t.reshape(g, -1)), (g, shape[0] // g)
        if kind in ("attn_q.weight", "attn_k.weight"):
            n_head = int(self.hparams["num_attention_heads"])
            n = n_head if kind == "attn_q.weight" else int(self.hparams["num_key_value_heads"])
            return (lambda t: _rope_permute(t, n)), shape
        return None, shape


def _rope_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute (GraniteHybrid keeps undo_permute): within each head, rows
    [r0..r(d/2-1), r(d/2)..] -> interleaved pairs. q and k get the same per-head reorder, so attention
    scores (Nemotron-H uses no RoPE) are unchanged."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
