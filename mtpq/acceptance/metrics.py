"""Acceptance metrics with vLLM's definitions.

Over a set of :class:`GenerationResult` (one per prompt),
with a "draft" = one verify round that proposed k tokens and accepted a of them:

- acceptance rate = accepted tokens / drafted tokens
- per-position rate i (i = 0..k-1) = drafts that accepted more than i tokens / drafts
- mean acceptance length = 1 + accepted tokens / drafts (tokens emitted per trunk round)
- tokens/s = generated tokens / wall seconds (prefill included)

The acceptance rate's confidence interval treats drafts as the sampling unit (a
ratio estimator: sum a_i / sum k_i, delta-method variance of the per-draft
residuals a_i - r k_i), so tokens of one draft are not counted as independent
trials; ``unit="prompt"`` uses prompts as the unit instead (wider, and honest
when prompts differ a lot). Per-position rates get Wilson intervals.

    m = metrics_from_rounds(results); m.acceptance_rate, m.ci, m.per_position, m.to_dict()

Engines that report only per-request totals (llama-server's ``draft_n`` / ``draft_n_accepted``)
go through :func:`metrics_from_totals`: the same figures, prompts as the interval's unit, and
per-position rates only where the totals determine them (k = 1).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Sequence

# Where a speculative loop's rounds fall, as llama.cpp's two drivers place them (runtime.speculative.run_speculative)
ROUNDS = ("llama-server", "llama-speculative-simple")


@dataclass
class GenerationResult:
    """One generation, by any engine. ``accepted``/``drafted`` have one entry per verify round (empty for plain
    decoding)."""

    prompt_len: int
    tokens: list[int]  # generated tokens, prompt excluded
    k: int  # draft length; 0 for plain decoding
    accepted: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    seconds: float = 0.0
    trunk_forwards: int = 0
    draft_ids: list[list[int]] = field(default_factory=list)  # the drafts of each round (for inspection/tests)

    @property
    def n_drafts(self) -> int:
        return len(self.drafted)

    @property
    def n_drafted(self) -> int:
        return sum(self.drafted)

    @property
    def n_accepted(self) -> int:
        return sum(self.accepted)


@dataclass
class AcceptanceMetrics:
    n_sequences: int
    n_drafts: int
    n_drafted: int
    n_accepted: int
    acceptance_rate: float
    ci: tuple[float, float]  # acceptance_rate interval at `confidence`
    per_position: list[float]
    per_position_ci: list[tuple[float, float]]
    mean_acceptance_length: float
    n_generated: int
    seconds: float
    tokens_per_s: float
    confidence: float = 0.95

    def to_dict(self) -> dict:
        return asdict(self)


def _z(confidence: float) -> float:
    from statistics import NormalDist

    return NormalDist().inv_cdf(0.5 + confidence / 2)


def wilson(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion."""
    if n == 0:
        return (float("nan"), float("nan"))
    z = _z(confidence)
    p = successes / n
    denom = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, mid - half), min(1.0, mid + half))


def ratio_ci(num: Sequence[float], den: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """Interval of sum(num)/sum(den) with units i = (num_i, den_i) sampled independently (delta method)."""
    n = len(num)
    total = sum(den)
    if n < 2 or total == 0:
        return (float("nan"), float("nan"))
    r = sum(num) / total
    mean_den = total / n
    resid = [a - r * d for a, d in zip(num, den)]
    var = sum(e * e for e in resid) / (n - 1) / n / mean_den**2
    half = _z(confidence) * math.sqrt(var)
    return (max(0.0, r - half), min(1.0, r + half))


def _from_counts(
    n_sequences: int,
    n_drafts: int,
    n_drafted: int,
    n_accepted: int,
    ci: tuple[float, float],
    per_position: list[float],
    per_position_ci: list[tuple[float, float]],
    n_generated: int,
    seconds: float,
    confidence: float,
) -> AcceptanceMetrics:
    """The metrics from the counts, whichever engine gave them: the rates, the mean acceptance length and
    tokens/s computed here alone (nan where their denominator is 0)."""
    return AcceptanceMetrics(
        n_sequences=n_sequences,
        n_drafts=n_drafts,
        n_drafted=n_drafted,
        n_accepted=n_accepted,
        acceptance_rate=n_accepted / n_drafted if n_drafted else float("nan"),
        ci=ci,
        per_position=per_position,
        per_position_ci=per_position_ci,
        mean_acceptance_length=1 + n_accepted / n_drafts if n_drafts else float("nan"),
        n_generated=n_generated,
        seconds=seconds,
        tokens_per_s=n_generated / seconds if seconds > 0 else float("nan"),
        confidence=confidence,
    )


def metrics_from_rounds(
    results: Sequence[GenerationResult], confidence: float = 0.95, unit: str = "draft"
) -> AcceptanceMetrics:
    """Aggregate results (speculative ones; plain ones contribute only to tokens/s)."""
    if unit not in ("draft", "prompt"):
        raise ValueError("unit must be 'draft' or 'prompt'")
    accepted = [a for r in results for a in r.accepted]
    drafted = [d for r in results for d in r.drafted]
    n_drafts, n_acc, n_dft = len(drafted), sum(accepted), sum(drafted)
    k = max(drafted, default=0)
    per_pos_counts = [sum(1 for a in accepted if a > i) for i in range(k)]
    if unit == "draft":
        ci = ratio_ci(accepted, drafted, confidence)
    else:
        ci = ratio_ci([r.n_accepted for r in results], [r.n_drafted for r in results], confidence)
    per_position = [c / n_drafts for c in per_pos_counts] if n_drafts else []
    per_position_ci = [wilson(c, n_drafts, confidence) for c in per_pos_counts]
    n_gen, secs = sum(len(r.tokens) for r in results), sum(r.seconds for r in results)
    return _from_counts(
        len(results), n_drafts, n_dft, n_acc, ci, per_position, per_position_ci, n_gen, secs, confidence
    )


@dataclass
class DraftTotals:
    """One request's totals, as an engine without per-round data reports them."""

    generated: int  # tokens generated
    drafted: int  # draft tokens proposed
    accepted: int  # draft tokens accepted
    seconds: float
    k: int  # draft depth asked for


def metrics_from_totals(totals: Sequence[DraftTotals], confidence: float = 0.95) -> AcceptanceMetrics:
    """Metrics from per-request totals. Rounds are counted from the tokens: every round emits its
    accepted drafts plus one token of the trunk's, after the prompt's first token (exact when every
    round drafts; k = 1: rounds = drafted). Per-position rates need per-round data, except at k = 1
    where position 0 is the acceptance rate itself; the interval uses requests as units."""
    n_acc, n_dft = sum(t.accepted for t in totals), sum(t.drafted for t in totals)
    ks = {t.k for t in totals}
    if ks == {1}:
        rounds = n_dft
    else:
        rounds = sum(max(0, t.generated - 1 - t.accepted) for t in totals)
    per_position, per_position_ci = [], []
    if ks == {1} and n_dft:
        per_position, per_position_ci = [n_acc / n_dft], [wilson(n_acc, n_dft, confidence)]
    ci = ratio_ci([t.accepted for t in totals], [t.drafted for t in totals], confidence)
    n_gen, secs = sum(t.generated for t in totals), sum(t.seconds for t in totals)
    return _from_counts(len(totals), rounds, n_dft, n_acc, ci, per_position, per_position_ci, n_gen, secs, confidence)
