"""Mamba-2 (the selective state-space mixer of Nemotron-H), as llama.cpp's ``build_mamba2_layer`` and
ggml's ``ssm_conv`` / ``ssm_scan`` compute it, from the tensors of a GGUF (``ssm_in``, ``ssm_conv1d``,
``ssm_dt.bias``, ``ssm_a``, ``ssm_d``, ``ssm_norm``, ``ssm_out``).

Per token t, head h (head size P, state size N, the heads split into G groups; head h reads group
h // (n_heads / G), ggml's repeat_interleave):

    z, xBC, dt = split(ssm_in · x)                       d_inner, d_inner + 2 G N, n_heads
    x, B, C    = split(silu(causal_conv(xBC) + conv bias))    x: n_heads x P; B, C: G x N
    dt         = softplus(dt + ssm_dt.bias)
    S_h        = exp(dt_h A_h) S_h + (dt_h x_h) B_g^T     S_h: [P, N], zeros at the start; A = ssm_a = -exp(A_log)
    y_h        = S_h C_g + D_h x_h
    out        = ssm_out(rms_norm_per_group(y * silu(z)) * ssm_norm)   the norm over each group's d_inner / G

Two forms of the same recurrence, as for the gated DeltaNet (``deltanet.py``): the token-by-token one, which
also yields the state after every token (what :class:`~mtpq.runtime.cache.RecurrentCache` records under an open
checkpoint), and the chunked one (the state-space duality: per chunk a masked ``C B^T`` times the inputs plus
the carried state) for prefill and uncached passes. The recurrence runs in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import InputError
from .cache import RecurrentCache
from .deltanet import RECURRENT_MAX_T, RecurrentMixer, causal_conv, masked_exp
from .layers import autograd_records, rms_norm, take_rows
from .weights import Scope, as_dtype

CHUNK = 64  # tokens per chunk of the chunked form


@dataclass(frozen=True)
class Mamba2Config:
    n_heads: int  # ssm.time_step_rank
    head_dim: int  # ssm.inner_size / n_heads
    d_state: int  # ssm.state_size
    n_groups: int  # ssm.group_count: of B and C, and of the gated RMSNorm
    conv_kernel: int  # ssm.conv_kernel
    eps: float  # of the gated RMSNorm

    @property
    def d_inner(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.d_state


def recurrent_scan(x, log_decay, B, C, state, keep_all: bool = False):
    """x [B, H, T, P] (already times dt), log_decay [B, H, T] (dt * A), B, C [B, H, T, N], state [B, H, P, N] or
    None. -> (y [B, H, T, P] without the D skip, final state, the state after each token if ``keep_all``)."""
    b, h, T, p = x.shape
    S = state if state is not None else x.new_zeros(b, h, p, B.shape[-1])
    y = torch.empty_like(x)
    states = [] if keep_all else None
    decay = log_decay.exp()
    for t in range(T):
        S = S * decay[:, :, t, None, None] + x[:, :, t, :, None] * B[:, :, t, None, :]
        y[:, :, t] = torch.einsum("bhpn,bhn->bhp", S, C[:, :, t])
        if keep_all:
            states.append(S)
    return y, S, states


def chunked_scan(x, log_decay, B, C, state, chunk: int = CHUNK, final: bool = True):
    """:func:`recurrent_scan`, ``chunk`` tokens at a time -> (y, final state or None without ``final``).

    Inside a chunk with cumulative log decay c_t and start state S0:
    y_t = e^(c_t) S0 C_t + sum_{s <= t} e^(c_t - c_s) (C_t . B_s) x_s, and
    S_end = e^(c_end) S0 + sum_s e^(c_end - c_s) x_s B_s^T."""
    b, h, T, p = x.shape
    pad = (-T) % chunk
    if pad:  # padded tokens: x = 0 and a zero log decay leave the state alone
        x, B, C = (F.pad(t, (0, 0, 0, pad)) for t in (x, B, C))
        log_decay = F.pad(log_decay, (0, pad))
    n = (T + pad) // chunk
    x, B, C = (t.reshape(b, h, n, chunk, -1) for t in (x, B, C))
    c = log_decay.reshape(b, h, n, chunk).cumsum(dim=-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    scores = (C @ B.transpose(-1, -2)).mul_(masked_exp(c[..., :, None] - c[..., None, :], causal))
    y = scores @ x  # [b, h, n, chunk, P]: the chunk's own inputs
    del scores
    C_decayed = C * masked_exp(c.clone())[..., None]
    x_to_end = x * masked_exp(c[..., -1:] - c)[..., None]
    chunk_decay = masked_exp(c[..., -1].clone())[..., None, None]
    S = state  # None: zeros, whose products are skipped
    for i in range(n):
        if S is not None:
            y[:, :, i] += C_decayed[:, :, i] @ S.transpose(-1, -2)
        if i + 1 < n or final:
            to_end = x_to_end[:, :, i].transpose(-1, -2) @ B[:, :, i]
            S = to_end if S is None else S * chunk_decay[:, :, i] + to_end
    return y.reshape(b, h, n * chunk, p)[:, :, :T], S if final else None


class Mamba2(RecurrentMixer):
    """A sequence-mixing layer with the layers.py signature ``layer(x, start, cache, rows=None)``; ``cache`` is a
    :class:`RecurrentCache` holding ``{"conv": [B, K-1, C], "ssm": [B, n_heads, P, N]}``."""

    def __init__(self, w: Scope, cfg: Mamba2Config):
        super().__init__()
        self.cfg = cfg
        self.w_in, self.w_out = w.linear("ssm_in"), w.linear("ssm_out")
        self.conv = w.tensor("ssm_conv1d")  # [C, K]
        self.taps = self.conv.t().contiguous()  # [K, C]
        self.conv_bias = w.optional("ssm_conv1d.bias")
        self.dt_bias = w.tensor("ssm_dt.bias", torch.float32)
        self.a = w.tensor("ssm_a", torch.float32).reshape(-1)  # -exp(A_log), per head
        self.d = w.tensor("ssm_d", torch.float32).reshape(-1)
        self.norm = w.tensor("ssm_norm")  # [G, d_inner / G]: one row of weights per group the norm runs over
        self.group_of_head = torch.arange(cfg.n_heads, device=self.a.device) // (cfg.n_heads // cfg.n_groups)
        want = (cfg.conv_channels, cfg.conv_kernel)
        in_rows = cfg.d_inner + cfg.conv_channels + cfg.n_heads
        if (
            tuple(self.conv.shape) != want
            or self.w_in.out_features != in_rows
            or self.a.numel() != cfg.n_heads
            or tuple(self.norm.shape) != (cfg.n_groups, cfg.d_inner // cfg.n_groups)
        ):
            raise InputError(
                w.file.path,
                f"{w.name('ssm_in')} / ssm_conv1d / ssm_a / ssm_norm do not fit the ssm "
                f"metadata (conv {tuple(self.conv.shape)}, expected {want}; ssm_in "
                f"{self.w_in.out_features} rows, expected {in_rows}; ssm_norm "
                f"{tuple(self.norm.shape)})",
            )

    def forward(
        self, x: torch.Tensor, start: int, cache: RecurrentCache | None, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        cfg = self.cfg
        Bsz, T, _ = x.shape
        K, H, P, G, N = cfg.conv_kernel, cfg.n_heads, cfg.head_dim, cfg.n_groups, cfg.d_state
        state = cache.state if cache is not None else None
        z, xbc, dt = self.w_in(x).split((cfg.d_inner, cfg.conv_channels, H), dim=-1)
        prev = state["conv"].to(xbc.dtype) if state is not None else xbc.new_zeros(Bsz, K - 1, xbc.shape[-1])
        window = torch.cat((prev, xbc), dim=1)  # [B, K-1+T, C]
        bias = None if self.conv_bias is None else as_dtype(self.conv_bias, xbc.dtype)
        xbc = causal_conv(window, as_dtype(self.taps, xbc.dtype), bias).float()

        xs, Bg, Cg = xbc.split((cfg.d_inner, G * N, G * N), dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias).transpose(1, 2)  # [B, H, T]
        xs = xs.view(Bsz, T, H, P).transpose(1, 2)  # [B, H, T, P]
        Bh, Ch = (t.view(Bsz, T, G, N).transpose(1, 2)[:, self.group_of_head] for t in (Bg, Cg))
        ssm = state["ssm"] if state is not None else None
        recording = cache is not None and cache.recording
        # (the chunked form writes into its buffers, which autograd cannot follow)
        if recording or T <= RECURRENT_MAX_T or autograd_records(xs, Bh):
            y, final, per_token = recurrent_scan(
                xs * dt[..., None], dt * self.a[:, None], Bh, Ch, ssm, keep_all=recording
            )
        else:
            (y, final), per_token = (
                chunked_scan(xs * dt[..., None], dt * self.a[:, None], Bh, Ch, ssm, final=cache is not None),
                None,
            )
        if recording:  # the state after every token: the conv window ends at that token
            after = [{"conv": window[:, t + 1 : t + K].clone(), "ssm": s} for t, s in enumerate(per_token)]
            cache.push(T, after[-1], after)
        elif cache is not None:
            cache.push(T, {"conv": window[:, T:].clone(), "ssm": final})

        y = (y + xs * self.d[:, None, None]).transpose(1, 2)  # [B, T, H, P]
        if rows is not None:  # outputs for those rows only (the recurrence saw every row)
            y, z, T = take_rows(y, rows), take_rows(z, rows), rows.shape[1]
        y = y.reshape(Bsz, T, cfg.d_inner) * F.silu(z.float())
        y = rms_norm(y.view(Bsz, T, self.norm.shape[0], -1), self.norm.float(), cfg.eps).to(x.dtype)
        return self.w_out(y.reshape(Bsz, T, cfg.d_inner))
