"""manifest.json, SHA256SUMS and the model card (README.md) from the parts in a build's output folder.

The manifest is what the card and ``mtpq publish`` read: every file with its bytes and sha256 (each shard of a
split one), what it is (``kind``: reference, variant, head, mtp-only, no-mtp; ``form``: combined, trunk, head),
the ``-hf`` tag it answers, the head file a trunk pairs with (``head``) and the tags a head file serves
(``pairs``), the gate's figures and verdicts, and the recipe's [publish] table.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from ..errors import InputError
from .bookkeeping import PARTS, TOOL, files_of, write_json, write_text
from .card import model_card
from .recipe import Recipe

KIND_ORDER = {"reference": 0, "variant": 1, "head": 2}
FORM_ORDER = {"trunk": 0, "combined": 1, "head": 2}
MANIFEST = "manifest.json"


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


def write_manifest(
    recipe: Recipe, source: dict[str, str] | None, judge_entry: Callable[[dict, float | None, object], dict]
) -> dict:
    """manifest.json, SHA256SUMS and README.md; every gated variant judged again with ``judge_entry``."""
    entries = collect_parts(recipe)
    if source is None:
        cache = recipe.output / PARTS / "source-hashes.json"
        source = {k: v["sha256"] for k, v in json.loads(cache.read_text()).items()} if cache.is_file() else {}
    entries.sort(key=lambda e: (KIND_ORDER.get(e["kind"], 3), FORM_ORDER.get(e.get("form"), 3), e["file"]))
    ref = next((e for e in entries if e["kind"] == "reference"), None)  # the trunk (and head) -hf users get
    ref_rate = (ref or {}).get("acceptance", {}).get("acceptance_rate")
    for e in entries:  # re-judge on merge: partial builds did not know every rate
        if "acceptance" in e and e["kind"] == "variant" and recipe.gate is not None:
            e["gate"] = judge_entry(e, ref_rate, recipe.gate)
    for e in entries:
        if e["kind"] == "head":
            e["pairs"] = [t["tag"] for t in entries if t.get("head") == e["file"]]
    publish = {k: v for k, v in asdict(recipe.publish).items() if v not in (None, False)}
    manifest = {
        "model": recipe.name,
        "tool": TOOL,
        "recipe_sha256": recipe.raw_sha256,
        "source": {"folder": recipe.source.name, "files": source},
        "layout": recipe.layout,
        "publish": publish,
        "gate": asdict(recipe.gate) if recipe.gate else None,
        "passed": all(e.get("gate", {"passed": True})["passed"] for e in entries),
        "files": [{k: v for k, v in e.items() if k not in ("gate_key",)} for e in entries],
    }
    if recipe.gate and manifest["gate"]["prompts"] != "builtin":
        manifest["gate"]["prompts"] = Path(manifest["gate"]["prompts"]).name
    if recipe.gate and manifest["gate"]["text"] is not None:  # no machine's path in a published manifest
        manifest["gate"]["text"] = Path(manifest["gate"]["text"]).name
    write_json(recipe.output / MANIFEST, manifest)
    write_text(recipe.output / "SHA256SUMS", sha256sums(manifest))
    write_text(recipe.output / "README.md", model_card(manifest))
    return manifest


def sha256sums(manifest: dict) -> str:
    return "".join(f"{f['sha256']}  {f['file']}\n" for e in manifest["files"] for f in files_of(e))
