"""``mtpq inspect``: what a GGUF holds, with its MTP blocks made visible."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from ..gguf_io.summary import summarize_gguf
from .app import app
from .common import EXIT_CHECK_FAILED, fail, guarded, out


@app.command(
    epilog="Examples:\n\n  mtpq inspect air-q4km.gguf\n\n  mtpq inspect air-q4km.gguf --json | jq .mtp_types\n\n"
    "  mtpq inspect air-q4km-00002-of-00003.gguf   # any shard: the whole split model\n\n"
    "  mtpq inspect --check dist/*.gguf     # sound MTP files? exit 1 with a line per problem\n\n"
    "  mtpq inspect --check air-Q4_K_M.gguf mtp-air-Q8_0.gguf   # is the head made for the trunk?"
)
@guarded
def inspect(
    files: list[Path] = typer.Argument(
        ...,
        metavar="FILE...",
        help="GGUF file, or any shard of a split GGUF (the whole set is read); several with --check.",
    ),
    check: bool = typer.Option(
        False,
        "--check",
        help="Check the files as MTP models: nextn_predict_layers and "
        "block_count against the blocks, head tensors present, head types of 4 bits or more, "
        "head files (mtp-*.gguf) made for the trunks given. Exit 1 with one line per problem.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON on stdout."),
    all_tensors: bool = typer.Option(
        True, "--tensors/--no-tensors", help="List every tensor (default) or only totals."
    ),
) -> None:
    """Show a GGUF's architecture, MTP blocks, tensor types and sizes (MTP tensors marked); or --check files."""
    if check:
        _check(files)
        return
    if len(files) > 1:
        fail(" ".join(map(str, files[1:])), "one file at a time (several go with --check)")
    info = summarize_gguf(files[0])
    if as_json:
        typer.echo(json.dumps(info, indent=2))  # plain: rich would wrap long lines
        return
    mtp = info["mtp_blocks"]
    out.print(
        f"[bold]{info['file']}[/]  arch [cyan]{info['arch']}[/]  blocks {info['block_count']} "
        f"(trunk {info['trunk_blocks']}, MTP {len(mtp)}{': blk.' + ', blk.'.join(map(str, mtp)) if mtp else ''})  "
        f"{info['bytes'] / 2**20:.1f} MiB, {info['bits_per_weight']} bits/weight"
    )
    shards = info["shards"]
    if len(shards) > 1:
        out.print(
            f"split in {len(shards)} shards: {shards[0]['file']} .. {shards[-1]['file']} (llama.cpp: -m the first)"
        )
    if not mtp:
        out.print("[yellow]no MTP head: this file cannot self-draft (mtpq graft can add one)[/]")
    else:
        out.print(f"MTP weight types: {', '.join(info['mtp_types']) or '-'}")
    if all_tensors:
        table = Table("", "tensor", "shape", "type", "bytes", "role", box=None, pad_edge=False)
        for t in info["tensors"]:
            table.add_row(
                "[magenta]MTP[/]" if t["mtp"] else "",
                t["name"],
                "x".join(map(str, t["shape"])),
                t["type"],
                f"{t['bytes']:,}",
                t["role"],
            )
        out.print(table)
    totals = Table("role", "tensors", "bytes", "bits/weight", title="totals by role", box=None)
    for role, r in info["by_role"].items():
        totals.add_row(role, str(r["tensors"]), f"{r['bytes']:,}", f"{8 * r['bytes'] / max(r['elements'], 1):.2f}")
    out.print(totals)


def _check(files: list[Path]) -> None:
    """One line per model: ``ok`` with what it holds, or each of its problems; exit 1 when any."""
    from ..gguf_io.check import check_files, is_head_file

    problems, models = check_files(files)
    for g in models:
        mine = [p for p in problems if p.file == str(g.path)]
        if not mine:
            first = g.n_trunk
            what = "head file" if is_head_file(g) else "trunk + head" if g.n_mtp else "trunk only, no head"
            blocks = f" {', '.join(f'blk.{b}' for b in range(first, first + g.n_mtp))}" if g.n_mtp else ""
            typer.echo(f"{g.path}: ok ({what}{blocks})")
        for p in mine:
            typer.echo(p.line())
    if problems:
        raise typer.Exit(EXIT_CHECK_FAILED)
