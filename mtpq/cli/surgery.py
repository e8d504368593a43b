"""``mtpq graft`` and ``mtpq extract-mtp``: move MTP heads between GGUF files."""

from __future__ import annotations

from pathlib import Path

import typer

from ..ggml.types import WRITABLE_TYPES
from ..gguf_io import plan_from_gguf
from ..quantize.mtp_precision import parse_mtp
from ..tensors import Plan, Role
from . import options
from .app import app
from .common import console, files_written, guarded, split_rule, write_with_progress

MTP_TYPES = {t.name.lower(): t for t in WRITABLE_TYPES}  # what mtpq's kernels write


def _head_summary(plan: Plan) -> str:
    head = [s for s in plan.tensors if s.role is Role.MTP]
    types = sorted({s.ggml_type.name for s in head if len(s.shape) > 1})
    first = plan.n_trunk_layers
    blocks = ", ".join(f"blk.{first + i}" for i in range(plan.n_mtp_layers))
    return f"{len(head)} MTP tensors ({blocks}; weights {', '.join(types) or '-'})"


@app.command(
    epilog=(
        "Examples:\n\n"
        "Give a published Q4_K_M that has no head the head of the f16 conversion:\n\n"
        "  mtpq graft --mtp-from air-f16.gguf --into air-Q4_K_M.gguf air-Q4_K_M-mtp.gguf\n\n"
        "The same, holding the head at q8_0 (requantized from the donor's values):\n\n"
        "  mtpq graft --mtp-from air-f16.gguf --into air-Q4_K_M.gguf out.gguf --mtp-type q8_0\n\n"
        "The donor may be a head-only file (mtpq convert --mtp-only, mtpq extract-mtp):\n\n"
        "  mtpq graft --mtp-from mtp-air.gguf --into air-Q4_K_M.gguf out.gguf\n\n"
        "Both may be split GGUFs (give any shard); the output may be split too:\n\n"
        "  mtpq graft --mtp-from air-f16-00001-of-00005.gguf --into air-Q4_K_M-00001-of-00002.gguf out.gguf "
        "--split-max-size 48G\n\n"
        "The target already has a (say, 4-bit) head; swap it:\n\n"
        "  mtpq graft --mtp-from air-f16.gguf --into air-Q4_K_M.gguf out.gguf --replace\n\n"
        "Then: llama-speculative-simple -m out.gguf -p 'def' --spec-type draft-mtp"
    )
)
@guarded
def graft(
    out: Path = typer.Argument(..., help="GGUF file to write (temporary name, renamed when complete)."),
    mtp_from: Path = typer.Option(
        ..., "--mtp-from", help="Donor GGUF holding the MTP blocks (full model or head-only)."
    ),
    into: Path = typer.Option(..., "--into", help="Target GGUF (usually a quant without a head); copied unchanged."),
    mtp_type: str = typer.Option(
        "keep",
        "--mtp-type",
        help=f"Type of the head's weights: keep (byte copy) or {', '.join(MTP_TYPES)}. "
        "1-D tensors and routers stay as stored.",
    ),
    replace: bool = typer.Option(False, "--replace", help="Swap out a head the target already has."),
    split_max_size: str = options.SPLIT_MAX_SIZE,
    split_max_tensors: int = options.SPLIT_MAX_TENSORS,
    quiet: bool = options.QUIET,
) -> None:
    """Give a GGUF without an MTP head the MTP blocks of another GGUF of the same model.

    Checks that architecture, hidden size, vocabulary and trunk layer count
    match; fixes block_count and nextn_predict_layers. The target's tensors
    and metadata are copied byte for byte.
    """
    from ..quantize.surgery import GRAFT_KINDS, plan_graft

    precision = parse_mtp(mtp_type, "--mtp-type", allow=GRAFT_KINDS)  # before any file is read
    split = split_rule(split_max_size, split_max_tensors)
    plan = plan_graft(plan_from_gguf(mtp_from), plan_from_gguf(into), mtp_type=precision, replace=replace)
    total, written = write_with_progress(plan, out, "graft", quiet, split)
    if not quiet:
        console.print(
            f"wrote {files_written(written)} ({total / 2**20:.1f} MiB, {len(plan.tensors)} tensors): {into.name} + "
            f"{_head_summary(plan)} from {mtp_from.name}",
            soft_wrap=True,
        )


@app.command(
    "extract-mtp",
    epilog=(
        "Examples:\n\n"
        "  mtpq extract-mtp air-Q8_0.gguf mtp-air-Q8_0.gguf\n\n"
        "Use it as the draft model of a quant without a head:\n\n"
        "  llama-speculative-simple -m air-Q4_K_M.gguf -md mtp-air-Q8_0.gguf --spec-type draft-mtp -p 'def'\n\n"
        "Or graft it into that quant:\n\n"
        "  mtpq graft --mtp-from mtp-air-Q8_0.gguf --into air-Q4_K_M.gguf air-Q4_K_M-mtp.gguf"
    ),
)
@guarded
def extract_mtp(
    src: Path = typer.Argument(..., help="GGUF with MTP blocks."),
    out: Path = typer.Argument(..., help="Head-only GGUF to write: MTP blocks + token_embd, output_norm, output."),
    quiet: bool = options.QUIET,
) -> None:
    """Write the head-only GGUF that llama.cpp loads as an MTP draft model.

    The same file llama.cpp's converter writes with --mtp: the MTP blocks plus
    token_embd, output_norm and output, and the full model's metadata. Tensors
    are copied byte for byte.
    """
    from ..quantize.surgery import plan_extract_mtp

    plan = plan_extract_mtp(plan_from_gguf(src))
    total, written = write_with_progress(plan, out, "extract-mtp", quiet)
    if not quiet:
        console.print(
            f"wrote {files_written(written)} ({total / 2**20:.1f} MiB, {len(plan.tensors)} tensors): "
            f"{_head_summary(plan)}",
            soft_wrap=True,
        )
