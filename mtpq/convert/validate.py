"""Checks a checkpoint must pass before the converter writes a byte.

All cheap (names, shapes, JSON; no tensor data is read; see benchmarks/convert_bench.py):

- :func:`check_required_hparams`: the hparams a family cannot do without.
- :func:`check_dtypes`: every stored weight is floating point; an FP8 one has a
  float scale companion whose shape fits it.
- :func:`check_tensors`: every tensor the family's config implies exists with
  the implied shape (trunk and MTP blocks), and inside the blocks it describes
  nothing else is stored (a bias with ``attention_bias: false``).

The safetensors container itself (byte ranges tiling each shard's data area)
is checked where headers are read, in :mod:`.checkpoint`; config.json's value
types (``"num_hidden_layers": "four"``, a negative dimension) where it is read,
by :func:`.hfconfig.check_config`.

Families declare what they need as data: ``required_hparams``,
``expected_tensors(keep_mtp)`` yielding :class:`Expected` entries, and the
stored tensors under the names those use (:class:`Found`). This module checks
that data once for all of them and never calls back into a family.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Container, Iterable, Iterator, Mapping

from ..errors import InputError

if TYPE_CHECKING:
    from .checkpoint import HFCheckpoint


def check_required_hparams(stored: dict, required: Iterable[str], architecture: str, path: Path) -> None:
    """The keys a family cannot do without must be STORED (``stored``: config.json's language-model table as
    written): transformers' view fills a missing hidden_size with its class default (4096), and a checkpoint
    refused for "shape [512, 256], config.json implies [512, 4096]" would blame the wrong thing. (Keys
    transformers derives from other stored keys are not required; families read them from the view.)"""
    missing = [k for k in required if stored.get(k) is None]
    if missing:
        raise InputError(path, f"missing {', '.join(missing)} (needed to convert {architecture})")


# ----------------------------------------------------------------------------- tensors


@dataclass(frozen=True)
class Expected:
    """A tensor the config implies: its (logical) HF name and shape; ``optional`` ones may be absent."""

    name: str
    shape: tuple[int, ...]
    optional: bool = False


@dataclass(frozen=True)
class Found:
    """A stored tensor under the name :class:`Expected` entries use: its stored name, the shape of the values it
    holds (packed encodings hold more values than bytes) and its file (for messages)."""

    name: str
    shape: tuple[int, ...]
    file: Path


FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
FP8_DTYPES = {"F8_E4M3", "F8_E5M2"}


def check_dtypes(ckpt: "HFCheckpoint", own_encodings: Container[str] = ()) -> None:
    """Weights are floating point (FP8 with its scale companion); an integer lm_head is an error, not a conversion.
    ``own_encodings``: weights (and their scales) the family itself has checked (MiMo-V2.5's per-rank FP8 tiles,
    its MXFP4 experts)."""
    for name in ckpt.names():
        st = ckpt.stored[name]
        if st.dtype in FLOAT_DTYPES or name in own_encodings:
            continue
        if st.dtype in FP8_DTYPES:
            _check_fp8_scale(ckpt, name)
            continue
        raise InputError(
            st.file,
            f"tensor {name} has dtype {st.dtype}; a weight must be floating point (F32, F16, BF16 or FP8 with a scale)",
        )
    for name, st in ckpt.stored.items():  # scale companions: float, as every FP8 recipe stores them
        if (
            ckpt.is_scale(name)
            and name.endswith(("_scale_inv", "_scale"))
            and st.dtype not in FLOAT_DTYPES
            and name.rsplit("_scale", 1)[0] not in own_encodings
        ):
            raise InputError(st.file, f"scale tensor {name} has dtype {st.dtype}; expected F32, F16 or BF16")


def _in_mtp_block(name: str, n_trunk: int) -> bool:
    m = re.match(r"^model\.layers\.(\d+)\.", name)
    return name.startswith(("mtp.", "model.mtp.")) or (m is not None and int(m[1]) >= n_trunk)


# a decoder block: trunk (model.layers.N., DeepSeek-V4's layers.N.) or MTP (Qwen3.5's mtp.layers.i., MiMo-V2's
# model.mtp.layers.i., DeepSeek-V4's mtp.i.)
_BLOCK = re.compile(r"^(?:model\.layers|mtp\.layers|model\.mtp\.layers|layers|mtp)\.(\d+)\.")


def fp8_block_size(ckpt: "HFCheckpoint") -> tuple[int, int]:
    """quantization_config.weight_block_size (default 128x128): two positive integers or an InputError."""
    qcfg = ckpt.config.get("quantization_config") or {}
    block = qcfg.get("weight_block_size") or [128, 128]
    if not (
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise InputError(
            ckpt.folder / "config.json",
            f"quantization_config.weight_block_size must be two positive integers, got {block!r}",
        )
    return block[0], block[1]


def _check_fp8_scale(ckpt: "HFCheckpoint", name: str) -> None:
    """An FP8 weight has a scale companion whose shape fits it (checked now, not halfway through writing)."""
    st = ckpt.stored[name]
    if (scale := ckpt.stored.get(name + "_scale_inv")) is not None:  # block-scaled tiles
        bh, bw = fp8_block_size(ckpt)
        if len(st.shape) < 2:
            raise InputError(st.file, f"FP8 tensor {name} has shape {list(st.shape)}; block scales need a matrix")
        want = (*st.shape[:-2], -(-st.shape[-2] // bh), -(-st.shape[-1] // bw))
        if tuple(scale.shape) != want and tuple(scale.shape[-2:]) != want[-2:]:
            raise InputError(
                scale.file,
                f"{scale.name} has shape {list(scale.shape)}, expected {list(want)} "
                f"for {bh}x{bw} tiles of {name} {list(st.shape)}",
            )
    elif (scale := ckpt.stored.get(name + "_scale")) is not None:  # per-channel [out, 1] or one scalar
        n = 1
        for d in scale.shape:
            n *= d
        if n != 1 and (not st.shape or n != st.shape[0]):
            raise InputError(
                scale.file,
                f"{scale.name} has shape {list(scale.shape)}, expected one scale per "
                f"output row of {name} {list(st.shape)} (or a single scale)",
            )
    else:
        raise InputError(st.file, f"FP8 tensor {name} has no weight_scale_inv or weight_scale companion")


def check_tensors(
    expected: Iterable[Expected], found: Mapping[str, Found], *, folder: Path, n_trunk: int, layout: str
) -> None:
    """Every expected tensor is ``found`` with the expected shape, and no found tensor inside a described block
    is left over.

    ``expected`` is consumed lazily: an absurd config (a billion layers or experts) fails at its
    first missing tensor instead of building the list. ``layout`` ends a missing-tensor message
    ("config.json has 2 layers + 1 MTP").
    """
    names: set[str] = set()
    for e in expected:
        names.add(e.name)
        hf = found.get(e.name)
        if hf is None:
            if e.optional:
                continue
            hint = "; convert the trunk alone with --no-mtp" if _in_mtp_block(e.name, n_trunk) else ""
            layer = _BLOCK.match(e.name)
            if layer and not any(n.startswith(layer[0]) for n in found):
                raise InputError(folder, f"no tensors for layer {layer[1]} ({layer[0]}*; {layout}{hint})")
            raise InputError(folder, f"missing tensor {e.name} ({layout}{hint})")
        if hf.shape != tuple(e.shape):
            raise InputError(hf.file, f"{hf.name} has shape {list(hf.shape)}, but config.json implies {list(e.shape)}")
    _check_no_extra(found, names)


def _check_no_extra(found: Mapping[str, Found], names: set[str]) -> None:
    """Inside a block config.json describes, a stored tensor it does not imply (a q_proj.bias with
    attention_bias false, shared experts with n_shared_experts 0) contradicts it: which one is right?"""
    blocks = {m[0] for n in names if (m := _BLOCK.match(n))}
    for name, hf in found.items():
        m = _BLOCK.match(name)
        if m and m[0] in blocks and name not in names:
            raise InputError(hf.file, f"{hf.name} is stored, but config.json implies no such tensor")


def layout_line(n_trunk: int, n_mtp: int) -> str:
    """How a missing-tensor message states the layout config.json declares."""
    return f"config.json has {n_trunk} layers" + (f" + {n_mtp} MTP" if n_mtp else "")


# ----------------------------------------------------------------------------- building blocks families declare with


def attention(
    p: str,
    hidden: int,
    n_head: int,
    n_head_kv: int,
    head_dim: int,
    *,
    bias: bool = False,
    qk_norm: bool = False,
    q_rows: int | None = None,
    v_head_dim: int | None = None,
) -> list[Expected]:
    """A (grouped-query) attention block under ``p`` (``...self_attn.``); ``q_rows`` for gated q_proj,
    ``v_head_dim`` where value heads are narrower than query/key heads (MiMo-V2)."""
    dv = v_head_dim or head_dim
    q, kv, v = q_rows or n_head * head_dim, n_head_kv * head_dim, n_head_kv * dv
    out = [
        Expected(p + "q_proj.weight", (q, hidden)),
        Expected(p + "k_proj.weight", (kv, hidden)),
        Expected(p + "v_proj.weight", (v, hidden)),
        Expected(p + "o_proj.weight", (hidden, n_head * dv)),
    ]
    if bias:
        out += [
            Expected(p + "q_proj.bias", (n_head * head_dim,)),
            Expected(p + "k_proj.bias", (kv,)),
            Expected(p + "v_proj.bias", (v,)),
        ]
    if qk_norm:
        out += [Expected(p + "q_norm.weight", (head_dim,)), Expected(p + "k_norm.weight", (head_dim,))]
    return out


def dense_ffn(p: str, hidden: int, ff: int) -> list[Expected]:
    """gate/up/down projections under ``p`` (``...mlp.`` or ``...mlp.shared_experts.``)."""
    return [
        Expected(p + "gate_proj.weight", (ff, hidden)),
        Expected(p + "up_proj.weight", (ff, hidden)),
        Expected(p + "down_proj.weight", (hidden, ff)),
    ]


def routed_experts(p: str, hidden: int, n_expert: int, ff: int) -> Iterator[Expected]:
    """Per-expert tensors ``p{e}.{gate,up,down}_proj.weight`` (``p`` = ``...mlp.experts.``), lazily."""
    for e in range(n_expert):
        yield from dense_ffn(f"{p}{e}.", hidden, ff)


def switched(on: bool | None, *expected: Expected) -> list[Expected]:
    """Tensors a config.json switch adds: required when it is true, absent when false, and either way when
    config.json leaves it out (the implementations disagree on the defaults of these switches)."""
    if on is None:
        return [replace(e, optional=True) for e in expected]
    return list(expected) if on else []


def deepseek_moe(
    p: str, hidden: int, n_expert: int, ff: int, n_shared: int = 0, *, router_bias: bool | None = True
) -> Iterator[Expected]:
    """A DeepSeek-style MoE FFN under ``p`` (``...mlp.``): the router (and its noaux_tc correction bias:
    ``router_bias`` as :func:`switched` reads it, None where it may be stored or not), per-expert tensors,
    and ``n_shared`` shared experts stored as one FFN ``n_shared`` times as wide."""
    yield Expected(p + "gate.weight", (n_expert, hidden))
    yield from switched(router_bias, Expected(p + "gate.e_score_correction_bias", (n_expert,)))
    yield from routed_experts(p + "experts.", hidden, n_expert, ff)
    if n_shared:
        yield from dense_ffn(p + "shared_experts.", hidden, ff * n_shared)


def deepseek_layout(
    hp: dict,
    n_trunk: int,
    n_blocks: int,
    attention: Callable[[str], Iterable[Expected]],
    *,
    moe_ff: int,
    router_bias: bool | None,
) -> Iterator[Expected]:
    """DeepSeek-V3's checkpoint, which GLM-4.5 shares but for the attention: blocks ``model.layers.N.`` (the MTP
    blocks appended past the trunk, with the NextN tensors), each two norms, ``attention(block prefix)``, then a
    dense FFN in the first ``first_k_dense_replace`` blocks and MoE in the others (the MTP blocks included)."""
    h, vocab = hp["hidden_size"], hp["vocab_size"]
    n_exp, dense = hp.get("n_routed_experts"), hp.get("first_k_dense_replace") or 0
    yield from embeddings(h, vocab, tied=bool(hp.get("tie_word_embeddings")))
    for bid in range(n_blocks):
        p = f"model.layers.{bid}."
        yield from norms(p, h, "input_layernorm", "post_attention_layernorm")
        yield from attention(p)
        if n_exp and bid >= dense:
            yield from deepseek_moe(
                p + "mlp.", h, n_exp, moe_ff, hp.get("n_shared_experts") or 0, router_bias=router_bias
            )
        else:
            yield from dense_ffn(p + "mlp.", h, hp["intermediate_size"])
        if bid >= n_trunk:
            yield from nextn_head(p, h, vocab)


def norms(p: str, hidden: int, *names: str) -> list[Expected]:
    return [Expected(f"{p}{n}.weight", (hidden,)) for n in names]


def nextn_head(
    p: str, hidden: int, vocab: int, *, norm: str = "shared_head.norm", head: str = "shared_head.head"
) -> list[Expected]:
    """The NextN tensors of an MTP block: eh_proj, enorm, hnorm and ``norm`` (the one before its head); its own
    embed_tokens and ``head`` may be absent, tied to the trunk's (GLM-4.6; llama.cpp falls back)."""
    return [
        Expected(p + "eh_proj.weight", (hidden, 2 * hidden)),
        *norms(p, hidden, "enorm", "hnorm", norm),
        Expected(p + "embed_tokens.weight", (vocab, hidden), optional=True),
        Expected(p + head + ".weight", (vocab, hidden), optional=True),
    ]


def embeddings(hidden: int, vocab: int, tied: bool, prefix: str = "model.") -> list[Expected]:
    return [
        Expected(prefix + "embed_tokens.weight", (vocab, hidden)),
        Expected(prefix + "norm.weight", (hidden,)),
        Expected("lm_head.weight", (vocab, hidden), optional=tied),
    ]
