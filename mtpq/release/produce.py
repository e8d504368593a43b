"""What each file of a build is made of. Every maker takes a job (see :mod:`.plan`) and returns the files it wrote.

- the reference: the checkpoint converted once (``combined``), or its trunk (``trunk``, the layouts with head
  files): a ``--no-mtp`` conversion, byte for byte;
- a head file ``mtp-NAME-LABEL.gguf``: the reference's MTP blocks with ``token_embd``, ``output_norm`` and
  ``output`` (the file llama.cpp's converter writes with ``--mtp``), the head and those two matrices at the
  head's type; the reference's own head is the ``--mtp-only`` conversion; a head quantized like its trunk
  (``same``) is cut from that quant;
- a variant: the reference quantized (or an existing quant given the reference's head), whole or as its trunk;
- a fused file (layout ``both``): a trunk and its head file grafted into one, byte copies of both.

In the layouts with head files the reference is read as its trunk with its head file grafted back in, which is
the one-file reference byte for byte (tests/release/test_sidecar.py), so a variant is the same either way.
"""

from __future__ import annotations

from pathlib import Path

from ..tensors import Plan
from .recipe import Recipe, Variant


def _write(plan: Plan, out: Path, split_max_size: int) -> list[Path]:
    from ..gguf_io import SplitRule, write_plan

    return write_plan(plan, out, split=SplitRule(max_size=split_max_size))


def converted(recipe: Recipe, mode: str = "keep") -> Plan:
    """The checkpoint as a plan at the reference type: whole (``keep``), trunk only (``drop``), head only (``only``)."""
    from ..convert import OUTTYPES, BlockSelection, plan_checkpoint

    return plan_checkpoint(recipe.source, mtp=BlockSelection(mode), outtype=OUTTYPES[recipe.reference_type])


def reference_plan(job: dict) -> Plan:
    """The reference as one model: its file, or its trunk with its head file grafted back in."""
    from ..gguf_io import plan_from_gguf
    from ..quantize.surgery import plan_graft

    trunk = plan_from_gguf(Path(job["reference"]))
    head = job.get("reference_head")
    return trunk if head is None else plan_graft(plan_from_gguf(Path(head)), trunk)


def variant_plan(reference: Plan, v: Variant) -> Plan:
    """The variant with its own head: the reference quantized by the variant's options, or ``graft_into``'s
    tensors with the reference's head."""
    from ..gguf_io import plan_from_gguf

    if v.graft_into is not None:
        from ..quantize.surgery import plan_graft

        return plan_graft(reference, plan_from_gguf(v.graft_into), mtp_type=v.mtp_type)
    from ..quantize.pipeline import plan_quantize

    return plan_quantize(reference, quantize_options(v))


def quantize_options(v: Variant):
    """The variant's quantize job, parsed once (a QuantOptions)."""
    from ..quantize.imatrix import read_imatrix
    from ..quantize.pipeline import parse_options

    return parse_options(
        v.preset,
        v.mtp_type,
        v.mtp_experts_type,
        tensor_types=list(v.tensor_types),
        imatrix=read_imatrix(v.imatrix) if v.imatrix is not None else None,
        include_weights=list(v.include_weights),
        exclude_weights=list(v.exclude_weights),
    )


def head_plan(reference: Plan, v: Variant, reference_type: str) -> Plan:
    """The head file a variant's trunk pairs with, from the reference: the head at ``mtp_type`` (its experts at
    ``mtp_experts_type``), ``token_embd`` and ``output`` at ``mtp_type`` too (``keep``: the reference's type);
    with ``same`` the variant's own head as its quant has it."""
    from ..quantize.surgery import plan_extract_mtp

    if v.head_like_trunk:
        return plan_extract_mtp(variant_plan(reference, v))
    head = plan_extract_mtp(reference)
    if v.mtp_type.is_keep and (v.mtp_experts_type is None or v.mtp_experts_type.is_keep):
        return head
    from ..errors import InputError
    from ..quantize.pipeline import parse_options, plan_quantize
    from ..quantize.presets import preset_named

    name = reference_type if v.mtp_type.is_keep else str(v.mtp_type)
    try:  # the preset only names the file type here: every tensor's type is set below
        preset = preset_named(name.upper(), "mtp_type").name
    except InputError:
        preset = "Q8_0"
    tops = [f"^{t}\\.weight$={name}" for t in ("token_embd", "output")]
    return plan_quantize(head, parse_options(preset, v.mtp_type, v.mtp_experts_type, tensor_types=tops))


def make(job: dict) -> list[Path]:
    """Write the job's artifact; returns its files (shard 1 first)."""
    from ..quantize.surgery import plan_strip_mtp

    out, split, recipe = Path(job["out"]), job["split_max_size"], job["recipe"]
    how = job["make"]
    if how == "convert":
        return _write(converted(recipe, job.get("mode", "keep")), out, split)
    if how == "reference-trunk":
        return _write(plan_strip_mtp(converted(recipe)), out, split)
    if how == "fuse":
        from ..gguf_io import plan_from_gguf
        from ..quantize.surgery import plan_graft

        return _write(plan_graft(plan_from_gguf(Path(job["head"])), plan_from_gguf(Path(job["trunk"]))), out, split)
    v: Variant = job["variant"]
    if how == "head":
        # whole: llama.cpp's -hf fetches one head file
        return _write(head_plan(reference_plan(job), v, recipe.reference_type), out, 0)
    if how == "trunk":
        return _write(plan_strip_mtp(variant_plan(reference_plan(job), v)), out, split)
    return _combined_variant(job, v, out, split)


def _combined_variant(job: dict, v: Variant, out: Path, split: int) -> list[Path]:
    reference = reference_plan(job)
    if v.auto_max_drop is None or v.graft_into is not None:
        return _write(variant_plan(reference, v), out, split)
    # mtp_type = "auto": measured on the quantized trunk, then grafted in
    from ..gguf_io import SplitRule
    from ..quantize.pipeline import plan_quantize
    from ..workflows.auto_head import quantize_with_auto_head

    options = quantize_options(v)
    trunk = plan_quantize(reference, options)
    prompts = job["recipe"].gate.prompts if job["recipe"].gate else "builtin"
    _, written = quantize_with_auto_head(
        Path(job["reference"]),
        out,
        reference,
        trunk,
        options,
        v.auto_max_drop,
        prompts,
        split=SplitRule(max_size=split),
    )
    return written
