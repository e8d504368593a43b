"""Step3.5 Flash / Step3.7 Flash (``Step3p5ForCausalLM``, ``Step3p7ForConditionalGeneration``) -> GGUF arch ``step35``.

Trunk: GQA attention with q/k norms and a head-wise sigmoid gate (``self_attn.g_proj``
-> ``attn_gate``); layers alternate full and sliding-window attention
(``layer_types``), with their own head counts (``attention_other_setting``) and
partial RoPE (``partial_rotary_factors``: 0.5 full, 1.0 sliding). Dense first
layers (``mlp.*``), then MoE layers (``moe_layers_enum``): a sigmoid router
``moe.gate`` with a selection bias ``moe.router_bias``, experts stored already
stacked (``moe.{gate,up,down}_proj`` [E, rows, cols]) and a shared expert
``share_expert.*``. Per-layer SwiGLU clamps (``swiglu_limits[_shared]``).
Step3.7 Flash is the same text model under ``text_config`` beside a vision tower
(``vision_model.*``, ``vit_large_projector``) that llama.cpp writes to its mmproj file.

The MTP blocks are appended past ``num_hidden_layers`` (3 in the release, dense
MLP, sliding attention): ``model.layers.{N+i}.{eh_proj, enorm, hnorm}`` and
``model.layers.{N+i}.transformer.shared_head.{norm, output}`` (-> ``nextn.shared_head_*``),
plus a full decoder block named as the trunk's. ``layer_types``,
``partial_rotary_factors`` and the clamps carry entries for them (padded with
full attention / no clamp when a checkpoint truncates them), as llama.cpp's
converter (conversion/step3.py) writes them.

Transforms, as there: every ``*norm.weight`` is zero-centred (x_hat * (1 + w)) and
written as w + 1 (added in f32 for bf16 sources, in f16 for f16 ones, as llama.cpp
does); gates, router and experts are squeezed of size-1 dims.

RoPE: the releases (Step-3.5-Flash, Step-3.7-Flash) scale RoPE the Llama-3 way
(``rope_scaling.rope_type: llama3``, factor 2 over 131072 positions) on full-attention
layers only (``yarn_only_types: ["full_attention"]``), with ``rope_theta`` per layer.
llama.cpp's converter writes no scaling keys for that but one F32 tensor,
``rope_freqs.weight`` [head_dim / 2] (conversion/step3.py ``generate_extra_tensors``):
Llama-3 factors over the full-attention layers' rotary dims (head_dim x their
partial_rotary_factor), from the full-attention base (``rope_theta[0]``), padded with 1.0;
its graph applies them to non-SWA layers only. It writes the tensor in every mode
(--no-mtp and --mtp included); so does :meth:`Step35.tensors`.
"""

from __future__ import annotations

import math
import re
from typing import Iterator

import gguf
import torch
from gguf import GGUFWriter

from ...errors import InputError
from .. import validate as V
from ..base import (
    NEXTN_TENSORS,
    ConvertFamily,
    Emit,
    Transform,
    add_hparams,
    as_llama_cpp_reads,
    gguf_name,
    keeps_bytes,
)
from ..validate import Expected

_SQUEEZED = (
    ".self_attn.g_proj.weight",
    ".moe.gate.weight",
    ".moe.up_proj.weight",
    ".moe.gate_proj.weight",
    ".moe.down_proj.weight",
)


def _pad(values: list, n: int, default) -> list:
    """Per-block arrays: the checkpoint's entries, padded with ``default`` (or cut) to ``n`` blocks."""
    values = list(values)
    return (values + [default] * max(0, n - len(values)))[:n]


class Step35(ConvertFamily):
    hf_architectures = ("Step3p5ForCausalLM", "Step3p7ForConditionalGeneration")
    arch = "step35"
    # The releases' config.json is remote-code format (num_attention_groups, attention_other_setting, per-layer
    # rope_theta, layer_types covering the MTP layers). The transformers llama.cpp pins for its converter (4.57)
    # does not know step3p5 / step3p7, so llama.cpp reads the file as stored; transformers 5 knows them and
    # rewrites the config into keys llama.cpp's Step code does not read (KeyError 'num_attention_groups') and
    # layer lists cut to the trunk, dropping the MTP layers' entries. So the stored file is what counts here.
    stored_config = True
    # llama.cpp's converter writes the llama3 rope_freqs in every mode, its --mtp head-only file included
    # (tensors.mtp_only_keep: rope_freqs.weight is kept beside the head)
    per_expert_infix = "moe.experts."  # none in the releases: experts are stored stacked
    other_towers = ("vision_model.", "vit_large_projector.")  # Step3.7's vision tower: llama.cpp's mmproj file
    # the release nests the MTP shared head under ``transformer.`` and calls the head ``output``
    nextn_tensors = {
        **NEXTN_TENSORS,
        "transformer.shared_head.norm.weight": gguf.MODEL_TENSOR.NEXTN_SHARED_HEAD_NORM,
        "transformer.shared_head.output.weight": gguf.MODEL_TENSOR.NEXTN_SHARED_HEAD_HEAD,
    }

    required_hparams = ConvertFamily.required_hparams + (
        "num_attention_heads",
        "num_attention_groups",
        "head_dim",
        "intermediate_size",
        "sliding_window",
        "moe_num_experts",
        "moe_top_k",
        "moe_intermediate_size",
        "share_expert_dim",
    )

    # -- metadata -----------------------------------------------------------------------

    @property
    def rope_parameters(self) -> dict:
        """Step3.5 may give ``rope_theta`` per layer: the first entry is the full-attention base, the second SWA's."""
        rp = dict(self.hparams.get("rope_parameters") or self.hparams.get("rope_scaling") or {})
        if "full_attention" not in rp and "sliding_attention" not in rp and "rope_type" not in rp and "type" in rp:
            rp["rope_type"] = rp["type"]  # llama.cpp's TextModel mirrors the 4.x spelling the same way
        rp = dict(rp.get("full_attention", rp))
        theta = self.hparams.get("rope_theta")
        if isinstance(theta, list):
            rp["rope_theta"] = float(theta[0])
        elif theta is not None and "rope_theta" not in rp:
            rp["rope_theta"] = theta
        return rp

    def swa_rope_theta(self) -> float | None:
        theta = self.hparams.get("rope_theta")
        if isinstance(theta, list) and len(theta) > 1:
            return float(theta[1])
        return super().swa_rope_theta()

    def set_metadata(self, w: GGUFWriter) -> None:
        hp, n, K = self.hparams, self.n_blocks, gguf.Keys
        cfg = self.ckpt.folder / "config.json"
        layer_types = _pad(hp.get("layer_types") or [], n, "full_attention")
        factors = _pad(hp.get("partial_rotary_factors") or [], n, 0.5)
        want = [1.0 if t == "sliding_attention" else 0.5 for t in layer_types]
        if [float(f) for f in factors] != want:  # llama.cpp asserts the same: its graph assumes these factors
            raise InputError(
                cfg,
                f"partial_rotary_factors {factors} do not follow layer_types (0.5 for full attention, 1.0 for sliding)",
            )
        swa = [t == "sliding_attention" for t in layer_types]
        for key in (
            K.Attention.HEAD_COUNT,
            K.Attention.HEAD_COUNT_KV,
            K.Attention.VALUE_LENGTH,
            K.Attention.LAYERNORM_RMS_EPS,
        ):
            w.kv_data[0].pop(key.format(arch=self.arch), None)  # per-layer values replace the common scalars
        heads = [self._heads(bid) for bid in range(n)]
        w.add_head_count([n_head for n_head, _ in heads])
        w.add_head_count_kv([n_kv for _, n_kv in heads])
        w.add_sliding_window(hp["sliding_window"])
        w.add_sliding_window_pattern(swa)
        add_hparams(
            w,
            hp,
            (
                ("add_value_length", "head_dim"),
                ("add_expert_count", "moe_num_experts"),
                ("add_expert_used_count", "moe_top_k"),
                ("add_expert_feed_forward_length", "moe_intermediate_size"),
                ("add_expert_shared_feed_forward_length", "share_expert_dim"),
            ),
        )
        if (v := hp.get("moe_router_scaling_factor")) is not None:
            w.add_expert_weights_scale(v)
        if (v := hp.get("norm_expert_weight")) is not None:
            w.add_expert_weights_norm(v)
        w.add_leading_dense_block_count(self._leading_dense())
        w.add_moe_every_n_layers(int(hp.get("moe_every_n_layer", 1)))
        w.add_layer_norm_rms_eps(hp.get("rms_norm_eps", 1e-5))
        # MTP blocks default to no clamping (0.0)
        if (limits := hp.get("swiglu_limits")) is not None:
            w.add_swiglu_clamp_exp(_pad([0.0 if v is None else float(v) for v in limits], n, 0.0))
        if (limits := hp.get("swiglu_limits_shared")) is not None:
            w.add_swiglu_clamp_shexp(_pad([0.0 if v is None else float(v) for v in limits], n, 0.0))

    def _leading_dense(self) -> int:
        """As llama.cpp's converter reads it: the first MoE layer of a ``moe_layers_enum`` string, else 0."""
        layers = self._moe_layers()
        if isinstance(self.hparams.get("moe_layers_enum"), str) and layers:
            return max(0, min(layers))
        return 0

    def _moe_layers(self) -> set[int] | None:
        """The MoE layers ``moe_layers_enum`` lists ("3,4,...,44", or a list); None when config.json omits it."""
        enum = self.hparams.get("moe_layers_enum")
        if enum is None or (isinstance(enum, str) and not enum.strip()):
            return None
        items = enum.strip().split(",") if isinstance(enum, str) else enum
        try:
            if not isinstance(items, list) or any(isinstance(i, (bool, float)) for i in items):
                raise ValueError
            return {int(i) for i in items}
        except (TypeError, ValueError):
            raise InputError(
                self.ckpt.folder / "config.json", f"moe_layers_enum {enum!r} is not a list of layer numbers"
            ) from None

    def _is_moe(self, bid: int) -> bool:
        if (layers := self._moe_layers()) is not None:
            return bid in layers
        # without moe_layers_enum the implementations disagree (MoE from layer 1, or 3): the stored router decides
        return f"model.layers.{bid}.moe.gate.weight" in self.ckpt

    def _heads(self, bid: int) -> tuple[int, int]:
        """(query heads, KV groups) of block ``bid``: sliding layers take ``attention_other_setting``'s."""
        hp = self.hparams
        n_head, n_kv = hp["num_attention_heads"], hp["num_attention_groups"]
        if _pad(hp.get("layer_types") or [], self.n_trunk + self.n_mtp, "full_attention")[bid] == "sliding_attention":
            other = hp.get("attention_other_setting") or {}
            n_head, n_kv = other.get("num_attention_heads", n_head), other.get("num_attention_groups", n_kv)
        for key, v in (("num_attention_heads", n_head), ("num_attention_groups", n_kv)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(
                    self.ckpt.folder / "config.json",
                    f"attention_other_setting.{key} must be a positive integer, got {v!r}",
                )
        return n_head, n_kv

    # -- what config.json implies (checked before anything is planned) -------------------

    def expected_tensors(self, keep_mtp: bool) -> Iterator[Expected]:
        """Per block: GQA with q/k norms (head counts by layer type), the head-wise gate, then a dense MLP or
        (layers in moe_layers_enum) router + selection bias + stacked experts + shared expert; past the trunk
        the NextN tensors (the release's MTP blocks are sliding-attention, dense-MLP blocks)."""
        hp = self.hparams
        h, vocab, d = hp["hidden_size"], hp["vocab_size"], hp["head_dim"]
        yield from V.embeddings(h, vocab, tied=bool(hp.get("tie_word_embeddings")))
        for bid in range(self.n_trunk + (self.n_mtp if keep_mtp else 0)):
            p = f"model.layers.{bid}."
            n_head, n_kv = self._heads(bid)
            yield from V.norms(p, h, "input_layernorm", "post_attention_layernorm")
            yield from V.attention(
                p + "self_attn.", h, n_head, n_kv, d, bias=bool(hp.get("attention_bias")), qk_norm=True
            )
            yield from V.switched(
                hp.get("use_head_wise_attn_gate"), Expected(p + "self_attn.g_proj.weight", (n_head, h))
            )
            if self._is_moe(bid):
                n_exp, ff = hp["moe_num_experts"], hp["moe_intermediate_size"]
                yield Expected(p + "moe.gate.weight", (n_exp, h))
                yield from V.switched(hp.get("use_moe_router_bias"), Expected(p + "moe.router_bias", (n_exp,)))
                yield from (
                    Expected(p + f"moe.{proj}.weight", (n_exp, *shape))
                    for proj, shape in (("gate_proj", (ff, h)), ("up_proj", (ff, h)), ("down_proj", (h, ff)))
                )
                yield from V.dense_ffn(p + "share_expert.", h, hp["share_expert_dim"])
            else:
                yield from V.dense_ffn(p + "mlp.", h, hp["intermediate_size"])
            if bid >= self.n_trunk:
                yield from V.nextn_head(
                    p, h, vocab, norm="transformer.shared_head.norm", head="transformer.shared_head.output"
                )

    # -- tensors: the base's per-layer loop; these hooks are the family's differences ----

    def tensors(self) -> Iterator[Emit]:
        if (freqs := self._llama3_rope_freqs()) is not None:
            yield freqs
        yield from super().tensors()

    def _llama3_rope_freqs(self) -> Emit | None:
        """llama.cpp's ``rope_freqs.weight`` for ``rope_type: llama3`` (see the module docstring), computed with
        the same float32 torch ops and float64 Python arithmetic, so its bytes are llama.cpp's."""
        rp = self.rope_parameters
        if (rp.get("rope_type") or "").lower() != "llama3":
            return None
        hp, cfg = self.hparams, self.ckpt.folder / "config.json"
        theta = hp.get("rope_theta", 10000.0)  # not rope_parameters' own: llama.cpp reads the hparam
        base = float(theta[0] if isinstance(theta, list) else theta)
        storage_dim = int(
            hp["head_dim"] if hp.get("head_dim") is not None else hp["hidden_size"] // hp["num_attention_heads"]
        )
        # the first full-attention layer's rotary share, among the blocks this file holds (as stored, unpadded)
        pairs = zip(
            (hp.get("layer_types") or [])[: self.n_blocks], (hp.get("partial_rotary_factors") or [])[: self.n_blocks]
        )
        factor = next((float(f) for t, f in pairs if t == "full_attention"), None)
        if factor is None:  # llama.cpp's converter stops here too (StopIteration)
            raise InputError(
                cfg,
                "llama3 RoPE scaling applies to full-attention layers, but layer_types / "
                "partial_rotary_factors name none",
            )
        rotary_dim = int(storage_dim * factor)

        def load() -> torch.Tensor:
            freqs = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
            scale = float(rp.get("factor", 8.0))
            low, high = float(rp.get("low_freq_factor", 1.0)), float(rp.get("high_freq_factor", 4.0))
            old_ctx = int(rp.get("original_max_position_embeddings", 8192))
            low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
            out = []
            for freq in freqs:
                wavelen = 2 * math.pi / float(freq)
                if wavelen < high_wavelen:
                    out.append(1.0)
                elif wavelen > low_wavelen:
                    out.append(scale)
                else:
                    smooth = (old_ctx / wavelen - low) / (high - low)
                    out.append(1.0 / ((1.0 - smooth) / scale + smooth))
            out += [1.0] * (storage_dim // 2 - len(out))  # sliding layers' extra rotary dims stay unscaled
            return torch.tensor(out, dtype=torch.float32)

        name = gguf_name(gguf.MODEL_TENSOR.ROPE_FREQS)
        n = len(range(0, rotary_dim, 2))
        return Emit(name, (max(n, storage_dim // 2),), load, "config.json:rope_scaling (llama3)")

    def values(self, hf_name: str, shape: tuple[int, ...]) -> tuple[Transform | None, tuple[int, ...]]:
        if hf_name.endswith("norm.weight"):
            return (lambda t: as_llama_cpp_reads(t) + 1.0), shape
        if hf_name.endswith(_SQUEEZED):
            return keeps_bytes(lambda t: t.squeeze().contiguous()), tuple(d for d in shape if d != 1)
        return None, shape

    def modify(self, bid: int, rest: str, hf: str) -> list[Emit] | None:
        if rest == "moe.router_bias":  # gguf-py knows the selection bias as a bias: exp_probs_b.bias
            return [self.emit(self.map_name(hf + ".bias"), hf)]
        if bid >= self.n_trunk and rest.startswith("transformer.") and rest not in self.nextn_tensors:
            # llama.cpp drops the ``transformer.`` infix of any MTP tensor before naming it
            name = self.map_name(re.sub(r"\.transformer\.", ".", hf, count=1))
            return None if name is None else [self.emit(name, hf)]
        return None
