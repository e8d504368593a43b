"""Shared numerics of the runtime's families: norms, RoPE, GQA attention, SwiGLU, routed experts.

Every module is built from a :class:`~mtpq.runtime.weights.Scope` (the GGUF tensors under
one prefix, already bound to a device and dtype) plus a small config. Sequence-mixing
layers (attention here, MLA in ``mla.py``, DeltaNet in ``deltanet.py``) share one
call signature, ``layer(x, start, cache, rows=None)`` with ``x`` [B, T, H], ``start`` the
position of x[:, 0] and ``cache`` a :mod:`~mtpq.runtime.cache` object or None (uncached: any
batch, positions from 0), and say which cache they need with ``new_cache()``. ``rows`` [B, M]
(uncached passes): outputs for those positions of each sequence only. :class:`Packing` runs
several sequences as the rows of one tensor (the teacher-forced estimator).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import weights as weight_io  # weight_io.observer: see mtpq.runtime.importance
from .cache import KVCache, LengthCache
from .weights import FusedLinear, Scope, as_dtype, widened


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, scaled in the input dtype (as transformers does)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:  # one call, bitwise the same arithmetic
        if weight.dim() == 1:
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        return weight * F.rms_norm(x, (x.shape[-1],), None, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Bias-free LayerNorm (ggml_norm, then the weight), computed in float32 and scaled in the input dtype."""
    return weight * F.layer_norm(x.float(), (x.shape[-1],), None, None, eps).to(x.dtype)


# ----------------------------------------------------------------------------- RoPE


def rope_inv_freq(dim: int, base: float, linear_factor: float = 1.0) -> torch.Tensor:
    """Inverse frequencies of RoPE over ``dim`` rotated dims (linear scaling divides positions)."""
    # float32 throughout, as transformers computes it: greedy agreement on tiny models depends on the last bit
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)) / linear_factor


def yarn_inv_freq(
    dim: int,
    base: float,
    factor: float,
    orig_ctx: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    ext_factor: float = 1.0,
) -> torch.Tensor:
    """YaRN's inverse frequencies: high-frequency pairs keep RoPE's, low-frequency pairs are divided by
    ``factor``, with a linear ramp between the pairs that turn ``beta_fast`` and ``beta_slow`` times over
    ``orig_ctx`` (transformers' _compute_yarn_parameters, ggml's rope_yarn). The attention scaling YaRN
    also brings is the caller's: it differs between families (see mla.py)."""
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)

    def corr_dim(rotations: float) -> float:  # the pair index that turns `rotations` times over orig_ctx
        return dim * math.log(orig_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(corr_dim(beta_fast)), 0), min(math.ceil(corr_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # as both references do: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = (1 - ramp) * ext_factor  # share of the original frequency
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated


class Rope:
    """Rotary embedding on the first ``2 * len(inv_freq)`` dims of each head; the rest pass through.

    ``neox``: rotate the two halves (GPT-NeoX order, llama.cpp's ROPE_TYPE_NEOX); otherwise adjacent
    pairs (2i, 2i+1) (llama.cpp's ROPE_TYPE_NORM). ``mscale`` multiplies cos and sin (YaRN's attention
    factor). Families with other schedules (YaRN, multi-section) build ``inv_freq`` themselves.
    """

    def __init__(self, inv_freq: torch.Tensor, neox: bool = True, mscale: float = 1.0):
        self.inv_freq = inv_freq.float()
        self.neox, self.mscale = neox, mscale
        self.dim = 2 * inv_freq.numel()
        self._memo: list = []  # the last MEMO (key, tables): the layers of one forward share them

    MEMO = 2  # a packed head pass alternates two position tensors (queries, keys)

    def tables(self, start: int | torch.Tensor, length: int, device: torch.device, dtype: torch.dtype):
        """The two factors of :meth:`apply`, [length, dim] at positions start.., or [B, 1, T, dim] at positions
        ``start`` [B, T] (memoized by identity: a packing's tensors). neox: (cos, sin); adjacent pairs:
        cos and (-sin, sin) per pair, repeated to the pair's two dims."""
        for key, tables in self._memo or ():  # (None: cleared)
            tensors = isinstance(start, torch.Tensor) or isinstance(key[0], torch.Tensor)
            if (key[0] is start if tensors else key[0] == start) and key[1:] == (length, device, dtype):
                return tables
        if self.inv_freq.device != device:  # moved once: a copy per call would wait for the GPU each time
            self.inv_freq = self.inv_freq.to(device)
        if isinstance(start, torch.Tensor):
            freqs = start.to(torch.float32)[..., None] * self.inv_freq
        else:
            pos = torch.arange(start, start + length, device=device, dtype=torch.float32)
            freqs = pos[:, None] * self.inv_freq[None, :]
        if self.neox:
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = (emb.cos() * self.mscale).to(dtype), (emb.sin() * self.mscale).to(dtype)
        else:
            c, s = (freqs.cos() * self.mscale).to(dtype), (freqs.sin() * self.mscale).to(dtype)
            cos, sin = c.repeat_interleave(2, dim=-1), torch.stack((-s, s), dim=-1).flatten(-2)
        if isinstance(start, torch.Tensor):
            cos, sin = cos[:, None], sin[:, None]
        self._memo = [((start, length, device, dtype), (cos, sin)), *(self._memo or ())][: self.MEMO]
        return cos, sin

    def apply(self, x: torch.Tensor, start: int | torch.Tensor) -> torch.Tensor:
        """x [B, H, T, head_dim] at positions start..start+T-1, or at positions ``start`` [B, T]."""
        cos, sin = self.tables(start, x.shape[2], x.device, x.dtype)
        d = self.dim
        rot, rest = x[..., :d], x[..., d:]
        if self.neox:
            x1, x2 = rot[..., : d // 2], rot[..., d // 2 :]
            out = rot * cos + torch.cat((-x2, x1), dim=-1) * sin
        else:  # pairs (2i, 2i+1) share frequency i: (x1 c - x2 s, x2 c + x1 s) as rot * cos + swapped pairs *
            # (-s, s), the same bits (a + (-b) == a - b) in 4 contiguous ops instead of 6 strided ones and a stack
            out = rot * cos + rot.unflatten(-1, (-1, 2)).flip(-1).flatten(-2) * sin
        return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def take_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [B, T, ...] -> [B, M, ...]: row rows[b, m] of sequence b."""
    return x[torch.arange(x.shape[0], device=x.device)[:, None], rows]


_mask_memo: list = [None, None]  # (key, mask): the layers of one forward share it


def _causal_mask(start: int, T: int, S: int, device: torch.device) -> torch.Tensor:
    key = (start, T, S, device)
    if _mask_memo[0] != key:
        rows = torch.arange(start, start + T, device=device)[:, None]
        _mask_memo[:] = key, torch.arange(S, device=device)[None, :] <= rows
    return _mask_memo[1]


def autograd_records(*tensors: torch.Tensor) -> bool:
    """Whether autograd records an op on ``tensors``: then the ops that overwrite their inputs to save memory at
    inference must not (scripts/train_family.py trains through the runtime)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int | torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, Hq, T, D] at positions start.. (or at positions ``start`` [B, T]), k [B, Hkv, S, D] and
    v [B, Hkv, S, Dv] at positions 0..S-1 (GQA: query head h reads key head h // (Hq / Hkv)) -> [B, Hq, T, Dv]."""
    B, Hq, T, _ = q.shape
    S, gqa = k.shape[2], Hq != k.shape[1]
    if isinstance(start, torch.Tensor):  # each sequence's own query positions
        allowed = (torch.arange(S, device=q.device) <= start[..., None])[:, None]  # [B, 1, T, S]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)
    blocked = T >= BLOCKED_MIN_T and q.device.type == "cpu" and _block_rows(B, Hq, S) >= MIN_BLOCK_ROWS
    if blocked and not autograd_records(q, k, v):  # (its blocks are written into a buffer autograd cannot follow)
        return blocked_causal_attention(q, k, v, start, scale)
    mqa = k.shape[1] == 1 and Hq > 1 and T < 16  # (long T: SDPA's own GQA path is as fast)
    if (pad := q.shape[-1] - v.shape[-1]) > 0 and not mqa:  # SDPA's CPU flash kernel wants v as wide as q
        return causal_attention(q, k, F.pad(v, (0, pad)), start, scale)[..., : v.shape[-1]]
    if start == 0 and T == S and not mqa:  # a whole sequence (prefill, uncached): bitwise the mask's result, faster
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if T == 1 and S <= start + 1:  # one new token (plain decoding): it sees every key, no mask to build
        allowed = None
    else:
        allowed = _causal_mask(start, T, S, q.device)
    if mqa:  # one kv head (MLA's latent): the heads become rows of one query, one GEMM instead of SDPA's GQA path
        out = F.scaled_dot_product_attention(
            q.reshape(B, 1, Hq * T, -1), k, v, scale=scale, attn_mask=None if allowed is None else allowed.repeat(Hq, 1)
        )
        return out.view(B, Hq, T, -1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)


# From this many query rows on, attention on the CPU runs as blocks of GEMMs (blocked_causal_attention) instead
# of SDPA's flash kernel, skipping most of the masked triangle; fewer rows have little triangle to skip and SDPA's
# single call wins (docs/notes/runtime.md, "Constants and the figures behind them")
BLOCKED_MIN_T = 128
ATTN_BLOCK = 64  # query rows per block: the blocks skip all but 1/(2 n_blocks) of the masked triangle
ATTN_BLOCK_SCORES = 1 << 22  # and at most this many scores per block (memory with many heads x long contexts)
MIN_BLOCK_ROWS = 16  # blocks thinner than this (very many heads x keys): SDPA's flash kernel, whose memory is its tiles
_upper_memo: dict = {}


def _block_rows(B: int, Hq: int, S: int) -> int:
    return min(ATTN_BLOCK, ATTN_BLOCK_SCORES // (B * Hq * S))


def _strict_upper(n: int, device: torch.device) -> torch.Tensor:
    """[n, n]: -inf above the diagonal, 0 on and below it (what row i of a block may not see of its own keys)."""
    key = (n, device)
    if key not in _upper_memo:
        _upper_memo[key] = torch.full((n, n), float("-inf"), device=device).triu_(1)
    return _upper_memo[key]


def blocked_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float
) -> torch.Tensor:
    """:func:`causal_attention` for q at positions start..start+T-1 as block GEMMs: each block of query rows
    (every query head of a key head folded into its rows) is scored against the keys it sees only, the
    diagonal square masked, softmax, times v. SDPA's CPU flash kernel runs its small per-head tiles well
    under GEMM speed here; these blocks skip the same masked triangle and run as batched GEMMs."""
    B, Hq, T, D = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[-1]
    g, BH = Hq // Hkv, B * Hkv
    k, v = k.reshape(BH, S, D), v.reshape(BH, S, Dv)
    q = q.reshape(BH, g, T, D)
    out = q.new_empty(BH, g, T, Dv)
    rows = max(1, _block_rows(B, Hq, S))
    n_blocks = -(-T // rows)
    edges = [T * i // n_blocks for i in range(n_blocks + 1)]
    for a, b in zip(edges, edges[1:]):
        n, seen = b - a, start + b  # the block's rows (positions start+a..), the keys they see (0..seen-1)
        qb = torch.mul(q[:, :, a:b], scale, out=q.new_empty(BH, g, n, D))  # contiguous: its rows fold
        s = torch.bmm(qb.view(BH, g * n, D), k[:, :seen].transpose(1, 2))
        s.view(BH, g, n, seen)[..., seen - n :].add_(_strict_upper(n, q.device))
        p = torch.softmax(s, dim=-1)
        out[:, :, a:b] = torch.bmm(p, v[:, :seen]).view(BH, g, n, Dv)
    return out.view(B, Hq, T, Dv)


def packed_attention(
    q: torch.Tensor,
    kv: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
    packing: Packing,
    scale: float,
    attend: Callable = None,
) -> torch.Tensor:
    """Attention of packed sequences, each on its own rows: q [Nq, Hq, D] (the packing's output rows), and
    ``kv(a, n)`` the keys [n, Hkv, D] and values [n, Hkv, Dv] of the packed rows a..a+n-1 -> [Nq, Hq, Dv].
    One causal attention per sequence at its own length: a padded batch would spend its longest
    sequence's T^2 on every sequence. ``attend``: another attention with :func:`causal_attention`'s signature
    (a sliding window's)."""
    attend = attend or causal_attention
    outs, at, aq = [], 0, 0
    for T, first in zip(packing.lengths, packing.firsts):
        M = T - first  # its output rows: positions first..T-1
        kb, vb = kv(at, T)
        qb, kb, vb = (t.transpose(0, 1)[None] for t in (q[aq : aq + M], kb, vb))
        outs.append(attend(qb, kb, vb, first, scale)[0].transpose(0, 1))
        at, aq = at + T, aq + M
    return torch.cat(outs)


# ----------------------------------------------------------------------------- attention


@dataclass(frozen=True)
class AttnConfig:
    n_heads: int
    n_kv_heads: int
    head_dim: int
    eps: float  # for the optional per-head q/k RMSNorm
    gated: bool = False  # attn_q also yields a per-head output gate: [q | gate] per head (Qwen3.5/Qwen3-Next)


class Attention(nn.Module):
    """GQA with optional q/k/v biases, per-head q/k RMSNorm (before RoPE) and a sigmoid output gate; ``rope=None``:
    no position encoding at all (Nemotron-H's attention). ``attend`` (causal_attention's signature) is the attention
    proper: a subclass may mask more (swa.py)."""

    attend = staticmethod(causal_attention)

    def __init__(self, w: Scope, cfg: AttnConfig, rope: Rope | None):
        super().__init__()
        self.cfg, self.rope = cfg, rope
        self.wq, self.wk, self.wv = w.linear("attn_q"), w.linear("attn_k"), w.linear("attn_v")
        self.wo = w.linear("attn_output")
        self.qkv = FusedLinear(self.wq, self.wk, self.wv)
        self.q_norm, self.k_norm = w.optional("attn_q_norm"), w.optional("attn_k_norm")
        # q and k normed and rotated as one tensor of n_heads + n_kv_heads heads (half the small ops; the
        # same arithmetic per element), with the two norms' weights stacked per head
        self.joint = (self.q_norm is None) == (self.k_norm is None)
        self.qk_norm = (
            None
            if self.q_norm is None or not self.joint
            else torch.cat((self.q_norm.expand(cfg.n_heads, -1), self.k_norm.expand(cfg.n_kv_heads, -1)))
        )
        # llama.cpp's numerics: keys and values as its default (f16) KV cache stores them
        self.stored_as = torch.float16 if w.weights.round_inputs else None

    def new_cache(self) -> KVCache:
        return KVCache()

    def _project(self, x: torch.Tensor, xq: torch.Tensor | None, q_at, k_at):
        """Queries (and the output gate) from the rows ``xq`` (all of ``x`` when None), keys and values from
        ``x``; q and k normed and rotated, at positions ``q_at`` / ``k_at`` (a start or a tensor, as
        :meth:`Rope.apply`). -> q [B, n_heads, Tq, D], k [B, n_kv, T, D], v [B, T, n_kv, D], gate or None."""
        cfg = self.cfg
        B, T, _ = x.shape
        if xq is not None:  # queries (and the gate) only where outputs are wanted
            q, k, v = self.wq(xq), self.wk(x), self.wv(x)
        else:
            q, k, v = self.qkv(x)
        Tq = q.shape[1]
        q = q.view(B, Tq, cfg.n_heads, -1)
        gate = None
        if cfg.gated:
            q, gate = q.split(cfg.head_dim, dim=-1)
            gate = gate.reshape(B, Tq, cfg.n_heads * cfg.head_dim)
        k = k.view(B, T, cfg.n_kv_heads, cfg.head_dim)
        if xq is None and self.joint:
            qk = torch.cat((q, k), dim=2)
            if self.qk_norm is not None:
                qk = rms_norm(qk, self.qk_norm, cfg.eps)
            q, k = self._rotate(qk.transpose(1, 2), k_at).split((cfg.n_heads, cfg.n_kv_heads), dim=1)
        else:  # q and k differ in length, or only one of them is normed: normed and rotated apart
            if self.q_norm is not None:
                q = rms_norm(q, self.q_norm, cfg.eps)
            if self.k_norm is not None:
                k = rms_norm(k, self.k_norm, cfg.eps)
            q, k = self._rotate(q.transpose(1, 2), q_at), self._rotate(k.transpose(1, 2), k_at)
        v = v.view(B, T, cfg.n_kv_heads, cfg.head_dim)
        if self.stored_as is not None:
            k, v = k.to(self.stored_as).to(q.dtype), v.to(self.stored_as).to(q.dtype)
        return q, k, v, gate

    def _rotate(self, t: torch.Tensor, at) -> torch.Tensor:
        return t if self.rope is None else self.rope.apply(t, at)

    def _output(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """The heads' outputs [B, Tq, n_heads * D], gated, through attn_output."""
        return self.wo(out if gate is None else out * torch.sigmoid(gate))

    def forward_packed(self, x: torch.Tensor, packing: Packing) -> torch.Tensor:
        """:meth:`forward` over packed sequences (:class:`Packing`), x [1, N, H] -> [1, kept rows, H]: the
        projections, norms and RoPE run on the real rows, attention per sequence."""
        xq = None if packing.kept is None else x[:, packing.kept]
        q, k, v, gate = self._project(x, xq, packing.out_positions, packing.positions)
        k, v = k[0].transpose(0, 1), v[0]  # [N, n_kv, D] rows
        out = packed_attention(
            q[0].transpose(0, 1),
            lambda a, n: (k[a : a + n], v[a : a + n]),
            packing,
            self.cfg.head_dim**-0.5,
            self.attend,
        )
        return self._output(out.reshape(1, q.shape[2], -1), gate)

    def forward(
        self, x: torch.Tensor, start: int, cache: KVCache | None, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``rows`` [B, M]: outputs for those positions only (every row still gives its key and value)."""
        at = start if rows is None else start + rows  # the queries' positions
        q, k, v, gate = self._project(x, None if rows is None else take_rows(x, rows), at, start)
        v = v.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v)
        out = self.attend(q, k, v, at, self.cfg.head_dim**-0.5).transpose(1, 2)
        return self._output(out.reshape(x.shape[0], q.shape[2], -1), gate)


# ----------------------------------------------------------------------------- feed-forward


def swiglu_(gate: torch.Tensor, up: torch.Tensor, limit: float = 0.0, clamp_gate: bool = False) -> torch.Tensor:
    """silu(gate) * up, written into ``gate``. ``limit`` > 0: llama.cpp's clamped SwiGLU (its ``swiglu_clamp_exp``
    / ``_shexp``): up clamped to [-limit, limit] and silu(gate) to at most limit, before the product; with
    ``clamp_gate`` the gate itself is clamped to at most limit before the silu instead (ggml_swiglu_clamp:
    DeepSeek-V4, Hy-V4)."""
    if autograd_records(gate, up):
        if limit <= 0:
            return F.silu(gate) * up
        if clamp_gate:
            return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
        return F.silu(gate).clamp(max=limit) * up.clamp(-limit, limit)
    if limit > 0 and clamp_gate:
        return F.silu(gate.clamp_(max=limit), inplace=True).mul_(up.clamp(-limit, limit))
    act = F.silu(gate, inplace=True)
    if limit > 0:
        return act.clamp_(max=limit).mul_(up.clamp(-limit, limit))
    return act.mul_(up)  # in place: no [rows, F] temporaries


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)). ``suffix`` ``_shexp`` gives the shared expert; ``limit``: see :func:`swiglu_`."""

    def __init__(self, w: Scope, suffix: str = "", limit: float = 0.0, clamp_gate: bool = False):
        super().__init__()
        self.gate, self.up = w.linear(f"ffn_gate{suffix}"), w.linear(f"ffn_up{suffix}")
        self.down = w.linear(f"ffn_down{suffix}")
        self.limit, self.clamp_gate = limit, clamp_gate

        self.gate_up = FusedLinear(self.gate, self.up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down(swiglu_(gate, up, self.limit, self.clamp_gate))


def relu_squared(h: torch.Tensor) -> torch.Tensor:
    """relu(h)^2, in place (llama.cpp's LLM_FFN_RELU_SQR without a gate)."""
    return F.relu(h).square() if autograd_records(h) else F.relu(h, inplace=True).square_()


class SquaredReLU(nn.Module):
    """down(relu(up(x))^2): Nemotron-H's non-gated MLP (biases where the file has them). ``suffix`` ``_shexp``
    gives the shared expert."""

    def __init__(self, w: Scope, suffix: str = ""):
        super().__init__()
        self.up, self.down = w.linear(f"ffn_up{suffix}"), w.linear(f"ffn_down{suffix}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(relu_squared(self.up(x)))


@dataclass(frozen=True)
class MoEConfig:
    n_experts: int
    n_used: int
    gating: str = "softmax"  # "softmax" | "sigmoid" (scores from router logits)
    norm_topk: bool = False  # renormalise the chosen experts' weights to sum to 1
    scale: float = 1.0  # routed_scaling_factor
    n_group: int = 1  # group-limited routing: keep the best topk_group groups (a group scores its best two)
    topk_group: int = 1
    swiglu_limit: float = 0.0  # the routed experts' clamped SwiGLU (swiglu_), 0: none
    shared_swiglu_limit: float = 0.0  # the shared expert's
    clamp_gate: bool = False  # the clamps as ggml_swiglu_clamp applies them (see swiglu_)


DENSE_MOE_TOKENS = 16  # above this many tokens a MoE layer runs only the experts they pick
GATHERED_MOE_PICKS = 64  # off the CPU, up to this many (token, expert) picks gather their experts by index


class MoE(nn.Module):
    """Routed SwiGLU experts (stacked 3-D weights) plus an optional shared expert, optionally gated
    by ``sigmoid(ffn_gate_inp_shexp · x)`` (Qwen3.5-MoE). ``exp_probs_b`` (DeepSeek/GLM's correction
    bias) only chooses experts, it never weighs them.

    Nemotron-H's LatentMoE, read from its tensors: experts without ``ffn_gate_exps`` are non-gated,
    relu(up x)^2 (so is a shared expert without ``ffn_gate_shexp``), and with ``ffn_latent_down`` /
    ``ffn_latent_up`` the routed experts work on latent_down(x) and their sum goes through latent_up; the
    router and the shared expert still read x."""

    def __init__(self, w: Scope, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.router = w.tensor("ffn_gate_inp", torch.float32)  # [E, H], routed in f32
        self.router_name, self.shared_gate_name = w.name("ffn_gate_inp"), w.name("ffn_gate_inp_shexp")
        # (Hy3's GGUF names it without the .bias suffix, as llama.cpp's hy_v3 loader does)
        self.bias = w.optional("exp_probs_b.bias" if w.has("exp_probs_b.bias") else "exp_probs_b", torch.float32)
        self.gate = w.qweight("ffn_gate_exps") if w.has("ffn_gate_exps") else None  # None: relu(up x)^2
        self.up, self.down = w.qweight("ffn_up_exps"), w.qweight("ffn_down_exps")
        self.latent_down = w.linear("ffn_latent_down", bias=False) if w.has("ffn_latent_down") else None
        self.latent_up = w.linear("ffn_latent_up", bias=False) if w.has("ffn_latent_up") else None
        self.shared = (
            SwiGLU(w, "_shexp", cfg.shared_swiglu_limit, cfg.clamp_gate)
            if w.has("ffn_gate_shexp")
            else SquaredReLU(w, "_shexp")
            if w.has("ffn_up_shexp")
            else None
        )
        self.shared_gate = w.optional("ffn_gate_inp_shexp", torch.float32)  # [H] or [1, H]
        self.register_buffer("gate_up", None, persistent=False)  # float stacks: gate|up as one [2*E*F, H]
        if (
            self.gate is not None
            and not self.gate.quantized
            and not self.up.quantized
            and self.gate.data.dtype == self.up.data.dtype
        ):
            E, F_, H = self.gate.data.shape
            both = torch.cat([self.gate.data.reshape(E * F_, H), self.up.data.reshape(E * F_, H)])
            self.gate.data, self.up.data = both[: E * F_].view(E, F_, H), both[E * F_ :].view(E, F_, H)
            self.gate_up = both  # (the expert stacks are now views of it)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (weights [N, k] f32, expert ids [N, k])."""
        cfg = self.cfg
        if weight_io.observer is not None:
            weight_io.observer(self.router_name, None, x)
        logits = F.linear(as_dtype(x, torch.float32), self.router)
        scores = logits.sigmoid() if cfg.gating == "sigmoid" else logits.softmax(dim=-1)
        choice = scores if self.bias is None else scores + self.bias
        if cfg.n_group > 1 and cfg.topk_group < cfg.n_group:
            grouped = choice.view(-1, cfg.n_group, cfg.n_experts // cfg.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(cfg.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(-1, cfg.n_experts)
        ids = choice.topk(cfg.n_used, dim=-1).indices
        weights = scores.gather(1, ids)
        if cfg.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * cfg.scale, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.route(x)
        watch = weight_io.observer
        xe = x if self.latent_down is None else self.latent_down(x)  # what the routed experts read
        # few tokens (decoding, verifying drafts) and few experts per pick: every expert, no host sync;
        # many tokens (prefill, teacher forcing): arithmetic counts, only the experts in use
        if watch is None and self.cfg.n_experts <= 2 * self.cfg.n_used and x.shape[0] <= DENSE_MOE_TOKENS:
            out = self._all_experts(xe, weights, ids)
        elif watch is None and x.device.type != "cpu" and ids.numel() <= GATHERED_MOE_PICKS:
            out = self._gathered_experts(xe, weights, ids)
        else:
            out = self._used_experts(xe, weights, ids, watch)
        if self.latent_up is not None:
            out = self.latent_up(out)
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                if watch is not None:
                    watch(self.shared_gate_name, None, x)
                shared = shared * torch.sigmoid(F.linear(x.float(), self.shared_gate.view(1, -1))).to(x.dtype)
            out = out + shared
        return out.view(shape)

    def _all_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, unused ones weighted 0: with few experts per pick (E <= 2k) this
        is at most twice the arithmetic of the sparse path, in a handful of batched ops instead of ~10
        small ops per expert, whose overhead is what costs on a small model."""
        E, F_, H = self.up.shape
        # gate and up as [E*F, H] matrices (views: no transposed copies), one GEMM when fused; down batched.
        # Each weight is fetched right before its one GEMM (matrix() may hand out a reused buffer).
        if self.gate_up is not None:
            g, u = F.linear(self.gate.input(x), widened(self.gate_up, x.dtype, self.gate.pool)).chunk(2, dim=-1)
        else:
            g = (
                None
                if self.gate is None
                else F.linear(self.gate.input(x), as_dtype(self.gate.matrix(), x.dtype).reshape(E * F_, H))
            )
            u = F.linear(self.up.input(x), as_dtype(self.up.matrix(), x.dtype).reshape(E * F_, H))
        h = relu_squared(u) if g is None else swiglu_(g, u, self.cfg.swiglu_limit, self.cfg.clamp_gate)  # [N, E*F]
        h = self.down.input(h.view(-1, E, F_)).view(h.shape)  # (rounded per expert row, as llama.cpp)
        down = as_dtype(self.down.matrix(), x.dtype)  # [E, H, F]
        y = torch.bmm(h.view(-1, E, F_).transpose(0, 1), down.transpose(1, 2))  # [E, N, H]
        dense = torch.zeros(x.shape[0], self.cfg.n_experts, dtype=torch.float32, device=x.device)
        dense.scatter_add_(1, ids, weights)  # (add: a hash-routed token may pick one expert twice)
        return torch.einsum("ne,enh->nh", as_dtype(dense, x.dtype), y)

    def _gathered_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each (token, slot) pick's expert gathered from the stacks by its id on the device, as batched GEMMs:
        the expert ids never leave the device, so decoding on a GPU waits for no host sync (the sparse path
        reads them back to group the tokens)."""
        N, k = ids.shape
        flat = ids.reshape(-1)
        xs = x.repeat_interleave(k, dim=0)[:, None]  # [N*k, 1, H]: one row per pick
        u = torch.bmm(self.up.input(xs), _picked(self.up, flat, x.dtype).transpose(1, 2))
        if self.gate is None:
            h = relu_squared(u)  # [N*k, 1, F]
        else:
            h = swiglu_(
                torch.bmm(self.gate.input(xs), _picked(self.gate, flat, x.dtype).transpose(1, 2)),
                u,
                self.cfg.swiglu_limit,
                self.cfg.clamp_gate,
            )
        y = torch.bmm(self.down.input(h), _picked(self.down, flat, x.dtype).transpose(1, 2))  # [N*k, 1, H]
        return (y.view(N, k, -1) * as_dtype(weights, x.dtype)[..., None]).sum(dim=1)

    def _used_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, watch) -> torch.Tensor:
        out = x.new_zeros(x.shape[0], self.down.shape[1])  # (the latent width when experts read a latent)
        k = ids.shape[1]
        one = x.shape[0] == 1
        if one:  # decoding one token: its experts and weights need no search
            groups = [(e, slice(None), weights[:, s, None]) for e, s in sorted(zip(ids[0].tolist(), range(k)))]
        else:  # the (token, slot) picks grouped by expert with one stable sort (tokens stay in order) and one
            # host sync, instead of a search per expert; only the experts some token uses
            flat = ids.reshape(-1)
            order = flat.argsort(stable=True)
            tok_sorted, w_sorted = order // k, weights.reshape(-1)[order, None]
            groups, at = [], 0
            for e, count in enumerate(torch.bincount(flat, minlength=self.cfg.n_experts).tolist()):
                if count:
                    groups.append((e, tok_sorted[at : at + count], w_sorted[at : at + count]))
                at += count
        for e, tok, w in groups:
            h = x[tok]
            if watch is not None:
                for m in (self.gate, self.up) if self.gate is not None else (self.up,):
                    watch(m.name, e, h)
            u = F.linear(self.up.input(h), as_dtype(self.up.matrix(e), x.dtype))
            if self.gate is None:
                h = relu_squared(u)
            else:
                h = swiglu_(
                    F.linear(self.gate.input(h), as_dtype(self.gate.matrix(e), x.dtype)),
                    u,
                    self.cfg.swiglu_limit,
                    self.cfg.clamp_gate,
                )
            if watch is not None:
                watch(self.down.name, e, h)
            h = F.linear(self.down.input(h), as_dtype(self.down.matrix(e), x.dtype))
            if one:
                out += (h * w).to(x.dtype)
            else:
                out.index_add_(0, tok, (h * w).to(x.dtype))
        return out


def _picked(stack, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Experts ``ids`` of a 3-D expert stack (a QWeight) as floats [len(ids), rows, cols], indexed on the device."""
    if stack.quantized:
        return stack.dequant_bytes(stack.data[ids], (ids.numel(), *stack.shape[1:]))
    return as_dtype(stack.data[ids], dtype)


# ----------------------------------------------------------------------------- block


class Packing:
    """Sequences packed one after another as the rows of one [1, N, H] tensor, each from position 0,
    uncached (the teacher-forced estimator's pass). The per-row work (norms, projections, feed-forward,
    logits) runs once over all N rows; a sequence mixer with ``forward_packed`` (attention, MLA) takes the rows
    as they are and attends per sequence, any other sees them as a right-padded batch [B, T, H] (``pad``:
    padding follows each sequence's own rows, so causal mixing never reads it into them) and gives back one
    output per row (``unpad``). With ``out_from`` (per sequence) only rows out_from[b]..
    of sequence b give outputs (the MTP head's compared pairs): ``rows`` [B, M] are their positions
    (a sequence with fewer repeats its last row; those outputs are dropped), ``kept`` their flat rows."""

    def __init__(self, lengths: list[int], device: torch.device, out_from: list[int] | None = None):
        B, T = len(lengths), max(lengths)
        self.shape = (B, T)
        self.lengths, self.firsts = list(lengths), list(out_from) if out_from is not None else [0] * B
        # each row's position in its sequence, and the output rows' ([1, N] / [1, kept]: RoPE's tensor form)
        self.positions = torch.cat([torch.arange(n) for n in lengths]).to(device)[None]
        self.out_positions = (
            self.positions
            if out_from is None
            else torch.cat([torch.arange(f, n) for f, n in zip(out_from, lengths)]).to(device)[None]
        )
        self.slots = torch.cat([torch.arange(n) + b * T for b, n in enumerate(lengths)]).to(device)
        if out_from is None:
            self.rows = self.kept = None
            self.out_slots = self.slots
            return
        firsts = torch.tensor(out_from)
        M = max(n - f for n, f in zip(lengths, out_from))
        self.rows = torch.minimum(firsts[:, None] + torch.arange(M), torch.tensor(lengths)[:, None] - 1).to(device)
        at = [0] + list(itertools.accumulate(lengths))
        self.kept = torch.cat([torch.arange(a + f, a + n) for a, f, n in zip(at, out_from, lengths)]).to(device)
        self.out_slots = torch.cat([torch.arange(n - f) + b * M for b, (n, f) in enumerate(zip(lengths, out_from))]).to(
            device
        )

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[1, N, H] -> [B, T, H] (padding rows zero)."""
        B, T = self.shape
        return x.new_zeros(B * T, x.shape[-1]).index_copy_(0, self.slots, x[0]).view(B, T, -1)

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """A mixer's output [B, T or M, H] -> [1, rows, H] (the kept rows only with ``out_from``)."""
        return y.reshape(-1, y.shape[-1]).index_select(0, self.out_slots)[None]


class DecoderBlock(nn.Module):
    """Pre-norm residual block: h = x + mix(norm(x)); out = h + ffn(norm(h)) (``ffn=None``: out = h, a block of
    one layer, Nemotron-H's).

    ``mix`` is any sequence-mixing layer (attention, MLA, DeltaNet, Mamba-2, :class:`PositionWise`); the norm
    names are the family's (``post_attention_norm`` for GLM/Qwen, ``ffn_norm`` for DeepSeek)."""

    def __init__(
        self, w: Scope, mix: nn.Module, ffn: nn.Module | None, eps: float, ffn_norm: str = "post_attention_norm"
    ):
        super().__init__()
        self.eps = eps
        self.attn_norm, self.attn = w.tensor("attn_norm"), mix
        self.ffn_norm, self.ffn = (w.tensor(ffn_norm) if ffn is not None else None), ffn

    def new_cache(self):
        return self.attn.new_cache()

    def forward(self, x: torch.Tensor, start: int, cache, packing: Packing | None = None) -> torch.Tensor:
        """With ``packing`` (x [1, N, H], uncached): the mixer runs on the padded batch; only the kept rows'
        outputs are returned (the mixer still sees every row as context but computes queries for the
        kept rows only; the feed-forward runs on them only)."""
        normed = rms_norm(x, self.attn_norm, self.eps)
        if packing is None:
            h = x + self.attn(normed, start, cache)
        elif hasattr(self.attn, "forward_packed"):  # per-row work on the real rows only, no padded batch
            h = (x if packing.kept is None else x[:, packing.kept]) + self.attn.forward_packed(normed, packing)
        else:
            mixed = packing.unpad(self.attn(packing.pad(normed), 0, None, rows=packing.rows))
            h = (x if packing.kept is None else x[:, packing.kept]) + mixed
        return h if self.ffn is None else h + self.ffn(rms_norm(h, self.ffn_norm, self.eps))


class PositionWise(nn.Module):
    """A feed-forward layer (MLP, MoE) in a sequence mixer's place (Nemotron-H's FFN-only blocks): it mixes
    nothing, and its cache only counts the tokens it has seen."""

    def __init__(self, ffn: nn.Module):
        super().__init__()
        self.ffn = ffn

    def new_cache(self) -> LengthCache:
        return LengthCache()

    def forward(
        self, x: torch.Tensor, start: int, cache: LengthCache | None, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        if cache is not None:
            cache.advance(x.shape[1])
        return self.ffn(x if rows is None else take_rows(x, rows))

    def forward_packed(self, x: torch.Tensor, packing: Packing) -> torch.Tensor:
        return self.ffn(x if packing.kept is None else x[:, packing.kept])
