"""What every command shares: error handling, exit codes, progress bars."""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from typer._click import exceptions as click_errors  # typer vendors its own click

from ..engines import ENGINES
from ..errors import InputError, MeasurementError

EXIT_OK, EXIT_CHECK_FAILED, EXIT_INPUT, EXIT_INTERNAL = 0, 1, 2, 3
EXIT_SIGINT, EXIT_SIGTERM = 130, 143  # 128 + signal number, as shells report them

console = Console(stderr=True)  # messages and progress; stdout stays clean for --json
out = Console()
DEBUG = {"on": bool(os.environ.get("MTPQ_DEBUG"))}  # --debug: tracebacks for internal errors


class Terminated(KeyboardInterrupt):
    """SIGTERM (kill, timeout, CI cancellation), raised where Ctrl-C would be: the same clean-up runs."""


def _on_sigterm(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one is enough: let the clean-up finish
    raise Terminated()


def fail(where: str, problem: str) -> None:
    """One line naming the file (or option) and the problem, exit 2."""
    console.print(f"[bold red]error:[/] {escape(str(where))}: {escape(str(problem))}", highlight=False, soft_wrap=True)
    raise typer.Exit(EXIT_INPUT)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def guarded(fn: Callable) -> Callable:
    """Every failure of a command as one line: InputError and OS errors exit 2, Ctrl-C 130, SIGTERM 143,
    anything unexpected 3 ("internal error ...; please report it", the traceback only with --debug)."""
    command = fn.__name__.replace("_", "-")

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        logging.getLogger("gguf").setLevel(logging.WARNING)
        in_main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, _on_sigterm) if in_main else None
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, click_errors.ClickException, typer.Abort):
            raise
        except InputError as exc:
            fail(_one_line(exc.where), _one_line(exc.problem))
        except KeyboardInterrupt as exc:
            what = "terminated" if isinstance(exc, Terminated) else "interrupted"
            console.print(f"[yellow]{what}; no partial output was left behind[/]")
            raise typer.Exit(EXIT_SIGTERM if isinstance(exc, Terminated) else EXIT_SIGINT)
        except OSError as exc:  # permissions, a read-only or full disk, a folder where a file belongs...
            where = exc.filename or "input"
            fail(str(where), _one_line(exc.strerror or str(exc)))
        except Exception as exc:
            if DEBUG["on"]:
                console.print_exception()
            text = _one_line(f"{exc.__class__.__name__}: {exc}")
            console.print(
                f"[bold red]error:[/] internal error in {command}: {escape(text)}; please report it",
                highlight=False,
                soft_wrap=True,
            )
            raise typer.Exit(EXIT_INTERNAL)
        finally:
            if in_main:
                signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)

    return wrapper


@contextmanager
def gating(gates: bool = True) -> Iterator[None]:
    """A measurement that fails (MeasurementError: non-finite logits, an engine's NaN) inside this block fails the
    command's gate when it has one (``gates``): one line, exit 1. Without a gate it stays an input error (exit 2)."""
    try:
        yield
    except MeasurementError as exc:
        if not gates:
            raise
        console.print(
            f"[bold red]FAIL[/] {escape(_one_line(exc.where))}: {escape(_one_line(exc.problem))}",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(EXIT_CHECK_FAILED)


@contextmanager
def byte_progress(description: str, total: int, enabled: bool = True) -> Iterator[Callable[[int, str], None]]:
    """A rich progress bar over bytes; yields ``advance(nbytes, label)``."""
    if not enabled or not sys.stderr.isatty():
        yield lambda n, label="": None
        return
    cols = [
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[label]}"),
    ]
    with Progress(*cols, console=console, transient=True) as progress:
        task = progress.add_task(description, total=total, label="")
        yield lambda n, label="": progress.update(task, advance=n, label=label)


def write_with_progress(plan, out: Path, label: str, quiet: bool, split=None) -> tuple[int, list[Path]]:
    """``plan`` written to ``out`` (split by ``split``, a SplitRule) under a byte bar; -> (tensor bytes, files)."""
    from ..gguf_io import tensor_nbytes, write_plan

    total = sum(tensor_nbytes(s.shape, s.ggml_type) for s in plan.tensors)
    with byte_progress(f"{label} -> {out.name}", total, enabled=not quiet) as advance:
        written = write_plan(plan, out, split=split, on_tensor=lambda spec, n: advance(n, spec.name))
    return total, written


def report_hooks(quiet: bool) -> dict:
    """``progress`` and ``say`` for a library call that reports to a person: the byte bar and stderr (none if quiet)."""
    return {} if quiet else {"progress": byte_progress, "say": console.print}


def check_auto_head_arch(arch: str, src: Path) -> None:
    """``--mtp-type auto`` measures the candidate heads in the torch runtime: ``src``'s architecture needs one."""
    check_runtime_arch(arch, str(src), "--mtp-type auto", "choose the head's type with --mtp-type")


def write_quantized(
    label: str, src: Path, out: Path, before, plan, options, quiet: bool, split, auto_head=None, head_file=False
) -> tuple[object, list[Path]]:
    """``plan`` (``quantize``'s of ``before``, or ``convert --quant``'s) written to ``out`` by the job's ``options``;
    -> (the plan written, files).

    ``auto_head``: ``(max_drop, prompts)`` of ``--mtp-type auto``: ``plan`` is then the trunk with the input's head,
    written once, every candidate head measured on it and the chosen one grafted in; the plan returned has the
    chosen head's types (``head_file``: ``src`` is a head file and ``plan`` its trunk's)."""
    if auto_head is None:
        return plan, write_with_progress(plan, out, label, quiet, split)[1]
    from ..workflows.auto_head import quantize_with_auto_head

    max_drop, prompts = auto_head
    return quantize_with_auto_head(
        src, out, before, plan, options, max_drop, prompts, split=split, head_file=head_file, **report_hooks(quiet)
    )


def set_threads(threads: int | None) -> None:
    """``--threads``: the threads the kernels split each tensor over (and torch's, where it is loaded)."""
    if threads is None:
        return
    if threads < 1:
        fail("--threads", f"must be at least 1, got {threads}")
    from ..ggml.engine import set_workers

    set_workers(threads)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)


def check_device(device: str | None) -> str | None:
    """A --device the runtime can use, refused with one line before any work (cpu, cuda, cuda:N)."""
    if device is None:
        return None
    import torch  # only the commands that compute pay for it

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        fail("--device", f"unknown device {device!r}; use cpu, cuda or cuda:N")
    if dev.type not in ("cpu", "cuda"):
        fail("--device", f"unsupported device {device!r}; use cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            fail("--device", f"{device}: CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            fail("--device", f"{device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def split_rule(max_size: str | None, max_tensors: int | None, keep: bool = False):
    """The ``--split-max-size`` / ``--split-max-tensors`` / ``--keep-split`` options as a SplitRule (None: one
    file), refused with one line before any file is read."""
    from ..gguf_io import SplitRule, parse_size

    if keep and (max_size is not None or max_tensors is not None):
        fail("--keep-split", "keeps the input's shards: not with --split-max-size / --split-max-tensors")
    if max_tensors is not None and max_tensors < 1:
        fail("--split-max-tensors", f"must be at least 1, got {max_tensors}")
    size = 0
    if max_size is not None:
        try:
            size = parse_size(max_size)
        except ValueError as exc:
            fail("--split-max-size", str(exc))
    if not (keep or size or max_tensors):
        return None
    return SplitRule(max_size=size, max_tensors=max_tensors or 0, keep=keep)


def files_written(paths: list) -> str:
    """``out.gguf``, or ``out-00001-of-00003.gguf .. out-00003-of-00003.gguf (3 shards)``."""
    if len(paths) == 1:
        return str(paths[0])
    return f"{paths[0]} .. {paths[-1].name} ({len(paths)} shards)"


def check_fractions(**options: float | None) -> None:
    """Options that are fractions (``--min-rate=0.4``: pass them as ``min_rate=...``), each None or in [0, 1]."""
    for name, v in options.items():
        if v is not None and not 0.0 <= v <= 1.0:
            fail("--" + name.replace("_", "-"), f"must be between 0 and 1, got {v}")


def auto_head_asked(mtp_type: str | None, max_drop: float) -> bool:
    """True for ``--mtp-type auto``, whose ``--max-drop`` is then checked."""
    auto = (mtp_type or "").strip().lower() == "auto"
    if auto:
        check_fractions(max_drop=max_drop)
    return auto


def check_engine(engine: str) -> None:
    if engine not in ENGINES:
        fail("--engine", f"choose one of {', '.join(ENGINES)}")


def check_torch_engine(llama_cpp_options: dict, extra: list[str], tool: str) -> None:
    """With --engine torch: no option of the llama.cpp engine, and no arguments after ``--`` (they go to ``tool``)."""
    for opt, v in llama_cpp_options.items():
        if v is not None:
            fail(opt, "belongs to --engine llama.cpp")
    if extra:
        fail(" ".join(extra), f"extra arguments go to {tool}: only with --engine llama.cpp")


def check_runtime(paths: list[Path], what: str, alternative: str = "") -> None:
    """Every GGUF in ``paths`` is of an architecture the torch runtime runs; otherwise one line naming the file, before
    any work (``what``: the work that needs the runtime; ``alternative``: what to use instead)."""
    from ..gguf_io import GGUFFile

    for p in paths:
        check_runtime_arch(GGUFFile(Path(p)).arch, str(p), what, alternative)


def check_runtime_arch(arch: str, where: str, what: str, alternative: str = "") -> None:
    from ..runtime.archs import RUNTIME_ARCHS

    if arch not in RUNTIME_ARCHS:
        fail(
            where,
            f"architecture {arch!r} has no runtime in mtpq, which {what} needs"
            + (f"; {alternative}" if alternative else "")
            + f" (the runtime runs {', '.join(sorted(RUNTIME_ARCHS))})",
        )


def check_writable(option: str, path: Path, inputs: list[Path]) -> None:
    """A report path that cannot be written fails now, not after minutes of measuring; never an input."""
    if path.is_dir():
        fail(option, f"{path} is a folder")
    if not path.parent.is_dir():
        fail(option, f"{path}: folder {path.parent} does not exist")
    if path.exists() and not os.access(path, os.W_OK) or not os.access(path.parent, os.W_OK):
        fail(option, f"{path}: not writable")
    for src in inputs:
        if path.exists() and os.path.samefile(path, src):
            fail(option, f"{path} is an input of this run; choose another file")


def check_report_paths(json_out: Path | None, md_out: Path | None, inputs: list[Path]) -> None:
    """--json and --md checked before the measurement, not after it ('-': stdout)."""
    for opt, path in (("--json", json_out), ("--md", md_out)):
        if path is not None and str(path) != "-":
            check_writable(opt, path, inputs)


def write_reports(json_out: Path | None, doc: dict, md_out: Path | None, markdown: Callable[[], str]) -> None:
    """``doc`` as JSON to --json ('-': stdout, plain: rich would wrap), ``markdown()`` appended to --md."""
    if json_out is not None:
        text = json.dumps(doc, indent=2, sort_keys=True)
        typer.echo(text) if str(json_out) == "-" else json_out.write_text(text + "\n")
    if md_out is not None:
        with open(md_out, "a") as f:
            f.write(markdown())


def finish_report(
    json_out: Path | None,
    doc: dict,
    md_out: Path | None,
    markdown: Callable[[], str],
    show: Callable[[], None],
    passed: bool,
) -> NoReturn:
    """A measuring command's end: the report to --json and --md, ``show()`` on the terminal unless --json is
    stdout, and the exit code (0 passed, 1 a check failed)."""
    write_reports(json_out, doc, md_out, markdown)
    if str(json_out) != "-":
        show()
    raise typer.Exit(EXIT_OK if passed else EXIT_CHECK_FAILED)
