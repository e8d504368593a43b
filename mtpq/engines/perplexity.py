"""llama.cpp as the trunk-quality engine: ``llama-perplexity --kl-divergence-base`` once on the reference, then
``--kl-divergence`` per quant, read into the figures ``mtpq compare`` reports (no torch here).

For models beyond one device: llama-perplexity offloads (``-ngl``), splits over GPUs and RPC as llama.cpp does.
Its base file holds every scored position's log-probabilities over the whole vocabulary (2 bytes each): it is
written into a private temporary folder and removed afterwards.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..acceptance.quality import COLUMNS
from ..errors import InputError, MeasurementError
from .binaries import child_env, find_binary, reason_from_log

PERPLEXITY_BINARY = "llama-perplexity"

# the closing statistics of --kl-divergence -> our keys, and how each is scaled (llama.cpp prints percents)
_FIELDS = {
    r"Mean PPL\(Q\)\s*:\s*([-\d.eE+naif]+)": ("ppl", 1.0),
    r"Mean PPL\(Q\)/PPL\(base\)\s*:\s*([-\d.eE+naif]+)": ("ppl_ratio", 1.0),
    r"Mean\s+KLD:\s*([-\d.eE+naif]+)": ("kld_mean", 1.0),
    r"Median\s+KLD:\s*([-\d.eE+naif]+)": ("kld_median", 1.0),
    r"99\.0%\s+KLD:\s*([-\d.eE+naif]+)": ("kld_p99", 1.0),
    r"Maximum KLD:\s*([-\d.eE+naif]+)": ("kld_max", 1.0),
    r"Same top p:\s*([-\d.eE+naif]+)": ("top1", 0.01),
    r"RMS Δp\s*:\s*([-\d.eE+naif]+)": ("dp_rms", 0.01),
}


@dataclass
class PerplexityConfig:
    binary: Path
    ctx_size: int = 512
    chunks: int | None = None
    threads: int | None = None
    ngl: int | None = None
    extra: list[str] = field(default_factory=list)

    def args(self, model: Path, text: Path) -> list[str]:
        a = [str(self.binary), "-m", str(model), "-f", str(text), "-c", str(self.ctx_size)]
        for flag, value in (("--chunks", self.chunks), ("-t", self.threads), ("-ngl", self.ngl)):
            if value is not None:
                a += [flag, str(value)]
        return a + list(self.extra)


def find_perplexity(bin_dir: Path | str | None = None) -> Path:
    return find_binary(PERPLEXITY_BINARY, bin_dir)


# llama.cpp logs through a worker thread that nobody joins at exit (common_log_main() is never destroyed), so
# on a loaded machine a run can exit 0 with its last lines -- the closing statistics -- never printed. Seen
# with -t equal to the machine's cores: the compute threads leave the log thread no core. A run whose log
# stops before its statistics is rerun with one thread fewer each time (ggml's CPU figures do not depend on
# the thread count); the log goes to a file, never a pipe that a busy reader could let fill.
_ATTEMPTS = 4


def _run(cmd: list[str], what: Path, complete=lambda log: True) -> str:
    for attempt in range(_ATTEMPTS):
        if attempt:
            cmd = _with_threads(cmd, max(1, _threads_in(cmd) - 1))
        with tempfile.TemporaryFile(mode="w+b") as out:
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_env())
            out.seek(0)
            log = out.read().decode("utf-8", errors="replace")
        if proc.returncode != 0:
            raise InputError(what, f"{Path(cmd[0]).name} failed (exit {proc.returncode}): {reason_from_log(log)}")
        if complete(log) or not _log_cut_short(log):
            return log
    return log


def _threads_in(cmd: list[str]) -> int:
    return int(cmd[cmd.index("-t") + 1]) if "-t" in cmd else (os.cpu_count() or 2)


def _with_threads(cmd: list[str], n: int) -> list[str]:
    if "-t" in cmd:
        i = cmd.index("-t")
        return cmd[: i + 1] + [str(n)] + cmd[i + 2 :]
    return cmd + ["-t", str(n)]


def _log_cut_short(log: str) -> bool:
    """The run scored chunks but its log ends without llama_perf's closing lines (printed after the statistics)."""
    return "over " in log and "chunks" in log and "llama_perf_context_print" not in log


def kld_complete(log: str) -> bool:
    """Every closing statistic of --kl-divergence is in the log (a log cut short can stop between them)."""
    return all(re.search(pattern, log) for pattern in _FIELDS)


def parse_kld_log(log: str, what: Path) -> dict:
    """The closing statistics of ``llama-perplexity --kl-divergence`` (fractions and nats)."""
    out = {}
    for pattern, (key, scale) in _FIELDS.items():
        m = re.search(pattern, log)
        if m is None:
            raise InputError(
                what,
                f"llama-perplexity printed no '{key}' statistics (it prints them only from 100 "
                "scored tokens on: give more text or a larger --ctx-size)",
            )
        out[key] = _finite(m.group(1), key, what) * scale
    return out


def parse_ppl_log(log: str, what: Path) -> float:
    m = re.search(r"Final estimate: PPL = ([-\d.eE+naif]+)", log)
    if m is None:
        raise InputError(what, "llama-perplexity printed no final PPL estimate")
    return _finite(m.group(1), "ppl", what)


def _finite(text: str, key: str, what: Path) -> float:
    """A figure llama-perplexity printed; its ``nan`` or ``inf`` is the engine failing, not a number."""
    try:
        value = float(text)
    except ValueError:
        raise InputError(what, f"llama-perplexity printed {text!r} for {key}, not a number") from None
    if not math.isfinite(value):
        raise MeasurementError(
            what,
            f"llama-perplexity printed {text} for {key} ({COLUMNS[key][0]}): "
            "non-finite logits or probabilities; no figure to judge",
        )
    return value


def kld_with_llama_cpp(
    reference: Path, quants: list[Path], text: Path, cfg: PerplexityConfig, on_file=None
) -> tuple[dict, list[dict], int]:
    """(the reference's figures, each quant's, the chunk count), measured by llama-perplexity on ``text``."""
    from ..gguf_io.files import first_shard

    # llama.cpp loads a split model from shard 1 only (any shard may be given); every set is checked first
    reference, quants = first_shard(reference), [first_shard(q) for q in quants]
    with tempfile.TemporaryDirectory(prefix="mtpq-kld-") as tmp:
        base = Path(tmp) / "base.kld"
        log = _run(
            cfg.args(reference, text) + ["--kl-divergence-base", str(base)],
            reference,
            complete=lambda log: "Final estimate: PPL" in log,
        )
        m = re.search(r"over (\d+) chunks", log)
        n_chunks = int(m.group(1)) if m else 0
        ref = {
            "ppl": parse_ppl_log(log, reference),
            "ppl_ratio": 1.0,
            "kld_mean": 0.0,
            "kld_median": 0.0,
            "kld_p99": 0.0,
            "kld_max": 0.0,
            "top1": 1.0,
            "dp_rms": 0.0,
        }
        if on_file:
            on_file(0)
        out = []
        for i, q in enumerate(quants, 1):
            log = _run(
                cfg.args(q, text) + ["--kl-divergence-base", str(base), "--kl-divergence"], q, complete=kld_complete
            )
            out.append(parse_kld_log(log, q))
            if on_file:
                on_file(i)
    return ref, out, n_chunks
