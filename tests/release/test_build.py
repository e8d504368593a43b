"""mtpq build: artifacts, manifest, incremental rebuilds, reproducibility, gate, bad recipes, kill + resume."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from tests.helpers.runcli import run_cli

ROOT = Path(__file__).resolve().parents[2]

RECIPE = """
[model]
name = "tiny"
source = "{source}"
output = "{output}"
reference_type = "f16"
{gate}
[[variant]]
name = "Q8_0"
preset = "Q8_0"

[[variant]]
name = "Q4_K_M"
preset = "Q4_K_M"
mtp_type = "{mtp}"

[extras]
mtp_only = true
"""
GATE = """
[gate]
prompts = "{prompts}"
draft = 2
max_new_tokens = 6
min_rate = {min_rate}
"""


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    p.write_text('{"category": "code", "prompt": "def add(a, b):"}\n{"category": "prose", "prompt": "The quick"}\n')
    return p


def write_recipe(path: Path, source: Path, output: str = "dist", mtp: str = "q8_0", gate: str = "") -> Path:
    path.write_text(RECIPE.format(source=source, output=output, mtp=mtp, gate=gate))
    return path


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def stamps(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in folder.glob("*.gguf")}


@pytest.fixture(scope="module")
def built(glm_ckpt, tmp_path_factory):
    work = tmp_path_factory.mktemp("build")
    recipe = write_recipe(work / "recipe.toml", glm_ckpt)
    res = run_cli("build", recipe)
    assert res.exit_code == 0, res.output
    return work, recipe


def test_all_files_and_manifest(built):
    work, _ = built
    dist = work / "dist"
    names = {"tiny-F16.gguf", "tiny-Q8_0.gguf", "tiny-Q4_K_M.gguf", "tiny-F16-MTP-only.gguf"}
    assert names <= {p.name for p in dist.iterdir()}
    manifest = json.loads((dist / "manifest.json").read_text())
    assert {f["file"] for f in manifest["files"]} == names
    for f in manifest["files"]:  # sha256 and size entries match the files
        assert f["sha256"] == sha(dist / f["file"]) and f["bytes"] == (dist / f["file"]).stat().st_size
    sums = dict(reversed(line.split("  ")) for line in (dist / "SHA256SUMS").read_text().splitlines())
    assert sums == {f["file"]: f["sha256"] for f in manifest["files"]}
    q4 = next(f for f in manifest["files"] if f["file"] == "tiny-Q4_K_M.gguf")
    assert q4["mtp_precision"] == ["Q8_0"] and q4["preset"] == "Q4_K_M"
    assert "Q4_K" in {t for types in q4["types_by_role"].values() for t in types}
    card = (dist / "README.md").read_text()
    assert all(n in card for n in names)


def test_source_hashes_recorded(built, glm_ckpt):
    manifest = json.loads((built[0] / "dist" / "manifest.json").read_text())
    for name, digest in manifest["source"]["files"].items():
        assert digest == sha(glm_ckpt / name)
    assert manifest["recipe_sha256"] == sha(built[1])
    assert "time" not in json.dumps(manifest).lower()  # no timestamps in artifacts


def test_second_build_rebuilds_nothing(built):
    work, recipe = built
    dist = work / "dist"
    before, manifest = stamps(dist), (dist / "manifest.json").read_bytes()
    res = run_cli("build", recipe)
    assert res.exit_code == 0, res.output
    assert "built" not in res.stderr and res.stderr.count("reused") == 4
    assert stamps(dist) == before and (dist / "manifest.json").read_bytes() == manifest


def test_changed_option_rebuilds_only_its_variant(glm_ckpt, tmp_path):
    recipe = write_recipe(tmp_path / "r.toml", glm_ckpt)
    assert run_cli("build", recipe).exit_code == 0
    before = stamps(tmp_path / "dist")
    write_recipe(recipe, glm_ckpt, mtp="f16")
    res = run_cli("build", recipe)
    assert res.exit_code == 0, res.output
    after = stamps(tmp_path / "dist")
    changed = {n for n in before if before[n] != after[n]}
    assert changed == {"tiny-Q4_K_M.gguf"}
    manifest = json.loads((tmp_path / "dist" / "manifest.json").read_text())
    assert next(f for f in manifest["files"] if f["variant"] == "Q4_K_M")["mtp_precision"] == ["F16"]


def test_builds_are_byte_identical(built, glm_ckpt, tmp_path):
    recipe = write_recipe(tmp_path / "recipe.toml", glm_ckpt)  # same recipe text, another folder
    assert run_cli("build", recipe).exit_code == 0
    a, b = built[0] / "dist", tmp_path / "dist"
    for p in a.glob("*.gguf"):
        assert sha(p) == sha(b / p.name), p.name
    ma, mb = json.loads((a / "manifest.json").read_text()), json.loads((b / "manifest.json").read_text())
    assert ma == mb


def test_gate_pass_and_fail(glm_ckpt, tmp_path, prompts):
    recipe = write_recipe(tmp_path / "r.toml", glm_ckpt, gate=GATE.format(prompts=prompts, min_rate=0.0))
    res = run_cli("build", recipe)
    assert res.exit_code == 0, res.output
    manifest = json.loads((tmp_path / "dist" / "manifest.json").read_text())
    gated = [f for f in manifest["files"] if f["kind"] == "variant"]
    assert manifest["passed"] and all(f["gate"]["passed"] for f in gated)
    for f in gated:  # acceptance figures are consistent with each other
        a = f["acceptance"]
        assert a["acceptance_rate"] == pytest.approx(a["accepted"] / a["drafted"], abs=1e-6)
        assert a["mean_acceptance_length"] == pytest.approx(1 + a["accepted"] / a["drafts"], abs=1e-6)
    # a gate nobody can pass: exit 1, every variant still built, the manifest says why
    write_recipe(
        recipe,
        glm_ckpt,
        gate=GATE.format(prompts=prompts, min_rate=1.0).replace("min_rate = 1.0", "min_rate = 1.0\nmax_drop = 0.0"),
    )
    res = run_cli("build", recipe)
    assert res.exit_code == 1, res.output
    manifest = json.loads((tmp_path / "dist" / "manifest.json").read_text())
    assert not manifest["passed"]
    for f in (f for f in manifest["files"] if f["kind"] == "variant"):
        assert not f["gate"]["passed"] and "min_rate" in f["gate"]["reason"]
        assert (tmp_path / "dist" / f["file"]).is_file()
    assert "GATE FAILED" in res.stderr


@pytest.mark.parametrize(
    "edit, key",
    [
        (lambda t: t.replace('preset = "Q4_K_M"', 'preset = "Q9_Z"'), "variant[1].preset"),
        (lambda t: t.replace('name = "tiny"', ""), "model.name"),
        (lambda t: t.replace('mtp_type = "q8_0"', 'mtp_type = "q4_x"'), "variant[1].mtp_type"),
        (lambda t: t.replace("[extras]", "[extras]\nsurprise = 1"), "extras.surprise"),
        (
            lambda t: t.replace('preset = "Q8_0"', 'preset = "Q8_0"\ntensor_types = ["blk.(=q8_0"]'),
            "variant[0].tensor_types[0]",
        ),
        (lambda t: t.replace('reference_type = "f16"', 'reference_type = "q3"'), "model.reference_type"),
        (lambda t: t.replace('[[variant]]\nname = "Q4_K_M"', '[[variant]]\nname = "Q8_0"'), "variant"),
        (lambda t: t + "\n[[[", "TOML"),
    ],
)
def test_broken_recipe_names_the_key(glm_ckpt, tmp_path, edit, key):
    recipe = write_recipe(tmp_path / "r.toml", glm_ckpt)
    recipe.write_text(edit(recipe.read_text()))
    res = run_cli("build", recipe)
    assert res.exit_code == 2, res.output
    line = res.stderr.strip()
    assert "\n" not in line and "r.toml" in line and key in line, line
    assert not (tmp_path / "dist").exists()


def test_variant_subset_and_merge(glm_ckpt, built, tmp_path):
    """A CI matrix: each job builds one variant into its own folder; the parts are merged afterwards."""
    merged = tmp_path / "dist"
    merged.mkdir()
    for v in ("Q8_0", "Q4_K_M"):
        job = tmp_path / f"job-{v}"
        job.mkdir()
        recipe = write_recipe(job / "r.toml", glm_ckpt)
        res = run_cli("build", recipe, "--variant", v)
        assert res.exit_code == 0, res.output
        assert not (job / "dist" / "manifest.json").exists()
        shutil.copytree(job / "dist", merged, dirs_exist_ok=True)  # download-artifact, merge-multiple
    recipe = write_recipe(tmp_path / "r.toml", glm_ckpt)
    res = run_cli("build", recipe, "--merge")
    assert res.exit_code == 0, res.output
    manifest = json.loads((merged / "manifest.json").read_text())
    full = json.loads((built[0] / "dist" / "manifest.json").read_text())
    assert manifest["files"] == [f for f in full["files"] if f["kind"] != "mtp-only"]


def test_killed_build_leaves_no_partial_artifact_and_resumes(glm_ckpt, tmp_path):
    recipe = write_recipe(tmp_path / "r.toml", glm_ckpt)
    dist = tmp_path / "dist"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mtpq.cli", "build", str(recipe)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 240
    while time.time() < deadline and not list(dist.glob(".tiny-Q4_K_M.gguf.partial-*")):
        time.sleep(0.05)
    assert list(dist.glob(".tiny-Q4_K_M.gguf.partial-*")), "the build never reached the Q4_K_M variant"
    proc.send_signal(signal.SIGKILL)  # no chance to clean up
    proc.wait()
    assert not (dist / "tiny-Q4_K_M.gguf").exists()
    assert not (dist / "manifest.json").exists()
    q8_stamp = (dist / "tiny-Q8_0.gguf").stat().st_mtime_ns
    res = run_cli("build", recipe)
    assert res.exit_code == 0, res.output
    assert (dist / "tiny-Q4_K_M.gguf").is_file() and not list(dist.glob(".*.partial-*"))
    assert (dist / "tiny-Q8_0.gguf").stat().st_mtime_ns == q8_stamp  # resumed, not redone


def _synthetic_imatrix(ckpt: Path, out: Path, seed: int) -> Path:
    """Importance data for every weight of the reference GGUF (random positive, seeded)."""
    import numpy as np
    from gguf import GGMLQuantizationType as T

    from mtpq.convert import plan_checkpoint
    from mtpq.quantize.imatrix import Entry, Imatrix, write_imatrix

    rng = np.random.default_rng(seed)
    entries = {}
    for s in plan_checkpoint(ckpt, outtype=T.F16).tensors:
        if len(s.shape) >= 2 and s.name.endswith("weight"):
            n_mat = s.shape[0] if len(s.shape) == 3 else 1
            entries[s.name] = Entry(
                rng.random((n_mat, s.shape[-1]), dtype=np.float32) + 0.01, np.ones(n_mat, dtype=np.float32)
            )
    write_imatrix(Imatrix(dict(sorted(entries.items())), datasets=["synthetic"], chunk_count=1, chunk_size=1), out)
    return out


def test_variant_with_imatrix_records_it_and_rebuilds_when_it_changes(glm_ckpt, tmp_path):
    imf = _synthetic_imatrix(glm_ckpt, tmp_path / "tiny.imatrix.gguf", seed=1)
    recipe = write_recipe(tmp_path / "r.toml", glm_ckpt)
    recipe.write_text(
        recipe.read_text().replace('mtp_type = "q8_0"', 'mtp_type = "q8_0"\nimatrix = "tiny.imatrix.gguf"')
    )
    res = run_cli("build", recipe)
    assert res.exit_code == 0, res.output
    dist = tmp_path / "dist"
    manifest = json.loads((dist / "manifest.json").read_text())
    entry = next(f for f in manifest["files"] if f["variant"] == "Q4_K_M")
    assert entry["imatrix"] == "tiny.imatrix.gguf" and entry["imatrix_sha256"] == sha(imf)
    assert "imatrix" not in next(f for f in manifest["files"] if f["variant"] == "Q8_0")
    # the variant equals mtpq quantize --imatrix of the reference
    ref = dist / "tiny-F16.gguf"
    direct = tmp_path / "direct.gguf"
    assert run_cli("quantize", ref, direct, "Q4_K_M", "--imatrix", imf, "-q").exit_code == 0
    assert sha(direct) == sha(dist / "tiny-Q4_K_M.gguf")
    before = stamps(dist)
    _synthetic_imatrix(glm_ckpt, imf, seed=2)  # new importance data: only that variant is rebuilt
    assert run_cli("build", recipe).exit_code == 0
    after = stamps(dist)
    assert {n for n in before if before[n] != after[n]} == {"tiny-Q4_K_M.gguf"}


@pytest.mark.parametrize(
    "extra, key, says",
    [
        ('imatrix = "missing.imatrix.gguf"', "variant[1].imatrix", "cannot read imatrix file"),
        ('imatrix = "r.toml"', "variant[1].imatrix", "not an imatrix"),
        ('exclude_weights = ["ffn"]', "variant[1].exclude_weights", "needs imatrix"),
    ],
)
def test_broken_imatrix_keys_name_the_key(glm_ckpt, tmp_path, extra, key, says):
    recipe = write_recipe(tmp_path / "r.toml", glm_ckpt)
    recipe.write_text(recipe.read_text().replace('mtp_type = "q8_0"', f'mtp_type = "q8_0"\n{extra}'))
    res = run_cli("build", recipe)
    assert res.exit_code == 2, res.output
    line = res.stderr.strip()
    assert "\n" not in line and key in line and says in line, line
    assert not (tmp_path / "dist").exists()


GRAFT_RECIPE = """
[model]
name = "tiny"
source = "{source}"
reference_type = "f16"

[[variant]]
name = "published-mtp-q8"
preset = "Q4_K_M"
graft_into = "{target}"
mtp_type = "q8_0"

[[variant]]
name = "published-mtp-keep"
preset = "Q4_K_M"
graft_into = "{target}"
mtp_type = "keep"
"""


def test_graft_into_variants(glm_ckpt, tmp_path):
    """Regression: a graft_into variant once handed the string 'q8_0' to plan_graft and died in a traceback."""
    from tests.helpers.ggufcheck import read_gguf

    target = tmp_path / "published-Q4_K_M.gguf"  # a published quant without a head
    assert run_cli("convert", glm_ckpt, target, "--no-mtp", "--quant", "Q4_K_M", "--quiet").exit_code == 0
    recipe = tmp_path / "r.toml"
    recipe.write_text(GRAFT_RECIPE.format(source=glm_ckpt, target=target.name))
    res = run_cli("build", recipe)
    assert res.exit_code == 0, res.output
    dist = tmp_path / "dist"
    _, ref = read_gguf(dist / "tiny-F16.gguf")
    _, trunk = read_gguf(target)
    n_trunk = 2
    for variant, head_type in (("published-mtp-q8", T.Q8_0), ("published-mtp-keep", None)):
        _, got = read_gguf(dist / f"tiny-{variant}.gguf")
        head = {n for n in got if n.startswith(f"blk.{n_trunk}.")}
        assert head == {n for n in ref if n.startswith(f"blk.{n_trunk}.")}, variant
        for name in set(got) - head:  # the target's tensors are copied byte for byte
            assert got[name][0] == trunk[name][0] and np.array_equal(got[name][1], trunk[name][1]), name
        for name in head:
            qtype, data = got[name]
            if head_type is None or ref[name][0] == T.F32:  # keep, and 1-D / router tensors: the reference's bytes
                assert qtype == ref[name][0] and np.array_equal(data, ref[name][1]), name
            else:
                assert qtype == head_type, name
    manifest = json.loads((dist / "manifest.json").read_text())
    by_variant = {f["variant"]: f for f in manifest["files"]}
    assert by_variant["published-mtp-q8"]["mtp_type"] == "q8_0"
    assert by_variant["published-mtp-q8"]["mtp_precision"] == ["Q8_0"]
    assert by_variant["published-mtp-keep"]["mtp_type"] == "keep"


@pytest.mark.parametrize(
    "mtp, key, says",
    [
        ("same", "variant[1].mtp_type", "not accepted here"),  # graft has no trunk rule to follow
        ("q9_9", "variant[1].mtp_type", "unknown"),
    ],
)
def test_graft_into_refuses_what_graft_cannot_do(glm_ckpt, tmp_path, mtp, key, says):
    target = tmp_path / "t.gguf"
    target.write_bytes(b"")  # never read: the recipe is refused first
    recipe = tmp_path / "r.toml"
    recipe.write_text(GRAFT_RECIPE.format(source=glm_ckpt, target=target.name).replace('"keep"', f'"{mtp}"'))
    res = run_cli("build", recipe)
    assert res.exit_code == 2, res.output
    line = res.stderr.strip()
    assert "\n" not in line and key in line and says in line, line
    assert not (tmp_path / "dist").exists()


def test_split_artifacts(glm_ckpt, tmp_path, prompts):
    """split_max_size (the recipe's, a variant's own): the artifacts are llama.cpp shards holding the unsplit
    build's bytes; the parts and the manifest list each shard (bytes, sha256), SHA256SUMS has a line per shard,
    the card names shard 1; the gate measures the split files (the whole build's figures); an unchanged build is
    reused, and one with another size removes the shards it replaces."""
    from mtpq.gguf_io import plan_from_gguf, write_plan

    gate = GATE.format(prompts=prompts, min_rate=0.0)
    whole = write_recipe(tmp_path / "whole.toml", glm_ckpt, output="whole", gate=gate)
    assert run_cli("build", whole).exit_code == 0
    text = RECIPE.format(source=glm_ckpt, output="split", mtp="q8_0", gate=gate)
    text = text.replace('reference_type = "f16"', 'reference_type = "f16"\nsplit_max_size = "2M"')
    recipe = tmp_path / "split.toml"
    recipe.write_text(text.replace('preset = "Q8_0"', 'preset = "Q8_0"\nsplit_max_size = 1000000'))
    res = run_cli("build", recipe)
    assert res.exit_code == 0, res.output
    dist, ref = tmp_path / "split", tmp_path / "whole"
    manifest = json.loads((dist / "manifest.json").read_text())
    by_file = {f["file"]: f for f in manifest["files"]}
    assert set(by_file) == {
        "tiny-F16-00001-of-00004.gguf",
        "tiny-Q8_0-00001-of-00005.gguf",
        "tiny-Q4_K_M-00001-of-00002.gguf",
        "tiny-F16-MTP-only-00001-of-00002.gguf",
    }
    sums = dict(reversed(line.split("  ")) for line in (dist / "SHA256SUMS").read_text().splitlines())
    assert set(sums) == {p.name for p in dist.glob("*.gguf")}
    whole_manifest = {
        f["kind"] + str(f["variant"]): f for f in json.loads((ref / "manifest.json").read_text())["files"]
    }
    for name, f in by_file.items():
        shards = sorted(dist.glob(name.replace("00001-of", "*-of")))
        assert [s["file"] for s in f["shards"]] == [p.name for p in shards] and len(shards) > 1
        for s, p in zip(f["shards"], shards):
            assert s["bytes"] == p.stat().st_size and s["sha256"] == sha(p) == sums[p.name]
        assert f["bytes"] == sum(p.stat().st_size for p in shards)
        w = whole_manifest[f["kind"] + str(f["variant"])]
        write_plan(plan_from_gguf(shards[-1]), tmp_path / "rewritten.gguf")
        assert sha(tmp_path / "rewritten.gguf") == w["sha256"], name  # the unsplit build's bytes
        assert f.get("acceptance") == w.get("acceptance"), name  # measured on the shards: the same figures
    assert "acceptance" in by_file["tiny-Q4_K_M-00001-of-00002.gguf"]
    assert by_file["tiny-Q8_0-00001-of-00005.gguf"]["split_max_size"] == 1_000_000
    card = (dist / "README.md").read_text()
    assert "`tiny-Q4_K_M-00001-of-00002.gguf` + 1 more shards" in card and "-m tiny-F16-00001-of-00004.gguf" in card

    before = stamps(dist)
    res = run_cli("build", recipe, "--dry-run")
    assert res.exit_code == 0 and "build" not in res.stderr.replace("tiny", ""), res.stderr
    assert run_cli("build", recipe).exit_code == 0 and stamps(dist) == before
    recipe.write_text(text)  # Q8_0 back to the recipe's 2M: fewer shards, the 4 it had removed
    assert run_cli("build", recipe).exit_code == 0
    q8 = next(f for f in json.loads((dist / "manifest.json").read_text())["files"] if f["variant"] == "Q8_0")
    assert sorted(p.name for p in dist.glob("tiny-Q8_0*")) == [s["file"] for s in q8["shards"]]
    assert q8["file"] == "tiny-Q8_0-00001-of-00003.gguf"
    assert {n: t for n, t in stamps(dist).items() if "Q8_0" not in n} == {
        n: t for n, t in before.items() if "Q8_0" not in n
    }


def test_examples_are_what_the_readme_says():
    """The example recipes load; the workflow builds the big-model recipe on a self-hosted runner, gates through
    llama.cpp with every layer offloaded, keeps files under Hugging Face's 50 GB, lays quants and head files out
    for llama.cpp's -hf, checks them and publishes with mtpq publish."""
    from mtpq.release import load_recipe

    yaml = pytest.importorskip("yaml")
    small = load_recipe(ROOT / "examples" / "recipe.toml")
    assert small.split_max_size == 48 * 10**9 and small.layout == "both"
    flow = yaml.safe_load((ROOT / "examples" / "github-actions.yml").read_text())
    recipe = load_recipe(ROOT / flow["env"]["RECIPE"], check_inputs=False)
    assert recipe.gate.engine == "llama.cpp" and recipe.gate.ngl == 999 and recipe.split_max_size <= 48 * 10**9
    assert recipe.layout == "sidecar" and recipe.publish.repo == flow["env"]["HF_REPO"]
    job = flow["jobs"]["build"]
    assert "self-hosted" in job["runs-on"]
    steps = " ".join(s.get("run", "") for s in job["steps"])
    assert 'mtpq build "$RECIPE"' in steps and "sha256sum -c" in steps and "mtpq inspect --check" in steps
    assert 'mtpq publish "$DIST" --repo "$HF_REPO"' in steps and "huggingface-cli" not in steps
