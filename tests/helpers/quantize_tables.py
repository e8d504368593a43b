"""llama-quantize's recorded per-tensor choices (tests/data/llama_quantize_choices/*.json, recorded and kept
current by tests/quantize/test_policy.py): expectations that come from llama.cpp, not from mtpq's presets."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

DATA = Path(__file__).parents[1] / "data" / "llama_quantize_choices"


@cache
def load(variant: str) -> dict:
    return json.loads((DATA / f"{variant}.json").read_text())


def recorded_type(variant: str, preset: str, name: str, options: dict | None = None) -> str:
    """The type llama-quantize gave tensor ``name`` of ``variant`` under ``preset`` (and ``options``)."""
    doc = load(variant)
    run = next(r for r in doc["runs"] if r["preset"] == preset and r["options"] == (options or {}))
    return dict(zip(run.get("names", doc["tensors"]), run["types"]))[name]


def kind(name: str) -> str:
    """A tensor's name without its block (``blk.8.nextn.eh_proj.weight`` -> ``nextn.eh_proj.weight``)."""
    return re.sub(r"^blk\.\d+\.", "", name)


@cache
def quantized_kinds() -> dict[str, bool]:
    """Whether llama-quantize quantizes each tensor kind it was shown: the Q8_0 runs of every recorded variant
    (their inputs are f32, so a tensor left F32 is one it does not quantize). A kind recorded both ways would
    make the answer depend on the model: that fails here."""
    seen: dict[str, set[bool]] = {}
    for path in sorted(DATA.glob("*.json")):
        doc = load(path.stem)
        run = next(r for r in doc["runs"] if r["preset"] == "Q8_0" and not r["options"])
        for name, qtype in zip(doc["tensors"], run["types"]):
            seen.setdefault(kind(name), set()).add(qtype != "F32")
    mixed = sorted(k for k, v in seen.items() if len(v) > 1)
    assert not mixed, f"llama-quantize quantizes these kinds in some recorded models only: {mixed}"
    return {k: v.pop() for k, v in seen.items()}
