"""Checks a checkpoint must pass before the converter writes a byte.

All cheap (names, shapes, JSON; no tensor data is read; see benchmarks/convert_bench.py):

- :func:`check_config`: config.json values have the JSON types they must have
  (``"num_hidden_layers": "four"``, a negative dimension, a list where an
  object belongs: one line each), wherever they sit (top level or text_config).
- :func:`check_required_hparams`: the hparams a family cannot do without.
- :func:`check_dtypes`: every stored weight is floating point; an FP8 one has a
  float scale companion whose shape fits it.
- :func:`check_tensors`: every tensor the family's config implies exists with
  the implied shape (trunk and MTP blocks), and inside the blocks it describes
  nothing else is stored (a bias with ``attention_bias: false``).

The safetensors container itself (byte ranges tiling each shard's data area)
is checked where headers are read, in :mod:`.checkpoint`.

Families declare what they need as data: ``required_hparams`` and
``expected_tensors(keep_mtp)`` yielding :class:`Expected` entries; this module
does the checking once for all of them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Container, Iterable, Iterator

from ..errors import InputError

if TYPE_CHECKING:
    from .base import Family
    from .checkpoint import HFCheckpoint

# ----------------------------------------------------------------------------- config.json

# key -> (kind, minimum). "int" values must be JSON integers (not bools), "number" ints or floats,
# "bool" true/false, "strs" a list of strings, "flags" a list of 0/1 (or true/false). null is allowed everywhere
# (families decide what null means).
_POSITIVE, _NON_NEGATIVE = 1, 0
CONFIG_SCHEMA: dict[str, tuple[str, float | None]] = {
    **{k: ("int", _POSITIVE) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "moe_intermediate_size", "shared_expert_intermediate_size",
        "n_routed_experts", "num_experts", "num_local_experts", "num_experts_per_tok", "max_position_embeddings",
        "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
        "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
        "linear_num_value_heads", "full_attention_interval", "n_group", "topk_group",
        # Step3.5 and MiMo-V2 spellings
        "num_attention_groups", "moe_num_experts", "moe_top_k", "share_expert_dim",
        "swa_num_attention_heads", "swa_num_key_value_heads", "swa_head_dim", "swa_v_head_dim", "sliding_window_size",
        # GLM-5's sparse-attention indexer
        "index_n_heads", "index_head_dim", "index_topk")},
    **{k: ("int", _NON_NEGATIVE) for k in (
        "n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers", "mtp_num_hidden_layers")},
    **{k: ("number", None) for k in ("rms_norm_eps", "routed_scaling_factor", "partial_rotary_factor")},
    "rope_theta": ("numbers", None),  # Step3.5 gives one base per attention kind: [full, sliding, ...]
    **{k: ("bool", None) for k in ("tie_word_embeddings", "attention_bias", "use_qk_norm", "norm_topk_prob",
                                   "use_head_wise_attn_gate", "use_moe_router_bias", "add_swa_attention_sink_bias",
                                   "add_full_attention_sink_bias")},
    "hybrid_layer_pattern": ("flags", None),  # MiMo-V2: per layer, 1 = sliding window
    **{k: ("strs", None) for k in ("architectures", "layer_types")},
    **{k: ("dict", None) for k in ("text_config", "rope_scaling", "rope_parameters", "quantization_config")},
}


def _type_problem(key: str, value, kind: str, minimum: float | None) -> str | None:
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if kind == "int" and not is_int:
        return f"{key} must be an integer, got {value!r}"
    if kind == "number" and not (is_int or isinstance(value, float)):
        return f"{key} must be a number, got {value!r}"
    if kind == "numbers":
        items = value if isinstance(value, list) and value else [value]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in items):
            return f"{key} must be a number (or a list of numbers), got {value!r}"
        return None
    if kind == "bool" and not isinstance(value, bool):
        return f"{key} must be true or false, got {value!r}"
    if kind == "strs" and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        return f"{key} must be a list of strings, got {value!r}"
    if kind == "flags" and not (isinstance(value, list) and all(v in (0, 1) and not isinstance(v, float)
                                                                for v in value)):
        return f"{key} must be a list of 0/1 flags, got {value!r}"
    if kind == "dict" and not isinstance(value, dict):
        return f"{key} must be a JSON object, got {value!r}"
    if minimum is not None and value < minimum:
        return f"{key} must be {'positive' if minimum > 0 else 'at least 0'}, got {value}"
    return None


def check_config(config, path: Path) -> None:
    """config.json's values have the types the converter relies on; the first problem is an InputError."""
    if not isinstance(config, dict):
        raise InputError(path, f"expected a JSON object, got {type(config).__name__}")
    tables = [("", config)]
    if isinstance(config.get("text_config"), dict):
        tables.append(("text_config.", config["text_config"]))
    for prefix, table in tables:
        for key, value in table.items():
            rule = CONFIG_SCHEMA.get(key)
            if rule is None or value is None:
                continue
            if (problem := _type_problem(prefix + key, value, *rule)) is not None:
                raise InputError(path, problem)


def check_required_hparams(family: "Family") -> None:
    """The keys a family cannot do without must be STORED: transformers' view fills a missing hidden_size with its
    class default (4096), and a checkpoint refused for "shape [512, 256], config.json implies [512, 4096]" would
    blame the wrong thing. (Keys transformers derives from other stored keys are not required; families read
    them from the view.)"""
    stored = family.text_config(family.ckpt.config)
    missing = [k for k in family.required_hparams if stored.get(k) is None]
    if missing:
        raise InputError(family.ckpt.folder / "config.json",
                         f"missing {', '.join(missing)} (needed to convert {family.hf_architectures[0]})")


# ----------------------------------------------------------------------------- tensors


@dataclass(frozen=True)
class Expected:
    """A tensor the config implies: its (logical) HF name and shape; ``optional`` ones may be absent."""

    name: str
    shape: tuple[int, ...]
    optional: bool = False


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
        raise InputError(st.file, f"tensor {name} has dtype {st.dtype}; a weight must be floating point "
                                  "(F32, F16, BF16 or FP8 with a scale)")
    for name, st in ckpt.stored.items():  # scale companions: float, as every FP8 recipe stores them
        if (ckpt.is_scale(name) and name.endswith(("_scale_inv", "_scale")) and st.dtype not in FLOAT_DTYPES
                and name.rsplit("_scale", 1)[0] not in own_encodings):
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
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise InputError(ckpt.folder / "config.json",
                         f"quantization_config.weight_block_size must be two positive integers, got {block!r}")
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
            raise InputError(scale.file, f"{scale.name} has shape {list(scale.shape)}, expected {list(want)} "
                                         f"for {bh}x{bw} tiles of {name} {list(st.shape)}")
    elif (scale := ckpt.stored.get(name + "_scale")) is not None:  # per-channel [out, 1] or one scalar
        n = 1
        for d in scale.shape:
            n *= d
        if n != 1 and (not st.shape or n != st.shape[0]):
            raise InputError(scale.file, f"{scale.name} has shape {list(scale.shape)}, expected one scale per "
                                         f"output row of {name} {list(st.shape)} (or a single scale)")
    else:
        raise InputError(st.file, f"FP8 tensor {name} has no weight_scale_inv or weight_scale companion")


def check_tensors(family: "Family", expected: Iterable[Expected], layout: str) -> None:
    """Every expected tensor exists (resolved through ``family.resolve``) with the expected shape, and
    no stored tensor inside a described block is left over.

    ``expected`` is consumed lazily: an absurd config (a billion layers or experts) fails at its
    first missing tensor instead of building the list. ``layout`` ends a missing-tensor message
    ("config.json has 2 layers + 1 MTP").
    """
    ckpt = family.ckpt
    names: set[str] = set()
    for e in expected:
        names.add(e.name)
        hf = family.resolve(e.name)
        if hf is None:
            if e.optional:
                continue
            hint = "; convert the trunk alone with --no-mtp" if _in_mtp_block(e.name, family.n_trunk) else ""
            layer = _BLOCK.match(e.name)
            if layer and not any(n.startswith(layer[0]) for n in family.logical_names()):
                raise InputError(ckpt.folder, f"no tensors for layer {layer[1]} ({layer[0]}*; {layout}{hint})")
            raise InputError(ckpt.folder, f"missing tensor {e.name} ({layout}{hint})")
        got = family.logical_shape(hf)
        if got != tuple(e.shape):
            raise InputError(ckpt.stored[hf].file, f"{hf} has shape {list(got)}, but config.json implies {list(e.shape)}")
    _check_no_extra(family, names)


def _check_no_extra(family: "Family", names: set[str]) -> None:
    """Inside a block config.json describes, a stored tensor it does not imply (a q_proj.bias with
    attention_bias false, shared experts with n_shared_experts 0) contradicts it: which one is right?"""
    blocks = {m[0] for n in names if (m := _BLOCK.match(n))}
    for name in family.logical_names():
        m = _BLOCK.match(name)
        if m and m[0] in blocks and name not in names:
            hf = family.resolve(name) or name
            raise InputError(family.ckpt.stored[hf].file, f"{hf} is stored, but config.json implies no such tensor")


def check_family(family: "Family", keep_mtp: bool) -> None:
    """All tensor-level checks of one checkpoint for one family; called before any tensor is planned."""
    check_dtypes(family.ckpt, family.own_encodings)
    layout = f"config.json has {family.n_trunk} layers" + (f" + {family.n_mtp} MTP" if family.n_mtp else "")
    expected = family.expected_tensors(keep_mtp)
    if expected is not None:
        check_tensors(family, expected, layout)


# ----------------------------------------------------------------------------- building blocks families declare with


def attention(p: str, hidden: int, n_head: int, n_head_kv: int, head_dim: int, *, bias: bool = False,
              qk_norm: bool = False, q_rows: int | None = None, v_head_dim: int | None = None) -> list[Expected]:
    """A (grouped-query) attention block under ``p`` (``...self_attn.``); ``q_rows`` for gated q_proj,
    ``v_head_dim`` where value heads are narrower than query/key heads (MiMo-V2)."""
    dv = v_head_dim or head_dim
    q, kv, v = q_rows or n_head * head_dim, n_head_kv * head_dim, n_head_kv * dv
    out = [Expected(p + "q_proj.weight", (q, hidden)), Expected(p + "k_proj.weight", (kv, hidden)),
           Expected(p + "v_proj.weight", (v, hidden)), Expected(p + "o_proj.weight", (hidden, n_head * dv))]
    if bias:
        out += [Expected(p + "q_proj.bias", (n_head * head_dim,)), Expected(p + "k_proj.bias", (kv,)),
                Expected(p + "v_proj.bias", (v,))]
    if qk_norm:
        out += [Expected(p + "q_norm.weight", (head_dim,)), Expected(p + "k_norm.weight", (head_dim,))]
    return out


def dense_ffn(p: str, hidden: int, ff: int) -> list[Expected]:
    """gate/up/down projections under ``p`` (``...mlp.`` or ``...mlp.shared_experts.``)."""
    return [Expected(p + "gate_proj.weight", (ff, hidden)), Expected(p + "up_proj.weight", (ff, hidden)),
            Expected(p + "down_proj.weight", (hidden, ff))]


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


def deepseek_moe(p: str, hidden: int, n_expert: int, ff: int, n_shared: int = 0, *,
                 router_bias: bool | None = True) -> Iterator[Expected]:
    """A DeepSeek-style MoE FFN under ``p`` (``...mlp.``): the router (and its noaux_tc correction bias:
    ``router_bias`` as :func:`switched` reads it, None where it may be stored or not), per-expert tensors,
    and ``n_shared`` shared experts stored as one FFN ``n_shared`` times as wide."""
    yield Expected(p + "gate.weight", (n_expert, hidden))
    yield from switched(router_bias, Expected(p + "gate.e_score_correction_bias", (n_expert,)))
    yield from routed_experts(p + "experts.", hidden, n_expert, ff)
    if n_shared:
        yield from dense_ffn(p + "shared_experts.", hidden, ff * n_shared)


def deepseek_layout(family: "Family", keep_mtp: bool, attention: Callable[[str], Iterable[Expected]], *,
                    moe_ff: int, router_bias: bool | None) -> Iterator[Expected]:
    """DeepSeek-V3's checkpoint, which GLM-4.5 shares but for the attention: blocks ``model.layers.N.`` (the MTP
    blocks appended past the trunk, with the NextN tensors), each two norms, ``attention(block prefix)``, then a
    dense FFN in the first ``first_k_dense_replace`` blocks and MoE in the others (the MTP blocks included)."""
    hp = family.hparams
    h, vocab = hp["hidden_size"], hp["vocab_size"]
    n_exp, dense = hp.get("n_routed_experts"), hp.get("first_k_dense_replace") or 0
    yield from embeddings(h, vocab, tied=bool(hp.get("tie_word_embeddings")))
    for bid in range(family.n_trunk + (family.n_mtp if keep_mtp else 0)):
        p = f"model.layers.{bid}."
        yield from norms(p, h, "input_layernorm", "post_attention_layernorm")
        yield from attention(p)
        if n_exp and bid >= dense:
            yield from deepseek_moe(p + "mlp.", h, n_exp, moe_ff, hp.get("n_shared_experts") or 0,
                                    router_bias=router_bias)
        else:
            yield from dense_ffn(p + "mlp.", h, hp["intermediate_size"])
        if bid >= family.n_trunk:
            yield from nextn_head(p, h, vocab)


def norms(p: str, hidden: int, *names: str) -> list[Expected]:
    return [Expected(f"{p}{n}.weight", (hidden,)) for n in names]


def nextn_head(p: str, hidden: int, vocab: int, *, norm: str = "shared_head.norm",
               head: str = "shared_head.head") -> list[Expected]:
    """The NextN tensors of an MTP block: eh_proj, enorm, hnorm and ``norm`` (the one before its head); its own
    embed_tokens and ``head`` may be absent, tied to the trunk's (GLM-4.6; llama.cpp falls back)."""
    return [Expected(p + "eh_proj.weight", (hidden, 2 * hidden)), *norms(p, hidden, "enorm", "hnorm", norm),
            Expected(p + "embed_tokens.weight", (vocab, hidden), optional=True),
            Expected(p + head + ".weight", (vocab, hidden), optional=True)]


def embeddings(hidden: int, vocab: int, tied: bool, prefix: str = "model.") -> list[Expected]:
    return [Expected(prefix + "embed_tokens.weight", (vocab, hidden)), Expected(prefix + "norm.weight", (hidden,)),
            Expected("lm_head.weight", (vocab, hidden), optional=tied)]
