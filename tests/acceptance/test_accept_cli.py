"""mtpq accept: its figures against the teacher-forced estimator, the gate's exit codes, reports, bad input.

The model is a tiny GLM whose head is a "copy head" (tests/builders/tiny.py): it drafts
well inside the random trunk's greedy cycles and badly elsewhere, so acceptance
is neither 0 nor 1. Grafting a random head onto the same trunk gives a model whose
acceptance collapses: the gate must catch that.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.builders import tiny
from tests.helpers.runcli import run_cli

PROMPTS = [
    '{"category": "code", "prompt": "def add(a, b):"}',
    '{"category": "code", "prompt": "class Point:"}',
    '{"category": "prose", "prompt": "The quick brown fox"}',
    '{"category": "prose", "prompt": "for i in"}',
]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    w = tmp_path_factory.mktemp("accept")
    (w / "p.jsonl").write_text("\n".join(PROMPTS) + "\n")
    copy = tiny.copy_head(tiny.glm4moe(w / "copy", dtype=torch.float32))
    assert run_cli("convert", copy, w / "good.gguf", "--outtype", "f32", "-q").exit_code == 0
    rnd = tiny.glm4moe(w / "random", dtype=torch.float32)  # same seed: same trunk, a random head
    assert run_cli("convert", rnd, w / "random.gguf", "--outtype", "f32", "-q").exit_code == 0
    res = run_cli("graft", "--mtp-from", w / "random.gguf", "--into", w / "good.gguf", w / "bad.gguf", "--replace")
    assert res.exit_code == 0, res.output
    assert run_cli("convert", copy, w / "trunk.gguf", "--outtype", "f32", "--no-mtp", "-q").exit_code == 0
    return w


def accept_json(*args) -> tuple[int, dict]:
    res = run_cli("accept", *args, "--json", "-")
    assert res.exit_code in (0, 1), res.output
    return res.exit_code, json.loads(res.stdout)


def test_depth1_rate_equals_teacher_forced_estimator(work):
    """k=1 loop figures from the CLI == one batched teacher-forced pass per prompt (a different computation)."""
    from mtpq.runtime.speculative import load_model, run_plain, teacher_forced_acceptance

    _, rep = accept_json(work / "good.gguf", "--prompts", work / "p.jsonl", "-k", "1", "-n", "24")
    model, tok = load_model(work / "good.gguf", device="cpu")
    drafts = accepted = 0
    for line in PROMPTS:
        ids = tok.encode(json.loads(line)["prompt"])
        cont = run_plain(model, ids, 24).tokens
        tf = teacher_forced_acceptance(model, ids + cont, prompt_len=len(ids))
        drafts += tf.loop_drafts
        accepted += tf.loop_accepted
    assert rep["drafts"] == drafts and rep["accepted"] == accepted
    assert 0 < rep["acceptance_rate"] < 1
    assert rep["greedy_outputs_identical"] is True


def test_report_is_consistent_and_per_category(work, tmp_path):
    code, rep = accept_json(work / "good.gguf", "--prompts", work / "p.jsonl", "-k", "3", "-n", "24")
    assert code == 0
    assert rep["acceptance_rate"] == pytest.approx(rep["accepted"] / rep["drafted"], abs=1e-6)
    assert rep["mean_acceptance_length"] == pytest.approx(1 + rep["accepted"] / rep["drafts"], abs=1e-6)
    assert len(rep["per_position"]) == 3 and rep["per_position"] == sorted(rep["per_position"], reverse=True)
    assert rep["ci95"][0] <= rep["acceptance_rate"] <= rep["ci95"][1]
    cats = rep["by_category"]
    assert set(cats) == {"code", "prose"}
    assert sum(c["accepted"] for c in cats.values()) == rep["accepted"]
    assert sum(c["drafted"] for c in cats.values()) == rep["drafted"]
    md = tmp_path / "r.md"
    res = run_cli("accept", work / "good.gguf", "--prompts", work / "p.jsonl", "-k", "3", "-n", "24", "--md", md)
    assert res.exit_code == 0
    text = md.read_text()
    assert "| **overall** |" in text and f"{100 * rep['acceptance_rate']:.1f} %" in text and "PASS" in text


def test_gate_exit_codes(work):
    code, good = accept_json(work / "good.gguf", "--prompts", work / "p.jsonl", "-k", "2", "-n", "24")
    rate = good["acceptance_rate"]
    code, rep = accept_json(
        work / "good.gguf", "--prompts", work / "p.jsonl", "-k", "2", "-n", "24", "--min-rate", f"{rate - 0.01:.4f}"
    )
    assert code == 0 and rep["passed"]
    code, rep = accept_json(
        work / "good.gguf", "--prompts", work / "p.jsonl", "-k", "2", "-n", "24", "--min-rate", f"{rate + 0.01:.4f}"
    )
    assert code == 1 and not rep["passed"] and "min-rate" in rep["reasons"][0]


def test_reference_drop_catches_a_broken_head(work):
    _, good = accept_json(work / "good.gguf", "--prompts", work / "p.jsonl", "-k", "1", "-n", "24")
    limit = good["acceptance_rate"] / 2
    assert limit > 0.02
    code, rep = accept_json(
        work / "bad.gguf",
        "--reference",
        work / "good.gguf",
        "--prompts",
        work / "p.jsonl",
        "-k",
        "1",
        "-n",
        "24",
        "--max-drop",
        f"{limit:.4f}",
    )
    assert code == 1, rep
    assert rep["reference"]["acceptance_rate"] == good["acceptance_rate"]
    assert rep["reference"]["acceptance_rate"] - rep["acceptance_rate"] == pytest.approx(rep["drop"], abs=1e-6)
    assert rep["drop"] > limit and "max-drop" in rep["reasons"][0]
    code, rep = accept_json(
        work / "good.gguf",
        "--reference",
        work / "good.gguf",
        "--prompts",
        work / "p.jsonl",
        "-k",
        "2",
        "-n",
        "24",
        "--max-drop",
        "0.0",
    )
    assert code == 0 and rep["drop"] == 0.0


@pytest.mark.parametrize(
    "args, needle",
    [
        (["missing.gguf"], "missing.gguf"),
        (["{w}/trunk.gguf", "--prompts", "{w}/p.jsonl"], "no MTP head"),
        (["{w}/good.gguf", "--max-drop", "0.1"], "--reference"),
        (["{w}/good.gguf", "--prompts", "{w}/nope.jsonl"], "nope.jsonl"),
        (["{w}/good.gguf", "--draft", "9", "--prompts", "{w}/p.jsonl"], "--draft"),
        (["{w}/p.jsonl"], "p.jsonl"),
    ],
)
def test_bad_input(work, args, needle):
    res = run_cli("accept", *[a.format(w=work) for a in args])
    assert res.exit_code == 2, res.output
    assert needle in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_an_architecture_without_runtime_is_one_line(work):
    """A GGUF the runtime cannot run: exit 2 naming the architecture and the families the runtime has."""
    from mtpq.gguf_io import plan_from_gguf, write_plan
    from mtpq.runtime.families import RUNTIME_FAMILIES

    plan = plan_from_gguf(work / "good.gguf")
    plan.arch = "llama"  # same tensors, an architecture the runtime lacks (it has no MTP graph)
    write_plan(plan, work / "llama.gguf")
    res = run_cli("accept", work / "llama.gguf", "--prompts", work / "p.jsonl")
    assert res.exit_code == 2, res.output
    line = res.stderr.strip()
    assert len(line.splitlines()) == 1 and "llama" in line and "llama.gguf" in line, line
    assert all(arch in line for arch in RUNTIME_FAMILIES), line


def test_demo_table_keeps_file_names_on_80_columns():
    from rich.console import Console

    from mtpq.cli.demo import DEMO_VARIANTS, results_table

    for stem in ("demo", "qwen35"):  # the two bundled demos' file names
        names = [f"{stem}-F16.gguf"] + [f"{stem}-{suffix}.gguf" for suffix, _, _ in DEMO_VARIANTS]
        table = results_table(names, 3, 64)
        cells = ["12.3", "Q4_K/Q6_K", "33.3", "-12.6", "2.00", "yes"]
        for n in names:
            table.add_row(n, *cells)
        con = Console(width=80, record=True, file=open("/dev/null", "w"))
        con.print(table)
        text = con.export_text()
        assert max(len(line) for line in text.splitlines()) <= 80
        for n in names:  # every row on one line, nothing cut
            row = next(line for line in text.splitlines() if n in line)
            assert all(c in row for c in cells), (row, text)
