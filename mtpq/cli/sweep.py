"""``mtpq sweep``: acceptance as a function of MTP-head precision x trunk preset."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import typer
from rich.table import Table

from . import options
from .app import app
from .common import check_device, check_runtime, console, fail, guarded, out

PLOT_INSTALL = "pip install 'mtpq[plot]'"


def _pyplot():
    """matplotlib's pyplot (Agg), or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _heatmap(plt, path: Path, rows: list[str], cols: list[str], grid: list[list[float]], title: str) -> None:
    """A PNG heat map of ``grid`` (fractions, shown as percents)."""
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


@app.command(
    epilog=(
        "Examples:\n\n"
        "  mtpq sweep air-f16.gguf                                      # default grid\n\n"
        "  mtpq sweep air-f16.gguf --mtp f16,q8_0,q4_k --trunk Q4_K_M,Q2_K --png sweep.png --json sweep.json\n\n"
        "  mtpq sweep air-f16.gguf --text wiki.test.raw                 # + each trunk preset's mean KLD\n\n"
        "  mtpq sweep big-f16.gguf --engine llama.cpp --ngl 999 --keep sweep/   # models beyond one device"
    )
)
@guarded
def sweep(
    reference: Path = typer.Argument(
        ..., help="A full-precision (f32/f16/bf16) GGUF with an MTP head (or a trunk, with --head)."
    ),
    head: Path = options.head(
        "torch engine: the full-precision head file (mtp-*.gguf) that "
        "drafts for REFERENCE's trunk, as llama.cpp's -md (DeepSeek-V4's head lives in its own "
        "file): the head types are quantized from it."
    ),
    mtp: str = typer.Option("f16,q8_0,q6_k,q4_k,q2_k", "--mtp", help="Comma-separated MTP head types."),
    trunk: str = typer.Option("Q8_0,Q4_K_M,Q2_K", "--trunk", help="Comma-separated trunk presets."),
    prompts: str = typer.Option("builtin", "--prompts", help="'builtin', 'demo_heldout' or a JSONL file."),
    max_new_tokens: int = options.max_new_tokens(48),
    max_prompts: int = options.max_prompts(),
    text: Path = typer.Option(
        None,
        "--text",
        "-f",
        help="Also score each trunk preset's mean KLD against the "
        "reference on this text (llama-perplexity's chunking, see mtpq compare).",
    ),
    ctx_size: int = typer.Option(512, "--ctx-size", "-c", help="With --text: tokens per chunk."),
    chunks: int = typer.Option(None, "--chunks", help="With --text: score only the first N chunks."),
    json_out: Path = typer.Option(None, "--json", help="Write the grid as JSON here."),
    png_out: Path = typer.Option(None, "--png", help="Write a heat map here (needs matplotlib)."),
    allow_requantize: bool = typer.Option(
        False,
        "--allow-requantize",
        help="Allow requantizing tensors REFERENCE "
        "stores quantized already (DeepSeek-V4's converted files keep its FP8 "
        "weights as Q8_0).",
    ),
    workdir: Path = typer.Option(None, "--keep", help="Keep the trunk GGUFs (one per preset) in this folder."),
    engine: str = options.engine(
        "torch: one trunk pass per preset, every head drafting "
        "from it. llama.cpp: one grafted file per pair, measured by llama-server."
    ),
    llama_cpp: Path = options.llama_cpp(
        "llama.cpp: folder with llama-server (default: $MTPQ_LLAMA_CPP_BIN, then PATH)."
    ),
    ngl: int = options.NGL,
    device: str = options.DEVICE,
    threads: int = options.RUNTIME_THREADS,
) -> None:
    """How many bits does my head need? For every trunk preset the trunk is quantized ONCE; for every head
    type only the head's tensors are quantized (exactly as `mtpq quantize --mtp-type T` writes them) and
    measured on that trunk: greedy k=1 acceptance (what `mtpq accept --draft 1` reports for the full file),
    from the teacher-forced estimator. Prints the grid; with --text, each trunk preset's mean KLD too."""
    from ..acceptance.prompts import load_prompts
    from ..gguf_io import plan_from_gguf, write_plan
    from ..quantize.pipeline import parse_options, plan_quantize
    from ..runtime.accept import use_threads

    mtps = [m.strip().lower() for m in mtp.split(",") if m.strip()]
    trunks = [t.strip().upper() for t in trunk.split(",") if t.strip()]
    if not mtps or not trunks:
        fail("--mtp/--trunk", "need at least one value each")
    if engine not in ("torch", "llama.cpp"):
        fail("--engine", "choose torch or llama.cpp")
    if engine == "torch" and (llama_cpp is not None or ngl is not None):
        fail("--llama-cpp" if llama_cpp is not None else "--ngl", "belongs to --engine llama.cpp")
    if text is not None and not text.is_file():
        fail(str(text), "no such file")
    if head is not None and engine != "torch":
        fail("--head", "belongs to --engine torch")
    if head is not None and not head.is_file():
        fail(str(head), "no such file")
    plt = _pyplot() if png_out is not None else None
    if png_out is not None and plt is None:
        fail("--png", f"needs matplotlib, which is not installed: {PLOT_INSTALL}")
    device = check_device(device)
    if engine == "torch":
        check_runtime(
            [reference] + ([head] if head is not None else []),
            "sweep --engine torch",
            "--engine llama.cpp measures each pair in llama.cpp",
        )
    ref_plan = plan_from_gguf(reference)
    head_ref = plan_from_gguf(head) if head is not None else ref_plan  # where the head types are quantized from
    if head_ref.n_mtp_layers == 0:
        fail(str(head or reference), "has no MTP head to sweep")
    for m in mtps:  # every head type parsed before any work
        plan_quantize(head_ref, parse_options(trunks[0], mtp_type=m, allow_requantize=allow_requantize))
    pairs = load_prompts(prompts, max_prompts)
    use_threads(reference, threads)
    tmp = None if workdir else tempfile.TemporaryDirectory(prefix="mtpq-sweep-", dir=reference.parent)
    folder = workdir or Path(tmp.name)
    folder.mkdir(parents=True, exist_ok=True)
    grid = {m: {} for m in mtps}
    kld: dict[str, float] = {}

    def rates(trunk_file: Path, preset: str, head_types: list[str]) -> dict[str, float]:
        """Each head type's rate on ``trunk_file``, quantized with ``preset``, under this sweep's settings."""
        return _rates(
            engine,
            trunk_file,
            reference,
            preset,
            head_types,
            pairs,
            max_new_tokens,
            device,
            folder,
            llama_cpp,
            ngl,
            threads,
            head,
            allow_requantize,
        )

    try:
        ref_rate = rates(reference, "F16", ["keep"])["keep"]
        for t in trunks:
            path = folder / f"{reference.stem}-{t}.gguf"
            console.print(f"{t}: quantizing the trunk -> {path.name}")
            write_plan(
                plan_quantize(ref_plan, parse_options(t, mtp_type="keep", allow_requantize=allow_requantize)), path
            )  # the head is measured per type below
            for m, rate in rates(path, t, mtps).items():
                grid[m][t] = rate
            if text is not None:
                kld[t] = _trunk_kld(reference, path, text, ctx_size, chunks, device)
            if workdir is None:
                path.unlink()
    finally:
        if tmp is not None:
            tmp.cleanup()
    rows = [[grid[m][t] for t in trunks] for m in mtps]
    table = Table(title=f"greedy k=1 acceptance of {reference.name}'s head: reference {100 * ref_rate:.1f} %")
    table.add_column("MTP head \\ trunk")
    for t in trunks:
        table.add_column(t, justify="right")
    for m, row in zip(mtps, rows):
        table.add_row(m, *(f"{100 * v:.1f} %" for v in row))
    if kld:
        table.add_row("[dim]trunk mean KLD[/]", *(f"{kld[t]:.4f}" for t in trunks))
    out.print(table)
    doc = {
        "reference": str(reference),
        "reference_rate": ref_rate,
        "draft": 1,
        "mtp_types": mtps,
        "trunk_presets": trunks,
        "acceptance": rows,
        "engine": engine,
        "trunk_kld_mean": [kld[t] for t in trunks] if kld else None,
    }
    if json_out:
        json_out.write_text(json.dumps(doc, indent=2) + "\n")
    if png_out is not None:
        _heatmap(plt, png_out, mtps, trunks, rows, "MTP acceptance, k=1")


def _rates(
    engine: str,
    trunk: Path,
    reference: Path,
    preset: str,
    head_types: list[str],
    pairs,
    max_new_tokens: int,
    device,
    folder: Path,
    llama_cpp,
    ngl,
    threads,
    head: Path | None = None,
    allow_requantize: bool = False,
) -> dict[str, float]:
    """Each head type's greedy k=1 acceptance on ``trunk``'s trunk."""
    prompts = [p for _, p in pairs]
    if engine == "torch":
        from ..quantize.pipeline import parse_options
        from ..workflows.headsweep import head_rates

        return {
            t: r.rate
            for t, r in head_rates(
                trunk,
                head or reference,
                parse_options(preset, allow_requantize=allow_requantize),
                head_types,
                prompts,
                max_new_tokens,
                head=head,
                device=device,
                workdir=folder,
            ).items()
        }
    from ..engines.llama_cpp import ServerConfig, find_server, measure_with_llama_cpp
    from ..gguf_io import plan_from_gguf, write_plan
    from ..quantize.pipeline import parse_options
    from ..quantize.surgery import plan_graft
    from ..workflows.headsweep import head_plan

    server = ServerConfig(find_server(llama_cpp), ngl=ngl, threads=threads)
    ref_plan, out = plan_from_gguf(reference), {}
    for t in head_types:
        path = folder / f"{trunk.stem}-mtp_{t}.gguf"  # the trunk's bytes copied, the head quantized as type t
        write_plan(plan_graft(head_plan(ref_plan, parse_options(preset), t), plan_from_gguf(trunk), replace=True), path)
        out[t] = measure_with_llama_cpp(
            path, pairs, draft=1, max_new_tokens=max_new_tokens, server=server
        ).overall.acceptance_rate
        path.unlink()
    return out


def _trunk_kld(reference: Path, quant: Path, text: Path, ctx_size: int, chunks: int | None, device) -> float:
    from ..runtime.trunk_quality import QualityRun, compare_runs

    dev = device or ("cuda" if __import__("torch").cuda.is_available() else "cpu")
    ref, q = QualityRun(reference, device=dev), QualityRun(quant, device=dev)
    compare_runs(ref, [q], text.read_text(), n_ctx=ctx_size, n_chunks=chunks)
    return q.quality.summary(ref.quality)["kld_mean"]
