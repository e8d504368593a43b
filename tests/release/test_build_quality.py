"""``mtpq build`` gates on the trunk's quality too: [gate] text + max_kld / min_top1 / max_ppl_ratio score every
variant against the reference as ``mtpq compare`` does; the figures go into the manifest and the model card."""

from __future__ import annotations

import inspect
import json
import json.decoder
from importlib import resources
from pathlib import Path

import pytest

from tests.helpers.runcli import run_cli

RECIPE = """
[model]
name = "demo"
source = "{source}"
output = "dist"
reference_type = "f16"

[gate]
prompts = "{prompts}"
draft = 1
max_new_tokens = 8
text = "text.txt"
kld_ctx_size = 128
kld_chunks = 6
max_kld = {max_kld}

[[variant]]
name = "Q8_0"
preset = "Q8_0"

[[variant]]
name = "Q2_K"
preset = "Q2_K"
"""


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("buildq")
    (d / "text.txt").write_text(inspect.getsource(json.decoder) * 2)
    (d / "p.jsonl").write_text('{"category": "code", "prompt": "def add(a, b):"}\n')
    return d


def _recipe(work: Path, max_kld: float) -> Path:
    src = Path(str(resources.files("mtpq").joinpath("data/demo")))
    r = work / "r.toml"
    r.write_text(RECIPE.format(source=src, prompts=work / "p.jsonl", max_kld=max_kld))
    return r


def test_max_kld_fails_q2_k_and_passes_q8_0(work):
    res = run_cli("build", _recipe(work, 0.01))
    assert res.exit_code == 1, res.output
    manifest = json.loads((work / "dist" / "manifest.json").read_text())
    by = {f["variant"]: f for f in manifest["files"] if f["kind"] == "variant"}
    q8, q2 = by["Q8_0"], by["Q2_K"]
    assert q8["quality"]["kld_mean"] < 0.01 < q2["quality"]["kld_mean"]
    assert q8["gate"]["passed"] and not q2["gate"]["passed"] and "mean KLD" in q2["gate"]["reason"]
    assert q2["quality"]["chunks"] == 6 and q2["quality"]["top1"] < q8["quality"]["top1"]
    assert manifest["gate"]["text"] == "text.txt" and not manifest["passed"]
    card = (work / "dist" / "README.md").read_text()
    assert "| mean KLD | same top | PPL ratio |" in card and f"{q2['quality']['kld_mean']:.4f}" in card
    # the same figures as mtpq compare on the same files, text and chunks
    res = run_cli(
        "compare",
        work / "dist" / "demo-F16.gguf",
        work / "dist" / "demo-Q2_K.gguf",
        "-f",
        work / "text.txt",
        "-c",
        128,
        "--chunks",
        6,
        "--json",
        "-",
    )
    assert json.loads(res.stdout)["files"][0]["kld_mean"] == pytest.approx(q2["quality"]["kld_mean"], rel=1e-9)


def test_a_looser_gate_reuses_the_files_and_passes(work):
    res = run_cli("build", _recipe(work, 1.0))
    assert res.exit_code == 0, res.output
    assert json.loads((work / "dist" / "manifest.json").read_text())["passed"]


@pytest.mark.parametrize(
    "edit,key",
    [
        (lambda t: t.replace('text = "text.txt"\n', ""), "gate.max_kld"),
        (lambda t: t.replace('text = "text.txt"', 'text = "missing.txt"'), "gate.text"),
        (lambda t: t.replace("kld_ctx_size = 128", "kld_ctx_size = 2"), "gate.kld_ctx_size"),
    ],
)
def test_broken_quality_gates_name_the_key(work, edit, key, tmp_path):
    r = _recipe(work, 0.05)
    bad = work / "bad.toml"
    bad.write_text(edit(r.read_text()))
    res = run_cli("build", bad)
    assert res.exit_code == 2 and key in res.stderr, res.output


def test_an_auto_head_variant_records_its_measured_choice(work, tmp_path):
    """mtp_type = "auto": the variant's head is the narrowest type within auto_max_drop, recorded in the file,
    and the file is the bytes of that explicit mtp_type."""
    from tests.helpers.ggufcheck import read_gguf

    src = Path(str(resources.files("mtpq").joinpath("data/demo")))
    recipe = tmp_path / "auto.toml"
    recipe.write_text(f"""
[model]
name = "demo"
source = "{src}"
output = "dist"
reference_type = "f16"

[[variant]]
name = "Q4_K_M-auto"
preset = "Q4_K_M"
mtp_type = "auto"
auto_max_drop = 1.0
""")
    res = run_cli("build", recipe)
    assert res.exit_code == 0, res.output
    kv, tensors = read_gguf(tmp_path / "dist" / "demo-Q4_K_M-auto.gguf")
    assert json.loads(kv["mtpq.mtp_type_auto"])["mtp_type"] == "q2_k"  # any drop allowed: the narrowest
    direct = tmp_path / "direct.gguf"
    assert (
        run_cli(
            "quantize", tmp_path / "dist" / "demo-F16.gguf", direct, "Q4_K_M", "--mtp-type", "q2_k", "--quiet"
        ).exit_code
        == 0
    )
    _, want = read_gguf(direct)
    assert {n: d.tobytes() for n, (_, d) in tensors.items()} == {n: d.tobytes() for n, (_, d) in want.items()}
