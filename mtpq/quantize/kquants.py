"""ggml-exact K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) and IQ4_NL / IQ4_XS in torch.

Reproduces byte for byte what ``ggml_quantize_chunk`` produces without an
importance matrix: ``quantize_row_q{2..6}_K_ref`` (with ``make_qkx2_quants``,
``make_q3_quants`` and ``make_qx_quants``) and ``quantize_iq4_nl`` /
``quantize_iq4_xs`` (``quantize_row_iq4_nl_impl`` with ``ntry = 7``).

Layout of the work: a chunk of super-blocks ``x`` (n_blocks, 256) is viewed as
sub-blocks stored element-major, ``X`` (n, n_sub) with n = 16 or 32, so that
"element i of every sub-block" is one contiguous row.  Everything is
vectorised over sub-blocks.  Sums are accumulated strictly sequentially in
float32, exactly like the C ``sum += ...`` loops (torch's own reductions use
another order): on CPU as numpy ``einsum`` sums of products (one pass, no
temporary; probed at import, see :func:`_einsum_is_exact`) or one numpy
reduction along dim 0, which adds row after row; elsewhere by a Python loop
over the 16/32 rows.  The candidate scales of the search loops run one after
the other (make_qkx2_quants' candidates depend on the previous winner) over a
few reused full-size buffers, updated in place; the small per-sub-block
bookkeeping between them runs in numpy on CPU (:class:`_NumpyVec`), whose
per-call overhead is a fraction of torch's.

Speed, for the next engineer: on one core these kernels now take about 0.9x
ggml's time (benchmarks/quant_bench.py --threads 1).  What mattered, measured
on 65536-value chunks:

* The full passes of a candidate (Q6_K: levels 3, sums 2; Q4_K: levels 4,
  sums 3, error 4) stream from L2 at ~0.15-0.3 ns a value; together they are
  only about half of ggml's time.  The rest was per-call overhead: ~30 small
  vector ops per candidate, at 0.5-3 us each, more than the passes.  Hence
  buffers made once and written with ``out=``, (1, n_sub) views made once,
  the least-squares products as two ops on (3, n_sub) views, Q6_K's
  candidates reduced to (19, n_sub) sums first and chosen between afterwards,
  and the per-block scale arithmetic and packing in numpy (a third of a torch
  op's overhead at these sizes).  Measure overhead with a 2-block input: it
  is all overhead.
* glibc returned the freed chunk temporaries to the kernel and faulted them in
  again at every chunk (see ``kernels._keep_freed_buffers``): ~20 % of Q6_K.
* Threads: every op hands the GIL over, so two threads reached only 1.3-1.4x
  one; forked workers scale 1.8-1.9x (``kernels._run_forked``).
* Tried and dropped: ``torch.compile`` of one candidate (bit-exact, but
  dynamo's ~100 us per call ate the gain) or of the whole loop (43 s to
  compile, slower, 5 of 2048 scales changed); an analytic Q6_K search (needs
  a per-sub-block scatter-add, ~3.5 ns a value in numpy and torch); Q6_K's
  choice between candidates from a running maximum checked afterwards (the
  many exact ties between candidates with equal sums, and numpy's slow
  ``maximum.accumulate`` along a leading axis, made it slower than the
  18-step loop on vectors).

With an importance matrix ggml runs other searches (``quantize_row_*_impl``);
:mod:`mtpq.quantize.weighted` builds them from the routines here, which take
the weights as a parameter for that.

See :mod:`mtpq.quantize.legacy` for the float rules (no fused ops, IEEE
division helpers, ``nearest_int`` bit trick, C integer wrap-around).
"""

from __future__ import annotations

import functools
from typing import Callable

import numpy as np
import torch

from .legacy import (
    cst,
    div,
    f32,
    first_absmax,
    first_min,
    fp16_bits,
    fp16_round,
    from_fp16_bytes,
    nearest_int,
    rdiv,
    sqrt_f32,
    u8,
    wrap_i8,
)

__all__ = [
    "quantize_q2_k", "quantize_q3_k", "quantize_q4_k", "quantize_q5_k", "quantize_q6_k",
    "quantize_iq4_nl", "quantize_iq4_xs",
    "dequantize_q2_k", "dequantize_q3_k", "dequantize_q4_k", "dequantize_q5_k", "dequantize_q6_k",
    "dequantize_iq4_nl", "dequantize_iq4_xs",
]

QK_K = 256
_F32 = torch.float32
_GROUP_MAX_EPS = f32(1e-15)
KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


# --------------------------------------------------------------------------- helpers

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


# --------------------------------------------------------------------------- per-column bookkeeping

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


# --------------------------------------------------------------------------- ggml search routines

@functools.lru_cache(maxsize=None)
def _qx_candidates(nmax: int) -> tuple[float, ...]:
    """make_qx_quants' iscale numerators: -nmax, then -(nmax + 0.1*is) for is = -9..9, is != 0
    (float32 arithmetic; numpy scalar ops cost a microsecond each, so once per process)."""
    return (f32(-nmax),) + tuple(
        float(-(np.float32(nmax) + np.float32(0.1) * np.float32(i))) for i in range(-9, 10) if i != 0
    )


@functools.lru_cache(maxsize=None)
def _qkx2_candidates(nmax: int, rmin: float, rdelta: float, nstep: int) -> tuple[float, ...]:
    """make_qkx2_quants' iscale numerators ``rmin + rdelta*is + nmax`` in float32."""
    return tuple(
        float(np.float32(np.float32(rmin) + np.float32(rdelta) * np.float32(step)) + np.float32(nmax))
        for step in range(nstep + 1)
    )


def _make_qx_quants_rmse1(
    X: torch.Tensor, nmax: int, W: torch.Tensor | None = None
) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
    """``make_qx_quants(n, nmax, x, L, rmse_type=1, qw)`` for every column of ``X``:
    ``qw = NULL`` (weights x*x) when ``W`` is None, else the weights ``W`` (same shape).

    Returns (scale (n_sub,), levels) where ``levels()`` gives L (n, n_sub), float32
    in [0, 2*nmax-1].  The 19 candidate scales do not depend on each other: each
    is one reused (n, n_sub) buffer of levels (small enough to stay in cache)
    reduced to its two sums, and the C loop's choice between them -- candidate
    0, then each later one that is strictly better -- runs afterwards on the
    (19, n_sub) sums.  L is computed only on demand: the caller's last pass
    recomputes it anyway wherever the final sub-block scale is nonzero (see
    :func:`_final_levels`).
    """
    v = _vec_ops(X)
    ns = X.shape[1]
    amax, mx, lo, hi = _first_absmax_cols(X, v)
    zero_v = amax < _GROUP_MAX_EPS
    consts = _qx_candidates(nmax)
    nc = len(consts)
    if W is None:
        W = X * X
    WX = W * X
    L = torch.empty_like(X)
    Wa, WXa, La = v.arr(W), v.arr(WX), v.arr(L)
    SLX, SL2 = v.empty((nc, ns), X), v.empty((nc, ns), X)
    with np.errstate(all="ignore"):  # inf/NaN propagate as in C
        ISC = v.div(v.consts(consts, X)[:, None], mx[None])  # (nc, ns): every candidate's iscale
        ISC_t = v.t(ISC)
        # iscale * x lies in [-|c|, |c| * r] (rounding aside), r the largest ratio of the far side
        # of zero to the max; a clamp that cannot act is skipped (columns with max below
        # GROUP_MAX_EPS may hold inf/NaN levels, but they are set to zero below)
        opp = v.where(mx > 0, -lo, hi) / amax
        r = v.amax(v.where(zero_v, 0.0, opp))
        r = r if r <= 1.0 else float("inf")  # NaN: clamp always
        for k, c in enumerate(consts):
            # |iscale * x| <= nmax + 1 whenever max >= GROUP_MAX_EPS, and there nearest_int
            # is round-half-even
            torch.mul(X, ISC_t[k : k + 1], out=L).round_()
            low = -c * (1 + 1e-5) > nmax + 0.5  # may round to -nmax-1
            high = -c * r * (1 + 1e-5) >= nmax - 0.5  # may round to nmax
            if low or high:
                L.clamp_(-nmax if low else None, nmax - 1 if high else None)
            v.dot(WXa, La, SLX[k])  # sum of (w*x)*l
            v.dot3(Wa, La, La, SL2[k])  # sum of (w*l)*l
        NS = v.div(SLX, SL2)  # each candidate's scale
        v.put(NS[0], SL2[0] == 0, 0.0)  # candidate 0: scale = suml2 ? sumlx/suml2 : 0
        Q = v.mul(NS, SLX)  # its "best" = scale * sumlx
        SQ = v.mul(SLX, SLX)
        never = ~(SL2 > 0)
        if v.any(never):
            v.put(SQ, never, -np.inf)  # a candidate with suml2 <= 0 never wins: -inf > y is false
        # the C loop: candidate 0, then each one that is strictly better (a Python step per
        # candidate, but on (n_sub,) vectors of sums); the winner is the last that was better
        best = v.clone(Q[0])
        better = v.bools((nc, ns), X)
        better[0] = True
        tmp = v.empty(ns, X)
        for k in range(1, nc):
            v.gt(SQ[k], v.mul(best, SL2[k], out=tmp), out=better[k])  # sumlx^2 > best * suml2
            v.put(best, better[k], Q[k])
        win = v.last_true(better)
        scale = v.where(zero_v, 0.0, v.take(NS, win))
        best_isc = v.where(zero_v, 0.0, v.take(ISC, win))

    def levels() -> torch.Tensor:
        torch.mul(X, v.t(best_isc)[None], out=L).round_().clamp_(-nmax, nmax - 1)
        return L.add_(nmax).mul_((~v.t(zero_v)).to(_F32)[None])

    return v.t(scale), levels


def _make_q3_quants(X: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``make_q3_quants(n, nmax, x, L, do_rmse=true)`` for every column of ``X``."""
    n, ns = X.shape
    amax, mx = first_absmax(X, 0)
    zero = amax < _GROUP_MAX_EPS
    iscale = rdiv(f32(-nmax), mx)
    L = torch.clamp(nearest_int(iscale[None] * X), -nmax, nmax - 1)
    Lf = L.to(_F32)
    W = X * X
    WX = W * X
    sumlx = _seq_sum(WX * Lf)
    suml2 = _seq_sum((W * Lf) * Lf)
    rows = [L[i] for i in range(n)]
    rows_f = [Lf[i] for i in range(n)]
    for _itry in range(5):
        changed = None
        for i in range(n):
            xi, wi, wxi, li, lfi = X[i], W[i], WX[i], rows[i], rows_f[i]
            slx = sumlx - wxi * lfi
            sl2 = suml2 - (wi * lfi) * lfi
            new_l = torch.clamp(nearest_int(torch.div(xi * sl2, slx)), -nmax, nmax - 1)
            new_lf = new_l.to(_F32)
            slx2 = slx + wxi * new_lf
            sl22 = sl2 + (wi * new_lf) * new_lf
            upd = (slx > 0) & (new_l != li) & (sl22 > 0) & ((slx2 * slx2) * suml2 > (sumlx * sumlx) * sl22)
            rows[i] = torch.where(upd, new_l, li)
            rows_f[i] = torch.where(upd, new_lf, lfi)
            sumlx = torch.where(upd, slx2, sumlx)
            suml2 = torch.where(upd, sl22, suml2)
            changed = upd if changed is None else (changed | upd)
        # a sub-block with no change is at a fixed point: further passes leave it alone
        if not bool(changed.any()):
            break
    L = torch.stack(rows) + nmax
    scale = torch.where(suml2 > 0, torch.div(sumlx, suml2), _zeros(sumlx))
    L = L * (~zero).to(torch.int32)[None]
    scale = torch.where(zero, _zeros(scale), scale)
    return scale, L


def _make_qkx2_quants(
    X: torch.Tensor, W: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool,
    zero_sign: bool = False,
) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
    """``make_qkx2_quants`` for every column. Returns ((scale, the_min) as (2, n_sub), levels).

    ``zero_sign``: also get the sign of a zero ``the_min`` right (the C scan keeps the
    first minimal element, -0.0 or 0.0); Q4_1/Q5_1 store the min as fp16, where it shows.

    ``levels()`` gives the winner's L (n, n_sub) as float32, on demand (see
    :func:`_make_qx_quants_rmse1`).

    The C routine updates ``min`` whenever a candidate wins, and later candidates
    use it, so the candidate loop stays sequential.  Instead of carrying L we
    remember (iscale, min) of the winning candidate and recompute L once.
    Each candidate is four in-place passes for the levels, three sums of
    products and four passes for the error, over two reused (n, n_sub) buffers;
    its per-sub-block arithmetic writes into vectors made once (see
    :class:`_NumpyVec`).
    """
    # The sign of a zero min/max never reaches the output (levels, errors and the
    # 6-bit min codes come out the same), so no first-index scan is needed.
    v = _vec_ops(X)
    ns = X.shape[1]
    xmin, mx = v.col_min(X), v.col_max(X)
    La = torch.empty_like(X)  # levels of the current candidate
    A = torch.empty_like(X)
    Xa, Wa, Laa, Aa = (v.arr(T) for T in (X, W, La, A))  # what the sums of products take
    # The least-squares fit needs six products of the sums.  Laid out as
    # F = [sum_x, sum_l, sum_xl, sum_w, sum_l2, sum_x], they are two products of
    # (3, n_sub) views and one broadcast, N = F[3:6]*F[2:5] - sum_l*F[0:3] =
    # [scale numerator, D, min numerator], each with the C operands.
    F = v.empty((6, ns), X)
    sum_l, sum_xl, sum_l2 = F[1], F[2], F[4]
    v.copy(F[3], v.vec(_seq_sum_from_first(W)))
    v.copy(F[0], v.vec(_seq_sum_from_first(W * X)))
    v.copy(F[5], F[0])
    N, P = v.empty((3, ns), X), v.empty((3, ns), X)
    D = N[1]
    cand = v.empty((2, ns), X)  # this_scale, this_min
    this_scale, this_min = cand
    # the winner so far: the (iscale, min) its levels were computed with, its error, scale and min
    state = v.empty((5, ns), X)
    win_isc, win_mn, best_err, best_scale, best_min = state
    isc, err, rng, tmp = v.empty((4, ns), X)
    isc_b, this_scale_b, this_min_b, best_min_b = (v.bcast(r) for r in (isc, this_scale, this_min, best_min))
    steps = _qkx2_candidates(nmax, rmin, rdelta, nstep)

    def ratio_bound(m, rng) -> float:
        """max |x - m| / |rng|: |iscale * (x - m)| <= c * this (float rounding is monotonic).

        inf when some c / rng could overflow (subnormal ranges); NaN propagates.  Either
        sends ``levels`` down the exact path.
        """
        r = v.abs(rng)
        if not v.amin(r) > 1e-30:
            return float("inf")
        b = v.amax(v.abs(m - xmin) / r)
        return max(1.0, b) if b == b else float("inf")

    def levels(isc_b, m_b, bound: float) -> None:
        """La = clamp(nearest_int(isc * (x - m)), 0, nmax) as float32."""
        torch.sub(X, m_b, out=La).mul_(isc_b)
        if bound < _SAFE:  # there nearest_int is round-half-even
            La.round_().clamp_(0, nmax)
        else:
            La.copy_(_round_clamp_exact(La, 0, nmax))

    def err_sum(sc_b, m_b, out) -> None:
        """out = sum of w * f((scale * L + min) - x), f = |.| or square."""
        torch.mul(La, sc_b, out=A).add_(m_b).sub_(X)
        if use_mad:
            A.abs_()
            v.dot(Aa, Wa, out)
        else:
            v.dot3(Aa, Aa, Wa, out)

    def set_range() -> float:
        """rng = max - min of the winner (1 where the column is flat); returns its ratio_bound."""
        v.sub(mx, best_min, out=rng)
        if any_flat:
            v.put(rng, flat, 1.0)
        return ratio_bound(best_min, rng)

    with np.errstate(all="ignore"):  # inf/NaN propagate as in C
        x0 = v.vec(first_min(X, 0)) if zero_sign else xmin
        v.copy(best_min, v.where(x0 > 0, 0.0, x0))
        v.copy(win_mn, best_min)
        flat = mx == best_min  # C returns early: L = 0, scale 0; such columns are never updated
        any_flat = v.any(flat)
        bound = set_range()
        v.rdiv(float(nmax), rng, out=win_isc)
        v.rdiv(1.0, win_isc, out=best_scale)
        levels(v.bcast(win_isc), best_min_b, nmax * bound)
        err_sum(v.bcast(best_scale), best_min_b, best_err)
        v.put(best_err, flat, -np.inf)  # -inf: no candidate beats it
        for c in steps:
            v.rdiv(c, rng, out=isc)
            levels(isc_b, best_min_b, c * bound)
            v.dot(Wa, Laa, sum_l)
            v.dot3(Wa, Laa, Laa, sum_l2)
            v.dot3(Wa, Laa, Xa, sum_xl)
            v.sub(v.mul(F[3:6], F[2:5], out=N), v.mul(F[1:2], F[0:3], out=P), out=N)
            v.div(N[0::2], N[1:2], out=cand)  # this_scale, this_min
            pos = this_min > 0
            if v.any(pos):
                v.put(this_min, pos, 0.0)
                v.put(this_scale, pos, v.div(sum_xl, sum_l2, out=tmp))
            err_sum(this_scale_b, this_min_b, err)
            upd = (D > 0) & (err < best_err)
            if not v.any(upd):
                continue
            v.put(win_isc, upd, isc)
            v.put(win_mn, upd, best_min)
            v.put(best_err, upd, err)
            v.put(best_scale, upd, this_scale)
            v.put(best_min, upd, this_min)
            bound = set_range()
        v.put(best_scale, flat, 0.0)
        v.neg(best_min, out=best_min)  # the_min

    def best_levels() -> torch.Tensor:
        with np.errstate(all="ignore"):
            bound = ratio_bound(win_mn, v.where(flat, 1.0, mx - win_mn))
            levels(v.bcast(win_isc), v.bcast(win_mn), (nmax + 1) * bound)
        return La.mul_((~v.t(flat)).to(_F32)[None])

    return v.t(state[3:5]), best_levels


def _final_levels(Y: torch.Tensor, dl: torch.Tensor, lo: int, hi: int, offset: int, search_levels) -> torch.Tensor:
    """The last pass of the K-quant routines, as uint8 (n, n_sub).

    ``l = nearest_int(y / d)`` clamped to [lo, hi], plus ``offset``, for every
    sub-block whose final scale ``d`` is nonzero; the others keep the levels
    of the search (``search_levels()``, already offset), which are computed
    only when such a sub-block exists.
    """
    nz = dl != 0
    all_nz = bool(nz.all())
    Q = torch.div(Y, (dl if all_nz else torch.where(nz, dl, torch.ones_like(dl)))[None])
    q_lo, q_hi = torch.aminmax(Q)
    if -_SAFE < float(q_lo) and float(q_hi) < _SAFE:  # round-half-even there; NaN: exact path
        Q.clamp_(lo, hi).round_()
    else:
        Q = _round_clamp_exact(Q, lo, hi)
    if offset:
        Q.add_(offset)
    if not all_nz:
        Q = torch.where(nz[None], Q, search_levels())
    if Q.device.type == "cpu":  # numpy converts 4x faster; the values are small whole numbers
        return torch.from_numpy(Q.numpy().astype(np.uint8))
    return Q.to(torch.uint8)


def _pack_2bit(L: torch.Tensor) -> torch.Tensor:
    """(nb, 256) values in [0,3] -> (nb, 64): qs[32h+l] = L[128h+l] | L[128h+l+32]<<2 | ..."""
    q = L.view(-1, 2, 4, 32)
    return u8(q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(-1, 64)


def _pack_k4_scales(ls: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    """6-bit (scale, min) pairs of Q4_K/Q5_K, (nb, 8) each -> (nb, 12) bytes."""
    b0 = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    b1 = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    b2 = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    return u8(_cat([b0, b1, b2]))


# --------------------------------------------------------------------------- quantizers

def quantize_q2_k(x: torch.Tensor) -> torch.Tensor:
    nb = x.shape[0]
    X = _sub_blocks(x, 16)
    SM, levels = _make_qkx2_quants(X, X.abs(), 3, -0.5, 0.1, 15, True)
    S, M = SM.view(2, nb, 16)
    max_scale = _pos_max(S, 1)
    max_min = _pos_max(M, 1)
    sp = max_scale > 0
    mp = max_min > 0
    z = _zeros(max_scale)
    lsc = torch.where(sp[:, None], nearest_int(rdiv(15.0, max_scale)[:, None] * S), 0)
    lmn = nearest_int(rdiv(15.0, max_min)[:, None] * M)
    sbyte = torch.where(mp[:, None], (lsc | (lmn << 4)), lsc) & 0xFF
    d = torch.where(sp, fp16_round(div(max_scale, 15.0)), z)
    dmin = torch.where(mp, fp16_round(div(max_min, 15.0)), z)

    dl = (d[:, None] * (sbyte & 0xF).to(_F32)).reshape(-1)
    ml = (dmin[:, None] * (sbyte >> 4).to(_F32)).reshape(-1)
    L = _final_levels(X + ml[None], dl, 0, 3, 0, levels)
    qs = _pack_2bit(_from_sub_blocks(L, nb))
    return torch.cat([u8(sbyte), qs, fp16_bits(d), fp16_bits(dmin)], dim=1)


def quantize_q3_k(x: torch.Tensor) -> torch.Tensor:
    nb = x.shape[0]
    X = _sub_blocks(x, 16)
    scales, L = _make_q3_quants(X, 4)
    S = scales.view(nb, 16)
    _, max_scale = first_absmax(S, 1)
    nz = max_scale != 0
    iscale = rdiv(-32.0, max_scale)
    ls = torch.clamp(wrap_i8(nearest_int(iscale[:, None] * S)), -32, 31) + 32
    ls = torch.where(nz[:, None], ls, 0)  # memset(scales, 0) when max_scale == 0
    d = torch.where(nz, fp16_round(rdiv(1.0, iscale)), _zeros(max_scale))
    sb_low = (ls[:, :8] & 0xF) | ((ls[:, 8:] & 0xF) << 4)
    hi = (ls >> 4).view(nb, 4, 4)  # [group g = j//4, k = j%4]
    sb_high = hi[:, 0] | (hi[:, 1] << 2) | (hi[:, 2] << 4) | (hi[:, 3] << 6)
    sb = u8(torch.cat([sb_low, sb_high], dim=1))

    dl = (d[:, None] * (ls - 32).to(_F32)).reshape(-1)
    Lq = torch.clamp(nearest_int(torch.div(X, dl[None])), -4, 3) + 4
    L = _select(dl != 0, Lq, L)
    Lb = _from_sub_blocks(L, nb)
    high = (Lb > 3).to(torch.int32)
    Lb = Lb - 4 * high
    hmask = u8((high.view(nb, 8, 32) << torch.arange(8, device=x.device, dtype=torch.int32)[None, :, None]).sum(1))
    return torch.cat([hmask, _pack_2bit(Lb), sb, fp16_bits(d)], dim=1)


def _quantize_q45_k(x: torch.Tensor, nmax: int, rmin: float, nstep: int):
    nb = x.shape[0]
    X = _sub_blocks(x, 32)
    v = _vec_ops(X)
    Xa = v.arr(X)
    sum_x2 = v.t(v.dot(Xa, Xa, v.empty(X.shape[1], X)))
    av_x = sqrt_f32(div(sum_x2, 32.0))
    W = torch.abs(X).add_(av_x[None])  # av_x + |x|
    SM, levels = _make_qkx2_quants(X, W, nmax, rmin, 0.1, nstep, False)
    # scales and mins side by side: (2, nb, 8), then (2, nb) maxima, 6-bit codes, fp16 d and
    # dmin; on vectors (numpy on CPU, see _NumpyVec)
    SM = v.vec(SM).reshape(2, nb, 8)
    with np.errstate(all="ignore"):
        max_sm = _pos_max(SM, 2)
        inv = v.where(max_sm > 0, rdiv(63.0, max_sm), 0.0)
        lsm = v.imin(nearest_int(inv[:, :, None] * SM) & 0xFF, 63)
        dd = fp16_round(div(max_sm, 63.0))
        dlml = v.t((dd[:, :, None] * v.f32(lsm)).reshape(2, -1))
    L = _final_levels(X + dlml[1][None], dlml[0], 0, nmax, 0, levels)
    head = v.t(_cat([fp16_bits(dd[0]), fp16_bits(dd[1]), _pack_k4_scales(lsm[0], lsm[1])]))
    return head, _from_sub_blocks(L, nb)


def quantize_q4_k(x: torch.Tensor) -> torch.Tensor:
    head, Lb = _quantize_q45_k(x, 15, -1.0, 20)
    q = Lb.view(-1, 4, 2, 32)
    qs = u8(q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    return torch.cat([head, qs], dim=1)


def quantize_q5_k(x: torch.Tensor) -> torch.Tensor:
    head, Lb = _quantize_q45_k(x, 31, -0.5, 15)
    q = Lb.view(-1, 4, 2, 32)
    lo, hi = q & 0xF, q >> 4  # hi in {0,1}
    qs = u8(lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(-1, 128)
    shifts = (2 * torch.arange(4, device=x.device, dtype=torch.int32)).view(1, 4, 1)
    qh = u8(((hi[:, :, 0] << shifts) | (hi[:, :, 1] << (shifts + 1))).sum(1))
    return torch.cat([head, qh, qs], dim=1)


def quantize_q6_k(x: torch.Tensor, qw_sub: torch.Tensor | None = None) -> torch.Tensor:
    """``quantize_row_q6_K_ref``, or ``quantize_row_q6_K_impl`` with importance weights
    ``qw_sub`` (in the layout of ``_sub_blocks(x, 16)``): the same search with them as its weights."""
    nb = x.shape[0]
    X = _sub_blocks(x, 16)
    scales, levels = _make_qx_quants_rmse1(X, 32, qw_sub)
    # per super-block arithmetic and packing on vectors (numpy on CPU, see _NumpyVec)
    v = _vec_ops(X)
    S = v.vec(scales).reshape(nb, 16)
    amax, max_scale = _first_absmax_cols(v.t(v.contig(S.T)), v)[:2]
    zero = amax < _GROUP_MAX_EPS
    with np.errstate(all="ignore"):  # all-zero super-blocks: inf/NaN as in C, zeroed below
        iscale = rdiv(-128.0, max_scale)
        d = fp16_round(rdiv(1.0, iscale))
        sc = wrap_i8(v.imin(nearest_int(iscale[:, None] * S), 127))
        dl = (d[:, None] * v.f32(sc)).reshape(-1)
    L = _from_sub_blocks(_final_levels(X, v.t(dl), -32, 31, 32, levels), nb)
    # element 128h + 32g + t; the 32-value groups g and g+2 share bytes: [b, h, g // 2, g % 2, t]
    q = v.vec(L).reshape(nb, 2, 2, 2, 32)
    lo, hi = q & 0xF, q >> 4
    ql = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(nb, 128)  # g | g+2 << 4, for g = 0, 1
    h2 = hi[:, :, 0] | (hi[:, :, 1] << 4)  # g | g+2 << 4
    qh = (h2[:, :, 0] | (h2[:, :, 1] << 2)).reshape(nb, 64)  # g=0 | g=1 << 2 | g=2 << 4 | g=3 << 6
    out = _cat([ql, qh, u8(sc), fp16_bits(d)])
    if v.any(zero):
        out[zero] = 0  # memset(0) for an all-zero super-block
    return v.t(out)


# --------------------------------------------------------------------------- IQ4_NL / IQ4_XS

def _kvalues(device) -> torch.Tensor:
    return torch.tensor(KVALUES_IQ4NL, dtype=_F32, device=device)


# ggml's best_index_int8 picks kv[k] over kv[k+1] iff v - kv[k] < kv[k+1] - v.  Near
# the midpoint both differences are exact in float32, so this is v < (kv[k]+kv[k+1])/2
# exactly; the midpoints are multiples of 0.5, hence the index only depends on
# floor(2v), and a 512-entry table over floor(2v) in [-256, 255] gives it.
_IQ4_SUMS = [KVALUES_IQ4NL[k] + KVALUES_IQ4NL[k + 1] for k in range(15)]
_IQ4_LUT = [sum(1 for s2 in _IQ4_SUMS if s2 <= t) for t in range(-256, 256)]


def _iq4_slot(v: torch.Tensor) -> torch.Tensor:
    """Flat int64 row index into the 512-entry tables for each value of ``v``."""
    t = torch.clamp((v * 2.0).floor_(), -256.0, 255.0)
    t = torch.nan_to_num(t, nan=255.0)  # NaN: ggml's search ends on the top value
    return (t + 256.0).to(torch.int64).reshape(-1)


def _best_index_iq4(v: torch.Tensor) -> torch.Tensor:
    """``best_index_int8(16, kvalues_iq4nl, v)`` (int64 indices, shape of ``v``)."""
    lut = torch.tensor(_IQ4_LUT, dtype=torch.int64, device=v.device)
    return lut.index_select(0, _iq4_slot(v)).view(v.shape)


def _iq4_values(v: torch.Tensor) -> torch.Tensor:
    """``kvalues_iq4nl[best_index_int8(...)]`` as float32."""
    lut = torch.tensor([KVALUES_IQ4NL[i] for i in _IQ4_LUT], dtype=_F32, device=v.device)
    return lut.index_select(0, _iq4_slot(v)).view(v.shape)


def _iq4_block_scales(X: torch.Tensor, ntry: int, W: torch.Tensor | None = None) -> torch.Tensor:
    """Per 32-element block part of ``quantize_row_iq4_nl_impl``; ``W`` the weights
    (``qw * sqrtf(sigma2 + x*x)`` with an importance matrix), x*x when None.

    Returns the scale d of every block (column of ``X``); the first-pass levels
    are not needed: ggml recomputes them afterwards when ntry > 0.
    """
    amax, mx = first_absmax(X, 0)
    zero = amax < _GROUP_MAX_EPS
    if W is None:
        W = X * X
    d0 = torch.div(-mx, cst(-127.0, X))
    id0 = rdiv(1.0, d0)
    consts = [float(i - 127) for i in range(-ntry, ntry + 1)]
    idc = torch.div(torch.tensor(consts, dtype=_F32, device=X.device)[:, None], mx[None])
    ids = torch.cat([id0[None], idc], dim=0)  # (nc, ns)
    Q = _iq4_values(ids[:, None, :] * X[None])  # (nc, n, ns)
    n = X.shape[0]
    P = torch.empty((n, 2) + ids.shape, dtype=_F32, device=X.device)
    WQ = torch.mul(W[None], Q, out=P[:, 1].transpose(0, 1))
    torch.mul(WQ, X[None], out=P[:, 0].transpose(0, 1))  # w*q*x
    torch.mul(WQ, Q, out=P[:, 1].transpose(0, 1))  # w*q*q (in place over w*q)
    del Q
    sums = _seq_sum(P)
    sumqx, sumq2 = sums[0], sums[1]
    del P
    d = torch.where(sumq2[0] > 0, torch.div(sumqx[0], sumq2[0]), _zeros(mx))
    best = d * sumqx[0]
    for k in range(1, len(consts) + 1):
        sqx, sq2 = sumqx[k], sumq2[k]
        better = (sq2 > 0) & (sqx * sqx > best * sq2)
        nd = torch.div(sqx, sq2)
        d = torch.where(better, nd, d)
        best = torch.where(better, nd * sqx, best)
    return torch.where(zero, _zeros(d), d)


def _pack_iq4(L: torch.Tensor) -> torch.Tensor:
    """(nb, 32*k) indices -> (nb, 16*k): q[16i+j] = L[32i+j] | L[32i+16+j] << 4."""
    q = L.view(L.shape[0], -1, 2, 16)
    return u8(q[:, :, 0] | (q[:, :, 1] << 4)).reshape(L.shape[0], -1)


def quantize_iq4_nl(x: torch.Tensor, W: torch.Tensor | None = None) -> torch.Tensor:
    """``W``: the weights in the layout of ``x.t()`` (see :mod:`.weighted`), x*x when None."""
    X = x.t().contiguous()  # (32, nb)
    d = _iq4_block_scales(X, 7, W)
    idv = torch.where(d != 0, rdiv(1.0, d), _zeros(d))
    L = _best_index_iq4(idv[:, None] * x)
    return torch.cat([fp16_bits(d), _pack_iq4(L)], dim=1)


def quantize_iq4_xs(x: torch.Tensor, W: torch.Tensor | None = None) -> torch.Tensor:
    """``W``: the weights in the layout of ``_sub_blocks(x, 32)``, x*x when None."""
    nb = x.shape[0]
    X = _sub_blocks(x, 32)
    scales = _iq4_block_scales(X, 7, W)
    S = scales.view(nb, 8)
    _, max_scale = first_absmax(S, 1)
    d = div(-max_scale, 32.0)  # float d = -max_scale/32;  (-0.0 for an all-zero super-block)
    idv = torch.where(d != 0, rdiv(1.0, d), _zeros(d))
    l = torch.clamp(nearest_int(idv[:, None] * S), -32, 31)
    dl = d[:, None] * l.to(_F32)
    idl = torch.where(dl != 0, rdiv(1.0, dl), _zeros(dl))
    L = _best_index_iq4(idl.repeat_interleave(32, dim=1) * x)
    l = l + 32
    lo = l & 0xF
    scales_l = u8(lo[:, 0::2] | (lo[:, 1::2] << 4))
    sh = ((l >> 4) << (2 * torch.arange(8, device=x.device, dtype=torch.int32))).sum(1)
    scales_h = u8(torch.stack([sh, sh >> 8], dim=1))
    return torch.cat([fp16_bits(d), scales_h, scales_l, _pack_iq4(L)], dim=1)


# --------------------------------------------------------------------------- dequantizers

def _unpack_2bit(qs: torch.Tensor) -> torch.Tensor:
    """(nb, 64) -> (nb, 256) 2-bit values in element order."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=qs.device).view(1, 1, 4, 1)
    return ((qs.view(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, QK_K)


def dequantize_q2_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    sc = b[:, :16]
    d = from_fp16_bytes(b[:, 80:82])
    dmin = from_fp16_bytes(b[:, 82:84])
    dl = (d[:, None] * (sc & 0xF).to(_F32)).view(nb, 16, 1)
    ml = (dmin[:, None] * (sc >> 4).to(_F32)).view(nb, 16, 1)
    q = _unpack_2bit(b[:, 16:80]).view(nb, 16, 16).to(_F32)
    return (dl * q - ml).view(nb, QK_K)


def dequantize_q3_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    hmask = b[:, :32]
    sb = b[:, 96:108]
    d = from_fp16_bytes(b[:, 108:110])
    low = torch.cat([sb[:, :8] & 0xF, sb[:, :8] >> 4], dim=1)  # j = 0..15
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device)
    high = ((sb[:, 8:12].unsqueeze(1) >> shifts.view(1, 4, 1)) & 3).reshape(nb, 16)  # j = 4g + k
    sc = (low | (high << 4)).to(torch.int16) - 32
    dl = (d[:, None] * sc.to(_F32)).view(nb, 16, 1)
    ql = _unpack_2bit(b[:, 32:96]).to(torch.int16)
    bit = torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)
    hb = ((hmask.unsqueeze(1) >> bit) & 1).reshape(nb, QK_K)
    q = (ql - 4 * (1 - hb.to(torch.int16))).to(_F32).view(nb, 16, 16)
    return (dl * q).view(nb, QK_K)


def _k4_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


def dequantize_q4_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    d = from_fp16_bytes(b[:, 0:2])
    dmin = from_fp16_bytes(b[:, 2:4])
    sc, mn = _k4_scale_min(b[:, 4:16])
    dl = (d[:, None] * sc.to(_F32)).view(nb, 8, 1)
    ml = (dmin[:, None] * mn.to(_F32)).view(nb, 8, 1)
    qs = b[:, 16:].view(nb, 4, 1, 32)
    q = torch.cat([qs & 0xF, qs >> 4], dim=2).view(nb, 8, 32).to(_F32)
    return (dl * q - ml).view(nb, QK_K)


def dequantize_q5_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    d = from_fp16_bytes(b[:, 0:2])
    dmin = from_fp16_bytes(b[:, 2:4])
    sc, mn = _k4_scale_min(b[:, 4:16])
    dl = (d[:, None] * sc.to(_F32)).view(nb, 8, 1)
    ml = (dmin[:, None] * mn.to(_F32)).view(nb, 8, 1)
    qh = b[:, 16:48]
    qs = b[:, 48:].view(nb, 4, 1, 32)
    ql = torch.cat([qs & 0xF, qs >> 4], dim=2).view(nb, 8, 32)
    hb = (qh.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)) & 1
    q = (ql | (hb << 4)).to(_F32)
    return (dl * q - ml).view(nb, QK_K)


def dequantize_q6_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    ql = b[:, :128].view(nb, 2, 1, 64)
    qh = b[:, 128:192].view(nb, 2, 1, 32)
    sc = b[:, 192:208].contiguous().view(torch.int8).to(_F32)
    d = from_fp16_bytes(b[:, 208:210])
    lo = torch.cat([ql & 0xF, ql >> 4], dim=2).view(nb, 2, 4, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)
    hi = (qh >> shifts) & 3
    q = ((lo | (hi << 4)).to(torch.int16) - 32).to(_F32).view(nb, 16, 16)
    dl = (d[:, None] * sc).view(nb, 16, 1)
    return (dl * q).view(nb, QK_K)


def dequantize_iq4_nl(b: torch.Tensor) -> torch.Tensor:
    kv = _kvalues(b.device)
    d = from_fp16_bytes(b[:, :2])
    qs = b[:, 2:18]
    q = kv[torch.cat([qs & 0xF, qs >> 4], dim=1).long()]
    return d[:, None] * q


def dequantize_iq4_xs(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    kv = _kvalues(b.device)
    d = from_fp16_bytes(b[:, :2])
    sh = b[:, 2:4].to(torch.int32)
    sh = sh[:, 0] | (sh[:, 1] << 8)
    sl = b[:, 4:8]
    lo = torch.stack([sl & 0xF, sl >> 4], dim=2).reshape(nb, 8).to(torch.int32)
    hi = (sh[:, None] >> (2 * torch.arange(8, device=b.device, dtype=torch.int32))) & 3
    sc = (lo | (hi << 4)) - 32
    dl = (d[:, None] * sc.to(_F32)).view(nb, 8, 1)
    qs = b[:, 8:].view(nb, 8, 1, 16)
    idx = torch.cat([qs & 0xF, qs >> 4], dim=2).view(nb, 8, 32).long()
    return (dl * kv[idx]).view(nb, QK_K)
