"""What a manifest's ``SOURCES`` must say: where each source is, and only fields the manifest has.

Each entry names its location -- a URL, a repository path (``owner/name path/file.py``, ``vllm/.../x.py``,
``llama.cpp conversion/glm.py``) or a pull request -- and then, in parentheses, what was read there. A config key
or tensor-name part named in that account (``attention_bias``, ``shared_head.norm``, ``quantization_config``)
must be one the manifest has in some form it builds, unless the account says it is absent ("no X",
"without X"): a source that vouches for a field the manifest lacks is a reading nobody checked.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import ModuleType

_URL = r"https?://\S+"
_PATH = r"(?<![\w/])[\w.-]+(?:/[\w.{},*-]+)+\.(?:py|json|md|cpp|h|hpp|rs|swift|txt|yaml|toml)\b"
_REPO_FILE = r"\b[\w-]+/[\w.-]+ [\w./-]+\.(?:py|json|md|cpp|safetensors)\b"  # owner/name config.json
_PULL = r"\b[\w.-]+/[\w.-]+ (?:pull|issue)s? \d+"
_REPO = r"^[\w-]+/[\w.-]+ "  # a repository named first, what in it said in the account
_FIELD = r"(?<![\w.-])[a-z][a-z0-9]*(?:[_.][a-z0-9]+)+(?![\w(-])"  # not a function call
_ABSENT = re.compile(r"\b(?:no|without)\b")


def located(source: str) -> bool:
    """The source names where it is: a URL, a repository path or pull request, or a repository first."""
    where = source.split(" (")[0]
    return any(re.search(p, where) for p in (_URL, _PATH, _REPO_FILE, _PULL, _REPO))


def _account(source: str) -> str:
    """What the source says was read there: its parenthesised parts."""
    depth, out = 0, []
    for ch in source:
        depth += ch == "("
        if depth:
            out.append(ch)
        depth -= ch == ")" and depth > 0
    return "".join(out)


def named_fields(source: str) -> list[str]:
    """The identifiers (snake_case, dotted) the source's account names as present: not those a clause
    introduces with "no" / "without"."""
    out = []
    for clause in re.split(r"[;,:(]", re.sub(_PATH, " ", _account(source))):
        if not _ABSENT.search(clause):
            out += re.findall(_FIELD, clause)
    return out


def has(folder: Path) -> set[str]:
    """Every config key (at any depth) and every dotted part of every tensor name of a built checkpoint."""
    out: set[str] = set()

    def walk(x):
        if isinstance(x, dict):
            for k, v in x.items():
                out.add(str(k))
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(json.loads((folder / "config.json").read_text()))
    for name in json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]:
        parts = name.split(".")
        out |= {".".join(parts[i:j]) for i in range(len(parts)) for j in range(i + 1, len(parts) + 1)}
    return out


def citation_problems(manifest: ModuleType, fields: set[str], every_field: set[str]) -> list[str]:
    """Sources that name no location, and fields a source names that are a field of some manifest
    (``every_field``) but not of this one (``fields``: :func:`has` of each of its built forms)."""
    out = [f"no URL or repository path: {s[:80]}" for s in manifest.SOURCES if not located(s)]
    for s in manifest.SOURCES:
        out += [
            f"{f!r} named by {s[:60]}..., not in the manifest"
            for f in named_fields(s)
            if f in every_field and f not in fields
        ]
    return out
