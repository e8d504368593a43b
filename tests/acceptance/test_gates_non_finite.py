"""No gate passes on a figure that is NaN, infinite or missing (issue 35): compare's, accept's and build's gates are
decided by one judge (mtpq.acceptance.quality.judge), and llama-perplexity's ``nan`` is an engine failure."""

from __future__ import annotations

import math
import stat
from pathlib import Path

import pytest

from mtpq.acceptance.metrics import DraftTotals, metrics_from_totals
from mtpq.acceptance.quality import CHECKS, COLUMNS, Gates, judge
from mtpq.acceptance.report import AcceptReport
from mtpq.acceptance.report import judge as judge_accept
from mtpq.engines.perplexity import _FIELDS, parse_kld_log, parse_ppl_log
from mtpq.errors import MeasurementError
from mtpq.release.recipe import Gate
from mtpq.workflows.gates import judge as judge_build
from tests.helpers.ggufcheck import one_tensor_gguf
from tests.helpers.runcli import run_cli

BAD = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "missing": None}
PROBLEM = {"nan": "NaN", "inf": "+infinite", "-inf": "-infinite", "missing": "not measured"}
# a figure that passes every gate below, per figure
GOOD = {"kld_mean": 0.01, "top1": 0.95, "ppl_ratio": 1.01, "accept_rate": 0.6, "accept_drop": 0.01}
LIMITS = {"max_kld": 0.05, "min_top1": 0.9, "max_ppl_ratio": 1.05, "min_rate": 0.5, "max_drop": 0.05}


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("gate", CHECKS)
def test_every_gate_fails_a_nan_infinite_or_missing_figure(gate, bad):
    key = CHECKS[gate][0]
    row = {"file": "q.gguf", **GOOD, key: BAD[bad]}
    assert judge([{"file": "q.gguf", **GOOD}], Gates(**LIMITS)) == {"q.gguf": []}
    (reason,) = judge([row], Gates(**LIMITS))["q.gguf"]
    assert COLUMNS[key][0] in reason and PROBLEM[bad] in reason and gate.replace("_", "-") in reason


def _report(drafted: int, accepted: int) -> AcceptReport:
    m = metrics_from_totals([DraftTotals(generated=drafted + 4, drafted=drafted, accepted=accepted, seconds=1.0, k=1)])
    return AcceptReport("m.gguf", 1, 0.0, 8, [], m, {}, None, None)


def test_accept_fails_a_nan_rate_and_a_nan_drop():
    nothing = _report(0, 0)  # no drafts: the rate is NaN
    assert math.isnan(nothing.overall.acceptance_rate)
    good = _report(10, 6)
    assert judge_accept(good, good, min_rate=0.5, max_drop=0.05).passed
    v = judge_accept(nothing, None, min_rate=0.5, max_drop=None)
    assert not v.passed and "head accept is NaN" in v.reasons[0] and "--min-rate" in v.reasons[0]
    v = judge_accept(good, nothing, min_rate=None, max_drop=0.05)  # the reference's NaN makes the drop NaN
    assert not v.passed and "accept drop is NaN" in v.reasons[0] and "--max-drop" in v.reasons[0]


@pytest.mark.parametrize(
    "rate,ref_rate,quality,words",
    [
        (None, 0.6, {}, ["head accept", "not measured", "gate.min_rate"]),  # skipped in silence before
        (math.nan, 0.6, {}, ["head accept is NaN", "gate.min_rate"]),
        (0.6, None, {}, ["accept drop", "not measured", "gate.max_drop"]),  # skipped in silence before
        (0.6, math.inf, {}, ["accept drop is +infinite", "gate.max_drop"]),
        (0.6, 0.6, {"kld_mean": math.nan}, ["mean KLD is NaN", "gate.max_kld"]),
        (0.6, 0.6, {"error": "non-finite logits"}, ["mean KLD was not measured: non-finite logits"]),
    ],
)
def test_a_build_gate_fails_a_missing_or_non_finite_figure(rate, ref_rate, quality, words):
    gate = Gate(min_rate=0.5, max_drop=0.05, text="t.txt", max_kld=0.05)
    assert judge_build(0.6, 0.6, gate, {"kld_mean": 0.01})["passed"]
    verdict = judge_build(rate, ref_rate, gate, quality)
    assert not verdict["passed"] and all(w in verdict["reason"] for w in words), verdict


# ----------------------------------------------------------------------------- llama-perplexity's log

# the closing statistics as llama-perplexity prints them (tools/perplexity/perplexity.cpp), all finite
KLD_LOG = """\
Mean PPL(Q)                   :  12.345678 ±   0.123456
Mean PPL(base)                :  12.000000 ±   0.120000
Mean PPL(Q)/PPL(base)         :   1.028806 ±   0.001234
Mean    KLD:   0.012345 ±   0.000123
Maximum KLD:   1.234567
99.0%   KLD:   0.234567
Median  KLD:   0.004567
RMS Δp    :  1.234 ± 0.012 %
Same top p: 95.123 ± 0.123 %
llama_perf_context_print:        load time =      10.00 ms
"""
LINE_OF = {
    "ppl": "Mean PPL(Q)    ",
    "ppl_ratio": "Mean PPL(Q)/PPL(base)",
    "kld_mean": "Mean    KLD",
    "kld_median": "Median  KLD",
    "kld_p99": "99.0%   KLD",
    "kld_max": "Maximum KLD",
    "top1": "Same top p",
    "dp_rms": "RMS Δp",
}


def _with(key: str, printed: str) -> str:
    out = []
    for line in KLD_LOG.splitlines():
        if line.startswith(LINE_OF[key]):
            head, rest = line.split(":", 1)
            line = f"{head}: {printed}" + (" ± nan" if "±" in rest else "")
        out.append(line)
    return "\n".join(out) + "\n"


@pytest.mark.parametrize("printed", ["nan", "-nan", "inf", "-inf"])
@pytest.mark.parametrize("key", [k for _, (k, _) in _FIELDS.items()])
def test_llama_perplexity_printing_nan_is_an_engine_failure(key, printed):
    assert parse_kld_log(KLD_LOG, Path("q.gguf"))["kld_mean"] == pytest.approx(0.012345)
    with pytest.raises(MeasurementError) as e:
        parse_kld_log(_with(key, printed), Path("q.gguf"))
    assert key in e.value.problem and COLUMNS[key][0] in e.value.problem and e.value.where == "q.gguf"


def test_a_reference_ppl_of_nan_is_an_engine_failure():
    assert parse_ppl_log("Final estimate: PPL = 12.3456 +/- 0.12345\n", Path("r.gguf")) == pytest.approx(12.3456)
    with pytest.raises(MeasurementError, match="printed nan for ppl"):
        parse_ppl_log("Final estimate: PPL = nan +/- nan\n", Path("r.gguf"))


def _fake_perplexity(folder: Path, log: str) -> Path:
    """A stand-in llama-perplexity that prints ``log`` (and a llama-server that is never started)."""
    folder.mkdir()
    (folder / "log.txt").write_text(log)
    for name, body in (("llama-perplexity", f'cat "{folder / "log.txt"}"\n'), ("llama-server", "exit 1\n")):
        exe = folder / name
        exe.write_text("#!/bin/sh\n" + body)
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return folder


def test_compare_with_a_nan_from_llama_perplexity_fails_its_gate(tmp_path):
    """The log of a reference run (its PPL) and a quant run whose mean KLD is nan: exit 1, the figure named."""
    model = one_tensor_gguf(tmp_path / "m.gguf")  # never run: the stand-in prints its log whatever it is given
    (tmp_path / "t.txt").write_text("text")
    log = "over 4 chunks\nFinal estimate: PPL = 12.3456 +/- 0.12345\n" + _with("kld_mean", "nan")
    bins = _fake_perplexity(tmp_path / "bin", log)
    res = run_cli(
        "compare",
        model,
        model,
        "-f",
        tmp_path / "t.txt",
        "--engine",
        "llama.cpp",
        "--llama-cpp",
        bins,
        "--max-kld",
        "0.05",
    )
    assert res.exit_code == 1, res.output
    assert "printed nan for kld_mean (mean KLD)" in res.output and len(res.output.strip().splitlines()) == 1
    res = run_cli("compare", model, model, "-f", tmp_path / "t.txt", "--engine", "llama.cpp", "--llama-cpp", bins)
    assert res.exit_code == 2 and "printed nan for kld_mean" in res.output, res.output  # no gate: bad input
