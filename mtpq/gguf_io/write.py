"""Streaming a plan into a GGUF file, or into the shards of a split set, atomically.

gguf-py's GGUFWriter serializes (nothing here writes GGUF by hand); it also writes split sets as llama.cpp
does: shard 1 carries all the metadata, every shard ``split.no``, ``split.count`` and ``split.tensors.count``.
Where a set is cut follows ``llama-gguf-split``: its shards of a file are the shards written here from that
file's plan, byte for byte, and ``llama-gguf-split --merge`` joins them back. Output goes to temporary names
beside the target and becomes visible only when every file is complete.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from gguf import GGUF_DEFAULT_ALIGNMENT, GGUFValueType, GGUFWriter

from ..errors import InputError
from ..tensors import Plan, TensorSpec
from .buffers import encoded, tensor_nbytes
from .files import SPLIT_COUNT, shard_name, split_prefix


def size_label(specs: list[TensorSpec]) -> str:
    """general.size_label ("4x2.4M", "8B") as llama.cpp's converter computes it from the tensors written."""
    from gguf import size_label as label

    w = GGUFWriter(None, "none")  # tensor infos only: gguf-py counts shared and expert parameters
    for spec in specs:
        w.add_tensor_info(spec.name, spec.shape, np.dtype(np.float32), 0, raw_dtype=spec.ggml_type)
    return label(*w.get_total_parameter_count())


def refresh_size_label(plan: Plan) -> None:
    """After a plan gains or loses tensors (graft, extract), its size label follows, if it has one."""
    if "general.size_label" in plan.kv:
        plan.set_kv("general.size_label", size_label(plan.tensors), GGUFValueType.STRING)


# ----------------------------------------------------------------------------- split sets


_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]?)\s*$", re.IGNORECASE)
_UNIT = {"": 1, "K": 1000, "M": 1000**2, "G": 1000**3}  # decimal, as llama-gguf-split and convert_hf_to_gguf


def parse_size(text: str | int) -> int:
    """``--split-max-size`` / ``split_max_size``: bytes, or a number with K, M or G (powers of 1000, as llama.cpp's
    tools read them: "48G" is 48e9 bytes). ValueError with what is wrong."""
    if isinstance(text, bool):
        raise ValueError(f"expected a size such as 48G, got {text!r}")
    if isinstance(text, int):
        n = text
    else:
        m = _SIZE.match(str(text))
        if m is None:
            raise ValueError(f"expected bytes or a number with K, M or G (48G = 48e9 bytes), got {text!r}")
        n = int(m.group(1)) * _UNIT[m.group(2).upper()]
    if n <= 0:
        raise ValueError(f"must be positive, got {text!r}")
    return n


@dataclass(frozen=True)
class SplitRule:
    """How :func:`write_plan` cuts a plan into shards; the default (nothing set) writes one file.

    ``max_size``: bytes of tensor data per shard, each tensor counted padded to the alignment as
    ``llama-gguf-split --split-max-size`` counts it (the metadata is not counted); a tensor larger than that
    gets a shard of its own. ``max_tensors``: tensors per shard (``--split-max-tensors``). ``keep``: each
    tensor goes to the shard it was read from (``TensorSpec.shard``), as ``llama-quantize --keep-split``.
    """

    max_size: int = 0
    max_tensors: int = 0
    keep: bool = False

    def groups(self, specs: list[TensorSpec]) -> list[list[TensorSpec]]:
        """The tensors of each shard, in writing order (never an empty shard, at least one group)."""
        if self.keep:
            by_shard: dict[int, list[TensorSpec]] = {}
            for spec in specs:  # llama-quantize sorts by input shard, keeping the order within each
                by_shard.setdefault(spec.shard, []).append(spec)
            return [by_shard[k] for k in sorted(by_shard)] or [[]]
        out: list[list[TensorSpec]] = [[]]
        size = 0
        for spec in specs:
            n = -(-tensor_nbytes(spec.shape, spec.ggml_type) // GGUF_DEFAULT_ALIGNMENT) * GGUF_DEFAULT_ALIGNMENT
            full = (self.max_size and size + n > self.max_size) or (
                self.max_tensors and len(out[-1]) >= self.max_tensors
            )
            if full and out[-1]:
                out.append([])
                size = 0
            out[-1].append(spec)
            size += n
        return out


def output_paths(out: Path, n_shards: int) -> list[Path]:
    """The files a plan written to ``out`` in ``n_shards`` shards becomes: ``out`` itself for one, else
    ``PREFIX-00001-of-0000N.gguf``.. beside it, PREFIX being ``out``'s name without ``.gguf`` (or without its own
    shard suffix, when ``out`` is named like a shard)."""
    out = Path(out)
    if n_shards == 1:
        return [out]
    prefix = split_prefix(out.name) or out.name.removesuffix(".gguf")
    return [out.with_name(shard_name(prefix, i + 1, n_shards)) for i in range(n_shards)]


# ----------------------------------------------------------------------------- atomic outputs


def check_not_an_input(out: Path, inputs: list[Path]) -> None:
    out = Path(out)
    for src in inputs:
        src = Path(src)
        same = out.resolve() == src.resolve() or (out.exists() and src.exists() and os.path.samefile(out, src))
        if same:
            raise InputError(out, f"output path is an input ({src}); choose another output name")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


_PUBLISHING = "publishing"  # in a shard set's partial folder while its shards are renamed into place: their names


def remove_partial(p: Path) -> list[Path]:
    """Remove one run's ``.NAME.partial-PID`` file or folder, and the shards it had begun to rename into place
    (its folder's list of them): what a run killed while publishing a split set leaves. Returns what was removed."""
    removed = []
    with contextlib.suppress(FileNotFoundError):
        if p.is_dir() and not p.is_symlink():
            journal = p / _PUBLISHING
            for name in journal.read_text().split("\n") if journal.is_file() else []:
                if name and "/" not in name:
                    with contextlib.suppress(FileNotFoundError):
                        (p.parent / name).unlink()
                        removed.append(p.parent / name)
            shutil.rmtree(p)
        else:
            p.unlink()
        removed.append(p)
    return removed


def remove_stale_partials(out: Path) -> list[Path]:
    """Remove ``.NAME.partial-PID`` files and folders beside ``out`` whose process is gone (a SIGKILL leaves them:
    it cannot be caught), with :func:`remove_partial`. A live process's temporary files are left alone. Returns
    what was removed."""
    removed = []
    prefix = f".{out.name}.partial-"
    try:
        candidates = [p for p in out.parent.iterdir() if p.name.startswith(prefix)]
    except OSError:
        return removed
    for p in candidates:
        pid = p.name[len(prefix) :].split(".")[0]  # .d: a run's intermediate files, .shards: a split output's
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            removed += remove_partial(p)
    return removed


@contextlib.contextmanager
def partial_folder(out: Path) -> Iterator[Path]:
    """A private folder beside ``out`` for a run's intermediate files (``.NAME.partial-PID.d``), removed on every
    exit path; one left by a killed run is removed by the next (:func:`remove_stale_partials`)."""
    out = Path(out)
    remove_stale_partials(out)
    folder = out.with_name(f".{out.name}.partial-{os.getpid()}.d")
    folder.mkdir()
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _disk_full(folder: Path) -> bool:
    """numpy's tofile reports a short write without errno ("N requested and M written"): ask the disk."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < (1 << 20)


def _check_output_folder(out: Path) -> None:
    if out.is_dir():
        raise InputError(out, "output path is a directory")
    if not out.parent.exists():
        raise InputError(out, f"output folder {out.parent} does not exist")
    if not out.parent.is_dir():
        raise InputError(out, f"{out.parent} is not a folder")


@contextlib.contextmanager
def atomic_output(out: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``out``; rename it to ``out`` only if the body succeeds (one file of
    :func:`atomic_outputs`)."""
    out = Path(out)
    with atomic_outputs(out, [out]) as tmps:
        yield tmps[0]


@contextlib.contextmanager
def atomic_outputs(out: Path, finals: list[Path]) -> Iterator[list[Path]]:
    """Yield a temporary path for each of ``finals`` (the file ``out``, or the shards written for it); they become
    ``finals`` only when the body succeeds, shard 1 last, so a set is never seen before it is complete.

    Whatever stops the body or the renaming (an error, Ctrl-C, SIGTERM via the CLI's handler) removes the
    temporary files and the shards already renamed; what a SIGKILL leaves is removed by the next run for ``out``.
    A full disk is an InputError naming the output and how far the write got.
    """
    out = Path(out)
    for f in finals:
        _check_output_folder(f)
    remove_stale_partials(out)
    pid = os.getpid()
    folder = None
    if len(finals) == 1:
        tmps = [out.with_name(f".{out.name}.partial-{pid}")]
    else:  # a private folder: one name to find and clean, whatever the shards are called
        folder = out.with_name(f".{out.name}.partial-{pid}.shards")
        shutil.rmtree(folder, ignore_errors=True)  # a killed run's with our pid (reused) is no live run's
        folder.mkdir()
        tmps = [folder / f.name for f in finals]
    try:
        yield tmps
        if folder is None:
            os.replace(tmps[0], finals[0])
        else:
            _publish(folder, tmps, finals)
    except OSError as exc:
        if exc.errno != errno.ENOSPC and not _disk_full(out.parent):
            raise
        wrote = sum(t.stat().st_size for t in tmps if t.exists())
        expected = getattr(exc, "expected_bytes", None)
        of = f" of {expected}" if expected else ""
        where = out if folder is None else f"{finals[0]} (shard 1 of {len(finals)})"
        raise InputError(where, f"no space left on device (wrote {wrote}{of} bytes)") from None
    finally:
        if folder is None:
            with contextlib.suppress(OSError):
                tmps[0].unlink()
        else:
            shutil.rmtree(folder, ignore_errors=True)


def _publish(folder: Path, tmps: list[Path], finals: list[Path]) -> None:
    """Rename complete shards into place, shard 1 (what readers are given) last. The folder lists them first, so
    that a run killed halfway has its renamed shards removed by the next; an interrupted renaming removes them."""
    journal = folder / _PUBLISHING
    journal.write_text("\n".join(f.name for f in finals))
    placed = []
    try:
        for tmp, final in reversed(list(zip(tmps, finals))):
            os.replace(tmp, final)
            placed.append(final)
        journal.unlink()
    except BaseException:
        for f in placed:
            with contextlib.suppress(OSError):
                f.unlink()
        raise


# ----------------------------------------------------------------------------- the writer


class _ShardWriter(GGUFWriter):
    """GGUFWriter whose files (one per shard, in order) are the temporary paths given, not names it derives."""

    def __init__(self, paths: list[Path], arch: str):
        super().__init__(paths[0], arch)
        self._paths = paths

    def format_shard_names(self, path: Path) -> list[Path]:
        assert len(self._paths) == len(self.tensors)
        return list(self._paths)

    def add_shard_kv_data(self) -> None:
        """The split keys in llama-gguf-split's order (split.no, split.tensors.count, split.count: it sets the count
        last), so that its split of the unsplit file is these shards byte for byte; gguf-py puts the count second."""
        super().add_shard_kv_data()
        for kv in self.kv_data:
            if SPLIT_COUNT in kv:
                kv[SPLIT_COUNT] = kv.pop(SPLIT_COUNT)


def write_plan(
    plan: Plan,
    out: Path,
    *,
    split: SplitRule | None = None,
    on_tensor: Callable[[TensorSpec, int], None] | None = None,
) -> list[Path]:
    """Stream ``plan`` to ``out`` atomically, in shards if ``split`` says so (see :func:`output_paths` for their
    names). Returns the files written. ``on_tensor(spec, nbytes)`` reports progress."""
    out = Path(out)
    groups = (split or SplitRule()).groups(plan.tensors)
    finals = output_paths(out, len(groups))
    for f in dict.fromkeys([out, *finals]):
        check_not_an_input(f, plan.inputs)
    with atomic_outputs(out, finals) as tmps:
        writer = _ShardWriter(tmps, plan.arch)
        for key, val in plan.kv.items():
            writer.add_key_value(key, val.value, val.type, sub_type=val.sub_type)
        for i, group in enumerate(groups):
            if i:
                writer.tensors.append({})  # a new shard (GGUFWriter adds the split keys when there are several)
            for spec in group:
                writer.add_tensor_info(
                    spec.name,
                    spec.shape,
                    np.dtype(np.float32),  # ignored: raw_dtype decides, shape is the logical shape
                    tensor_nbytes(spec.shape, spec.ggml_type),
                    raw_dtype=spec.ggml_type,
                )
        expected = None
        try:
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            expected = _expected_size(writer, plan)
            try:
                with _heap_frozen():
                    for spec, data in encoded([s for g in groups for s in g]):
                        writer.write_tensor_data(data)  # into the first shard that still has tensors to come
                        if on_tensor is not None:
                            on_tensor(spec, data.nbytes)
                        del data
            finally:
                writer.close()
        except OSError as exc:
            exc.expected_bytes = expected  # a full disk's message says how far the write got
            raise
    return finals


@contextlib.contextmanager
def _heap_frozen():
    """The objects alive before the tensors are written (a tokenizer's vocabulary: 200k+ of them) left out of
    the cyclic collector while they are: a full collection that the writing's own allocations happen to set
    off scans them all, 90 ms in the middle of a 0.5 s FP8 -> bf16 write, at random. Given back after."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _expected_size(writer: GGUFWriter, plan: Plan) -> int | None:
    """The bytes the finished file(s) would have had: each header, metadata and tensor infos, then aligned data."""
    try:
        heads = [f.tell() for f in writer.fout] if writer.fout else [0]
    except (OSError, ValueError, TypeError):
        return None
    align = writer.data_alignment
    data = sum(-(-tensor_nbytes(s.shape, s.ggml_type) // align) * align for s in plan.tensors)
    return sum(-(-h // align) * align for h in heads) + data
