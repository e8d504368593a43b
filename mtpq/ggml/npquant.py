"""Quantization without torch: Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 here, the K-quants Q2_K-Q6_K from :mod:`.npkquants`
and IQ4_NL / IQ4_XS from :mod:`.npiq4`.

The same bytes as :mod:`.legacy`'s and :mod:`.kquants`' torch kernels.

Why: the legacy types are a few passes over the data, so on a whole file their time goes to per-call costs,
extra copies and start-up, not arithmetic -- and importing torch alone is ~1.5 s of CPU, more than
llama-quantize takes for a small model. :func:`quantize_rows` is what :func:`mtpq.ggml.kernels.quantize`
runs for a float32 numpy input of these types (``mtpq quantize`` reads an f32 GGUF into one), so a
quantization to them never imports torch. The rare chunk the fast path cannot take (a deep-subnormal scale,
whose ``1/d`` overflows) goes to the torch kernel, imported then.

The float rules are :mod:`.legacy`'s (one IEEE float32 op at a time, in C order); what differs is the
layout of the work: each block's min and max are column reductions of the chunk transposed to (8, 4 x blocks)
(numpy reduces along a leading axis row after row, at memory speed; along rows of 32 it costs ~15x more),
which also give the NaN/Inf check for free (both propagate NaN; inf shows as a min or max).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from . import malloc, npiq4, npkquants

T = GGMLQuantizationType
NUMPY_TYPES = frozenset({T.Q8_0, T.Q4_0, T.Q5_0, T.Q4_1, T.Q5_1})
# the search types without importance weights (those searches are torch's)
_SEARCH_KERNELS = {**npkquants.KERNELS, **npiq4.KERNELS}
_SEARCH_CHUNK = {**npkquants.CHUNK, **npiq4.CHUNK}
NUMPY_SEARCH_TYPES = frozenset(_SEARCH_KERNELS)
TORCH_FREE_TYPES = NUMPY_TYPES | NUMPY_SEARCH_TYPES
CHUNK = 1 << 18  # values per chunk: its temporaries (~5 MB) stay in L2/L3
# where each type's fp16 scales lie in a block: an exponent of all ones (inf/NaN) is refused, as llama-quantize does
FP16_FIELDS: dict[T, tuple[int, ...]] = {
    T.Q8_0: (0,), T.Q4_0: (0,), T.Q5_0: (0,), T.Q4_1: (0, 2), T.Q5_1: (0, 2),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.IQ4_NL: (0,), T.IQ4_XS: (0,),
}
_F0 = np.float32(0.0)
_BELOW_HALF = np.nextafter(np.float32(0.5), np.float32(0.0))  # 0.49999997f


def chunk_values(qtype: T) -> int:
    """Values a worker quantizes at a time."""
    return CHUNK if qtype in NUMPY_TYPES else _SEARCH_CHUNK[qtype]


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

# A chunk of blocks x (n, 32) is transposed once, in groups of four values, to P (8, 4n): P[j, 4b + p] is
# x[b, 4j + p] (numpy transposes a 16-byte item in little more time than a 4-byte one: 0.6x the time of a
# transpose in pairs). Each block's min and max are then reductions along P's leading axis (numpy adds row after
# row at memory speed; along rows of 32 its reductions cost ~15x more), and Q4_0/Q5_0's passes run along rows
# of 4n values with the per-block scale repeated as a (1, 4n) operand; their bytes go back to the blocks' layout
# as 4-byte words. numpy's uint8 minimum takes its bound as a (1, 4n) array (with a scalar it is 10x slower),
# and bit shifts run on uint32 words (its uint8 shifts are not vectorised: 6x slower). Q8_0 works in x's own
# layout (32 bytes a block transposed back cost more than its few passes save).

LANES = 4  # values per transposed item (complex128)
_GATHER = np.uint32(1 + (1 << 7) + (1 << 14) + (1 << 21))  # bytes b0..b3 of a word (0 or 1) to bits 21..24
_NIBBLE_PLACES = (np.uint32(1) << (4 * np.arange(8, dtype=np.uint32)))[:, None]  # row r's bits to bits 4r..4r+3


def _groups(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.view(np.complex128).T).view(np.float32)


def _min_max(P: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    lo4, hi4 = np.minimum.reduce(P, axis=0), np.maximum.reduce(P, axis=0)
    lo2 = np.minimum(lo4[0::4], lo4[1::4])
    hi2 = np.maximum(hi4[0::4], hi4[1::4])
    return (np.minimum(lo2, np.minimum(lo4[2::4], lo4[3::4]), out=lo2),
            np.maximum(hi2, np.maximum(hi4[2::4], hi4[3::4]), out=hi2))


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
    """d as each block's first two bytes (every block size here is even: a uint16 column of ``out``)."""
    out.view(np.uint16)[:, 0] = d.astype("<f2").view(np.uint16)


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
    v += _BELOW_HALF  # roundf(|v|) == trunc(|v| + 0.49999997f) (see legacy), <= 127
    q = v.astype(np.uint8).view(np.int8)
    m = neg.view(np.int8)
    np.negative(m, out=m)  # 0 or -1: (q ^ m) - m is q with v's sign
    q ^= m
    q -= m
    out[:, 2:] = q.view(np.uint8)
    return True


def _levels_plus(P: np.ndarray, d: np.ndarray, offset: float, top: int) -> np.ndarray | None:
    """``MIN(top, (int8_t)(x*id + offset))`` as uint8 in P's layout: every x*id + offset lies in
    [0.5, 2*offset], so the float -> uint8 conversion is C's truncation. P is overwritten."""
    idv = _inverse(d)
    if idv is None:
        return None
    v = np.multiply(P, np.repeat(idv, LANES)[None], out=P)
    v += np.float32(offset)  # two roundings, as C's x*id + offset
    q = v.astype(np.uint8)
    return np.minimum(q, np.full((1, q.shape[1]), top, dtype=np.uint8), out=q)


def _put_nibbles(out: np.ndarray, q: np.ndarray) -> None:
    """Bytes e = q[e] | q[e + 16] << 4 of every block into ``out`` (n, 16), from levels (< 16) in P's layout:
    rows j and j + 4 hold elements 4j + p and 4j + 16 + p; a uint32 of a row is a block's bytes 4j .. 4j + 3.
    The shift runs on uint32 words (no byte carries past its own byte: numpy's uint8 shifts are not vectorised)."""
    packed = q[4:].view(np.uint32) << np.uint32(4)
    packed |= q[:4].view(np.uint32)
    out.view(np.uint32)[:] = packed.T


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
    _put_five_bits(out[:, 2:], q)
    return True


def _put_five_bits(out: np.ndarray, q: np.ndarray) -> None:
    """qh (4 bytes) then qs (16) of every block into ``out`` (n, 20), from levels (< 32) in P's layout.

    qh: bit i of byte k is element 8k + i's fifth bit, i.e. row 2k + i // 4, lane i % 4 of P's layout. In a
    row's uint32 word the four lanes' bits are bytes 0-3 (bits 0, 8, 16, 24); times _GATHER they also land,
    without carries, in bits 21-24, which puts element 4r + lane's bit at bit 4r + lane of the word qh is."""
    g = q.view(np.uint32) >> np.uint32(4)
    g &= np.uint32(0x01010101)  # each byte's fifth bit (the byte above's low bits moved in above it)
    g *= _GATHER
    g >>= np.uint32(21)
    g &= np.uint32(0xF)
    g *= _NIBBLE_PLACES
    out[:, :4].view(np.uint32)[:, 0] = np.bitwise_or.reduce(g, axis=0)
    q &= np.uint8(0x0F)
    _put_nibbles(out[:, 4:], q)


def _first_of_zeros(x: np.ndarray, m: np.ndarray) -> np.ndarray:
    """A block's min (or max) as C's scan finds it: where it is a zero, the block's first zero, -0.0 or +0.0
    (it ends up in Q4_1/Q5_1's fp16 min, and in max - min)."""
    z = np.flatnonzero(m == 0)
    if len(z):
        sub = x[z]
        m[z] = sub[np.arange(len(z)), (sub == 0).argmax(axis=1)]
    return m


def _levels_from_min(x: np.ndarray, P: np.ndarray, lo: np.ndarray, hi: np.ndarray, nmax: float, out: np.ndarray):
    """Q4_1/Q5_1's scale and levels: d = (max - min) / nmax into ``out``'s fp16 fields d and m, and
    ``(uint8_t)((x - min) * id + 0.5f)`` in P's layout (each in [0.5, nmax + 0.5]: C's truncation), or None
    where some 1/d overflows. P is overwritten."""
    mn, mx = _first_of_zeros(x, lo), _first_of_zeros(x, hi)
    d = (mx - mn) / np.float32(nmax)
    idv = _inverse(d)
    if idv is None:
        return None
    _put_fp16(out, d)
    out.view(np.uint16)[:, 1] = mn.astype("<f2").view(np.uint16)
    v = np.subtract(P, np.repeat(mn, LANES)[None], out=P)  # three roundings, as C's (x - min) * id + 0.5f
    v *= np.repeat(idv, LANES)[None]
    v += np.float32(0.5)
    return v.astype(np.uint8)


def _q4_1(x: np.ndarray, P: np.ndarray, lo: np.ndarray, hi: np.ndarray, out: np.ndarray) -> bool:
    q = _levels_from_min(x, P, lo, hi, 15.0, out)
    if q is None:
        return False
    np.minimum(q, np.full((1, q.shape[1]), 15, dtype=np.uint8), out=q)  # MIN(15, ...)
    _put_nibbles(out[:, 4:], q)
    return True


def _q5_1(x: np.ndarray, P: np.ndarray, lo: np.ndarray, hi: np.ndarray, out: np.ndarray) -> bool:
    q = _levels_from_min(x, P, lo, hi, 31.0, out)  # no clamp in ggml: below 32 anyway
    if q is None:
        return False
    _put_five_bits(out[:, 4:], q)
    return True


_KERNELS = {T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.Q5_0: _q5_0, T.Q4_1: _q4_1, T.Q5_1: _q5_1}


def _torch_chunk(x: np.ndarray, qtype: T) -> np.ndarray:
    """The torch kernel for a chunk the fast path leaves (imports torch)."""
    import torch

    from . import legacy

    fn = {T.Q8_0: legacy.quantize_q8_0, T.Q4_0: legacy.quantize_q4_0, T.Q5_0: legacy.quantize_q5_0,
          T.Q4_1: legacy.quantize_q4_1, T.Q5_1: legacy.quantize_q5_1}[qtype]
    return fn(torch.from_numpy(np.ascontiguousarray(x))).numpy()


def quantize_chunk(c: np.ndarray, qtype: T, name: str, check_scales: bool, o: np.ndarray) -> None:
    """One chunk ``c`` (float32 blocks, (n, block size)) into ``o`` (uint8, (n, type size)), with
    :func:`quantize_rows`' errors."""
    if qtype in NUMPY_SEARCH_TYPES:
        if not np.isfinite(c).all():
            raise ValueError(f"{name}: contains NaN/Inf values")
        o[:] = _SEARCH_KERNELS[qtype](c)
        if check_scales:
            _check_fp16(o, qtype, name)
        return
    kernel = _KERNELS[qtype]
    with np.errstate(all="ignore"):
        P = _groups(c)
        lo, hi = _min_max(P)  # NaN propagates through both; an inf is a min or a max
        if not (np.isfinite(lo).all() and np.isfinite(hi).all()):
            raise ValueError(f"{name}: contains NaN/Inf values")
        if not kernel(c, P, lo, hi, o):
            o[:] = _torch_chunk(c, qtype)
    if check_scales:
        _check_fp16(o, qtype, name)


def _check_fp16(o: np.ndarray, qtype: T, name: str) -> None:
    """Refuse blocks whose fp16 scale overflowed to inf: ggml's quantizers write them and llama-quantize then
    fails ("quantized data validation failed"); such a GGUF would decode to inf/NaN."""
    for at in FP16_FIELDS[qtype]:
        if np.count_nonzero((o[:, at + 1] & 0x7C) == 0x7C):  # fp16 exponent all ones
            raise ValueError(f"{name}: values too large for {qtype.name}: a block scale overflows fp16 "
                             "(llama-quantize rejects such data too)")


def quantize_rows(values: np.ndarray, qtype: T, name: str = "tensor", *, check_scales: bool = True,
                  n_workers: int | None = None) -> np.ndarray:
    """``values`` (float32, any shape, rows of whole blocks) in ``qtype`` (one of TORCH_FREE_TYPES) as uint8
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
    step = chunk_values(qtype) // bs

    def work(b0: int) -> None:
        quantize_chunk(x[b0:b0 + step], qtype, name, check_scales, out[b0:b0 + step])

    starts = range(0, nb, step)
    n_workers = min(n_workers or workers(), len(starts))
    if n_workers > 1:  # numpy lets the GIL go inside each pass: threads share the chunks (the K-quants' less well)
        with ThreadPoolExecutor(max_workers=n_workers) as pool:
            for f in [pool.submit(work, b0) for b0 in starts]:
                f.result()
    else:
        for b0 in starts:
            work(b0)
    return out.reshape(*shape[:-1], shape[-1] // bs * ts)

