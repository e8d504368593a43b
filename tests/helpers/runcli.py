"""Run the mtpq CLI in-process, as a user would type it."""

from __future__ import annotations


def run_cli(*args):
    """Returns click's Result: exit_code, output (stdout+stderr), stdout, stderr."""
    from typer.testing import CliRunner

    from mtpq.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])
