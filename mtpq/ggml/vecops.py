"""Per-sub-block vector ops of the search loops, for numpy (CPU) and torch (other devices).

The full-size (n, n_sub) elementwise work of the searches in :mod:`.search`
stays in torch; the many small per-candidate vector ops (one value per
sub-block) go through :func:`_vec_ops`, which picks :class:`_NumpyVec` on CPU
(a third of torch's per-call overhead) and :class:`_TorchVec` elsewhere.
"""

from __future__ import annotations

import numpy as np
import torch

from .cfloat import _EINSUM_EXACT, _F32, _dot3_einsum, _dot3_reduce, _dot_einsum, _dot_reduce, _seq_sum
from .legacy import first_absmax, rdiv


class _VecCommon:
    """Reductions to a Python value, spelled the same for numpy arrays and torch tensors."""

    rdiv = staticmethod(rdiv)  # legacy's takes both

    @staticmethod
    def amax(v) -> float:
        return float(v.max())  # NaN propagates in both

    @staticmethod
    def amin(v) -> float:
        return float(v.min())


class _NumpyVec(_VecCommon):
    """Vector (one value per sub-block) ops of the search loops on CPU.

    The full-size (n, n_sub) elementwise work stays in torch; the sums of
    products run as numpy ``einsum`` (one pass, no temporary), and the many
    small per-candidate vector ops run in numpy, whose per-call overhead is a
    fraction of torch's.  At a few thousand values a vector op costs little
    more than its call, so the loops write into buffers made once (``out=``)
    and the big ops read them through (1, n_sub) torch views made once
    (:meth:`bcast`).  Every op is one IEEE float32 operation either way (numpy
    2 keeps Python scalars float32).  Sums run row after row, as the C loops do.
    """

    where = staticmethod(np.where)
    maximum = staticmethod(np.maximum)
    abs = staticmethod(np.abs)
    mul = staticmethod(np.multiply)
    sub = staticmethod(np.subtract)
    neg = staticmethod(np.negative)
    div = staticmethod(np.divide)
    copy = staticmethod(np.copyto)  # copy(dst, src)
    put = staticmethod(np.putmask)  # put(dst, mask, src): dst[mask] = src[mask] (or the scalar)
    vec = staticmethod(lambda t: t.numpy())  # torch (CPU) -> vector, shared memory
    contig = staticmethod(np.ascontiguousarray)
    imin = staticmethod(np.minimum)
    f32 = staticmethod(lambda a: a.astype(np.float32))
    t = staticmethod(torch.from_numpy)  # vector -> torch, shared memory
    bcast = staticmethod(lambda r: torch.from_numpy(r[None]))  # vector -> (1, n) torch view
    arr = staticmethod(lambda T: T.numpy())  # (n, n_sub) torch -> what dot/dot3 take, shared memory
    clone = staticmethod(np.copy)
    gt = staticmethod(np.greater)

    @staticmethod
    def empty(shape, ref: torch.Tensor) -> np.ndarray:
        return np.empty(shape, dtype=np.float32)

    @staticmethod
    def bools(shape, ref: torch.Tensor) -> np.ndarray:
        return np.empty(shape, dtype=bool)

    @staticmethod
    def last_true(B: np.ndarray) -> np.ndarray:
        """Per column, the index (< 128) of the last True row; B[0] is all True.  A max
        over dim 0 in int8, which numpy reduces row by row (argmax along it is slow)."""
        rows = np.arange(B.shape[0], dtype=np.int8)[:, None]
        return np.maximum.reduce(B.view(np.int8) * rows, axis=0).astype(np.int64)

    @staticmethod
    def consts(values, ref: torch.Tensor) -> np.ndarray:
        return np.array(values, dtype=np.float32)

    @staticmethod
    def any(m: np.ndarray) -> bool:
        return np.count_nonzero(m) > 0  # several times quicker than ndarray.any() here

    @staticmethod
    def take(V: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """``V[idx[j], j]`` for every column j (a flat take: take_along_axis is slower)."""
        n = V.shape[1]
        return V.reshape(-1).take(idx * n + np.arange(n))

    dot = staticmethod(_dot_einsum if _EINSUM_EXACT else _dot_reduce)
    dot3 = staticmethod(_dot3_einsum if _EINSUM_EXACT else _dot3_reduce)

    @staticmethod
    def col_min(T: torch.Tensor) -> np.ndarray:  # torch's reductions along dim 0 are slow
        return np.minimum.reduce(T.numpy(), axis=0)

    @staticmethod
    def col_max(T: torch.Tensor) -> np.ndarray:
        return np.maximum.reduce(T.numpy(), axis=0)


class _TorchVec(_VecCommon):
    """The same in torch, for other devices (CUDA...)."""

    where = staticmethod(torch.where)
    maximum = staticmethod(torch.maximum)
    abs = staticmethod(torch.abs)
    mul = staticmethod(torch.mul)
    sub = staticmethod(torch.sub)
    neg = staticmethod(torch.neg)
    div = staticmethod(torch.div)
    copy = staticmethod(lambda dst, src: dst.copy_(src))
    vec = staticmethod(lambda t: t)
    contig = staticmethod(lambda t: t.contiguous())
    imin = staticmethod(lambda a, b: torch.clamp(a, max=b))
    f32 = staticmethod(lambda a: a.to(_F32))
    t = staticmethod(lambda v: v)
    bcast = staticmethod(lambda r: r[None])
    arr = staticmethod(lambda T: T)
    col_min = staticmethod(lambda T: T.amin(dim=0))
    col_max = staticmethod(lambda T: T.amax(dim=0))
    any = staticmethod(lambda m: bool(m.any()))
    take = staticmethod(lambda V, idx: V.gather(0, idx[None])[0])
    clone = staticmethod(torch.clone)
    gt = staticmethod(torch.gt)

    @staticmethod
    def empty(shape, ref: torch.Tensor) -> torch.Tensor:
        return torch.empty(shape, dtype=_F32, device=ref.device)

    @staticmethod
    def bools(shape, ref: torch.Tensor) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.bool, device=ref.device)

    @staticmethod
    def last_true(B: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(B.shape[0], device=B.device)[:, None]
        return torch.where(B, rows, 0).amax(dim=0)

    @staticmethod
    def consts(values, ref: torch.Tensor) -> torch.Tensor:
        return torch.tensor(values, dtype=_F32, device=ref.device)

    @staticmethod
    def put(dst: torch.Tensor, mask: torch.Tensor, src) -> None:
        dst.copy_(torch.where(mask, src, dst))

    @staticmethod
    def dot(A: torch.Tensor, B: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(_seq_sum(A * B))

    @staticmethod
    def dot3(A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(_seq_sum((A * B).mul_(C)))


def _vec_ops(X: torch.Tensor):
    return _NumpyVec if X.device.type == "cpu" else _TorchVec


def _first_absmax_cols(X: torch.Tensor, v):
    """:func:`first_absmax` along dim 0 as vectors, from the column min and max, which
    it returns too: (amax, max, column min, column max).

    The first element of largest |x| is +amax or -amax; only a column holding
    both (or a NaN) needs the index scan.  All-zero columns give +0.0.
    """
    lo, hi = v.col_min(X), v.col_max(X)
    amax = v.maximum(hi, -lo)
    pos = hi == amax
    if v.any((pos & (lo == -amax) & (amax > 0)) | (amax != amax)):
        amax, mx = first_absmax(X, 0)
        return v.vec(amax), v.vec(mx), lo, hi
    return amax, v.where(amax > 0, v.where(pos, amax, -amax), 0.0), lo, hi
