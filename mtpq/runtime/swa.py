"""Sliding-window attention, as llama.cpp masks it (``LLAMA_SWA_TYPE_STANDARD``): the query at position i sees
the keys at positions j with i - window < j <= i.

The layer is :class:`~mtpq.runtime.layers.Attention` with another ``attend``; its cache is a plain
:class:`~mtpq.runtime.cache.KVCache` that keeps every key, so rolling back stays a trim and is exact at any
depth, and the mask (not the cache) hides what lies outside the window.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .layers import Attention, AttnConfig, Rope, causal_attention
from .weights import Scope


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int | torch.Tensor, scale: float,
                       window: int) -> torch.Tensor:
    """:func:`~mtpq.runtime.layers.causal_attention` with each query seeing only its last ``window`` positions:
    q [B, Hq, T, D] at positions start.. (or at positions ``start`` [B, T]), k and v at positions 0..S-1."""
    T, S = q.shape[2], k.shape[2]
    last = start.max().item() if isinstance(start, torch.Tensor) else start + T - 1
    if last < window:  # every key it could see is inside the window
        return causal_attention(q, k, v, start, scale)
    if isinstance(start, torch.Tensor):
        lo, at = 0, start[:, None, :, None]  # [B, 1, T, 1]
    else:  # keys older than the first query's window are never read
        lo, at = max(0, start - window + 1), torch.arange(start, start + T, device=q.device)[:, None]
        k, v = k[:, :, lo:], v[:, :, lo:]
    keys = torch.arange(lo, S, device=q.device)
    allowed = (keys <= at) & (at - keys < window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


class SlidingWindowAttention(Attention):
    """GQA (every option of :class:`~mtpq.runtime.layers.Attention`) over the last ``window`` positions."""

    def __init__(self, w: Scope, cfg: AttnConfig, rope: Rope, window: int):
        super().__init__(w, cfg, rope)
        self.window = window

    def attend(self, q, k, v, start, scale):
        return windowed_attention(q, k, v, start, scale, self.window)
