"""MXFP4 (OCP microscaling FP4) blocks, no quantizer: checkpoints ship experts in it (MiMo-V2.5) and the
converter keeps them (their bits moved into ggml's blocks); quantizing a tensor from them needs their values.

A block is 32 values in 17 bytes: an E8M0 exponent byte x, then 16 bytes whose byte j holds value j in its low
nibble and value j + 16 in its high one. Value = kvalues[code] * 2^(x - 128), with ggml's doubled E2M1 table
(the halved scale makes up for it): ggml_e8m0_to_fp32_half, gguf-py's ``MXFP4.dequantize_blocks``.
"""

from __future__ import annotations

import numpy as np
import torch

_KVALUES = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 0.0, -1.0, -2.0, -3.0, -4.0, -6.0, -8.0, -12.0)


def dequantize_mxfp4(b: torch.Tensor) -> torch.Tensor:
    """uint8 blocks [n, 17] -> float32 values [n, 32]."""
    x = b[:, :1].to(torch.int32)
    # 2^(x - 128) as float32 bits: normal from x = 2 on, the two smallest are subnormal (as ggml builds them)
    bits = torch.where(x < 2, torch.tensor(0x00200000, dtype=torch.int32, device=b.device) << x, (x - 1) << 23)
    d = bits.view(torch.float32)
    qs = b[:, 1:]
    codes = torch.cat((qs & 0xF, qs >> 4), dim=1).long()
    return d * torch.tensor(_KVALUES, dtype=torch.float32, device=b.device)[codes]


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
