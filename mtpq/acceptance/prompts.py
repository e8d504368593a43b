"""The prompt sets the acceptance check drafts over: packaged ones (``builtin``, ``demo_heldout``) or JSONL files."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from ..errors import InputError


def load_prompts(spec: str | Path, max_prompts: int | None = None) -> list[tuple[str, str]]:
    """(category, prompt) pairs from a packaged set (``builtin``, ``demo_heldout``) or a JSONL file."""
    packaged = resources.files("mtpq").joinpath(f"data/prompts/{spec}.jsonl")
    if "/" not in str(spec) and not str(spec).endswith(".jsonl") and packaged.is_file():
        text = packaged.read_text()
        where = f"{spec} prompts"
    else:
        path = Path(spec)
        if not path.is_file():
            raise InputError(path, "no such prompts file")
        text, where = path.read_text(), str(path)
    prompts = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            prompts.append((str(obj.get("category", "all")), str(obj["prompt"])))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise InputError(where, f'line {i}: expected a JSON object with a "prompt" field') from None
    if not prompts:
        raise InputError(where, "no prompts")
    return prompts[:max_prompts] if max_prompts else prompts
