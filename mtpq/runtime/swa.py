"""Sliding-window attention, as llama.cpp masks it (``LLAMA_SWA_TYPE_STANDARD``: the query at position i sees the
keys at positions j with i - window < j <= i), with attention sinks and a head-wise gate (llama.cpp's step35 and
mimo2 graphs).

Every layer here keeps a plain :class:`~mtpq.runtime.cache.KVCache` with every key, so rolling back stays a trim and
is exact at any depth: the mask (not the cache) hides what lies outside the window, and each block of queries reads
only the keys its window reaches.

- :class:`SlidingWindowAttention`: :class:`~mtpq.runtime.layers.Attention` (every option it has) over the window.
- :class:`WindowedAttention` (Step-3.5, MiMo-V2): its own options, each off where a layer lacks it:

  - ``window`` (None: full causal attention);
  - ``sinks`` (MiMo-V2, ``attn_sinks``): one logit per head joins each softmax's denominator and carries no value
    (ggml_soft_max_add_sinks: the sink is not scaled by the scores' 1/sqrt(d));
  - gate (Step-3.5, ``attn_gate`` [n_heads, hidden]): sigmoid(attn_gate · x), one value per head, multiplies that
    head's output before ``attn_output``;
  - ``value_scale`` (MiMo-V2.5): the layer's output (after ``attn_output``) times a constant;
  - projections: one fused ``attn_qkv`` ([q | k | v] rows, MiMo-V2.5) or ``attn_q`` / ``attn_k`` / ``attn_v``;
    values may be narrower than queries and keys (MiMo: 48 / 32); optional per-head q/k RMSNorm before RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .cache import KVCache
from .layers import Attention, AttnConfig, Packing, Rope, causal_attention, rms_norm, take_rows
from .weights import FusedLinear, Scope

BLOCK_SCORES = 1 << 22  # scores per block of queries: bounds the memory of a long prefill


@dataclass(frozen=True)
class SwaConfig:
    n_heads: int
    n_kv_heads: int
    head_dim: int  # queries and keys
    v_head_dim: int
    eps: float  # the per-head q/k RMSNorm's
    window: int | None = None  # None: full causal attention
    value_scale: float = 1.0


def windowed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int | torch.Tensor,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`~mtpq.runtime.layers.causal_attention` with a sliding ``window`` and ``sinks`` [Hq]: q [B, Hq, T, D] at
    positions start.. (or at positions ``start`` [B, T]), k [B, Hkv, S, D] and v [B, Hkv, S, Dv] at 0..S-1."""
    T, S = q.shape[2], k.shape[2]
    if sinks is None:
        last = start.max().item() if isinstance(start, torch.Tensor) else start + T - 1
        if window is None or last < window:  # every key a query could see is inside its window
            return causal_attention(q, k, v, start, scale)
    keys = torch.arange(S, device=q.device)
    if isinstance(start, torch.Tensor):  # each sequence's own query positions: one pass over every key
        return _attend(q, k, v, start[:, None, :, None], keys, scale, window, sinks)
    B, Hq = q.shape[:2]
    reach = S if window is None else min(S, window + T)
    rows = max(1, min(T, BLOCK_SCORES // (B * Hq * reach)))
    outs = []
    for a in range(0, T, rows):
        b = min(T, a + rows)
        lo = 0 if window is None else max(0, start + a - window + 1)  # the first key the block's window reaches
        hi = min(S, start + b)
        pos = torch.arange(start + a, start + b, device=q.device)[:, None]
        outs.append(_attend(q[:, :, a:b], k[:, :, lo:hi], v[:, :, lo:hi], pos, keys[lo:hi], scale, window, sinks))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _attend(q, k, v, q_pos, k_pos, scale, window, sinks):
    """Attention of q over k/v whose positions are k_pos [S]; q_pos broadcasts to [.., T, 1]."""
    allowed = k_pos <= q_pos
    if window is not None:
        allowed = allowed & (q_pos - k_pos < window)
    gqa = q.shape[1] != k.shape[1]
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)
    # the sink as one more column of each head's scores: softmax over [scores, sink], values of the real keys
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    g = Hq // Hkv  # query head h reads key head h // g
    scores = torch.matmul(q.reshape(B, Hkv, g, T, D), k[:, :, None].transpose(-1, -2)) * scale
    mask = allowed if allowed.dim() == 4 else allowed[None, None]  # [B or 1, 1, T, S]
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    sink = sinks.to(scores.dtype).view(1, Hkv, g, 1, 1).expand(B, Hkv, g, T, 1)
    p = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    return torch.matmul(p, v[:, :, None]).reshape(B, Hq, T, v.shape[-1])


class SlidingWindowAttention(Attention):
    """GQA (every option of :class:`~mtpq.runtime.layers.Attention`) over the last ``window`` positions."""

    def __init__(self, w: Scope, cfg: AttnConfig, rope: Rope, window: int):
        super().__init__(w, cfg, rope)
        self.window = window

    def attend(self, q, k, v, start, scale):
        return windowed_attention(q, k, v, start, scale, self.window)


class WindowedAttention(nn.Module):
    """GQA with the options of the module docstring; ``rope`` is the layer's own (per-layer base and width)."""

    def __init__(self, w: Scope, cfg: SwaConfig, rope: Rope):
        super().__init__()
        self.cfg, self.rope = cfg, rope
        if w.has("attn_qkv"):
            self.qkv = w.linear("attn_qkv")
        else:
            self.qkv = FusedLinear(w.linear("attn_q"), w.linear("attn_k"), w.linear("attn_v"))
        self.wo = w.linear("attn_output")
        self.q_norm, self.k_norm = w.optional("attn_q_norm"), w.optional("attn_k_norm")
        self.gate = w.linear("attn_gate", bias=False) if w.has("attn_gate") else None
        self.sinks = w.optional("attn_sinks")

    def new_cache(self) -> KVCache:
        return KVCache()

    def _project(self, x: torch.Tensor, q_at, k_at):
        """-> q [B, n_heads, T, D], k [B, n_kv, T, D], v [B, n_kv, T, Dv], q and k normed and rotated at positions
        ``q_at`` / ``k_at`` (a start or a tensor, as :meth:`Rope.apply`)."""
        cfg = self.cfg
        B, T, _ = x.shape
        qkv = self.qkv(x)
        if isinstance(qkv, tuple):
            q, k, v = qkv
        else:
            q, k, v = qkv.split(
                (cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads * cfg.v_head_dim), dim=-1
            )
        q = q.reshape(B, T, cfg.n_heads, cfg.head_dim)
        k = k.reshape(B, T, cfg.n_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, cfg.eps)
        if self.k_norm is not None:
            k = rms_norm(k, self.k_norm, cfg.eps)
        q, k = self.rope.apply(q.transpose(1, 2), q_at), self.rope.apply(k.transpose(1, 2), k_at)
        return q, k, v.reshape(B, T, cfg.n_kv_heads, cfg.v_head_dim).transpose(1, 2)

    def _attention(self, q, k, v, start) -> torch.Tensor:
        return windowed_attention(q, k, v, start, self.cfg.head_dim**-0.5, self.cfg.window, self.sinks)

    def _output(self, out: torch.Tensor, xq: torch.Tensor) -> torch.Tensor:
        """The heads' outputs [B, Tq, n_heads, Dv] of the rows ``xq`` (the layer's input there) -> [B, Tq, H]."""
        if self.gate is not None:
            out = out * torch.sigmoid(self.gate(xq))[..., None]
        y = self.wo(out.flatten(-2))
        return y * self.cfg.value_scale if self.cfg.value_scale != 1.0 else y

    def forward(
        self, x: torch.Tensor, start: int, cache: KVCache | None, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``rows`` [B, M]: outputs for those positions only."""
        q, k, v = self._project(x, start, start)
        if cache is not None:
            k, v = cache.update(k, v)
        xq = x
        if rows is not None:
            q = take_rows(q.transpose(1, 2), rows).transpose(1, 2)
            xq, start = take_rows(x, rows), start + rows
        return self._output(self._attention(q, k, v, start).transpose(1, 2), xq)

    def forward_packed(self, x: torch.Tensor, packing: Packing) -> torch.Tensor:
        """:meth:`forward` over packed sequences (x [1, N, H] -> [1, kept rows, H]), attention per sequence."""
        q, k, v = self._project(x, packing.positions, packing.positions)
        outs, at = [], 0
        for T, first in zip(packing.lengths, packing.firsts):
            sl = slice(at + first, at + T)  # the sequence's output rows
            outs.append(self._attention(q[:, :, sl], k[:, :, at : at + T], v[:, :, at : at + T], first))
            at += T
        xq = x if packing.kept is None else x[:, packing.kept]
        return self._output(torch.cat(outs, dim=2).transpose(1, 2), xq)
