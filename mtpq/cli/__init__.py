"""The ``mtpq`` command line (one Typer app; one module per command group)."""

import os

# Thread settings mtpq chooses for itself when the user has not (read when torch or numpy loads, so set before
# any command imports them):
# - torch's OpenMP pool spin-waits between ops by default; on a shared machine the spinning threads steal the
#   cores the work needs. Passive waiting costs nothing measurable on our sizes.
# - numpy's OpenBLAS starts a thread per core that spins ~0.1 s of CPU at start-up; mtpq's numpy does no
#   matrix products worth a thread (the models run in torch), and --threads workers are processes.
# Child processes get the user's environment back (engines.binaries.child_env): ggml's OpenMP pool under
# PASSIVE lets llama.cpp exit before its log thread has written the closing lines.
_CHOSEN = {"OMP_WAIT_POLICY": "PASSIVE", "OPENBLAS_NUM_THREADS": "1"}
_set_here = [k for k in _CHOSEN if k not in os.environ]
for _k in _set_here:
    os.environ[_k] = _CHOSEN[_k]
if _set_here:
    os.environ["MTPQ_SET_ENV"] = ",".join(_set_here)

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
from . import publish as _publish  # noqa: E402,F401
from . import demo as _demo  # noqa: E402,F401
from . import imatrix as _imatrix  # noqa: E402,F401

__all__ = ["app", "main"]
