"""Finding llama.cpp's programs: ``--llama-cpp DIR``, else ``$MTPQ_LLAMA_CPP_BIN``, else PATH (no torch here)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from ..errors import InputError

ENV_BIN = "MTPQ_LLAMA_CPP_BIN"


def find_binary(name: str, bin_dir: Path | str | None = None, option: str = "--engine llama.cpp") -> Path:
    """llama.cpp's program ``name`` (llama-server, llama-perplexity ...) from ``bin_dir``, ``$MTPQ_LLAMA_CPP_BIN``
    or PATH; a folder that lacks it is an error (not silently another build from PATH)."""
    for where, d in (("--llama-cpp", bin_dir), (ENV_BIN, os.environ.get(ENV_BIN))):
        if d:
            exe = Path(d) / name
            if exe.is_file() and os.access(exe, os.X_OK):
                return exe
            raise InputError(
                where,
                f"{exe}: no executable {name} there (build llama.cpp's {name} target, or "
                "point at its build/bin folder)",
            )
    found = shutil.which(name)
    if found is None:
        raise InputError(
            option, f"{name} not found: pass --llama-cpp DIR (llama.cpp's build/bin), set {ENV_BIN}, or put it on PATH"
        )
    return Path(found)


def child_env() -> dict[str, str]:
    """The environment for llama.cpp processes: the user's, without the thread settings mtpq chose for
    itself (see mtpq.cli: under its OpenMP wait policy llama.cpp may exit before its log thread drains)."""
    env = dict(os.environ)
    for name in filter(None, env.pop("MTPQ_SET_ENV", "").split(",")):
        env.pop(name, None)
    return env


_LOG_PREFIX = re.compile(r"^[\d.]+ [A-Z] +")  # llama.cpp's "0.00.008.775 E " timestamp and level


def reason_from_log(text: str) -> str:
    """The line of a server log that says why it stopped: the first error line (llama.cpp logs the cause
    first, then what failed because of it), else the last line."""
    lines = [_LOG_PREFIX.sub("", ln).strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln]
    for ln in lines:
        if "error" in ln.lower():
            return ln
    return lines[-1] if lines else "no output"
