"""MXFP4 (OCP microscaling FP4): ``quantize_row_mxfp4_ref`` (llama-quantize's MXFP4_MOE experts), its
dequantizer, and checkpoints' MXFP4 pairs moved into ggml's blocks.

A block is 32 values in 17 bytes: an E8M0 exponent byte e, then 16 bytes whose byte j holds value j in its low
nibble and value j + 16 in its high one; value = kvalues[code] * 2^(e - 128), ggml's doubled E2M1 table with
the halved scale (``ggml_e8m0_to_fp32_half``).
"""

from __future__ import annotations

import numpy as np

from .jit import F, bits_f32, block_absmax, c_int, inline, kernel

KVALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


@kernel
def e8m0_half(e):
    """``ggml_e8m0_to_fp32_half``: 2^(e - 128), subnormal for e < 2."""
    if e < 2:
        return bits_f32(np.uint32(0x00200000) << np.uint32(e))
    return bits_f32(np.uint32(e - 1) << np.uint32(23))


@kernel
def _best_index(x, d):
    """``best_index_mxfp4``: the first of the 16 codes whose ``|kvalues[i] * d - x|`` is least."""
    best = 0
    best_err = abs(F(KVALUES[0]) * d - x)
    for i in range(1, 16):
        err = abs(F(KVALUES[i]) * d - x)
        if err < best_err:
            best = i
            best_err = err
    return best


@inline
def _code(v, d):
    """``_best_index`` by comparing |v| with the midpoints between the magnitudes 0, 1, 2, 3, 4, 6, 8, 12
    (times d: exact, d is a power of two >= 2^-128). The caller makes sure |v| < 16 d and 12 d is finite. Then
    the two errors at a midpoint are exact (Sterbenz: the magnitudes either side are within a factor 2 of |v|),
    so ``err < best_err`` is the exact comparison, won by the smaller magnitude on a tie (``a > h``); a negative
    v takes the same magnitude's code + 8 (codes 9-15 are 1-7 negated; the scan meets +0 before -0); a NaN finds
    no midpoint and takes code 0, as in the scan."""
    a = abs(v)
    q = (
        np.uint8(a > F(0.5) * d)
        + np.uint8(a > F(1.5) * d)
        + np.uint8(a > F(2.5) * d)
        + np.uint8(a > F(3.5) * d)
        + np.uint8(a > F(5.0) * d)
        + np.uint8(a > F(7.0) * d)
        + np.uint8(a > F(10.0) * d)
    )
    return q | (np.uint8(8) * np.uint8((v < F(0.0)) & (q > 0)))


@kernel
def quantize_mxfp4(x, y, n_per_row):
    for i in range(x.size // 32):
        amax = block_absmax(x, 32 * i)[0]  # C's loop skips a NaN (amax < NaN is false): so does the scan
        e = 0
        if amax > 0:
            e = c_int(np.floor(F(np.log2(np.float64(amax)))) - F(2.0) + F(127.0)) & 0xFF
        d = e8m0_half(e)
        y[17 * i] = np.uint8(e)
        if amax < F(16.0) * d and F(12.0) * d < np.inf:
            for j in range(16):
                y[17 * i + 1 + j] = _code(x[32 * i + j], d) | (_code(x[32 * i + 16 + j], d) << np.uint8(4))
        else:  # an infinite value, or a block near FLT_MAX or below 2^-125 (e wrapped): the scan decides
            for j in range(16):
                y[17 * i + 1 + j] = np.uint8(_best_index(x[32 * i + j], d) | (_best_index(x[32 * i + 16 + j], d) << 4))


@kernel
def dequantize_mxfp4(y, x):
    for i in range(x.size // 32):
        d = e8m0_half(np.int64(y[17 * i]))
        for j in range(16):
            b = y[17 * i + 1 + j]
            x[32 * i + j] = F(KVALUES[b & 0x0F]) * d
            x[32 * i + j + 16] = F(KVALUES[b >> 4]) * d


def blocks_from_packed(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """A checkpoint's MXFP4 pair -- E2M1 codes uint8 [rows, values / 2] (value 2i in the low nibble, 2i + 1 in the
    high one) and E8M0 scales uint8 [rows, values / 32] -> ggml blocks uint8 [rows, values / 32 * 17]: the same
    bits, moved (the codes index the same table on both sides)."""
    rows, groups = scales.shape
    codes = codes.reshape(rows, groups, 16)
    codes = np.stack((codes & 15, codes >> 4), axis=-1).reshape(rows, groups, 32)
    out = np.empty((rows, groups, 17), dtype=np.uint8)
    out[..., 0] = scales
    out[..., 1:] = codes[..., :16] | (codes[..., 16:] << 4)
    return out.reshape(rows, groups * 17)
