"""A recipe as jobs: one per file a build writes, each with its build key, its part file and its gate.

Incremental by content: every artifact has a build key (a hash of everything that decides its bytes: tool
version, source file hashes, options, the keys of what it is made from). A part file per artifact
(``build-parts/NAME.json``) records the key, the file's sha256 and its gate result; an artifact whose key and
files are unchanged is not rebuilt. The gate key says the same of the figures: a pair's figures depend on its
trunk and its head file.

Stages, in the order they run (each needs the files of the ones before):
  reference   layouts with head files: the reference's own head file (the --mtp-only conversion), then the
              checkpoint converted once (layout "combined"), else its trunk
  heads       the other head files ``mtp-NAME-LABEL.gguf``, one per head a variant uses
  variants    each variant whole (layout "combined"), else its trunk, paired with its head file
  fused       layout "both": the reference and each variant as one file ``NAME-TAG_MTP.gguf``
  extras      layout "combined": the head-only and trunk-only conversions ([extras])
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import layout as naming
from .files import PARTS, TOOL, key_of, sha256_file, sha256_model, write_json
from .recipe import Recipe, Variant


@dataclass
class BuildPlan:
    source: dict[str, str]
    reference: dict
    reference_head: dict | None = None
    heads: list[dict] = field(default_factory=list)
    variants: list[dict] = field(default_factory=list)
    fused: list[dict] = field(default_factory=list)
    extras: list[dict] = field(default_factory=list)

    @property
    def jobs(self) -> list[dict]:
        first = [self.reference_head] if self.reference_head else []
        return [*first, self.reference, *self.heads, *self.variants, *self.fused, *self.extras]


def source_hashes(recipe: Recipe, write_cache: bool = True) -> dict[str, str]:
    """sha256 of every file of the source checkpoint, cached by (size, mtime) in the output folder
    (``write_cache=False``: --dry-run, which writes nothing)."""
    import json

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


def _split_key(key: str, size: int) -> str:
    """The shard size changes an artifact's files, not what it holds."""
    return key_of(key, {"split_max_size": size}) if size else key


def _variant_options(v: Variant) -> dict:
    opts = {"preset": v.preset, "mtp_type": str(v.mtp_type),
            "mtp_experts_type": None if v.mtp_experts_type is None else str(v.mtp_experts_type),
            "tensor_types": list(v.tensor_types), "graft_into": v.graft_into.name if v.graft_into else None}
    if v.imatrix is not None:  # recorded (and part of the build key) only when used
        opts.update(imatrix=v.imatrix.name, imatrix_sha256=sha256_file(v.imatrix),
                    include_weights=list(v.include_weights), exclude_weights=list(v.exclude_weights))
    return opts


def plan_jobs(recipe: Recipe, only: list[str] | None, force: bool, dry_run: bool = False) -> BuildPlan:
    src = source_hashes(recipe, write_cache=not dry_run)
    parts, out = recipe.output / PARTS, recipe.output
    ref_tag = recipe.reference_type.upper()
    ref_key = key_of(TOOL, src, recipe.reference_type)  # what the reference holds: the key variants build on
    gate = recipe.gate
    gate_opts = asdict(gate) if gate else None
    if gate is not None and gate.text is not None:  # the text's bytes, not its name, decide the quality figures
        gate_opts["text"] = sha256_file(Path(gate.text))
    common = {"force": force, "recipe": recipe, "gate": gate}
    ref_split = recipe.split_of(None)
    ref_opts = {"preset": ref_tag, "mtp_type": recipe.reference_type,
                **({"split_max_size": ref_split} if ref_split else {})}
    ref_out = out / naming.model_file(recipe.name, ref_tag)
    reference = {**common, "kind": "reference", "label": "reference", "tag": ref_tag, "out": str(ref_out),
                 "part": str(parts / "_reference.json"), "gated": gate is not None, "split_max_size": ref_split,
                 "options": ref_opts}
    plan = BuildPlan(src, reference)
    chosen = [recipe.variant(n) for n in only] if only else recipe.variants
    contents = {}
    for v in chosen:
        graft_sha = sha256_model(v.graft_into) if v.graft_into else None
        contents[v.name] = (key_of(ref_key, _variant_options(v), graft_sha), _variant_options(v))

    if not recipe.sidecar:
        reference.update(make="convert", form="combined", build_key=_split_key(ref_key, ref_split),
                         gate_key=key_of(ref_key, gate_opts))
    else:
        ref_head_out = out / naming.head_file(recipe.name, recipe.head_label(None))
        ref_head = {**common, "kind": "head", "label": "head", "form": "head", "make": "convert", "mode": "only",
                    "head_label": recipe.head_label(None), "out": str(ref_head_out), "split_max_size": 0,
                    "part": str(parts / f"_head-{recipe.head_label(None)}.json"), "gated": False,
                    "build_key": key_of(ref_key, "head"), "options": {"mtp_type": recipe.reference_type}}
        reference.update(make="reference-trunk", form="trunk", head=str(ref_head_out), draft_head=str(ref_head_out),
                         head_key=ref_head["build_key"],
                         build_key=_split_key(key_of(ref_key, "trunk"), ref_split),
                         gate_key=key_of(ref_key, "pair", ref_head["build_key"], gate_opts))
        plan.reference_head = ref_head
    heads = {recipe.head_label(None): plan.reference_head} if recipe.sidecar else {}
    for v in chosen:
        content, opts = contents[v.name]
        size = recipe.split_of(v)
        if size:  # recorded (and part of the build key) only when the files are split
            opts = {**opts, "split_max_size": size}
        job = {**common, "kind": "variant", "label": "variant", "variant": v, "variant_name": v.name, "tag": v.name,
               "out": str(out / naming.model_file(recipe.name, v.name)), "part": str(parts / f"{v.name}.json"),
               "reference": reference["out"], "gated": gate is not None and v.gate, "split_max_size": size,
               "options": opts}
        if not recipe.sidecar:
            job.update(make="combined", form="combined", build_key=_split_key(content, size),
                       gate_key=key_of(content, gate_opts))
        else:
            label = recipe.head_label(v)
            if label not in heads:
                spec = ({"same": content} if v.head_like_trunk else
                        {"mtp_type": opts["mtp_type"], "mtp_experts_type": opts["mtp_experts_type"]})
                heads[label] = {**common, "kind": "head", "label": "head", "form": "head", "make": "head",
                                "variant": v, "head_label": label, "split_max_size": 0, "gated": False,
                                "out": str(out / naming.head_file(recipe.name, label)),
                                "part": str(parts / f"_head-{label}.json"), "reference": reference["out"],
                                "reference_head": ref_head["out"], "build_key": key_of(ref_key, "head", label,
                                                                                           spec),
                                "options": {"mtp_type": opts["mtp_type"],
                                            "mtp_experts_type": opts["mtp_experts_type"]}}
                plan.heads.append(heads[label])
            head = heads[label]
            job.update(make="trunk", form="trunk", head=head["out"], draft_head=head["out"], head_key=head["build_key"],
                       reference_head=ref_head["out"], build_key=_split_key(key_of(content, "trunk"), size),
                       gate_key=key_of(content, "pair", head["build_key"], gate_opts))
        plan.variants.append(job)
    if recipe.layout == "both":
        for trunk in [reference, *plan.variants]:
            plan.fused.append(_fused(recipe, trunk, gate_opts))
    if not only and not recipe.sidecar:
        for flag, mode, suffix in ((recipe.mtp_only, "only", "MTP-only"), (recipe.no_mtp, "drop", "no-MTP")):
            if flag:
                name = f"{recipe.name}-{ref_tag}-{suffix}.gguf"
                plan.extras.append({**common, "kind": mode, "label": suffix.lower(), "form": suffix.lower(),
                                    "make": "convert", "mode": mode, "out": str(out / name),
                                    "part": str(parts / f"_{suffix.lower()}.json"), "gate": None, "gated": False,
                                    "build_key": _split_key(key_of(ref_key, mode), ref_split), "gate_key": None,
                                    "split_max_size": ref_split,
                                    "options": {"preset": ref_tag, "mtp_type": suffix, **({"split_max_size": ref_split}
                                                                                          if ref_split else {})}})
    return plan


def _fused(recipe: Recipe, trunk: dict, gate_opts) -> dict:
    """Layout "both": the trunk and its head file as one file, ``NAME-TAG_MTP.gguf``."""
    tag = trunk["tag"]
    key = key_of(trunk["build_key"], trunk["head_key"], "fused")
    return {**{k: trunk[k] for k in ("force", "recipe", "gate", "gated", "kind", "label", "split_max_size",
                                     "options", "tag")},
            **({"variant": trunk["variant"], "variant_name": trunk["variant_name"]} if "variant" in trunk else {}),
            "make": "fuse", "form": "combined", "trunk": trunk["out"], "head": trunk["head"],
            "trunk_part": trunk["part"], "out": str(recipe.output / naming.combined_file(recipe.name, tag, "both")),
            "part": str(recipe.output / PARTS / f"_fused-{tag}.json"), "build_key": key,
            "gate_key": key_of(key, gate_opts)}
