"""``mtpq sweep``: acceptance as a function of MTP-head precision x trunk preset."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import typer
from rich.table import Table

from .app import app
from .common import check_device, console, fail, guarded, out, RUNTIME_THREADS_HELP


def _heatmap(path: Path, rows: list[str], cols: list[str], grid: list[list[float]], title: str) -> bool:
    """A PNG heat map when matplotlib is installed (`pip install mtpq[plot]`); False otherwise."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(1.4 * len(cols) + 2, 0.6 * len(rows) + 1.5))
    top = max(1.0, 100 * max(max(r) for r in grid))
    im = ax.imshow([[100 * v for v in r] for r in grid], cmap="viridis", vmin=0, vmax=top, aspect="auto")
    ax.set_xticks(range(len(cols)), cols)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xlabel("trunk preset")
    ax.set_ylabel("MTP head type")
    for i, r in enumerate(grid):
        for j, v in enumerate(r):
            ax.text(j, i, f"{100 * v:.1f}", ha="center", va="center", color="w")
    fig.colorbar(im, ax=ax, label="acceptance %")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


@app.command(
    epilog=(
        "Examples:\n\n"
        "  mtpq sweep air-f16.gguf                                      # default grid\n\n"
        "  mtpq sweep air-f16.gguf --mtp f16,q8_0,q4_k --trunk Q4_K_M,Q2_K --png sweep.png --json sweep.json"
    )
)
@guarded
def sweep(
    reference: Path = typer.Argument(..., help="A full-precision (f32/f16/bf16) GGUF with an MTP head."),
    mtp: str = typer.Option("f16,q8_0,q6_k,q4_k,q2_k", "--mtp", help="Comma-separated MTP head types."),
    trunk: str = typer.Option("Q8_0,Q4_K_M,Q2_K", "--trunk", help="Comma-separated trunk presets."),
    prompts: str = typer.Option("builtin", "--prompts", help="'builtin', 'demo_heldout' or a JSONL file."),
    draft: int = typer.Option(3, "--draft", "-k", help="Draft depth k."),
    max_new_tokens: int = typer.Option(48, "--max-new-tokens", "-n"),
    max_prompts: int = typer.Option(None, "--max-prompts"),
    json_out: Path = typer.Option(None, "--json", help="Write the grid as JSON here."),
    png_out: Path = typer.Option(None, "--png", help="Write a heat map here (needs matplotlib)."),
    workdir: Path = typer.Option(None, "--keep", help="Keep the quantized GGUFs in this folder."),
    device: str = typer.Option(None, "--device"),
    threads: int = typer.Option(None, "--threads", "-t", help=RUNTIME_THREADS_HELP),
) -> None:
    """How many bits does my head need? Quantize REFERENCE for every (head type, trunk preset)
    pair, measure each file's greedy acceptance, and print the grid."""
    from ..gguf_io import plan_from_gguf, write_plan
    from ..quantize.pipeline import plan_quantize
    from ..runtime.accept import measure_file

    mtps = [m.strip().lower() for m in mtp.split(",") if m.strip()]
    trunks = [t.strip().upper() for t in trunk.split(",") if t.strip()]
    if not mtps or not trunks:
        fail("--mtp/--trunk", "need at least one value each")
    device = check_device(device)
    ref_plan = plan_from_gguf(reference)
    if ref_plan.n_mtp_layers == 0:
        fail(str(reference), "has no MTP head to sweep")
    tmp = None if workdir else tempfile.TemporaryDirectory(prefix="mtpq-sweep-", dir=reference.parent)
    folder = workdir or Path(tmp.name)
    folder.mkdir(parents=True, exist_ok=True)
    kw = dict(prompts=prompts, draft=draft, max_new_tokens=max_new_tokens, max_prompts=max_prompts,
              device=device, with_plain=False, threads=threads)
    try:
        ref_rate = measure_file(reference, **kw).overall.acceptance_rate
        grid: list[list[float]] = []
        for m in mtps:
            row = []
            for t in trunks:
                path = folder / f"{reference.stem}-{t}-mtp_{m}.gguf"
                console.print(f"{t} trunk, {m} head -> {path.name}")
                write_plan(plan_quantize(plan_from_gguf(reference), t, mtp_type=m), path)
                row.append(measure_file(path, **kw).overall.acceptance_rate)
                if workdir is None:
                    path.unlink()
            grid.append(row)
    finally:
        if tmp is not None:
            tmp.cleanup()
    table = Table(title=f"greedy acceptance (k={draft}) of {reference.name}: reference {100 * ref_rate:.1f} %")
    table.add_column("MTP head \\ trunk")
    for t in trunks:
        table.add_column(t, justify="right")
    for m, row in zip(mtps, grid):
        table.add_row(m, *(f"{100 * v:.1f} %" for v in row))
    out.print(table)
    doc = {"reference": str(reference), "reference_rate": ref_rate, "draft": draft, "mtp_types": mtps,
           "trunk_presets": trunks, "acceptance": grid}
    if json_out:
        json_out.write_text(json.dumps(doc, indent=2) + "\n")
    if png_out and not _heatmap(png_out, mtps, trunks, grid, f"MTP acceptance, k={draft}"):
        console.print("[yellow]--png needs matplotlib: pip install 'mtpq[plot]'[/]")
