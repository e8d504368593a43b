"""mtpq build with head files (recipe ``layout = "sidecar"`` / ``"both"``): trunk-only quants plus one
``mtp-NAME-TYPE.gguf`` per head, named so that llama.cpp's -hf selection pairs each trunk with its head; gated on
the pair; a card the Hub parses. The fused one-file quants of layout "both" are the combined layout's files byte
for byte, and every file passes ``mtpq inspect --check``."""

from __future__ import annotations

import hashlib
import json
import re
from importlib import resources
from pathlib import Path

import pytest

from tests.helpers.runcli import run_cli

DEMO = Path(str(resources.files("mtpq").joinpath("data/demo")))  # a trained head: acceptance worth comparing
RECIPE = """
[model]
name = "demo"
source = "{source}"
output = "{output}"
reference_type = "f16"
layout = "{layout}"

[gate]
prompts = "{prompts}"
draft = 1
max_new_tokens = 8
min_rate = 0.05
text = "text.txt"
kld_ctx_size = 64
kld_chunks = 2
max_kld = 10.0

[[variant]]
name = "Q8_0"
preset = "Q8_0"

[[variant]]
name = "Q6_K"
preset = "Q6_K"

[[variant]]
name = "Q2_K"
preset = "Q2_K"
mtp_type = "same"

[publish]
repo = "someone/demo-MTP-GGUF"
base_model = "someone/demo"
quantized_by = "someone"
license = "mit"
"""
TAGS = ("F16", "Q8_0", "Q6_K", "Q2_K")
HEADS = {
    "F16": "mtp-demo-F16.gguf",
    "Q8_0": "mtp-demo-Q8_0.gguf",
    "Q6_K": "mtp-demo-Q8_0.gguf",
    "Q2_K": "mtp-demo-Q2_K.gguf",
}  # "same": a head like its trunk, named for it


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def write(work: Path, layout: str, output: str) -> Path:
    (work / "text.txt").write_text(Path(json.__file__).read_text())
    (work / "p.jsonl").write_text(
        '{"category": "code", "prompt": "def add(a, b):"}\n'
        '{"category": "prose", "prompt": "import os\\nimport sys\\n"}\n'
    )
    r = work / f"{output}.toml"
    r.write_text(RECIPE.format(source=DEMO, output=output, layout=layout, prompts=work / "p.jsonl"))
    return r


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("sidecar")
    for layout in ("both", "combined"):
        res = run_cli("build", write(d, layout, layout))
        assert res.exit_code == 0, res.output
    return d


def manifest(work: Path, layout: str = "both") -> dict:
    return json.loads((work / layout / "manifest.json").read_text())


def test_files_pairs_and_llama_cpp_resolution(work):
    from mtpq.release.layout import resolution_problems

    m = manifest(work)
    names = {f["file"] for f in m["files"]}
    assert names == {f"demo-{t}.gguf" for t in TAGS} | {f"demo-{t}_MTP.gguf" for t in TAGS} | set(HEADS.values())
    trunks = {f["tag"]: f for f in m["files"] if f["form"] == "trunk"}
    assert {t: f["head"] for t, f in trunks.items()} == HEADS
    heads = {f["file"]: f for f in m["files"] if f["kind"] == "head"}
    assert heads["mtp-demo-Q8_0.gguf"]["pairs"] == ["Q6_K", "Q8_0"] and heads["mtp-demo-Q8_0.gguf"][
        "mtp_precision"
    ] == ["Q8_0"]
    assert all(f["mtp_blocks"] == 0 for f in trunks.values()) and all(h["mtp_blocks"] == 1 for h in heads.values())
    pairs = {t: (f"demo-{t}.gguf", h) for t, h in HEADS.items()}
    assert resolution_problems(sorted(names), pairs) == []


def test_fused_files_are_the_combined_layouts(work):
    """The head file's head is the quant's own (q8_0 from the reference; 'same': cut from the quant), and a trunk
    is its quant without the head: fused again, they are the combined build's files byte for byte."""
    for t in TAGS:
        assert sha(work / "both" / f"demo-{t}_MTP.gguf") == sha(work / "combined" / f"demo-{t}.gguf"), t


def test_pairs_are_gated_as_llama_cpp_loads_them(work):
    m = manifest(work)
    by = {(f["tag"], f["form"]): f for f in m["files"] if f["kind"] != "head"}
    combined = {f["tag"]: f for f in manifest(work, "combined")["files"] if f["kind"] in ("reference", "variant")}
    for t in TAGS:
        pair, fused = by[(t, "trunk")], by[(t, "combined")]
        assert pair["acceptance"]["drafted"] > 0
        assert pair["acceptance"] == fused["acceptance"] == combined[t]["acceptance"], t
        if t != "F16":  # the trunk against the reference's: the same figures from the trunk alone
            assert pair["gate"]["passed"] and fused["gate"]["passed"]
            assert pair["quality"] == fused["quality"] == combined[t]["quality"] and pair["quality"]["chunks"] == 2
    assert m["passed"] and m["layout"] == "both"


def test_every_file_passes_inspect_check_but_a_two_bit_head(work):
    """The Q2_K quant with a head "same" as its trunk is what --check exists for: its head is 2-3 bits."""
    files = sorted((work / "both").glob("*.gguf")) + sorted((work / "combined").glob("*.gguf"))
    res = run_cli("inspect", "--check", *files)
    assert res.exit_code == 1, res.output
    lines = res.stdout.splitlines()
    warned = {line.split(": ")[0] for line in lines if ": warning: " in line}
    assert warned == {
        str(work / "both" / "demo-Q2_K_MTP.gguf"),
        str(work / "both" / "mtp-demo-Q2_K.gguf"),
        str(work / "combined" / "demo-Q2_K.gguf"),
    }
    assert {line.split(": ")[0] for line in lines if ": ok (" in line} == set(map(str, files)) - warned
    assert len(lines) == len(files) - len(warned) + 2 * len(warned)  # q2_K and q3_K weights: two lines each


def test_card_parses_and_names_the_pairs(work):
    from huggingface_hub import ModelCard
    from huggingface_hub.utils import validate_repo_id

    text = (work / "both" / "README.md").read_text()
    card = ModelCard(text)
    data = card.data.to_dict()
    assert data["base_model"] == ["someone/demo"] and data["base_model_relation"] == "quantized"
    assert data["quantized_by"] == "someone" and data["license"] == "mit" and {"gguf", "mtp"} <= set(data["tags"])
    for repo in data["base_model"]:
        validate_repo_id(repo)
    assert data["base_model_relation"] in ("adapter", "merge", "quantized", "finetune")  # the Hub's values
    for t, head in HEADS.items():
        assert f"llama-server -hf someone/demo-MTP-GGUF:{t} --spec-type draft-mtp" in text
        assert f"llama-server -m demo-{t}.gguf -md {head} --spec-type draft-mtp" in text
        row = next(line for line in text.splitlines() if line.startswith(f"| {t} |"))
        assert f"`demo-{t}.gguf` + `{head}`" in row and re.search(r"\d+\.\d %", row), row
    combined = (work / "combined" / "README.md").read_text()
    assert "-md" not in combined and "llama-server -hf someone/demo-MTP-GGUF:Q6_K --spec-type draft-mtp" in combined


def test_rebuild_reuses_and_a_layout_change_removes_what_it_replaces(work, tmp_path):
    import shutil

    dist = tmp_path / "both"
    shutil.copytree(work / "both", dist)
    recipe = write(tmp_path, "both", "both")
    res = run_cli("build", recipe)
    assert res.exit_code == 0 and "built" not in res.stderr, res.output
    recipe.write_text(recipe.read_text().replace('layout = "both"', 'layout = "sidecar"'))
    res = run_cli("build", recipe)
    assert res.exit_code == 0 and "built" not in res.stderr, res.output  # the same trunks and heads
    assert not list(dist.glob("*_MTP.gguf")) and "removed demo-Q8_0_MTP.gguf" in res.stderr
    assert {f["file"] for f in json.loads((dist / "manifest.json").read_text())["files"]} == {
        f"demo-{t}.gguf" for t in TAGS
    } | set(HEADS.values())


@pytest.mark.slow
def test_ci_matrix_jobs_merge_into_the_whole_build(glm_ckpt, tmp_path):
    """Each matrix job builds its variant's trunk, its head file and the reference's; the parts merge into the
    manifest of a whole build (a head two jobs built is the same part)."""
    import shutil

    text = f'[model]\nname = "tiny"\nsource = "{glm_ckpt}"\nreference_type = "f16"\nlayout = "both"\n\n' + "".join(
        f'[[variant]]\nname = "{v}"\npreset = "{v}"\n\n' for v in ("Q8_0", "Q4_K_M", "Q5_K_M")
    )
    whole = tmp_path / "whole"
    whole.mkdir()
    (whole / "r.toml").write_text(text)
    assert run_cli("build", whole / "r.toml").exit_code == 0
    merged = tmp_path / "merged"
    merged.mkdir()
    for v in ("Q8_0", "Q4_K_M", "Q5_K_M"):
        job = tmp_path / f"job-{v}"
        job.mkdir()
        (job / "r.toml").write_text(text)
        res = run_cli("build", job / "r.toml", "--variant", v)
        assert res.exit_code == 0, res.output
        shutil.copytree(job / "dist", merged / "dist", dirs_exist_ok=True)
    (merged / "r.toml").write_text(text)
    res = run_cli("build", merged / "r.toml", "--merge")
    assert res.exit_code == 0, res.output
    a, b = (json.loads((d / "dist" / "manifest.json").read_text()) for d in (whole, merged))
    assert a["files"] == b["files"] and len(a["files"]) == 2 * 4 + 2
    assert (whole / "dist" / "README.md").read_text() == (merged / "dist" / "README.md").read_text()
