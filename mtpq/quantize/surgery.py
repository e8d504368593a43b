"""Surgery on existing GGUFs: graft an MTP head into a file that lacks one, or cut it out.

Most published quants drop the MTP blocks. ``plan_graft`` gives such a file the
head of another GGUF of the same model (copied byte for byte, or requantized);
``plan_strip_mtp`` is the trunk-only file (what llama.cpp's converter writes with
``--no-mtp``); ``plan_extract_mtp`` writes the head-only file that llama.cpp's converter
produces with ``--mtp`` and that llama.cpp loads as a ``draft-mtp`` draft model:
the MTP blocks plus ``token_embd``, ``output_norm`` and ``output``, with the
full model's metadata (block_count counts trunk + MTP; the loader recognises a
head-only file by the missing ``blk.0.attn_norm.weight``).

Both return plans; :func:`mtpq.gguf_io.write_plan` streams them to disk.
"""

from __future__ import annotations

import dataclasses

import gguf
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType, Keys

from ..errors import InputError
from ..gguf_io import refresh_size_label
from ..tensors import Plan, TensorSpec, block_index, mtp_only_keep
from .mtp_precision import KEEP, MtpPrecision, MtpPrecisionKind, parse_mtp
from .presets import llama_quantizes, row_fallback

# Hyperparameters that fix the shapes of an MTP block's tensors: they must agree
# between donor and target (compared when both files carry them as scalars).
_SHAPE_KEYS = (
    Keys.Attention.HEAD_COUNT,
    Keys.Attention.HEAD_COUNT_KV,
    Keys.Attention.KEY_LENGTH,
    Keys.Attention.VALUE_LENGTH,
    Keys.LLM.EXPERT_COUNT,
    Keys.LLM.EXPERT_USED_COUNT,
    Keys.LLM.EXPERT_FEED_FORWARD_LENGTH,
    Keys.LLM.EXPERT_SHARED_COUNT,
    Keys.Rope.DIMENSION_COUNT,
)


def _where(plan: Plan) -> str:
    return str(plan.inputs[0]) if plan.inputs else f"<{plan.arch} plan>"


def _key(plan: Plan, template: str) -> str:
    return template.format(arch=plan.arch)


def _mtp_specs(plan: Plan) -> list[TensorSpec]:
    return [s for s in plan.tensors if (b := block_index(s.name)) is not None and b >= plan.n_trunk_layers]


def _n_blocks(plan: Plan) -> int:
    return int(plan.kv_value(_key(plan, Keys.LLM.BLOCK_COUNT), 0))


# ----------------------------------------------------------------------------- checks


def _check_same_model(donor: Plan, target: Plan) -> None:
    """Refuse a donor that is not the same model as the target; the message names the donor."""
    a, b = _where(donor), _where(target)
    if donor.arch != target.arch:
        raise InputError(a, f"architecture {donor.arch} does not match {b} ({target.arch})")
    emb = _key(donor, Keys.LLM.EMBEDDING_LENGTH)
    if donor.kv_value(emb) != target.kv_value(emb):
        raise InputError(a, f"hidden size ({emb}) {donor.kv_value(emb)} does not match {b} ({target.kv_value(emb)})")
    if donor.n_trunk_layers != target.n_trunk_layers:
        raise InputError(
            a,
            f"{donor.n_trunk_layers} trunk layers, but {b} has {target.n_trunk_layers} "
            f"(block_count minus {_key(donor, Keys.LLM.NEXTN_PREDICT_LAYERS)})",
        )
    tok_a, tok_b = donor.kv_value(Keys.Tokenizer.LIST), target.kv_value(Keys.Tokenizer.LIST)
    if tok_a is not None and tok_b is not None:
        if len(tok_a) != len(tok_b):
            raise InputError(a, f"vocabulary has {len(tok_a)} tokens, but {b} has {len(tok_b)}")
        if tok_a != tok_b:
            first = next(i for i, (x, y) in enumerate(zip(tok_a, tok_b)) if x != y)
            raise InputError(a, f"vocabulary differs from {b}'s (token {first}: {tok_a[first]!r} vs {tok_b[first]!r})")
    emb_a = next((s for s in donor.tensors if s.name == "token_embd.weight"), None)
    emb_b = next((s for s in target.tensors if s.name == "token_embd.weight"), None)
    if emb_a is not None and emb_b is not None and emb_a.shape != emb_b.shape:
        raise InputError(
            a, f"token_embd.weight has shape {list(emb_a.shape)}, but {b}'s is {list(emb_b.shape)} (vocab x hidden)"
        )
    for template in _SHAPE_KEYS:
        k = _key(donor, template)
        va, vb = donor.kv_value(k), target.kv_value(k)
        if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and va != vb:
            raise InputError(a, f"{k} is {va}, but {b} has {vb}")


# ----------------------------------------------------------------------------- graft


def _mtp_type_for(spec: TensorSpec, qtype: T, arch: str) -> tuple[T, str]:
    """The type an MTP tensor gets under ``--mtp-type``: what llama-quantize never quantizes keeps its type."""
    if not llama_quantizes(spec.name, spec.shape, arch):
        return spec.ggml_type, f"kept at {spec.ggml_type.name.lower()} (1-D or router: never quantized)"
    new, why = row_fallback(qtype, spec.shape[-1])
    return new, f"mtp block requantized to {qtype.name.lower()} (--mtp-type)" + (f"; {why}" if why else "")


def _merge_per_layer_arrays(out: Plan, donor: Plan, target: Plan) -> None:
    """Metadata arrays with one entry per block (e.g. per-layer head counts) get the donor's MTP entries."""
    n_a, n_b, n_trunk = _n_blocks(donor), _n_blocks(target), target.n_trunk_layers
    for key, val in target.kv.items():
        dv = donor.kv.get(key)
        if val.type != GGUFValueType.ARRAY or dv is None or dv.type != GGUFValueType.ARRAY:
            continue
        if n_a != n_b and len(val.value) == n_b and len(dv.value) == n_a:
            out.set_kv(key, list(val.value[:n_trunk]) + list(dv.value[n_trunk:]), val.type, val.sub_type)


def _set_nextn(out: Plan, n_mtp: int) -> None:
    """Write ``{arch}.nextn_predict_layers`` where converters put it: after the last ``{arch}.*`` key."""
    key = _key(out, Keys.LLM.NEXTN_PREDICT_LAYERS)
    if key in out.kv:  # a trunk-only file that kept the key (llama.cpp loads those too)
        out.set_kv(key, n_mtp, out.kv[key].type)
        return
    items = list(out.kv.items())
    last_arch = max((i for i, (k, _) in enumerate(items) if k.startswith(out.arch + ".")), default=len(items) - 1)
    items.insert(last_arch + 1, (key, gguf.GGUFValue(n_mtp, GGUFValueType.UINT32)))
    out.kv = dict(items)


# 'same' has no trunk rule to follow in an already-quantized target
GRAFT_KINDS = (MtpPrecisionKind.KEEP, MtpPrecisionKind.TYPE)


def plan_graft(donor: Plan, target: Plan, mtp_type: MtpPrecision | str = KEEP, replace: bool = False) -> Plan:
    """``target``'s tensors and metadata plus ``donor``'s MTP blocks.

    Target tensors are copied unchanged and keep their order; the MTP tensors go
    right after the last trunk-block tensor (where converters put them), in the
    donor's order. ``mtp_type``: ``keep`` copies the head byte for byte; a type
    requantizes the head's 2-D/3-D weights from their dequantized values (text is
    parsed here, so a bad value is an InputError naming --mtp-type). A target that
    already has MTP tensors is refused unless ``replace``.
    """
    precision = parse_mtp(mtp_type, "--mtp-type", KEEP, allow=GRAFT_KINDS)
    a, b = _where(donor), _where(target)
    head = _mtp_specs(donor)
    if donor.n_mtp_layers == 0 or not head:
        raise InputError(
            a,
            f"has no MTP blocks to graft ({_key(donor, Keys.LLM.NEXTN_PREDICT_LAYERS)} "
            f"= {donor.n_mtp_layers}, {len(head)} tensors in blocks >= {donor.n_trunk_layers})",
        )
    _check_same_model(donor, target)
    old_head = _mtp_specs(target)
    old_ids = {id(s) for s in old_head}
    kept = [s for s in target.tensors if id(s) not in old_ids]
    if not any(block_index(s.name) is not None for s in kept):
        raise InputError(b, "has no trunk blocks (a head-only file cannot receive a head)")
    if old_head and not replace:
        raise InputError(
            b,
            f"already has an MTP head ({len(old_head)} tensors in blk.{target.n_trunk_layers}+); "
            "pass --replace to swap it for the donor's",
        )

    if not precision.is_keep:
        head = [s.with_type(*_mtp_type_for(s, precision.qtype, donor.arch)) for s in head]
    else:
        origin = donor.inputs[0].name if donor.inputs else "the donor"
        head = [dataclasses.replace(s, reason=f"MTP block copied from {origin}") for s in head]

    if old_head:  # --replace: the new head goes where the old one was
        at = next(i for i, s in enumerate(target.tensors) if id(s) in old_ids)
    else:
        at = max(i for i, s in enumerate(kept) if block_index(s.name) is not None) + 1
    tensors = kept[:at] + head + kept[at:]

    out = Plan(
        arch=target.arch,
        kv=dict(target.kv),
        tensors=tensors,
        inputs=[*target.inputs, *donor.inputs],
        n_trunk_layers=target.n_trunk_layers,
        n_mtp_layers=donor.n_mtp_layers,
    )
    _merge_per_layer_arrays(out, donor, target)
    bc = _key(out, Keys.LLM.BLOCK_COUNT)
    bc_type = out.kv[bc].type if bc in out.kv else GGUFValueType.UINT32
    out.set_kv(bc, target.n_trunk_layers + donor.n_mtp_layers, bc_type)
    _set_nextn(out, donor.n_mtp_layers)
    quantized = any(s.ggml_type not in (T.F32, T.F16, T.BF16) for s in tensors)
    if quantized and Keys.General.QUANTIZATION_VERSION not in out.kv:  # as llama-quantize adds it
        out.set_kv(Keys.General.QUANTIZATION_VERSION, gguf.GGML_QUANT_VERSION, GGUFValueType.UINT32)
    refresh_size_label(out)
    return out


# ----------------------------------------------------------------------------- strip and extract


def plan_strip_mtp(plan: Plan) -> Plan:
    """The trunk alone: every tensor but the MTP blocks' (byte copies), metadata as a ``--no-mtp`` conversion has
    it: block_count counts the trunk, no nextn_predict_layers, per-block arrays cut to the trunk's blocks."""
    head_ids = {id(s) for s in _mtp_specs(plan)}
    n_blocks, n_trunk = _n_blocks(plan), plan.n_trunk_layers
    out = Plan(
        arch=plan.arch,
        kv=dict(plan.kv),
        tensors=[s for s in plan.tensors if id(s) not in head_ids],
        inputs=list(plan.inputs),
        n_trunk_layers=n_trunk,
        n_mtp_layers=0,
    )
    for key, val in plan.kv.items():
        if val.type == GGUFValueType.ARRAY and n_blocks != n_trunk and len(val.value) == n_blocks:
            out.set_kv(key, list(val.value[:n_trunk]), val.type, val.sub_type)
    bc = _key(out, Keys.LLM.BLOCK_COUNT)
    if bc in out.kv:
        out.set_kv(bc, n_trunk, out.kv[bc].type)
    out.drop_kv(_key(out, Keys.LLM.NEXTN_PREDICT_LAYERS))
    refresh_size_label(out)
    return out


def plan_extract_mtp(plan: Plan) -> Plan:
    """The head-only draft file: MTP blocks + token_embd, output_norm, output; metadata unchanged."""
    where = _where(plan)
    head = _mtp_specs(plan)
    if plan.n_mtp_layers == 0 or not head:
        raise InputError(
            where,
            f"has no MTP blocks to extract ({_key(plan, Keys.LLM.NEXTN_PREDICT_LAYERS)} "
            f"= {plan.n_mtp_layers}, {len(head)} tensors in blocks >= {plan.n_trunk_layers})",
        )
    names = {s.name for s in plan.tensors}
    for required in ("token_embd.weight", "output_norm.weight"):  # llama.cpp's loader requires both
        if required not in names:
            raise InputError(where, f"has no {required}, which a head-only draft file needs")
    head_ids = {id(s) for s in head}
    keep = mtp_only_keep(plan.arch)  # DeepSeek-V4's head file also holds its output hyper-connection
    tensors = [s for s in plan.tensors if id(s) in head_ids or s.name in keep]
    if any((b := block_index(s.name)) is not None and b < plan.n_trunk_layers for s in tensors):
        raise AssertionError("a head-only plan kept a trunk block")  # never write a full model as "head-only"
    out = Plan(
        arch=plan.arch,
        kv=dict(plan.kv),
        tensors=tensors,
        inputs=list(plan.inputs),
        n_trunk_layers=plan.n_trunk_layers,
        n_mtp_layers=plan.n_mtp_layers,
    )
    refresh_size_label(out)
    return out
