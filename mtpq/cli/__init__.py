"""The ``mtpq`` command line (one Typer app; one module per command group)."""

from .app import app, main

__all__ = ["app", "main"]
