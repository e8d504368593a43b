"""Kimi delta attention (KDA), the linear-attention layer of Ling 3.0 (GGUF arch ``bailingmoe3``), as llama.cpp's
bailingmoe3 graph computes it from the tensors our converter writes (convert/families/bailingmoe3.py).

Per token t and head h (state S_h: [d, d], zeros at the start):

    q, k, v = silu(causal_conv_q(attn_q · x)), ... (one short depthwise conv each; their states: the last K-1 inputs)
    q, k    = l2norm(q) / sqrt(d), l2norm(k)
    g       = lower_bound * sigmoid(ssm_a[h] * (ssm_f_a · x + ssm_dt.bias))     one log decay per key channel
    beta    = sigmoid(ssm_beta · x)
    S       = diag(exp(g)) S;   S += k (beta (v - S^T k))^T;   o = S^T q
    out     = attn_output(rms_norm(o) * ssm_norm * sigmoid(ssm_g_a · x))      (norm over each head's d)

It is gated DeltaNet (deltanet.py) with a decay per key channel instead of one per head ("safe gate": the log
decay lies in (lower_bound, 0)). ``ssm_a`` holds exp(A_log), one per head.

Two forms of the recurrence: token by token (deltanet.py's, which takes a decay per key channel too: short
inputs, and the state after every token while a checkpoint is open, for :class:`~mtpq.runtime.cache.RecurrentCache`),
and chunked for long inputs. In a
chunk with start state S0 and cumulative log decays c_t (a vector over key channels; every c_t - c_j with j <= t
is <= 0, so no exponential overflows):

    A_tj  = sum_i k_t,i k_j,i e^(c_t,i - c_j,i)  (j < t)      (I + beta A) U = beta V - beta (k e^c) S0
    out   = (q e^c) S0 + [q_t . (k_j e^(c_t - c_j)), j <= t] U
    S_end = e^(c_end) S0 + sum_j (k_j e^(c_end - c_j)) u_j^T
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import InputError
from .cache import RecurrentCache
from .deltanet import RecurrentMixer, causal_conv, conv_window, delta_rule_through_cache, l2norm
from .layers import rms_norm, take_rows
from .weights import FusedLinear, Scope, as_dtype

CHUNK = 16  # tokens per chunk of the chunked form (its pairwise decays are [chunk, chunk, d] per head)


@dataclass(frozen=True)
class KDAConfig:
    n_heads: int  # attention.head_count
    head_dim: int  # kda.head_dim (keys and values alike)
    conv_kernel: int  # ssm.conv_kernel
    eps: float  # of the l2 norms and the output RMSNorm (the file's rms epsilon)
    gate_lower_bound: float  # kda.gate_lower_bound (< 0)


def chunked_kda(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The same recurrence, ``chunk`` tokens at a time (the module docstring's form). -> (out, final state)."""
    B, H, T, d = k.shape
    pad = (-T) % chunk
    if pad:  # padded tokens: k = 0 and g = 0 leave the state alone
        q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    n = (T + pad) // chunk
    q, k, v, g = (t.reshape(B, H, n, chunk, -1) for t in (q, k, v, g))
    beta = beta.reshape(B, H, n, chunk, 1)
    c = g.cumsum(dim=3)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)[..., None]  # j > t
    S = state
    out = torch.empty_like(v)
    for i in range(n):
        qi, ki, vi, bi, ci = q[:, :, i], k[:, :, i], v[:, :, i], beta[:, :, i], c[:, :, i]
        decay = (ci[:, :, :, None] - ci[:, :, None]).masked_fill_(upper, float("-inf")).exp_()  # [B, H, t, j, d]
        k_seen = decay.mul_(ki[:, :, None])  # k_j e^(c_t - c_j), zero for j > t
        a = torch.einsum("bhtd,bhtjd->bhtj", ki, k_seen)
        scores = torch.einsum("bhtd,bhtjd->bhtj", qi, k_seen)
        e_c = ci.exp()
        rhs = vi if S is None else vi - (ki * e_c) @ S
        u = torch.linalg.solve_triangular(bi * a, bi * rhs, upper=False, unitriangular=True)
        out[:, :, i] = scores @ u if S is None else (qi * e_c) @ S + scores @ u
        to_end = (ki * (ci[:, :, -1:] - ci).exp()).transpose(-1, -2) @ u
        S = to_end if S is None else S * e_c[:, :, -1, :, None] + to_end
    return out.reshape(B, H, n * chunk, -1)[:, :, :T], S


class KimiDeltaAttention(RecurrentMixer):
    """A sequence-mixing layer with the layers.py signature ``layer(x, start, cache, rows=None)``; ``cache`` is a
    :class:`RecurrentCache` holding ``{"conv": [B, K-1, 3 H d] (q | k | v inputs), "ssm": [B, H, d, d]}``."""

    def __init__(self, w: Scope, cfg: KDAConfig):
        super().__init__()
        self.cfg = cfg
        C, K = cfg.n_heads * cfg.head_dim, cfg.conv_kernel
        self.wq, self.wk, self.wv = w.linear("attn_q"), w.linear("attn_k"), w.linear("attn_v")
        self.qkv = FusedLinear(self.wq, self.wk, self.wv)
        self.w_decay, self.w_beta, self.w_gate = w.linear("ssm_f_a"), w.linear("ssm_beta"), w.linear("ssm_g_a")
        self.a = w.tensor("ssm_a", torch.float32).reshape(-1)  # exp(A_log), per head
        self.dt_bias = w.tensor("ssm_dt.bias", torch.float32)
        self.norm = w.tensor("ssm_norm")  # [d], shared by the heads
        self.wo = w.linear("attn_output")
        convs = [w.tensor(f"ssm_conv1d_{x}") for x in "qkv"]  # [1, C, 1, K] each
        if any(t.numel() != C * K for t in convs) or self.a.numel() != cfg.n_heads:
            raise InputError(
                w.file.path,
                f"{w.prefix}ssm_conv1d_* / ssm_a do not fit the kda metadata "
                f"({cfg.n_heads} heads of {cfg.head_dim}, kernel {K})",
            )
        self.taps = torch.cat([t.reshape(C, K) for t in convs]).t().contiguous()  # [K, 3C]: tap i, every channel

    def forward(
        self, x: torch.Tensor, start: int, cache: RecurrentCache | None, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = x.shape
        H, d, K = cfg.n_heads, cfg.head_dim, cfg.conv_kernel
        mixed = torch.cat(self.qkv(x), dim=-1)  # [B, T, 3C]
        window = conv_window(cache, mixed, K)
        q, k, v = causal_conv(window, as_dtype(self.taps, mixed.dtype)).float().view(B, T, 3, H, d).unbind(2)
        q = (l2norm(q, cfg.eps) * d**-0.5).transpose(1, 2)
        k, v = l2norm(k, cfg.eps).transpose(1, 2), v.transpose(1, 2)
        decay_in = (self.w_decay(x).float() + self.dt_bias).view(B, T, H, d) * self.a[:, None]
        g = (cfg.gate_lower_bound * torch.sigmoid(decay_in)).transpose(1, 2)  # [B, H, T, d]
        beta = torch.sigmoid(self.w_beta(x).float()).transpose(1, 2)  # [B, H, T]
        out = delta_rule_through_cache(q, k, v, g, beta, cache, window, K, chunked_kda).transpose(1, 2)  # [B, T, H, d]
        if rows is not None:  # outputs for those rows only (the recurrence saw every row)
            x, out, T = take_rows(x, rows), take_rows(out, rows), rows.shape[1]
        gate = torch.sigmoid(self.w_gate(x).view(B, T, H, d))
        out = rms_norm(out.to(x.dtype), self.norm, cfg.eps) * gate
        return self.wo(out.reshape(B, T, H * d))
