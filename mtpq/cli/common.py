"""What every command shares: error handling, exit codes, progress bars."""

from __future__ import annotations

import functools
import logging
import sys
from contextlib import contextmanager
from typing import Callable, Iterator

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from ..errors import InputError

EXIT_OK, EXIT_CHECK_FAILED, EXIT_INPUT = 0, 1, 2

console = Console(stderr=True)  # messages and progress; stdout stays clean for --json
out = Console()


def fail(where: str, problem: str) -> None:
    """One line naming the file (or option) and the problem, exit 2."""
    console.print(f"[bold red]error:[/] {where}: {problem}", highlight=False, soft_wrap=True)
    raise typer.Exit(EXIT_INPUT)


def guarded(fn: Callable) -> Callable:
    """Turn InputError (and a few OS errors) into the one-line, exit-2 contract."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        logging.getLogger("gguf").setLevel(logging.WARNING)
        try:
            return fn(*args, **kwargs)
        except InputError as exc:
            fail(exc.where, exc.problem)
        except (FileNotFoundError, PermissionError, IsADirectoryError) as exc:
            fail(getattr(exc, "filename", None) or "input", exc.strerror or str(exc))
        except KeyboardInterrupt:
            console.print("[yellow]interrupted; no partial output was left behind[/]")
            raise typer.Exit(130)

    return wrapper


@contextmanager
def byte_progress(description: str, total: int, enabled: bool = True) -> Iterator[Callable[[int, str], None]]:
    """A rich progress bar over bytes; yields ``advance(nbytes, label)``."""
    if not enabled or not sys.stderr.isatty():
        yield lambda n, label="": None
        return
    cols = [TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
            TimeRemainingColumn(), TextColumn("{task.fields[label]}")]
    with Progress(*cols, console=console, transient=True) as progress:
        task = progress.add_task(description, total=total, label="")
        yield lambda n, label="": progress.update(task, advance=n, label=label)


THREADS_HELP = ("CPU workers for quantizing (default: torch's choice, all physical cores); on "
                "Linux, forked processes (MTPQ_WORKERS=threads: Python threads). "
                "The bytes written do not depend on it.")


def set_threads(threads: int | None) -> None:
    """``--threads``: the kernels split each tensor over ``torch.get_num_threads()`` workers."""
    if threads is None:
        return
    if threads < 1:
        fail("--threads", f"must be at least 1, got {threads}")
    import torch

    torch.set_num_threads(threads)
