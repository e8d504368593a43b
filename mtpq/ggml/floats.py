"""The float types' conversions and the checks every quantization makes, as kernels: stored values (float32,
float16 or bf16 bits) widened to float32, NaN/Inf found, float32 narrowed to F16/BF16 as ggml rounds, fp16
scales that overflowed found."""

from __future__ import annotations

import numpy as np

from .jit import bits_f32, f32_bits, fp16, fp16_to_f32, kernel

F32, BF16, F16 = 0, 1, 2  # what stored values are: float32, bf16 bits, float16 bits


@kernel
def widen(raw, kind, x):
    """Stored 16-bit values (their bytes, ``kind`` BF16/F16) into float32 ``x``."""
    if kind == BF16:
        v = raw.view(np.uint16)
        for i in range(x.size):
            x[i] = bits_f32(np.uint32(v[i]) << np.uint32(16))
    else:
        v = raw.view(np.uint16)
        for i in range(x.size):
            x[i] = fp16_to_f32(v[i])


@kernel
def all_finite(x):
    """No NaN or inf in the float32 ``x``: no value whose exponent bits are all ones. A minimum over the
    exponent bits inverted, without an early exit, which LLVM vectorizes (6x the loop that stops at the first)."""
    v = x.view(np.int32)
    m = np.int32(0x7F800000)
    for i in range(v.size):
        m = min(m, ~v[i] & np.int32(0x7F800000))
    return m != 0


@kernel
def to_f16(x, y):
    """float32 -> fp16 bits (``ggml_fp32_to_fp16_row``); False if a finite value became inf."""
    ok = True
    v = y.view(np.uint16)
    for i in range(x.size):
        h = fp16(x[i])
        v[i] = h
        if (h & np.uint16(0x7C00)) == np.uint16(0x7C00):
            ok = False
    return ok


@kernel
def to_bf16(x, y):
    """float32 -> bf16 bits, ``ggml_compute_fp32_to_bf16``: round to nearest even, NaN made quiet; False if a
    finite value rounded to inf."""
    ok = True
    v = y.view(np.uint16)
    for i in range(x.size):
        u = f32_bits(x[i])
        if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
            v[i] = np.uint16((u >> np.uint32(16)) | np.uint32(64))
        else:
            r = np.uint16((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16))
            v[i] = r
            if (r & np.uint16(0x7FFF)) == np.uint16(0x7F80):
                ok = False
    return ok


@kernel
def fp16_overflow(y, ts, fields):
    """Whether a block (``ts`` bytes each) holds an fp16 scale at one of ``fields`` whose exponent is all ones."""
    nb = y.size // ts
    for f in fields:
        top = 0  # the largest (exponent bits + 4): 0x80 only for an exponent of all ones; no early exit, vectorized
        for b in range(nb):
            top = max(top, (np.int64(y[b * ts + f + 1]) & 0x7C) + 4)
        if top == 0x80:
            return True
    return False


@kernel
def iq1_m_overflow(y):
    """IQ1_M keeps its fp16 scale in the top nibbles of four words: its exponent bits lie in bytes 53 and 55."""
    for b in range(y.size // 56):
        if (y[b * 56 + 53] & 0xC0) == 0xC0 and (y[b * 56 + 55] & 0x70) == 0x70:
            return True
    return False
