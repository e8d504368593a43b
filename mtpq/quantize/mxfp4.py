"""MXFP4 (OCP microscaling FP4) blocks, decoding only: checkpoints ship experts in it (MiMo-V2.5) and the
converter keeps them; quantizing a tensor from them needs their values.

A block is 32 values in 17 bytes: an E8M0 exponent byte x, then 16 bytes whose byte j holds value j in its low
nibble and value j + 16 in its high one. Value = kvalues[code] * 2^(x - 128), with ggml's doubled E2M1 table
(the halved scale makes up for it): ggml_e8m0_to_fp32_half, gguf-py's ``MXFP4.dequantize_blocks``.
"""

from __future__ import annotations

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
