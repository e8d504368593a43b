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


# --------------------------------------------------------------------------- kernels on (n_blocks, 32) float32

def _min_max(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    xt = np.ascontiguousarray(x.T)
    return np.minimum.reduce(xt, axis=0), np.maximum.reduce(xt, axis=0)


def _signed_absmax(x: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """:func:`.legacy.first_absmax`'s ``max`` (the first element of largest |x|, +0.0 for a zero row) from
    the rows' min and max: it is +amax or -amax, and only a row holding both needs the first index."""
    amax = np.maximum(hi, -lo)
    pos = hi == amax
    mx = np.where(pos, hi, lo)
    both = pos & (lo == -amax) & (amax > 0)
    if np.count_nonzero(both):
        rows = np.flatnonzero(both)
        sub = x[rows]
        mx[rows] = sub[np.arange(len(rows)), np.abs(sub).argmax(axis=1)]
    return np.where(amax > 0, mx, _F0)


def _fp16(d: np.ndarray) -> np.ndarray:
    return d.astype("<f2")


def _q8_0(x: np.ndarray, lo: np.ndarray, hi: np.ndarray, out: np.ndarray) -> bool:
    amax = np.maximum(hi, -lo) + _F0  # max |x|; + 0 makes an all-zero row's -0.0 the +0.0 of abs().amax()
    d = amax / np.float32(127.0)
    nz = d != 0
    idv = np.divide(np.float32(1.0), d, out=np.zeros_like(d), where=nz)
    if np.isinf(idv).any():
        return False
    out[:, :2] = _fp16(d).view(np.uint8).reshape(-1, 2)
    v = x * idv[:, None]
    v += np.copysign(_BELOW_HALF, v)  # roundf(v) == trunc(v + copysign(0.49999997f, v)) (see legacy)
    out[:, 2:] = v.astype(np.int8).view(np.uint8)  # astype truncates toward zero
    return True


def _levels_plus(x: np.ndarray, d: np.ndarray, offset: float, top: int) -> np.ndarray | None:
    nz = d != 0
    idv = np.divide(np.float32(1.0), d, out=np.zeros_like(d), where=nz)
    if np.isinf(idv).any():
        return None
    v = x * idv[:, None]
    v += np.float32(offset)  # two roundings, as C's x*id + offset
    q = v.astype(np.uint8)  # every x*id + offset lies in [0.5, 2*offset]: truncation
    return np.minimum(q, np.uint8(top), out=q)


def _q4_0(x: np.ndarray, lo: np.ndarray, hi: np.ndarray, out: np.ndarray) -> bool:
    d = _signed_absmax(x, lo, hi) / np.float32(-8.0)
    q = _levels_plus(x, d, 8.5, 15)
    if q is None:
        return False
    out[:, :2] = _fp16(d).view(np.uint8).reshape(-1, 2)
    np.bitwise_or(q[:, :16], q[:, 16:] << 4, out=out[:, 2:])
    return True


def _q5_0(x: np.ndarray, lo: np.ndarray, hi: np.ndarray, out: np.ndarray) -> bool:
    d = _signed_absmax(x, lo, hi) / np.float32(-16.0)
    q = _levels_plus(x, d, 16.5, 31)
    if q is None:
        return False
    out[:, :2] = _fp16(d).view(np.uint8).reshape(-1, 2)
    out[:, 2:6] = np.packbits(q >> 4, axis=1, bitorder="little")  # bit j of the uint32: element j's fifth bit
    q &= 0x0F
    np.bitwise_or(q[:, :16], q[:, 16:] << 4, out=out[:, 6:])
    return True


_KERNELS = {T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.Q5_0: _q5_0}


def _torch_chunk(x: np.ndarray, qtype: T) -> np.ndarray:
    """The torch kernel for a chunk the fast path leaves (imports torch)."""
    import torch

    from . import legacy

    fn = {T.Q8_0: legacy.quantize_q8_0, T.Q4_0: legacy.quantize_q4_0, T.Q5_0: legacy.quantize_q5_0}[qtype]
    return fn(torch.from_numpy(np.ascontiguousarray(x))).numpy()


def quantize_rows(values: np.ndarray, qtype: T, name: str = "tensor", *, check_scales: bool = True,
                  n_workers: int | None = None) -> np.ndarray:
    """``values`` (float32, any shape, rows of whole blocks) in ``qtype`` (one of NUMPY_TYPES) as uint8
    ``(..., bytes_per_row)``; the ValueErrors of :func:`.kernels.quantize` (NaN/Inf, fp16 scale overflow)."""
    qtype = T(qtype)
    bs, ts = GGML_QUANT_SIZES[qtype]
    shape = values.shape if values.ndim else (1,)
    if shape[-1] % bs:
        raise ValueError(f"{name}: row length {shape[-1]} is not a multiple of the {qtype.name} block size {bs}")
    x = np.ascontiguousarray(values, dtype=np.float32).reshape(-1, bs)
    nb = x.shape[0]
    out = np.empty((nb, ts), dtype=np.uint8)
    kernel = _KERNELS[qtype]
    step = CHUNK // bs

    def work(b0: int) -> None:
        c, o = x[b0:b0 + step], out[b0:b0 + step]
        with np.errstate(all="ignore"):
            lo, hi = _min_max(c)
            if not (np.isfinite(lo).all() and np.isfinite(hi).all()):
                raise ValueError(f"{name}: contains NaN/Inf values")
            if not kernel(c, lo, hi, o):
                o[:] = _torch_chunk(c, qtype)
        if check_scales and bool(((o[:, 1] & 0x7C) == 0x7C).any()):  # the fp16 d overflowed, as kernels checks
            raise ValueError(f"{name}: values too large for {qtype.name}: a block scale overflows fp16 "
                             "(llama-quantize rejects such data too)")

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

