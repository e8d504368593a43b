"""Facade over mtpq's ggml-exact torch quantization kernels.

``quantize`` turns a float tensor (torch order: ``(..., n_per_row)``, the last
dimension is GGUF's ``ne[0]``) into exactly the bytes ggml's quantizers
(``ggml_quantize_chunk``, i.e. what ``llama-quantize`` writes) produce -- the
reference quantizers, or with ``importance=`` (an imatrix's weights) ggml's
importance-weighted ones (:mod:`.weighted`) -- as the numpy array gguf-py's
``GGUFWriter`` takes with ``raw_dtype=qtype``:

* quantized types: ``uint8`` of shape ``(..., bytes_per_row)``;
* F32 / F16: ``float32`` / ``float16`` of the input's shape;
* BF16: ``uint16`` bit patterns of the input's shape (rounded like
  ``ggml_compute_fp32_to_bf16``: round to nearest even).  A ``uint16`` array
  (rather than the ``uint8`` view gguf-py's ``quants.quantize`` returns) keeps
  the element shape and is byte-swapped correctly by ``GGUFWriter`` for
  big-endian files; ``arr.view(np.uint8)`` gives gguf-py's bytes.

``dequantize`` is the inverse, in torch on the device of its input (CUDA
included), numerically identical to ``gguf.quants.dequantize``.

Work is done in chunks of whole blocks so the extra memory stays bounded
(tens of MB per worker on CPU, a few hundred MB on GPU), on the device of the
input tensor.  On CPU, chunks are spread over ``torch.get_num_threads()``
workers (one torch thread each); set that to choose the count.  On Linux the
workers are forked processes writing into shared memory (see
:func:`_run_forked`), or, while a file is written (:func:`mtpq.ggml.pool.scope`),
processes forked once for the whole file (:mod:`.pool`); elsewhere, or with
``MTPQ_WORKERS=threads`` in the environment, Python threads. Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 of contiguous float32 CPU input
run in numpy (:mod:`.npquant`, the same bytes; numpy threads); the K-quants' CPU kernels are numpy's too (:mod:`.npkquants`). ``mtpq quantize`` of a float GGUF goes through
:func:`quantize_stored` (:mod:`.from_file`): the pool's workers read their chunks from the file themselves.
"""

from __future__ import annotations

import contextlib
import gc
import mmap
import os
import signal
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from . import from_file, malloc, npiq4, npkquants, npquant, pool
from . import cnumpy, iq4, iquants, kquants, legacy, mxfp4, weighted
from .types import WRITABLE_TYPES

__all__ = ["SUPPORTED_TYPES", "block_size", "type_size", "bytes_per_row", "quantize", "dequantize"]

T = GGMLQuantizationType

# qtype -> (quantize kernel, dequantize kernel, input elements per chunk on CPU for one
# worker or forked workers, the same for several Python threads).  Measured on a 2-core
# x86 (benchmarks/quant_bench.py): alone, the search-loop K-quants run fastest on chunks
# whose buffers stay in L2 (2**16); threads (the fallback where workers cannot be forked)
# hand the GIL over at every short op, so for them 2**20 scales best even though each op
# then streams from L3.
_K, _M = 1 << 10, 1 << 20
_KERNELS: dict[GGMLQuantizationType, tuple[Callable, Callable, int, int]] = {
    T.Q8_0: (legacy.quantize_q8_0, legacy.dequantize_q8_0, 256 * _K, 256 * _K),
    T.Q4_0: (legacy.quantize_q4_0, legacy.dequantize_q4_0, 256 * _K, 256 * _K),
    T.Q4_1: (legacy.quantize_q4_1, legacy.dequantize_q4_1, 256 * _K, 256 * _K),
    T.Q5_0: (legacy.quantize_q5_0, legacy.dequantize_q5_0, 256 * _K, 256 * _K),
    T.Q5_1: (legacy.quantize_q5_1, legacy.dequantize_q5_1, 256 * _K, 256 * _K),
    T.Q2_K: (kquants.quantize_q2_k, kquants.dequantize_q2_k, npkquants.CHUNK[T.Q2_K], _M),
    T.Q3_K: (kquants.quantize_q3_k, kquants.dequantize_q3_k, npkquants.CHUNK[T.Q3_K], _M),
    T.Q4_K: (kquants.quantize_q4_k, kquants.dequantize_q4_k, npkquants.CHUNK[T.Q4_K], _M),
    T.Q5_K: (kquants.quantize_q5_k, kquants.dequantize_q5_k, npkquants.CHUNK[T.Q5_K], _M),
    T.Q6_K: (kquants.quantize_q6_k, kquants.dequantize_q6_k, npkquants.CHUNK[T.Q6_K], _M),
    T.IQ4_NL: (iq4.quantize_iq4_nl, iq4.dequantize_iq4_nl, npiq4.CHUNK[T.IQ4_NL], 64 * _K),
    T.IQ4_XS: (iq4.quantize_iq4_xs, iq4.dequantize_iq4_xs, npiq4.CHUNK[T.IQ4_XS], 64 * _K),
    # i-quants: kernel(blocks, importance (n_blocks, 256) or None); see iquants.REQUIRES_WEIGHTS.
    # IQ2_XXS/IQ3_XXS: the fastest of 2**14..2**19 on one core (their search holds all candidates at once)
    T.IQ2_XXS: (iquants.quantize_iq2_xxs, iquants.dequantize_iq2_xxs, 128 * _K, 128 * _K),
    T.IQ3_XXS: (iquants.quantize_iq3_xxs, iquants.dequantize_iq3_xxs, 64 * _K, 64 * _K),
    T.IQ2_XS: (iquants.quantize_iq2_xs, iquants.dequantize_iq2_xs, 64 * _K, 64 * _K),
    T.IQ3_S: (iquants.quantize_iq3_s, iquants.dequantize_iq3_s, 64 * _K, 64 * _K),
    T.IQ2_S: (iquants.quantize_iq2_s, iquants.dequantize_iq2_s, 64 * _K, 64 * _K),
    T.IQ1_S: (iquants.quantize_iq1_s, iquants.dequantize_iq1_s, 64 * _K, 64 * _K),
    T.IQ1_M: (iquants.quantize_iq1_m, iquants.dequantize_iq1_m, 64 * _K, 64 * _K),
}
# ggml's importance-weighted paths (quantize_row_*_impl); Q8_0 and the float types have none
_WEIGHTED: dict[GGMLQuantizationType, Callable] = {
    T.Q4_0: weighted.quantize_q4_0, T.Q4_1: weighted.quantize_q4_1,
    T.Q5_0: weighted.quantize_q5_0, T.Q5_1: weighted.quantize_q5_1,
    T.Q2_K: weighted.quantize_q2_k, T.Q3_K: weighted.quantize_q3_k, T.Q4_K: weighted.quantize_q4_k,
    T.Q5_K: weighted.quantize_q5_k, T.Q6_K: weighted.quantize_q6_k,
    T.IQ4_NL: weighted.quantize_iq4_nl, T.IQ4_XS: weighted.quantize_iq4_xs,
}
# types with an optional importance-weighted path (an imatrix changes their bytes)
IMPORTANCE_TYPES: tuple[GGMLQuantizationType, ...] = tuple(_WEIGHTED)
# the i-quants' kernels take the per-block weights themselves (ggml's quantize_row_iq*_impl)
_WEIGHTED.update({T.IQ2_XXS: iquants.quantize_iq2_xxs, T.IQ3_XXS: iquants.quantize_iq3_xxs,
                  T.IQ2_XS: iquants.quantize_iq2_xs, T.IQ3_S: iquants.quantize_iq3_s, T.IQ2_S: iquants.quantize_iq2_s,
                  T.IQ1_S: iquants.quantize_iq1_s, T.IQ1_M: iquants.quantize_iq1_m})
# input elements per chunk on CPU for the importance-weighted K-quant searches (instead of
# _KERNELS' first size): 37 candidate scales of ~25 small vector ops each, whose per-call
# cost 2**18 values amortise better than 2**16 (Q4_K: ~105 vs ~133 ns a value on one core)
_WEIGHTED_CHUNK = {T.Q2_K: 256 * _K, T.Q4_K: 256 * _K, T.Q5_K: 256 * _K}
# the legacy impls weight by the mean square of the whole row, not of the block
_ROW_SIGMA2 = frozenset({T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1})
_GPU_CHUNK = 1 << 22  # input elements per chunk on accelerators
# Types whose kernels are long runs of short ops (the search loops) go to forked workers on
# CPU; the legacy ones are a few long ops each, which threads share well, and a fork would
# cost them more than it saves (Q8_0: 0.47x llama-quantize's time with threads, 0.73x forked).
_FORKED_TYPES = from_file.SEARCH_TYPES
# A fork and its exit cost the parent ~10-25 ms of system time each (page tables of a process holding
# torch; more under load), twice per tensor with two workers: on the 1-8M-value tensors of a small model
# (benchmarks/quant_bench.py --whole-file) that was a fifth of a Q6_K run's CPU time and more of its wall
# time. Tensors below this many values (16 MB of float32) go to threads instead: on that file, at load
# 2.8 on 2 cores, a Q6_K run took 5.5-5.7 s of CPU forking every tensor, 4.0-4.2 s with this threshold,
# 3.8-5.1 s with 16M. A real model's tensors are far above it. Inside a pool scope (a file being written) no
# call forks, and every tensor of more than one chunk goes to the pool.
_FORK_MIN_VALUES = 1 << 22

# types mtpq reads but does not write (a checkpoint's own encoding kept by the converter)
_DEQUANT_ONLY: dict[GGMLQuantizationType, Callable] = {T.MXFP4: mxfp4.dequantize_mxfp4}

FLOAT_TYPES = (T.F32, T.F16, T.BF16)
# byte offsets of the fp16 scale fields llama-quantize validates (ggml_validate_row_data)
_FP16_FIELDS: dict[GGMLQuantizationType, tuple[int, ...]] = {
    **npquant.FP16_FIELDS,
    T.IQ2_XXS: (0,), T.IQ3_XXS: (0,),
    T.IQ2_XS: (0,), T.IQ3_S: (0,), T.IQ2_S: (0,), T.IQ1_S: (0,), T.IQ1_M: (),
}
SUPPORTED_TYPES: tuple[GGMLQuantizationType, ...] = FLOAT_TYPES + tuple(_KERNELS)
assert SUPPORTED_TYPES == WRITABLE_TYPES, "ggml_types.WRITABLE_TYPES names the types these kernels write"

_FLOAT_CHUNK = 1 << 22
_DEQUANT_CHUNK = 1 << 24  # output elements per dequantization chunk


def block_size(qtype: GGMLQuantizationType) -> int:
    """Elements per block (1 for float types)."""
    return GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][0]


def type_size(qtype: GGMLQuantizationType) -> int:
    """Bytes per block."""
    return GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][1]


def bytes_per_row(qtype: GGMLQuantizationType, n: int) -> int:
    """Bytes of one row of ``n`` elements; ValueError if ``n`` is not a whole number of blocks."""
    qtype = GGMLQuantizationType(qtype)
    bs, ts = GGML_QUANT_SIZES[qtype]
    if n % bs:
        raise ValueError(f"row length {n} is not a multiple of the {qtype.name} block size {bs}")
    return n // bs * ts


def _check_supported(qtype: GGMLQuantizationType, name: str) -> GGMLQuantizationType:
    try:
        qtype = GGMLQuantizationType(qtype)
    except ValueError:
        raise ValueError(f"{name}: unknown ggml type {qtype!r}") from None
    if qtype not in SUPPORTED_TYPES and not (name == "dequantize" and qtype in _DEQUANT_ONLY):
        raise ValueError(f"{name}: mtpq has no kernel for type {qtype.name}")
    return qtype


def all_finite(c: torch.Tensor) -> bool:
    """No NaN or Inf in ``c``: min and max (both propagate NaN), no full-size temporary."""
    if c.numel() == 0:
        return True
    if c.device.type == "cpu" and c.dtype == torch.float32:  # numpy's are 2x quicker
        a = c.numpy()
        return bool(np.isfinite(a.min()) and np.isfinite(a.max()))
    return bool(torch.isfinite(torch.stack(torch.aminmax(c))).all())


def _finite_piece(c: torch.Tensor, name: str) -> torch.Tensor:
    if not all_finite(c):
        raise ValueError(f"{name}: contains NaN/Inf values")
    return c


def _bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """``ggml_compute_fp32_to_bf16`` of float32 ``x``: the bf16 bit patterns as int16.

    Round to nearest even (``(u + 0x7fff + ((u >> 16) & 1)) >> 16``, computed
    without int32 overflow as high half + carry), NaN made quiet (``| 64``).
    """
    u = x.contiguous().view(torch.int32)
    hi = u >> 16  # arithmetic shift: the low 16 bits are the bf16 pattern
    carry = ((u & 0xFFFF) + (0x7FFF + (hi & 1))) >> 16
    r = torch.where((u & 0x7FFFFFFF) > 0x7F800000, hi | 64, hi + carry)
    return r.to(torch.int16)


def _validate_scales(q: torch.Tensor, qtype: GGMLQuantizationType, name: str) -> None:
    """Refuse blocks whose fp16 scale overflowed to inf, as llama-quantize does.

    ggml's quantizers write such blocks (huge values, e.g. a Q4_1 min below
    -65504) and ``llama-quantize`` then fails with "quantized data validation
    failed"; a GGUF holding them would decode to inf/NaN.
    """
    if q.device.type == "cpu":
        q = q.numpy()  # a few small ops: numpy's overhead is a third of torch's
    bad = None
    if qtype == T.IQ1_M:  # its fp16 is spread over the top nibbles of 4 words: exponent bits in bytes 53, 55
        bad = ((q[:, 53] & 0xC0) == 0xC0) & ((q[:, 55] & 0x70) == 0x70)
    for off in _FP16_FIELDS[qtype]:
        b = (q[:, off + 1] & 0x7C) == 0x7C  # fp16 exponent all ones: inf or NaN
        bad = b if bad is None else bad | b
    if bool(bad.any()):
        raise ValueError(
            f"{name}: values too large for {qtype.name}: a block scale overflows fp16 "
            "(llama-quantize rejects such data too)"
        )


def quantize(
    values: torch.Tensor,
    qtype: GGMLQuantizationType,
    name: str = "tensor",
    *,
    check_scales: bool = True,
    importance=None,
) -> np.ndarray:
    """ggml-exact encoding of ``values`` (shape ``(..., n_per_row)``) in ``qtype``.

    ``importance``: llama-quantize's ``--imatrix`` weights for this tensor, one
    per column (shape ``(n_per_row,)``), or one row per expert (``(n_expert,
    n_per_row)`` for ``values`` of shape ``(n_expert, rows, n_per_row)``);
    the bytes are then those of ``ggml_quantize_chunk(..., imatrix)``.  Types
    without an importance path in ggml (Q8_0, floats) ignore it, as ggml does.

    Raises ``ValueError`` naming the tensor for NaN/Inf input, a row length that
    is not a multiple of the block size, or an unsupported type; and, like
    llama-quantize, for data whose fp16 block scales (or F16 values) overflow.
    ``check_scales=False`` skips that last check and returns exactly what
    ``ggml_quantize_chunk`` writes even then.
    """
    qtype = _check_supported(qtype, name)
    if not isinstance(values, torch.Tensor):
        values = torch.as_tensor(np.asarray(values))
    values = values.detach()
    if importance is not None and qtype in _WEIGHTED:
        imp = _importance_for(importance, values, name)
        if imp.dim() == 2:  # one row of weights per expert: the experts one after the other
            parts = [quantize(values[e], qtype, name, check_scales=check_scales, importance=imp[e])
                     for e in range(imp.shape[0])]
            return np.stack(parts)
        importance = imp
    else:
        importance = None
    if (qtype in npquant.NUMPY_TYPES and importance is None and values.device.type == "cpu"
            and values.dtype == torch.float32 and values.is_contiguous()):
        # numpy's kernels for these few-pass types (the same bytes; see npquant); other inputs take the torch
        # path, which converts chunk by chunk (never a float32 copy of the whole tensor)
        return npquant.quantize_rows(values.numpy(), qtype, name, check_scales=check_scales,
                                     n_workers=torch.get_num_threads())
    if values.dim() == 0:
        values = values.reshape(1)
    shape = tuple(values.shape)
    n = shape[-1]
    bs, ts = GGML_QUANT_SIZES[qtype]
    if n % bs:
        raise ValueError(
            f"{name}: row length {n} is not a multiple of the {qtype.name} block size {bs}"
        )
    # a 2-D (rows, n) view of the input; a contiguous or 2-D input is never copied whole
    rows2d = values.reshape(1, n) if values.dim() == 1 else values.flatten(0, -2)
    n_rows = rows2d.shape[0]
    on_cpu = rows2d.device.type == "cpu"

    def pieces(elems: int) -> list[tuple[int, int, int, int]]:
        return from_file.pieces(n_rows, n, bs, elems)

    def load(p: tuple[int, int, int, int]) -> torch.Tensor:
        return _load_piece(rows2d, p, name)

    same = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}.get(qtype)
    if values.dtype == same:  # already in the target type: the bits pass through unchanged
        flat = values.contiguous()
        if not all(all_finite(c) for c in flat.view(-1).split(1 << 22)):  # bounded work per step
            raise ValueError(f"{name}: contains NaN/Inf values")
        raw = flat.view(torch.int16) if qtype == T.BF16 else flat
        out = raw.cpu().numpy()
        return out.view(np.uint16) if qtype == T.BF16 else out
    if qtype in FLOAT_TYPES:
        np_dtype = {T.F32: np.float32, T.F16: np.float16, T.BF16: np.uint16}[qtype]
        out = np.empty((n_rows, n), dtype=np_dtype)
        for p in pieces(_FLOAT_CHUNK):
            # F16 straight from the source dtype: bf16/f16 -> f32 is exact, so this rounds exactly as via f32
            c = load(p) if qtype != T.F16 else _finite_piece(rows2d[p[0]:p[1], p[2]:p[3]], name)
            if qtype == T.F16:
                r = c.to(torch.float16)
                if check_scales and not all_finite(r):
                    raise ValueError(f"{name}: values exceed the F16 range (|x| > 65504)")
            elif qtype == T.BF16:
                r = _bf16_bits(c)
                if check_scales and bool(((r & 0x7FFF) == 0x7F80).any()):
                    raise ValueError(f"{name}: values exceed the BF16 range (round to inf)")
                r = r.view(torch.uint16)
            else:
                r = c
            out[p[0]:p[1], p[2]:p[3]] = r.cpu().numpy()
        return out.reshape(shape)

    chunk_alone = _chunk_alone(qtype, importance is not None, name)
    qfn, _, _, chunk_shared = _KERNELS[qtype]
    if importance is not None:
        qfn = _weighted_kernel(qtype, importance.to(rows2d.device), _row_sigma2(rows2d) if qtype in _ROW_SIGMA2 else None)
    iquants.prepare(qtype, rows2d.device.type)  # grid tables built once, before any fork
    if on_cpu:
        malloc.keep_freed_buffers()
    workers = torch.get_num_threads() if on_cpu else 1
    todo = pieces(chunk_alone if on_cpu else _GPU_CHUNK)
    searching = workers > 1 and len(todo) > 1 and qtype in _FORKED_TYPES and pool.available()
    pooled = _in_pool(rows2d, qtype, importance, check_scales, name, chunk_alone, workers) if searching else None
    if pooled is not None:
        return pooled.reshape(*shape[:-1], n // bs * ts)
    forked = searching and n_rows * n >= _FORK_MIN_VALUES
    if on_cpu and workers > 1 and not forked:
        # big chunks, but at least two per worker so that all of them stay busy
        todo = pieces(max(chunk_alone, min(chunk_shared, n_rows * n // (2 * workers))))
    out_shape = (n_rows, n // bs * ts)
    out = _shared_empty(out_shape) if forked else np.empty(out_shape, dtype=np.uint8)

    def work(p: tuple[int, int, int, int]) -> None:
        r0, r1, c0, c1 = p
        q = qfn(load(p).reshape(-1, bs)) if importance is None else qfn(load(p).reshape(-1, bs), p)
        if check_scales:
            _validate_scales(q, qtype, name)
        out[r0:r1, c0 // bs * ts:c1 // bs * ts] = q.cpu().numpy().reshape(r1 - r0, -1)

    if forked:
        _run_forked(work, todo, workers)
    elif workers > 1 and len(todo) > 1:
        _run_parallel(work, todo, workers)
    else:
        for p in todo:
            work(p)
    return out.reshape(*shape[:-1], n // bs * ts)


def _load_piece(rows2d: torch.Tensor, p: tuple[int, int, int, int], name: str) -> torch.Tensor:
    """One chunk as contiguous float32, after the NaN/Inf check."""
    r0, r1, c0, c1 = p
    c = rows2d[r0:r1, c0:c1]
    if not all_finite(c):
        raise ValueError(f"{name}: contains NaN/Inf values")
    return c.to(torch.float32) if c.dtype != torch.float32 else c.contiguous()


# --------------------------------------------------------------------------- the writer's worker pool (pool.py)

# what the pool's input arena holds: float32, bf16 bits or float16, as the tensor came (converted per chunk);
# the kind numbers are from_file's (its KIND_DTYPES)
_ARENA_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_NO_TABLES = frozenset({T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS})


def _note_tables(qtype: T) -> None:
    """Say that ``qtype``'s grid tables exist in this process (iquants.prepare): a pool forked earlier lacks
    them, so from_file.workers_pool forks a new one."""
    if qtype not in _NO_TABLES:
        from_file.tables_built.add(qtype)


def _in_pool(rows2d: torch.Tensor, qtype: T, importance, check_scales: bool, name: str, chunk: int,
             workers: int) -> np.ndarray | None:
    """``rows2d`` (CPU) quantized in the writer's pool, if one is open and the rows fit its arenas (see
    :mod:`.pool`): band by band of rows, copied into the input arena, chunks handed out, bytes copied back.
    None when there is no pool for it (the caller forks or uses threads)."""
    if not pool.available():
        return None
    from_file.settle()  # a band left running by the tensor before: its slot and weights are reused here
    n_rows, n = rows2d.shape
    bs, ts = GGML_QUANT_SIZES[qtype]
    kind = _ARENA_KINDS.get(rows2d.dtype, 0)
    np_dtype = from_file.KIND_DTYPES[kind]
    row_in, row_out = n * np.dtype(np_dtype).itemsize, n // bs * ts
    band = min(n_rows, pool.IN_BYTES // row_in, pool.OUT_BYTES // row_out)
    if band == 0 or (importance is not None and importance.numel() * 4 > pool.AUX_BYTES - from_file.PATH_BYTES):
        return None
    _note_tables(qtype)
    workers_pool = from_file.workers_pool(workers)
    if workers_pool is None:
        return None
    flags = from_file.task_flags(qtype, kind, check_scales, importance is not None, False)
    if importance is not None:
        np.frombuffer(workers_pool.arena_aux, dtype=np.float32, count=n)[:] = importance.cpu().numpy()
    out = np.empty((n_rows, row_out), dtype=np.uint8)
    for b0 in range(0, n_rows, band):
        b1 = min(n_rows, b0 + band)
        src = rows2d[b0:b1].contiguous()
        if kind == 0 and src.dtype != torch.float32:
            src = src.to(torch.float32)
        arena = np.frombuffer(workers_pool.arena_in, dtype=np_dtype, count=(b1 - b0) * n).reshape(b1 - b0, n)
        arena[...] = src.view(torch.int16).numpy().view(np.uint16) if kind == 1 else src.numpy()
        tasks = [(flags, k, b1 - b0, n, *p) for k, p in enumerate(from_file.pieces(b1 - b0, n, bs, chunk))]
        out[b0:b1] = from_file.run_band(workers_pool, tasks, name, (b1 - b0) * row_out).reshape(b1 - b0, row_out)
    return out


def _chunk_alone(qtype: T, weighted: bool, name: str) -> int:
    """Input values per chunk for one worker (the weighted K-quant searches take bigger ones); refuses an
    i-quant without weights, where ggml aborts, in one line."""
    if qtype in iquants.REQUIRES_WEIGHTS and not weighted:
        raise ValueError(f"{name}: {qtype.name} needs an importance matrix (imatrix), none given")
    chunk = _KERNELS[qtype][2]
    return _WEIGHTED_CHUNK.get(qtype, chunk) if weighted else chunk


def quantize_stored(path, offset: int, source_type: T, shape: tuple[int, ...], qtype: T, name: str, buffer,
                    importance=None, check_scales: bool = True, defer: bool = False) -> np.ndarray | None:
    """:func:`.from_file.quantize_stored` for every type it takes: a search-loop ``qtype``'s importance
    weights checked as :func:`quantize` checks them (float32, ``(n,)`` or one row per expert) and its grid
    tables built before the pool forks."""
    qtype = T(qtype)
    if qtype not in _FORKED_TYPES:
        return from_file.quantize_stored(path, offset, source_type, shape, qtype, name, buffer,
                                          importance=importance, check_scales=check_scales, defer=defer)
    imp = None
    if importance is not None and qtype in _WEIGHTED:
        imp = _importance_for(importance, torch.empty(shape, device="meta"), name).numpy()
    chunk = _chunk_alone(qtype, imp is not None, name)
    iquants.prepare(qtype, "cpu")
    _note_tables(qtype)
    return from_file.quantize_stored(path, offset, source_type, shape, qtype, name, buffer, importance=imp,
                                      check_scales=check_scales, chunk=chunk, defer=defer)


def pool_piece(raw: np.ndarray, qtype: T, check_scales: bool, weighted: bool, piece: tuple[int, int, int, int],
               n: int, arena_aux) -> np.ndarray:
    """In a pool worker (:func:`.from_file.run_task`): one piece (rows r0:r1, columns c0:c1 of rows of ``n``
    values) of stored values (float32, bf16 bits as uint16, or float16) quantized, weighted by the row of
    importance at the start of the aux arena if ``weighted``."""
    bs = GGML_QUANT_SIZES[qtype][0]
    x = torch.from_numpy(np.ascontiguousarray(raw))
    if raw.dtype == np.uint16:
        x = x.view(torch.bfloat16)
    x = _load_piece(x, (0, x.shape[0], 0, x.shape[1]), from_file.POOL_NAME).reshape(-1, bs)
    if weighted:
        imp = torch.from_numpy(np.frombuffer(arena_aux, dtype=np.float32, count=n))
        q = _weighted_kernel(qtype, imp, None)(x, piece)
    else:
        q = _KERNELS[qtype][0](x)
    if check_scales:
        _validate_scales(q, qtype, from_file.POOL_NAME)
    return q.numpy()


def _importance_for(importance, values: torch.Tensor, name: str) -> torch.Tensor:
    """The importance weights as float32 (n,) or (n_expert, n), checked against ``values``."""
    imp = importance if isinstance(importance, torch.Tensor) else torch.as_tensor(np.asarray(importance))
    imp = imp.detach().to(torch.float32)
    n = values.shape[-1]
    if imp.dim() == 2 and imp.shape[0] == 1:
        imp = imp[0]
    if imp.dim() == 1 and imp.shape[0] == n:
        return imp.contiguous()
    if imp.dim() == 2 and values.dim() == 3 and tuple(imp.shape) == (values.shape[0], n):
        return imp.contiguous()
    raise ValueError(
        f"{name}: importance data of shape {tuple(imp.shape)} does not fit a tensor of shape {tuple(values.shape)}"
    )


def _row_sigma2(rows2d: torch.Tensor) -> torch.Tensor:
    """``sum_x2 / n_per_row`` of every row, the sum in C order (float32), for the legacy impls."""
    n_rows, n = rows2d.shape
    out = np.empty(n_rows, dtype=np.float32)
    step = max(1, (1 << 20) // max(n, 1))
    for r0 in range(0, n_rows, step):
        xt = np.ascontiguousarray(rows2d[r0:r0 + step].to(torch.float32).cpu().numpy().T)  # (n, k)
        with np.errstate(all="ignore"):
            # row after row, like the C loop (also for a lone row: see cnumpy.seq_sum)
            out[r0:r0 + step] = cnumpy.seq_sum(xt * xt) / np.float32(n)
    return torch.from_numpy(out).to(rows2d.device)


def _weighted_kernel(qtype: GGMLQuantizationType, imp: torch.Tensor, row_sigma2: torch.Tensor | None):
    """kernel(x_blocks, chunk) for a chunk (row0, row1, col0, col1) of the matrix, with its weights."""
    fn = _WEIGHTED[qtype]
    bs = block_size(qtype)
    tiles: dict[tuple[int, int, int], torch.Tensor] = {}  # chunks of one shape share their weights

    def run(x: torch.Tensor, p: tuple[int, int, int, int]) -> torch.Tensor:
        r0, r1, c0, c1 = p
        key = (c0, c1, r1 - r0)
        qw = tiles.get(key)
        if qw is None:
            qw = tiles[key] = imp[c0:c1].repeat(r1 - r0).reshape(-1, bs)
        if row_sigma2 is None:
            return fn(x, qw)
        return fn(x, qw, row_sigma2[r0:r1].repeat_interleave((c1 - c0) // bs))

    return run


from_file.torch_piece = pool_piece  # pool workers forked from now on run the torch kernels

_THREAD_LOCK = threading.Lock()
if npquant._workers["n"] is not None:  # --threads given before torch was loaded
    torch.set_num_threads(npquant._workers["n"])


def _shared_empty(shape: tuple[int, int]) -> np.ndarray:
    """A uint8 array in anonymous shared memory: what forked workers write is seen here."""
    size = shape[0] * shape[1]
    return np.frombuffer(mmap.mmap(-1, max(size, 1)), dtype=np.uint8, count=size).reshape(shape)


def _run_forked(work: Callable[[tuple], None], ranges: list, workers: int) -> None:
    """Run ``work`` over chunks in this process and ``workers - 1`` forked ones, one torch thread each.

    The kernels are long sequences of short ops.  Threads sharing one GIL hand
    it over at every op, and on 2 cores reach only 1.3-1.4x one thread;
    forked workers need no hand-over and scale like llama-quantize's threads
    (benchmarks/quant_bench.py: 2 workers take 0.55x the time of 1).  A fork
    costs about a millisecond: the children see the input (and every other
    object) as it is at the fork, copy-on-write, and write their output into
    shared memory (:func:`_shared_empty`).  Chunks are handed out through a
    pipe of 4-byte indices, so a slow worker takes fewer.  A child only runs
    ``work`` and leaves with ``os._exit``; an error there (NaN/Inf, an fp16
    overflow) comes back through a second pipe and is raised here, with its
    type (ValueError) kept; an error in this process's own chunks stops the
    children and is raised the same way.  Interrupted, the parent kills its children.
    """
    task_r, task_w = os.pipe()
    err_r, err_w = os.pipe()
    pids: list[int] = []
    order = b"".join(i.to_bytes(4, "little") for i in range(len(ranges)))
    # this process takes chunks too, so workers - 1 children: each fork and exit costs this process
    # 10-25 ms of system time; not where the order could fill the pipe before anyone reads it
    helping = len(order) <= 32768
    saved = torch.get_num_threads()
    torch.set_num_threads(1)  # inherited: a child never enters an OpenMP region
    mine: BaseException | None = None
    try:
        with warnings.catch_warnings():
            # Python 3.12+ warns about fork() in a multi-threaded process; the children run
            # only numpy/torch arithmetic on data that exists, no locks other threads may hold
            warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
            for _ in range(min(workers, len(ranges)) - (1 if helping else 0)):
                pid = os.fork()
                if pid == 0:  # pragma: no cover - runs in the child, which never returns
                    os.close(task_w)
                    os.close(err_r)
                    _child(work, ranges, task_r, err_w)
                pids.append(pid)
        os.close(err_w)
        err_w = -1
        try:
            for k in range(0, len(order), 4096):  # writes of at most PIPE_BUF bytes are atomic
                os.write(task_w, order[k:k + 4096])
        except BrokenPipeError:  # every child has left (with an error): collect it below
            pass
        os.close(task_w)
        task_w = -1
        if helping:
            try:
                while True:
                    b = pool.read_all(task_r, 4)
                    if len(b) < 4:
                        break
                    work(ranges[int.from_bytes(b, "little")])
            except Exception as e:  # noqa: BLE001 - reported as a child's would be, after the children
                mine = e
                for pid in pids:  # the chunks left are not needed
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        os.close(task_r)
        task_r = -1
        errors = pool.read_all(err_r).split(b"\0")
        failed = [pid for pid in pids if os.waitpid(pid, 0)[1] != 0]
        pids = []
    except BaseException:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        raise
    finally:
        torch.set_num_threads(saved)
        for fd in (task_r, task_w, err_r, err_w):
            if fd >= 0:
                os.close(fd)
    if mine is not None:
        if isinstance(mine, ValueError):
            raise mine
        raise RuntimeError(f"quantization worker failed: {type(mine).__name__}: {mine}") from mine
    for e in errors:
        if e:
            kind, msg = e[:1], e[1:].decode("utf-8", "replace")
            raise ValueError(msg) if kind == b"V" else RuntimeError(f"quantization worker failed: {msg}")
    if failed and mine is None:
        raise RuntimeError(f"{len(failed)} quantization worker(s) died (out of memory?)")


def _child(work: Callable[[tuple], None], ranges: list, task_r: int, err_w: int) -> None:  # pragma: no cover
    code = 0
    try:
        pool.die_with_parent()
        gc.disable()  # a short life: no collections touching (and copying) the parent's pages
        while True:
            b = pool.read_all(task_r, 4)
            if len(b) < 4:
                break
            work(ranges[int.from_bytes(b, "little")])
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        kind = b"V" if isinstance(e, ValueError) else b"E"
        text = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        os.write(err_w, (kind + text.encode("utf-8", "replace"))[:4000] + b"\0")
        code = 1
    finally:
        os._exit(code)


def _run_parallel(work: Callable[[tuple], None], ranges: list, workers: int) -> None:
    """Run ``work`` over chunks on ``workers`` Python threads, one torch thread each.

    The fallback where workers cannot be forked.  Spreading chunks over
    threads (torch releases the GIL inside ops) scales better than intra-op
    parallelism of each small op, though the GIL hand-overs cap it.  torch's
    intra-op pool is set to 1 thread meanwhile and restored.
    """
    with _THREAD_LOCK:
        saved = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                for f in [pool.submit(work, r) for r in ranges]:
                    f.result()  # re-raises the first error (NaN/Inf, overflow)
        finally:
            torch.set_num_threads(saved)


def _as_torch(raw: np.ndarray | torch.Tensor) -> torch.Tensor:
    if isinstance(raw, torch.Tensor):
        return raw
    arr = np.asarray(raw)
    if not arr.flags.c_contiguous or not arr.flags.writeable:
        arr = np.array(arr, copy=True, order="C")  # torch refuses read-only memory (memmaps)
    return torch.from_numpy(arr)


def dequantize(raw: np.ndarray | torch.Tensor, qtype: GGMLQuantizationType, shape) -> torch.Tensor:
    """Decode ``raw`` (the GGUF bytes, any leading shape) into a float32 tensor of ``shape``.

    Runs in torch on ``raw``'s device (numpy input is decoded on CPU).  The
    values are identical to ``gguf.quants.dequantize``.
    """
    qtype = _check_supported(qtype, "dequantize")
    shape = tuple(int(s) for s in shape)
    n_el = 1
    for s in shape:
        n_el *= s
    t = _as_torch(raw)
    if qtype in FLOAT_TYPES:
        if t.is_floating_point() and qtype != T.BF16:
            return t.to(torch.float32).reshape(shape)
        if qtype == T.BF16 and t.dtype == torch.bfloat16:
            return t.to(torch.float32).reshape(shape)
        u8 = t.contiguous().view(torch.uint8).reshape(-1)
        if qtype == T.F32:
            return u8.view(torch.float32).reshape(shape).clone()
        if qtype == T.F16:
            return u8.view(torch.float16).to(torch.float32).reshape(shape)
        bits = u8.view(torch.int16).to(torch.int32) << 16
        return bits.view(torch.float32).reshape(shape)

    dfn = _DEQUANT_ONLY[qtype] if qtype in _DEQUANT_ONLY else _KERNELS[qtype][1]
    bs, ts = GGML_QUANT_SIZES[qtype]
    if shape[-1] % bs:
        raise ValueError(f"dequantize: row length {shape[-1]} is not a multiple of the {qtype.name} block size {bs}")
    u8 = t.contiguous().view(torch.uint8).reshape(-1)
    nblocks = n_el // bs
    if u8.numel() != nblocks * ts:
        raise ValueError(
            f"dequantize: {u8.numel()} bytes given, {qtype.name} {shape} needs {nblocks * ts}"
        )
    b = u8.view(nblocks, ts)
    step = max(1, _DEQUANT_CHUNK // bs)
    if nblocks <= step:
        return dfn(b).reshape(shape)
    out = torch.empty((nblocks, bs), dtype=torch.float32, device=b.device)
    for b0 in range(0, nblocks, step):
        b1 = min(nblocks, b0 + step)
        out[b0:b1] = dfn(b[b0:b1])
    return out.reshape(shape)
