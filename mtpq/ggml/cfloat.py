"""C float32 arithmetic of ggml's K-quant loops, reproduced on tensors.

The K-quant and IQ4 kernels (:mod:`.kquants`, :mod:`.iq4`, :mod:`.weighted`)
view a chunk of super-blocks ``x`` (n_blocks, 256) as sub-blocks stored
element-major, ``X`` (n, n_sub) with n = 16 or 32, so that "element i of every
sub-block" is one contiguous row (:func:`_sub_blocks`).  Sums are accumulated
strictly sequentially in float32, exactly like the C ``sum += ...`` loops
(torch's own reductions use another order): on CPU as one numpy reduction along
dim 0, which adds row after row (:mod:`.cnumpy`); elsewhere by a Python loop over
the 16/32 rows. On CPU the K-quant searches run in numpy (:mod:`.npkquants`).

See :mod:`mtpq.ggml.legacy` for the other float rules (no fused ops, IEEE
division helpers, ``nearest_int`` bit trick, C integer wrap-around), and
docs/notes/quantize.md for what was measured to make it fast.
"""

from __future__ import annotations

import numpy as np
import torch

from .cnumpy import GROUP_MAX_EPS as _GROUP_MAX_EPS, QK_K, SAFE as _SAFE, seq_sum as seq_sum_np  # noqa: F401  (the kernels import them from here)
from .legacy import nearest_int

_F32 = torch.float32


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
