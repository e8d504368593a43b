"""Hashes, build keys and the atomic JSON/text writes a build's bookkeeping is made of (no torch)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from .. import __version__

PARTS = "build-parts"
TOOL = f"mtpq {__version__}"


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


def write_json(path: Path, data) -> None:
    """Deterministic JSON, written atomically."""
    write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def files_of(entry: dict) -> list[dict]:
    """The files of an artifact's part or manifest entry: each shard of a split one, else its one file."""
    return entry.get("shards") or [{"file": entry["file"], "bytes": entry["bytes"], "sha256": entry["sha256"]}]
