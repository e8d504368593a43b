"""``mtpq compare``: one quality report per quant — the trunk's KLD/PPL/top-1 as llama-perplexity measures them,
next to the MTP head's acceptance. Exit 1 when a gate fails."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import typer
from rich.progress import Progress

from . import options
from .app import app
from .common import (
    check_device,
    check_engine,
    check_fractions,
    check_report_paths,
    check_runtime,
    check_torch_engine,
    console,
    fail,
    finish_report,
    gating,
    guarded,
    out,
)


def _read_text(path: Path) -> str:
    if not path.is_file():
        fail(str(path), "no such file" if not path.exists() else "not a file")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        fail(str(path), f"not UTF-8 text (byte {exc.start})")


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": False},
    epilog=(
        "Examples:\n\n"
        "  mtpq compare f16.gguf q4km.gguf q2k.gguf -f wiki.test.raw            # the KLD table, + head column\n\n"
        "  mtpq compare f16.gguf q4km.gguf -f wiki.test.raw -c 512 --chunks 40 --md $GITHUB_STEP_SUMMARY\n\n"
        "  mtpq compare f16.gguf q4km.gguf -f text.txt --max-kld 0.05 --max-drop 0.05   # a CI gate\n\n"
        "  mtpq compare big-f16.gguf big-q4km.gguf -f wiki.test.raw --engine llama.cpp --ngl 999\n\n"
        "  mtpq compare --kld-base f16.kld q4km.gguf q2k.gguf     # against llama-perplexity's saved logits\n\n"
        "The trunk's figures follow llama-perplexity's --kl-divergence: chunks of -c tokens, each scored from its "
        "middle on. With --engine llama.cpp, arguments after `--` go to llama-perplexity. --kld-base takes the file "
        "`llama-perplexity -m f16.gguf -f TEXT --kl-divergence-base f16.kld` wrote: its tokens, chunks and the "
        "reference's log-probabilities, so the reference model is not needed (every FILE is then a quant)."
    ),
)
@guarded
def compare(
    ctx: typer.Context,
    files: list[Path] = typer.Argument(
        ...,
        metavar="REFERENCE QUANT...",
        help="The full-precision GGUF "
        "(f16/bf16/q8_0) the quants are measured against, then one or more quantized "
        "GGUFs of the same model (with --kld-base: quants only).",
    ),
    text: Path = typer.Option(None, "--text", "-f", help="UTF-8 text to score (e.g. wikitext-2's wiki.test.raw)."),
    kld_base: Path = typer.Option(
        None,
        "--kld-base",
        help="The reference as llama-perplexity's "
        "--kl-divergence-base file: its log-probabilities on its own tokens (torch engine).",
    ),
    ctx_size: int = typer.Option(
        None,
        "--ctx-size",
        "-c",
        help="Tokens per chunk (llama-perplexity's -c; default 512, or the --kld-base file's).",
    ),
    chunks: int = typer.Option(None, "--chunks", help="Score only the first N chunks."),
    json_out: Path = options.JSON_REPORT,
    md_out: Path = options.MD_REPORT,
    max_kld: float = typer.Option(
        None, "--max-kld", help="Fail (exit 1) when a quant's mean KLD is above this (nats)."
    ),
    min_top1: float = typer.Option(None, "--min-top1", help="Fail when the top token agrees less often (fraction)."),
    max_ppl_ratio: float = typer.Option(None, "--max-ppl-ratio", help="Fail when PPL(Q)/PPL(ref) is above this."),
    min_rate: float = typer.Option(None, "--min-rate", help="Fail when the head's acceptance is below this."),
    max_drop: float = typer.Option(
        None, "--max-drop", help="Fail when the head's acceptance drops more than this below the reference's."
    ),
    engine: str = options.engine(
        "torch: the bundled runtime (one device). llama.cpp: llama-perplexity for the trunk, llama-server for the head."
    ),
    head: Path = options.head(
        "torch engine: a head file (mtp-*.gguf) that drafts for every "
        "file's trunk, as llama.cpp's -md (DeepSeek-V4's head lives in its own file)."
    ),
    numerics: str = typer.Option(
        "llama.cpp",
        "--numerics",
        help="torch engine: 'llama.cpp' rounds each weight's "
        "inputs as llama.cpp's CPU backend does (the figures llama-perplexity prints); "
        "'exact' multiplies in f32 (the quantization error alone).",
    ),
    device: str = typer.Option(
        None, "--device", help="torch engine: cuda, cuda:1 or cpu (default: cuda when available)."
    ),
    threads: int = options.RUNTIME_THREADS,
    llama_cpp: Path = options.llama_cpp(
        "llama.cpp: folder with llama-perplexity and llama-server (default: $MTPQ_LLAMA_CPP_BIN, then PATH)."
    ),
    ngl: int = options.NGL,
) -> None:
    """Score quants against their full-precision reference: PPL, PPL ratio, mean/median/99 %/max KLD, how often
    the top token agrees, RMS Δp — the table quant publishers put on model cards, computed as llama-perplexity
    computes it — and the MTP head's depth-1 acceptance on the same chunks, with its drop against the
    reference's head. Exit codes: 0 pass, 1 a gate failed, 2 bad input."""
    from ..acceptance.quality import OPTIONS, Gates, judge, rich_table, to_markdown

    check_engine(engine)
    # click hands everything after `--` to the variadic FILE argument: llama-perplexity's options start there
    at = next((i for i, f in enumerate(files) if str(f).startswith("-")), len(files))
    files, passed_on = files[:at], [str(f) for f in files[at:]] + list(ctx.args)
    if kld_base is not None:
        if engine != "torch":
            fail("--kld-base", "is read by the torch engine (llama-perplexity reads it itself: --kl-divergence)")
        if text is not None:
            fail("--text", "not with --kld-base: the base file holds the tokens that are scored")
        reference, quants = None, files
        if ctx_size is not None:
            fail("--ctx-size", "not with --kld-base: the chunks are the base file's")
    elif text is None:
        fail("--text", "missing: the text to score (or --kld-base FILE, llama-perplexity's saved reference)")
    elif len(files) < 2:
        fail("compare", "needs the reference GGUF and at least one quant")
    else:
        reference, quants = files[0], files[1:]
    if numerics not in ("llama.cpp", "exact"):
        fail("--numerics", "choose llama.cpp or exact")
    ctx_size = 512 if ctx_size is None else ctx_size
    if ctx_size < 4:
        fail("--ctx-size", f"must be at least 4, got {ctx_size}")
    if chunks is not None and chunks < 1:
        fail("--chunks", f"must be at least 1, got {chunks}")
    if engine == "torch":
        check_torch_engine({"--llama-cpp": llama_cpp, "--ngl": ngl}, passed_on, "llama-perplexity")
    elif device is not None or numerics != "llama.cpp" or head is not None:
        fail(
            "--device" if device is not None else "--numerics" if head is None else "--head",
            "belongs to --engine torch",
        )
    check_fractions(min_top1=min_top1, min_rate=min_rate, max_drop=max_drop)
    if kld_base is not None and max_drop is not None:
        fail("--max-drop", "needs the reference's head: with --kld-base there is no reference model")
    inputs = [p for p in (reference, *quants, text, kld_base, head) if p is not None]
    for p in inputs:
        if not p.is_file():
            fail(str(p), "no such file")
    check_report_paths(json_out, md_out, inputs)
    if engine == "torch":
        check_runtime(
            [p for p in (reference, *quants, head) if p is not None],
            "compare --engine torch",
            "--engine llama.cpp measures it with llama-perplexity and llama-server",
        )
    device = check_device(device)

    gates = Gates(max_kld=max_kld, min_top1=min_top1, max_ppl_ratio=max_ppl_ratio, min_rate=min_rate, max_drop=max_drop)
    with gating(gates.any()):  # non-finite figures: a failed gate (exit 1), else bad input (2)
        if kld_base is not None:
            report = _with_base(kld_base, quants, chunks, TorchScoring.chosen(device, threads, numerics, head))
        elif engine == "torch":
            scoring = TorchScoring.chosen(device, threads, numerics, head)
            report = _with_torch(reference, quants, _read_text(text), ctx_size, chunks, scoring)
        else:
            _read_text(text)
            report = _with_llama_cpp(reference, quants, text, ctx_size, chunks, threads, ngl, llama_cpp, passed_on)
    failures = judge(report["files"], gates, OPTIONS)
    report["passed"] = not any(failures.values())
    report["failures"] = {f: r for f, r in failures.items() if r}

    def show() -> None:
        out.print(rich_table(report))
        out.print(f"trunk: {report['engine']['trunk']}; head: {report['engine']['head']}")
        if gates.any():
            for f, reasons in failures.items():
                out.print(
                    f"[red]FAIL[/] {Path(f).name}: " + "; ".join(reasons)
                    if reasons
                    else f"[green]PASS[/] {Path(f).name}"
                )

    finish_report(json_out, report, md_out, lambda: to_markdown(report, failures), show, report["passed"])


@dataclass(frozen=True)
class TorchScoring:
    """How the torch engine scores files: device, CPU threads, numerics, and the head file that drafts for every
    trunk (None: each file's own head)."""

    device: str
    threads: int | None
    numerics: str
    head: Path | None

    @classmethod
    def chosen(cls, device: str | None, threads: int | None, numerics: str, head: Path | None) -> TorchScoring:
        """The options as given; no --device: cuda when available, else cpu."""
        return cls(device or ("cuda" if __import__("torch").cuda.is_available() else "cpu"), threads, numerics, head)

    @property
    def label(self) -> str:
        return f"torch ({self.device}, numerics {self.numerics})"

    def load_runs(self, paths: list[Path], progress, task) -> list:
        """A QualityRun per file (threads chosen by the first), the progress line naming the file it loads."""
        from ..runtime.accept import use_threads
        from ..runtime.trunk_quality import QualityRun

        use_threads(paths[0], self.threads)
        runs = []
        for p in paths:
            progress.update(task, description=f"loading {p.name}")
            runs.append(QualityRun(p, device=self.device, numerics=self.numerics, head=self.head))
        return runs


# what the torch engine measures of the head
HEAD_FIGURES = "teacher-forced depth-1 acceptance on the same chunks"


def _with_torch(
    reference: Path, quants: list[Path], text: str, ctx_size: int, chunks: int | None, scoring: TorchScoring
) -> dict:
    from ..runtime.trunk_quality import compare_runs

    with Progress(console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task("loading", total=None)
        runs = scoring.load_runs([reference, *quants], progress, task)
        progress.update(task, description=f"scoring {len(quants) + 1} files")
        n = compare_runs(
            runs[0],
            runs[1:],
            text,
            n_ctx=ctx_size,
            n_chunks=chunks,
            on_chunk=lambda i, total: progress.update(task, completed=i, total=total),
        )
    ref = runs[0].quality
    label = scoring.label
    return {
        "reference": ref.summary(ref),
        "files": [r.quality.summary(ref) for r in runs[1:]],
        "ctx_size": ctx_size,
        "chunks": n,
        "numerics": scoring.numerics,
        "engine": {"trunk": label, "head": f"{label}: {HEAD_FIGURES}"},
    }


def _with_base(base_path: Path, quants: list[Path], chunks: int | None, scoring: TorchScoring) -> dict:
    from ..engines.kld_base import KldBase
    from ..runtime.trunk_quality import compare_with_base

    base = KldBase(base_path)
    with Progress(console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task("loading", total=None)
        runs = scoring.load_runs(quants, progress, task)
        progress.update(task, description=f"scoring {len(quants)} files against {base_path.name}")
        ref = compare_with_base(
            base, runs, n_chunks=chunks, on_chunk=lambda i, total: progress.update(task, completed=i, total=total)
        )
    label = scoring.label
    summary = ref.summary(ref)
    summary.update(size_bytes=None, bits_per_weight=None)
    return {
        "reference": summary,
        "files": [r.quality.summary(None) for r in runs],
        "ctx_size": base.n_ctx,
        "chunks": min(chunks or base.n_chunk, base.n_chunk),
        "numerics": scoring.numerics,
        "kld_base": str(base_path),
        "engine": {
            "trunk": f"{label} against {base_path.name} (llama-perplexity's reference log-probabilities)",
            "head": f"{label}: {HEAD_FIGURES}",
        },
    }


def _with_llama_cpp(
    reference: Path,
    quants: list[Path],
    text: Path,
    ctx_size: int,
    chunks: int | None,
    threads: int | None,
    ngl: int | None,
    bin_dir: Path | None,
    extra: list[str],
) -> dict:
    from ..engines.llama_cpp import ServerConfig, find_server, measure_with_llama_cpp
    from ..engines.perplexity import PerplexityConfig, find_perplexity, kld_with_llama_cpp
    from ..gguf_io import GGUFFile

    cfg = PerplexityConfig(
        find_perplexity(bin_dir), ctx_size=ctx_size, chunks=chunks, threads=threads, ngl=ngl, extra=list(extra)
    )
    server = ServerConfig(find_server(bin_dir), ngl=ngl, threads=threads)
    with Progress(console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task("llama-perplexity", total=len(quants) + 1)
        ref, figures, n_chunks = kld_with_llama_cpp(
            reference, quants, text, cfg, on_file=lambda i: progress.update(task, completed=i + 1)
        )
        rates = {}
        for p in (reference, *quants):  # the head: llama-server's draft counters, k=1, greedy, built-in prompts
            progress.update(task, description=f"llama-server: {p.name}")
            if GGUFFile(p).n_mtp:
                rates[p] = measure_with_llama_cpp(
                    p, "builtin", draft=1, max_new_tokens=64, server=server
                ).overall.acceptance_rate
    rows = []
    for p, f in [(reference, ref), *zip(quants, figures)]:
        g = GGUFFile(p)
        size, n = g.nbytes, g.n_elements
        rate = rates.get(p)
        drop = rates[reference] - rate if rate is not None and rates.get(reference) is not None else None
        rows.append(
            {
                "file": str(p),
                "size_bytes": size,
                "bits_per_weight": round(8 * size / max(n, 1), 4),
                **f,
                "accept_rate": rate,
                "accept_drop": drop,
            }
        )
    scored = ctx_size - 1 - ctx_size // 2
    return {
        "reference": rows[0],
        "files": rows[1:],
        "ctx_size": ctx_size,
        "chunks": n_chunks,
        "positions_per_chunk": scored,
        "numerics": "llama.cpp",
        "engine": {
            "trunk": f"llama.cpp ({cfg.binary.name} --kl-divergence)",
            "head": f"llama.cpp ({server.binary.name} --spec-type draft-mtp, k=1, greedy, built-in prompts)",
        },
    }
