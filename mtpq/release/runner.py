"""Run a recipe: convert once, derive every variant, gate each, write the manifest.

Incremental by content: every artifact has a build key (a hash of everything
that decides its bytes: tool version, source file hashes, options, the
reference's key). A part file per artifact (``build-parts/NAME.json``) records
the key, the file's sha256 and its gate result; an artifact whose key and file
are unchanged is not rebuilt. Parts are also the unit a CI matrix ships around:
``--merge`` turns whatever parts sit in the output folder into the manifest.
Artifacts hold no timestamps, so building twice gives the same bytes.

An artifact may be a split GGUF (``split_max_size``): its part and the manifest name shard 1 as its ``file``
and list every shard (``shards``: file, bytes, sha256); SHA256SUMS has a line per shard; gates measure the
split files themselves (llama.cpp and the runtime load them from shard 1).
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from .. import __version__
from ..errors import InputError
from .recipe import Gate, Recipe, Variant

PARTS = "build-parts"
TOOL = f"mtpq {__version__}"


# ----------------------------------------------------------------------------- hashing


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def sha256_model(path: Path) -> str:
    """sha256 of a GGUF model's bytes: its file's, or for a split set (any shard given) the hash of its shards'."""
    from ..gguf_io import shard_paths

    paths = shard_paths(path)
    return sha256_file(path) if len(paths) == 1 else key_of([sha256_file(p) for p in paths])


def key_of(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def source_hashes(recipe: Recipe, write_cache: bool = True) -> dict[str, str]:
    """sha256 of every file of the source checkpoint, cached by (size, mtime) in the output folder
    (``write_cache=False``: --dry-run, which writes nothing)."""
    cache_path = recipe.output / PARTS / "source-hashes.json"
    cache = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    out, fresh = {}, {}
    for f in sorted(p for p in recipe.source.iterdir() if p.is_file() and not p.name.startswith(".")):
        st = f.stat()
        stamp = f"{st.st_size}:{st.st_mtime_ns}"
        hit = cache.get(f.name)
        digest = hit["sha256"] if hit and hit["stamp"] == stamp else sha256_file(f)
        out[f.name] = digest
        fresh[f.name] = {"stamp": stamp, "sha256": digest}
    if write_cache:
        write_json(cache_path, fresh)
    return out


def write_json(path: Path, data) -> None:
    """Deterministic JSON, written atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- artifacts


def describe(path: Path) -> dict:
    """Per-role type table, MTP precision and size (all shards) of a GGUF (from :func:`~mtpq.gguf_io.summary.summarize_gguf`)."""
    from ..gguf_io.summary import summarize_gguf

    info = summarize_gguf(path)
    by_role: dict[str, dict[str, int]] = {}
    for t in info["tensors"]:
        by_role.setdefault(t["role"], {}).setdefault(t["type"], 0)
        by_role[t["role"]][t["type"]] += 1
    return {"bytes": sum(s["bytes"] for s in info["shards"]), "bits_per_weight": info["bits_per_weight"],
            "types_by_role": by_role, "mtp_precision": info["mtp_types"], "mtp_blocks": len(info["mtp_blocks"])}


def files_of(entry: dict) -> list[dict]:
    """The files of an artifact's part or manifest entry: each shard of a split one, else its one file."""
    return entry.get("shards") or [{"file": entry["file"], "bytes": entry["bytes"], "sha256": entry["sha256"]}]


def _write(plan, out: Path, split_max_size: int) -> list[Path]:
    from ..gguf_io import SplitRule, write_plan

    return write_plan(plan, out, split=SplitRule(max_size=split_max_size))


def _produce_reference(recipe: Recipe, out: Path, split_max_size: int) -> list[Path]:
    from ..convert import OUTTYPES, plan_checkpoint

    return _write(plan_checkpoint(recipe.source, outtype=OUTTYPES[recipe.reference_type]), out, split_max_size)


def _produce_extra(recipe: Recipe, mode: str, out: Path, split_max_size: int) -> list[Path]:
    from ..convert import OUTTYPES, BlockSelection, plan_checkpoint

    plan = plan_checkpoint(recipe.source, mtp=BlockSelection(mode), outtype=OUTTYPES[recipe.reference_type])
    return _write(plan, out, split_max_size)


def _produce_variant(reference: Path, v: Variant, out: Path, split_max_size: int, prompts: str = "builtin") -> list[Path]:
    from ..gguf_io import plan_from_gguf
    from ..quantize.pipeline import plan_quantize

    ref = plan_from_gguf(reference)
    if v.graft_into is not None:
        from ..quantize.surgery import plan_graft

        plan = plan_graft(ref, plan_from_gguf(v.graft_into), mtp_type=v.mtp_type)
    else:
        from ..quantize.imatrix import read_imatrix

        options = dict(mtp_experts_type=v.mtp_experts_type, tensor_types=list(v.tensor_types))
        extra = dict(imatrix=read_imatrix(v.imatrix) if v.imatrix is not None else None,
                     include_weights=list(v.include_weights), exclude_weights=list(v.exclude_weights))
        plan = plan_quantize(ref, v.preset, mtp_type=v.mtp_type, **options, **extra)
        if v.auto_max_drop is not None:  # mtp_type = "auto": measured on the quantized trunk, then grafted in
            from ..gguf_io import SplitRule
            from ..runtime.auto_head import quantize_with_auto_head

            _, written = quantize_with_auto_head(reference, out, ref, plan, v.preset, v.auto_max_drop, prompts,
                                                 options, extra, split=SplitRule(max_size=split_max_size))
            return written
    return _write(plan, out, split_max_size)


def measure(path: Path, gate: Gate) -> dict:
    """Greedy acceptance figures of one GGUF on the gate's prompts (deterministic: no timings)."""
    kw = dict(prompts=gate.prompts, draft=gate.draft, max_new_tokens=gate.max_new_tokens, temperature=gate.temperature,
              max_prompts=gate.max_prompts)
    if gate.engine == "llama.cpp":
        from ..engines.llama_cpp import ServerConfig, find_server, measure_with_llama_cpp

        cfg = ServerConfig(find_server(gate.llama_cpp), ngl=gate.ngl, ctx_size=gate.ctx_size, threads=gate.threads,
                           rpc=gate.rpc, extra=list(gate.server_args))
        report = measure_with_llama_cpp(path, **kw, server=cfg)
    else:
        from ..runtime.accept import measure_file

        report = measure_file(path, **kw, threads=gate.threads)
    return {**report.deterministic_summary(), "engine": report.engine}


def measure_quality(reference: Path, path: Path, gate: Gate) -> dict:
    """The trunk's figures against the reference on gate.text (mtpq compare's), deterministic: no timings."""
    if gate.engine == "llama.cpp":
        from ..engines.perplexity import PerplexityConfig, find_perplexity, kld_with_llama_cpp

        cfg = PerplexityConfig(find_perplexity(gate.llama_cpp), ctx_size=gate.kld_ctx_size, chunks=gate.kld_chunks,
                               threads=gate.threads, ngl=gate.ngl)
        _, (figures,), chunks = kld_with_llama_cpp(reference, [path], Path(gate.text), cfg)
        return {**figures, "chunks": chunks, "ctx_size": gate.kld_ctx_size, "engine": "llama.cpp"}
    from ..runtime.accept import use_threads
    from ..runtime.quality import QualityRun, compare_runs

    use_threads(path, gate.threads)
    ref, q = QualityRun(reference), QualityRun(path)
    chunks = compare_runs(ref, [q], Path(gate.text).read_text(), n_ctx=gate.kld_ctx_size, n_chunks=gate.kld_chunks)
    keep = ("ppl", "ppl_ratio", "kld_mean", "kld_median", "kld_p99", "kld_max", "top1", "dp_rms")
    return {**{k: v for k, v in q.quality.summary(ref.quality).items() if k in keep}, "chunks": chunks,
            "ctx_size": gate.kld_ctx_size, "engine": "torch"}


def judge(rate: float | None, ref_rate: float | None, gate: Gate, quality: dict | None = None) -> dict:
    """The gate's verdict (:func:`mtpq.acceptance.quality.judge`): a gated figure that is missing or not finite
    fails, as one below its limit does."""
    from ..acceptance.quality import CHECKS, Gates
    from ..acceptance.quality import judge as judge_figures

    drop = ref_rate - rate if rate is not None and ref_rate is not None else None
    row = {**(quality or {}), "file": "", "accept_rate": rate, "accept_drop": drop}
    gates = Gates(max_kld=gate.max_kld, min_top1=gate.min_top1, max_ppl_ratio=gate.max_ppl_ratio,
                  min_rate=gate.min_rate, max_drop=gate.max_drop)
    reasons = judge_figures([row], gates, {g: f"gate.{g}" for g in CHECKS})[""]
    return {"passed": not reasons, "reason": "; ".join(reasons) or "ok"}


def _judge_entry(entry: dict, ref_rate: float | None, gate: Gate) -> dict:
    return judge(entry.get("acceptance", {}).get("acceptance_rate"), ref_rate, gate, entry.get("quality"))


# ----------------------------------------------------------------------------- one artifact


def reusable(job: dict, old: dict | None) -> bool:
    """An artifact built before with the same key whose files are all still there, at their sizes."""
    if not old or job["force"] or old.get("build_key") != job["build_key"]:
        return False
    folder = Path(job["out"]).parent
    return all((folder / f["file"]).is_file() and (folder / f["file"]).stat().st_size == f["bytes"]
               for f in files_of(old))


def build_artifact(job: dict) -> dict:
    """Build (or reuse) one artifact and gate it. Runs in a worker process with --jobs > 1."""
    out = Path(job["out"])
    part_path = Path(job["part"])
    old = json.loads(part_path.read_text()) if part_path.is_file() else None
    reused = reusable(job, old)
    if not reused:
        kind, split = job["kind"], job["split_max_size"]
        if kind == "reference":
            written = _produce_reference(job["recipe"], out, split)
        elif kind in ("only", "drop"):
            written = _produce_extra(job["recipe"], kind, out, split)
        else:
            gate = job["recipe"].gate if job.get("recipe") else None
            written = _produce_variant(Path(job["reference"]), job["variant"], out, split,
                                       gate.prompts if gate else "builtin")
        files = [{"file": p.name, "bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in written]
        for f in files_of(old) if old else []:  # the previous build's files of this artifact (another layout)
            if f["file"] not in {g["file"] for g in files}:
                (out.parent / f["file"]).unlink(missing_ok=True)
        entry = {"file": files[0]["file"], "kind": job["label"], "variant": job.get("variant_name"),
                 "build_key": job["build_key"], **({"sha256": files[0]["sha256"]} if len(files) == 1 else {}),
                 **describe(written[0]), **({"shards": files} if len(files) > 1 else {}), **job["options"]}
    else:
        entry = {k: v for k, v in old.items() if k not in ("acceptance", "quality", "gate", "gate_key")}
    entry["reused"] = reused
    gate: Gate | None = job["gate"]
    if gate is not None and job["gated"]:
        same_gate = reused and old.get("gate_key") == job["gate_key"]
        if same_gate and "acceptance" in old:
            entry["acceptance"] = old["acceptance"]
        else:
            entry["acceptance"] = measure(out.parent / entry["file"], gate)  # a split artifact: from its shard 1
        if gate.scores_quality and job["kind"] == "variant":  # the trunk against the reference, on gate.text
            if same_gate and "quality" in old:
                entry["quality"] = old["quality"]
            else:
                entry["quality"] = measure_quality(Path(job["reference"]), out.parent / entry["file"], gate)
        entry["gate_key"] = job["gate_key"]
    write_json(part_path, {k: v for k, v in entry.items() if k != "reused"})
    return entry


# ----------------------------------------------------------------------------- the build


def plan_jobs(recipe: Recipe, only: list[str] | None, force: bool, dry_run: bool = False) -> tuple[dict, list[dict]]:
    src = source_hashes(recipe, write_cache=not dry_run)
    parts = recipe.output / PARTS
    ref_name = f"{recipe.name}-{recipe.reference_type.upper()}.gguf"
    ref_key = key_of(TOOL, src, recipe.reference_type)  # what the reference holds: the key variants build on
    gate = recipe.gate
    gate_opts = asdict(gate) if gate else None
    if gate is not None and gate.text is not None:  # the text's bytes, not its name, decide the quality figures
        gate_opts["text"] = sha256_file(Path(gate.text))

    def split_key(key: str, size: int) -> str:  # the shard size changes an artifact's files, not what it holds
        return key_of(key, {"split_max_size": size}) if size else key

    ref_split = recipe.split_of(None)
    ref_build = split_key(ref_key, ref_split)
    reference = {"kind": "reference", "label": "reference", "out": str(recipe.output / ref_name),
                 "part": str(parts / "_reference.json"), "build_key": ref_build, "force": force, "recipe": recipe,
                 "gate": gate, "gated": gate is not None, "gate_key": key_of(ref_key, gate_opts),
                 "split_max_size": ref_split,
                 "options": {"preset": recipe.reference_type.upper(), "mtp_type": recipe.reference_type,
                             **({"split_max_size": ref_split} if ref_split else {})}}
    jobs = []
    chosen = [recipe.variant(n) for n in only] if only else recipe.variants
    for v in chosen:
        graft_sha = sha256_model(v.graft_into) if v.graft_into else None
        opts = {"preset": v.preset, "mtp_type": str(v.mtp_type),
                "mtp_experts_type": None if v.mtp_experts_type is None else str(v.mtp_experts_type),
                "tensor_types": list(v.tensor_types), "graft_into": v.graft_into.name if v.graft_into else None}
        if v.imatrix is not None:  # recorded (and part of the build key) only when used
            opts.update(imatrix=v.imatrix.name, imatrix_sha256=sha256_file(v.imatrix),
                        include_weights=list(v.include_weights), exclude_weights=list(v.exclude_weights))
        content = key_of(ref_key, opts, graft_sha)
        size = recipe.split_of(v)
        if size:  # recorded (and part of the build key) only when the files are split
            opts["split_max_size"] = size
        bkey = split_key(content, size)
        jobs.append({"kind": "variant", "label": "variant", "variant": v, "variant_name": v.name,
                     "out": str(recipe.output / f"{recipe.name}-{v.name}.gguf"), "part": str(parts / f"{v.name}.json"),
                     "reference": reference["out"], "build_key": bkey, "force": force, "gate": gate,
                     "gated": gate is not None and v.gate, "gate_key": key_of(content, gate_opts),
                     "split_max_size": size, "options": opts})
    if not only:
        for flag, mode, suffix in ((recipe.mtp_only, "only", "MTP-only"), (recipe.no_mtp, "drop", "no-MTP")):
            if flag:
                name = f"{recipe.name}-{recipe.reference_type.upper()}-{suffix}.gguf"
                jobs.append({"kind": mode, "label": suffix.lower(), "out": str(recipe.output / name),
                             "part": str(parts / f"_{suffix.lower()}.json"), "force": force,
                             "build_key": split_key(key_of(ref_key, mode), ref_split), "recipe": recipe,
                             "gate": None, "gated": False, "gate_key": None, "split_max_size": ref_split,
                             "options": {"preset": recipe.reference_type.upper(), "mtp_type": suffix,
                                         **({"split_max_size": ref_split} if ref_split else {})}})
    return {"reference": reference, "source": src}, jobs


def run_build(recipe: Recipe, only: list[str] | None = None, jobs: int = 1, force: bool = False,
              log: Callable[[str], None] = print) -> int:
    """Build the recipe; returns the exit code (0 all passed, 1 a gate failed)."""
    from ..convert import OUTTYPES, plan_checkpoint

    # the whole source is checked (cheap: headers, shapes, config, tokenizer) before anything is written,
    # so a bad source leaves no output folder or build-parts cache behind
    plan_checkpoint(recipe.source, outtype=OUTTYPES[recipe.reference_type])
    recipe.output.mkdir(parents=True, exist_ok=True)
    from ..gguf_io import remove_partial

    for stale in [*recipe.output.glob(".*.partial-*"), *(recipe.output / PARTS).glob(".*.partial-*")]:
        remove_partial(stale)  # left by a build that was killed; never an artifact
    head, todo = plan_jobs(recipe, only, force)
    log(f"reference {Path(head['reference']['out']).name}")
    ref_entry = build_artifact(head["reference"])
    log(f"  {'reused' if ref_entry['reused'] else 'built'}" + _acc(ref_entry))
    for job in todo:  # what the variants read: the reference as written (shard 1 of a split one)
        if job["kind"] == "variant":
            job["reference"] = str(recipe.output / ref_entry["file"])
    ref_rate = ref_entry.get("acceptance", {}).get("acceptance_rate")
    entries = [ref_entry]
    if jobs > 1 and len(todo) > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            results = list(pool.map(build_artifact, todo))
    else:
        results = []
        for job in todo:
            log(f"{Path(job['out']).name}")
            results.append(build_artifact(job))
            log(f"  {'reused' if results[-1]['reused'] else 'built'}" + _acc(results[-1]))
    for job, entry in zip(todo, results):
        if job["gated"]:
            entry["gate"] = _judge_entry(entry, ref_rate, recipe.gate)
            write_json(Path(job["part"]), {k: v for k, v in entry.items() if k != "reused"})
        entries.append(entry)
    failed = [e for e in entries if e.get("gate") and not e["gate"]["passed"]]
    for e in failed:
        log(f"GATE FAILED {e['file']}: {e['gate']['reason']}")
    if not only:
        write_outputs(recipe, head["source"])
    else:
        log(f"partial build ({', '.join(only)}): parts in {recipe.output / PARTS}; combine with --merge")
    return 1 if failed else 0


def _acc(entry: dict) -> str:
    a = entry.get("acceptance")
    return f", acceptance {a['acceptance_rate']:.3f}" if a else ""


# ----------------------------------------------------------------------------- manifest, sums, card


def collect_parts(recipe: Recipe) -> list[dict]:
    parts_dir = recipe.output / PARTS
    if not parts_dir.is_dir():
        raise InputError(parts_dir, "no build parts to merge (run mtpq build first)")
    entries = []
    for p in sorted(parts_dir.glob("*.json")):
        if p.name == "source-hashes.json":
            continue
        e = json.loads(p.read_text())
        for listed in files_of(e):
            f = recipe.output / listed["file"]
            if not f.is_file():
                raise InputError(f, f"listed by {p.name} but missing from the output folder")
            if f.stat().st_size != listed["bytes"]:
                raise InputError(f, f"size differs from {p.name} (a stale or partial copy?)")
        entries.append(e)
    return entries


def write_outputs(recipe: Recipe, source: dict[str, str] | None = None) -> dict:
    """manifest.json, SHA256SUMS and README.md from the parts in the output folder."""
    entries = collect_parts(recipe)
    if source is None:
        cache = recipe.output / PARTS / "source-hashes.json"
        source = {k: v["sha256"] for k, v in json.loads(cache.read_text()).items()} if cache.is_file() else {}
    order = {"reference": 0, "variant": 1}
    entries.sort(key=lambda e: (order.get(e["kind"], 2), e["file"]))
    ref = next((e for e in entries if e["kind"] == "reference"), None)
    ref_rate = (ref or {}).get("acceptance", {}).get("acceptance_rate")
    for e in entries:  # re-judge on merge: partial builds did not know every rate
        if "acceptance" in e and e["kind"] == "variant" and recipe.gate is not None:
            e["gate"] = _judge_entry(e, ref_rate, recipe.gate)
    manifest = {
        "model": recipe.name,
        "tool": TOOL,
        "recipe_sha256": recipe.raw_sha256,
        "source": {"folder": recipe.source.name, "files": source},
        "gate": asdict(recipe.gate) if recipe.gate else None,
        "passed": all(e.get("gate", {"passed": True})["passed"] for e in entries),
        "files": [{k: v for k, v in e.items() if k not in ("gate_key",)} for e in entries],
    }
    if recipe.gate and manifest["gate"]["prompts"] != "builtin":
        manifest["gate"]["prompts"] = Path(manifest["gate"]["prompts"]).name
    if recipe.gate and manifest["gate"]["text"] is not None:  # no machine's path in a published manifest
        manifest["gate"]["text"] = Path(manifest["gate"]["text"]).name
    write_json(recipe.output / "manifest.json", manifest)
    sums = "".join(f"{f['sha256']}  {f['file']}\n" for e in entries for f in files_of(e))
    _write_text(recipe.output / "SHA256SUMS", sums)
    _write_text(recipe.output / "README.md", model_card(recipe, manifest))
    return manifest


def _size_text(n: int | None) -> str:
    if not n:
        return "the shard size"
    for unit, scale in (("G", 1000**3), ("M", 1000**2)):
        if n % scale == 0:
            return f"{n // scale} {unit}B"
    return f"{n:,} bytes"


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def model_card(recipe: Recipe, manifest: dict) -> str:
    lines = [f"# {recipe.name} — GGUF with MTP heads", "",
             f"Built by {manifest['tool']} from `{recipe.source.name}` (recipe sha256 `{recipe.raw_sha256[:12]}`).",
             "Every file keeps the model's Multi-Token-Prediction head, so llama.cpp can self-draft with "
             "`--spec-type draft-mtp`.", ""]
    gate = recipe.gate
    if gate:
        lines += [f"Acceptance: greedy draft acceptance rate at depth k={gate.draft} on the `{Path(gate.prompts).name}` "
                  f"prompts ({gate.max_new_tokens} new tokens each), measured by `mtpq accept`.", ""]
    quality = gate is not None and gate.scores_quality
    if quality:
        lines += [f"Quality: the trunk against the reference on `{Path(gate.text).name}` as llama-perplexity "
                  f"--kl-divergence measures it (chunks of {gate.kld_ctx_size} tokens): mean KLD, how often the "
                  "top token agrees, PPL ratio; computed by `mtpq compare`.", ""]
    head = "| file | size | bits/weight | MTP type | acceptance |" + (" mean KLD | same top | PPL ratio |" if quality else "")
    lines += [head + " gate |", "|---|---:|---:|---|---:|" + ("---:|---:|---:|" if quality else "") + "---|"]
    for f in manifest["files"]:
        acc = f.get("acceptance", {}).get("acceptance_rate")
        g = f.get("gate")
        q = f.get("quality") or {}
        shards = f" + {len(f['shards']) - 1} more shards" if "shards" in f else ""
        cells = (f" {q['kld_mean']:.4f} | {100 * q['top1']:.1f} % | {q['ppl_ratio']:.4f} |" if q else " — | — | — |"
                 ) if quality else ""
        lines.append(f"| `{f['file']}`{shards} | {f['bytes'] / 2**20:,.1f} MiB | {f['bits_per_weight']:.2f} | "
                     f"{', '.join(f['mtp_precision']) or '—'} | {'—' if acc is None else f'{100 * acc:.1f} %'} |"
                     f"{cells} {'—' if g is None else ('pass' if g['passed'] else 'FAIL: ' + g['reason'])} |")
    split = [f for f in manifest["files"] if "shards" in f]
    if split:
        first = split[0]
        lines += ["", f"Files over {_size_text(first.get('split_max_size'))} are split (`NAME-00001-of-0000N.gguf`, ...). "
                  "Download every shard of a quant into one folder and give llama.cpp the first: "
                  f"`llama-server -m {first['file']} --spec-type draft-mtp` loads them all."]
    lines += ["", "Check the downloads with `sha256sum -c SHA256SUMS`.", ""]
    return "\n".join(lines)
