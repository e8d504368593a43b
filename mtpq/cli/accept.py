"""``mtpq accept``: does the MTP head of this GGUF still draft well? Exit 1 when not."""

from __future__ import annotations

import math
from pathlib import Path

import typer
from rich.progress import Progress
from rich.table import Table

from ..acceptance.metrics import ROUNDS
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

DTYPES = ("f32", "bf16", "f16")  # torch dtypes by name, resolved when a run starts (no torch to start the CLI)


def _table(report, reference=None) -> Table:
    t = Table(title=f"MTP acceptance of {Path(report.model).name}  (k={report.draft}, T={report.temperature})")
    for col in ("category", "drafts", "acceptance", "95% CI", "per position", "mean acc. len"):
        t.add_column(col, justify="right" if col != "category" else "left")
    if reference is not None:
        t.add_column("reference", justify="right")
        t.add_column("drop", justify="right")
    cats = sorted(report.by_category) + ["overall"]
    for c in cats:
        m = report.overall if c == "overall" else report.by_category[c]
        row = [
            f"[bold]{c}[/]" if c == "overall" else c,
            str(m.n_drafts),
            f"{100 * m.acceptance_rate:.1f} %",
            f"{100 * m.ci[0]:.1f}–{100 * m.ci[1]:.1f}",
            " ".join(f"{100 * p:.0f}" for p in m.per_position),
            f"{m.mean_acceptance_length:.2f}",
        ]
        if reference is not None:
            r = reference.overall if c == "overall" else reference.by_category.get(c)
            row += (
                ["—", "—"]
                if r is None
                else [f"{100 * r.acceptance_rate:.1f} %", f"{100 * (r.acceptance_rate - m.acceptance_rate):+.1f} pt"]
            )
        t.add_row(*row)
    return t


def check_numbers(run: dict, *, min_rate: float | None, max_drop: float | None) -> None:
    """Options whose out-of-range values would measure nonsense (nan %, a PASS on nothing); ``run``: the
    measurement's options (draft, temperature, top_k, top_p, max_new_tokens, max_prompts, seed)."""
    draft, temperature, top_k, top_p = run["draft"], run["temperature"], run["top_k"], run["top_p"]
    max_new_tokens, max_prompts = run["max_new_tokens"], run["max_prompts"]
    if not 1 <= draft <= 8:
        fail("--draft", f"must be between 1 and 8, got {draft}")
    if not 0.0 <= temperature < math.inf:
        fail("--temperature", f"must be 0 (greedy) or positive, got {temperature}")
    if top_k < 0:
        fail("--top-k", f"must be 0 (off) or positive, got {top_k}")
    if not 0.0 < top_p <= 1.0:
        fail("--top-p", f"must be in (0, 1], got {top_p}")
    if max_new_tokens < 1:
        fail("--max-new-tokens", f"must be at least 1, got {max_new_tokens}")
    if max_prompts is not None and max_prompts < 1:
        fail("--max-prompts", f"must be at least 1, got {max_prompts}")
    check_fractions(min_rate=min_rate, max_drop=max_drop)


def check_engine_options(
    engine: str,
    extra: list[str],
    *,
    llama_cpp,
    server,
    ngl,
    ctx_size,
    rpc,
    threads,
    device,
    dtype,
    hidden,
    reference,
    rounds="llama-server",
):
    """The options that belong to one engine only; -> the llama-server configuration (None for torch or --server)."""
    llama_only = {"--llama-cpp": llama_cpp, "--server": server, "--ngl": ngl, "--ctx-size": ctx_size, "--rpc": rpc}
    if engine == "torch":
        check_torch_engine(llama_only, extra, "llama-server")
        return None
    for opt, v, default in (("--device", device, None), ("--dtype", dtype, "f32"), ("--hidden", hidden, "auto")):
        if v != default:
            fail(opt, "belongs to --engine torch (llama-server decides devices and precision itself)")
    if rounds != "llama-server":
        fail("--rounds", "belongs to --engine torch (llama-server places its rounds as llama-server does)")
    if server is not None:
        if not server.startswith(("http://", "https://", "unix:")):
            fail("--server", f"{server}: expected http://HOST:PORT or unix:/path/to/llama.sock")
        for opt in ("--llama-cpp", "--ngl", "--ctx-size", "--rpc"):
            if llama_only[opt] is not None:
                fail(opt, "starts a server: not with --server (that server was started by someone else)")
        if reference is not None:
            fail(
                "--reference",
                "with --server, one server holds one model: measure the reference separately "
                "and compare the JSON reports",
            )
        if extra:
            fail(" ".join(extra), "arguments for llama-server: not with --server")
        return None
    for opt, v in (("--ngl", ngl), ("--ctx-size", ctx_size), ("--threads", threads)):
        if v is not None and v < (0 if opt == "--ngl" else 1):
            fail(opt, f"must be {'0 or more' if opt == '--ngl' else 'at least 1'}, got {v}")
    from ..engines.llama_cpp import ServerConfig, find_server

    return ServerConfig(find_server(llama_cpp), ngl=ngl, ctx_size=ctx_size, threads=threads, rpc=rpc, extra=list(extra))


def check_prompts(pairs: list[tuple[str, str]], where: str) -> list[tuple[str, str]]:
    for i, (_, text) in enumerate(pairs, 1):
        if not text.strip():
            fail(str(where), f"prompt {i} is empty")
    return pairs


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": False},
    epilog=(
        "Examples:\n\n"
        "  mtpq accept q4km.gguf                                  # built-in prompts, k=3, greedy\n\n"
        "  mtpq accept q4km.gguf --reference f16.gguf --max-drop 0.05\n\n"
        "  mtpq accept q4km.gguf --min-rate 0.4 --json acc.json --md acc.md   # a CI gate\n\n"
        "  mtpq accept q4km.gguf --prompts mine.jsonl --draft 2 --temperature 0.7\n\n"
        "  mtpq accept air-Q4_K_M.gguf --head mtp-air-Q8_0.gguf   # a trunk and its head file (llama.cpp's -md)\n\n"
        "  mtpq accept big-q4km.gguf --engine llama.cpp --ngl 999 -- --tensor-split 1,1   # two GPUs\n\n"
        "  mtpq accept big-q4km.gguf --engine llama.cpp --rpc 10.0.0.2:50052,10.0.0.3:50052\n\n"
        "  mtpq accept big-q4km.gguf --engine llama.cpp --server http://gpu-box:8080\n\n"
        'Prompts file: one JSON object per line, {"category": "code", "prompt": "def f(x):"}.\n\n'
        "With --engine llama.cpp, arguments after `--` go to llama-server as they are."
    ),
)
@guarded
def accept(
    ctx: typer.Context,
    model: Path = typer.Argument(..., help="GGUF with an MTP head (or a trunk, with --head)."),
    head: Path = options.head(
        "A head file (mtp-*.gguf) that drafts for MODEL's trunk, as "
        "llama.cpp's -md: its MTP blocks (and its token_embd/output where the head ties to "
        "them) replace any head MODEL has."
    ),
    reference: Path = typer.Option(
        None, "--reference", help="A higher-precision GGUF of the same model to compare with."
    ),
    prompts: str = typer.Option("builtin", "--prompts", help="'builtin' (code, math, chat, prose) or a JSONL file."),
    draft: int = options.DRAFT,
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy acceptance; > 0 = rejection sampling."),
    top_k: int = typer.Option(0, "--top-k", help="Top-k filter when sampling (0 = off)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Top-p filter when sampling (1 = off)."),
    max_new_tokens: int = options.max_new_tokens(64),
    max_prompts: int = options.max_prompts(),
    min_rate: float = typer.Option(None, "--min-rate", help="Fail (exit 1) when the acceptance rate is below this."),
    max_drop: float = typer.Option(
        None, "--max-drop", help="Fail (exit 1) when the rate drops more than this below --reference."
    ),
    json_out: Path = options.JSON_REPORT,
    md_out: Path = options.MD_REPORT,
    device: str = options.DEVICE,
    threads: int = options.RUNTIME_THREADS,
    dtype: str = typer.Option("f32", "--dtype", help="Compute dtype: f32, bf16 or f16."),
    hidden: str = typer.Option(
        "auto",
        "--hidden",
        help="Hidden state fed to the head: auto (default: what llama.cpp "
        "feeds this architecture's head), post_norm or pre_norm.",
    ),
    seed: int = typer.Option(0, "--seed", help="Sampling seed."),
    rounds: str = typer.Option(
        "llama-server",
        "--rounds",
        help="torch engine: where the draft rounds fall, as one of llama.cpp's drivers places them. "
        "llama-server (default): drafting starts after the prompt's first new token. "
        "llama-speculative-simple: the prompt's last token starts the first round (the first new token is "
        "drafted too), and it counts the rounds that example prints. Greedy acceptance differs between the two "
        "by a point or so on a good head: a run of accepted drafts keeps its phase until a miss.",
    ),
    engine: str = options.engine(
        "torch: the bundled runtime (one device). llama.cpp: "
        "llama-server with its MTP drafter, for models that need several GPUs or machines."
    ),
    llama_cpp: Path = options.llama_cpp(
        "llama.cpp: folder with llama-server (default: $MTPQ_LLAMA_CPP_BIN, then PATH)."
    ),
    server: str = typer.Option(
        None,
        "--server",
        help="llama.cpp: use this running llama-server (http://HOST:PORT, or "
        "unix:PATH for one started with --host PATH.sock; started with --spec-type "
        "draft-mtp) instead of starting one.",
    ),
    ngl: int = options.NGL,
    ctx_size: int = typer.Option(None, "--ctx-size", "-c", help="llama.cpp: context size of the server."),
    rpc: str = typer.Option(
        None, "--rpc", help="llama.cpp: rpc-server endpoints HOST:PORT,HOST:PORT to spread the model over."
    ),
) -> None:
    """Measure how well the MTP head drafts: acceptance rate, per-position rates, mean acceptance length, tokens/s.

    --engine torch (default) runs the bundled PyTorch runtime (weights stay in their
    GGUF quant type and are dequantized on the fly); --engine llama.cpp starts
    llama-server --spec-type draft-mtp (GPU offload, RPC across machines) and reads its
    draft counters. Exit codes: 0 pass, 1 below --min-rate or drop above --max-drop,
    2 bad input.
    """
    from ..acceptance.prompts import load_prompts
    from ..acceptance.report import judge, to_markdown
    from ..runtime.accept import measure_file

    check_engine(engine)
    server_cfg = check_engine_options(
        engine,
        ctx.args,
        llama_cpp=llama_cpp,
        server=server,
        ngl=ngl,
        ctx_size=ctx_size,
        rpc=rpc,
        threads=threads,
        device=device,
        dtype=dtype,
        hidden=hidden,
        reference=reference,
        rounds=rounds,
    )
    if rounds not in ROUNDS:
        fail("--rounds", f"choose {' or '.join(ROUNDS)}")
    if dtype not in DTYPES:
        fail("--dtype", f"choose one of {', '.join(DTYPES)}")
    if hidden not in ("auto", "post_norm", "pre_norm"):
        fail("--hidden", "choose auto, post_norm or pre_norm")
    if max_drop is not None and reference is None:
        fail("--max-drop", "needs --reference")
    if head is not None and server is not None:
        fail("--head", "a running --server holds its draft model already")
    run = dict(
        draft=draft,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
        max_prompts=max_prompts,
        seed=seed,
    )  # what measure_file and measure_with_llama_cpp take besides the prompts
    check_numbers(run, min_rate=min_rate, max_drop=max_drop)
    device = check_device(device)
    for p in (model, reference, head):
        if p is not None and not p.is_file() and server is None:
            fail(str(p), "no such file")
    check_report_paths(json_out, md_out, [p for p in (model, reference, head) if p is not None])
    if engine == "torch":
        check_runtime(
            [p for p in (model, reference) if p is not None],
            "accept --engine torch",
            "--engine llama.cpp measures it through llama-server",
        )
    kw = dict(prompts=check_prompts(load_prompts(prompts, max_prompts), prompts), **run)
    if engine == "torch":
        import torch

        kw.update(
            device=device,
            dtype={"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[dtype],
            hidden=hidden,
            threads=threads,
            rounds=rounds,
        )
    reports = {}
    # accept always judges (greedy outputs identical, and its gates): a measurement that fails is a failed check
    with gating(), Progress(console=console, transient=True, disable=not console.is_terminal) as progress:
        for label, path in (("model", model), ("reference", reference)):
            if path is None:
                continue
            task = progress.add_task(
                f"{label}: {path.name}" + (" (llama-server)" if engine != "torch" else ""), total=None
            )
            tick = lambda i, n, t=task: progress.update(t, completed=i, total=n)  # noqa: E731
            own_head = head if label == "model" else None
            if engine == "torch":
                reports[label] = measure_file(path, **kw, head=own_head, on_prompt=tick)
            else:
                from ..engines.llama_cpp import measure_with_llama_cpp, with_draft_model

                cfg = with_draft_model(server_cfg, own_head) if own_head is not None else server_cfg
                reports[label] = measure_with_llama_cpp(path, **kw, server=cfg, url=server, on_prompt=tick)
    report, ref = reports["model"], reports.get("reference")
    verdict = judge(report, ref, min_rate, max_drop)
    doc = {
        **report.to_dict(),
        "reference": ref.to_dict() if ref else None,
        "drop": verdict.drop,
        "passed": verdict.passed,
        "reasons": verdict.reasons,
    }

    def show() -> None:
        out.print(_table(report, ref))
        if report.engine == "llama.cpp":
            out.print(
                f"engine llama.cpp ({report.extra.get('server')}): {report.extra.get('note')}; "
                f"tokens/s {report.overall.tokens_per_s:.1f} with drafting"
            )
        if report.speedup is not None:
            out.print(
                f"tokens/s: {report.overall.tokens_per_s:.1f} drafting vs {report.plain_tokens_per_s:.1f} plain "
                f"({report.speedup:.2f}x on {report.device})"
            )
        if report.greedy_outputs_identical is False:
            out.print("[red]greedy speculative output differs from plain greedy output[/]")
        out.print("[green]PASS[/]" if verdict.passed else "[red]FAIL[/]: " + "; ".join(verdict.reasons))

    finish_report(json_out, doc, md_out, lambda: to_markdown(report, ref, verdict), show, verdict.passed)
