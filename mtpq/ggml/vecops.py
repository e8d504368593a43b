"""Per-sub-block vector ops of the torch search loops (:mod:`.search`, other devices than the CPU).

On CPU the searches run in numpy (:mod:`.npkquants`, a third of torch's per-call overhead on the many small
per-candidate vector ops): :func:`numpy_path` says which, and the tests switch it off to run the torch code on
CPU too.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from .cfloat import _F32, _seq_sum
from .legacy import first_absmax, rdiv


class _TorchVec:
    """The per-sub-block vector ops of the torch searches, for other devices (CUDA...)."""

    rdiv = staticmethod(rdiv)

    @staticmethod
    def amax(v) -> float:
        return float(v.max())  # NaN propagates

    @staticmethod
    def amin(v) -> float:
        return float(v.min())

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


def numpy_path(X: torch.Tensor) -> bool:
    """Whether a search on ``X`` runs :mod:`.npkquants`' numpy code (on the CPU tensor's memory)."""
    return X.device.type == "cpu"


def cpu_runs(numpy_kernel: Callable):
    """Decorator of a torch kernel ``f(x, *weights)``: on a CPU tensor (:func:`numpy_path`) ``numpy_kernel``
    runs instead, on the tensors' memory, with the same bytes."""
    def wrap(kernel: Callable) -> Callable:
        @functools.wraps(kernel)
        def run(x: torch.Tensor, *args, **kwargs):
            if not numpy_path(x):
                return kernel(x, *args, **kwargs)
            arr = lambda a: a.numpy() if isinstance(a, torch.Tensor) else a  # noqa: E731
            return torch.from_numpy(numpy_kernel(x.numpy(), *map(arr, args), **{k: arr(a) for k, a in kwargs.items()}))
        return run
    return wrap


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
