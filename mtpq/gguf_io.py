"""Reading GGUF files into plans and streaming plans into GGUF files.

Both directions use gguf-py (GGUFReader, GGUFWriter); nothing here serializes
GGUF by hand. The writer streams: header, metadata and tensor infos first, then
each tensor's bytes as soon as it is produced, so peak memory stays near the
largest single tensor. Output goes to a temporary file beside the target and is
renamed only when complete.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import shutil
import threading
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, Keys
from gguf.gguf_writer import GGUFValue

from .errors import InputError
from .malloc import MMAP_THRESHOLD
from .tensors import Plan, TensorSpec, block_index, classify

FLOAT_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
_INT_TYPES = {GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
              GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64}


# ----------------------------------------------------------------------------- reading


class _CheckedReader(GGUFReader):
    """GGUFReader that checks every tensor's byte range before gguf-py maps it, so a truncated or
    corrupt file is refused with what is wrong with it instead of numpy's reshape message."""

    def __init__(self, path: Path):
        self._path = path
        super().__init__(path)

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        size = len(self.data)
        ranges = []
        for field in fields:
            _name_len, name_data, _n_dims, dims, raw_dtype, offset_tensor = field.parts
            name = bytes(name_data).decode("utf-8", "replace")
            try:
                qtype = GGMLQuantizationType(int(raw_dtype[0]))
                block, type_size = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise InputError(self._path, f"tensor {name} has unknown ggml type {int(raw_dtype[0])}") from None
            dims = [int(d) for d in dims]
            if dims and dims[0] % block:
                raise InputError(self._path, f"tensor {name}: row length {dims[0]} is not a multiple of "
                                             f"{qtype.name}'s block size {block}")
            n_elems = 1
            for d in dims:
                n_elems *= d
            start = int(start_offs) + int(offset_tensor[0])
            end = start + n_elems // block * type_size
            if end > size:
                raise InputError(self._path, f"truncated: tensor {name} ends at byte {end}, the file has {size}")
            ranges.append((start, end, name))
        ranges.sort()
        for (_, end_a, a), (start_b, _, b) in zip(ranges, ranges[1:]):
            if start_b < end_a:
                raise InputError(self._path, f"corrupt: the data of tensors {a} and {b} overlap")
        super()._build_tensors(start_offs, fields)


def open_gguf(path: Path) -> GGUFReader:
    """Open a GGUF file (memory-mapped) or raise an InputError naming it."""
    path = Path(path)
    if path.is_dir():
        raise InputError(path, "is a folder, not a GGUF file")
    if not path.is_file():
        raise InputError(path, "no such file")
    try:
        return _CheckedReader(path)
    except InputError:
        raise
    except IndexError:  # gguf-py read past the end while parsing metadata or tensor infos
        raise InputError(path, f"truncated or corrupt GGUF header (the file has {path.stat().st_size} bytes)") from None
    except Exception as exc:  # gguf-py raises ValueError/struct errors on bad files
        raise InputError(path, f"not a readable GGUF file ({exc})") from None


def _count_key(reader: GGUFReader, kv: dict[str, GGUFValue], key: str, path: Path) -> int:
    """An integer metadata value (0 when absent); any other type is an InputError."""
    if key not in kv:
        return 0
    val = kv[key]
    if val.type not in _INT_TYPES or isinstance(val.value, (list, str)):
        raise InputError(path, f"metadata {key} must be an integer, got {val.value!r}")
    return int(val.value)


def reader_kv(reader: GGUFReader) -> dict[str, GGUFValue]:
    """The metadata of a GGUF as GGUFWriter values, without the header fields and the arch."""
    kv: dict[str, GGUFValue] = {}
    for name, fld in reader.fields.items():
        if name.startswith("GGUF.") or name == Keys.General.ARCHITECTURE:
            continue
        vtype = GGUFValueType(fld.types[0])
        sub = GGUFValueType(fld.types[-1]) if vtype == GGUFValueType.ARRAY else None
        kv[name] = GGUFValue(fld.contents(), vtype, sub)
    return kv


def reader_arch(reader: GGUFReader, path: Path) -> str:
    fld = reader.fields.get(Keys.General.ARCHITECTURE)
    if fld is None:
        raise InputError(path, "GGUF has no general.architecture")
    return fld.contents()


class GGUFFile:
    """One GGUF file opened for reading: metadata as plain Python values, tensors by name, and the
    trunk/MTP split. The one reader of the package: plans (:func:`plan_from_gguf`), ``inspect`` and the
    runtime all see a file through it."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.reader = open_gguf(self.path)
        self.arch = reader_arch(self.reader, self.path)
        self.kv: dict[str, Any] = {n: f.contents() for n, f in self.reader.fields.items() if not n.startswith("GGUF.")}
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.n_blocks = int(self.value("block_count", 0) or 0)
        self.n_mtp = int(self.value("nextn_predict_layers", 0) or 0)
        self.n_trunk = self.n_blocks - self.n_mtp  # MTP blocks are numbered n_trunk .. n_blocks-1

    def value(self, key: str, default: Any = None) -> Any:
        """Metadata value; a ``key`` without a ``general.``/``tokenizer.`` prefix is taken as ``{arch}.key``."""
        full = key if key.startswith(("general.", "tokenizer.")) else f"{self.arch}.{key}"
        return self.kv.get(full, default)

    def require(self, key: str) -> Any:
        v = self.value(key)
        if v is None:
            raise InputError(self.path, f"missing metadata {self.arch}.{key}")
        return v

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        """Torch order (rows..., row length); GGUF stores ne[0] = row length first."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape.tolist()))

    def qtype(self, name: str) -> GGMLQuantizationType:
        return GGMLQuantizationType(self.tensors[name].tensor_type)


def _raw_loader(t) -> Callable[[], np.ndarray]:
    return lambda: np.asarray(t.data)


def _float_loader(t, shape: tuple[int, ...]) -> Callable[[], torch.Tensor]:
    def load() -> torch.Tensor:
        qtype = GGMLQuantizationType(t.tensor_type)
        data = np.asarray(t.data)
        if qtype == GGMLQuantizationType.BF16:
            return torch.from_numpy(data.view(np.uint16).astype(np.int32) << 16).view(torch.float32).reshape(shape)
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            return torch.from_numpy(data.astype(np.float32)).reshape(shape)
        from .quantize.kernels import dequantize

        return dequantize(data, qtype, shape)

    return load


def plan_from_gguf(path: Path) -> Plan:
    """A plan that rewrites ``path`` unchanged: every tensor keeps its type and bytes."""
    path = Path(path)
    reader = open_gguf(path)
    arch = reader_arch(reader, path)
    kv = reader_kv(reader)
    n_blocks = _count_key(reader, kv, f"{arch}.block_count", path)
    n_mtp = _count_key(reader, kv, f"{arch}.nextn_predict_layers", path)
    if n_mtp and n_mtp >= n_blocks:
        raise InputError(path, f"metadata contradicts itself: {arch}.nextn_predict_layers is {n_mtp}, but "
                               f"{arch}.block_count is {n_blocks} (trunk + MTP blocks; no trunk would be left)")
    n_trunk = n_blocks - n_mtp
    specs = []
    for t in reader.tensors:
        bid = block_index(t.name)
        if bid is not None and bid >= n_blocks and f"{arch}.block_count" in kv:
            raise InputError(path, f"tensor {t.name} is in block {bid}, but {arch}.block_count is {n_blocks}")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF ne order -> torch order
        qtype = GGMLQuantizationType(t.tensor_type)
        specs.append(
            TensorSpec(
                name=t.name,
                shape=shape,
                role=classify(t.name, shape, n_trunk),
                ggml_type=qtype,
                load=_float_loader(t, shape),
                source=f"{path.name}:{t.name}",
                source_type=qtype,
                load_raw=_raw_loader(t),
                reason="kept as stored",
            )
        )
    return Plan(arch=arch, kv=kv, tensors=specs, inputs=[path], n_trunk_layers=n_trunk, n_mtp_layers=n_mtp)


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


# ----------------------------------------------------------------------------- writing


def tensor_nbytes(shape: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    from gguf import GGML_QUANT_SIZES

    block, type_size = GGML_QUANT_SIZES[qtype]
    n = 1
    for d in shape:
        n *= d
    return n // block * type_size


def encode_tensor(spec: TensorSpec) -> np.ndarray:
    """The bytes (as the numpy array GGUFWriter wants) of one tensor in ``spec.ggml_type``."""
    if spec.load_raw is not None and spec.source_type == spec.ggml_type:
        return spec.load_raw()
    from .quantize.kernels import quantize

    try:
        return quantize(spec.load(), spec.ggml_type, name=spec.name, importance=spec.importance)
    except ValueError as exc:  # NaN/Inf, bad row length: the source is at fault, say which tensor
        raise InputError(spec.source, str(exc)) from None


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


def remove_stale_partials(out: Path) -> list[Path]:
    """Remove ``.NAME.partial-PID`` files beside ``out`` whose process is gone (a SIGKILL leaves them:
    it cannot be caught). A live process's temporary file is left alone. Returns what was removed."""
    removed = []
    prefix = f".{out.name}.partial-"
    try:
        candidates = [p for p in out.parent.iterdir() if p.name.startswith(prefix)]
    except OSError:
        return removed
    for p in candidates:
        pid = p.name[len(prefix):].removesuffix(".d")  # (.d: a folder of a run's temporaries, see partial_folder)
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
                removed.append(p)
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


@contextlib.contextmanager
def atomic_output(out: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``out``; rename it to ``out`` only if the body succeeds.

    Whatever stops the body (an error, Ctrl-C, SIGTERM via the CLI's handler) removes the
    temporary file; stale ones of killed earlier runs are removed first. A full disk is an
    InputError naming ``out`` and how far the write got.
    """
    out = Path(out)
    if out.is_dir():
        raise InputError(out, "output path is a directory")
    if not out.parent.exists():
        raise InputError(out, f"output folder {out.parent} does not exist")
    if not out.parent.is_dir():
        raise InputError(out, f"{out.parent} is not a folder")
    remove_stale_partials(out)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, out)
    except OSError as exc:
        if exc.errno != errno.ENOSPC and not _disk_full(out.parent):
            raise
        wrote = tmp.stat().st_size if tmp.exists() else 0
        expected = getattr(exc, "expected_bytes", None)
        of = f" of {expected}" if expected else ""
        raise InputError(out, f"no space left on device (wrote {wrote}{of} bytes)") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def write_plan(
    plan: Plan,
    out: Path,
    *,
    on_tensor: Callable[[TensorSpec, int], None] | None = None,
) -> None:
    """Stream ``plan`` to ``out`` atomically. ``on_tensor(spec, nbytes)`` reports progress."""
    check_not_an_input(out, plan.inputs)
    with atomic_output(out) as tmp:
        writer = GGUFWriter(tmp, plan.arch)
        for key, val in plan.kv.items():
            writer.add_key_value(key, val.value, val.type, sub_type=val.sub_type)
        for spec in plan.tensors:
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
                for spec, data in _encoded(plan.tensors):
                    writer.write_tensor_data(data)
                    if on_tensor is not None:
                        on_tensor(spec, data.nbytes)
                    del data
            finally:
                writer.close()
        except OSError as exc:
            exc.expected_bytes = expected  # a full disk's message says how far the write got
            raise


def _expected_size(writer: GGUFWriter, plan: Plan) -> int | None:
    """The size the finished file would have had: header + metadata + tensor infos, then aligned data."""
    try:
        head = writer.fout[0].tell() if writer.fout else 0
    except (OSError, ValueError, TypeError):
        return None
    align = writer.data_alignment
    data = sum(-(-tensor_nbytes(s.shape, s.ggml_type) // align) * align for s in plan.tensors)
    return -(-head // align) * align + data


PREFETCH_BUDGET = 1 << 30  # bytes of two neighbouring tensors above which they are not held at once

# One written tensor's memory, kept for the next tensor of its size when the writer has the budget for it:
# a fresh buffer's pages are faulted in and zeroed by the kernel as the encoder first writes them, a third
# of an FP8 -> bf16 conversion's time (the copy it is measured against writes from one reused buffer).
_spare_lock = threading.RLock()  # also taken by _returned, which runs wherever a buffer's last user drops it
_spare: dict = {"size": 0, "mem": None}


def output_buffer(nbytes: int) -> np.ndarray:
    """A uint8 array of ``nbytes`` for one tensor's encoded bytes (contents unspecified). Big ones are an
    anonymous mapping of their own, reused for the next tensor of that size once written (the writer says
    when it may keep one, :func:`_keep_spare`); the array and every view of it hold the mapping, which goes
    back to the writer when the last goes."""
    if nbytes < MMAP_THRESHOLD:  # below malloc's mmap threshold (malloc.keep_freed_buffers): it reuses its heap
        return _claimed(np.empty(nbytes, dtype=np.uint8))
    with _spare_lock:
        mem, _spare["mem"] = _spare["mem"], None
    if mem is None or len(mem) != nbytes:
        mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared would be shmem: no huge pages
        if hasattr(mmap, "MADV_HUGEPAGE"):
            mem.madvise(mmap.MADV_HUGEPAGE)  # as numpy asks for its big arrays: fewer, cheaper faults
    arr = np.frombuffer(mem, dtype=np.uint8)  # its base is the mapping, not an array: views keep arr alive
    weakref.finalize(arr, _returned, mem)
    return _claimed(arr)


class _Progress:
    """The tensor encoded ahead: its output buffer (the first :func:`output_buffer` of its encoding) and how
    much of it, from the start, is final -- which the writer writes while the rest is encoded."""

    def __init__(self):
        self.cond = threading.Condition()
        self.buf: np.ndarray | None = None
        self.done = 0
        self.finished = False

    def advance(self, nbytes: int) -> None:
        with self.cond:
            self.done = max(self.done, nbytes)
            self.cond.notify_all()

    def finish(self) -> None:
        with self.cond:
            self.finished = True
            self.cond.notify_all()


_encoding = threading.local()  # the _Progress of the tensor this thread encodes ahead, if any


def _claimed(arr: np.ndarray) -> np.ndarray:
    progress = getattr(_encoding, "progress", None)
    if progress is not None and progress.buf is None:
        progress.buf = arr
    return arr


def report_progress(arr: np.ndarray) -> Callable[[int], None] | None:
    """For an encoder that fills an :func:`output_buffer` ``arr`` from its start (called in the thread that
    got it): the function to call with the length of its final prefix as it grows, or None if nobody reads
    it (the writer is not waiting for this tensor)."""
    progress = getattr(_encoding, "progress", None)
    return progress.advance if progress is not None and progress.buf is arr else None


class _Ahead:
    """A tensor still being encoded: GGUFWriter's ``tofile`` writes its buffer's final prefix as it grows,
    then the rest once the encoding returns (rewriting it whole if what returned is not that buffer)."""

    def __init__(self, future, progress: _Progress, nbytes: int):
        self.future, self.progress, self.nbytes = future, progress, nbytes

    def tofile(self, f) -> None:
        p, written, start = self.progress, 0, f.tell()
        while True:
            with p.cond:
                p.cond.wait_for(lambda: p.done > written or p.finished)
                buf, done, finished = p.buf, p.done, p.finished
            if done > written:
                f.write(memoryview(buf)[written:done])
                written = done
            elif finished:
                break
        data = self.future.result()  # the encoder's error, if any
        same = (buf is not None and isinstance(data, np.ndarray) and data.flags.c_contiguous
                and data.nbytes == buf.nbytes and data.ctypes.data == buf.ctypes.data)
        if same:
            f.write(memoryview(buf)[written:])
            return
        if written:
            f.seek(start)
        data.tofile(f)


def _returned(mem: mmap.mmap) -> None:
    with _spare_lock:
        if len(mem) == _spare["size"] and _spare["mem"] is None:
            _spare["mem"] = mem  # else unmapped as it is dropped


def _keep_spare(nbytes: int) -> None:
    """Let a written tensor's buffer of ``nbytes`` be kept for the next one (0: keep none, drop any kept)."""
    with _spare_lock:
        _spare["size"] = nbytes
        if _spare["mem"] is not None and len(_spare["mem"]) != nbytes:
            _spare["mem"] = None


def _encoded(specs: list[TensorSpec]) -> Iterator[tuple[TensorSpec, np.ndarray]]:
    """Each spec with its bytes (an :class:`_Ahead`), in order. Tensors are read and encoded in a worker
    thread, and written as their rows are finished (file I/O and torch release the GIL); the next tensor is
    encoded while the current one is written unless the two together exceed PREFETCH_BUDGET: memory stays
    near the largest tensor."""
    from concurrent.futures import ThreadPoolExecutor

    def checked(spec: TensorSpec, inflight: int, progress: _Progress | None = None) -> np.ndarray:
        # a buffer of this size kept for reuse: encoded ahead (``inflight`` bytes being written meanwhile), it
        # can be a third tensor in memory, so only within the look-ahead's budget; encoded alone (the tensors
        # too big to overlap), the one kept is the buffer this tensor then takes: never more than one tensor,
        # and a multi-GB expert stack is not mapped and faulted in afresh after each one of its size
        size = tensor_nbytes(spec.shape, spec.ggml_type)
        _keep_spare(size if not inflight or inflight + 2 * size <= PREFETCH_BUDGET else 0)
        _encoding.progress = progress
        try:
            data = encode_tensor(spec)
        finally:
            _encoding.progress = None
            if progress is not None:
                progress.finish()
        if data.nbytes != size:
            raise InputError(spec.source, f"produced {data.nbytes} bytes, expected {size} for {spec.ggml_type.name}")
        return data

    size = [tensor_nbytes(s.shape, s.ggml_type) for s in specs]
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:

            def encoding(spec: TensorSpec, inflight: int) -> tuple:  # the future and the progress to follow
                progress = _Progress()
                return pool.submit(checked, spec, inflight, progress), progress

            ahead = None
            for i, spec in enumerate(specs):
                # every tensor is encoded in the worker and written as its rows are finished: one too big to be
                # encoded ahead still overlaps its own encoding and writing; the next one is encoded ahead, once
                # this one is, when the two fit the budget
                data = _Ahead(*(ahead or encoding(spec, 0)), size[i])
                ahead = None
                if i + 1 < len(specs) and size[i] + size[i + 1] <= PREFETCH_BUDGET:
                    ahead = encoding(specs[i + 1], size[i])
                yield spec, data
                del data  # written: not held while the next tensor is encoded
    finally:
        _keep_spare(0)  # nothing kept past the file
