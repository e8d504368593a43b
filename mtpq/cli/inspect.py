"""``mtpq inspect``: what a GGUF holds, with its MTP blocks made visible."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import typer
from rich.table import Table

from ..gguf_io import plan_from_gguf, tensor_nbytes
from ..tensors import Role
from .app import app
from .common import guarded, out


def summarize(path: Path) -> dict:
    """A JSON-ready description of a GGUF (a file, or a split set from any of its shards): arch, blocks, MTP
    blocks, tensors, totals by role, and the files (``shards``: shard 1 first) with their sizes."""
    plan = plan_from_gguf(path)
    tensors = []
    by_role: dict[str, dict[str, int]] = defaultdict(lambda: {"tensors": 0, "bytes": 0, "elements": 0})
    for s in plan.tensors:
        nbytes = tensor_nbytes(s.shape, s.ggml_type)
        tensors.append({"name": s.name, "shape": list(s.shape), "type": s.ggml_type.name, "bytes": nbytes,
                        "role": s.role.value, "mtp": s.role is Role.MTP})
        r = by_role[s.role.value]
        r["tensors"] += 1
        r["bytes"] += nbytes
        r["elements"] += s.n_elements
    total_bytes = sum(t["bytes"] for t in tensors)
    total_el = sum(r["elements"] for r in by_role.values())
    mtp_blocks = list(range(plan.n_trunk_layers, plan.n_trunk_layers + plan.n_mtp_layers))
    return {
        "file": str(path),
        "shards": [{"file": p.name, "bytes": p.stat().st_size} for p in plan.inputs],
        "arch": plan.arch,
        "name": plan.kv_value("general.name"),
        "block_count": plan.kv_value(f"{plan.arch}.block_count"),
        "trunk_blocks": plan.n_trunk_layers,
        "nextn_predict_layers": plan.n_mtp_layers,
        "mtp_blocks": mtp_blocks,
        # the head's weight matrices (its router stays f32 whatever the head's precision)
        "mtp_types": sorted({t["type"] for t in tensors
                             if t["mtp"] and len(t["shape"]) > 1 and ".ffn_gate_inp" not in t["name"]}),
        "tensor_count": len(tensors),
        "bytes": total_bytes,
        "bits_per_weight": round(8 * total_bytes / total_el, 3) if total_el else 0.0,
        "by_role": dict(sorted(by_role.items())),
        "tensors": tensors,
    }


@app.command(epilog="Examples:\n\n  mtpq inspect air-q4km.gguf\n\n  mtpq inspect air-q4km.gguf --json | jq .mtp_types\n\n"
                    "  mtpq inspect air-q4km-00002-of-00003.gguf   # any shard: the whole split model")
@guarded
def inspect(
    file: Path = typer.Argument(..., help="GGUF file, or any shard of a split GGUF (the whole set is read)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON on stdout."),
    all_tensors: bool = typer.Option(True, "--tensors/--no-tensors", help="List every tensor (default) or only totals."),
) -> None:
    """Show a GGUF's architecture, MTP blocks, tensor types and sizes (MTP tensors marked)."""
    info = summarize(file)
    if as_json:
        typer.echo(json.dumps(info, indent=2))  # plain: rich would wrap long lines
        return
    mtp = info["mtp_blocks"]
    out.print(f"[bold]{info['file']}[/]  arch [cyan]{info['arch']}[/]  blocks {info['block_count']} "
              f"(trunk {info['trunk_blocks']}, MTP {len(mtp)}{': blk.' + ', blk.'.join(map(str, mtp)) if mtp else ''})  "
              f"{info['bytes'] / 2**20:.1f} MiB, {info['bits_per_weight']} bits/weight")
    shards = info["shards"]
    if len(shards) > 1:
        out.print(f"split in {len(shards)} shards: {shards[0]['file']} .. {shards[-1]['file']} (llama.cpp: -m the first)")
    if not mtp:
        out.print("[yellow]no MTP head: this file cannot self-draft (mtpq graft can add one)[/]")
    else:
        out.print(f"MTP weight types: {', '.join(info['mtp_types']) or '-'}")
    if all_tensors:
        table = Table("", "tensor", "shape", "type", "bytes", "role", box=None, pad_edge=False)
        for t in info["tensors"]:
            table.add_row("[magenta]MTP[/]" if t["mtp"] else "", t["name"], "x".join(map(str, t["shape"])), t["type"],
                          f"{t['bytes']:,}", t["role"])
        out.print(table)
    totals = Table("role", "tensors", "bytes", "bits/weight", title="totals by role", box=None)
    for role, r in info["by_role"].items():
        totals.add_row(role, str(r["tensors"]), f"{r['bytes']:,}", f"{8 * r['bytes'] / max(r['elements'], 1):.2f}")
    out.print(totals)
