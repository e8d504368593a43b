"""Encoding a converted tensor slab by slab into one output buffer of the output type.

Loading a whole tensor and then encoding it holds it twice, and for FP8 checkpoints in float32: one
DeepSeek-V3 layer's stacked experts are 7.5 GB in bf16 but 15 GB dequantized (and ``torch.stack``
of the dequantized experts held that twice). Here each slab (one expert of a stack, a band of rows
of a single tensor) is read, dequantized, encoded into its place in the preallocated output and
dropped, so the extra memory is one slab, not the tensor. A big float tensor has no output buffer at all:
its slabs are written to the file as they are encoded (:class:`SlabWrites`).

The bytes are those of encoding the whole tensor: every type the converter writes (F32, F16, BF16,
Q8_0) encodes each row independently of the others.
"""

from __future__ import annotations

import math
import os
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from ..errors import InputError
from ..gguf_io import output_buffer, report_progress
from .checkpoint import ST_DTYPES, HFCheckpoint, one_torch_thread

SLAB_ELEMENTS = 1 << 23  # values per slab of a single tensor: 32 MB as float32
# to a float type: 4 MB of float32 per slab, so that the lookup, scaling, checks and rounding of one slab
# find it in the CPU's cache and glibc reuses the buffers (each pass over DRAM-sized slabs cost as much as
# the copy); the quantized types keep big slabs, the kernels share them out among threads
FLOAT_SLAB_ELEMENTS = 1 << 20
# threads converting the slabs of one tensor to a float type: the machine's cores, at most 2 (the writer
# writes the previous tensor meanwhile)
FLOAT_WORKERS = min(2, os.cpu_count() or 1)
_TORCH_OF = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}

Slab = tuple[int, int, Callable[[], torch.Tensor]]  # rows r0:r1 along dim 0, and how to read them


class Rows:
    """A slab's reader: rows ``r0:r1`` of one stored tensor (block-scaled FP8 ones can also be rounded
    straight into their place in a float output, :meth:`HFCheckpoint.rows_as`)."""

    def __init__(self, ck: HFCheckpoint, name: str, r0: int, r1: int):
        self.ck, self.name, self.r0, self.r1 = ck, name, r0, r1

    def __call__(self) -> torch.Tensor:
        return self.ck.load_rows(self.name, self.r0, self.r1)


def encode_values(values: torch.Tensor, qtype: T, name: str, source: str, out: np.ndarray | None = None) -> np.ndarray:
    """mtpq.ggml's ``quantize`` of torch values (bf16 given as its bits; into ``out``, a uint8 buffer of the
    output's size, if given), with a bad value reported as the source's fault (as the writer does)."""
    from ..ggml.engine import quantize

    values = values.detach().cpu().contiguous()
    if values.dtype == torch.bfloat16:
        arr = values.view(torch.int16).numpy().view(np.uint16)  # the kernels read uint16 as bf16 bits
    elif values.dtype in (torch.float32, torch.float16):
        arr = values.numpy()
    else:
        arr = values.to(torch.float32).numpy()
    try:
        return quantize(arr, qtype, name, out=out)
    except ValueError as exc:  # NaN/Inf, out of range: the source is at fault, say which tensor
        raise InputError(source, str(exc)) from None


def encode_loaded(load: Callable[[], torch.Tensor], qtype: T, name: str, source: str) -> np.ndarray:
    """``encode_values(load())`` with the loading (a family's transform: concatenations, strided copies, all
    memory-bound) on one torch thread: 20x quicker than on two (attn_qkv of qwen3next) when the other
    core is busy, as it is while the writer writes the previous tensor."""
    with one_torch_thread():
        values = load()
    return encode_values(values, qtype, name, source)


def encode_slabs(name: str, source: str, shape: tuple[int, ...], qtype: T, slabs: Iterable[Slab]) -> np.ndarray:
    """The bytes of a tensor of ``shape`` in ``qtype`` (the array ``quantize`` would return for the whole
    tensor), encoded slab by slab into one buffer allocated once."""
    if qtype in _TORCH_OF:
        with one_torch_thread():
            return _float_slabs(name, source, shape, qtype, slabs)
    from ..ggml.registry import bytes_per_row

    row_bytes = bytes_per_row(qtype, math.prod(shape[1:]))
    out = output_buffer(shape[0] * row_bytes).reshape(shape[0], row_bytes)
    for r0, r1, load in slabs:  # each slab's bytes straight into their place
        encode_values(load(), qtype, name, source, out=out[r0:r1].reshape(-1))
    return out


def _float_slab(name: str, source: str, qtype: T, slab: Slab, dst: torch.Tensor) -> None:
    """One slab's rows converted by torch into ``dst`` (their place in the output, or a slab buffer): one pass;
    ggml's fp32 -> bf16 and torch's are both round-to-nearest-even, and NaN, where they differ, is refused,
    with ``quantize``'s checks and messages."""
    r0, r1, load = slab
    if isinstance(load, Rows) and load.ck.rows_as(load.name, load.r0, load.r1, dst):
        return
    values = load()
    dst.copy_(values.reshape(dst.shape))
    # one check of the (smaller) result: NaN/Inf stay NaN/Inf, so a finite result had a finite source;
    # only when it is not are the source values looked at, to say which of the two went wrong
    if not all_finite(dst):
        if not all_finite(values):
            raise InputError(source, f"{name}: contains NaN/Inf values")
        what = "F16 range (|x| > 65504)" if qtype == T.F16 else "BF16 range (round to inf)"
        raise InputError(source, f"{name}: values exceed the {what}")


def _run_slabs(slabs: list[Slab], one: Callable[[int, Slab], None]) -> None:
    """``one(i, slab)`` for every slab, on FLOAT_WORKERS Python threads of one torch thread each (torch and
    numpy release the GIL in their passes); the first bad slab's error, in order."""
    workers = min(FLOAT_WORKERS, len(slabs))
    if workers < 2:
        for i, slab in enumerate(slabs):
            one(i, slab)
        return
    pool = ThreadPoolExecutor(workers, initializer=torch.set_num_threads, initargs=(1,))
    try:
        for f in [pool.submit(one, i, slab) for i, slab in enumerate(slabs)]:
            f.result()
    finally:
        pool.shutdown(cancel_futures=True)


# a float tensor of this many bytes or more (a fresh mapping of its own in output_buffer, whose pages the
# kernel zeroes as they are first written) is encoded when written, each slab into a small buffer
# written to its place in the file: SlabWrites
WRITE_SLABS_BYTES = 32 << 20


class SlabWrites:
    """A float tensor's bytes, encoded as the writer writes it: each slab converted into a buffer of its own
    (reused by malloc) and written with ``pwrite`` at its place in the file by the worker that converted it.
    No buffer of the whole tensor: the kernel's zeroing of its fresh pages (a third of an FP8 -> bf16
    conversion's CPU, as much as the write's own copy) goes, and so does the writer's wait for the workers.
    Has what GGUFWriter.write_tensor_data uses of an array (``nbytes``, ``tofile``); ``np.asarray`` encodes
    into memory for any other reader. A bad value is refused when the tensor is written."""

    def __init__(self, name: str, source: str, shape: tuple[int, ...], qtype: T, slabs: list[Slab]):
        self.name, self.source, self.qtype, self.slabs = name, source, qtype, slabs
        self.base = self.shape = tuple(shape)  # base: the shape whose dim 0 the slabs' rows index
        self.dtype = np.dtype(_BITS_AS[qtype])
        self.nbytes = math.prod(shape) * self.dtype.itemsize

    def reshape(self, *shape) -> "SlabWrites":
        """The same bytes seen as ``shape`` (one -1 allowed), as an array's reshape."""
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        if -1 in shape:
            known = math.prod(d for d in shape if d != -1)
            shape = tuple(math.prod(self.shape) // known if d == -1 else d for d in shape)
        if math.prod(shape) != math.prod(self.shape):
            raise ValueError(f"cannot reshape {self.shape} into {shape}")
        new = SlabWrites(self.name, self.source, self.base, self.qtype, self.slabs)
        new.shape = shape
        return new

    def tofile(self, f) -> None:
        f.flush()
        fd, start = f.fileno(), f.tell()
        flat = (self.base[0], math.prod(self.base[1:]))  # rows along dim 0, as the slabs
        row = flat[1] * self.dtype.itemsize
        dtype = _TORCH_OF[self.qtype]

        # the file system writes into one file one write at a time (the inode's lock); a worker that finds the
        # other writing would spin on that lock in the kernel: it sleeps here
        writing = threading.Lock()

        def one(i: int, slab: Slab) -> None:
            r0, r1, _ = slab
            dst = torch.empty((r1 - r0, flat[1]), dtype=dtype)
            with one_torch_thread():
                _float_slab(self.name, self.source, self.qtype, slab, dst)
            with writing:
                _pwrite(fd, memoryview(dst.view(torch.uint8).numpy()).cast("B"), start + r0 * row)

        from ..ggml.malloc import keep_freed_buffers

        keep_freed_buffers()  # each slab's buffer is the previous one's memory, not faulted in again
        _run_slabs(self.slabs, one)
        f.seek(start + self.nbytes)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = _float_slabs(self.name, self.source, self.base, self.qtype, self.slabs).reshape(self.shape)
        return out if dtype is None else out.astype(dtype)


def _pwrite(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _float_slabs(name: str, source: str, shape: tuple[int, ...], qtype: T, slabs: Iterable[Slab]) -> np.ndarray:
    """F32/F16/BF16: each slab converted by torch straight into its place in the output (:func:`_float_slab`)."""
    from ..ggml.malloc import keep_freed_buffers

    keep_freed_buffers()  # the slabs' temporaries are reused, not faulted in again for every slab
    # the writer's buffer: huge pages (madvise; first writes into a fresh output in 4 KB page faults are slow),
    # and the memory of the previous tensor of this size when it could keep it
    dtype = np.dtype(np.float32 if qtype == T.F32 else np.int16)
    buf = output_buffer(math.prod(shape) * dtype.itemsize)
    out = torch.from_numpy(buf.view(dtype).reshape(shape))
    out = out if qtype == T.F32 else out.view(_TORCH_OF[qtype])

    def one(slab: Slab) -> None:
        _float_slab(name, source, qtype, slab, out[slab[0] : slab[1]])

    slabs = list(slabs)
    # the writer writes the finished rows while the rest are converted: slabs i < k finished are rows
    # 0:slabs[k - 1][1] when the slabs follow one another from row 0 (as every caller here gives them)
    in_order = all(s[0] == (slabs[i - 1][1] if i else 0) for i, s in enumerate(slabs))
    report = report_progress(buf) if in_order else None
    row = out[0].nbytes if len(out) else 0
    finished, upto, lock = set(), [0], threading.Lock()

    def done(i: int) -> None:  # slab i is final: report the rows finished from the start
        if report is None:
            return
        with lock:
            finished.add(i)
            while upto[0] in finished:
                upto[0] += 1
            end = slabs[upto[0] - 1][1] * row if upto[0] else 0
        report(end)

    _run_slabs(slabs, lambda i, slab: (one(slab), done(i)))
    # the arrays quantize returns: BF16 as uint16 bit patterns
    return out.view(torch.int16).numpy().view(np.uint16) if qtype == T.BF16 else out.numpy()


_BITS_AS = {T.BF16: np.uint16, T.F16: np.float16, T.F32: np.float32}  # the arrays ``quantize`` returns


def all_finite(c: torch.Tensor) -> bool:
    """No NaN or Inf in ``c``: min and max (both propagate NaN), no full-size temporary."""
    if c.numel() == 0:
        return True
    if c.device.type == "cpu" and c.dtype == torch.float32:  # numpy's min/max are quicker than torch's aminmax
        a = c.numpy()
        return bool(np.isfinite(a.min()) and np.isfinite(a.max()))
    return bool(torch.isfinite(torch.stack(torch.aminmax(c))).all())


def bits_finite(bits: np.ndarray, dtype: str) -> bool:
    """No NaN/Inf among stored ``dtype`` (safetensors name) values given as their bits: ``quantize``'s check
    (min and max propagate NaN), on a view of the bits, 4M values per step, one thread."""
    signed = bits.reshape(-1).view(np.int16 if bits.itemsize == 2 else np.int32)
    with warnings.catch_warnings():  # the mapped bits are read-only; nothing here writes them
        warnings.simplefilter("ignore", UserWarning)
        values = torch.from_numpy(signed).view(ST_DTYPES[dtype])
    with one_torch_thread():
        return all(all_finite(c) for c in values.split(1 << 22))


def _passed_bits(ck: HFCheckpoint, hf_name: str, name: str, source: str, qtype: T) -> np.ndarray:
    """A passed-through tensor: its stored bits mapped from the file and checked, as the output type's array."""
    bits = ck.map_bits(hf_name)
    if not bits_finite(bits, ck.source_dtype(hf_name)):
        raise InputError(source, f"{name}: contains NaN/Inf values")
    return bits.view(_BITS_AS[qtype])


class Pieces:
    """One tensor's bytes as consecutive arrays (a passed-through expert stack: each expert mapped from its
    file), written one after the other with no stacking copy. Has what GGUFWriter.write_tensor_data uses of
    an array: ``nbytes`` and ``tofile``; ``np.asarray`` joins them (a copy) for any other reader."""

    def __init__(self, parts: list[np.ndarray], shape: tuple[int, ...]):
        self.parts, self.shape, self.dtype = parts, shape, parts[0].dtype
        self.nbytes = sum(p.nbytes for p in parts)

    def tofile(self, f) -> None:
        for p in self.parts:
            if p.nbytes:
                f.write(memoryview(p).cast("B"))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = np.concatenate([p.reshape(-1) for p in self.parts]).reshape(self.shape)
        return out if dtype is None else out.astype(dtype)


def passes_through(ck: HFCheckpoint, hf_name: str, qtype: T) -> bool:
    """The stored values are already the output type's: their bits are written as they are."""
    return not ck.is_fp8(hf_name) and ST_DTYPES[ck.source_dtype(hf_name)] == _TORCH_OF.get(qtype)


def _band(ck: HFCheckpoint, hf_name: str, row: int, qtype: T) -> int:
    """Rows per slab of ``hf_name`` (``row`` values each), a multiple of its :meth:`HFCheckpoint.row_step`."""
    step = ck.row_step(hf_name)
    elems = FLOAT_SLAB_ELEMENTS if qtype in _TORCH_OF else SLAB_ELEMENTS
    return max(step, elems // max(row, 1) // step * step)


def encode_tensor(ck: HFCheckpoint, hf_name: str, name: str, source: str, qtype: T) -> np.ndarray:
    """One HF tensor in ``qtype``, read and converted a band of rows at a time."""
    shape = tuple(ck.shape(hf_name))
    if passes_through(ck, hf_name, qtype):  # the bits are the output
        return _passed_bits(ck, hf_name, name, source, qtype)
    row = 1
    for d in shape[1:]:
        row *= d
    per = _band(ck, hf_name, row, qtype)
    if not shape or not shape[0] or (per >= shape[0] and qtype not in _TORCH_OF):  # one slab
        return encode_values(ck.load(hf_name), qtype, name, source)

    def slab(r0: int) -> Slab:
        r1 = min(shape[0], r0 + per)
        return r0, r1, Rows(ck, hf_name, r0, r1)

    return _encode_rows(name, source, shape, qtype, [slab(r0) for r0 in range(0, shape[0], per)])


def encode_stack(
    ck: HFCheckpoint, hf_names: list[str], name: str, source: str, shape: tuple[int, ...], qtype: T
) -> np.ndarray | Pieces:
    """Per-expert tensors stacked into ``shape`` = [n_expert, rows, cols] in ``qtype``, one band of an expert's
    rows at a time."""
    if hf_names and all(passes_through(ck, n, qtype) for n in hf_names):
        # the stored bits are the output: every expert mapped and checked before any is written
        return Pieces([_passed_bits(ck, n, name, source, qtype) for n in hf_names], shape)
    n_exp, rows, cols = shape
    if not rows:
        return encode_values(torch.zeros(shape), qtype, name, source)
    slabs = []  # bands of rows of the stack seen as [n_expert * rows, cols]
    for i, n in enumerate(hf_names):
        per = _band(ck, n, cols, qtype)
        for r0 in range(0, rows, per):
            r1 = min(rows, r0 + per)
            slabs.append((i * rows + r0, i * rows + r1, Rows(ck, n, r0, r1)))
    out = _encode_rows(name, source, (n_exp * rows, cols), qtype, slabs)
    return out.reshape(n_exp, rows, -1)


def _encode_rows(
    name: str, source: str, shape: tuple[int, ...], qtype: T, slabs: list[Slab]
) -> np.ndarray | SlabWrites:
    """:func:`encode_slabs`, or a big float tensor encoded as it is written (:class:`SlabWrites`)."""
    big = math.prod(shape) * _BITS_AS[qtype]().itemsize >= WRITE_SLABS_BYTES if qtype in _TORCH_OF else False
    if big and hasattr(os, "pwrite"):  # POSIX; elsewhere the buffered path
        return SlabWrites(name, source, shape, qtype, slabs)
    return encode_slabs(name, source, shape, qtype, slabs)


def encode_rows_of_stack(
    ck: HFCheckpoint, hf_name: str, name: str, source: str, lo: int, hi: int, qtype: T
) -> np.ndarray | Pieces:
    """Rows ``lo:hi`` of every expert of a stored stack [n_expert, rows, cols] (one half of a fused
    gate_up_proj) in ``qtype``, one expert at a time: neither the whole stack nor its other half is loaded."""
    n_exp, _, cols = ck.shape(hf_name)
    if passes_through(ck, hf_name, qtype):  # each expert's half is contiguous in the file: mapped, as stored
        bits = ck.map_bits(hf_name)
        parts = [bits[e, lo:hi] for e in range(n_exp)]
        if not all(bits_finite(p, ck.source_dtype(hf_name)) for p in parts):
            raise InputError(source, f"{name}: contains NaN/Inf values")
        return Pieces([p.view(_BITS_AS[qtype]) for p in parts], (n_exp, hi - lo, cols))
    n = hi - lo
    slabs = [
        (e * n, (e + 1) * n, (lambda e: lambda: ck.load_rows(hf_name, e, e + 1)[0, lo:hi])(e)) for e in range(n_exp)
    ]
    if not slabs or not n:
        return encode_values(torch.zeros(n_exp, n, cols), qtype, name, source)
    return encode_slabs(name, source, (n_exp * n, cols), qtype, slabs).reshape(n_exp, n, -1)
