"""``mtpq quantize``: GGUF -> GGUF with llama-quantize's presets and the MTP head held high."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

from ..gguf_io import plan_from_gguf
from ..quantize.imatrix import read_imatrix
from ..quantize.pipeline import plan_change_summary, plan_quantize
from ..quantize.presets import PRESETS
from . import options
from . import quant_options as opt
from .app import app
from .common import (
    auto_head_asked,
    check_auto_head_arch,
    console,
    files_written,
    guarded,
    out,
    set_threads,
    split_rule,
    write_quantized,
)


@app.command(
    epilog=(
        "Examples:\n\n"
        "  mtpq quantize air-f16.gguf air-q4km.gguf Q4_K_M            # MTP block at q8_0\n\n"
        "  mtpq quantize air-f16.gguf air-q4km.gguf Q4_K_M --mtp-type same   # exactly llama-quantize\n\n"
        "  mtpq quantize glm-bf16.gguf glm-q3.gguf Q3_K_M --mtp-experts-type q4_k\n\n"
        "  mtpq quantize air-f16.gguf x.gguf Q4_K_M --tensor-type 'attn_v=q8_0' --dry-run\n\n"
        "  mtpq quantize air-f16.gguf x.gguf Q4_K_M --tensor-type-file types.txt --leave-output-tensor\n\n"
        "  mtpq quantize air-f16.gguf x.gguf Q4_K_M --prune-layers 20,21 --override-kv general.name=str:Air-pruned\n\n"
        "  mtpq quantize air-f16.gguf air-iq4xs.gguf IQ4_XS --imatrix air.imatrix.gguf   # = llama-quantize "
        "--imatrix\n\n"
        "  mtpq quantize air-f16.gguf air-q4km.gguf Q4_K_M --mtp-type auto --max-drop 0.02   # measured choice\n\n"
        "  mtpq quantize air-bf16-00001-of-00005.gguf air-q4km.gguf Q4_K_M --split-max-size 48G   # split in and out"
    )
)
@guarded
def quantize(
    src: Path = typer.Argument(..., metavar="IN", help="GGUF to quantize (f32, f16 or bf16 gives the best quality)."),
    dst: Path = typer.Argument(..., metavar="OUT", help="GGUF to write (temporary name, renamed when complete)."),
    preset: str = typer.Argument(..., metavar="PRESET", help=f"llama-quantize preset: {', '.join(PRESETS)}."),
    mtp_type: Optional[str] = opt.MTP_TYPE,
    max_drop: float = opt.MAX_DROP,
    prompts: str = opt.PROMPTS,
    trunk: Optional[Path] = typer.Option(
        None,
        "--trunk",
        help="With --mtp-type auto on a head file (mtp-*.gguf, "
        "DeepSeek-V4's form): the trunk file it drafts for, quantized with PRESET "
        "to measure the head types on; OUT is the head file.",
    ),
    mtp_experts_type: Optional[str] = opt.MTP_EXPERTS_TYPE,
    tensor_type: Optional[List[str]] = opt.TENSOR_TYPE,
    tensor_type_file: Optional[List[Path]] = opt.TENSOR_TYPE_FILE,
    output_tensor_type: Optional[str] = opt.OUTPUT_TENSOR_TYPE,
    leave_output_tensor: bool = opt.LEAVE_OUTPUT_TENSOR,
    override_kv: Optional[List[str]] = opt.OVERRIDE_KV,
    prune_layers: Optional[str] = opt.PRUNE_LAYERS,
    token_embedding_type: Optional[str] = opt.TOKEN_EMBEDDING_TYPE,
    imatrix: Optional[Path] = opt.IMATRIX,
    include_weights: Optional[List[str]] = opt.INCLUDE_WEIGHTS,
    exclude_weights: Optional[List[str]] = opt.EXCLUDE_WEIGHTS,
    pure: bool = opt.PURE,
    allow_requantize: bool = opt.ALLOW_REQUANTIZE,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the per-tensor decisions and totals; write nothing."),
    as_json: bool = typer.Option(False, "--json", help="Print the decisions and totals as JSON on stdout."),
    threads: Optional[int] = options.THREADS,
    split_max_size: Optional[str] = options.SPLIT_MAX_SIZE,
    split_max_tensors: Optional[int] = options.SPLIT_MAX_TENSORS,
    keep_split: bool = options.KEEP_SPLIT,
    quiet: bool = options.QUIET,
) -> None:
    """Quantize a GGUF with a llama-quantize preset, holding MTP heads at high precision.

    Per-tensor types follow llama-quantize (with --imatrix as llama-quantize --imatrix) for the trunk; every
    tensor of an MTP block gets --mtp-type. 1-D tensors and routers stay as they are.
    """
    auto = auto_head_asked(mtp_type, max_drop)
    if auto:
        if dry_run:
            raise typer.BadParameter(
                "measures heads on the quantized trunk: not with --dry-run", param_hint="--mtp-type auto"
            )
        mtp_type = "keep"  # the trunk is written once with the input's head; the chosen head is grafted in
    options = opt.quant_options(
        preset,
        mtp_type=mtp_type,
        mtp_experts_type=mtp_experts_type,
        tensor_type=tensor_type,
        tensor_type_file=tensor_type_file,
        output_tensor_type=output_tensor_type,
        token_embedding_type=token_embedding_type,
        leave_output_tensor=leave_output_tensor,
        override_kv=override_kv,
        prune_layers=prune_layers,
        pure=pure,
        allow_requantize=allow_requantize,
        include_weights=include_weights,
        exclude_weights=exclude_weights,
    )
    split = split_rule(split_max_size, split_max_tensors, keep_split)
    set_threads(threads)
    if imatrix is not None:
        options = dataclasses.replace(options, imatrix=read_imatrix(imatrix))
    before = plan_from_gguf(src)
    if auto:
        check_auto_head_arch(before.arch, src)
    trunk_plan = None
    if trunk is not None:
        from ..gguf_io import GGUFFile
        from ..gguf_io.check import is_head_file

        if not auto:
            raise typer.BadParameter("only with --mtp-type auto on a head file", param_hint="--trunk")
        if not trunk.is_file():
            raise typer.BadParameter(f"{trunk}: no such file", param_hint="--trunk")
        if not is_head_file(GGUFFile(src)):
            raise typer.BadParameter(
                f"{src} is not a head file (it has trunk blocks): measure its own head without --trunk",
                param_hint="--trunk",
            )
        trunk_plan = plan_quantize(plan_from_gguf(trunk), options)
    after = plan_quantize(before, options)
    info = plan_change_summary(before, after)
    if dry_run:
        if as_json:
            typer.echo(json.dumps({"file": str(src), "dry_run": True, **info}, indent=2))  # plain: rich would wrap
        else:
            print_decisions(info)
        return
    auto_head = (max_drop, prompts) if auto else None
    head_file = trunk_plan is not None  # SRC is a head file, its candidates measured on the --trunk plan
    written_plan, written = write_quantized(
        "quantize", src, dst, before, trunk_plan or after, options, quiet or as_json, split, auto_head, head_file
    )
    if auto:  # the head's types were chosen while writing
        info = plan_change_summary(before, written_plan)
    if as_json:
        typer.echo(
            json.dumps(
                {"file": str(written[0]), "files": [str(p) for p in written], "dry_run": False, **info}, indent=2
            )
        )
    elif not quiet:
        t = info["totals"]
        mtp = info["by_role"].get("mtp")
        mtp_text = f", MTP {mtp['bits_per_weight']:.2f} bits/weight" if mtp else ", no MTP block"
        console.print(
            f"wrote {files_written(written)} ({t['bytes'] / 2**20:.1f} MiB, {t['bits_per_weight']:.2f} "
            f"bits/weight{mtp_text})"
        )


def print_decisions(info: dict) -> None:
    """The per-tensor table (MTP rows in magenta) and totals by role, one row per line."""
    rows = info["tensors"]
    table = Table("tensor", "role", "old type", "new type", "bytes", "rule", box=None, pad_edge=False)
    for r in rows:
        style = "magenta" if r["role"] == "mtp" else None
        new = r["type"] if r["type"] == r["old_type"] else f"[bold]{r['type']}[/]"
        name = f"{r['name']} (was {r['input_name']})" if "input_name" in r else r["name"]
        table.add_row(name, r["role"], r["old_type"], new, f"{r['bytes']:,}", r["rule"], style=style)
    # never wrap a row: a table meant for grep and diff
    width = max((2 * len(r["name"]) + len(r["rule"]) for r in rows), default=0) + 60
    Console(width=max(out.width, width)).print(table)
    totals = Table("role", "tensors", "old bytes", "new bytes", "bits/weight", title="totals by role", box=None)
    for role, v in info["by_role"].items():
        totals.add_row(role, str(v["tensors"]), f"{v['old_bytes']:,}", f"{v['bytes']:,}", f"{v['bits_per_weight']:.2f}")
    t = info["totals"]
    totals.add_row(
        "[bold]all[/]", str(t["tensors"]), f"{t['old_bytes']:,}", f"{t['bytes']:,}", f"{t['bits_per_weight']:.2f}"
    )
    out.print(totals)
    if t["pruned_tensors"]:
        out.print(f"--prune-layers: {t['pruned_tensors']} tensors dropped")
