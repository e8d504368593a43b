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

# Command modules register themselves on `app` (cli/app.py, which imports none of them) when imported here;
# --help lists them in this order.
from . import convert as _convert  # noqa: E402,F401
from . import quantize as _quantize  # noqa: E402,F401
from . import inspect as _inspect  # noqa: E402,F401
from . import surgery as _surgery  # noqa: E402,F401
from . import accept as _accept  # noqa: E402,F401
from . import compare as _compare  # noqa: E402,F401
from . import sweep as _sweep  # noqa: E402,F401
from . import build as _build  # noqa: E402,F401
from . import demo as _demo  # noqa: E402,F401
from . import imatrix as _imatrix  # noqa: E402,F401

__all__ = ["app", "main"]
