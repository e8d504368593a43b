"""Float tensors of a file quantized where they lie: each pool worker reads its own chunks.

Read whole and then quantized, a tensor crossed memory three times before any arithmetic: read into a buffer
(one thread), copied into the pool's input arena (:mod:`.pool`), read again by a worker. Here a worker
``pread``s its chunk (2**16-2**20 values) into a buffer of its own and quantizes it while it is in cache; the
parent hands out chunk records and copies the bytes back from the output arena. Reading runs on every worker,
and Q8_0/Q4_0/Q5_0's numpy kernels run in processes, out of the GIL that left two threads at 1.3x one.

Two bands are out at a time, in the two halves (slots) of the arenas: the next band is handed out before the
one before is collected, and a tensor's last band is left running while the next tensor's first is handed out
(``defer``, :func:`settle`), so the workers do not wait for the parent between bands and tensors. On a 440 MB
GLM-shaped file that took Q4_0 from 0.70x to 0.78x llama-quantize's throughput and Q8_0 from 1.10x to 1.30x
(benchmarks/quant_bench.py --whole-file): the workers were idle a quarter of the time before.

The pool has one handler for every task, :func:`run_task`: numpy's kernels for those three types and the
K-quants without importance weights (:mod:`.npquant`; so a process that never imported torch still does not),
:mod:`.kernels`' torch ones for the i-quants and the weighted searches (which kernels registers here when it
loads: :data:`torch_piece`), on rows read from the file or found in the input arena
(:func:`mtpq.ggml.kernels.quantize` of rows in memory). No torch is imported here: the torch types come through
:func:`mtpq.ggml.kernels.quantize_stored`, which checks their importance weights and builds their tables first.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from . import malloc, npquant, pool

T = GGMLQuantizationType

# The search-loop types (long runs of short ops, which threads would serialise on the GIL) and the numpy
# ones: what the pool runs.
SEARCH_TYPES = frozenset({T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS,
                          T.IQ2_XXS, T.IQ3_XXS, T.IQ2_XS, T.IQ3_S, T.IQ2_S, T.IQ1_S, T.IQ1_M})
POOLED_TYPES = SEARCH_TYPES | npquant.TORCH_FREE_TYPES

# What a chunk's values are stored as (the "kind" in a task's flags): float32, bf16 bits, float16.
KIND_DTYPES = (np.float32, np.uint16, np.float16)
SOURCE_KINDS = {T.F32: 0, T.BF16: 1, T.F16: 2}

POOL_NAME = "\x00tensor\x00"  # the name in a worker's error message, replaced by the tensor's own in the parent
PATH_BYTES = 4096  # each slot's aux tail: the file that its tasks read from (NUL-terminated)
# Two bands are out at a time, each in a *slot* of its own: half the output arena, half the aux arena (a row of
# importance weights at its start, the file's path at its end). A task's slot is field 9 of its record; a task
# without one (kernels' rows in memory, one band at a time) has slot 0, which then spans both halves.


def slot_bytes(arena) -> int:
    """The size of one slot of ``arena`` (the pool's output or aux arena)."""
    return len(arena) // 2
tables_built: set = set()  # i-quant types whose grid tables this process built (kernels adds to it)
# kernels.pool_piece, set when mtpq.ggml.kernels loads: a worker's torch kernels (a pool forked before lacks it)
torch_piece: Callable | None = None


def task_flags(qtype: T, kind: int, check_scales: bool, weighted: bool, from_file: bool) -> int:
    return int(qtype) | kind << 8 | int(check_scales) << 12 | int(weighted) << 13 | int(from_file) << 14


def pieces(n_rows: int, n: int, bs: int, elems: int) -> list[tuple[int, int, int, int]]:
    """(row0, row1, col0, col1) chunks of about ``elems`` values of an (n_rows, n) matrix, cut at block edges:
    whole rows, or parts of one row (so each is contiguous in a C-ordered tensor)."""
    if n >= elems:
        cols = max(bs, elems // bs * bs)
        return [(r, r + 1, c, min(n, c + cols)) for r in range(n_rows) for c in range(0, n, cols)]
    k = max(1, elems // max(n, 1))
    return [(r, min(n_rows, r + k), 0, n) for r in range(0, n_rows, k)]


def workers_pool(workers: int) -> "pool.Pool | None":
    """The scope's pool of ``workers``; forked again when this process has since loaded the torch kernels or
    built grid tables, which workers forked before lack. With torch, workers inherit one torch thread each."""
    torch = sys.modules.get("torch")
    tag = _tag()
    if torch is None:
        return pool.get(workers, run_task, tag=tag)
    saved = torch.get_num_threads()
    torch.set_num_threads(1)  # inherited by a pool forked now: a worker never enters an OpenMP region
    try:
        return pool.get(workers, run_task, tag=tag)
    finally:
        torch.set_num_threads(saved)


def as_float32(raw: np.ndarray) -> np.ndarray:
    """Stored values (float32, bf16 bits as uint16, float16) as contiguous float32 (exact)."""
    if raw.dtype == np.uint16:
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return np.ascontiguousarray(raw, dtype=np.float32)


# --------------------------------------------------------------------------- in a worker

_open: dict = {"path": None, "fd": -1}
_scratch: dict = {"buf": np.empty(0, dtype=np.uint8)}


def _read_piece(path_area, at: int, n: int, piece: tuple[int, int, int, int], dtype) -> np.ndarray:
    """A piece of the band whose first value lies at byte ``at`` of the file named in ``path_area``, read into
    this worker's scratch buffer (reused: valid until the next task)."""
    r0, r1, c0, c1 = piece
    size = np.dtype(dtype).itemsize
    path = bytes(path_area).split(b"\0", 1)[0]
    if _open["path"] != path:
        if _open["fd"] >= 0:
            os.close(_open["fd"])
        _open["fd"], _open["path"] = os.open(path, os.O_RDONLY), path
    nbytes = (r1 - r0) * (c1 - c0) * size
    if _scratch["buf"].nbytes < nbytes:
        _scratch["buf"] = np.empty(nbytes, dtype=np.uint8)
    view, start, got = memoryview(_scratch["buf"])[:nbytes], at + (r0 * n + c0) * size, 0
    while got < nbytes:
        k = os.preadv(_open["fd"], [view[got:]], start + got)
        if k == 0:
            raise ValueError(f"{POOL_NAME}: the file ends within this tensor's data (truncated)")
        got += k
    return _scratch["buf"][:nbytes].view(dtype).reshape(r1 - r0, c1 - c0)


def run_task(task: tuple[int, ...], arena_in, arena_out, arena_aux) -> None:
    """A pool worker's task: one chunk, from the file (``at``: the band's first byte) or from the band in the
    input arena, quantized into its place in the output arena."""
    malloc.keep_freed_buffers()  # the chunks' temporaries reused, not faulted in afresh (once per process)
    flags, _, n_rows, n, r0, r1, c0, c1, at, slot = task[:10]
    qtype, kind = T(flags & 0xFF), (flags >> 8) & 0xF
    check_scales, weighted, from_file = bool(flags >> 12 & 1), bool(flags >> 13 & 1), bool(flags >> 14 & 1)
    bs, ts = GGML_QUANT_SIZES[qtype]
    dtype = KIND_DTYPES[kind]
    aux_slot = slot_bytes(arena_aux)
    aux = memoryview(arena_aux)[slot * aux_slot:]
    if from_file:
        raw = _read_piece(aux[aux_slot - PATH_BYTES:aux_slot], at, n, (r0, r1, c0, c1), dtype)
    else:
        raw = np.frombuffer(arena_in, dtype=dtype, count=n_rows * n).reshape(n_rows, n)[r0:r1, c0:c1]
    out = np.frombuffer(arena_out, dtype=np.uint8, count=n_rows * (n // bs * ts),
                        offset=slot * slot_bytes(arena_out)).reshape(n_rows, -1)
    dst = out[r0:r1, c0 // bs * ts:c1 // bs * ts]
    if qtype in npquant.TORCH_FREE_TYPES and not weighted:
        assert dst.flags.c_contiguous  # pieces() cuts whole rows or parts of one: the bytes go straight into place
        npquant.quantize_chunk(as_float32(raw).reshape(-1, bs), qtype, POOL_NAME, check_scales, dst.reshape(-1, ts))
    else:  # torch_piece is set: the pool was forked after kernels loaded (workers_pool's tag)
        dst[...] = torch_piece(raw, qtype, check_scales, weighted, (r0, r1, c0, c1), n, aux).reshape(dst.shape)


# --------------------------------------------------------------------------- in the parent

def run_band(workers: "pool.Pool", tasks: list[tuple[int, ...]], name: str, nbytes: int) -> np.ndarray:
    """Run one band's tasks (slot 0); its ``nbytes`` of output (a view of the output arena, valid until the next
    run). A chunk's input error names the tensor ``name``."""
    return _Band(workers, workers.submit(tasks), 0, name, nbytes).result()


class _Band:
    """A band handed out to the pool: its slot and its output's length; :meth:`result` waits for it."""

    def __init__(self, workers: "pool.Pool", batch, slot: int, name: str, nbytes: int, done=None):
        self.workers, self.batch, self.slot, self.name, self.nbytes, self.done = workers, batch, slot, name, nbytes, done
        self.source = None

    def result(self) -> np.ndarray:
        try:
            self.workers.wait(self.batch)
        except ValueError as e:
            raise ValueError(str(e).replace(POOL_NAME, self.name)) from None
        arena = self.workers.arena_out
        return np.frombuffer(arena, dtype=np.uint8, count=self.nbytes, offset=self.slot * slot_bytes(arena))

    def finish(self) -> None:
        """Wait, then ``done`` (copy the bytes out, report them)."""
        self.done(self.result())


# A tensor's last band may be left running when its caller allows (``defer``): the next tensor's first band is
# handed out before it is collected, so the workers go from one tensor to the next without waiting for the
# parent. It is collected by :func:`settle` -- which the next use of the pool calls, and the caller must call
# before it relies on the tensor's bytes -- and whatever was registered with :func:`after_settle` runs then.
_deferred: dict = {"band": None, "after": []}


class DeferredError(ValueError):
    """An input error of a band left running, raised by :func:`settle`: ``source`` is what its caller named the
    tensor's origin (:func:`label_deferred`), not the tensor being encoded when it surfaced."""

    def __init__(self, message: str, source):
        super().__init__(message)
        self.source = source


def settle() -> None:
    """Collect the band left running, if any (its errors raised here), then run what waits for it."""
    band, after = _deferred["band"], _deferred["after"]
    _deferred["band"], _deferred["after"] = None, []
    try:
        if band is not None:
            try:
                band.finish()
            except ValueError as e:
                raise DeferredError(str(e), band.source) from None
    finally:
        for fn in after:
            fn()


def discard() -> None:
    """Forget the band left running, and what waited for it: the file it was for is abandoned (its pool is
    closed after this)."""
    _deferred["band"], _deferred["after"] = None, []


def label_deferred(source) -> None:
    """Name the origin of the band left running (given back with its error, see :class:`DeferredError`)."""
    if _deferred["band"] is not None:
        _deferred["band"].source = source


def after_settle(fn: Callable[[], None]) -> bool:
    """Have ``fn`` run once the band left running is collected; False (and nothing done) if none is."""
    if _deferred["band"] is None:
        return False
    _deferred["after"].append(fn)
    return True


def quantize_stored(path: str | Path, offset: int, source_type: T, shape: tuple[int, ...], qtype: T, name: str,
                    buffer: Callable[[int], tuple[np.ndarray, Callable | None]], importance=None,
                    check_scales: bool = True, chunk: int | None = None, defer: bool = False) -> np.ndarray | None:
    """The float tensor stored at byte ``offset`` of ``path`` (``source_type`` F32/BF16/F16, C order,
    torch-order ``shape``) quantized: its bytes in the uint8 array ``buffer(nbytes)`` gave, with the function
    it gave (if any) called with the length of the final prefix as bands finish. The errors of
    :func:`mtpq.ggml.kernels.quantize`, naming ``name``. None, with nothing done, when the pool does not take
    it (one worker, no pool scope, a type the pool does not run): encode it otherwise.

    Bands alternate between the pool's two slots, the next handed out before the last is collected. With
    ``defer`` the last band is left running (see :func:`settle`): the array returned is complete only then.

    The K- and i-quants come through :func:`mtpq.ggml.kernels.quantize_stored` (``chunk`` and ``importance``
    checked there, float32 numpy); called here directly with one of them, it returns None."""
    qtype = T(qtype)
    if qtype not in POOLED_TYPES or source_type not in SOURCE_KINDS or not pool.available() or not shape:
        return None
    n_workers = npquant.workers()
    bs, ts = GGML_QUANT_SIZES[qtype]
    n, n_rows = shape[-1], int(np.prod(shape[:-1], dtype=np.int64))
    row_out = n // bs * ts
    path_bytes = os.fsencode(str(path))
    out_slot, aux_slot = pool.OUT_BYTES // 2, pool.AUX_BYTES // 2  # the slots of the arenas a pool is made with
    if n_workers < 2 or n % bs or row_out > out_slot or len(path_bytes) >= PATH_BYTES:
        return None  # the in-process path runs it (and raises the row-length error)
    if torch_free(qtype, importance):
        chunk, imp = npquant.chunk_values(qtype), None
    elif qtype in SEARCH_TYPES and chunk is not None and torch_piece is not None:
        imp = importance
        if imp is not None and n * 4 > aux_slot - PATH_BYTES:
            return None  # a row of weights longer than a slot holds: the in-process path
    else:  # Q4_0/Q5_0 with importance weights (the row's mean square first, in process); not via kernels
        return None
    held = _deferred["band"]
    if held is not None and held.workers is not pool.current(n_workers, run_task, _tag()):
        settle()  # the pool is forked again (tables built since): collect the band first
        held = None
    workers = workers_pool(n_workers)
    if workers is None:
        settle()
        return None
    out, report = buffer(n_rows * row_out)
    kind = SOURCE_KINDS[source_type]
    row_in = n * np.dtype(KIND_DTYPES[kind]).itemsize
    flags = task_flags(qtype, kind, check_scales, imp is not None, True)
    if imp is not None and imp.ndim == 2:  # one row of weights per expert: an expert's rows at a time
        per = n_rows // imp.shape[0]
        segments = [(e * per, (e + 1) * per, imp[e]) for e in range(imp.shape[0])]
    else:
        segments = [(0, n_rows, imp)]
    slot = 1 - held.slot if held is not None else 0
    running: list[_Band | None] = [None, None]  # this tensor's band out in each slot

    def copy_out(b0: int, b1: int) -> Callable[[np.ndarray], None]:
        def done(data: np.ndarray) -> None:
            out[b0 * row_out:b1 * row_out] = data
            if report is not None:
                report(b1 * row_out)
        return done

    try:
        for s0, s1, weights in segments:
            band = max(1, min(s1 - s0, out_slot // row_out))
            for b0 in range(s0, s1, band):
                b1 = min(s1, b0 + band)
                if running[slot] is not None:  # the slot's earlier band: collected (in order) before reuse
                    running[slot].finish()
                    running[slot] = None
                aux = np.frombuffer(workers.arena_aux, dtype=np.uint8, count=aux_slot, offset=slot * aux_slot)
                aux[aux_slot - PATH_BYTES:aux_slot - PATH_BYTES + len(path_bytes) + 1] = np.frombuffer(
                    path_bytes + b"\0", dtype=np.uint8)
                if weights is not None:
                    aux[:n * 4].view(np.float32)[:] = weights
                tasks = [(flags, k, b1 - b0, n, *p, offset + b0 * row_in, slot)
                         for k, p in enumerate(pieces(b1 - b0, n, bs, chunk))]
                running[slot] = _Band(workers, workers.submit(tasks), slot, name, (b1 - b0) * row_out, copy_out(b0, b1))
                if held is not None:  # the previous tensor's last band, behind this one's first in the queue
                    held, _ = None, settle()
                slot = 1 - slot
        # the band handed out last is in the other slot; the one in this slot, if any, came before it
        for k, leave in ((slot, False), (1 - slot, defer)):
            if running[k] is not None:
                if leave:
                    assert _deferred["band"] is None  # the one before was collected after this one's first band
                    _deferred["band"] = running[k]
                else:
                    running[k].finish()
                running[k] = None
    except BaseException:
        for band in running:  # answered before the pool is used again (their slots are reused)
            if band is not None:
                with contextlib.suppress(Exception):
                    band.result()
        if held is not None:
            settle()
        raise
    return out


def torch_free(qtype: T, importance) -> bool:
    """Whether numpy's kernels (:mod:`.npquant`) quantize ``qtype`` with these importance weights: its types
    without them, and Q8_0, which has no weighted path, with them."""
    return qtype in npquant.TORCH_FREE_TYPES and (importance is None or qtype == T.Q8_0)


def _tag() -> tuple:
    """What a pool forked now would hold: the grid tables built and whether the torch kernels are loaded."""
    return (frozenset(tables_built), torch_piece is not None)
