"""``mtpq convert``: HF checkpoint folder -> GGUF that keeps its MTP heads."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import List, Optional

import typer

from ..gguf_io import tensor_nbytes
from ..quantize.imatrix import read_imatrix
from ..quantize.kv_override import parse_kv_overrides
from . import options
from . import quant_options as opt
from .app import app
from .common import (
    auto_head_asked,
    check_auto_head_arch,
    console,
    fail,
    files_written,
    guarded,
    set_threads,
    split_rule,
    write_quantized,
)


@app.command(
    epilog=(
        "Examples:\n\n"
        "  mtpq convert ./GLM-4.5-Air air-f16.gguf\n\n"
        "  mtpq convert ./Qwen3.6-35B-A3B qwen-bf16.gguf --outtype bf16\n\n"
        "  mtpq convert ./DeepSeek-V3 ds-q8.gguf --outtype q8_0\n\n"
        "  mtpq convert ./GLM-4.5-Air air-mtp-only.gguf --mtp-only   # head-only draft file\n\n"
        "  mtpq convert ./GLM-4.5-Air air-q4km.gguf --quant Q4_K_M --mtp-type q8_0   # one pass, no f16 file\n\n"
        "  mtpq convert ./GLM-4.5-Air air-bf16.gguf --split-max-size 48G   # air-bf16-00001-of-00005.gguf, ..."
    )
)
@guarded
def convert(
    src: Path = typer.Argument(..., help="Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer)."),
    out: Path = typer.Argument(..., help="GGUF file to write (written to a temporary name, renamed when complete)."),
    outtype: str = typer.Option(
        "auto",
        "--outtype",
        help="Type of 2-D weights: auto (bf16 for bf16 checkpoints, else f16), f32, f16, bf16 or q8_0. 1-D tensors "
        "stay f32.",
    ),
    no_mtp: bool = typer.Option(False, "--no-mtp", help="Drop the MTP head (and nextn_predict_layers)."),
    mtp_only: bool = typer.Option(
        False, "--mtp-only", help="Write only the MTP blocks + token_embd, output_norm, output."
    ),
    quant: Optional[str] = typer.Option(
        None,
        "--quant",
        help="Quantize in the same pass with this llama-quantize preset (Q4_K_M, Q8_0, ...), "
        "from the checkpoint's own values: no intermediate full-precision GGUF.",
    ),
    mtp_type: Optional[str] = opt.MTP_TYPE,
    max_drop: float = opt.MAX_DROP,
    prompts: str = opt.PROMPTS,
    mtp_experts_type: Optional[str] = opt.MTP_EXPERTS_TYPE,
    tensor_type: Optional[List[str]] = opt.TENSOR_TYPE,
    tensor_type_file: Optional[List[Path]] = opt.TENSOR_TYPE_FILE,
    leave_output_tensor: bool = opt.LEAVE_OUTPUT_TENSOR,
    prune_layers: Optional[str] = opt.PRUNE_LAYERS,
    override_kv: Optional[List[str]] = opt.OVERRIDE_KV,
    allow_requantize: bool = opt.ALLOW_REQUANTIZE,
    imatrix: Optional[Path] = opt.IMATRIX,
    include_weights: Optional[List[str]] = opt.INCLUDE_WEIGHTS,
    exclude_weights: Optional[List[str]] = opt.EXCLUDE_WEIGHTS,
    threads: Optional[int] = options.THREADS,
    split_max_size: Optional[str] = options.SPLIT_MAX_SIZE,
    split_max_tensors: Optional[int] = options.SPLIT_MAX_TENSORS,
    quiet: bool = options.QUIET,
) -> None:
    """Convert a Hugging Face checkpoint to GGUF, keeping every MTP tensor.

    FP8 checkpoints (block-scaled weight_scale_inv, or compressed-tensors
    weight_scale) are dequantized on the fly, one tensor at a time.
    """
    from ..convert import OUTTYPES, BlockSelection  # the families (and torch): only when converting
    from ..workflows.convert_quantize import converted_plan

    if outtype.lower() not in OUTTYPES and outtype.lower() != "auto":
        fail("--outtype", f"unknown type {outtype!r}; choose one of auto, {', '.join(OUTTYPES)}")
    if no_mtp and mtp_only:
        fail("--no-mtp/--mtp-only", "choose at most one")
    set_threads(threads)
    split = split_rule(split_max_size, split_max_tensors)
    blocks = BlockSelection.DROP if no_mtp else BlockSelection.ONLY if mtp_only else BlockSelection.KEEP
    auto = auto_head_asked(mtp_type, max_drop)
    if auto and (quant is None or blocks is not BlockSelection.KEEP):
        fail("--mtp-type auto", "needs --quant PRESET and the MTP head (not --no-mtp / --mtp-only)")
    options, kv_overrides = None, ()
    if quant is None:
        kv_overrides = parse_kv_overrides(override_kv or [])  # fails before anything is read
        for flag, given in (
            ("--mtp-type", mtp_type),
            ("--mtp-experts-type", mtp_experts_type),
            ("--tensor-type", tensor_type),
            ("--tensor-type-file", tensor_type_file),
            ("--leave-output-tensor", leave_output_tensor),
            ("--prune-layers", prune_layers),
            ("--imatrix", imatrix),
            ("--allow-requantize", allow_requantize),
            ("--include-weights", include_weights),
            ("--exclude-weights", exclude_weights),
        ):
            if given:
                fail(flag, "needs --quant PRESET (without it every weight gets --outtype)")
    else:  # fails before anything is read
        options = opt.quant_options(
            quant,
            preset_option="--quant",
            mtp_type="keep" if auto else mtp_type,
            mtp_experts_type=mtp_experts_type,
            tensor_type=tensor_type,
            tensor_type_file=tensor_type_file,
            leave_output_tensor=leave_output_tensor,
            override_kv=override_kv,
            prune_layers=prune_layers,
            allow_requantize=allow_requantize,
            include_weights=include_weights,
            exclude_weights=exclude_weights,
        )
        if imatrix is not None:
            options = dataclasses.replace(options, imatrix=read_imatrix(imatrix))
    source, plan = converted_plan(src, blocks, OUTTYPES.get(outtype.lower()), options, kv_overrides)  # None: auto
    if auto:
        check_auto_head_arch(plan.arch, src)
    auto_head = (max_drop, prompts) if auto else None
    plan, written = write_quantized("convert", src, out, source, plan, options, quiet, split, auto_head)
    if auto:
        options = options.with_mtp_type(json.loads(plan.kv_value("mtpq.mtp_type_auto"))["mtp_type"])
    total = sum(tensor_nbytes(s.shape, s.ggml_type) for s in plan.tensors)
    if not quiet:
        n_mtp = sum(1 for s in plan.tensors if s.role.value == "mtp")
        quant_text = ""
        if quant is not None:
            held = "the trunk's types" if options.mtp_type.is_same else str(options.mtp_type)
            quant_text = f", {options.preset.name} with MTP at {held}"
        console.print(
            f"wrote {files_written(written)} ({total / 2**20:.1f} MiB, {len(plan.tensors)} tensors, "
            f"{n_mtp} in {plan.n_mtp_layers} MTP block(s), arch {plan.arch}{quant_text})"
        )
