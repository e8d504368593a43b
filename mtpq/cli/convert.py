"""``mtpq convert``: HF checkpoint folder -> GGUF that keeps its MTP heads."""

from __future__ import annotations

from pathlib import Path

import typer

from ..convert import OUTTYPES, MtpMode, plan_checkpoint
from ..gguf_io import tensor_nbytes, write_plan
from .app import app
from .common import byte_progress, console, fail, guarded


@app.command(
    epilog=(
        "Examples:\n\n"
        "  mtpq convert ./GLM-4.5-Air air-f16.gguf\n\n"
        "  mtpq convert ./Qwen3.6-35B-A3B qwen-bf16.gguf --outtype bf16\n\n"
        "  mtpq convert ./DeepSeek-V3 ds-q8.gguf --outtype q8_0\n\n"
        "  mtpq convert ./GLM-4.5-Air air-mtp-only.gguf --mtp-only   # head-only draft file"
    )
)
@guarded
def convert(
    src: Path = typer.Argument(..., help="Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer)."),
    out: Path = typer.Argument(..., help="GGUF file to write (written to a temporary name, renamed when complete)."),
    outtype: str = typer.Option("f16", "--outtype", help="Type of 2-D weights: f32, f16, bf16 or q8_0. 1-D tensors stay f32."),
    no_mtp: bool = typer.Option(False, "--no-mtp", help="Drop the MTP head (and nextn_predict_layers)."),
    mtp_only: bool = typer.Option(False, "--mtp-only", help="Write only the MTP blocks + token_embd, output_norm, output."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or summary."),
) -> None:
    """Convert a Hugging Face checkpoint to GGUF, keeping every MTP tensor.

    FP8 checkpoints (block-scaled weight_scale_inv, or compressed-tensors
    weight_scale) are dequantized on the fly, one tensor at a time.
    """
    if outtype.lower() not in OUTTYPES:
        fail("--outtype", f"unknown type {outtype!r}; choose one of {', '.join(OUTTYPES)}")
    if no_mtp and mtp_only:
        fail("--no-mtp/--mtp-only", "choose at most one")
    mode = MtpMode.DROP if no_mtp else MtpMode.ONLY if mtp_only else MtpMode.KEEP
    plan = plan_checkpoint(src, mtp=mode, outtype=OUTTYPES[outtype.lower()])
    total = sum(tensor_nbytes(s.shape, s.ggml_type) for s in plan.tensors)
    with byte_progress(f"convert -> {out.name}", total, enabled=not quiet) as advance:
        write_plan(plan, out, on_tensor=lambda spec, n: advance(n, spec.name))
    if not quiet:
        n_mtp = sum(1 for s in plan.tensors if s.role.value == "mtp")
        console.print(f"wrote {out} ({total / 2**20:.1f} MiB, {len(plan.tensors)} tensors, "
                      f"{n_mtp} in {plan.n_mtp_layers} MTP block(s), arch {plan.arch})")
