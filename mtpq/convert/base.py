"""What every family shares: the registry, common hparams, name mapping, types.

A family module subclasses :class:`Family` and supplies
- ``hf_architectures`` and ``arch`` (the GGUF architecture),
- ``set_metadata(w)``: family-specific hparams on top of :meth:`set_common_metadata`,
- ``tensors()``: (gguf name, shape, loader, source) for every tensor, MTP included,
  with the family's transforms folded into the loaders.
The base turns that into a :class:`~mtpq.tensors.Plan` with roles and output types.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Callable, ClassVar, Iterable, Iterator

import gguf
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, LlamaFileType

from ..errors import InputError
from ..gguf_io import size_label
from ..tensors import Plan, TensorSpec, block_index, classify
from . import validate
from .checkpoint import Checkpoint
from .validate import Expected


class MtpMode(str, Enum):
    KEEP = "keep"  # trunk + MTP blocks (the default: the reason mtpq exists)
    DROP = "drop"  # --no-mtp: trunk only, no nextn_predict_layers
    ONLY = "only"  # --mtp-only: MTP blocks + token_embd, output_norm, output (llama.cpp's --mtp export)


OUTTYPES = {"f32": T.F32, "f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0}
FILE_TYPES = {
    T.F32: LlamaFileType.ALL_F32, T.F16: LlamaFileType.MOSTLY_F16,
    T.BF16: LlamaFileType.MOSTLY_BF16, T.Q8_0: LlamaFileType.MOSTLY_Q8_0,
}
MTP_ONLY_KEEP = ("token_embd.weight", "output_norm.weight", "output.weight")


@dataclass
class Emit:
    """One tensor a family produces: GGUF name, torch-order shape, lazy values, where from."""

    name: str
    shape: tuple[int, ...]
    load: Callable[[], torch.Tensor]
    source: str


FAMILIES: dict[str, type["Family"]] = {}


def register(cls: type["Family"]) -> type["Family"]:
    for a in cls.hf_architectures:
        FAMILIES[a] = cls
    return cls


def family_for(ckpt: Checkpoint) -> "Family":
    archs = ckpt.config.get("architectures") or []
    for a in archs:
        if a in FAMILIES:
            return FAMILIES[a](ckpt)
    known = ", ".join(sorted(FAMILIES))
    raise InputError(ckpt.folder / "config.json", f"unsupported architecture {archs or '(none)'}; mtpq converts: {known}")


class Family:
    hf_architectures: ClassVar[tuple[str, ...]] = ()
    arch: ClassVar[str] = ""
    # GGUF-name suffixes kept at F32 whatever the outtype (llama.cpp's converter does the same)
    f32_kinds: ClassVar[tuple[str, ...]] = ("ffn_gate_inp", "ffn_gate_inp_shexp", "ssm_conv1d")
    # config.json keys without which the family cannot convert (checked before anything else)
    required_hparams: ClassVar[tuple[str, ...]] = ("vocab_size", "hidden_size", "num_hidden_layers")

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt
        self.hparams = self.text_config(ckpt.config)
        validate.check_required_hparams(self)
        self.n_trunk = int(self.hparams["num_hidden_layers"])
        self.n_mtp = int(self.hparams.get("num_nextn_predict_layers", 0) or 0)
        self._name_map: gguf.TensorNameMap | None = None

    # -- hooks for families -------------------------------------------------------------

    @staticmethod
    def text_config(config: dict) -> dict:
        """The language model's hparams (multimodal configs nest them under text_config)."""
        return {**config, **config.get("text_config", {})}

    def set_metadata(self, w: GGUFWriter) -> None:
        raise NotImplementedError

    def tensors(self) -> Iterator[Emit]:
        raise NotImplementedError

    def expected_tensors(self, keep_mtp: bool) -> Iterator[Expected]:
        """Every HF tensor (logical name, shape) config.json implies; checked before anything is planned."""
        raise NotImplementedError

    def resolve(self, name: str) -> str | None:
        """The stored name of an :meth:`expected_tensors` name, or None if the checkpoint lacks it."""
        return name if name in self.ckpt else None

    def logical_names(self) -> list[str]:
        """Every stored tensor under the names :meth:`expected_tensors` uses."""
        return self.ckpt.names()

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
        if (v := self.hp("max_position_embeddings")) is not None:
            w.add_context_length(v)
        if (v := self.hp("hidden_size")) is not None:
            w.add_embedding_length(v)
        if (v := self.hp("intermediate_size")) is not None:
            w.add_feed_forward_length(v)
        if (v := self.hp("num_attention_heads")) is not None:
            w.add_head_count(v)
        if (v := self.hp("num_key_value_heads")) is not None:
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
        if (v := self.hp("rms_norm_eps")) is not None:
            w.add_layer_norm_rms_eps(v)
        if (v := self.hp("num_local_experts", "num_experts", "n_routed_experts")) is not None:
            w.add_expert_count(v)
        if (v := self.hp("num_experts_per_tok")) is not None:
            w.add_expert_used_count(v)
        if (v := self.hparams.get("n_group")) is not None:
            w.add_expert_group_count(v)
        if (v := self.hparams.get("topk_group")) is not None:
            w.add_expert_group_used_count(v)
        if (v := self.hp("scoring_func", "score_function")) is not None:
            gating = {"sigmoid": gguf.ExpertGatingFuncType.SIGMOID, "softmax": gguf.ExpertGatingFuncType.SOFTMAX}
            if v not in gating:
                raise InputError(self.ckpt.folder / "config.json", f"unsupported scoring_func {v!r}")
            w.add_expert_gating_func(gating[v])
        if (v := self.hparams.get("head_dim")) is not None:
            w.add_key_length(v)
            w.add_value_length(v)

    def emit(self, name: str, hf_name: str, transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
             shape: tuple[int, ...] | None = None) -> Emit:
        """A GGUF tensor read from one HF tensor, optionally transformed (shape must then be given if it changes)."""
        load = self.ckpt.loader(hf_name)
        if transform is not None:
            inner = load
            load = lambda: transform(inner())  # noqa: E731
        src = f"{self.ckpt.stored[hf_name].file.name}:{hf_name}"
        return Emit(name, tuple(shape if shape is not None else self.ckpt.shape(hf_name)), load, src)

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
            if any(ck.is_fp8(n) for n in hf_names):  # dequantized one expert at a time
                return torch.stack([ck.load(n) for n in hf_names])
            out = torch.empty(shape, dtype=_dtype_of(ck, hf_names[0]))
            for i, n in enumerate(hf_names):  # each expert read straight into its slice: no stacking copy
                ck.read_into(n, out[i])
            return out

        return Emit(name, shape, load, src)

    def stack_experts(self, prefix: str, n_experts: int, used: list[str]) -> Iterator[Emit]:
        """Layer ``prefix``'s per-expert gate/up/down tensors as three stacked tensors, named as llama.cpp does."""
        for proj in ("gate_proj", "up_proj", "down_proj"):
            parts = [f"{prefix}mlp.experts.{e}.{proj}.weight" for e in range(n_experts)]
            used.extend(parts)
            yield self.stack(self.map_name(f"{prefix}mlp.experts.{proj}.weight"), parts)

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

    def plan(self, mtp: MtpMode = MtpMode.KEEP, outtype: T = T.F16) -> Plan:
        if mtp is not MtpMode.DROP and self.n_mtp == 0:
            if mtp is MtpMode.ONLY:
                raise InputError(self.ckpt.folder / "config.json", "--mtp-only: this checkpoint has no MTP layers")
        keep_mtp = mtp is not MtpMode.DROP and self.n_mtp > 0
        validate.check_family(self, keep_mtp)
        n_blocks = self.n_trunk + (self.n_mtp if keep_mtp else 0)

        specs: list[TensorSpec] = []
        seen: set[str] = set()
        for e in self.tensors():
            bid = block_index(e.name)
            is_mtp = bid is not None and bid >= self.n_trunk
            if is_mtp and not keep_mtp:
                continue
            if mtp is MtpMode.ONLY and not is_mtp and e.name not in MTP_ONLY_KEEP:
                continue
            if e.name in seen:
                raise InputError(self.ckpt.folder, f"two source tensors map to {e.name}")
            seen.add(e.name)
            role = classify(e.name, e.shape, self.n_trunk)
            qtype = self.output_type(e.name, e.shape, outtype)
            specs.append(TensorSpec(e.name, e.shape, role, qtype, e.load, e.source, reason=f"--outtype {outtype.name.lower()}"))

        w = GGUFWriter(None, self.arch)  # used only to collect metadata with gguf-py's typed helpers
        w.add_type("model")
        if name := self.ckpt.config.get("_name_or_path"):
            w.add_name(Path(name).name)
        w.add_file_type(FILE_TYPES[outtype])
        self.set_common_metadata(w, n_blocks)
        self.set_metadata(w)
        if keep_mtp:
            w.add_nextn_predict_layers(self.n_mtp)
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)  # llama.cpp's converter always writes it
        w.add_size_label(size_label(specs))
        self.write_vocab(w)
        kv = {k: v for k, v in w.kv_data[0].items() if k != gguf.Keys.General.ARCHITECTURE}

        return Plan(self.arch, kv, specs, inputs=list(self.ckpt.files), n_trunk_layers=self.n_trunk,
                    n_mtp_layers=self.n_mtp if keep_mtp else 0)


def _dtype_of(ckpt: Checkpoint, hf_name: str) -> torch.dtype:
    from .checkpoint import _ST_DTYPES

    return _ST_DTYPES[ckpt.source_dtype(hf_name)]


def layer_of(hf_name: str, prefix: str = "model.layers.") -> int | None:
    m = re.match(re.escape(prefix) + r"(\d+)\.", hf_name)
    return int(m.group(1)) if m else None


def check_unused(ckpt: Checkpoint, used: Iterable[str], ignore: tuple[str, ...] = ()) -> None:
    """Every source tensor must be converted or knowingly ignored: silent drops hide bugs."""
    left = [n for n in ckpt.names() if n not in set(used) and not n.startswith(ignore)]
    if left:
        raise InputError(ckpt.folder, f"{len(left)} tensors were not recognised, e.g. {left[0]}")
