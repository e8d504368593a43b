"""The commands that need the runtime run on each architecture's release-shaped fixture: ``accept --engine torch``,
``compare`` (its head column), ``sweep``, ``quantize --mtp-type auto`` and ``imatrix --mtp``.

The files are the contract's loop models (tests/helpers/runtime.py: the release checkpoints of tests/releases made
"bigram" models, so that their heads draft something right), f32 and one Q4_K_M quant; one prompt, a few tokens.
What the figures mean is held elsewhere (the contract, test_sweep.py, test_compare.py, test_mtp_auto.py); here each
command runs end to end and reports what it measured, on the architecture's own layers.
"""

from __future__ import annotations

import inspect
import json
import json.decoder

import gguf
import pytest

from tests.helpers.runcli import run_cli

ARCHS = ("qwen3next", "nemotron_h_moe")
N_NEW = 16


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """(prompts file, calibration text) shared by the commands."""
    d = tmp_path_factory.mktemp("commands")
    prompts = d / "prompts.jsonl"
    prompts.write_text(json.dumps({"category": "code", "prompt": "def add(a, b):\n    return a + b\n"}) + "\n")
    text = d / "text.txt"
    text.write_text(inspect.getsource(json.decoder))
    return prompts, text


@pytest.fixture(scope="module")
def q4km(rt, tmp_path_factory):
    """arch -> the loop model quantized Q4_K_M (head at q8_0), made once."""
    made = {}

    def get(arch: str):
        if arch not in made:
            out = tmp_path_factory.mktemp(f"q4km-{arch}") / "q4km.gguf"
            res = run_cli("quantize", rt.loop_gguf(arch), out, "Q4_K_M", "--quiet")
            assert res.exit_code == 0, res.output
            made[arch] = out
        return made[arch]

    return get


def accept_report(path, prompts, *args) -> dict:
    res = run_cli("accept", path, "--engine", "torch", "--prompts", prompts, "-n", N_NEW, "--json", "-",
                  "--threads", 1, *args)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


@pytest.mark.parametrize("arch", ARCHS)
def test_accept(arch, rt, inputs):
    report = accept_report(rt.loop_gguf(arch), inputs[0])
    assert report["greedy_outputs_identical"] and report["drafts"] > 0
    assert 0 < report["accepted"] < report["drafted"]  # the bigram head drafts some right, some wrong


@pytest.mark.parametrize("arch", ARCHS)
def test_compare_reports_the_head_column(arch, rt, q4km, inputs, tmp_path):
    out = tmp_path / "r.json"
    res = run_cli("compare", rt.loop_gguf(arch), q4km(arch), "-f", inputs[1], "-c", 64, "--chunks", 2,
                  "--json", out, "--threads", 1)
    assert res.exit_code == 0, res.output
    ref, (quant,) = (doc := json.loads(out.read_text()))["reference"], doc["files"]
    assert ref["kld_mean"] == 0 and quant["kld_mean"] > 0 and 0 < quant["top1"] < 1
    assert 0 < ref["accept_rate"] < 1 and 0 < quant["accept_rate"] < 1
    assert quant["accept_drop"] == pytest.approx(ref["accept_rate"] - quant["accept_rate"])


@pytest.mark.parametrize("arch", ARCHS)
def test_sweep_cell_equals_accept_draft_1(arch, rt, q4km, inputs, tmp_path):
    out = tmp_path / "grid.json"
    res = run_cli("sweep", rt.loop_gguf(arch), "--mtp", "q8_0", "--trunk", "Q4_K_M", "--prompts", inputs[0],
                  "-n", N_NEW, "--json", out, "--threads", 1)
    assert res.exit_code == 0, res.output
    grid = json.loads(out.read_text())
    full = accept_report(q4km(arch), inputs[0], "--draft", 1)  # quantize Q4_K_M: the head at q8_0
    assert grid["acceptance"] == [[pytest.approx(full["acceptance_rate"], abs=1e-6)]]
    assert 0 < grid["reference_rate"] < 1


@pytest.mark.parametrize("arch", ARCHS)
def test_quantize_mtp_type_auto(arch, rt, inputs, tmp_path):
    out = tmp_path / "auto.gguf"
    res = run_cli("quantize", rt.loop_gguf(arch), out, "Q4_K_M", "--mtp-type", "auto", "--max-drop", 0.05,
                  "--prompts", inputs[0])
    assert res.exit_code == 0, res.output
    r = gguf.GGUFReader(out)
    choice = json.loads(r.fields["mtpq.mtp_type_auto"].contents())
    n_trunk = r.fields[f"{arch}.block_count"].contents() - r.fields[f"{arch}.nextn_predict_layers"].contents()
    assert choice["rates"]["f16"]["rate"] > 0
    head = [t for t in r.tensors if t.name.startswith(f"blk.{n_trunk}.") and len(t.shape) >= 2
            and "ffn_gate_inp" not in t.name]
    assert head and {t.tensor_type.name.lower() for t in head} == {choice["mtp_type"]}


@pytest.mark.parametrize("arch", ARCHS)
def test_imatrix_mtp_covers_every_head_matrix(arch, rt, inputs, tmp_path):
    path = rt.loop_gguf(arch)
    out = tmp_path / "im.gguf"
    res = run_cli("imatrix", path, "-f", inputs[1], "-o", out, "-c", 64, "--chunks", 2, "--mtp", "--threads", 1)
    assert res.exit_code == 0, res.output
    model = gguf.GGUFReader(path)
    n_trunk = model.fields[f"{arch}.block_count"].contents() - model.fields[f"{arch}.nextn_predict_layers"].contents()
    matrices = {t.name for t in model.tensors if t.name.startswith(f"blk.{n_trunk}.") and len(t.shape) >= 2}
    entries = {t.name.rsplit(".", 1)[0] for t in gguf.GGUFReader(out).tensors if t.name.endswith(".in_sum2")}
    assert entries == matrices
