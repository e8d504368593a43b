"""Errors the user can fix. The CLI prints them as one line and exits with code 2."""

from __future__ import annotations

from pathlib import Path


class InputError(Exception):
    """Bad input: names the file (or option) at fault and what is wrong with it."""

    def __init__(self, where: str | Path, problem: str):
        self.where = str(where)
        self.problem = problem
        super().__init__(f"{self.where}: {problem}")
