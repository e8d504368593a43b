"""The acceptance check: run a GGUF's MTP head as a drafter over a prompt set and report.

    report = measure_file("q4km.gguf", prompts="builtin", draft=3, max_new_tokens=64)
    report.overall.acceptance_rate, report.by_category["code"].per_position
    verdict = judge(report, reference_report, min_rate=0.3, max_drop=0.1)

For every prompt the speculative loop generates ``max_new_tokens`` tokens with
k-token drafts (greedy by default), and plain decoding generates the same
number for the tokens/s baseline. With greedy decoding both outputs must be
identical (the loop's correctness invariant); the report says whether they were.
Metrics follow vLLM's definitions (see metrics.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Callable

import torch

from ..errors import InputError
from ..gguf_io import shard_paths, split_prefix
from .metrics import AcceptanceMetrics, summarize
from .speculative import GenerationResult, load_model, run_plain, run_speculative


@dataclass
class PromptRun:
    category: str
    prompt: str
    spec: GenerationResult
    plain: GenerationResult | None


@dataclass
class AcceptReport:
    model: str
    draft: int
    temperature: float
    max_new_tokens: int
    runs: list[PromptRun]
    overall: AcceptanceMetrics
    by_category: dict[str, AcceptanceMetrics]
    plain_tokens_per_s: float | None
    greedy_outputs_identical: bool | None  # greedy only: speculative output == plain output
    hidden: str = "post_norm"
    device: str = "cpu"
    engine: str = "torch"  # "torch" (this runtime) or "llama.cpp" (llama-server, see mtpq.engines)
    extra: dict = field(default_factory=dict)

    @property
    def speedup(self) -> float | None:
        if not self.plain_tokens_per_s:
            return None
        return self.overall.tokens_per_s / self.plain_tokens_per_s

    def deterministic_summary(self) -> dict:
        """The figures that do not depend on timing (for manifests that must be reproducible)."""

        def d(m: AcceptanceMetrics) -> dict:
            return {"acceptance_rate": round(m.acceptance_rate, 6), "per_position": [round(x, 6) for x in m.per_position],
                    "mean_acceptance_length": round(m.mean_acceptance_length, 6), "drafts": m.n_drafts,
                    "drafted": m.n_drafted, "accepted": m.n_accepted,
                    "ci95": [round(x, 6) for x in m.ci]}

        return {**d(self.overall), "draft": self.draft, "temperature": self.temperature,
                "max_new_tokens": self.max_new_tokens, "prompts": len(self.runs),
                "by_category": {c: d(m) for c, m in sorted(self.by_category.items())}}

    def to_dict(self) -> dict:
        return {"model": self.model, **self.deterministic_summary(), "engine": self.engine, "hidden": self.hidden,
                "device": self.device, "tokens_per_s": self.overall.tokens_per_s,
                "plain_tokens_per_s": self.plain_tokens_per_s, "speedup": self.speedup,
                "greedy_outputs_identical": self.greedy_outputs_identical, **self.extra}


# ----------------------------------------------------------------------------- prompts


def load_prompts(spec: str | Path, max_prompts: int | None = None) -> list[tuple[str, str]]:
    """(category, prompt) pairs from a packaged set (``builtin``, ``demo_heldout``) or a JSONL file."""
    packaged = resources.files("mtpq").joinpath(f"data/prompts/{spec}.jsonl")
    if "/" not in str(spec) and not str(spec).endswith(".jsonl") and packaged.is_file():
        text = packaged.read_text()
        where = f"{spec} prompts"
    else:
        path = Path(spec)
        if not path.is_file():
            raise InputError(path, "no such prompts file")
        text, where = path.read_text(), str(path)
    prompts = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            prompts.append((str(obj.get("category", "all")), str(obj["prompt"])))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise InputError(where, f"line {i}: expected a JSON object with a \"prompt\" field") from None
    if not prompts:
        raise InputError(where, "no prompts")
    return prompts[:max_prompts] if max_prompts else prompts


# ----------------------------------------------------------------------------- measuring


def measure_file(path: str | Path, prompts: str | Path | list[tuple[str, str]] = "builtin", draft: int = 3,
                 max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0, max_prompts: int | None = None, device: str | None = None,
                 dtype: torch.dtype = torch.float32, hidden: str = "post_norm", with_plain: bool = True,
                 threads: int | None = None,
                 on_prompt: Callable[[int, int], None] | None = None) -> AcceptReport:
    """Acceptance of one GGUF's MTP head over a prompt set."""
    path = Path(path)
    if not 1 <= draft <= 8:
        raise InputError("--draft", "must be between 1 and 8")
    use_threads(path, threads)
    model, tok = load_model(path, device=device, dtype=dtype, hidden=hidden)
    if getattr(model, "mtp", None) is None:
        raise InputError(path, "has no MTP head to draft with (mtpq graft can add one)")
    pairs = load_prompts(prompts, max_prompts) if not isinstance(prompts, list) else prompts
    stop = {i for i in (getattr(tok, "eos_token_id", None),) if i is not None}
    runs = []
    for i, (cat, text) in enumerate(pairs):
        ids = tok.encode(text)
        spec = run_speculative(model, ids, max_new_tokens, k=draft, temperature=temperature, top_k=top_k,
                               top_p=top_p, seed=seed + i, stop_ids=stop)
        plain = (run_plain(model, ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                           seed=seed + i, stop_ids=stop) if with_plain else None)
        runs.append(PromptRun(cat, text, spec, plain))
        if on_prompt:
            on_prompt(i + 1, len(pairs))
    by_cat: dict[str, list[GenerationResult]] = {}
    for r in runs:
        by_cat.setdefault(r.category, []).append(r.spec)
    plains = [r.plain for r in runs if r.plain is not None]
    plain_tps = (sum(len(p.tokens) for p in plains) / sum(p.seconds for p in plains)) if plains else None
    identical = all(r.spec.tokens == r.plain.tokens for r in runs) if plains and temperature == 0 else None
    return AcceptReport(model=str(path), draft=draft, temperature=temperature, max_new_tokens=max_new_tokens,
                        runs=runs, overall=summarize([r.spec for r in runs]),
                        by_category={c: summarize(v) for c, v in by_cat.items()}, plain_tokens_per_s=plain_tps,
                        greedy_outputs_identical=identical, hidden=hidden, device=str(model.device))


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
        threads = 1 if small else max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                      else (os.cpu_count() or 1))
    torch.set_num_threads(threads)
    return threads


@dataclass
class Verdict:
    passed: bool
    reasons: list[str]
    drop: float | None


def judge(report: AcceptReport, reference: AcceptReport | None, min_rate: float | None,
          max_drop: float | None) -> Verdict:
    rate = report.overall.acceptance_rate
    reasons = []
    if min_rate is not None and not rate >= min_rate:
        reasons.append(f"acceptance rate {rate:.3f} is below --min-rate {min_rate:.3f}")
    drop = None
    if reference is not None:
        drop = reference.overall.acceptance_rate - rate
        if max_drop is not None and drop > max_drop:
            reasons.append(f"acceptance dropped {drop:.3f} below the reference "
                           f"({reference.overall.acceptance_rate:.3f}), more than --max-drop {max_drop:.3f}")
    if report.greedy_outputs_identical is False:
        reasons.append("greedy speculative output differs from plain greedy output (runtime bug or precision tie)")
    return Verdict(not reasons, reasons, drop)


# ----------------------------------------------------------------------------- Markdown


def to_markdown(report: AcceptReport, reference: AcceptReport | None = None, verdict: Verdict | None = None) -> str:
    def row(name: str, m: AcceptanceMetrics, ref: AcceptanceMetrics | None) -> str:
        pos = " / ".join(f"{100 * p:.0f}" for p in m.per_position)
        cells = [name, str(m.n_drafts), f"{100 * m.acceptance_rate:.1f} % [{100 * m.ci[0]:.1f}, {100 * m.ci[1]:.1f}]",
                 pos, f"{m.mean_acceptance_length:.2f}"]
        if reference is not None:
            cells.append("—" if ref is None else f"{100 * ref.acceptance_rate:.1f} %")
        return "| " + " | ".join(cells) + " |"

    head = ["category", "drafts", "acceptance [95% CI]", "per position %", "mean acc. length"]
    if reference is not None:
        head.append("reference")
    lines = [f"## MTP acceptance: `{Path(report.model).name}`", "",
             f"draft k={report.draft}, temperature {report.temperature}, {len(report.runs)} prompts, "
             f"{report.max_new_tokens} new tokens each, "
             + (f"engine llama.cpp ({report.extra.get('note', '')})" if report.engine == "llama.cpp"
                else f"device {report.device}"), "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cat in sorted(report.by_category):
        ref = reference.by_category.get(cat) if reference else None
        lines.append(row(cat, report.by_category[cat], ref))
    lines.append(row("**overall**", report.overall, reference.overall if reference else None))
    lines.append("")
    if report.speedup is not None:
        lines.append(f"tokens/s: {report.overall.tokens_per_s:.1f} with drafting, {report.plain_tokens_per_s:.1f} "
                     f"without ({report.speedup:.2f}x)")
    if verdict is not None:
        lines += ["", f"**{'PASS' if verdict.passed else 'FAIL'}**" + ("" if verdict.passed else ": " + "; ".join(verdict.reasons))]
    return "\n".join(lines) + "\n"
