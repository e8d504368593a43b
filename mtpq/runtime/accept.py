"""The acceptance check: run a GGUF's MTP head as a drafter over a prompt set and report.

    report = measure_file("q4km.gguf", prompts="builtin", draft=3, max_new_tokens=64)
    report.overall.acceptance_rate, report.by_category["code"].per_position
    verdict = judge(report, reference_report, min_rate=0.3, max_drop=0.1)  # mtpq.acceptance.report

For every prompt the speculative loop generates ``max_new_tokens`` tokens with
k-token drafts (greedy by default), and plain decoding generates the same
number for the tokens/s baseline. With greedy decoding both outputs must be
identical (the loop's correctness invariant); the report says whether they were.
Metrics follow vLLM's definitions (see :mod:`mtpq.acceptance.metrics`); the report, its verdict and its
Markdown are engine-neutral (:mod:`mtpq.acceptance.report`), shared with the llama.cpp engine.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch

from ..acceptance.metrics import GenerationResult, metrics_from_rounds
from ..acceptance.prompts import load_prompts
from ..acceptance.report import AcceptReport, PromptRun
from ..errors import InputError
from ..gguf_io import shard_paths, split_prefix
from .speculative import load_model, run_plain, run_speculative

# ----------------------------------------------------------------------------- measuring


def measure_file(
    path: str | Path,
    prompts: str | Path | list[tuple[str, str]] = "builtin",
    draft: int = 3,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    max_prompts: int | None = None,
    device: str | None = None,
    dtype: torch.dtype = torch.float32,
    hidden: str = "auto",
    with_plain: bool = True,
    threads: int | None = None,
    head: str | Path | None = None,
    on_prompt: Callable[[int, int], None] | None = None,
    rounds: str = "llama-server",
) -> AcceptReport:
    """Acceptance of one GGUF's MTP head over a prompt set (``head``: a head file drafting for the trunk at
    ``path``, as llama.cpp's ``-md``; ``rounds``: which llama.cpp driver's rounds to count, see
    :func:`~mtpq.runtime.speculative.run_speculative`)."""
    path = Path(path)
    if not 1 <= draft <= 8:
        raise InputError("--draft", "must be between 1 and 8")
    use_threads(path, threads)
    model, tok = load_model(path, device=device, dtype=dtype, hidden=hidden, head=head)
    if getattr(model, "mtp", None) is None:
        if getattr(model.family, "head_in_own_file", False):
            raise InputError(
                path,
                f"has no MTP head to draft with: {model.arch}'s head lives in a file of its own "
                "(convert --mtp-only); pass it with --head",
            )
        raise InputError(path, "has no MTP head to draft with (mtpq graft can add one)")
    pairs = load_prompts(prompts, max_prompts) if not isinstance(prompts, list) else prompts
    stop = {i for i in (getattr(tok, "eos_token_id", None),) if i is not None}
    runs = []
    for i, (cat, text) in enumerate(pairs):
        ids = tok.encode(text)
        spec = run_speculative(
            model,
            ids,
            max_new_tokens,
            k=draft,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed + i,
            stop_ids=stop,
            rounds=rounds,
        )
        plain = (
            run_plain(
                model,
                ids,
                max_new_tokens,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                seed=seed + i,
                stop_ids=stop,
            )
            if with_plain
            else None
        )
        runs.append(PromptRun(cat, text, spec, plain))
        if on_prompt:
            on_prompt(i + 1, len(pairs))
    by_cat: dict[str, list[GenerationResult]] = {}
    for r in runs:
        by_cat.setdefault(r.category, []).append(r.spec)
    plains = [r.plain for r in runs if r.plain is not None]
    plain_tps = (sum(len(p.tokens) for p in plains) / sum(p.seconds for p in plains)) if plains else None
    identical = all(r.spec.tokens == r.plain.tokens for r in runs) if plains and temperature == 0 else None
    return AcceptReport(
        model=str(path),
        draft=draft,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        runs=runs,
        overall=metrics_from_rounds([r.spec for r in runs]),
        by_category={c: metrics_from_rounds(v) for c, v in by_cat.items()},
        plain_tokens_per_s=plain_tps,
        greedy_outputs_identical=identical,
        hidden=model.hidden,
        device=str(model.device),
    )


SMALL_MODEL_BYTES = 1 << 30


def _model_bytes(path: Path) -> int:
    """The size of the model at ``path``: every shard of a split GGUF (any shard given), else the file's."""
    paths = shard_paths(path) if split_prefix(path.name) else [path]
    return sum(p.stat().st_size for p in paths)


def use_threads(path: Path, threads: int | None = None) -> int:
    """CPU threads for the runtime, chosen deliberately: ``threads`` when given; else one for a file under
    1 GiB (a tiny model's ops are too small to split, and torch's pool spin-waits against whatever else the
    machine runs: a 30x CPU-time penalty seen on a loaded 2-core machine), else every core."""
    if threads is not None and threads < 1:
        raise InputError("--threads", f"must be at least 1, got {threads}")
    if threads is None:
        small = _model_bytes(Path(path)) < SMALL_MODEL_BYTES
        threads = (
            1
            if small
            else max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
        )
    torch.set_num_threads(threads)
    return threads
