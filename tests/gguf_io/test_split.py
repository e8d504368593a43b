"""Split GGUFs in and out (issue 24): a model published as ``PREFIX-0000k-of-0000N.gguf`` shards is one model.

- Every command that reads a GGUF, given any shard, reads the whole set and gives what it gives on the merged
  file: the same bytes (quantize, extract-mtp, graft with a split donor and a split target, imatrix), the same
  report (inspect, accept, sweep, compare) -- on shards mtpq wrote and, llama_cpp-marked, on shards
  ``llama-gguf-split`` wrote.
- Split outputs are llama.cpp's: ``llama-gguf-split --split`` of the unsplit output gives our shards byte for
  byte (so ``--merge`` joins them as it joins its own), ``--keep-split`` keeps llama-quantize's layout, and
  llama.cpp loads and drafts from shard 1.
- Broken sets (a missing shard, one of another split or model, duplicated or missing tensors) are in the
  damaged-input corpus (test_damaged_inputs.py); interrupted split writes in test_faults.py.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from mtpq.gguf_io import SPLIT_KEYS, SplitRule, plan_from_gguf, write_plan
from tests.helpers.llamacpp_ref import speculative_simple
from tests.helpers.runcli import run_cli

SPLIT_SIZE = "2M"  # the tiny f16 model (6.9 MiB) in 4 shards


def ok(*args) -> str:
    res = run_cli(*args)
    assert res.exit_code == 0, res.output
    return res.stdout


def shards_of(folder: Path, prefix: str) -> list[Path]:
    return sorted(folder.glob(f"{prefix}-*-of-*.gguf"))


def layout(path: Path) -> tuple[list[tuple], list[tuple], bytes]:
    """(metadata in order, tensor infos (name, type, shape) in order, the tensor data) of one file."""
    r = GGUFReader(path)
    kv = [(k, f.contents()) for k, f in r.fields.items() if not k.startswith("GGUF.")]
    infos = [(t.name, int(t.tensor_type), [int(d) for d in t.shape]) for t in r.tensors]
    return kv, infos, path.read_bytes()[r.data_offset :]


def split_values(path: Path) -> dict:
    fields = GGUFReader(path).fields
    return {k: fields[k].contents() for k in SPLIT_KEYS if k in fields}


@pytest.fixture(scope="module")
def models(glm_ckpt, tmp_path_factory) -> dict[str, Path | list[Path]]:
    """The tiny GLM (f16, MTP block) and its trunk, each whole and in mtpq's shards; text for imatrix/compare."""
    root = tmp_path_factory.mktemp("split")
    full, trunk = root / "full.gguf", root / "trunk.gguf"
    ok("convert", glm_ckpt, full, "--quiet")
    ok("convert", glm_ckpt, trunk, "--no-mtp", "--quiet")
    (root / "sh").mkdir()
    ok("convert", glm_ckpt, root / "sh" / "m.gguf", "--split-max-size", SPLIT_SIZE, "--quiet")
    ok("convert", glm_ckpt, root / "sh" / "t.gguf", "--no-mtp", "--split-max-size", SPLIT_SIZE, "--quiet")
    text = root / "text.txt"
    text.write_text("def add(a, b):\n    return a + b\n\n" * 40)
    return {
        "full": full,
        "trunk": trunk,
        "shards": shards_of(root / "sh", "m"),
        "trunk_shards": shards_of(root / "sh", "t"),
        "text": text,
    }


# ----------------------------------------------------------------------------- what a split file holds


def test_split_output_is_llama_cpps_layout(models):
    """Shard 1 holds every key and then split.no/.tensors.count/.count (llama-gguf-split's order), the others only
    those three; each shard's data stays within the limit; together they hold the unsplit file's tensors,
    in its order, with its bytes (read back by gguf-py, not by us)."""
    shards, full = models["shards"], models["full"]
    n = len(shards)
    assert n == 4 and [p.name for p in shards] == [f"m-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    full_kv, full_infos, _ = layout(full)
    full_data = {t.name: np.asarray(t.data).tobytes() for t in GGUFReader(full).tensors}
    infos = []
    for i, p in enumerate(shards):
        kv, shard_infos, _ = layout(p)
        tail = [("split.no", i), ("split.tensors.count", len(full_infos)), ("split.count", n)]
        assert kv == (full_kv if i == 0 else []) + tail, p.name
        r = GGUFReader(p)
        padded = sum(-(-int(t.n_bytes) // 32) * 32 for t in r.tensors)
        assert padded <= 2_000_000 or len(r.tensors) == 1, p.name
        for t in r.tensors:
            assert np.asarray(t.data).tobytes() == full_data[t.name], t.name
        infos += shard_infos
    assert infos == full_infos


def test_a_model_that_fits_stays_one_file(glm_ckpt, tmp_path):
    """As convert_hf_to_gguf: no shard suffix and no split keys when everything fits in one shard."""
    out = tmp_path / "m.gguf"
    ok("convert", glm_ckpt, out, "--split-max-size", "48G", "--quiet")
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"] and split_values(out) == {}


def test_split_max_tensors(models, tmp_path):
    ok("quantize", models["full"], tmp_path / "q.gguf", "Q8_0", "--split-max-tensors", "20", "-q")
    counts = [len(GGUFReader(p).tensors) for p in shards_of(tmp_path, "q")]
    assert counts == [20, 20, 20, 1]  # 61 tensors


# ----------------------------------------------------------------------------- every command, given a shard

TIMING = {"model", "tokens_per_s", "plain_tokens_per_s", "speedup", "file", "shards", "reference", "files"}


def _without(doc, keys=TIMING):
    if isinstance(doc, dict):
        return {k: _without(v, keys) for k, v in doc.items() if k not in keys}
    if isinstance(doc, list):
        return [_without(v, keys) for v in doc]
    return doc


def _same_results(whole: dict[str, Path], split: dict[str, Path], tmp_path: Path) -> None:
    """Each command on ``split`` (shards) and on ``whole`` (the merged files): same bytes, same reports."""
    outs = {}
    for label, m in (("whole", whole), ("split", split)):
        d = tmp_path / label
        d.mkdir()
        outs[label] = {
            "inspect": json.loads(ok("inspect", m["model"], "--json")),
            "accept": json.loads(ok("accept", m["model"], "--json", "-", "-k", "2", "-n", "8", "--max-prompts", "2")),
            "sweep": (
                ok(
                    "sweep",
                    m["model"],
                    "--mtp",
                    "q8_0",
                    "--trunk",
                    "Q8_0",
                    "-n",
                    "6",
                    "--max-prompts",
                    "1",
                    "--json",
                    d / "sweep.json",
                ),
                json.loads((d / "sweep.json").read_text()),
            )[1],
            "compare": json.loads(
                ok("compare", m["model"], m["model"], "--text", m["text"], "-c", "64", "--chunks", "2", "--json", "-")
            ),
        }
        ok("quantize", m["model"], d / "q.gguf", "Q4_K_M", "-q")
        ok("extract-mtp", m["model"], d / "head.gguf", "-q")
        ok("graft", d / "g.gguf", "--mtp-from", m["model"], "--into", m["trunk"], "--mtp-type", "q8_0", "-q")
        ok("imatrix", m["model"], "--text", m["text"], "-o", d / "im.gguf", "-c", "32", "--chunks", "2")
    a, b = outs["whole"], outs["split"]
    assert len(b["inspect"]["shards"]) > 1 and b["inspect"]["tensor_count"] == a["inspect"]["tensor_count"] == 61
    for cmd in a:
        assert _without(a[cmd]) == _without(b[cmd]), cmd
    assert a["accept"]["drafted"] > 0
    for name in ("q.gguf", "head.gguf", "g.gguf", "im.gguf"):
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "split" / name).read_bytes(), name


def test_every_command_on_a_shard_equals_the_whole_file(models, tmp_path):
    """Given shard 2 (the model) and the last shard (the graft target): the whole set is read."""
    whole = {"model": models["full"], "trunk": models["trunk"], "text": models["text"]}
    split = {"model": models["shards"][1], "trunk": models["trunk_shards"][-1], "text": models["text"]}
    _same_results(whole, split, tmp_path)


@pytest.mark.llama_cpp
def test_every_command_on_llama_gguf_splits_shards(models, tmp_path, llama_cpp_bin):
    """The same on shards llama-gguf-split wrote (by size for the model, by tensor count for the trunk)."""
    split_dir = tmp_path / "in"
    split_dir.mkdir()
    gguf_split(llama_cpp_bin, "--split-max-size", "1M", models["full"], split_dir / "m")
    gguf_split(llama_cpp_bin, "--split-max-tensors", "9", models["trunk"], split_dir / "t")
    shards = shards_of(split_dir, "m")
    assert len(shards) > 3 and len(shards_of(split_dir, "t")) > 3
    whole = {"model": models["full"], "trunk": models["trunk"], "text": models["text"]}
    split = {"model": shards[0], "trunk": shards_of(split_dir, "t")[0], "text": models["text"]}
    _same_results(whole, split, tmp_path)


def test_split_outputs_hold_the_unsplit_outputs_bytes(models, tmp_path):
    """quantize, graft and convert --quant with --split-max-size: read back, the same plan as unsplit; rewritten
    whole, the unsplit file's bytes."""
    runs = {
        "quantize": lambda out, *s: ok("quantize", models["shards"][0], out, "Q4_K_M", "-q", *s),
        "graft": lambda out, *s: ok(
            "graft", out, "--mtp-from", models["shards"][0], "--into", models["trunk"], "--mtp-type", "q8_0", "-q", *s
        ),
    }
    for name, run in runs.items():
        run(tmp_path / f"{name}.gguf")
        run(tmp_path / f"{name}-s.gguf", "--split-max-size", "1M")
        parts = shards_of(tmp_path, f"{name}-s")
        assert len(parts) > 1, name
        write_plan(plan_from_gguf(parts[-1]), tmp_path / f"{name}-merged.gguf")
        assert (tmp_path / f"{name}-merged.gguf").read_bytes() == (tmp_path / f"{name}.gguf").read_bytes(), name


def test_keep_split_keeps_the_inputs_shards(models, tmp_path):
    ok("quantize", models["shards"][2], tmp_path / "q.gguf", "Q4_K_M", "--keep-split", "-q")
    got = shards_of(tmp_path, "q")
    assert len(got) == len(models["shards"])
    for mine, theirs in zip(got, models["shards"]):
        assert [t.name for t in GGUFReader(mine).tensors] == [t.name for t in GGUFReader(theirs).tensors]
    ok("quantize", models["full"], tmp_path / "one.gguf", "Q4_K_M", "--keep-split", "-q")  # unsplit in: one file
    assert (tmp_path / "one.gguf").is_file() and not shards_of(tmp_path, "one")


# ----------------------------------------------------------------------------- against llama.cpp's tools


def gguf_split(bin_dir: Path, *args) -> subprocess.CompletedProcess:
    res = subprocess.run(
        [str(bin_dir / "llama-gguf-split"), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return res


@pytest.mark.llama_cpp
@pytest.mark.parametrize("how", [("--split-max-size", "1M"), ("--split-max-size", "3M"), ("--split-max-tensors", "7")])
def test_llama_gguf_split_cuts_the_unsplit_file_into_our_shards(models, glm_ckpt, tmp_path, llama_cpp_bin, how):
    """llama-gguf-split --split of the unsplit file gives our shards byte for byte: names, metadata, layout."""
    ok("convert", glm_ckpt, tmp_path / "ours.gguf", *how, "--quiet")
    gguf_split(llama_cpp_bin, "--split", *how, models["full"], tmp_path / "theirs")
    ours, theirs = shards_of(tmp_path, "ours"), shards_of(tmp_path, "theirs")
    assert len(ours) == len(theirs) > 1
    for a, b in zip(ours, theirs):
        assert a.name.replace("ours", "theirs") == b.name and a.read_bytes() == b.read_bytes(), a.name


@pytest.mark.llama_cpp
def test_merge_gives_the_unsplit_output(models, tmp_path, llama_cpp_bin):
    """llama-gguf-split --merge of quantize's shards is the unsplit quantize output but for the split keys it adds
    to every file it merges (split.no 0, split.tensors.count, split.count 0, its own --split/--merge round trip
    does the same): every other key in order, every tensor info and every data byte are the unsplit file's;
    and mtpq, which leaves split keys out of what it reads, rewrites the merged file into those exact bytes."""
    ok("quantize", models["full"], tmp_path / "q.gguf", "Q4_K_M", "-q")
    ok("quantize", models["shards"][0], tmp_path / "qs.gguf", "Q4_K_M", "--split-max-size", "1M", "-q")
    parts = shards_of(tmp_path, "qs")
    gguf_split(llama_cpp_bin, "--merge", parts[0], tmp_path / "merged.gguf")
    kv, infos, data = layout(tmp_path / "merged.gguf")
    want_kv, want_infos, want_data = layout(tmp_path / "q.gguf")
    assert kv == want_kv + [("split.no", 0), ("split.tensors.count", len(want_infos)), ("split.count", 0)]
    assert infos == want_infos and data == want_data
    write_plan(plan_from_gguf(tmp_path / "merged.gguf"), tmp_path / "rewritten.gguf")
    assert (tmp_path / "rewritten.gguf").read_bytes() == (tmp_path / "q.gguf").read_bytes()


@pytest.mark.llama_cpp
def test_llama_cpp_loads_and_drafts_from_our_shards(models, tmp_path, llama_cpp_bin):
    """llama-speculative-simple -m shard 1 of a split Q4_K_M (head at q8_0): the same greedy text and draft
    counts as the unsplit file."""
    ok("quantize", models["full"], tmp_path / "q.gguf", "Q4_K_M", "-q")
    ok("quantize", models["shards"][0], tmp_path / "qs.gguf", "Q4_K_M", "--split-max-size", "1M", "-q")
    flags = ["--spec-type", "draft-mtp", "-c", "256", "-t", "1", "--temp", "0", "--no-repack"]
    flags += ["-p", "def add(a, b):", "-n", "12"]
    whole, whole_stats = speculative_simple(llama_cpp_bin, "-m", tmp_path / "q.gguf", *flags)
    parts = shards_of(tmp_path, "qs")
    split, split_stats = speculative_simple(llama_cpp_bin, "-m", parts[0], *flags)
    assert split.stdout == whole.stdout and split_stats == whole_stats and split_stats["n_drafted"] > 0
    parts[1].unlink()  # and it did read the other shards: without one it stops. When it exits on its own, its
    # log names the missing shard; its log is written by a thread it does not wait for, and that thread sometimes
    # crashes it on the way out (SIGSEGV) with the message lost or cut after its timestamp: then only the failure.
    res = subprocess.run(
        [str(llama_cpp_bin / "llama-speculative-simple"), "-m", str(parts[0]), *map(str, flags)],
        capture_output=True,
        text=True,
        errors="replace",
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert res.returncode != 0, res.stderr[-2000:]
    assert res.returncode < 0 or parts[1].name in res.stderr, res.stderr[-2000:]


@pytest.mark.llama_cpp
def test_keep_split_matches_llama_quantize(models, tmp_path, llama_cpp_bin):
    """--keep-split with --mtp-type same on llama-gguf-split's shards: llama-quantize --keep-split's shard count,
    and in each shard its tensors, in its order, with its types and bytes."""
    gguf_split(llama_cpp_bin, "--split-max-size", "1M", models["full"], tmp_path / "in")
    first = shards_of(tmp_path, "in")[0]
    subprocess.run(
        [str(llama_cpp_bin / "llama-quantize"), "--keep-split", first, tmp_path / "ref", "Q4_K_M", "1"],
        check=True,
        capture_output=True,
        stdin=subprocess.DEVNULL,
        timeout=300,
    )
    ok("quantize", first, tmp_path / "ours.gguf", "Q4_K_M", "--mtp-type", "same", "--keep-split", "-q")
    ours, ref = shards_of(tmp_path, "ours"), shards_of(tmp_path, "ref")
    assert len(ours) == len(ref) == len(shards_of(tmp_path, "in"))
    for a, b in zip(ours, ref):
        ra, rb = GGUFReader(a), GGUFReader(b)
        assert split_values(a) == split_values(b)
        assert [t.name for t in ra.tensors] == [t.name for t in rb.tensors], a.name
        for ta, tb in zip(ra.tensors, rb.tensors):
            assert ta.tensor_type == tb.tensor_type and np.array_equal(
                np.asarray(ta.data).view(np.uint8).ravel(), np.asarray(tb.data).view(np.uint8).ravel()
            ), ta.name


@pytest.mark.llama_cpp
def test_the_llama_cpp_engine_is_given_shard_1(models, llama_cpp_bin, monkeypatch):
    """mtpq accept --engine llama.cpp on the last shard: llama-server gets shard 1 (it refuses any other) and
    measures what it measures on the unsplit file."""
    monkeypatch.setenv("MTPQ_LLAMA_CPP_BIN", str(llama_cpp_bin))
    args = ["--engine", "llama.cpp", "--json", "-", "-k", "2", "-n", "8", "--max-prompts", "2"]
    whole = json.loads(ok("accept", models["full"], *args))
    split = json.loads(ok("accept", models["shards"][-1], *args))
    assert whole["drafted"] > 0
    assert {k: whole[k] for k in ("drafted", "accepted", "by_category")} == {
        k: split[k] for k in ("drafted", "accepted", "by_category")
    }


def test_split_rule_cuts_as_llama_gguf_split():
    """The cutting rule alone: a tensor never shares a shard it would overflow; one larger than the limit gets a
    shard of its own (llama-gguf-split refuses that only for the first tensor); never an empty shard."""
    from gguf import GGMLQuantizationType as T

    from mtpq.tensors import Role, TensorSpec

    def spec(i: int, n: int) -> TensorSpec:
        return TensorSpec(f"t{i}", (n // 4,), Role.NORM, T.F32, lambda: None, "src")

    sizes = [400, 10, 600, 80, 4000, 8, 8]
    groups = SplitRule(max_size=1000).groups([spec(i, n) for i, n in enumerate(sizes)])
    assert [[s.name for s in g] for g in groups] == [["t0", "t1"], ["t2", "t3"], ["t4"], ["t5", "t6"]]
    big_first = SplitRule(max_size=100).groups([spec(0, 4000), spec(1, 8)])
    assert [[s.name for s in g] for g in big_first] == [["t0"], ["t1"]]
    assert SplitRule(max_tensors=3).groups([spec(i, 8) for i in range(7)])[-1][0].name == "t6"


@pytest.mark.llama_cpp
def test_the_llama_cpp_engine_refuses_a_broken_set_before_starting(models, tmp_path, llama_cpp_bin, monkeypatch):
    """A missing shard: our one line naming it (exit 2), not llama-server's log, and no server started."""
    import shutil

    monkeypatch.setenv("MTPQ_LLAMA_CPP_BIN", str(llama_cpp_bin))
    for p in models["shards"][:-1]:
        shutil.copy(p, tmp_path / p.name)
    started = []
    import mtpq.engines.llama_cpp as engine

    monkeypatch.setattr(engine.subprocess, "Popen", lambda *a, **k: started.append(a) or pytest.fail("started"))
    res = run_cli("accept", tmp_path / models["shards"][0].name, "--engine", "llama.cpp", "-n", "4")
    missing = tmp_path / models["shards"][-1].name
    assert (
        res.exit_code == 2
        and res.stderr.strip()
        == f"error: {missing}: missing: shard 4 of 4 of the split set {models['shards'][0].name} is in"
    ), res.stderr
    assert not started
