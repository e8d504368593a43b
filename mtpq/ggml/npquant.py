"""Q8_0 / Q4_0 / Q5_0 in numpy alone: the same bytes as :mod:`.legacy`'s torch kernels, without torch.

Why: these types are a few passes over the data, so on a whole file their time goes to per-call costs,
extra copies and start-up, not arithmetic -- and importing torch alone is ~1.5 s of CPU, more than
llama-quantize takes for a small model. :func:`quantize_rows` is what :func:`mtpq.ggml.kernels.quantize`
runs for a float32 numpy input of these types (``mtpq quantize`` reads an f32 GGUF into one), so a
quantization to them never imports torch. The rare chunk the fast path cannot take (a deep-subnormal scale,
whose ``1/d`` overflows) goes to the torch kernel, imported then.

The float rules are :mod:`.legacy`'s (one IEEE float32 op at a time, in C order); what differs is the
layout of the work: each row's min and max are column reductions of the chunk transposed to (32, blocks)
(numpy reduces along a leading axis row after row, at memory speed; along rows of 32 it costs ~7x more),
which also give the NaN/Inf check for free (both propagate NaN; inf shows as a min or max).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from . import malloc

T = GGMLQuantizationType
NUMPY_TYPES = frozenset({T.Q8_0, T.Q4_0, T.Q5_0})
CHUNK = 1 << 18  # values per chunk: its temporaries (~5 MB) stay in L2/L3
_F0 = np.float32(0.0)
_BELOW_HALF = np.nextafter(np.float32(0.5), np.float32(0.0))  # 0.49999997f

# --------------------------------------------------------------------------- worker count without torch

_workers: dict = {"n": None}


def set_workers(n: int) -> None:
    """``--threads``: the workers every kernel splits a tensor over. Sets torch's thread count if torch is
    loaded; else it is remembered, and :mod:`.kernels` applies it when it loads torch."""
    _workers["n"] = int(n)
    torch = __import__("sys").modules.get("torch")
    if torch is not None:
        torch.set_num_threads(int(n))


def workers() -> int:
    """The worker count: what :func:`set_workers` set, else torch's own (if loaded), else the CPUs usable."""
    if _workers["n"] is not None:
        return _workers["n"]
    torch = __import__("sys").modules.get("torch")
    if torch is not None:
        return torch.get_num_threads()
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# --------------------------------------------------------------------------- kernels

# A chunk of blocks x (n, 32) is transposed once, in pairs of values, to P (16, 2n): P[j, 2b + p] is
# x[b, 2j + p] (a transpose of 8-byte items costs half one of 4-byte items). Each block's min and max are then
# reductions along P's leading axis (numpy adds row after row at memory speed; along rows of 32 its
# reductions cost ~7x more), and Q4_0/Q5_0's passes run along rows of 2n values with the per-block scale
# repeated as a (1, 2n) operand. Constants are (1, 2n) arrays too: numpy's loops with a scalar operand are
# 10-20x slower for uint8 minimum and copysign. Q8_0 works in x's own layout (32 bytes a block transposed
# back cost more than its few passes save).

def _pairs(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.view(np.complex64).T).view(np.float32)


def _min_max(P: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    lo2, hi2 = np.minimum.reduce(P, axis=0), np.maximum.reduce(P, axis=0)
    return np.minimum(lo2[0::2], lo2[1::2]), np.maximum(hi2[0::2], hi2[1::2])


def _signed_absmax(x: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """:func:`.legacy.first_absmax`'s ``max`` (the first element of largest |x|, +0.0 for a zero block) from
    the blocks' min and max: it is +amax or -amax, and only a block holding both needs the first index."""
    amax = np.maximum(hi, -lo)
    pos = hi == amax
    mx = np.where(pos, hi, lo)
    both = pos & (lo == -amax) & (amax > 0)
    if np.count_nonzero(both):
        rows = np.flatnonzero(both)
        sub = x[rows]
        mx[rows] = sub[np.arange(len(rows)), np.abs(sub).argmax(axis=1)]
    return np.where(amax > 0, mx, _F0)


def _put_fp16(out: np.ndarray, d: np.ndarray) -> None:
    out[:, :2] = d.astype("<f2").view(np.uint8).reshape(-1, 2)


def _inverse(d: np.ndarray) -> np.ndarray | None:
    """``d ? 1/d : 0``; None where some 1/d overflows (a deep-subnormal d: the torch path)."""
    idv = np.divide(np.float32(1.0), d, out=np.zeros_like(d), where=d != 0)
    return None if np.isinf(idv).any() else idv


def _q8_0(x: np.ndarray, P: np.ndarray, lo: np.ndarray, hi: np.ndarray, out: np.ndarray) -> bool:
    amax = np.maximum(hi, -lo) + _F0  # max |x|; + 0 makes an all-zero block's -0.0 the +0.0 of abs().amax()
    d = amax / np.float32(127.0)
    idv = _inverse(d)
    if idv is None:
        return False
    _put_fp16(out, d)
    v = x * idv[:, None]
    neg = v < 0
    np.abs(v, out=v)
    v += np.full((1, v.shape[1]), _BELOW_HALF)  # roundf(|v|) == trunc(|v| + 0.49999997f) (see legacy), <= 127
    q = v.astype(np.uint8).view(np.int8)
    m = neg.view(np.int8)
    np.negative(m, out=m)  # 0 or -1: (q ^ m) - m is q with v's sign
    q ^= m
    q -= m
    out[:, 2:] = q.view(np.uint8)
    return True


def _levels_plus(P: np.ndarray, d: np.ndarray, offset: float, top: int) -> np.ndarray | None:
    """``MIN(top, (int8_t)(x*id + offset))`` as uint8 in P's layout: every x*id + offset lies in
    [0.5, 2*offset], so the float -> uint8 conversion is C's truncation."""
    idv = _inverse(d)
    if idv is None:
        return None
    row = np.repeat(idv, 2)[None]
    v = P * row
    v += np.full_like(row, offset)  # two roundings, as C's x*id + offset
    q = v.astype(np.uint8)
    return np.minimum(q, np.full(row.shape, top, dtype=np.uint8), out=q)


def _put_nibbles(out: np.ndarray, q: np.ndarray) -> None:
    """Bytes e = q[e] | q[e + 16] << 4 of every block into ``out`` (n, 16), from levels in P's layout: rows
    j and j + 8 hold elements 2j + p and 2j + 16 + p; a uint16 of a row is a block's bytes 2j, 2j + 1."""
    packed = q[:8] | (q[8:] << 4)
    out.view(np.uint16)[:] = packed.view(np.uint16).T


def _q4_0(x: np.ndarray, P: np.ndarray, lo: np.ndarray, hi: np.ndarray, out: np.ndarray) -> bool:
    d = _signed_absmax(x, lo, hi) / np.float32(-8.0)
    q = _levels_plus(P, d, 8.5, 15)
    if q is None:
        return False
    _put_fp16(out, d)
    _put_nibbles(out[:, 2:], q)
    return True


def _q5_0(x: np.ndarray, P: np.ndarray, lo: np.ndarray, hi: np.ndarray, out: np.ndarray) -> bool:
    d = _signed_absmax(x, lo, hi) / np.float32(-16.0)
    q = _levels_plus(P, d, 16.5, 31)
    if q is None:
        return False
    _put_fp16(out, d)
    # qh: bit i of byte k is element 8k + i's fifth bit, i.e. row 4k + i // 2, p = i % 2
    g = (q >> 4).view(np.uint16)  # (16, n): fifth bits of elements 2j (bit 0) and 2j + 1 (bit 8)
    g = (g | (g >> 7)) & 3  # the two bits side by side
    qh = g[0::4] | (g[1::4] << 2) | (g[2::4] << 4) | (g[3::4] << 6)  # (4, n): byte k from rows 4k..4k+3
    out[:, 2:6] = qh.astype(np.uint8).T
    q &= 0x0F
    _put_nibbles(out[:, 6:], q)
    return True


_KERNELS = {T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.Q5_0: _q5_0}


def _torch_chunk(x: np.ndarray, qtype: T) -> np.ndarray:
    """The torch kernel for a chunk the fast path leaves (imports torch)."""
    import torch

    from . import legacy

    fn = {T.Q8_0: legacy.quantize_q8_0, T.Q4_0: legacy.quantize_q4_0, T.Q5_0: legacy.quantize_q5_0}[qtype]
    return fn(torch.from_numpy(np.ascontiguousarray(x))).numpy()


def quantize_chunk(c: np.ndarray, qtype: T, name: str, check_scales: bool, o: np.ndarray) -> None:
    """One chunk ``c`` (float32 blocks, (n, block size)) into ``o`` (uint8, (n, type size)), with
    :func:`quantize_rows`' errors."""
    kernel = _KERNELS[qtype]
    with np.errstate(all="ignore"):
        P = _pairs(c)
        lo, hi = _min_max(P)  # NaN propagates through both; an inf is a min or a max
        if not (np.isfinite(lo).all() and np.isfinite(hi).all()):
            raise ValueError(f"{name}: contains NaN/Inf values")
        if not kernel(c, P, lo, hi, o):
            o[:] = _torch_chunk(c, qtype)
    if check_scales and bool(((o[:, 1] & 0x7C) == 0x7C).any()):  # the fp16 d overflowed, as kernels checks
        raise ValueError(f"{name}: values too large for {qtype.name}: a block scale overflows fp16 "
                         "(llama-quantize rejects such data too)")


def quantize_rows(values: np.ndarray, qtype: T, name: str = "tensor", *, check_scales: bool = True,
                  n_workers: int | None = None) -> np.ndarray:
    """``values`` (float32, any shape, rows of whole blocks) in ``qtype`` (one of NUMPY_TYPES) as uint8
    ``(..., bytes_per_row)``; the ValueErrors of :func:`.kernels.quantize` (NaN/Inf, fp16 scale overflow)."""
    qtype = T(qtype)
    bs, ts = GGML_QUANT_SIZES[qtype]
    shape = values.shape if values.ndim else (1,)
    if shape[-1] % bs:
        raise ValueError(f"{name}: row length {shape[-1]} is not a multiple of the {qtype.name} block size {bs}")
    malloc.keep_freed_buffers()  # the chunks' temporaries and the tensors' buffers: not faulted in afresh each time
    x = np.ascontiguousarray(values, dtype=np.float32).reshape(-1, bs)
    nb = x.shape[0]
    out = np.empty((nb, ts), dtype=np.uint8)
    step = CHUNK // bs

    def work(b0: int) -> None:
        quantize_chunk(x[b0:b0 + step], qtype, name, check_scales, out[b0:b0 + step])

    starts = range(0, nb, step)
    n_workers = min(n_workers or workers(), len(starts))
    if n_workers > 1:  # numpy lets the GIL go inside each pass: threads share the chunks well
        with ThreadPoolExecutor(max_workers=n_workers) as pool:
            for f in [pool.submit(work, b0) for b0 in starts]:
                f.result()
    else:
        for b0 in starts:
            work(b0)
    return out.reshape(*shape[:-1], shape[-1] // bs * ts)

