"""ggml-exact i-quants (IQ2_XXS, IQ3_XXS, ...) in torch, vectorised over blocks.

Reproduces byte for byte ``ggml_quantize_chunk`` for these types with an
importance vector (``quantize_row_iq2_xxs_impl`` / ``quantize_row_iq3_xxs_impl``
in ``ggml/src/ggml-quants.c``), and without one where ggml allows it (IQ3_XXS
then weights by x^2; IQ2_XXS requires one, as in ggml).

The method, shared by the grid types: every 32-value sub-block gets its signs
fixed first (an even number of negatives per group of 8: the cheapest value,
by weight*x^2, is flipped), then a set of candidate scales is tried; for each,
every group of ``gw`` values (8 for IQ2, 4 for IQ3) is rounded to the nearest
lattice point, and a point that is not on the type's grid is replaced by the
best of its precomputed grid neighbours (smallest weighted squared error at
that scale).  The candidate with the best least-squares score wins, then the
groups are refitted once at the winning scale.

Tables: the grids come from gguf-py's dequantizer tables (``gguf.quants``);
the lattice-point -> grid-index map and the neighbour lists are computed from
them exactly as ``iq2xs_init_impl`` / ``iq3xs_init_impl`` do (all grid points
at the ``nwant`` smallest integer distances, ordered by distance then index),
but only for the lattice points the search can reach.

Layout: sub-blocks are processed element-major, ``X`` of shape (32, S), so
the C loops' sequential float sums are numpy reductions along axis 0
(:func:`mtpq.ggml.cfloat._seq_sum`), and a group of ``gw`` values is a
run of rows.  The neighbour search is done only for the groups that are off
the grid, all their neighbours at once (lists padded with +inf errors);
``argmin`` returns the first minimum, which is the C loop's strict ``<``.  On CPU
the grid types' candidate loop runs in numpy instead (:func:`_candidates_np`,
:class:`_Scorer`): all candidates at once, neighbours scored from per-group sums
and decided exactly only where a proven error bound leaves a near tie.
Float rules as in :mod:`mtpq.ggml.legacy` (one IEEE op at a time, in the
C order, ``nearest_int`` bit trick, C integer wrap-around).
"""

from __future__ import annotations

from .dequant import (dequantize_iq1_m, dequantize_iq1_s, dequantize_iq2_s, dequantize_iq2_xs, dequantize_iq2_xxs,
                      dequantize_iq3_s, dequantize_iq3_xxs)
from .grid_types import quantize_iq2_s, quantize_iq2_xs, quantize_iq2_xxs, quantize_iq3_s, quantize_iq3_xxs
from .iq1 import quantize_iq1_m, quantize_iq1_s
from .tables import REQUIRES_WEIGHTS, _grid, prepare  # noqa: F401  (_grid: the tests read the grids)

__all__ = [
    "quantize_iq2_xxs", "quantize_iq2_xs", "quantize_iq2_s", "quantize_iq3_xxs", "quantize_iq3_s",
    "quantize_iq1_s", "quantize_iq1_m", "dequantize_iq1_s", "dequantize_iq1_m", "prepare",
    "dequantize_iq2_xxs", "dequantize_iq2_xs", "dequantize_iq2_s", "dequantize_iq3_xxs", "dequantize_iq3_s",
    "REQUIRES_WEIGHTS",
]
