"""The ``mtpq`` command line (one Typer app; one module per command group)."""

import os

# Thread settings mtpq chooses for itself when the user has not (read when torch or numpy loads, so set before
# any command imports them; the figures behind them: docs/notes/quantize.md, "Command start-up"):
# - torch's OpenMP pool spin-waits between ops by default; on a shared machine the spinning threads steal the
#   cores the work needs, and passive waiting does not slow our sizes down.
# - numpy's OpenBLAS starts a spinning thread per core at start-up; mtpq's numpy does no matrix products worth a
#   thread (the models run in torch).
# Child processes get the user's environment back (engines.binaries.child_env): ggml's OpenMP pool under
# PASSIVE lets llama.cpp exit before its log thread has written the closing lines.
_CHOSEN = {"OMP_WAIT_POLICY": "PASSIVE", "OPENBLAS_NUM_THREADS": "1"}
_set_here = [k for k in _CHOSEN if k not in os.environ]
for _k in _set_here:
    os.environ[_k] = _CHOSEN[_k]
if _set_here:
    os.environ["MTPQ_SET_ENV"] = ",".join(_set_here)

import gc  # noqa: E402
import importlib  # noqa: E402
import sys  # noqa: E402

from . import app as _app  # noqa: E402

# The modules that register the commands on `app` (cli/app.py, which imports none of them), in --help's order,
# with the commands each registers. `mtpq CMD ...` imports only CMD's module: the others' imports (and their
# typer signatures, which typer resolves for every registered command) would lengthen every command's start-up.
_MODULES = {
    "convert": ("convert",),
    "quantize": ("quantize",),
    "inspect": ("inspect",),
    "surgery": ("graft", "extract-mtp"),
    "accept": ("accept",),
    "compare": ("compare",),
    "sweep": ("sweep",),
    "build": ("build",),
    "publish": ("publish",),
    "demo": ("demo",),
    "imatrix": ("imatrix",),
}
_COMMANDS = {c: m for m, cs in _MODULES.items() for c in cs}


def register(command: str | None = None):
    """Register ``command``'s module on the app, or (None, or a name that is no command) every module; returns
    the Typer app."""
    modules = [_COMMANDS[command]] if command in _COMMANDS else list(_MODULES)
    for m in modules:
        importlib.import_module(f"{__name__}.{m}")
    return _app.app


def _command_in(args: list[str]) -> str | None:
    """The command word of a command line: the first argument that is not an option (the app's own options
    take no values)."""
    return next((a for a in args if not a.startswith("-")), None)


def main() -> None:
    """The ``mtpq`` entry point: registers the command asked for (all for --help or a mistyped one) and runs it.

    When it returns (or exits), every object left is frozen out of the garbage collector: the interpreter's
    last collections would otherwise walk numba's, typer's and gguf-py's millions of objects, a good part of a
    short command's time (docs/notes/quantize.md, "Command start-up"), for memory the process hands back anyway."""
    try:
        register(_command_in(sys.argv[1:]))()
    finally:
        gc.freeze()


def __getattr__(name: str):
    """``mtpq.cli.app``: the Typer app with every command registered (what the tests and --help see)."""
    if name == "app":
        return register()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


del app  # noqa: F821 -- the submodule's name on this package: `app` is the Typer app (module __getattr__ above)

__all__ = ["app", "main", "register"]
