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

from ..errors import InputError, tensor_error
from ..ggml.malloc import MMAP_THRESHOLD
from ..tensors import TensorSpec


def tensor_nbytes(shape: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    block, type_size = GGML_QUANT_SIZES[qtype]
    n = 1
    for d in shape:
        n *= d
    return n // block * type_size


SLAB_ELEMENTS = 1 << 24  # values of a quantized source decoded at a time (64 MB as float32)
_FLOAT_SOURCES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def encode_tensor(spec: TensorSpec) -> np.ndarray:
    """The bytes (as the numpy array GGUFWriter wants) of one tensor in ``spec.ggml_type``: a float tensor of a
    GGUF read by the kernels' threads where the file stores it; a quantized one decoded slab by slab (a row
    reader, ``load_rows``); any other from its values (``load``)."""
    if spec.load_raw is not None and spec.source_type == spec.ggml_type:
        return spec.load_raw()
    from ..ggml.engine import Stored, quantize

    try:
        if spec.stored_at is not None and spec.source_type in _FLOAT_SOURCES:
            out = output_buffer(tensor_nbytes(spec.shape, spec.ggml_type))
            return quantize(
                Stored(*spec.stored_at, spec.source_type, spec.shape),
                spec.ggml_type,
                spec.name,
                importance=spec.importance,
                out=out,
                progress=report_progress(out),
            )
        if spec.load_rows is not None and len(spec.shape) > 1 and spec.n_elements > SLAB_ELEMENTS:
            return _encode_slabs(spec, quantize)
        return quantize(_as_numpy(spec.load()), spec.ggml_type, spec.name, importance=spec.importance)
    except ValueError as exc:  # NaN/Inf, bad row length: the source is at fault, say which tensor
        raise tensor_error(spec.source, spec.name, str(exc)) from None


def _as_numpy(values) -> np.ndarray:
    """A plan's values as numpy (a checkpoint's are torch tensors; bf16, which numpy lacks, widened exactly)."""
    if isinstance(values, np.ndarray):
        return values
    values = values.detach().cpu()
    if str(values.dtype) == "torch.bfloat16":
        return values.float().numpy()
    return values.numpy()


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
        a, b = r0 * total // rows, r1 * total // rows
        quantize(
            _as_numpy(spec.load_rows(r0, r1)),
            spec.ggml_type,
            spec.name,
            importance=imp[r0:r1] if per_expert else imp,
            out=out[a:b],
        )
        if report is not None:
            report(b)
    return out


PREFETCH_BUDGET = 1 << 30  # bytes of two neighbouring tensors above which they are not held at once

# One written tensor's memory, kept for the next tensor of its size when the writer has the budget for it:
# a fresh buffer's pages are faulted in and zeroed by the kernel as the encoder first writes them, a large part of
# a float conversion's time (docs/notes/convert.md).
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
        same = (
            buf is not None
            and isinstance(data, np.ndarray)
            and data.flags.c_contiguous
            and data.nbytes == buf.nbytes
            and data.ctypes.data == buf.ctypes.data
        )
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
    within PREFETCH_BUDGET (or it is the only one): memory stays near the largest tensor."""
    from concurrent.futures import ThreadPoolExecutor

    size = [tensor_nbytes(s.shape, s.ggml_type) for s in specs]
    turn = threading.Condition()
    state = {"written": 0, "stop": False}  # tensors the writer is done with; the file is abandoned

    def held(i: int) -> int:  # bytes encoded ahead of tensor i and not yet written
        return sum(size[state["written"] : i])

    def may_start(i: int) -> bool:
        return state["stop"] or i <= state["written"] or held(i) + size[i] <= PREFETCH_BUDGET

    def wait_turn(i: int) -> int:
        with turn:
            turn.wait_for(lambda: may_start(i))
            if state["stop"]:
                raise _Abandoned
            return held(i)

    def checked(i: int, progress: _Progress) -> np.ndarray:
        spec = specs[i]
        inflight = wait_turn(i)
        # a buffer of this size kept for reuse: encoded ahead (``inflight`` bytes being written meanwhile), it
        # can be a third tensor in memory, so only within the look-ahead's budget; encoded alone (the tensors
        # too big to overlap), the one kept is the buffer this tensor then takes: never more than one tensor,
        # and a multi-GB expert stack is not mapped and faulted in afresh after each one of its size
        _keep_spare(size[i] if not inflight or inflight + 2 * size[i] <= PREFETCH_BUDGET else 0)
        _encoding.progress = progress
        try:
            data = encode_tensor(spec)
        finally:
            _encoding.progress = None
            progress.finish()
        if data.nbytes != size[i]:
            raise InputError(spec.source, f"produced {data.nbytes} bytes, expected {size[i]} for {spec.ggml_type.name}")
        return data

    encoder = ThreadPoolExecutor(max_workers=1)
    progress = [_Progress() for _ in specs]
    futures = [encoder.submit(checked, i, progress[i]) for i in range(len(specs))]
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
    finally:
        with turn:
            state["stop"] = True
            turn.notify_all()
        for f in futures:
            if f is not None:
                f.cancel()
        encoder.shutdown(wait=True)
        _keep_spare(0)  # nothing kept past the file


class _Abandoned(Exception):
    """The writer stopped (an error, an interrupt): tensors still waiting for their turn are not encoded."""
