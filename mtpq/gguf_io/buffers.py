"""A plan's tensors encoded and handed to the writer: one tensor's bytes at a time, the next one encoded while
the current one is written, each written as its rows are finished, in buffers reused from tensor to tensor.
Peak memory stays near the largest single tensor, never the model."""

from __future__ import annotations

import mmap
import threading
import weakref
from typing import Callable, Iterator

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import InputError
from ..ggml import from_file, pool as workers_pool
from ..ggml.from_file import as_float32
from ..ggml.malloc import MMAP_THRESHOLD
from ..tensors import TensorSpec


def tensor_nbytes(shape: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    block, type_size = GGML_QUANT_SIZES[qtype]
    n = 1
    for d in shape:
        n *= d
    return n // block * type_size


SLAB_ELEMENTS = 1 << 24  # values a big tensor is encoded in at a time (64 MB as float32)


def encode_tensor(spec: TensorSpec) -> np.ndarray:
    """The bytes (as the numpy array GGUFWriter wants) of one tensor in ``spec.ggml_type``; a big one with a row
    reader (``load_rows``) slab by slab, into its place in one output buffer."""
    if spec.load_raw is not None and spec.source_type == spec.ggml_type:
        return spec.load_raw()
    try:
        if spec.stored_at is not None and spec.source_type in _NUMPY_SOURCES and spec.ggml_type != spec.source_type:
            # workers read their chunks from the file and quantize them in cache (no whole-tensor read first);
            # numpy's types without torch, the others through kernels (their weights checked, tables built)
            if spec.ggml_type in from_file.SEARCH_TYPES and not from_file.torch_free(spec.ggml_type, spec.importance):
                from ..ggml.kernels import quantize_stored
            else:
                quantize_stored = from_file.quantize_stored
            out = quantize_stored(*spec.stored_at, spec.source_type, spec.shape, spec.ggml_type, spec.name,
                                  _buffer_and_report, importance=spec.importance,
                                  defer=getattr(_encoding, "defer", False))
            if out is not None:
                from_file.label_deferred(spec.source)
                return out
        # the paths below that use the pool (kernels.quantize's rows in memory) collect a band left running
        if _numpy_only(spec):  # numpy reads and quantizes it: no torch (~1.5 s to import), no float copy
            from ..ggml.npquant import quantize_rows

            return quantize_rows(_float_values(spec), spec.ggml_type, spec.name)
        from ..ggml.kernels import quantize

        if spec.load_rows is not None and len(spec.shape) > 1 and spec.n_elements > SLAB_ELEMENTS:
            return _encode_slabs(spec, quantize)
        # a float GGUF tensor read straight into a reused buffer (load() copies f32 once more)
        values = _float_values(spec) if _whole_float(spec) else spec.load()
        return quantize(values, spec.ggml_type, name=spec.name, importance=spec.importance)
    except ValueError as exc:  # NaN/Inf, bad row length: the source is at fault, say which tensor
        raise InputError(getattr(exc, "source", None) or spec.source, str(exc)) from None


def settle_previous() -> None:
    """Collect the tensor before's last band of pool work if it was left running (see :func:`encoded`); its
    input error as the InputError that names it."""
    try:
        from_file.settle()
    except from_file.DeferredError as exc:
        if exc.source is None:  # not labelled (label_deferred): a plain ValueError, as the caller's own
            raise ValueError(str(exc)) from None
        raise InputError(exc.source, str(exc)) from None


_NUMPY_SOURCES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def _whole_float(spec: TensorSpec) -> bool:
    """A float tensor read from a GGUF (the only plans with a row reader: there ``load_raw`` holds the very
    values ``load`` gives; a checkpoint's holds them converted to the outtype), small enough to be read whole
    (the bigger ones are encoded slab by slab)."""
    return (spec.load_raw is not None and spec.load_rows is not None and spec.source_type in _NUMPY_SOURCES
            and not (len(spec.shape) > 1 and spec.n_elements > SLAB_ELEMENTS))


def _numpy_only(spec: TensorSpec) -> bool:
    """A float GGUF tensor read whole, of a type :mod:`mtpq.ggml.npquant` writes: the legacy types, and the
    K-quants on one worker (on more, the forked pool runs their search loops, which threads would serialise)."""
    from ..ggml import npquant

    return (from_file.torch_free(spec.ggml_type, spec.importance) and _whole_float(spec)
            and (spec.ggml_type in npquant.NUMPY_TYPES or npquant.workers() < 2))


def _float_values(spec: TensorSpec) -> np.ndarray:
    """The stored values of a float GGUF tensor as float32 numpy, read straight into place for F32."""
    progress = getattr(_encoding, "progress", None)
    _encoding.progress = None  # load_raw reads into an output_buffer: not the tensor's output the writer follows
    try:
        raw = spec.load_raw()
    finally:
        _encoding.progress = progress
    return as_float32(raw.view(np.uint16) if spec.source_type == GGMLQuantizationType.BF16 else raw)


def _encode_slabs(spec: TensorSpec, quantize: Callable) -> np.ndarray:
    """Slabs along dim 0 (whole experts of a stack, bands of rows), each encoded as the whole tensor's rows are:
    every ggml type encodes a row on its own, an imatrix weighs each expert's rows with that expert's row, so
    the bytes are those of encoding the tensor at once. The writer writes each slab's rows once encoded."""
    rows = spec.shape[0]
    total = tensor_nbytes(spec.shape, spec.ggml_type)
    out = output_buffer(total)
    report = report_progress(out)
    imp = spec.importance
    per_expert = imp is not None and np.ndim(imp) == 2 and len(spec.shape) == 3 and np.shape(imp)[0] == rows > 1
    step = max(1, SLAB_ELEMENTS // (spec.n_elements // rows))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        part = quantize(spec.load_rows(r0, r1), spec.ggml_type, name=spec.name,
                        importance=imp[r0:r1] if per_expert else imp)
        a, b = r0 * total // rows, r1 * total // rows
        out[a:b] = np.ascontiguousarray(part).reshape(-1).view(np.uint8)
        del part
        if report is not None:
            report(b)
    return out


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


def _buffer_and_report(nbytes: int) -> tuple[np.ndarray, Callable[[int], None] | None]:
    out = output_buffer(nbytes)
    return out, report_progress(out)


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


def encoded(specs: list[TensorSpec]) -> Iterator[tuple[TensorSpec, np.ndarray]]:
    """Each spec with its bytes (an :class:`_Ahead`), in order. Tensors are read and encoded in a worker
    thread, one after the other, and written as their rows are finished (file I/O and torch release the GIL);
    the encoder runs ahead of the writer while the tensors encoded and not yet written, with the next one, stay
    within PREFETCH_BUDGET (or it is the only one): memory stays near the largest tensor.

    A tensor's last band of pool work is left running when another tensor follows (see
    :func:`mtpq.ggml.from_file.settle`): the workers go on to the next tensor's first band without waiting for
    this thread, which collects the band after handing that one out (or before it waits for the writer), and
    only then tells the writer the tensor is finished."""
    from concurrent.futures import ThreadPoolExecutor

    size = [tensor_nbytes(s.shape, s.ggml_type) for s in specs]
    turn = threading.Condition()
    state = {"written": 0, "stop": False}  # tensors the writer is done with; the file is abandoned

    def held(i: int) -> int:  # bytes encoded ahead of tensor i and not yet written
        return sum(size[state["written"]:i])

    def may_start(i: int) -> bool:
        return state["stop"] or i <= state["written"] or held(i) + size[i] <= PREFETCH_BUDGET

    def wait_turn(i: int) -> int:
        with turn:
            if may_start(i):
                return held(i)
        settle_previous()  # the writer may be waiting for the tensor before: collect its band first
        with turn:
            turn.wait_for(lambda: may_start(i))
            if state["stop"]:
                raise _Abandoned
            return held(i)

    def checked(i: int, progress: _Progress) -> np.ndarray:
        spec, last = specs[i], i + 1 == len(specs)
        inflight = wait_turn(i)
        # a buffer of this size kept for reuse: encoded ahead (``inflight`` bytes being written meanwhile), it
        # can be a third tensor in memory, so only within the look-ahead's budget; encoded alone (the tensors
        # too big to overlap), the one kept is the buffer this tensor then takes: never more than one tensor,
        # and a multi-GB expert stack is not mapped and faulted in afresh after each one of its size
        _keep_spare(size[i] if not inflight or inflight + 2 * size[i] <= PREFETCH_BUDGET else 0)
        _encoding.progress, _encoding.defer = progress, not last
        try:
            data = encode_tensor(spec)
            if last:
                settle_previous()  # no tensor follows to collect a band left running
        except BaseException:
            settle_previous()  # the tensor before, still waited for by the writer (its error comes first)
            raise
        finally:
            _encoding.progress, _encoding.defer = None, False
            if not from_file.after_settle(progress.finish):
                progress.finish()
        if data.nbytes != size[i]:
            raise InputError(spec.source, f"produced {data.nbytes} bytes, expected {size[i]} for {spec.ggml_type.name}")
        return data

    # the quantization workers, if any tensor wants them, are forked once for the file (see ggml.pool)
    with workers_pool.scope():
        encoder = ThreadPoolExecutor(max_workers=1)
        progress = [_Progress() for _ in specs]
        futures = [encoder.submit(checked, i, progress[i]) for i in range(len(specs))]
        complete = False
        try:
            for i, spec in enumerate(specs):
                # every tensor is written as its rows are finished: one too big to be encoded ahead still
                # overlaps its own encoding and writing
                data = _Ahead(futures[i], progress[i], size[i])
                yield spec, data
                del data  # written: not held while later tensors are encoded
                futures[i] = progress[i] = None
                with turn:
                    state["written"] = i + 1
                    turn.notify_all()
            complete = True
        finally:
            with turn:
                state["stop"] = True
                turn.notify_all()
            for f in futures:
                if f is not None:
                    f.cancel()
            if not complete:  # an error or an interrupt: the workers' queued chunks are of no use now
                workers_pool.abandon()
            encoder.shutdown(wait=True)
            if not complete:
                from_file.discard()  # a band the tensor being encoded left running: its pool is gone
            _keep_spare(0)  # nothing kept past the file


class _Abandoned(Exception):
    """The writer stopped (an error, an interrupt): tensors still waiting for their turn are not encoded."""
