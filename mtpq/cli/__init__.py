"""The ``mtpq`` command line (one Typer app; one module per command group)."""

import os

# torch's OpenMP pool spin-waits between ops by default; on a shared machine the spinning threads
# steal the cores the work needs. Passive waiting costs nothing measurable on our sizes.
# (Read by the OpenMP runtime when torch loads, so it must be set before any command imports torch.)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .app import app, main  # noqa: E402

__all__ = ["app", "main"]
