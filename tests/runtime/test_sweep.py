"""``mtpq sweep`` that scales: the trunk quantized once per preset, each head type measured on it, and the grid
equal to what ``mtpq accept --draft 1`` reports for each full file (``quantize --mtp-type T``)."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest

from tests.helpers.runcli import run_cli

HEADS, TRUNKS = ["f16", "q8_0", "q6_k", "q4_k", "q2_k"], ["Q8_0", "Q4_K_M", "Q2_K"]
PROMPTS = ("--prompts", "demo_heldout", "--max-prompts", "4", "-n", "24")


@pytest.fixture(scope="module")
def demo_f16(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sweep") / "demo-f16.gguf"
    src = Path(str(resources.files("mtpq").joinpath("data/demo")))
    assert run_cli("convert", src, out, "--outtype", "f16", "--quiet").exit_code == 0
    return out


@pytest.fixture(scope="module")
def swept(demo_f16, tmp_path_factory):
    """(the sweep's JSON, the plans it wrote: (trunk blocks, MTP blocks) per file)."""
    import mtpq.gguf_io as gguf_io

    written = []
    real = gguf_io.write_plan

    def counting(plan, out, **kw):
        blocks = {int(s.name.split(".")[1]) for s in plan.tensors if s.name.startswith("blk.")}
        written.append((sum(b < plan.n_trunk_layers for b in blocks), sum(b >= plan.n_trunk_layers for b in blocks)))
        return real(plan, out, **kw)

    gguf_io.write_plan = counting
    try:
        path = tmp_path_factory.mktemp("sweep-out") / "grid.json"
        res = run_cli(
            "sweep",
            demo_f16,
            "--mtp",
            ",".join(HEADS),
            "--trunk",
            ",".join(TRUNKS),
            *PROMPTS,
            "--json",
            path,
            "--threads",
            1,
        )
        assert res.exit_code == 0, res.output
    finally:
        gguf_io.write_plan = real
    return json.loads(path.read_text()), written


def test_the_trunk_is_quantized_once_per_preset(swept):
    _, written = swept
    with_trunk = [w for w in written if w[0] > 0]
    head_only = [w for w in written if w[0] == 0]
    assert len(with_trunk) == len(TRUNKS)
    assert len(head_only) == len(TRUNKS) * len(HEADS) + 1 and all(m >= 1 for _, m in head_only)  # + the reference's


# Every cell of the grid costs a quantize and an accept: the default run checks one cell per head type, covering
# every trunk preset too; the slow run checks the other ten.
CELLS = [(i, j) for i in range(len(HEADS)) for j in range(len(TRUNKS))]
SAMPLED = [(i, i % len(TRUNKS)) for i in range(len(HEADS))]


@pytest.mark.parametrize(
    "cells",
    [
        pytest.param(SAMPLED, id="every-head-and-trunk"),
        pytest.param([c for c in CELLS if c not in SAMPLED], id="the-rest", marks=pytest.mark.slow),
    ],
)
def test_the_grid_equals_accept_draft_1_on_each_full_file(swept, demo_f16, tmp_path, cells):
    doc, _ = swept
    assert doc["mtp_types"] == HEADS and doc["trunk_presets"] == TRUNKS
    for i, j in cells:
        m, t = HEADS[i], TRUNKS[j]
        q = tmp_path / f"{t}-{m}.gguf"
        assert run_cli("quantize", demo_f16, q, t, "--mtp-type", m, "--quiet").exit_code == 0
        res = run_cli("accept", q, "--draft", 1, *PROMPTS, "--json", "-", "--threads", 1)
        assert res.exit_code == 0, res.output
        # accept rounds to 6 places
        assert doc["acceptance"][i][j] == pytest.approx(json.loads(res.stdout)["acceptance_rate"], abs=1e-6), (m, t)
        q.unlink()


def test_png_without_matplotlib_exits_2_before_any_work(demo_f16, tmp_path, monkeypatch):
    """Not a warning after minutes of measuring and no picture (exit 0): one line with the install command, and
    nothing quantized or written."""
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError, installed or not
    keep = tmp_path / "keep"
    res = run_cli("sweep", demo_f16, "--png", tmp_path / "grid.png", "--keep", keep, *PROMPTS)
    assert res.exit_code == 2, res.output
    assert res.output.strip() == "error: --png: needs matplotlib, which is not installed: pip install 'mtpq[plot]'"
    assert not keep.exists() and not (tmp_path / "grid.png").exists()
