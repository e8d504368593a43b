"""The precision policy: an ordered list of rules; the first rule that answers decides.

Each rule is a small pure function of a :class:`~mtpq.tensors.TensorSpec` and a
:class:`PolicyContext` returning ``(type, reason)`` or ``None``. After the
deciding rule, a type whose block does not divide the row length falls back as
llama-quantize falls back (q4_k -> q5_0, q5_k -> q5_1, q6_k -> q8_0,
q2_k/q3_k -> q4_0, then f16).

Order (what beats what):

1. never quantized: 1-D tensors, norms, routers, conv1d... keep their type; with
   ``--leave-output-tensor`` also ``output.weight`` (as llama-quantize: it beats
   ``--output-tensor-type``; a tied token_embd is still quantized)
2. ``--token-embedding-type`` / ``--output-tensor-type`` (as in llama-quantize)
3. ``--tensor-type REGEX=TYPE``, first match (beats the MTP rule; applies even
   when the preset is f16/bf16, where llama-quantize ignores it)
4. the MTP rule: every quantizable tensor of an MTP block at ``--mtp-type``
   (its ``*_exps`` at ``--mtp-experts-type``); ``keep`` holds the type it has;
   ``same`` skips this rule
5. ``--pure``: the preset's base type everywhere
6. float presets (F32/F16/BF16): the base type
7. the preset's llama-quantize mix (:func:`mtpq.quantize.presets.llama_mix`)
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Mapping, Optional

from gguf import GGMLQuantizationType

from ..errors import tensor_error
from ..tensors import Role, TensorSpec, tensor_kind
from .mtp_precision import SAME, MtpPrecision
from .presets import (
    ATTN_V_LIKE,
    Category,
    ModelFacts,
    Preset,
    category,
    ggml_n_dims,
    llama_mix,
    llama_order_key,
    llama_quantizes,
    row_fallback,
)

Decision = tuple[GGMLQuantizationType, str]


@dataclass(frozen=True)
class Override:
    """One ``--tensor-type REGEX=TYPE``: searched anywhere in the GGUF name, like std::regex_search."""

    text: str
    pattern: re.Pattern
    qtype: GGMLQuantizationType


@dataclass(frozen=True)
class PolicyContext:
    preset: Preset
    model: ModelFacts
    mtp_type: MtpPrecision = SAME  # SAME: treat the MTP block like the trunk
    mtp_experts_type: MtpPrecision = SAME  # the MTP block's *_exps
    overrides: tuple[Override, ...] = ()
    output_tensor_type: Optional[GGMLQuantizationType] = None
    token_embedding_type: Optional[GGMLQuantizationType] = None
    pure: bool = False
    leave_output: bool = False  # --leave-output-tensor: output.weight keeps its type
    has_imatrix: bool = False  # importance data given (after --include/--exclude-weights): some mixes change
    # llama-quantize's running counters, precomputed in file order by with_counters(): the number of
    # attn_v-like tensors, and each tensor's index among those of its counted category that reach the mix
    n_attn_v: int = 0
    running_index: Mapping[str, int] = field(default_factory=dict)


Rule = Callable[[TensorSpec, PolicyContext], Optional[Decision]]


def _row(spec: TensorSpec) -> int:
    return spec.shape[-1]


# ----------------------------------------------------------------------------- the rules, in order


def never_quantized(spec: TensorSpec, ctx: PolicyContext) -> Optional[Decision]:
    if spec.role not in (Role.NORM, Role.ROUTER) and llama_quantizes(spec.name, spec.shape, ctx.model.arch):
        return None
    if ggml_n_dims(spec.shape) < 2:
        what = "1-D tensor"
    elif spec.role is Role.ROUTER or tensor_kind(spec.name).startswith("ffn_gate_inp"):
        what = "router"
    else:
        what = "never quantized by llama-quantize"
    return spec.ggml_type, f"{what}: kept at {spec.ggml_type.name.lower()}"


def leave_output_tensor(spec: TensorSpec, ctx: PolicyContext) -> Optional[Decision]:
    if ctx.leave_output and spec.name == "output.weight":
        return spec.ggml_type, f"--leave-output-tensor: kept at {spec.ggml_type.name.lower()}"
    return None


def token_embedding_option(spec: TensorSpec, ctx: PolicyContext) -> Optional[Decision]:
    if ctx.token_embedding_type is not None and category(spec.name) is Category.TOKEN_EMBD:
        return ctx.token_embedding_type, "--token-embedding-type"
    return None


def output_tensor_option(spec: TensorSpec, ctx: PolicyContext) -> Optional[Decision]:
    if ctx.output_tensor_type is not None and category(spec.name) is Category.OUTPUT:
        return ctx.output_tensor_type, "--output-tensor-type"
    return None


def user_override(spec: TensorSpec, ctx: PolicyContext) -> Optional[Decision]:
    for o in ctx.overrides:
        if o.pattern.search(spec.name):
            return o.qtype, f"user override {o.text}"
    return None


def mtp_block(spec: TensorSpec, ctx: PolicyContext) -> Optional[Decision]:
    if spec.role is not Role.MTP:
        return None
    if tensor_kind(spec.name).endswith("_exps"):
        precision, what = ctx.mtp_experts_type, "mtp experts"
    else:
        precision, what = ctx.mtp_type, "mtp block"
    if precision.is_same:
        return None
    if precision.is_keep:
        return spec.ggml_type, f"{what} kept at {spec.ggml_type.name.lower()} (--mtp-type keep)"
    return precision.qtype, f"{what} held at {precision.qtype.name.lower()}"


def pure_preset(spec: TensorSpec, ctx: PolicyContext) -> Optional[Decision]:
    if ctx.pure:
        return ctx.preset.base, f"--pure: {ctx.preset.name} base type"
    return None


def float_preset(spec: TensorSpec, ctx: PolicyContext) -> Optional[Decision]:
    if ctx.preset.is_float:
        return ctx.preset.base, f"{ctx.preset.name} preset"
    return None


def preset_mix(spec: TensorSpec, ctx: PolicyContext) -> Optional[Decision]:
    return llama_mix(
        spec.name,
        _row(spec),
        ctx.preset,
        ctx.model,
        i_running=ctx.running_index.get(spec.name, 0),
        n_attn_v=ctx.n_attn_v,
        output_tensor_type=ctx.output_tensor_type,
        has_imatrix=ctx.has_imatrix,
        n_mat=spec.shape[0] if len(spec.shape) == 3 else 1,
    )


RULES: list[Rule] = [
    never_quantized,
    leave_output_tensor,
    token_embedding_option,
    output_tensor_option,
    user_override,
    mtp_block,
    pure_preset,
    float_preset,
    preset_mix,
]


# ----------------------------------------------------------------------------- deciding


def first_answer(spec: TensorSpec, ctx: PolicyContext, rules: Iterable[Rule] = RULES) -> tuple[Rule, Decision]:
    for rule in rules:
        answer = rule(spec, ctx)
        if answer is not None:
            return rule, answer
    raise AssertionError("preset_mix always answers")


def decide(spec: TensorSpec, ctx: PolicyContext) -> Decision:
    """The type of one tensor and the reason, after llama-quantize's row-length fallback."""
    rule, (qtype, reason) = first_answer(spec, ctx)
    if rule in _KEPT:
        return qtype, reason
    try:
        new, why = row_fallback(qtype, _row(spec))
    except ValueError as e:  # llama-quantize stops there too
        raise tensor_error(spec.source, spec.name, str(e)) from None
    return (new, f"{reason}; {why}") if why else (qtype, reason)


def with_counters(ctx: PolicyContext, specs: list[TensorSpec]) -> PolicyContext:
    """Fill in llama-quantize's attn_v / ffn_down / ffn_gate / ffn_up counters.

    llama.cpp counts every attn_v-like tensor in the file (n_attention_wv) but
    advances the running index only for tensors that reach the preset's mix, in
    its file order. Tensors decided by an earlier rule (an override, --pure, the
    MTP rule) do not advance it, exactly as there.
    """
    n_attn_v = sum(1 for s in specs if category(s.name) in ATTN_V_LIKE)
    base = replace(ctx, n_attn_v=n_attn_v, running_index={})
    seen: dict[Category, int] = defaultdict(int)
    index = {}
    for s in sorted(specs, key=lambda s: llama_order_key(s.name)):
        rule, _ = first_answer(s, base)
        if rule is not preset_mix:
            continue
        cat = category(s.name)
        counter = "attn_v" if cat in ATTN_V_LIKE else cat if cat in _COUNTED else None
        if counter is not None:
            index[s.name] = seen[counter]
            seen[counter] += 1
    return replace(base, running_index=index)


_KEPT = (never_quantized, leave_output_tensor)  # the type it has: no row fallback
_COUNTED = (Category.FFN_DOWN, Category.FFN_GATE, Category.FFN_UP)
