"""The quality report of ``mtpq compare`` (and of ``mtpq build``'s gates): per file the trunk's figures as
llama-perplexity defines them and the MTP head's acceptance, with gates; JSON, Markdown and a Rich table.

    report = {"reference": {...figures}, "files": [{"file": ..., "ppl": ..., "kld_mean": ...}, ...],
              "ctx_size": 512, "chunks": 40, "engine": {"trunk": "torch", "head": "torch"}, "numerics": "llama.cpp"}
    failures = judge(report["files"], Gates(max_kld=0.05))
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, fields

# key -> (column title, how it prints); fractions print as percents
COLUMNS = {
    "ppl": ("PPL", "{:.4f}"),
    "ppl_ratio": ("PPL ratio", "{:.4f}"),
    "kld_mean": ("mean KLD", "{:.6f}"),
    "kld_median": ("median KLD", "{:.6f}"),
    "kld_p99": ("99% KLD", "{:.6f}"),
    "kld_max": ("max KLD", "{:.4f}"),
    "top1": ("same top", "pct"),
    "dp_rms": ("RMS Δp", "pct"),
    "accept_rate": ("head accept", "pct"),
    "accept_drop": ("accept drop", "pts"),
}


@dataclass(frozen=True)
class Gates:
    """Thresholds a file must meet (None: not checked). KLD in nats, the rest fractions."""

    max_kld: float | None = None  # mean KLD
    min_top1: float | None = None
    max_ppl_ratio: float | None = None
    min_rate: float | None = None  # the head's acceptance
    max_drop: float | None = None  # the head's acceptance below the reference's

    def any(self) -> bool:
        return any(getattr(self, f.name) is not None for f in fields(self))


OPTIONS = {
    "max_kld": "--max-kld",
    "min_top1": "--min-top1",
    "max_ppl_ratio": "--max-ppl-ratio",
    "min_rate": "--min-rate",
    "max_drop": "--max-drop",
}  # the command-line options of the gates

# gate -> (the figure it reads, how a figure passes, the sentence when it does not)
CHECKS = {
    "max_kld": ("kld_mean", operator.le, "mean KLD {v:.6f} above {g}"),
    "min_top1": ("top1", operator.ge, "same top {v:.2%} below {g:.2%}"),
    "max_ppl_ratio": ("ppl_ratio", operator.le, "PPL ratio {v:.4f} above {g}"),
    "min_rate": ("accept_rate", operator.ge, "head acceptance {v:.2%} below {g:.2%}"),
    "max_drop": ("accept_drop", operator.le, "head acceptance {v:.2%} below the reference's (limit {g:.2%})"),
}


def unusable(value) -> str | None:
    """Why ``value`` cannot be judged (missing, NaN, infinite, not a number), or None for a finite number."""
    if value is None:
        return "was not measured"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"is not a number ({value!r})"
    if math.isnan(value):
        return "is NaN (not a number)"
    if math.isinf(value):
        return f"is {'+' if value > 0 else '-'}infinite"
    return None


def judge(files: list[dict], gates: Gates, names: dict[str, str] | None = None) -> dict[str, list[str]]:
    """file -> the gates it fails, each as a sentence; the one place gates are decided (``mtpq accept`` and
    ``mtpq build`` judge through it too). A gated figure that is missing, NaN or infinite fails its gate,
    naming the figure and what is wrong with it (and the file's ``error``, why it was not measured, if any).
    ``names``: how the caller spells each gate (``--max-kld``, ``max_kld``), appended to each sentence."""
    out = {}
    for f in files:
        reasons = []
        for gate, (key, passes, text) in CHECKS.items():
            g = getattr(gates, gate)
            if g is None:
                continue
            spelled = (names or {}).get(gate)
            v = f.get(key)
            problem = unusable(v)
            if problem is not None:
                why = f": {f['error']}" if f.get("error") and v is None else ""
                reasons.append(f"{COLUMNS[key][0]} {problem}{why}: fails {spelled or gate.replace('_', '-')}")
            elif not passes(v, g):
                reasons.append(text.format(v=v, g=g) + (f" ({spelled})" if spelled else ""))
        out[f["file"]] = reasons
    return out


def cell(key: str, value, short: bool = False) -> str:
    if value is None:
        return "—"
    fmt = COLUMNS[key][1]
    if fmt == "pct":
        return f"{100 * value:.1f}%" if short else f"{100 * value:.2f} %"
    if fmt == "pts":
        return f"{100 * value:+.1f}" if short else f"{100 * value:+.2f} pt"
    if short:
        return f"{value:.4f}" if key.startswith("kld") else f"{value:.3f}" if key == "ppl_ratio" else f"{value:.2f}"
    return fmt.format(value)


def _name(path: str) -> str:
    return path.replace("\\", "/").rsplit("/", 1)[-1]


def to_markdown(report: dict, failures: dict[str, list[str]] | None = None) -> str:
    keys = list(COLUMNS)
    head = "| file | size | bits/weight | " + " | ".join(COLUMNS[k][0] for k in keys) + " |"
    lines = [
        f"### Quality against `{_name(report['reference']['file'])}`",
        "",
        f"{report['chunks']} chunks of {report['ctx_size']} tokens (llama-perplexity's chunking); trunk "
        f"measured by {report['engine']['trunk']}, head by {report['engine']['head']}.",
        "",
        head,
        "|" + "---|" * (len(keys) + 3),
    ]
    for f in [report["reference"], *report["files"]]:
        size = f"{f['size_bytes'] / 2**20:,.1f} MiB" if f.get("size_bytes") else "—"
        bpw = f"{f['bits_per_weight']:.2f}" if f.get("bits_per_weight") else "—"
        lines.append(f"| `{_name(f['file'])}` | {size} | {bpw} | " + " | ".join(cell(k, f.get(k)) for k in keys) + " |")
    for file, reasons in (failures or {}).items():
        if reasons:
            lines.append(f"\n**FAIL** `{_name(file)}`: " + "; ".join(reasons))
    return "\n".join(lines) + "\n\n"


# the terminal's columns (80 wide): key -> short title
TABLE = {
    "ppl": "PPL",
    "ppl_ratio": "ratio",
    "kld_mean": "KLD",
    "kld_p99": "KLD 99%",
    "top1": "top1",
    "dp_rms": "RMS Δp",
    "accept_rate": "head",
    "accept_drop": "drop",
}


def rich_table(report: dict):
    """The terminal's table (the figures that fit 80 columns; JSON and Markdown carry all)."""
    from rich.table import Table

    t = Table(
        title=f"Quality against {_name(report['reference']['file'])}  ({report['chunks']} chunks x "
        f"{report['ctx_size']} tokens)"
    )
    t.add_column("file", overflow="fold")
    for title in TABLE.values():
        t.add_column(title, justify="right")
    for f in [report["reference"], *report["files"]]:
        t.add_row(_name(f["file"]), *(cell(k, f.get(k), short=True) for k in TABLE))
    return t
