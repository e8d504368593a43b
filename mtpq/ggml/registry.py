"""One record per ggml type mtpq reads or writes: its block, its kernels, whether it needs an imatrix.

Quantizers take ``(x, y, n_per_row)`` -- float32 rows laid end to end, their blocks' bytes -- and weighted
ones ``(x, y, n_per_row, qw)`` with one importance weight per column (ggml's ``quantize_*``: ``qw`` NULL is
the first, given the second); dequantizers ``(y, x)``. The i-quants' kernels get their grid tables bound
here (built at their first use, as ``ggml_quantize_init`` does).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as T

from . import iq4, iqtables, iquants, kquants, legacy, mxfp4, ternary, types  # noqa: F401  (types: Q2_0 in gguf-py)
from .types import FLOAT_TYPES  # noqa: F401  (ggml's float types, read here by engine and the tests)

_NONE = np.empty(0, np.float32)


@dataclass(frozen=True)
class GgmlType:
    qtype: T
    block_size: int
    type_size: int
    quantize: Callable | None  # without importance; None: a float type, or one that needs an imatrix
    quantize_weighted: Callable | None  # None: ggml ignores importance for this type
    dequantize: Callable | None  # None: a float type (the engine converts it)
    fp16_fields: tuple[int, ...] = ()  # bytes of a block holding fp16 scales, refused when inf/NaN (as ggml)

    @property
    def requires_imatrix(self) -> bool:
        """ggml aborts without importance weights (only a weighted quantizer)."""
        return self.quantize is None and self.quantize_weighted is not None


def _iq(qtype: T, type_size: int, kind, unweighted: bool, family: str = "", fp16_fields=(0,)) -> GgmlType:
    """An i-quant's record: ``kind`` its code in :mod:`.iquants` (its kernel ``iquants.QUANTIZERS[kind]``); its
    tables (``family``'s, default its own) bound at first use. ``unweighted``: ggml quantizes it without
    importance too (the same function, ``qw`` empty)."""
    family = family or qtype.name
    fn = iquants.QUANTIZERS[kind]

    def run(x, y, n, qw=_NONE):
        fn(x, y, n, qw, *iqtables.search_tables(family))

    deq = getattr(iquants, f"dequantize_{qtype.name.lower()}")

    def dequantize(y, x):
        deq(y, x, iqtables.dequant_grid(family))

    run.kernel, dequantize.kernel = fn.kernel, deq
    return GgmlType(qtype, 256, type_size, run if unweighted else None, run, dequantize, fp16_fields)


def _block(module, qtype: T, block_size: int, type_size: int, fp16_fields=(0,), weighted=True) -> GgmlType:
    """A type whose kernels are ``module``'s ``quantize_<name>``, ``quantize_<name>_weighted`` (``weighted``:
    ggml has that path) and ``dequantize_<name>``."""
    name = qtype.name.lower()
    q, dq = getattr(module, f"quantize_{name}"), getattr(module, f"dequantize_{name}")
    qw = getattr(module, f"quantize_{name}_weighted") if weighted else None
    return GgmlType(qtype, block_size, type_size, q, qw, dq, fp16_fields)


def _float(qtype: T, size: int) -> GgmlType:
    return GgmlType(qtype, 1, size, None, None, None)


TYPES: dict[T, GgmlType] = {
    t.qtype: t
    for t in (
        _float(T.F32, 4),
        _float(T.F16, 2),
        _float(T.BF16, 2),
        _block(legacy, T.Q8_0, 32, 34, weighted=False),
        _block(legacy, T.Q4_0, 32, 18),
        _block(legacy, T.Q4_1, 32, 20, (0, 2)),
        _block(legacy, T.Q5_0, 32, 22),
        _block(legacy, T.Q5_1, 32, 24, (0, 2)),
        _block(kquants, T.Q2_K, 256, 84, (80, 82)),
        _block(kquants, T.Q3_K, 256, 110, (108,)),
        _block(kquants, T.Q4_K, 256, 144, (0, 2)),
        _block(kquants, T.Q5_K, 256, 176, (0, 2)),
        _block(kquants, T.Q6_K, 256, 210, (208,)),
        _block(iq4, T.IQ4_NL, 32, 18),
        _block(iq4, T.IQ4_XS, 256, 136),
        _iq(T.IQ2_XXS, 66, iquants.IQ2_XXS, False),
        _iq(T.IQ2_XS, 74, iquants.IQ2_XS, False),
        _iq(T.IQ2_S, 82, iquants.IQ2_S, True),
        _iq(T.IQ3_XXS, 98, iquants.IQ3_XXS, True),
        _iq(T.IQ3_S, 110, iquants.IQ3_S, True),
        _iq(T.IQ1_S, 50, iquants.IQ1_S, False),
        _iq(T.IQ1_M, 56, iquants.IQ1_M, True, "IQ1_S", ()),
        _block(ternary, T.TQ1_0, 256, 54, (52,), weighted=False),
        _block(ternary, T.TQ2_0, 256, 66, (64,), weighted=False),
        _block(legacy, T.Q1_0, 128, 18, weighted=False),
        _block(legacy, T.Q2_0, 64, 18, weighted=False),
        _block(mxfp4, T.MXFP4, 32, 17, (), weighted=False),
    )
}


@functools.cache
def record(qtype) -> GgmlType:
    """The record of ``qtype``; ValueError naming it when mtpq has no kernels for it."""
    try:
        qtype = T(qtype)
    except ValueError:
        raise ValueError(f"unknown ggml type {qtype!r}") from None
    if qtype not in TYPES:
        raise ValueError(f"mtpq has no kernel for type {qtype.name}")
    return TYPES[qtype]


def bytes_per_row(qtype, n: int) -> int:
    """Bytes of one row of ``n`` values; ValueError if ``n`` is not a whole number of blocks."""
    r = record(qtype)
    if n % r.block_size:
        raise ValueError(f"row length {n} is not a multiple of the {r.qtype.name} block size {r.block_size}")
    return n // r.block_size * r.type_size


assert tuple(TYPES) == types.WRITABLE_TYPES, "mtpq.ggml.types.WRITABLE_TYPES names the types these kernels write"
