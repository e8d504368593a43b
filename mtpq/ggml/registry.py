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


def _grid(kind: int, family: str):
    """The grid type ``kind``'s quantizer with its tables (one function: with and without weights)."""

    def run(x, y, n, qw=_NONE):
        iquants.quantize_grid(x, y, n, qw, kind, *iqtables.grid_tables(family))

    run.kernel = iquants.quantize_grid
    return run


def _iq1(fn, family: str = "IQ1_S"):
    def run(x, y, n, qw=_NONE):
        fn(x, y, n, qw, *iqtables.grid_tables(family))

    run.kernel = fn
    return run


def _with_grid(fn, family: str):
    def run(y, x):
        fn(y, x, iqtables.dequant_grid(family))

    run.kernel = fn
    return run


def _float(qtype: T, size: int) -> GgmlType:
    return GgmlType(qtype, 1, size, None, None, None)


TYPES: dict[T, GgmlType] = {
    t.qtype: t
    for t in (
        _float(T.F32, 4),
        _float(T.F16, 2),
        _float(T.BF16, 2),
        GgmlType(T.Q8_0, 32, 34, legacy.quantize_q8_0, None, legacy.dequantize_q8_0, (0,)),
        GgmlType(T.Q4_0, 32, 18, legacy.quantize_q4_0, legacy.quantize_q4_0_weighted, legacy.dequantize_q4_0, (0,)),
        GgmlType(T.Q4_1, 32, 20, legacy.quantize_q4_1, legacy.quantize_q4_1_weighted, legacy.dequantize_q4_1, (0, 2)),
        GgmlType(T.Q5_0, 32, 22, legacy.quantize_q5_0, legacy.quantize_q5_0_weighted, legacy.dequantize_q5_0, (0,)),
        GgmlType(T.Q5_1, 32, 24, legacy.quantize_q5_1, legacy.quantize_q5_1_weighted, legacy.dequantize_q5_1, (0, 2)),
        GgmlType(
            T.Q2_K, 256, 84, kquants.quantize_q2_k, kquants.quantize_q2_k_weighted, kquants.dequantize_q2_k, (80, 82)
        ),
        GgmlType(
            T.Q3_K, 256, 110, kquants.quantize_q3_k, kquants.quantize_q3_k_weighted, kquants.dequantize_q3_k, (108,)
        ),
        GgmlType(
            T.Q4_K, 256, 144, kquants.quantize_q4_k, kquants.quantize_q4_k_weighted, kquants.dequantize_q4_k, (0, 2)
        ),
        GgmlType(
            T.Q5_K, 256, 176, kquants.quantize_q5_k, kquants.quantize_q5_k_weighted, kquants.dequantize_q5_k, (0, 2)
        ),
        GgmlType(
            T.Q6_K, 256, 210, kquants.quantize_q6_k, kquants.quantize_q6_k_weighted, kquants.dequantize_q6_k, (208,)
        ),
        GgmlType(T.IQ4_NL, 32, 18, iq4.quantize_iq4_nl, iq4.quantize_iq4_nl_weighted, iq4.dequantize_iq4_nl, (0,)),
        GgmlType(T.IQ4_XS, 256, 136, iq4.quantize_iq4_xs, iq4.quantize_iq4_xs_weighted, iq4.dequantize_iq4_xs, (0,)),
        GgmlType(
            T.IQ2_XXS,
            256,
            66,
            None,
            _grid(iquants.IQ2_XXS, "IQ2_XXS"),
            _with_grid(iquants.dequantize_iq2_xxs, "IQ2_XXS"),
            (0,),
        ),
        GgmlType(
            T.IQ2_XS,
            256,
            74,
            None,
            _grid(iquants.IQ2_XS, "IQ2_XS"),
            _with_grid(iquants.dequantize_iq2_xs, "IQ2_XS"),
            (0,),
        ),
        GgmlType(
            T.IQ2_S,
            256,
            82,
            _grid(iquants.IQ2_S, "IQ2_S"),
            _grid(iquants.IQ2_S, "IQ2_S"),
            _with_grid(iquants.dequantize_iq2_s, "IQ2_S"),
            (0,),
        ),
        GgmlType(
            T.IQ3_XXS,
            256,
            98,
            _grid(iquants.IQ3_XXS, "IQ3_XXS"),
            _grid(iquants.IQ3_XXS, "IQ3_XXS"),
            _with_grid(iquants.dequantize_iq3_xxs, "IQ3_XXS"),
            (0,),
        ),
        GgmlType(
            T.IQ3_S,
            256,
            110,
            _grid(iquants.IQ3_S, "IQ3_S"),
            _grid(iquants.IQ3_S, "IQ3_S"),
            _with_grid(iquants.dequantize_iq3_s, "IQ3_S"),
            (0,),
        ),
        GgmlType(
            T.IQ1_S, 256, 50, None, _iq1(iquants.quantize_iq1_s), _with_grid(iquants.dequantize_iq1_s, "IQ1_S"), (0,)
        ),
        GgmlType(
            T.IQ1_M,
            256,
            56,
            _iq1(iquants.quantize_iq1_m),
            _iq1(iquants.quantize_iq1_m),
            _with_grid(iquants.dequantize_iq1_m, "IQ1_S"),
        ),
        GgmlType(T.TQ1_0, 256, 54, ternary.quantize_tq1_0, None, ternary.dequantize_tq1_0, (52,)),
        GgmlType(T.TQ2_0, 256, 66, ternary.quantize_tq2_0, None, ternary.dequantize_tq2_0, (64,)),
        GgmlType(T.Q1_0, 128, 18, legacy.quantize_q1_0, None, legacy.dequantize_q1_0, (0,)),
        GgmlType(T.Q2_0, 64, 18, legacy.quantize_q2_0, None, legacy.dequantize_q2_0, (0,)),
        GgmlType(T.MXFP4, 32, 17, mxfp4.quantize_mxfp4, None, mxfp4.dequantize_mxfp4),
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
