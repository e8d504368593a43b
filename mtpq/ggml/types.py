"""The ggml types mtpq writes, named without importing the kernels (and torch with them): the CLI checks
a user's type names at start-up. :mod:`.kernels` checks that it has a kernel for each, in this order."""

from __future__ import annotations

from gguf import GGMLQuantizationType as T

FLOAT_TYPES = (T.F32, T.F16, T.BF16)
WRITABLE_TYPES: tuple[T, ...] = FLOAT_TYPES + (
    T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS,
    T.IQ2_XXS, T.IQ3_XXS, T.IQ2_XS, T.IQ3_S, T.IQ2_S, T.IQ1_S, T.IQ1_M,
)
