"""What every convert family shares: common hparams, name mapping, types, the plan.

A family module subclasses :class:`ConvertFamily` and declares
- ``hf_architectures`` and ``arch`` (the GGUF architecture),
- ``set_metadata(w)``: family-specific hparams on top of :meth:`set_common_metadata`,
- for families whose blocks are ``model.layers.{N}`` (trunk, then the MTP blocks
  appended past ``num_hidden_layers``: GLM-4.5, DeepSeek-V3, Step3.5), data:
  ``expert_count_keys`` / ``per_expert_infix`` (per-expert tensors stacked into
  ``*_exps``), ``nextn_tensors`` (the MTP-only tensors and their GGUF kinds),
  ``drop_tied_output``; and per-tensor hooks: ``modify`` (llama.cpp's
  ``modify_tensors``: rename, split, transform one HF tensor) and ``check_block``.
  The one per-layer loop, :meth:`ConvertFamily.tensors`, walks them.
- families stored another way (Qwen3.5's ``mtp.*``) override ``tensors()``.
The base turns the tensors into a :class:`~mtpq.tensors.Plan` with roles and output types.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Callable, ClassVar, Container, Iterable, Iterator

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, LlamaFileType

from ..errors import InputError
from ..gguf_io import size_label
from ..tensors import Plan, TensorSpec, block_index, classify, mtp_only_keep
from . import stream, validate
from .checkpoint import HFCheckpoint
from .validate import Expected, Found


class BlockSelection(str, Enum):
    KEEP = "keep"  # trunk + MTP blocks (the default: the reason mtpq exists)
    DROP = "drop"  # --no-mtp: trunk only, no nextn_predict_layers
    ONLY = "only"  # --mtp-only: MTP blocks + token_embd, output_norm, output (llama.cpp's --mtp export)


OUTTYPES = {"f32": T.F32, "f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0}
FILE_TYPES = {
    T.F32: LlamaFileType.ALL_F32,
    T.F16: LlamaFileType.MOSTLY_F16,
    T.BF16: LlamaFileType.MOSTLY_BF16,
    T.Q8_0: LlamaFileType.MOSTLY_Q8_0,
}
# llama.cpp's llama_expert_gating_func_type, as its converter writes scoring_func (sqrtsoftplus: newer than gguf 0.19)
EXPERT_GATING = {"softmax": 1, "sigmoid": 2, "sqrtsoftplus": 4}

# The MTP-only tensors inside an MTP block (name inside ``model.layers.{N}.``) -> GGUF kind. Named here because
# the gguf-py we depend on (0.19) lacks the nextn entries in several architectures' tensor tables.
NEXTN_TENSORS: dict[str, gguf.MODEL_TENSOR] = {
    "eh_proj.weight": gguf.MODEL_TENSOR.NEXTN_EH_PROJ,
    "enorm.weight": gguf.MODEL_TENSOR.NEXTN_ENORM,
    "hnorm.weight": gguf.MODEL_TENSOR.NEXTN_HNORM,
    "embed_tokens.weight": gguf.MODEL_TENSOR.NEXTN_EMBED_TOKENS,
    "shared_head.head.weight": gguf.MODEL_TENSOR.NEXTN_SHARED_HEAD_HEAD,
    "shared_head.norm.weight": gguf.MODEL_TENSOR.NEXTN_SHARED_HEAD_NORM,
}


def gguf_name(kind: gguf.MODEL_TENSOR, bid: int | None = None, suffix: str = ".weight") -> str:
    """``blk.{bid}.<kind>.weight`` (or a top-level name) from gguf-py's table of tensor names."""
    return gguf.TENSOR_NAMES[kind].format(bid=bid) + suffix


Transform = Callable[[torch.Tensor], torch.Tensor]


def as_llama_cpp_reads(t: torch.Tensor) -> torch.Tensor:
    """A tensor as llama.cpp's converter holds it before its transforms: anything but f16/f32 upcast to f32
    (so bf16 + 1, exp(bf16) round once, as there)."""
    return t if t.dtype in (torch.float16, torch.float32) else t.float()


def keeps_bytes(fn: Transform) -> Transform:
    """Mark a transform that only adds or drops size-1 dims (``squeeze``): the stored bytes, in order, are
    the result's, so :meth:`ConvertFamily.emit` can still stream the tensor (map or convert it band by band)."""
    fn.keeps_bytes = True
    return fn


@dataclass
class Emit:
    """One tensor a family produces: GGUF name, torch-order shape, lazy values, where from."""

    name: str
    shape: tuple[int, ...]
    load: Callable[[], torch.Tensor]
    source: str
    # the bytes in a given output type, produced a slab at a time (:mod:`.stream`) instead of from the whole
    # ``load()``; None: ``load()`` encoded whole (stream.encode_loaded)
    encode: Callable[[T], np.ndarray] | None = None
    # a type the tensor keeps whatever the outtype (bits stored already quantized, e.g. MXFP4 experts)
    ggml_type: T | None = None


class ConvertFamily:
    hf_architectures: ClassVar[tuple[str, ...]] = ()
    arch: ClassVar[str] = ""
    # GGUF-name suffixes kept at F32 whatever the outtype (llama.cpp's converter does the same)
    f32_kinds: ClassVar[tuple[str, ...]] = ("ffn_gate_inp", "ffn_gate_inp_shexp", "ssm_conv1d")
    # config.json keys without which the family cannot convert (checked before anything else)
    required_hparams: ClassVar[tuple[str, ...]] = ("vocab_size", "hidden_size", "num_hidden_layers")

    # -- the declaration read by the generic per-layer loop (:meth:`tensors`) --------------
    block_prefix: ClassVar[str] = "model.layers."
    mtp_prefix: ClassVar[str | None] = None  # MTP block i at f"{mtp_prefix}{i}." (else block_prefix, N + i)
    expert_count_keys: ClassVar[tuple[str, ...]] = ("n_routed_experts",)  # hparams naming the routed experts
    per_expert_infix: ClassVar[str] = "mlp.experts."  # {infix}{e}.{gate,up,down}_proj.weight, stacked into *_exps
    nextn_tensors: ClassVar[dict[str, gguf.MODEL_TENSOR]] = NEXTN_TENSORS
    drop_tied_output: ClassVar[bool] = False  # lm_head skipped when tie_word_embeddings (as llama.cpp does)
    # name prefixes of a multimodal release's other towers (vision, audio): llama.cpp writes those to a separate
    # mmproj file, so they are left out here, knowingly (any other unused tensor is an error)
    other_towers: ClassVar[tuple[str, ...]] = ()
    # stored weights whose encoding (an FP8 scale layout, MXFP4 packing) the family itself checks and decodes
    own_encodings: Container[str] = frozenset()
    # True where llama.cpp's converter reads config.json as stored, without transformers' derived keys (the
    # transformers it pins does not know the model type): the family then reads exactly that too
    stored_config: ClassVar[bool] = False

    n_blocks: int  # set by plan(): the blocks it writes (trunk, + MTP unless --no-mtp); per-layer metadata covers them

    def __init__(self, ckpt: HFCheckpoint):
        self.ckpt = ckpt
        self.hparams = self.text_config(ckpt.config if self.stored_config else ckpt.hparams)
        validate.check_required_hparams(
            self.text_config(ckpt.config), self.required_hparams, self.hf_architectures[0], ckpt.folder / "config.json"
        )
        self.n_trunk = int(self.hparams["num_hidden_layers"])
        self.n_mtp = int(self.hparams.get("num_nextn_predict_layers", 0) or 0)
        self._name_map: gguf.TensorNameMap | None = None
        self.block_selection = BlockSelection.KEEP  # set by plan(): --no-mtp converts checkpoints without MTP layers

    # -- hooks for families -------------------------------------------------------------

    @staticmethod
    def text_config(config: dict) -> dict:
        """The language model's hparams (multimodal configs nest them under text_config)."""
        return {**config, **config.get("text_config", {})}

    def set_metadata(self, w: GGUFWriter) -> None:
        raise NotImplementedError

    def modify(self, bid: int, rest: str, hf: str) -> Iterable[Emit] | None:
        """llama.cpp's ``modify_tensors``: the GGUF tensors made from HF tensor ``hf`` (``rest`` is its name
        inside block ``bid``), or None for the default naming (nextn table, then gguf-py's name map)."""
        return None

    def check_block(self, bid: int, prefix: str) -> None:
        """Refuse a block whose shapes contradict config.json (before any of its tensors is emitted)."""

    def tensors(self) -> Iterator[Emit]:
        """The one per-layer loop: token_embd, every block (trunk then MTP), output_norm, output."""
        ck = self.ckpt
        n_blocks = self.n_trunk + self.n_mtp
        self.expect_shape(
            self.require("model.embed_tokens.weight"), (self.hparams["vocab_size"], self.hparams["hidden_size"])
        )
        used: list[str] = []
        by_block: dict[int, list[str]] = {}
        for n in ck.names():
            if self.mtp_prefix and (i := layer_of(n, self.mtp_prefix)) is not None:
                by_block.setdefault(self.n_trunk + i, []).append(n)
            elif (bid := layer_of(n, self.block_prefix)) is not None:
                by_block.setdefault(bid, []).append(n)

        def one(hf: str) -> Emit:
            name = self.map_name(hf)
            if name is None:
                raise KeyError(hf)
            used.append(hf)
            return self.emit(name, hf)

        yield one("model.embed_tokens.weight")
        for bid in range(n_blocks):
            mtp = bid >= self.n_trunk
            p = f"{self.mtp_prefix}{bid - self.n_trunk}." if mtp and self.mtp_prefix else f"{self.block_prefix}{bid}."
            names = by_block.get(bid, [])
            if not names:
                if bid >= self.n_trunk and self.block_selection is BlockSelection.DROP:
                    continue  # many published copies lack the MTP layers: fine for a trunk-only GGUF
                hint = " (convert the trunk alone with --no-mtp)" if bid >= self.n_trunk else ""
                raise InputError(
                    ck.folder,
                    f"no tensors for layer {bid} (config.json has {self.n_trunk} layers + {self.n_mtp} MTP){hint}",
                )
            self.check_block(bid, p)
            experts = [n for n in names if n.startswith(p + self.per_expert_infix)]
            for hf in names:
                if hf in experts:
                    continue
                rest = hf[len(p) :]
                key = f"{self.block_prefix}{bid}.{rest}"  # as gguf-py's name map spells it
                if (custom := self.modify(bid, rest, hf)) is not None:
                    used.append(hf)
                    yield from custom
                elif mtp and rest in self.nextn_tensors:
                    used.append(hf)
                    yield self.emit(gguf_name(self.nextn_tensors[rest], bid), hf)
                elif (name := self.map_name(key)) is not None:
                    used.append(hf)
                    yield self.emit(name, hf)
                # anything else is reported by check_unused below
            if experts:
                yield from self.stack_experts(p, int(self.hp(*self.expert_count_keys)), used, bid)
        if "model.norm.weight" in ck:
            yield one("model.norm.weight")
        if "lm_head.weight" in ck:
            if self.drop_tied_output and self.hparams.get("tie_word_embeddings"):
                used.append("lm_head.weight")  # output falls back to token_embd
            else:
                yield one("lm_head.weight")
        check_unused(ck, used, ignore=self.other_towers)

    def expected_tensors(self, keep_mtp: bool) -> Iterator[Expected] | None:
        """Every HF tensor (logical name, shape) config.json implies; checked before anything is planned.
        Every family in the tree declares them; None (a new family before it does) leaves only the checks
        that need no declaration (dtypes, safetensors layout, the per-layer loop's own "no tensors for layer")."""
        return None

    def blocks_checked(self, keep_mtp: bool) -> int:
        """The blocks :meth:`expected_tensors` describes: the trunk, and the MTP blocks when they are kept."""
        return self.n_trunk + (self.n_mtp if keep_mtp else 0)

    def found_tensors(self) -> dict[str, Found]:
        """Every stored tensor under the name :meth:`expected_tensors` uses, with the shape of its values."""
        out = {}
        for name in self.logical_names():
            if (hf := self.resolve(name)) is not None:
                out[name] = Found(hf, self.logical_shape(hf), self.ckpt.stored[hf].file)
        return out

    def check(self, keep_mtp: bool) -> None:
        """All tensor-level checks of the checkpoint, on the data this family declares; before any tensor is
        planned."""
        validate.check_dtypes(self.ckpt, self.own_encodings)
        expected = self.expected_tensors(keep_mtp)
        if expected is not None:
            validate.check_tensors(
                expected,
                self.found_tensors(),
                folder=self.ckpt.folder,
                n_trunk=self.n_trunk,
                layout=validate.layout_line(self.n_trunk, self.n_mtp),
            )

    def resolve(self, name: str) -> str | None:
        """The stored name of an :meth:`expected_tensors` name, or None if the checkpoint lacks it."""
        return name if name in self.ckpt else None

    def logical_shape(self, hf_name: str) -> tuple[int, ...]:
        """The shape of the values a stored tensor holds (packed encodings hold more values than bytes)."""
        return tuple(self.ckpt.shape(hf_name))

    def logical_names(self) -> list[str]:
        """Every stored tensor under the names :meth:`expected_tensors` uses (the other towers left out)."""
        return [n for n in self.ckpt.names() if not n.startswith(self.other_towers)]

    def vocab_size(self) -> int:
        return int(self.hparams["vocab_size"])

    def write_vocab(self, w: GGUFWriter) -> None:
        from .vocab import write_bpe_vocab

        write_bpe_vocab(w, self.ckpt.folder, self.vocab_size())

    # -- shared helpers -----------------------------------------------------------------

    def hp(self, *keys: str, default=None):
        for k in keys:
            if k in self.hparams and self.hparams[k] is not None:
                return self.hparams[k]
        return default

    def swa_rope_theta(self) -> float | None:
        """The sliding-window layers' RoPE base, under the names llama.cpp's converter looks for."""
        return self.hp(
            "local_rope_theta", "rope_local_theta", "rope_theta_local", "swa_rope_theta", "rope_local_base_freq"
        )

    @property
    def rope_parameters(self) -> dict:
        rp = self.hparams.get("rope_parameters") or self.hparams.get("rope_scaling") or {}
        rp = dict(rp)
        if "rope_theta" not in rp and "rope_theta" in self.hparams:
            rp["rope_theta"] = self.hparams["rope_theta"]
        return rp

    def set_common_metadata(self, w: GGUFWriter, n_blocks: int) -> None:
        """The hparams llama.cpp's TextModel.set_gguf_parameters writes for every model."""
        w.add_block_count(n_blocks)
        # the hparam spellings llama.cpp's find_hparam tries, in its order
        if (
            v := self.hp(
                "max_position_embeddings",
                "n_ctx",
                "n_positions",
                "max_length",
                "max_sequence_length",
                "model_max_length",
            )
        ) is not None:
            w.add_context_length(v)
        if (v := self.hp("hidden_size", "n_embd", "dim")) is not None:
            w.add_embedding_length(v)
        if (
            v := self.hp(
                "prefix_dense_intermediate_size",
                "dense_intermediate_size",
                "intermediate_size",
                "n_inner",
                "hidden_dim",
            )
        ) is not None:
            w.add_feed_forward_length(v)
        if (v := self.hp("num_attention_heads", "n_head", "n_heads")) is not None:
            w.add_head_count(v)
        if (v := self.hp("num_key_value_heads", "n_kv_heads")) is not None:
            w.add_head_count_kv(v)
        rp = self.rope_parameters
        if rp.get("rope_type") == "yarn" and rp.get("factor") is not None:
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(rp["factor"])
            w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
        elif rp.get("rope_type") == "linear" and rp.get("factor") is not None:
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rp["factor"])
        if (v := rp.get("rope_theta")) is not None:
            w.add_rope_freq_base(v)
        if (v := self.swa_rope_theta()) is not None:
            w.add_rope_freq_base_swa(v)
        if (v := self.hp("rms_norm_eps", "norm_eps")) is not None:
            w.add_layer_norm_rms_eps(v)
        if (v := self.hp("num_local_experts", "num_experts", "n_routed_experts")) is not None:
            w.add_expert_count(v)
        if (v := self.hp("num_experts_per_tok", "num_experts_per_token", "top_k_experts")) is not None:
            w.add_expert_used_count(v)
        if (v := self.hparams.get("n_group")) is not None:
            w.add_expert_group_count(v)
        if (v := self.hparams.get("topk_group")) is not None:
            w.add_expert_group_used_count(v)
        if (
            v := self.hp(
                "score_function",
                "scoring_func",
                "score_func",
                "moe_router_activation",
                "moe_router_activation_func",
                "expert_selection_fn",
            )
        ) is not None:
            if v not in EXPERT_GATING:
                raise InputError(self.ckpt.folder / "config.json", f"unsupported scoring_func {v!r}")
            w.add_uint32(gguf.Keys.LLM.EXPERT_GATING_FUNC.format(arch=self.arch), EXPERT_GATING[v])
        if (v := self.hparams.get("head_dim")) is not None:
            w.add_key_length(v)
            w.add_value_length(v)

    def values(self, hf_name: str, shape: tuple[int, ...]) -> tuple[Transform | None, tuple[int, ...]]:
        """The family's value transform of one HF tensor (e.g. +1 on zero-centred norms) and the shape it gives;
        applied to every tensor :meth:`emit` reads, before any transform the caller adds."""
        return None, shape

    def emit(
        self, name: str, hf_name: str, transform: Transform | None = None, shape: tuple[int, ...] | None = None
    ) -> Emit:
        """A GGUF tensor read from one HF tensor, optionally transformed (shape must then be given if it changes)."""
        load = self.ckpt.loader(hf_name)
        own, own_shape = self.values(hf_name, tuple(self.ckpt.shape(hf_name)))
        for step in (own, transform):
            if step is not None:
                load = (lambda inner, f: lambda: f(inner()))(load, step)
        src = f"{self.ckpt.stored[hf_name].file.name}:{hf_name}"
        out_shape = tuple(shape if shape is not None else own_shape)
        stored = tuple(self.ckpt.shape(hf_name))
        # untransformed values (or only squeezed, rows unchanged: the same bytes) can be encoded band by band
        # (no full-size float32 copy of an FP8 tensor) or mapped as they are
        plain = all(getattr(f, "keeps_bytes", False) for f in (own, transform) if f is not None) and (
            own is None and transform is None or stored[-1:] == out_shape[-1:] and len(out_shape) > 1
        )
        encode = (lambda q: stream.encode_tensor(self.ckpt, hf_name, name, src, q)) if plain else None
        return Emit(name, out_shape, load, src, encode)

    def stack(self, name: str, hf_names: list[str]) -> Emit:
        """Stack per-expert 2-D tensors into one 3-D tensor [n_expert, rows, cols]."""
        missing = [n for n in hf_names if n not in self.ckpt]
        if missing:
            raise InputError(self.ckpt.folder, f"missing expert tensor {missing[0]}")
        shapes = {self.ckpt.shape(n) for n in hf_names}
        if len(shapes) != 1:
            raise InputError(self.ckpt.folder, f"expert tensors for {name} have different shapes {sorted(shapes)}")
        shape = (len(hf_names), *shapes.pop())
        src = f"{self.ckpt.stored[hf_names[0]].file.name}:{hf_names[0]} (+{len(hf_names) - 1} experts)"
        ck = self.ckpt

        def load() -> torch.Tensor:
            if any(ck.is_fp8(n) for n in hf_names):  # dequantized one expert at a time into one buffer
                out = torch.empty(shape, dtype=torch.float32)
                for i, n in enumerate(hf_names):
                    out[i] = ck.load(n)
                return out
            out = torch.empty(shape, dtype=_dtype_of(ck, hf_names[0]))
            for i, n in enumerate(hf_names):  # each expert read straight into its slice: no stacking copy
                ck.read_into(n, out[i])
            return out

        # what the writer uses: the experts encoded one by one into the output type's buffer
        return Emit(name, shape, load, src, lambda q: stream.encode_stack(ck, hf_names, name, src, shape, q))

    def stack_experts(self, prefix: str, n_experts: int, used: list[str], bid: int | None = None) -> Iterator[Emit]:
        """Layer ``prefix``'s per-expert gate/up/down tensors as three stacked tensors, named as llama.cpp does."""
        infix = self.per_expert_infix
        key = prefix if bid is None else f"{self.block_prefix}{bid}."
        for proj in ("gate_proj", "up_proj", "down_proj"):
            parts = [f"{prefix}{infix}{e}.{proj}.weight" for e in range(n_experts)]
            used.extend(parts)
            yield self.stack(self.map_name(f"{key}{infix}{proj}.weight"), parts)

    def expect_shape(self, hf_name: str, shape: tuple[int, ...]) -> None:
        """Refuse a tensor whose shape contradicts config.json."""
        got = self.ckpt.shape(hf_name)
        if tuple(got) != tuple(shape):
            f = self.ckpt.stored[hf_name].file
            raise InputError(f, f"{hf_name} has shape {list(got)}, but config.json implies {list(shape)}")

    def map_name(self, hf_name: str, n_blocks: int | None = None) -> str | None:
        """GGUF name of an HF tensor by gguf-py's TensorNameMap (llama.cpp's naming authority)."""
        if self._name_map is None:
            arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == self.arch)
            self._name_map = gguf.get_tensor_name_map(arch_enum, n_blocks or (self.n_trunk + self.n_mtp))
        name = hf_name
        if name.endswith("e_score_correction_bias"):  # llama.cpp renames this before mapping
            name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        return self._name_map.get_name(name, try_suffixes=(".weight", ".bias"))

    def require(self, hf_name: str) -> str:
        if hf_name not in self.ckpt:
            raise InputError(self.ckpt.folder, f"missing tensor {hf_name}")
        return hf_name

    # -- plan ---------------------------------------------------------------------------

    def file_type(self, outtype: T) -> gguf.LlamaFileType:
        """general.file_type, as llama.cpp's converter writes it for this outtype."""
        return FILE_TYPES[outtype]

    def output_type(self, name: str, shape: tuple[int, ...], outtype: T) -> T:
        """Output type at conversion, as llama.cpp's converter chooses it."""
        kind = name.rsplit(".", 1)[0] if block_index(name) is None else name.split(".", 2)[2].rsplit(".", 1)[0]
        if len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
            return T.F32
        if kind in self.f32_kinds:
            return T.F32
        if outtype == T.Q8_0 and shape[-1] % 32 != 0:
            return T.F16  # llama.cpp falls back the same way
        return outtype

    def plan(self, mtp: BlockSelection = BlockSelection.KEEP, outtype: T = T.F16) -> Plan:
        self.block_selection = mtp
        if mtp is not BlockSelection.DROP and self.n_mtp == 0:
            if mtp is BlockSelection.ONLY:
                raise InputError(self.ckpt.folder / "config.json", "--mtp-only: this checkpoint has no MTP layers")
        keep_mtp = mtp is not BlockSelection.DROP and self.n_mtp > 0
        self.check(keep_mtp)
        self.n_blocks = n_blocks = self.n_trunk + (self.n_mtp if keep_mtp else 0)

        specs: list[TensorSpec] = []
        seen: set[str] = set()
        for e in self.tensors():
            bid = block_index(e.name)
            is_mtp = bid is not None and bid >= self.n_trunk
            if is_mtp and not keep_mtp:
                continue
            if mtp is BlockSelection.ONLY and not is_mtp and e.name not in mtp_only_keep(self.arch):
                continue
            if e.name in seen:
                raise InputError(self.ckpt.folder, f"two source tensors map to {e.name}")
            seen.add(e.name)
            role = classify(e.name, e.shape, self.n_trunk)
            qtype = e.ggml_type or self.output_type(e.name, e.shape, outtype)
            # the bytes in qtype, which the writer takes as they are (load_raw): streamed, or ``load()`` encoded
            # by encode_loaded, which loads and converts to a float type on one torch thread (the writer's
            # quantize would use all of them, and stalls on a tensor like attn_k_b when another core is busy:
            # docs/notes/convert.md)
            encode = e.encode or (lambda e: lambda q: stream.encode_loaded(e.load, q, e.name, e.source))(e)
            raw = (lambda f, q: lambda: f(q))(encode, qtype)
            reason = f"stored as {qtype.name.lower()}" if e.ggml_type else f"--outtype {outtype.name.lower()}"
            specs.append(
                TensorSpec(
                    e.name, e.shape, role, qtype, e.load, e.source, reason=reason, source_type=qtype, load_raw=raw
                )
            )

        w = GGUFWriter(None, self.arch)  # used only to collect metadata with gguf-py's typed helpers
        w.add_type("model")
        if name := self.ckpt.config.get("_name_or_path"):
            w.add_name(Path(name).name)
        w.add_file_type(self.file_type(outtype))
        self.set_common_metadata(w, n_blocks)
        self.set_metadata(w)
        if keep_mtp:
            w.add_nextn_predict_layers(self.n_mtp)
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)  # llama.cpp's converter always writes it
        w.add_size_label(size_label(specs))
        self.write_vocab(w)
        kv = {k: v for k, v in w.kv_data[0].items() if k != gguf.Keys.General.ARCHITECTURE}

        return Plan(
            self.arch,
            kv,
            specs,
            inputs=list(self.ckpt.files),
            n_trunk_layers=self.n_trunk,
            n_mtp_layers=self.n_mtp if keep_mtp else 0,
        )


def mxfp4_stack(ckpt: HFCheckpoint, name: str, parts: list[tuple[str, str]]) -> Emit:
    """Per-expert MXFP4 pairs (``weight``: E2M1 codes two per byte [rows, values / 2], ``scale``: E8M0 bytes
    [rows, values / 32]; (weight, scale) names in ``parts``) stacked as ggml MXFP4 blocks [n_expert, rows, values]:
    the checkpoint's bits, moved (ggml/mxfp4.py), whatever the outtype."""
    from ..ggml.mxfp4 import blocks_from_packed

    rows, packed = ckpt.shape(parts[0][0])
    groups = 2 * packed // 32

    def raw(n: str) -> np.ndarray:
        return ckpt.raw(n).view(torch.uint8).numpy()

    def encode(qtype: T) -> np.ndarray:
        assert qtype == T.MXFP4, qtype
        out = np.empty((len(parts), rows, groups * 17), dtype=np.uint8)
        for e, (w, s) in enumerate(parts):
            out[e] = blocks_from_packed(raw(w), raw(s))
        return out

    def load() -> torch.Tensor:
        return torch.from_numpy(gguf.quants.dequantize(encode(T.MXFP4), T.MXFP4))

    src = f"{ckpt.stored[parts[0][0]].file.name}:{parts[0][0]} (+{len(parts) - 1} experts, MXFP4)"
    return Emit(name, (len(parts), rows, 2 * packed), load, src, encode, ggml_type=T.MXFP4)


def _dtype_of(ckpt: HFCheckpoint, hf_name: str) -> torch.dtype:
    from .checkpoint import ST_DTYPES

    return ST_DTYPES[ckpt.source_dtype(hf_name)]


# the top-level names of Llama-style checkpoints, for families with their own name tables
LLAMA_TOP_NAMES = {
    "model.embed_tokens.weight": gguf.MODEL_TENSOR.TOKEN_EMBD,
    "model.norm.weight": gguf.MODEL_TENSOR.OUTPUT_NORM,
    "lm_head.weight": gguf.MODEL_TENSOR.OUTPUT,
}


# the Llama-style names inside ``model.layers.{N}.`` (".weight" dropped) most MoE families share -> GGUF kind
LLAMA_BLOCK_NAMES = {
    "input_layernorm": gguf.MODEL_TENSOR.ATTN_NORM,
    "self_attn.q_proj": gguf.MODEL_TENSOR.ATTN_Q,
    "self_attn.k_proj": gguf.MODEL_TENSOR.ATTN_K,
    "self_attn.v_proj": gguf.MODEL_TENSOR.ATTN_V,
    "self_attn.o_proj": gguf.MODEL_TENSOR.ATTN_OUT,
    "mlp.gate_proj": gguf.MODEL_TENSOR.FFN_GATE,
    "mlp.up_proj": gguf.MODEL_TENSOR.FFN_UP,
    "mlp.down_proj": gguf.MODEL_TENSOR.FFN_DOWN,
    "mlp.experts.gate_proj": gguf.MODEL_TENSOR.FFN_GATE_EXP,
    "mlp.experts.up_proj": gguf.MODEL_TENSOR.FFN_UP_EXP,
    "mlp.experts.down_proj": gguf.MODEL_TENSOR.FFN_DOWN_EXP,
}


def add_hparams(w: GGUFWriter, hp: dict, calls: tuple[tuple[str, str], ...]) -> None:
    """GGUF keys taken as they are from the config: ``(GGUFWriter method, config key)`` pairs, in order (the
    order is the file's key order, llama.cpp's converter's)."""
    for method, key in calls:
        getattr(w, method)(hp[key])


def weight_table(names: dict[str, gguf.MODEL_TENSOR]) -> dict[str, tuple[gguf.MODEL_TENSOR, str]]:
    """A block table for ``name_from_tables`` from ``rest -> kind`` (".weight" dropped on both sides)."""
    return {f"{rest}.weight": (kind, ".weight") for rest, kind in names.items()}


def name_from_tables(
    hf_name: str,
    top: dict[str, gguf.MODEL_TENSOR],
    blocks: Callable[[int], dict[str, tuple[gguf.MODEL_TENSOR, str]]],
    prefix: str = "model.layers.",
) -> str | None:
    """GGUF name from a family's own tables (for architectures whose names pip's gguf lacks): a top-level
    name, else ``{prefix}{N}.<rest>`` looked up in block N's table of ``rest -> (kind, suffix)``."""
    if hf_name in top:
        return gguf_name(top[hf_name])
    m = re.match(re.escape(prefix) + r"(\d+)\.(.+)$", hf_name)
    if m is None or (entry := blocks(int(m[1])).get(m[2])) is None:
        return None
    return gguf_name(entry[0], int(m[1]), entry[1])


def layer_of(hf_name: str, prefix: str = "model.layers.") -> int | None:
    m = re.match(re.escape(prefix) + r"(\d+)\.", hf_name)
    return int(m.group(1)) if m else None


def check_unused(ckpt: HFCheckpoint, used: Iterable[str], ignore: tuple[str, ...] = ()) -> None:
    """Every source tensor must be converted or knowingly ignored: silent drops hide bugs."""
    used = set(used)
    left = [n for n in ckpt.names() if n not in used and not n.startswith(ignore)]
    if left:
        raise InputError(ckpt.folder, f"{len(left)} tensors were not recognised, e.g. {left[0]}")
