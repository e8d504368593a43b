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
from .bookkeeping import PARTS, TOOL, key_of, sha256_file, sha256_model, write_json
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


def _split_option(size: int) -> dict:
    """The shard size, recorded (and part of the build key) only when the files are split."""
    return {"split_max_size": size} if size else {}


def _variant_options(v: Variant) -> dict:
    opts = {
        "preset": v.preset,
        "mtp_type": str(v.mtp_type),
        "mtp_experts_type": None if v.mtp_experts_type is None else str(v.mtp_experts_type),
        "tensor_types": list(v.tensor_types),
        "graft_into": v.graft_into.name if v.graft_into else None,
    }
    if v.imatrix is not None:  # recorded (and part of the build key) only when used
        opts.update(
            imatrix=v.imatrix.name,
            imatrix_sha256=sha256_file(v.imatrix),
            include_weights=list(v.include_weights),
            exclude_weights=list(v.exclude_weights),
        )
    return opts


@dataclass
class _Context:
    """What every job of one plan shares."""

    recipe: Recipe
    ref_key: str  # what the reference holds: the key everything else builds on
    gate_opts: dict | None
    common: dict

    def part(self, name: str) -> str:
        return str(self.recipe.output / PARTS / f"{name}.json")

    def out(self, name: str) -> str:
        return str(self.recipe.output / name)


def plan_jobs(recipe: Recipe, only: list[str] | None, force: bool, dry_run: bool = False) -> BuildPlan:
    src = source_hashes(recipe, write_cache=not dry_run)
    gate = recipe.gate
    gate_opts = asdict(gate) if gate else None
    if gate is not None and gate.text is not None:  # the text's bytes, not its name, decide the quality figures
        gate_opts["text"] = sha256_file(Path(gate.text))
    ctx = _Context(
        recipe, key_of(TOOL, src, recipe.reference_type), gate_opts, {"force": force, "recipe": recipe, "gate": gate}
    )
    plan = BuildPlan(src, _reference(ctx))
    if recipe.sidecar:
        plan.reference_head = _reference_head(ctx, plan.reference)
    heads = {recipe.head_label(None): plan.reference_head} if recipe.sidecar else {}
    for v in [recipe.variant(n) for n in only] if only else recipe.variants:
        job = _variant(ctx, v, plan.reference)
        if recipe.sidecar:
            label = recipe.head_label(v)
            if label not in heads:
                heads[label] = _variant_head(ctx, v, job, plan.reference_head)
                plan.heads.append(heads[label])
            _pair(ctx, job, heads[label], plan.reference_head)
        plan.variants.append(job)
    if recipe.layout == "both":
        plan.fused = [_fused(recipe, trunk, gate_opts) for trunk in [plan.reference, *plan.variants]]
    if not only and not recipe.sidecar:
        plan.extras = _extras(ctx)
    return plan


def _reference(ctx: _Context) -> dict:
    """The checkpoint converted once (layout "combined"), else its trunk (paired by :func:`_reference_head`)."""
    recipe, tag = ctx.recipe, ctx.recipe.reference_type.upper()
    split = recipe.split_of(None)
    job = {
        **ctx.common,
        "kind": "reference",
        "label": "reference",
        "tag": tag,
        "out": ctx.out(naming.model_file(recipe.name, tag)),
        "part": ctx.part("_reference"),
        "gated": recipe.gate is not None,
        "split_max_size": split,
        "options": {"preset": tag, "mtp_type": recipe.reference_type, **_split_option(split)},
    }
    if recipe.sidecar:
        return {
            **job,
            "make": "reference-trunk",
            "form": "trunk",
            "build_key": _split_key(key_of(ctx.ref_key, "trunk"), split),
        }
    return {
        **job,
        "make": "convert",
        "form": "combined",
        "build_key": _split_key(ctx.ref_key, split),
        "gate_key": key_of(ctx.ref_key, ctx.gate_opts),
    }


def _reference_head(ctx: _Context, reference: dict) -> dict:
    """The reference's own head file (the --mtp-only conversion), and the reference trunk paired with it."""
    label = ctx.recipe.head_label(None)
    head = {
        **ctx.common,
        "kind": "head",
        "label": "head",
        "form": "head",
        "make": "convert",
        "mode": "only",
        "head_label": label,
        "out": ctx.out(naming.head_file(ctx.recipe.name, label)),
        "split_max_size": 0,
        "part": ctx.part(f"_head-{label}"),
        "gated": False,
        "build_key": key_of(ctx.ref_key, "head"),
        "options": {"mtp_type": ctx.recipe.reference_type},
    }
    reference.update(
        head=head["out"],
        draft_head=head["out"],
        head_key=head["build_key"],
        gate_key=key_of(ctx.ref_key, "pair", head["build_key"], ctx.gate_opts),
    )
    return head


def _variant(ctx: _Context, v: Variant, reference: dict) -> dict:
    """A variant whole (layout "combined"; its trunk is paired by :func:`_pair` in the others)."""
    opts = _variant_options(v)
    content = key_of(ctx.ref_key, opts, sha256_model(v.graft_into) if v.graft_into else None)
    size = ctx.recipe.split_of(v)
    opts.update(_split_option(size))
    return {
        **ctx.common,
        "kind": "variant",
        "label": "variant",
        "variant": v,
        "variant_name": v.name,
        "tag": v.name,
        "out": ctx.out(naming.model_file(ctx.recipe.name, v.name)),
        "part": ctx.part(v.name),
        "reference": reference["out"],
        "gated": ctx.recipe.gate is not None and v.gate,
        "split_max_size": size,
        "options": opts,
        "content": content,
        "make": "combined",
        "form": "combined",
        "build_key": _split_key(content, size),
        "gate_key": key_of(content, ctx.gate_opts),
    }


def _variant_head(ctx: _Context, v: Variant, job: dict, reference_head: dict) -> dict:
    """The head file of ``v``'s label: its head type from the reference, or (``same``) cut from its quant."""
    label, opts = ctx.recipe.head_label(v), job["options"]
    types = {"mtp_type": opts["mtp_type"], "mtp_experts_type": opts["mtp_experts_type"]}
    spec = {"same": job["content"]} if v.head_like_trunk else types
    return {
        **ctx.common,
        "kind": "head",
        "label": "head",
        "form": "head",
        "make": "head",
        "variant": v,
        "head_label": label,
        "split_max_size": 0,
        "gated": False,
        "out": ctx.out(naming.head_file(ctx.recipe.name, label)),
        "part": ctx.part(f"_head-{label}"),
        "reference": job["reference"],
        "reference_head": reference_head["out"],
        "build_key": key_of(ctx.ref_key, "head", label, spec),
        "options": types,
    }


def _pair(ctx: _Context, job: dict, head: dict, reference_head: dict) -> None:
    """``job`` becomes the variant's trunk, gated with ``head``."""
    job.update(
        make="trunk",
        form="trunk",
        head=head["out"],
        draft_head=head["out"],
        head_key=head["build_key"],
        reference_head=reference_head["out"],
        build_key=_split_key(key_of(job["content"], "trunk"), job["split_max_size"]),
        gate_key=key_of(job["content"], "pair", head["build_key"], ctx.gate_opts),
    )


def _extras(ctx: _Context) -> list[dict]:
    """Layout "combined": [extras] mtp_only / no_mtp, the head-only and trunk-only conversions."""
    recipe, tag, split = ctx.recipe, ctx.recipe.reference_type.upper(), ctx.recipe.split_of(None)
    jobs = []
    for flag, mode, suffix in ((recipe.mtp_only, "only", "MTP-only"), (recipe.no_mtp, "drop", "no-MTP")):
        if flag:
            jobs.append(
                {
                    **ctx.common,
                    "kind": mode,
                    "label": suffix.lower(),
                    "form": suffix.lower(),
                    "make": "convert",
                    "mode": mode,
                    "out": ctx.out(f"{recipe.name}-{tag}-{suffix}.gguf"),
                    "part": ctx.part(f"_{suffix.lower()}"),
                    "gate": None,
                    "gated": False,
                    "build_key": _split_key(key_of(ctx.ref_key, mode), split),
                    "gate_key": None,
                    "split_max_size": split,
                    "options": {"preset": tag, "mtp_type": suffix, **_split_option(split)},
                }
            )
    return jobs


def _fused(recipe: Recipe, trunk: dict, gate_opts) -> dict:
    """Layout "both": the trunk and its head file as one file, ``NAME-TAG_MTP.gguf``."""
    tag = trunk["tag"]
    key = key_of(trunk["build_key"], trunk["head_key"], "fused")
    return {
        **{
            k: trunk[k]
            for k in ("force", "recipe", "gate", "gated", "kind", "label", "split_max_size", "options", "tag")
        },
        **({"variant": trunk["variant"], "variant_name": trunk["variant_name"]} if "variant" in trunk else {}),
        "make": "fuse",
        "form": "combined",
        "trunk": trunk["out"],
        "head": trunk["head"],
        "trunk_part": trunk["part"],
        "out": str(recipe.output / naming.combined_file(recipe.name, tag, "both")),
        "part": str(recipe.output / PARTS / f"_fused-{tag}.json"),
        "build_key": key,
        "gate_key": key_of(key, gate_opts),
    }
