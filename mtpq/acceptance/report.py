"""The acceptance report of ``mtpq accept``, whichever engine measured it (the torch runtime's
:func:`mtpq.runtime.accept.measure_file`, llama-server's :func:`mtpq.engines.llama_cpp.measure_with_llama_cpp`):
per prompt its generation, overall and per category the metrics, a verdict against gates and a reference, Markdown.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .metrics import AcceptanceMetrics, GenerationResult


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
            return {
                "acceptance_rate": round(m.acceptance_rate, 6),
                "per_position": [round(x, 6) for x in m.per_position],
                "mean_acceptance_length": round(m.mean_acceptance_length, 6),
                "drafts": m.n_drafts,
                "drafted": m.n_drafted,
                "accepted": m.n_accepted,
                "ci95": [round(x, 6) for x in m.ci],
            }

        return {
            **d(self.overall),
            "draft": self.draft,
            "temperature": self.temperature,
            "max_new_tokens": self.max_new_tokens,
            "prompts": len(self.runs),
            "by_category": {c: d(m) for c, m in sorted(self.by_category.items())},
        }

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            **self.deterministic_summary(),
            "engine": self.engine,
            "hidden": self.hidden,
            "device": self.device,
            "tokens_per_s": self.overall.tokens_per_s,
            "plain_tokens_per_s": self.plain_tokens_per_s,
            "speedup": self.speedup,
            "greedy_outputs_identical": self.greedy_outputs_identical,
            **self.extra,
        }


# ----------------------------------------------------------------------------- verdict


@dataclass
class Verdict:
    passed: bool
    reasons: list[str]
    drop: float | None


def judge(
    report: AcceptReport, reference: AcceptReport | None, min_rate: float | None, max_drop: float | None
) -> Verdict:
    """The gates of ``mtpq accept``, decided by :func:`mtpq.acceptance.quality.judge` (a NaN or missing rate or
    drop fails its gate)."""
    from .quality import OPTIONS, Gates
    from .quality import judge as judge_figures

    rate = report.overall.acceptance_rate
    drop = None if reference is None else reference.overall.acceptance_rate - rate
    row = {"file": report.model, "accept_rate": rate, "accept_drop": drop}
    reasons = judge_figures([row], Gates(min_rate=min_rate, max_drop=max_drop), OPTIONS)[report.model]
    if report.greedy_outputs_identical is False:
        reasons.append("greedy speculative output differs from plain greedy output (runtime bug or precision tie)")
    return Verdict(not reasons, reasons, drop)


# ----------------------------------------------------------------------------- Markdown


def to_markdown(report: AcceptReport, reference: AcceptReport | None = None, verdict: Verdict | None = None) -> str:
    def row(name: str, m: AcceptanceMetrics, ref: AcceptanceMetrics | None) -> str:
        pos = " / ".join(f"{100 * p:.0f}" for p in m.per_position)
        cells = [
            name,
            str(m.n_drafts),
            f"{100 * m.acceptance_rate:.1f} % [{100 * m.ci[0]:.1f}, {100 * m.ci[1]:.1f}]",
            pos,
            f"{m.mean_acceptance_length:.2f}",
        ]
        if reference is not None:
            cells.append("—" if ref is None else f"{100 * ref.acceptance_rate:.1f} %")
        return "| " + " | ".join(cells) + " |"

    head = ["category", "drafts", "acceptance [95% CI]", "per position %", "mean acc. length"]
    if reference is not None:
        head.append("reference")
    lines = [
        f"## MTP acceptance: `{Path(report.model).name}`",
        "",
        f"draft k={report.draft}, temperature {report.temperature}, {len(report.runs)} prompts, "
        f"{report.max_new_tokens} new tokens each, "
        + (
            f"engine llama.cpp ({report.extra.get('note', '')})"
            if report.engine == "llama.cpp"
            else f"device {report.device}"
        ),
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for cat in sorted(report.by_category):
        ref = reference.by_category.get(cat) if reference else None
        lines.append(row(cat, report.by_category[cat], ref))
    lines.append(row("**overall**", report.overall, reference.overall if reference else None))
    lines.append("")
    if report.speedup is not None:
        lines.append(
            f"tokens/s: {report.overall.tokens_per_s:.1f} with drafting, {report.plain_tokens_per_s:.1f} "
            f"without ({report.speedup:.2f}x)"
        )
    if verdict is not None:
        lines += [
            "",
            f"**{'PASS' if verdict.passed else 'FAIL'}**"
            + ("" if verdict.passed else ": " + "; ".join(verdict.reasons)),
        ]
    return "\n".join(lines) + "\n"
