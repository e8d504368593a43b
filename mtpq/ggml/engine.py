"""The one way to the kernels: :func:`quantize` and :func:`dequantize`, for every type in :mod:`.registry`.

``quantize`` takes the values as an array (float32, float16, or bf16 bits as uint16; the last dimension is a
row, GGUF's ``ne[0]``) or where a file stores them (:class:`Stored`), and returns what gguf-py's
``GGUFWriter`` takes with ``raw_dtype=qtype``: uint8 ``(..., bytes_per_row)`` for the block types, float32 /
float16 / bf16 bits as uint16 of the values' shape for the float types. The bytes are those of ggml's
``ggml_quantize_chunk`` (``llama-quantize``), with ``importance`` (an imatrix's weights: one per column, or one
row per expert of a 3-D stack) its importance-weighted ones.

The rows are cut into chunks of about ``CHUNK`` values (whole rows, never two experts), each read (from the
array, or from the file with ``pread``), widened to float32, checked for NaN/Inf, quantized and its fp16
scales checked, by :func:`workers` threads: the kernels release the GIL. A first use compiles the kernels
(seconds; numba keeps them on disk for later runs) and says so on stderr.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as T

from . import floats, jit, malloc
from .registry import FLOAT_TYPES, GgmlType, bytes_per_row, record

__all__ = ["Stored", "quantize", "dequantize", "workers", "set_workers", "bytes_per_row"]

CHUNK = 1 << 17  # values per task: 512 KB of float32, in L2 while it is read, checked and quantized
REPORT_EVERY = 8  # tasks between progress reports: each wakes the writer for one write
_KIND = {T.F32: floats.F32, T.BF16: floats.BF16, T.F16: floats.F16}
_FLOAT_DTYPE = {T.F32: np.float32, T.F16: np.float16, T.BF16: np.uint16}  # how numpy holds each float type
_ITEM = {floats.F32: 4, floats.BF16: 2, floats.F16: 2}
_NONE = np.empty(0, np.float32)


@dataclass(frozen=True)
class Stored:
    """Float values a file holds in C order: ``dtype`` F32/F16/BF16 at byte ``offset``, torch-order ``shape``."""

    path: str | Path
    offset: int
    dtype: T
    shape: tuple[int, ...]


# --------------------------------------------------------------------------- threads

_state: dict = {"n": None, "pool": None, "size": 0}
_lock = threading.Lock()


def set_workers(n: int) -> None:
    """``--threads``: how many threads share a tensor's chunks."""
    _state["n"] = max(1, int(n))


def workers() -> int:
    """The thread count: what :func:`set_workers` set, else the CPUs this process may use."""
    if _state["n"] is not None:
        return _state["n"]
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _pool(n: int) -> ThreadPoolExecutor:
    with _lock:
        if _state["pool"] is None or _state["size"] != n:
            if _state["pool"] is not None:
                _state["pool"].shutdown(wait=False)
            _state["pool"], _state["size"] = ThreadPoolExecutor(n, thread_name_prefix="mtpq-quant"), n
        return _state["pool"]


def _share(n_tasks: int, run: Callable[[int], None], finished: Callable[[int], None] | None) -> None:
    """``run(i)`` for every task i, task 0 first and alone (a first call may compile: never twice at once), the
    rest shared by :func:`workers` threads: this one and the pool's, each taking the next task as it finishes
    one. ``finished(k)`` is called in this thread when tasks 0..k-1 are all done (the writer writes that
    prefix while the rest is encoded): once the prefix has grown by REPORT_EVERY tasks, and at the end. A
    failed task stops the others after their current one; its error is raised once no task runs (none may
    still write into the output).

    No future per task: with one, the thread waiting on them woke once per task, and those wake-ups (~10k per
    GB) cost the fast types a third of their marginal time at two threads (docs/notes/quantize.md)."""
    reported = 0

    def report(prefix: int) -> None:
        nonlocal reported
        if finished is not None and (prefix - reported >= REPORT_EVERY or prefix == n_tasks > reported):
            reported = prefix
            finished(prefix)

    run(0)
    n = min(workers(), n_tasks - 1)
    if n <= 1:
        for i in range(1, n_tasks):
            report(i)
            run(i)
        report(n_tasks)
        return
    nxt = itertools.count(1)  # next() on it is atomic under the GIL: each task is taken once
    done = bytearray(n_tasks)
    done[0] = 1
    failed: list[BaseException] = []

    def take(reporting: bool) -> None:
        prefix = 1
        for i in nxt:
            if i >= n_tasks or failed:
                return
            try:
                run(i)
            except BaseException as e:
                failed.append(e)
                return
            done[i] = 1
            if reporting:  # this thread: the finished prefix as it grows
                while prefix < n_tasks and done[prefix]:
                    prefix += 1
                report(prefix)

    helpers = [_pool(n - 1).submit(take, False) for _ in range(n - 1)]
    try:
        take(True)
    finally:
        for h in helpers:
            h.result()  # wait: no task may still write into the output (take() keeps the errors in failed)
    if failed:
        raise failed[0]
    report(n_tasks)


_scratch = threading.local()  # each thread's buffers for the chunk it reads and widens


def _buffer(name: str, n: int, dtype) -> np.ndarray:
    buf = getattr(_scratch, name, None)
    if buf is None or buf.size < n:
        buf = np.empty(max(n, CHUNK), dtype=dtype)
        setattr(_scratch, name, buf)
    return buf[:n]


# --------------------------------------------------------------------------- first use

_ready: set = set()  # kernels known to be compiled in this process or cached on disk


def _cached(kernel) -> bool:
    """Whether numba has ``kernel`` compiled in this process or in its cache folder (an index file there)."""
    kernel = getattr(kernel, "kernel", kernel)
    if kernel in _ready or getattr(kernel, "signatures", None):
        return True
    cache = getattr(kernel, "_cache", None)
    try:
        found = os.path.exists(cache._cache_file._index_path)
    except AttributeError:  # not a numba kernel, or numba's internals moved: nothing to say
        found = True
    if found:
        _ready.add(kernel)
    return found


def _first_use(kernels: list, label: str) -> None:
    """Say on stderr, once per process, that the kernels about to run get compiled (seconds; once)."""
    if not _told and not all(_cached(k) for k in kernels if k is not None):
        _told.append(True)
        print(
            f"mtpq: compiling the {label} kernels (once: later runs load them from {jit.CACHE_DIR})",
            file=sys.stderr,
            flush=True,
        )


_told: list[bool] = []


# --------------------------------------------------------------------------- quantize


class _Source:
    """Rows r0:r1 of the values as float32, from an array or a file, and the raw bits for pass-through."""

    def __init__(self, source, name: str):
        if isinstance(source, Stored):
            if T(source.dtype) not in _KIND:
                raise ValueError(f"{name}: stored values of type {T(source.dtype).name} are not floats")
            self.shape, self.kind, self.array = tuple(source.shape), _KIND[T(source.dtype)], None
            self.fd, self.offset = os.open(source.path, os.O_RDONLY), source.offset
        else:
            a = np.asarray(source)
            self.kind = next((_KIND[t] for t, d in _FLOAT_DTYPE.items() if a.dtype == d), None)
            if self.kind is None:  # any other dtype: its values as float32
                a, self.kind = a.astype(np.float32), floats.F32
            self.shape = a.shape if a.ndim else (1,)
            self.array, self.fd = np.ascontiguousarray(a).reshape(-1, self.shape[-1]), -1
        self.n = self.shape[-1]
        self.rows = int(np.prod(self.shape[:-1], dtype=np.int64))

    def raw(self, r0: int, r1: int) -> np.ndarray:
        """The stored bytes of rows r0:r1 (a view of the array, or this thread's read buffer)."""
        if self.array is not None:
            return self.array[r0:r1].reshape(-1).view(np.uint8)
        size = _ITEM[self.kind]
        nbytes = (r1 - r0) * self.n * size
        buf = _buffer("raw", nbytes, np.uint8)
        view, at, got = memoryview(buf), self.offset + r0 * self.n * size, 0
        while got < nbytes:
            k = os.preadv(self.fd, [view[got:]], at + got)
            if k == 0:
                raise ValueError("the file ends within this tensor's data (truncated)")
            got += k
        return buf

    def values(self, r0: int, r1: int, raw: np.ndarray | None = None) -> np.ndarray:
        """Rows r0:r1 (whose bytes ``raw`` are, if read already) as writable contiguous float32 (the kernels'
        one signature)."""
        raw = self.raw(r0, r1) if raw is None else raw
        if self.kind == floats.F32 and raw.flags.writeable:  # this thread's read buffer, or the array's rows
            return raw.view(np.float32)
        x = _buffer("x", (r1 - r0) * self.n, np.float32)
        if self.kind == floats.F32:  # a read-only array's rows: copied, the kernels take writable arrays
            x[:] = raw.view(np.float32)
        else:
            floats.widen(raw, self.kind, x)
        return x

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _importance(importance, src: _Source, name: str) -> np.ndarray | None:
    """float32 (n,) or (n_expert, n) weights, checked against the values."""
    if importance is None:
        return None
    imp = np.asarray(importance, dtype=np.float32)
    if imp.ndim == 2 and imp.shape[0] == 1:
        imp = imp[0]
    if imp.shape == (src.n,) or (len(src.shape) == 3 and imp.shape == (src.shape[0], src.n)):
        return np.ascontiguousarray(imp)
    raise ValueError(
        f"{name}: importance data of shape {tuple(imp.shape)} does not fit a tensor of shape {tuple(src.shape)}"
    )


def _tasks(src: _Source, imp: np.ndarray | None) -> list[tuple[int, int, np.ndarray]]:
    """(row0, row1, importance row) chunks: whole rows, about CHUNK values, one expert's rows at a time."""
    step = max(1, CHUNK // max(src.n, 1))
    if imp is not None and imp.ndim == 2:
        per = src.rows // imp.shape[0]
        return [
            (e * per + r, e * per + min(per, r + step), imp[e])
            for e in range(imp.shape[0])
            for r in range(0, per, step)
        ]
    w = _NONE if imp is None else imp
    return [(r, min(src.rows, r + step), w) for r in range(0, src.rows, step)]


def _encoder(rec: GgmlType, weighted: bool, check_scales: bool, name: str) -> Callable:
    """The function that encodes one chunk's float32 values ``x`` into ``y``."""
    qtype = rec.qtype
    if qtype in FLOAT_TYPES:

        def narrow(x, y, n, qw):
            if qtype == T.F32:
                y.view(np.float32)[:] = x
                return
            ok = (floats.to_f16 if qtype == T.F16 else floats.to_bf16)(x, y)
            if check_scales and not ok:
                what = "F16 range (|x| > 65504)" if qtype == T.F16 else "BF16 range (round to inf)"
                raise ValueError(f"{name}: values exceed the {what}")

        return narrow
    kernel = rec.quantize_weighted if weighted else rec.quantize
    fields = np.array(rec.fp16_fields, np.int64)

    def encode(x, y, n, qw):
        if weighted:
            kernel(x, y, n, qw)
        else:
            kernel(x, y, n)
        if check_scales and (
            floats.iq1_m_overflow(y) if qtype == T.IQ1_M else floats.fp16_overflow(y, rec.type_size, fields)
        ):
            raise ValueError(
                f"{name}: values too large for {qtype.name}: a block scale overflows fp16 "
                "(llama-quantize rejects such data too)"
            )

    return encode


def quantize(
    source,
    qtype,
    name: str = "tensor",
    *,
    importance=None,
    check_scales: bool = True,
    out: np.ndarray | None = None,
    progress: Callable[[int], None] | None = None,
) -> np.ndarray:
    """ggml's encoding of ``source`` (an array, or :class:`Stored` values of a file) in ``qtype``.

    ``importance``: llama-quantize's ``--imatrix`` weights of the tensor; types without a weighted path ignore
    them, as ggml does. ``out``: a uint8 buffer of the output's size to fill (else one is allocated);
    ``progress`` is called with the length of its final prefix as chunks finish. ValueError naming the tensor
    for NaN/Inf, a row that is not whole blocks, a type that needs an imatrix and has none, mismatched
    importance, and -- as llama-quantize -- data whose fp16 scales (or F16/BF16 values) overflow;
    ``check_scales=False`` skips that last check and keeps what ggml writes."""
    rec = record(qtype)
    src = _Source(source, name)
    try:
        if src.n % rec.block_size:
            raise ValueError(
                f"{name}: row length {src.n} is not a multiple of the {rec.qtype.name} block size {rec.block_size}"
            )
        imp = _importance(importance, src, name) if rec.quantize_weighted is not None else None
        if rec.requires_imatrix and imp is None:
            raise ValueError(f"{name}: {rec.qtype.name} needs an importance matrix (imatrix), none given")
        return _run(src, rec, imp, check_scales, name, out, progress)
    finally:
        src.close()


def _output_shape(src: _Source, rec: GgmlType) -> tuple[tuple[int, ...], np.dtype]:
    if rec.qtype in FLOAT_TYPES:
        return src.shape, np.dtype(_FLOAT_DTYPE[rec.qtype])
    return (*src.shape[:-1], src.n // rec.block_size * rec.type_size), np.dtype(np.uint8)


def _run(src: _Source, rec: GgmlType, imp, check_scales: bool, name: str, out, progress) -> np.ndarray:
    shape, dtype = _output_shape(src, rec)
    row_bytes = src.n // rec.block_size * rec.type_size
    nbytes = src.rows * row_bytes
    if out is None or out.nbytes != nbytes or out.dtype != np.uint8:
        out = np.empty(nbytes, dtype=np.uint8)
    flat = out.reshape(-1)
    encode = None if _KIND.get(rec.qtype) == src.kind else _encoder(rec, imp is not None, check_scales, name)

    def one(task: tuple[int, int, np.ndarray]) -> None:
        r0, r1, w = task
        y = flat[r0 * row_bytes : r1 * row_bytes]
        if encode is None:  # already in the target type: the bits pass, once checked
            raw = src.raw(r0, r1)
            if not floats.all_finite(src.values(r0, r1, raw)):
                raise ValueError(f"{name}: contains NaN/Inf values")
            y[:] = raw
            return
        x = src.values(r0, r1)
        if not floats.all_finite(x):
            raise ValueError(f"{name}: contains NaN/Inf values")
        encode(x, y, src.n, w)

    malloc.keep_freed_buffers()
    tasks = _tasks(src, imp)
    if not tasks:
        return out.view(dtype).reshape(shape)
    widens = src.kind != floats.F32  # float32, from an array or a file, goes to the kernels as it is
    kernels = [
        rec.quantize_weighted if imp is not None else rec.quantize,
        floats.widen if widens else None,
        floats.all_finite,
        {T.F16: floats.to_f16, T.BF16: floats.to_bf16}.get(rec.qtype),
    ]
    if check_scales and rec.fp16_fields:
        kernels.append(floats.fp16_overflow)
    _first_use(kernels, rec.qtype.name)
    _share(
        len(tasks),
        lambda i: one(tasks[i]),
        None if progress is None else lambda k: progress(tasks[k - 1][1] * row_bytes),
    )
    return out.view(dtype).reshape(shape)


# --------------------------------------------------------------------------- dequantize


def dequantize(raw, qtype, shape) -> np.ndarray:
    """The float32 values (of ``shape``) that ``raw`` (a type's bytes, any array of them) holds."""
    rec = record(qtype)
    shape = tuple(int(s) for s in shape)
    count = int(np.prod(shape, dtype=np.int64))
    a = np.ascontiguousarray(raw)
    if rec.qtype in FLOAT_TYPES and a.dtype != np.uint8:
        if rec.qtype == T.BF16:
            return (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
        return a.astype(np.float32).reshape(shape)
    b = a.reshape(-1).view(np.uint8)
    if shape and shape[-1] % rec.block_size:
        raise ValueError(
            f"dequantize: row length {shape[-1]} is not a multiple of the {rec.qtype.name} block size {rec.block_size}"
        )
    if b.size != count // rec.block_size * rec.type_size:
        raise ValueError(
            f"dequantize: {b.size} bytes given, {rec.qtype.name} {shape} needs "
            f"{count // rec.block_size * rec.type_size}"
        )
    if rec.qtype in FLOAT_TYPES:
        return dequantize(b.view(_FLOAT_DTYPE[rec.qtype]), qtype, shape)
    x = np.empty(count, dtype=np.float32)
    if not b.flags.writeable:
        b = b.copy()
    step = CHUNK * 8 // rec.block_size  # blocks per task
    nb = count // rec.block_size
    parts = [(k, min(nb, k + step)) for k in range(0, nb, step)]

    def one(p: tuple[int, int]) -> None:
        rec.dequantize(b[p[0] * rec.type_size : p[1] * rec.type_size], x[p[0] * rec.block_size : p[1] * rec.block_size])

    if not parts:
        return x.reshape(shape)
    _first_use([rec.dequantize], rec.qtype.name)
    _share(len(parts), lambda i: one(parts[i]), None)
    return x.reshape(shape)


def warm(qtypes=None) -> None:
    """Compile (or load from numba's cache) the kernels of ``qtypes`` (default: every type), with and without
    importance, and their dequantizers: what a test session or a first run does once."""
    from .registry import TYPES

    for qtype in qtypes or TYPES:
        rec = record(qtype)
        x = np.linspace(-1, 1, 2 * max(rec.block_size, 256), dtype=np.float32).reshape(2, -1)
        weights = [None, np.ones(x.shape[1], np.float32)] if rec.quantize_weighted is not None else [None]
        for w in weights:
            if w is None and rec.requires_imatrix:
                continue
            y = quantize(x, qtype, "warm", importance=w)
        dequantize(y, qtype, x.shape)
