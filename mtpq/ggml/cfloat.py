"""C float32 arithmetic of ggml's K-quant loops, reproduced on tensors.

The K-quant and IQ4 kernels (:mod:`.kquants`, :mod:`.iq4`, :mod:`.weighted`)
view a chunk of super-blocks ``x`` (n_blocks, 256) as sub-blocks stored
element-major, ``X`` (n, n_sub) with n = 16 or 32, so that "element i of every
sub-block" is one contiguous row (:func:`_sub_blocks`).  Sums are accumulated
strictly sequentially in float32, exactly like the C ``sum += ...`` loops
(torch's own reductions use another order): on CPU as numpy ``einsum`` sums of
products (one pass, no temporary; probed at import, see
:func:`_einsum_is_exact`) or one numpy reduction along dim 0, which adds row
after row; elsewhere by a Python loop over the 16/32 rows.

See :mod:`mtpq.ggml.legacy` for the other float rules (no fused ops, IEEE
division helpers, ``nearest_int`` bit trick, C integer wrap-around), and
docs/notes/quantize.md for what was measured to make it fast.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from .legacy import f32, nearest_int

QK_K = 256
_F32 = torch.float32
_GROUP_MAX_EPS = f32(1e-15)


# --------------------------------------------------------------------------- layout and sequential sums

def _sub_blocks(x: torch.Tensor, n: int) -> torch.Tensor:
    """(nb, 256) -> (n, nb*256/n): column s is sub-block s, row i its element i."""
    if x.device.type == "cpu":  # numpy transposes this shape 2-3x faster than torch
        return torch.from_numpy(np.ascontiguousarray(x.numpy().reshape(-1, n).T))
    return x.reshape(-1, n).t().contiguous()


def _from_sub_blocks(X: torch.Tensor, nb: int) -> torch.Tensor:
    """Inverse of :func:`_sub_blocks` (any dtype)."""
    if X.device.type == "cpu":
        return torch.from_numpy(np.ascontiguousarray(X.numpy().T)).reshape(nb, QK_K)
    return X.t().reshape(nb, QK_K)


def _seq_sum(T: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``float s = 0; for (i...) s += T[i];`` along ``dim``, in float32.

    On CPU numpy's reduction along a non-innermost axis does exactly this in one
    call (``out[j] += T[i, j]`` row after row, in float32; pairwise summation is
    only used along the innermost axis), instead of one torch op per row.
    """
    if T.device.type == "cpu" and dim < T.dim() - 1:
        return torch.from_numpy(seq_sum_np(T.numpy(), dim))
    T = T.movedim(dim, 0)
    acc = T[0] + 0.0  # 0.0f + t: same bits as the C accumulator after one step
    for i in range(1, T.shape[0]):
        acc.add_(T[i])
    return acc


def seq_sum_np(a: np.ndarray, dim: int = 0) -> np.ndarray:
    """``s += a[i]`` along ``dim`` (not the innermost) of a float32 numpy array, in C order.

    numpy adds row after row along a leading axis, but only while something is
    left beside it: with a single column the reduction becomes a contiguous one,
    which numpy sums pairwise.  A zero column is added then.
    """
    with np.errstate(all="ignore"):  # inf/NaN propagate exactly as in C
        if a.shape[dim] > 0 and a.size == a.shape[dim]:
            col = a.reshape(-1, 1)
            s = np.add.reduce(np.concatenate([col, np.zeros_like(col)], axis=1), axis=0, initial=np.float32(0.0))
            return s[:1].reshape(a.shape[:dim] + a.shape[dim + 1:])
        return np.add.reduce(a, axis=dim, initial=np.float32(0.0))


def _seq_sum_from_first(T: torch.Tensor) -> torch.Tensor:
    """``float s = T[0]; for (i = 1...) s += T[i];`` along dim 0.

    Equal to :func:`_seq_sum` except for the sign of a zero: starting from
    ``T[0]`` keeps -0.0 when every term is -0.0 (once a partial sum is nonzero
    both sequences are the same ops on the same values).
    """
    s = _seq_sum(T)
    z = s == 0
    if bool(z.any()):
        all_neg_zero = (torch.signbit(T) & (T == 0)).all(dim=0)
        s = torch.where(all_neg_zero, torch.full((), -0.0, dtype=s.dtype, device=s.device), s)
    return s


_SAFE = 4194304.0  # 2**22: below it ggml's nearest_int(f) is round-half-even(f)


def _round_clamp_exact(f: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Same for any f (inf/NaN/huge included) via the bit-level ``nearest_int``; float32 result."""
    return torch.clamp(nearest_int(f), lo, hi).to(_F32)


def _zeros(ref: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=ref.dtype, device=ref.device)


def _select(cond: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``where(cond[None], a, b)`` for int32 (n, ns) tensors; plain arithmetic is
    several times faster than torch.where on CPU."""
    return b + (a - b) * cond.to(torch.int32)[None]


def _pos_max(v: torch.Tensor, dim: int) -> torch.Tensor:
    """``float m = 0; for (...) if (v > m) m = v;`` (always +0.0 when nothing is positive)."""
    if isinstance(v, np.ndarray):
        return np.where(v > 0, v, np.float32(0.0)).max(axis=dim)
    return torch.where(v > 0, v, _zeros(v)).amax(dim=dim)  # NaN compares false: skipped


def _cat(parts: list) -> torch.Tensor:
    """Concatenate (N, k) byte fields along dim 1, numpy arrays or tensors."""
    return np.concatenate(parts, axis=1) if isinstance(parts[0], np.ndarray) else torch.cat(parts, dim=1)


# --------------------------------------------------------------------------- sums of products

# numpy's C einsum without the Python wrapper and its array-function dispatch (half its
# per-call cost at these sizes); np.einsum where a numpy does not have it there
_EINSUM = getattr(getattr(getattr(np, "_core", None), "multiarray", None), "c_einsum", None) or np.einsum


def _einsum_is_exact(einsum: Callable = _EINSUM) -> bool:
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


_EINSUM_EXACT = _einsum_is_exact()


def _dot_einsum(A: np.ndarray, B: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``s += a*b`` along dim 0, one pass, into ``out``."""
    return _EINSUM("ij,ij->j", A, B, out=out)


def _dot3_einsum(A: np.ndarray, B: np.ndarray, C: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``s += a*b*c``, i.e. ``(a*b)*c``, along dim 0, one pass, into ``out``."""
    return _EINSUM("ij,ij,ij->j", A, B, C, out=out)


def _dot_reduce(A: np.ndarray, B: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Fallback of :func:`_dot_einsum`: a product, then the row-by-row sum (see :func:`_seq_sum`)."""
    return np.add.reduce(A * B, axis=0, initial=np.float32(0.0), out=out)


def _dot3_reduce(A: np.ndarray, B: np.ndarray, C: np.ndarray, out: np.ndarray) -> np.ndarray:
    return np.add.reduce((A * B) * C, axis=0, initial=np.float32(0.0), out=out)
