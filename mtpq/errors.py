"""Errors the user can fix. The CLI prints them as one line and exits with code 2."""

from __future__ import annotations

from pathlib import Path


class InputError(Exception):
    """Bad input: names the file (or option) at fault and what is wrong with it."""

    def __init__(self, where: str | Path, problem: str):
        self.where = str(where)
        self.problem = problem
        super().__init__(f"{self.where}: {problem}")

    def __reduce__(self):  # rebuilt from (where, problem) when it crosses a process boundary (build --jobs)
        return self.__class__, (self.where, self.problem)


def tensor_error(source: str, name: str, problem: str) -> InputError:
    """An :class:`InputError` about the tensor ``name`` read from ``source``, naming it once: a GGUF's tensors
    are ``file.gguf:name`` already, a checkpoint's sources its file; ``problem`` may start with ``name: ``."""
    problem = problem.removeprefix(f"{name}: ")
    return InputError(source, problem if source.endswith(f":{name}") else f"{name}: {problem}")


class MeasurementError(InputError):
    """A measurement that gave no usable figure: non-finite logits or hidden states from finite weights, or an
    engine that printed NaN. Where a command gates (``compare`` with a gate, ``accept``, ``build``) it is a failed
    gate (exit 1); elsewhere an input the measurement cannot use (exit 2)."""
