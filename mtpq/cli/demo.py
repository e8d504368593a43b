"""``mtpq demo``: the whole pipeline on the bundled demo model, and what head precision does."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import typer
from rich.table import Table

from . import options
from .app import app
from .common import check_device, console, guarded, out

# (file suffix, trunk preset, --mtp-type): the head at q8_0 vs quantized like the trunk
DEMO_VARIANTS = [
    ("Q4_K_M", "Q4_K_M", "q8_0"),
    ("Q4_K_M-mtp-same", "Q4_K_M", "same"),
    ("Q2_K", "Q2_K", "q8_0"),
    ("Q2_K-mtp-same", "Q2_K", "same"),
]


# the bundled demo models: data folder and held-out prompt set (both made by scripts/train_demo.py)
DEMO_MODELS = {
    "glm4moe": ("data/demo", "demo_heldout"),  # GLM-4.5 architecture, MoE
    "qwen35": ("data/demo_qwen35", "demo_qwen35_heldout"),  # Qwen3.5: gated DeltaNet + gated attention
}


def results_table(names: list[str], draft: int, max_new_tokens: int) -> Table:
    """The demo's table. The file names are the point: they never wrap or shrink (they also name the
    trunk's preset); the other columns are short so that it fits an 80-column terminal (head = the MTP
    block's types, acc% = acceptance, Δpt = points against f16, len = mean acceptance length,
    same = the drafting output equals plain greedy output)."""
    table = Table(title=f"MTP draft acceptance on held-out Python (k={draft}, greedy, {max_new_tokens} tokens/prompt)")
    table.add_column("file", no_wrap=True, min_width=max(len(n) for n in names))
    for col in ("MiB", "head", "acc%", "Δpt", "len", "same"):
        table.add_column(col, justify="left" if col == "head" else "right", no_wrap=True)
    return table


@app.command(epilog="Examples:\n\n  mtpq demo --workdir demo-out\n\n  mtpq demo --model qwen35 --workdir demo-out")
@guarded
def demo(
    workdir: Path = typer.Option(Path("demo-out"), "--workdir", help="Where the GGUFs and reports go."),
    model: str = typer.Option(
        "glm4moe",
        "--model",
        "-m",
        help="Which bundled demo model: "
        + ", ".join(DEMO_MODELS)
        + " (a small GLM-4.5 MoE; a small Qwen3.5 with gated DeltaNet layers).",
    ),
    draft: int = options.DRAFT,
    max_new_tokens: int = options.max_new_tokens(48),
    max_prompts: int = options.max_prompts(12, "Use the first N of the 24 held-out prompts."),
    device: str = options.DEVICE,
    threads: int = options.RUNTIME_THREADS,
) -> None:
    """Convert a bundled demo model (a small GLM-4.5 or Qwen3.5 with one MTP layer, trained on
    Python's standard library), quantize it with the head held at q8_0 and with the head quantized like
    the trunk, and measure each file's draft acceptance against the f16 reference."""
    from ..convert import OUTTYPES, plan_checkpoint
    from ..gguf_io import plan_from_gguf, write_plan
    from ..gguf_io.summary import summarize_gguf
    from ..quantize.pipeline import parse_options, plan_quantize
    from ..runtime.accept import measure_file

    if model not in DEMO_MODELS:
        raise typer.BadParameter(
            f"unknown demo model {model!r}; choose one of: {', '.join(DEMO_MODELS)}", param_hint="--model"
        )
    folder, prompt_set = DEMO_MODELS[model]
    device = check_device(device)
    src = Path(str(resources.files("mtpq").joinpath(folder)))
    stem = "demo" if model == "glm4moe" else model  # file names short enough for an 80-column table
    workdir.mkdir(parents=True, exist_ok=True)
    ref = workdir / f"{stem}-F16.gguf"
    console.print(f"[bold]1.[/] convert {src} -> {ref}")
    write_plan(plan_checkpoint(src, outtype=OUTTYPES["f16"]), ref)
    files = [("F16", "f16", ref)]
    for suffix, preset, mtp in DEMO_VARIANTS:
        path = workdir / f"{stem}-{suffix}.gguf"
        console.print(
            f"[bold]2.[/] quantize {preset}, MTP head {'like the trunk' if mtp == 'same' else 'at ' + mtp} -> {path}"
        )
        write_plan(plan_quantize(plan_from_gguf(ref), parse_options(preset, mtp_type=mtp)), path)
        files.append((preset, mtp, path))
    table = results_table([p.name for _, _, p in files], draft, max_new_tokens)
    ref_rate = None
    rates: dict[tuple[str, str], float] = {}
    for preset, mtp, path in files:
        console.print(f"[bold]3.[/] mtpq accept {path.name}")
        r = measure_file(
            path,
            prompts=prompt_set,
            draft=draft,
            max_new_tokens=max_new_tokens,
            max_prompts=max_prompts,
            device=device,
            with_plain=True,
            threads=threads,
        )
        rate = r.overall.acceptance_rate
        ref_rate = rate if ref_rate is None else ref_rate
        rates[(preset, mtp)] = rate
        head_types = "/".join(summarize_gguf(path)["mtp_types"])
        table.add_row(
            path.name,
            f"{path.stat().st_size / 2**20:.1f}",
            head_types,
            f"{100 * rate:.1f}",
            f"{100 * (rate - ref_rate):+.1f}",
            f"{r.overall.mean_acceptance_length:.2f}",
            "yes" if r.greedy_outputs_identical else "NO",
        )
    out.print(table)
    for preset in dict.fromkeys(p for p, _, _ in files[1:]):  # what this run measured, per trunk preset
        held, same = rates[(preset, "q8_0")], rates[(preset, "same")]
        out.print(
            f"{preset}: head at q8_0 {100 * held:.1f} %, head quantized like the trunk {100 * same:.1f} % "
            f"(f16 reference {100 * ref_rate:.1f} %): holding the head at q8_0 "
            f"{'gains' if held >= same else 'loses'} {100 * abs(held - same):.1f} points."
        )
