"""C float32 arithmetic of ggml's quantizers in numpy alone (no torch).

The rules of :mod:`.legacy` and :mod:`.cfloat` for numpy arrays: one IEEE float32 operation at a time in the C
order (numpy 2 keeps Python scalars float32), sums accumulated row after row like the C ``sum += ...`` loops,
and ggml's ``nearest_int`` bit trick. :mod:`.npquant` and :mod:`.npkquants` build on it, so a quantization to
their types never imports torch (~1.4 s of start-up); :mod:`.legacy` and :mod:`.cfloat` use it for their numpy
branches.
"""

from __future__ import annotations

import functools
from typing import Callable

import numpy as np

QK_K = 256
MAGIC = 12582912.0  # 1.5 * 2**23, ggml's nearest_int bias
SAFE = 4194304.0  # 2**22: below it ggml's nearest_int(f) is round-half-even(f)
_F0 = np.float32(0.0)


def f32(v: float) -> float:
    """Round a Python number to the nearest float32 (a C ``float`` constant)."""
    return float(np.float32(v))


GROUP_MAX_EPS = f32(1e-15)


# --------------------------------------------------------------------------- conversions

def nearest_int(f: np.ndarray) -> np.ndarray:
    """ggml's ``nearest_int``: ``(bits(f + 12582912.f) & 0x7fffff) - 0x400000`` (int32)."""
    v = (f + np.float32(MAGIC)).view(np.int32)
    return (v & 0x007FFFFF) - 0x00400000


def clip_(a: np.ndarray, lo, hi) -> np.ndarray:
    """np.clip in place, without its per-call dtype checks (a tenth of a short loop's time)."""
    return np.minimum(np.maximum(a, lo, out=a), hi, out=a)


def nearest_int_clip_(f: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """``MAX(lo, MIN(hi, nearest_int(f)))`` in place: ``f``'s buffer, returned as int32."""
    f += np.float32(MAGIC)
    i = f.view(np.int32)
    i &= 0x007FFFFF
    i -= 0x00400000
    return clip_(i, lo, hi)


def wrap_i8(v: np.ndarray) -> np.ndarray:
    """Two's-complement truncation of ints to the int8 range (kept in their dtype); torch tensors too."""
    u = v & 0xFF
    return u - ((u & 0x80) << 1)


def u8(v: np.ndarray) -> np.ndarray:
    """Store ints into a C ``uint8_t`` (wrap)."""
    return v if v.dtype == np.uint8 else (v & 0xFF).astype(np.uint8)


def fp16_bits(x: np.ndarray) -> np.ndarray:
    """IEEE round-to-nearest-even fp16 of float32 ``x`` (shape (N,)) as (N, 2) little-endian bytes (inf where it
    overflows, as C's conversion; the kernels' callers refuse such scales)."""
    with np.errstate(over="ignore"):
        return np.ascontiguousarray(x, dtype="<f2").view(np.uint8).reshape(-1, 2)


def fp16_round(x: np.ndarray) -> np.ndarray:
    """``GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(x))``."""
    with np.errstate(over="ignore"):
        return x.astype(np.float16).astype(np.float32)


def rdiv(a: float, b: np.ndarray, out=None) -> np.ndarray:
    """IEEE float32 ``a / b`` for a constant numerator (into ``out`` if given)."""
    return np.divide(np.float32(a), b, out=out)


# --------------------------------------------------------------------------- scans and sums

def first_absmax(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """C loop ``if (fabsf(v) > amax) { amax = fabsf(v); max = v; }`` from 0 along ``axis``: (amax, max), max
    +0.0 where every element is zero; NaNs skipped, as the C compare does."""
    a = np.nan_to_num(np.abs(x), nan=0.0)
    idx = np.expand_dims(a.argmax(axis=axis), axis)  # the first index of the maximum
    amax = np.take_along_axis(a, idx, axis).squeeze(axis)
    mx = np.take_along_axis(x, idx, axis).squeeze(axis)
    return amax, np.where(amax > 0, mx, _F0)


def absmax_cols(X: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`first_absmax` along axis 0 from the column min and max, which it returns too: (amax, max,
    column min, column max). The first element of largest |x| is +amax or -amax; only a column holding both
    (or a NaN) needs the index scan. All-zero columns give +0.0."""
    lo, hi = np.minimum.reduce(X, axis=0), np.maximum.reduce(X, axis=0)
    amax = np.maximum(hi, -lo)
    pos = hi == amax
    if np.count_nonzero((pos & (lo == -amax) & (amax > 0)) | (amax != amax)):
        amax, mx = first_absmax(X, 0)
        return amax, mx, lo, hi
    return amax, np.where(amax > 0, np.where(pos, amax, -amax), _F0), lo, hi


def pos_max(v: np.ndarray, axis: int) -> np.ndarray:
    """``float m = 0; for (...) if (v > m) m = v;`` (always +0.0 when nothing is positive)."""
    return np.where(v > 0, v, _F0).max(axis=axis)


def seq_sum(a: np.ndarray, dim: int = 0) -> np.ndarray:
    """``s += a[i]`` along ``dim`` (not the innermost) of a float32 array, in C order.

    numpy adds row after row along a leading axis, but only while something is left beside it: with a single
    column the reduction becomes a contiguous one, which numpy sums pairwise. A zero column is added then.
    """
    with np.errstate(all="ignore"):  # inf/NaN propagate exactly as in C
        if a.shape[dim] > 0 and a.size == a.shape[dim]:
            col = a.reshape(-1, 1)
            s = np.add.reduce(np.concatenate([col, np.zeros_like(col)], axis=1), axis=0, initial=_F0)
            return s[:1].reshape(a.shape[:dim] + a.shape[dim + 1:])
        return np.add.reduce(a, axis=dim, initial=_F0)


def seq_sum_from_first(a: np.ndarray) -> np.ndarray:
    """``float s = a[0]; for (i = 1...) s += a[i];`` along axis 0: :func:`seq_sum` but for the sign of a zero
    (starting from ``a[0]`` keeps -0.0 when every term is -0.0)."""
    s = seq_sum(a)
    z = s == 0
    if np.count_nonzero(z):
        all_neg_zero = (np.signbit(a) & (a == 0)).all(axis=0)
        s = np.where(all_neg_zero, np.float32(-0.0), s)
    return s


# numpy's C einsum without the Python wrapper and its array-function dispatch (half its
# per-call cost at these sizes); np.einsum where a numpy does not have it there
_EINSUM = getattr(getattr(getattr(np, "_core", None), "multiarray", None), "c_einsum", None) or np.einsum


def einsum_is_exact(einsum: Callable = _EINSUM) -> bool:
    """True if numpy's float32 ``einsum`` sums of products round like the C loops.

    ``einsum('ij,ij,ij->j', a, b, c)`` must compute ``s += (a*b)*c`` row after
    row with every product and sum rounded separately.  This numpy does (its
    einsum inner loops are built for the baseline ISA, which has no FMA), but a
    build whose baseline has FMA would contract them: the probe catches that,
    a pairwise order and a different product order, and the kernels then fall
    back to a multiply and a separate row-by-row reduction.
    """
    e = np.float32(2.0 ** -12)
    one = np.float32(1.0)
    # fused multiply-add: -(1+2^-11) + (1+2^-12)^2 is 0 when rounded separately, 2^-24 fused
    a = np.array([[one], [one + e]], dtype=np.float32)
    b = np.array([[-(one + 2 * e)], [one + e]], dtype=np.float32)
    # order: 1 + 1e8 - 1e8 is 0 row after row, 1 pairwise or backwards
    c = np.array([[1.0], [1e8], [-1e8]], dtype=np.float32)
    ones = np.ones_like(c)
    # product order: these three give (x*y)*z != x*(y*z) == the exactly rounded product
    x, y, z = (np.array([[v]], dtype=np.float32) for v in (0.9349475502967834, 1.4741861820220947, 1.3976776599884033))
    with np.errstate(all="ignore"):
        ok = einsum("ij,ij->j", a, b)[0] == 0.0
        ok &= einsum("ij,ij->j", c, ones)[0] == 0.0
        ok &= einsum("ij,ij,ij->j", x, y, z)[0] == ((x * y) * z)[0, 0]
    return bool(ok)


EINSUM_EXACT = einsum_is_exact()


def dot_einsum(A: np.ndarray, B: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``s += a*b`` along axis 0, one pass, into ``out``."""
    return _EINSUM("ij,ij->j", A, B, out=out)


def dot3_einsum(A: np.ndarray, B: np.ndarray, C: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``s += a*b*c``, i.e. ``(a*b)*c``, along axis 0, one pass, into ``out``."""
    return _EINSUM("ij,ij,ij->j", A, B, C, out=out)


def dot_reduce(A: np.ndarray, B: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Fallback of :func:`dot_einsum`: a product, then the row-by-row sum (see :func:`seq_sum`)."""
    return np.add.reduce(A * B, axis=0, initial=_F0, out=out)


def dot3_reduce(A: np.ndarray, B: np.ndarray, C: np.ndarray, out: np.ndarray) -> np.ndarray:
    return np.add.reduce((A * B) * C, axis=0, initial=_F0, out=out)


class Dots:
    """The sums of products the searches run: einsum where the probe accepts it (tests swap the fallback in)."""

    dot = staticmethod(dot_einsum if EINSUM_EXACT else dot_reduce)
    dot3 = staticmethod(dot3_einsum if EINSUM_EXACT else dot3_reduce)


# --------------------------------------------------------------------------- the searches' candidate scales

@functools.lru_cache(maxsize=None)
def qx_candidates(nmax: int) -> tuple[float, ...]:
    """make_qx_quants' iscale numerators: -nmax, then -(nmax + 0.1*is) for is = -9..9, is != 0
    (float32 arithmetic; numpy scalar ops cost a microsecond each, so once per process)."""
    return (f32(-nmax),) + tuple(
        float(-(np.float32(nmax) + np.float32(0.1) * np.float32(i))) for i in range(-9, 10) if i != 0
    )


@functools.lru_cache(maxsize=None)
def qkx2_candidates(nmax: int, rmin: float, rdelta: float, nstep: int) -> tuple[float, ...]:
    """make_qkx2_quants' iscale numerators ``rmin + rdelta*is + nmax`` in float32."""
    return tuple(
        float(np.float32(np.float32(rmin) + np.float32(rdelta) * np.float32(step)) + np.float32(nmax))
        for step in range(nstep + 1)
    )
