"""Run a recipe: convert once, derive every variant and head file, gate each, write the manifest.

What each job is and how its key is made: :mod:`.plan`; what its file is made of: :mod:`.produce`; the
manifest, sums and card: :mod:`.manifest`; how an artifact is measured and gated: :mod:`mtpq.workflows.gates`.
Parts are also the unit a CI matrix ships around: ``--merge`` turns whatever parts sit in the output folder into the
manifest. Artifacts hold no timestamps, so building
twice gives the same bytes.

An artifact may be a split GGUF (``split_max_size``): its part and the manifest name shard 1 as its ``file``
and list every shard (``shards``: file, bytes, sha256); SHA256SUMS has a line per shard; gates measure the
split files themselves (llama.cpp and the runtime load them from shard 1). A trunk is gated with its head file,
as llama.cpp pairs them (``-m trunk -md mtp-head``; the torch runtime reads the pair the same way).
"""

from __future__ import annotations

import json
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Callable

from ..workflows.gates import Gate, describe, judge, measure, measure_quality
from .bookkeeping import PARTS, files_of, sha256_file, write_json
from .manifest import write_manifest
from .plan import BuildPlan, plan_jobs
from .recipe import Recipe

__all__ = ["build_artifact", "reusable", "run_build", "write_outputs"]


# ----------------------------------------------------------------------------- gates


def _judge_entry(entry: dict, ref_rate: float | None, gate: Gate) -> dict:
    return judge(entry.get("acceptance", {}).get("acceptance_rate"), ref_rate, gate, entry.get("quality"))


# ----------------------------------------------------------------------------- one artifact


def reusable(job: dict, old: dict | None) -> bool:
    """An artifact built before with the same key whose files are all still there, at their sizes."""
    if not old or job["force"] or old.get("build_key") != job["build_key"]:
        return False
    folder = Path(job["out"]).parent
    return all(
        (folder / f["file"]).is_file() and (folder / f["file"]).stat().st_size == f["bytes"] for f in files_of(old)
    )


def _identity(job: dict) -> dict:
    """What the manifest says an artifact is: its kind and form, the -hf tag it answers, its head file."""
    out = {"kind": job["label"], "form": job["form"], "variant": job.get("variant_name")}
    if "tag" in job:
        out["tag"] = job["tag"]
    if job.get("draft_head"):
        out["head"] = Path(job["draft_head"]).name
    if "head_label" in job:
        out["label"] = job["head_label"]
    return out


def build_artifact(job: dict) -> dict:
    """Build (or reuse) one artifact and gate it. Runs in a worker process with --jobs > 1."""
    from .produce import make

    out = Path(job["out"])
    part_path = Path(job["part"])
    old = json.loads(part_path.read_text()) if part_path.is_file() else None
    reused = reusable(job, old)
    if not reused:
        written = make(job)
        files = [{"file": p.name, "bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in written]
        for f in files_of(old) if old else []:  # the previous build's files of this artifact (another layout)
            if f["file"] not in {g["file"] for g in files}:
                (out.parent / f["file"]).unlink(missing_ok=True)
        entry = {
            "file": files[0]["file"],
            **_identity(job),
            "build_key": job["build_key"],
            **({"sha256": files[0]["sha256"]} if len(files) == 1 else {}),
            **describe(written[0]),
            **({"shards": files} if len(files) > 1 else {}),
            **job["options"],
        }
    else:
        entry = {k: v for k, v in old.items() if k not in ("acceptance", "quality", "gate", "gate_key")}
    entry["reused"] = reused
    gate: Gate | None = job["gate"]
    if gate is not None and job["gated"]:
        same_gate = reused and old.get("gate_key") == job["gate_key"]
        if same_gate and "acceptance" in old:
            entry["acceptance"] = old["acceptance"]
        else:  # a split artifact: from its shard 1; a trunk with its head file
            head = Path(job["draft_head"]) if job.get("draft_head") else None
            entry["acceptance"] = measure(out.parent / entry["file"], gate, head)
        if gate.scores_quality and job["kind"] == "variant":  # the trunk against the reference, on gate.text
            if same_gate and "quality" in old:
                entry["quality"] = old["quality"]
            elif job["make"] == "fuse":  # the trunk's bytes, fused with its head: the trunk's figures
                entry["quality"] = json.loads(Path(job["trunk_part"]).read_text())["quality"]
            else:
                entry["quality"] = measure_quality(Path(job["reference"]), out.parent / entry["file"], gate)
        entry["gate_key"] = job["gate_key"]
    write_json(part_path, {k: v for k, v in entry.items() if k != "reused"})
    return entry


# ----------------------------------------------------------------------------- the build


def run_build(
    recipe: Recipe,
    only: list[str] | None = None,
    jobs: int = 1,
    force: bool = False,
    log: Callable[[str], None] = print,
) -> int:
    """Build the recipe; returns the exit code (0 all passed, 1 a gate failed)."""
    from .produce import converted

    # the whole source is checked (cheap: headers, shapes, config, tokenizer) before anything is written,
    # so a bad source leaves no output folder or build-parts cache behind
    converted(recipe)
    recipe.output.mkdir(parents=True, exist_ok=True)
    from ..gguf_io import remove_partial

    for stale in [*recipe.output.glob(".*.partial-*"), *(recipe.output / PARTS).glob(".*.partial-*")]:
        remove_partial(stale)  # left by a build that was killed; never an artifact
    plan = plan_jobs(recipe, only, force)
    entries = _run_stage([plan.reference_head] if plan.reference_head else [], 1, log)
    log(f"reference {Path(plan.reference['out']).name}")
    ref_entry = build_artifact(plan.reference)
    log(f"  {'reused' if ref_entry['reused'] else 'built'}" + _acc(ref_entry))
    ref_file = str(recipe.output / ref_entry["file"])  # what the others read: the reference as written (shard 1)
    for job in plan.jobs:
        if "reference" in job:
            job["reference"] = ref_file
    ref_rate = ref_entry.get("acceptance", {}).get("acceptance_rate")
    entries.append(ref_entry)
    for stage in (plan.heads, plan.variants, plan.fused, plan.extras):
        results = _run_stage(stage, jobs, log)
        for job, entry in zip(stage, results):
            if job["gated"] and job["kind"] == "variant":
                entry["gate"] = _judge_entry(entry, ref_rate, recipe.gate)
                write_json(Path(job["part"]), {k: v for k, v in entry.items() if k != "reused"})
            entries.append(entry)
    failed = [e for e in entries if e.get("gate") and not e["gate"]["passed"]]
    for e in failed:
        log(f"GATE FAILED {e['file']}: {e['gate']['reason']}")
    if not only:
        _remove_unplanned(recipe, plan, log)
        write_outputs(recipe, plan.source)
    else:
        log(f"partial build ({', '.join(only)}): parts in {recipe.output / PARTS}; combine with --merge")
    return 1 if failed else 0


def _run_stage(stage: list[dict], jobs: int, log: Callable[[str], None]) -> list[dict]:
    if jobs > 1 and len(stage) > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            return list(pool.map(build_artifact, stage))
    results = []
    for job in stage:
        log(f"{Path(job['out']).name}")
        results.append(build_artifact(job))
        log(f"  {'reused' if results[-1]['reused'] else 'built'}" + _acc(results[-1]))
    return results


def _remove_unplanned(recipe: Recipe, plan: BuildPlan, log: Callable[[str], None]) -> None:
    """A whole build's parts are this recipe's: a part no job wrote (a variant taken out of the recipe, another
    layout's file) goes, with its files."""
    planned = {Path(j["part"]).name for j in plan.jobs}
    for part in sorted((recipe.output / PARTS).glob("*.json")):
        if part.name in planned or part.name == "source-hashes.json":
            continue
        old = json.loads(part.read_text())
        for f in files_of(old):
            (recipe.output / f["file"]).unlink(missing_ok=True)
        part.unlink()
        log(f"removed {old['file']} (no longer in the recipe)")


def write_outputs(recipe: Recipe, source: dict[str, str] | None = None) -> dict:
    """manifest.json, SHA256SUMS and README.md from the parts in the output folder, every variant judged again
    (a partial build did not know every rate)."""
    return write_manifest(recipe, source, _judge_entry)


def _acc(entry: dict) -> str:
    a = entry.get("acceptance")
    return f", acceptance {a['acceptance_rate']:.3f}" if a else ""
