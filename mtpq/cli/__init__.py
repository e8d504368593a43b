"""The ``mtpq`` command line (one Typer app; one module per command group)."""

import os

# torch's OpenMP pool spin-waits between ops by default; on a shared machine the spinning threads
# steal the cores the work needs. Passive waiting costs nothing measurable on our sizes.
# (Read by the OpenMP runtime when torch loads, so it must be set before any command imports torch.)
# Child processes get the user's environment back (engines.llama_cpp.child_env): ggml's OpenMP pool under
# PASSIVE lets llama.cpp exit before its log thread has written the closing lines.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ["MTPQ_SET_OMP_WAIT_POLICY"] = "1"

from .app import app, main  # noqa: E402

__all__ = ["app", "main"]
