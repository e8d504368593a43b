"""Plan -> plan with new types: the policy applied to every tensor, with reasons.

``plan_quantize`` decides types only; bytes are produced later, tensor by
tensor, when :func:`mtpq.gguf_io.write_plan` asks the kernels facade
(:func:`mtpq.ggml.kernels.quantize`). The same function serves
``mtpq quantize`` (a plan read from a GGUF) and ``mtpq convert --quant`` (a plan
read from an HF checkpoint, quantized from the source values in one pass).
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Sequence

from gguf import GGML_QUANT_VERSION, GGMLQuantizationType, GGUFValueType, Keys

from ..errors import InputError
from ..gguf_io import refresh_size_label, tensor_nbytes
from ..tensors import Plan, Role, TensorSpec
from .imatrix import Imatrix, select_entries
from .kv_override import KvOverride, apply_kv_overrides, parse_kv_overrides
from .mtp_precision import Q8_0, SAME, MtpPrecision, parse_mtp
from .policy import Override, PolicyContext, decide, never_quantized, with_counters
from .presets import FLOAT_TYPES, Category, ModelFacts, Preset, category, preset_named, requires_imatrix, type_named
from .prune import parse_prune_layers, prune_blocks

log = logging.getLogger(__name__)

MTP_DEFAULT = Q8_0  # the GGUF 8-bit class: at least as precise as FP8 e4m3


def parse_overrides(items: Sequence[str], option: str = "--tensor-type") -> tuple[Override, ...]:
    """``REGEX=TYPE`` strings -> overrides. Matching ignores case (llama-quantize lower-cases the pattern)."""
    out = []
    for text in items:
        pattern, eq, typ = text.rpartition("=")  # the type never holds '=', a regex may
        if not eq or not pattern or not typ:
            raise InputError(option, f"{text!r} is not REGEX=TYPE (e.g. 'blk\\.4[0-9]\\.ffn_down=q6_k')")
        try:
            compiled = re.compile(pattern, re.IGNORECASE)
        except re.error as exc:
            raise InputError(option, f"bad regular expression {pattern!r}: {exc}") from None
        out.append(Override(text, compiled, type_named(typ, option)))
    return tuple(out)


def read_tensor_type_file(path: str | Path) -> list[str]:
    """``--tensor-type-file``: the ``REGEX=TYPE`` entries of a file, separated by spaces or newlines (as
    llama-quantize reads them: whitespace-separated words, no comments)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(path, f"cannot read the tensor type file ({getattr(exc, 'strerror', None) or exc})") from None
    words = text.split()
    if not words:
        raise InputError(path, "the tensor type file has no REGEX=TYPE entries")
    parse_overrides(words, option=str(path))  # a bad entry names the file
    return words


def _optional_type(text: Optional[str], option: str) -> Optional[GGMLQuantizationType]:
    return None if text is None else type_named(text, option)


def model_facts(plan: Plan) -> ModelFacts:
    """What llama-quantize reads from the model's hparams to pick types."""
    arch = plan.arch

    def first(key: str, default: int) -> int:
        v = plan.kv_value(f"{arch}.{key}", default)
        if isinstance(v, (list, tuple)):  # per-layer arrays: llama.cpp's n_gqa() looks at layer 0
            v = v[0] if v else default
        return int(v)

    n_head = first("attention.head_count", 0)
    return ModelFacts(
        arch=arch,
        n_layer_all=first("block_count", plan.n_trunk_layers + plan.n_mtp_layers),
        n_expert=first("expert_count", 0),
        n_head=n_head,
        n_head_kv=first("attention.head_count_kv", n_head),
        tied_embeddings=not any(s.name == "output.weight" for s in plan.tensors),
    )


@dataclass(frozen=True)
class QuantOptions:
    """One quantize job's choices, parsed and validated once (:func:`parse_options`) and passed whole."""

    preset: Preset
    mtp_type: MtpPrecision  # SAME: the MTP block is treated like the trunk
    mtp_experts_type: Optional[MtpPrecision] = None  # the MTP block's *_exps; None: as mtp_type
    overrides: tuple[Override, ...] = ()
    output_tensor_type: Optional[GGMLQuantizationType] = None
    token_embedding_type: Optional[GGMLQuantizationType] = None
    leave_output_tensor: bool = False
    kv_overrides: tuple[KvOverride, ...] = ()
    prune_layers: tuple[int, ...] = ()
    pure: bool = False  # no llama-quantize mix: the preset's base type everywhere
    allow_requantize: bool = False
    imatrix: Optional[Imatrix] = None
    include_weights: tuple[str, ...] = ()  # substrings, as llama-quantize's --include-weights
    exclude_weights: tuple[str, ...] = ()

    @property
    def experts_type(self) -> MtpPrecision:
        return self.mtp_type if self.mtp_experts_type is None else self.mtp_experts_type

    def with_mtp_type(self, mtp_type: str | MtpPrecision) -> "QuantOptions":
        """The same job with the MTP block at ``mtp_type`` (its experts too, unless they were given their own)."""
        return replace(self, mtp_type=parse_mtp(mtp_type, "--mtp-type"))


def parse_options(
    preset: str | Preset,
    mtp_type: str | MtpPrecision | None = None,
    mtp_experts_type: str | MtpPrecision | None = None,
    tensor_types: Sequence[str] = (),
    output_tensor_type: Optional[str] = None,
    token_embedding_type: Optional[str] = None,
    preset_option: str = "PRESET",
    tensor_type_files: Sequence[str | Path] = (),
    leave_output_tensor: bool = False,
    kv_overrides: Sequence[str] = (),
    prune_layers: str | Sequence[int] | None = None,
    pure: bool = False,
    allow_requantize: bool = False,
    imatrix: Optional[Imatrix] = None,
    include_weights: Sequence[str] = (),
    exclude_weights: Sequence[str] = (),
) -> QuantOptions:
    """Validate every option (InputError naming the option or file); nothing but ``tensor_type_files`` is read.

    ``mtp_type``: an :class:`MtpPrecision` (or its text) for the MTP blocks' tensors: a type (default q8_0),
    ``keep`` (the type they have) or ``same`` (like the trunk; the default for float presets, so a head is never
    made coarser than its trunk unless asked). ``mtp_experts_type``: the MTP blocks' ``*_exps`` (default:
    ``mtp_type``). The entries of ``tensor_type_files`` (``--tensor-type-file``) follow those of ``tensor_types``,
    file after file (first match wins). ``imatrix``: importance data (:func:`mtpq.quantize.imatrix.read_imatrix`),
    narrowed by ``include_weights`` / ``exclude_weights``.
    """
    p = preset if isinstance(preset, Preset) else preset_named(preset, preset_option)
    mtp = parse_mtp(mtp_type, "--mtp-type", SAME if p.is_float else MTP_DEFAULT)
    from_files = [w for f in tensor_type_files for w in read_tensor_type_file(f)]
    return QuantOptions(
        preset=p,
        mtp_type=mtp,
        mtp_experts_type=parse_mtp(mtp_experts_type, "--mtp-experts-type"),
        overrides=parse_overrides(tensor_types) + parse_overrides(from_files, "--tensor-type-file"),
        output_tensor_type=_optional_type(output_tensor_type, "--output-tensor-type"),
        token_embedding_type=_optional_type(token_embedding_type, "--token-embedding-type"),
        leave_output_tensor=leave_output_tensor,
        kv_overrides=parse_kv_overrides(kv_overrides),
        prune_layers=parse_prune_layers(prune_layers),
        pure=pure,
        allow_requantize=allow_requantize,
        imatrix=imatrix,
        include_weights=tuple(include_weights),
        exclude_weights=tuple(exclude_weights),
    )


def plan_quantize(plan: Plan, o: QuantOptions) -> Plan:
    """``plan`` with every tensor's type (and reason) decided by the policy for the job's options ``o``.

    Each quantized tensor with an imatrix entry carries its weights (``TensorSpec.importance``) and the mixes that
    depend on an imatrix change as in llama-quantize.

    llama-quantize's other options: ``kv_overrides`` (``KEY=TYPE:VALUE``: written, and read for the choices as
    llama.cpp's loader reads them, :mod:`.kv_override`) and ``prune_layers`` (blocks dropped and the rest
    renumbered, the metadata kept consistent, :mod:`.prune`; the choices count layers as llama-quantize does, from
    the unpruned ``block_count``). Roles are the input's: an MTP block keeps the MTP rule wherever it is
    renumbered to.
    """
    p = o.preset
    selected = _select_imatrix(plan, o.imatrix, o.include_weights, o.exclude_weights)
    if o.kv_overrides:  # what the loader (and so llama-quantize's choices) reads, and the output's start
        plan = replace(plan, kv=dict(plan.kv))
        apply_kv_overrides(plan, o.kv_overrides)
    facts = model_facts(plan)
    plan = prune_blocks(plan, o.prune_layers)
    ctx = PolicyContext(
        preset=p,
        model=facts,
        mtp_type=o.mtp_type,
        mtp_experts_type=o.experts_type,
        overrides=o.overrides,
        output_tensor_type=o.output_tensor_type,
        token_embedding_type=o.token_embedding_type,
        pure=o.pure,
        leave_output=o.leave_output_tensor,
        has_imatrix=selected is not None,
    )
    ctx = with_counters(ctx, plan.tensors)

    specs: list[TensorSpec] = []
    requantized: list[TensorSpec] = []
    for spec in plan.tensors:
        qtype, reason = decide(spec, ctx)
        src = spec.source_type
        if src is not None and src not in FLOAT_TYPES and qtype != src:
            requantized.append(spec)
            reason = f"{reason} (requantized from {src.name.lower()})"
        new = spec.with_type(qtype, reason)
        if selected is not None and never_quantized(spec, ctx) is None:
            new = _with_importance(new, selected)
        specs.append(new)
    _check_imatrix_coverage(specs, p, o.imatrix)

    if requantized:
        first = requantized[0]
        what = (
            f"{len(requantized)} tensor(s) are already quantized and would be requantized "
            f"(e.g. {first.name}: {first.source_type.name.lower()})"
        )
        if not o.allow_requantize:
            where = plan.inputs[0] if plan.inputs else first.source
            raise InputError(
                where,
                f"{what}; requantizing loses precision: start from an f16/bf16/f32 GGUF or pass --allow-requantize",
            )
        log.warning("%s; quality will be worse than quantizing from full precision", what)

    kv = dict(plan.kv)
    out = Plan(
        plan.arch,
        kv,
        specs,
        inputs=list(plan.inputs),
        n_trunk_layers=plan.n_trunk_layers,
        n_mtp_layers=plan.n_mtp_layers,
    )
    overridden = {kvo.key for kvo in o.kv_overrides}  # llama-quantize applies them after these two
    if Keys.General.FILE_TYPE not in overridden:
        out.set_kv(Keys.General.FILE_TYPE, int(p.ftype), GGUFValueType.UINT32)
    if Keys.General.QUANTIZATION_VERSION not in overridden:
        out.set_kv(Keys.General.QUANTIZATION_VERSION, GGML_QUANT_VERSION, GGUFValueType.UINT32)
    if o.prune_layers:
        refresh_size_label(out)
    if selected is not None:  # what llama-quantize records about the imatrix
        out.set_kv("quantize.imatrix.file", str(o.imatrix.path or "imatrix")[:127], GGUFValueType.STRING)
        if selected.datasets:
            out.set_kv("quantize.imatrix.dataset", selected.datasets[0][:127], GGUFValueType.STRING)
        out.set_kv("quantize.imatrix.entries_count", len(selected.entries), GGUFValueType.UINT32)
        if selected.chunk_count > 0:
            out.set_kv("quantize.imatrix.chunks_count", selected.chunk_count, GGUFValueType.UINT32)
    return out


def _select_imatrix(
    plan: Plan, imatrix: Optional[Imatrix], include: Sequence[str], exclude: Sequence[str]
) -> Optional[Imatrix]:
    """The entries in use, or None when there are none (then nothing changes, as in llama-quantize)."""
    if include and exclude:
        raise InputError("--include-weights", "cannot be combined with --exclude-weights (llama-quantize refuses too)")
    if imatrix is None:
        if include or exclude:
            raise InputError("--include-weights" if include else "--exclude-weights", "needs --imatrix FILE")
        return None
    names = {s.name for s in plan.tensors}
    if not any(n in names for n in imatrix.entries):
        example = next(iter(imatrix.entries))
        raise InputError(
            imatrix.where(),
            f"none of its {len(imatrix.entries)} entries (e.g. {example}) names a "
            "tensor of this model: an imatrix made for another model?",
        )
    selected = select_entries(imatrix, list(include), list(exclude))
    return selected if selected.entries else None


def _with_importance(spec: TensorSpec, im: Imatrix) -> TensorSpec:
    """``spec`` carrying its importance weights, if the imatrix has an entry for it (under its name in the
    input: llama-quantize looks a renumbered block's weights up under its old number).

    A size that does not fit is an error (an imatrix for another model), except for
    token_embd, which llama-quantize quantizes without weights then.
    """
    n_mat = spec.shape[0] if len(spec.shape) == 3 else 1
    try:
        w = im.importance(spec.input_name or spec.name, spec.shape[-1], n_mat)
    except InputError:
        if category(spec.name) is Category.TOKEN_EMBD:
            return spec
        raise
    return spec if w is None else replace(spec, importance=w)


def _check_imatrix_coverage(specs: list[TensorSpec], preset: Preset, imatrix: Optional[Imatrix]) -> None:
    """Refuse, before anything is written, types that need importance data for tensors without it.

    llama-quantize aborts mid-file ("Missing importance matrix for tensor ...");
    here one line names the tensors and what to do -- for the MTP head, which
    llama-imatrix never runs, a type that needs no imatrix or ``mtpq imatrix --mtp``.
    """
    missing = [
        s
        for s in specs
        if s.importance is None and s.source_type != s.ggml_type and requires_imatrix(s.name, s.ggml_type, preset)
    ]
    if not missing:
        return
    names = ", ".join(s.name for s in missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
    types = "/".join(sorted({s.ggml_type.name.lower() for s in missing}))
    what = f"{len(missing)} tensor(s) to be quantized to {types} ({names}) need importance data"
    if any(s.role is Role.MTP for s in missing):
        remedy = (
            "llama-imatrix never runs the MTP head: give it a type that needs no imatrix "
            "(--mtp-type q8_0, the default) or add the head's entries with `mtpq imatrix --mtp`"
        )
    else:
        remedy = "use an imatrix with entries for them, or a type that needs none"
    if imatrix is None:
        raise InputError("--imatrix", f"{what}: pass --imatrix FILE ({remedy})")
    raise InputError(imatrix.where(), f"{what}, and it has none for them: {remedy}")


def plan_change_summary(before: Plan, after: Plan) -> dict:
    """A JSON-ready account of the decisions: one row per tensor and totals by role."""
    rows = []
    by_role: dict[str, dict[str, int]] = defaultdict(lambda: {"tensors": 0, "elements": 0, "old_bytes": 0, "bytes": 0})
    inputs = {s.name: s for s in before.tensors}
    for new in after.tensors:  # --prune-layers: fewer tensors, renamed
        old = inputs[new.input_name or new.name]
        old_bytes, new_bytes = tensor_nbytes(old.shape, old.ggml_type), tensor_nbytes(new.shape, new.ggml_type)
        rows.append(
            {
                "name": new.name,
                "role": new.role.value,
                "shape": list(new.shape),
                "old_type": old.ggml_type.name,
                "type": new.ggml_type.name,
                "old_bytes": old_bytes,
                "bytes": new_bytes,
                "rule": new.reason,
                **({"input_name": old.name} if old.name != new.name else {}),
            }
        )
        r = by_role[new.role.value]
        r["tensors"] += 1
        r["elements"] += new.n_elements
        r["old_bytes"] += old_bytes
        r["bytes"] += new_bytes
    roles = {
        k: {**v, "bits_per_weight": round(8 * v["bytes"] / max(v["elements"], 1), 3)}
        for k, v in sorted(by_role.items())
    }
    n_el = sum(v["elements"] for v in by_role.values())
    total_old = sum(v["old_bytes"] for v in by_role.values())
    total_new = sum(v["bytes"] for v in by_role.values())
    return {
        "arch": after.arch,
        "file_type": after.kv_value(Keys.General.FILE_TYPE),
        "tensors": rows,
        "by_role": roles,
        "totals": {
            "tensors": len(rows),
            "elements": n_el,
            "old_bytes": total_old,
            "bytes": total_new,
            "bits_per_weight": round(8 * total_new / max(n_el, 1), 3),
            "pruned_tensors": len(before.tensors) - len(rows),
        },
    }
