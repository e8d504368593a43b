"""Qwen3.5 / Qwen3.6 dense (``Qwen3_5ForCausalLM``, ``Qwen3_5ForConditionalGeneration``) -> GGUF arch ``qwen35``.

The trunk is hybrid: Gated DeltaNet linear-attention layers (``linear_attn.*``)
with a gated full-attention layer every ``full_attention_interval`` layers
(``q_proj`` rows hold [q; gate] per head, kept as one ``attn_q``). The
ConditionalGeneration checkpoints keep the text model under
``model.language_model.`` beside a vision tower (``model.visual.*``, not
converted: llama.cpp puts it in a separate mmproj file).

The MTP head is stored under ``mtp.``: ``mtp.fc`` -> ``nextn.eh_proj``,
``mtp.pre_fc_norm_embedding`` -> ``nextn.enorm``, ``mtp.pre_fc_norm_hidden`` ->
``nextn.hnorm``, ``mtp.norm`` -> ``nextn.shared_head_norm`` (all in block N =
num_hidden_layers), and ``mtp.layers.i.*`` (a full-attention decoder block) ->
block N + i. The head shares ``token_embd``/``output`` with the trunk.

Transforms, as llama.cpp's converter applies them (conversion/qwen.py):
- RMSNorms computed as x_hat * (1 + w) are written as 1 + w (ggml multiplies by
  the stored weight); the gated ``linear_attn.norm`` (x_hat * w) is not;
- ``A_log`` -> ``ssm_a`` = -exp(A_log); ``dt_bias`` -> ``ssm_dt.bias``;
  ``conv1d.weight`` [C, 1, K] -> [C, K];
- when there are more value heads than key heads, value heads are reordered
  from grouped order (HF: head k*r + j shares key head k) to tiled order
  (j*n_k + k), which ggml's broadcast over key heads expects: the V rows of
  ``in_proj_qkv``, rows of ``in_proj_z``/``in_proj_a``/``in_proj_b``,
  ``A_log``/``dt_bias``, the V channels of ``conv1d`` and the columns of
  ``out_proj``.
"""

from __future__ import annotations

import logging
import re
from typing import Iterator

import torch
from gguf import GGUFWriter

from ...errors import InputError
from ...tensors import tensor_kind
from .. import validate as V
from ..base import ConvertFamily, Emit, Transform, check_unused
from ..checkpoint import HFCheckpoint
from ..validate import Expected

log = logging.getLogger(__name__)

# HF names after ``mtp.`` -> GGUF kinds in the first MTP block. Spelled out here because the
# gguf-py we depend on (0.19) lacks the nextn tensors in its qwen35/qwen35moe name tables.
MTP_HEAD = {
    "fc.weight": "nextn.eh_proj.weight",
    "pre_fc_norm_embedding.weight": "nextn.enorm.weight",
    "pre_fc_norm_hidden.weight": "nextn.hnorm.weight",
    "norm.weight": "nextn.shared_head_norm.weight",
}
ZERO_CENTRED_NORMS = {
    "attn_norm",
    "post_attention_norm",
    "attn_q_norm",
    "attn_k_norm",
    "output_norm",
    "nextn.enorm",
    "nextn.hnorm",
    "nextn.shared_head_norm",
}
# llama.cpp's loaders require rope.dimension_sections; its converter writes Qwen3.5's default when absent
DEFAULT_MROPE_SECTION = [11, 11, 10, 0]
RECURRENT_LAYERS_KEY = "{arch}.attention.recurrent_layers"  # newer than gguf-py 0.19's Keys

_TEXT_PREFIX = re.compile(r"^model\.language_model\.")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")


def identity(t: torch.Tensor) -> torch.Tensor:
    return t


def tile_v_heads(t: torch.Tensor, dim: int, n_k_heads: int, head_dim: int) -> torch.Tensor:
    """Reorder value heads along ``dim``: grouped [k0v0, k0v1, k1v0, k1v1] -> tiled [k0v0, k1v0, k0v1, k1v1]."""
    shape = list(t.shape)
    n_per_k = shape[dim] // (n_k_heads * head_dim)
    grouped = t.reshape(*shape[:dim], n_k_heads, n_per_k, head_dim, *shape[dim + 1 :])
    return grouped.transpose(dim, dim + 1).reshape(shape)


class Qwen35(ConvertFamily):
    hf_architectures = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
    other_towers = ("model.visual.", "visual.")
    arch = "qwen35"
    required_hparams = ConvertFamily.required_hparams + (
        "num_attention_heads",
        "num_key_value_heads",
        "linear_conv_kernel_dim",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
    )

    def __init__(self, ckpt: HFCheckpoint):
        super().__init__(ckpt)
        self._sort_tensors()
        self.n_mtp = self._count_mtp_layers()

    # -- where every checkpoint tensor goes ---------------------------------------------

    def _sort_tensors(self) -> None:
        """Split the checkpoint into top-level tensors, trunk layers, MTP layers and the MTP head."""
        self.top: dict[str, str] = {}  # "model.embed_tokens.weight" -> HF name
        self.layers: dict[int, dict[str, str]] = {}  # trunk layer -> {name inside the layer: HF name}
        self.mtp_layers: dict[int, dict[str, str]] = {}
        self.mtp_head: dict[str, str] = {}  # "fc.weight" -> HF name
        self.logical: dict[str, str] = {}  # "model.layers.0.x" / "mtp.fc.weight" -> HF name
        for hf in self.ckpt.names():
            if hf.startswith(self.other_towers):
                continue
            name = _TEXT_PREFIX.sub("model.", hf)
            if name.startswith("model.mtp."):
                name = name[len("model.") :]
            self.logical[name] = hf
            if m := _MTP_LAYER.match(name):
                self.mtp_layers.setdefault(int(m[1]), {})[m[2]] = hf
            elif name.startswith("mtp."):
                self.mtp_head[name[len("mtp.") :]] = hf
            elif m := _LAYER.match(name):
                self.layers.setdefault(int(m[1]), {})[m[2]] = hf
            else:
                self.top[name] = hf

    def _count_mtp_layers(self) -> int:
        cfg = self.ckpt.folder / "config.json"
        declared = int(self.hp("mtp_num_hidden_layers", default=0) or 0)
        found = sorted(self.mtp_layers)
        if not found and not self.mtp_head:
            if declared:
                log.warning(
                    "%s declares %d MTP layer(s) but the checkpoint has no mtp.* tensors; converting the trunk",
                    cfg,
                    declared,
                )
            return 0
        if found != list(range(len(found))) or not found:
            raise InputError(self.ckpt.folder, f"MTP layers must be mtp.layers.0..N-1, found {found or 'none'}")
        if declared and declared != len(found):
            raise InputError(
                cfg, f"mtp_num_hidden_layers is {declared}, but the checkpoint holds {len(found)} MTP layer(s)"
            )
        missing = [k for k in MTP_HEAD if k not in self.mtp_head]
        if missing:
            raise InputError(self.ckpt.folder, f"MTP head is incomplete: missing tensor mtp.{missing[0]}")
        return len(found)

    # -- what config.json implies (checked before anything is planned) -------------------

    def resolve(self, name: str) -> str | None:
        return self.logical.get(name)

    def logical_names(self) -> list[str]:
        return list(self.logical)

    def full_attention_layers(self) -> set[int]:
        hp = self.hparams
        if (types := hp.get("layer_types")) is not None:
            return {i for i, t in enumerate(types) if t == "full_attention"}
        every = hp.get("full_attention_interval", 4)
        return {i for i in range(self.n_trunk) if (i + 1) % every == 0}

    def expected_tensors(self, keep_mtp: bool) -> Iterator[Expected]:
        hp = self.hparams
        h, nh = hp["hidden_size"], hp["num_attention_heads"]
        hd = hp.get("head_dim") or h // nh
        full = self.full_attention_layers()
        yield from V.embeddings(h, hp["vocab_size"], tied=bool(hp.get("tie_word_embeddings")))
        blocks = [f"model.layers.{i}." for i in range(self.n_trunk)]
        if keep_mtp:
            blocks += [f"mtp.layers.{i}." for i in range(self.n_mtp)]
            yield V.Expected("mtp.fc.weight", (h, 2 * h))
            yield from V.norms("mtp.", h, "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")
        for i, p in enumerate(blocks):
            yield from V.norms(p, h, "input_layernorm", "post_attention_layernorm")
            if i in full or p.startswith("mtp."):  # gated attention: q_proj holds [q; gate] per head
                yield from V.attention(
                    p + "self_attn.", h, nh, hp["num_key_value_heads"], hd, qk_norm=True, q_rows=2 * nh * hd
                )
            else:
                yield from (V.Expected(p + inner, shape) for inner, shape in self.linear_attn_shapes().items())
            yield from self.expected_ffn(p + "mlp.")

    def expected_ffn(self, p: str) -> Iterator[Expected]:
        yield from V.dense_ffn(p, self.hparams["hidden_size"], self.hparams["intermediate_size"])

    # -- metadata -----------------------------------------------------------------------

    def set_metadata(self, w: GGUFWriter) -> None:
        hp = self.hparams
        rope = self.rope_parameters
        try:
            w.add_ssm_conv_kernel(hp["linear_conv_kernel_dim"])
            w.add_ssm_state_size(hp["linear_key_head_dim"])
            w.add_ssm_group_count(hp["linear_num_key_heads"])
            w.add_ssm_time_step_rank(hp["linear_num_value_heads"])
            w.add_ssm_inner_size(hp["linear_value_head_dim"] * hp["linear_num_value_heads"])
        except KeyError as exc:
            raise InputError(self.ckpt.folder / "config.json", f"missing linear-attention hparam {exc}") from None
        if (layer_types := hp.get("layer_types")) is not None:
            if len(layer_types) != self.n_trunk:
                raise InputError(
                    self.ckpt.folder / "config.json",
                    f"layer_types has {len(layer_types)} entries, num_hidden_layers is {self.n_trunk}",
                )
            recurrent = [t == "linear_attention" for t in layer_types]
            recurrent += [False] * (self.n_blocks - self.n_trunk)  # MTP blocks use full attention
            w.add_array(RECURRENT_LAYERS_KEY.format(arch=self.arch), recurrent)
        w.add_full_attention_interval(hp.get("full_attention_interval", 4))
        head_dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
        partial = rope.get("partial_rotary_factor", hp.get("partial_rotary_factor", 0.25))
        w.add_rope_dimension_count(int(head_dim * partial))
        if (sections := self.rope_sections()) is not None:
            w.add_rope_dimension_sections((list(sections) + [0] * 4)[:4])

    def rope_sections(self) -> list[int] | None:
        """The MRoPE sections to write (Qwen3.5 always has them: its loaders require the key)."""
        return self.rope_parameters.get("mrope_section") or DEFAULT_MROPE_SECTION

    # -- tensors ------------------------------------------------------------------------

    def tensors(self) -> Iterator[Emit]:
        hp = self.hparams
        self.used: list[str] = []
        embed = self.top.get("model.embed_tokens.weight")
        if embed is None:
            raise InputError(
                self.ckpt.folder,
                "missing tensor model.embed_tokens.weight (or model.language_model.embed_tokens.weight)",
            )
        self.expect_shape(embed, (hp["vocab_size"], hp["hidden_size"]))
        yield self._emit("token_embd.weight", embed)
        for bid in range(self.n_trunk):
            if bid not in self.layers:
                raise InputError(
                    self.ckpt.folder, f"no tensors for layer {bid} (config.json has {self.n_trunk} layers)"
                )
            yield from self.block_tensors(bid, self.layers[bid])
        for i in range(self.n_mtp):
            bid = self.n_trunk + i
            yield from self.block_tensors(bid, self.mtp_layers[i])
            if i == 0:
                for key, kind in MTP_HEAD.items():
                    yield self._emit(f"blk.{bid}.{kind}", self.mtp_head[key])
        if "model.norm.weight" in self.top:
            yield self._emit("output_norm.weight", self.top["model.norm.weight"])
        if "lm_head.weight" in self.top:  # absent when tied to token_embd (the small models)
            yield self._emit("output.weight", self.top["lm_head.weight"])
        check_unused(self.ckpt, self.used, ignore=self.other_towers)

    def block_tensors(self, bid: int, names: dict[str, str]) -> Iterator[Emit]:
        """Every tensor of one decoder block; ``names`` maps the name inside the layer to the HF name."""
        for inner, hf in names.items():
            if inner.startswith("linear_attn."):
                self._check_linear_attn(inner, hf)
            key = f"model.layers.{bid}.{inner}"
            if key.endswith(".dt_bias"):  # llama.cpp's table knows it as dt_proj.bias
                key = key[: -len("dt_bias")] + "dt_proj.bias"
            name = self.map_name(key)
            if name is None:
                continue  # reported by check_unused
            yield self._emit(name, hf)

    def _emit(self, name: str, hf: str) -> Emit:
        self.used.append(hf)
        transform, shape = self.transform(tensor_kind(name), self.ckpt.shape(hf))
        return self.emit(name, hf, transform, shape)

    def transform(self, kind: str, shape: tuple[int, ...]) -> tuple[Transform | None, tuple[int, ...]]:
        """The values transform for a GGUF tensor kind, and the shape it produces."""
        if kind in ZERO_CENTRED_NORMS:
            return (lambda t: t.float() + 1.0), shape
        tile = self.v_head_tiling(kind)
        if kind == "ssm_a":
            return (lambda t: -torch.exp(tile(t.float()))), shape
        if kind == "ssm_conv1d":
            return (lambda t: tile(t.squeeze(1))), (shape[0], shape[-1])
        return (None if tile is identity else tile), shape

    def v_head_tiling(self, kind: str) -> Transform:
        """The grouped -> tiled value-head reorder of a linear-attention tensor (identity if n_v == n_k)."""
        hp = self.hparams
        n_k, n_v = hp["linear_num_key_heads"], hp["linear_num_value_heads"]
        qk, d_v = 2 * n_k * hp["linear_key_head_dim"], hp["linear_value_head_dim"]
        # kind -> (dim, where the V heads start along it, V head size)
        v_part = {
            "attn_qkv": (0, qk, d_v),
            "ssm_conv1d": (0, qk, d_v),
            "attn_gate": (0, 0, d_v),
            "ssm_beta": (0, 0, 1),
            "ssm_alpha": (0, 0, 1),
            "ssm_a": (0, 0, 1),
            "ssm_dt.bias": (0, 0, 1),
            "ssm_out": (1, 0, d_v),
        }
        if n_v == n_k or kind not in v_part:
            return identity
        dim, start, head_dim = v_part[kind]
        if dim == 1:
            return lambda t: tile_v_heads(t, 1, n_k, head_dim)
        return lambda t: torch.cat([t[:start], tile_v_heads(t[start:], 0, n_k, head_dim)])

    def _check_linear_attn(self, inner: str, hf: str) -> None:
        """Refuse linear-attention tensors whose shape contradicts config.json (the reorders depend on it)."""
        want = self.linear_attn_shapes().get(inner)
        if want is not None:
            self.expect_shape(hf, want)

    def linear_attn_shapes(self) -> dict[str, tuple[int, ...]]:
        """A linear-attention layer's tensors (names after ``model.layers.N.``) and their shapes."""
        hp = self.hparams
        h, n_k, n_v = hp["hidden_size"], hp["linear_num_key_heads"], hp["linear_num_value_heads"]
        d_k, d_v, k = hp["linear_key_head_dim"], hp["linear_value_head_dim"], hp["linear_conv_kernel_dim"]
        if n_v % n_k:
            raise InputError(
                self.ckpt.folder / "config.json",
                f"linear_num_value_heads {n_v} is not a multiple of linear_num_key_heads {n_k}",
            )
        conv = 2 * n_k * d_k + n_v * d_v
        return {
            "linear_attn.in_proj_qkv.weight": (conv, h),
            "linear_attn.in_proj_z.weight": (n_v * d_v, h),
            "linear_attn.in_proj_a.weight": (n_v, h),
            "linear_attn.in_proj_b.weight": (n_v, h),
            "linear_attn.A_log": (n_v,),
            "linear_attn.dt_bias": (n_v,),
            "linear_attn.conv1d.weight": (conv, 1, k),
            "linear_attn.out_proj.weight": (h, n_v * d_v),
            "linear_attn.norm.weight": (d_v,),
        }
