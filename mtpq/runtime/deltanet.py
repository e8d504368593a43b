"""Qwen3.5's gated DeltaNet (linear attention), as llama.cpp's qwen35 graph and transformers'
``Qwen3_5GatedDeltaNet`` compute it, from the tensors our converter writes (convert/families/qwen35.py).

Per token t and value head h (state S_h: [d_k, d_v], zeros at the start):

    q, k, v  = split(silu(causal_conv(attn_qkv · x)))    q, k: n_k heads, v: n_v heads
    q, k     = l2norm(q) / sqrt(d_k), l2norm(k)          value head h reads key head h % n_k
    decay    = exp(ssm_a * softplus(ssm_alpha · x + ssm_dt.bias))      (ssm_a = -exp(A_log))
    beta     = sigmoid(ssm_beta · x)
    S        = decay * S;   S += k (beta (v - S^T k))^T;   o = S^T q
    out      = ssm_out(rms_norm(o) * ssm_norm * silu(attn_gate · x))  (norm over each head's d_v)

"h % n_k": the converter reorders value heads from HF's grouped order (head k*r + j reads key
head k) to ggml's tiled order (head j*n_k + k reads key head k), so the key heads are tiled, not
interleaved, across the value heads. The conv is depthwise over the qkv channels with kernel K
(``ssm_conv1d`` [C, K]); its state is the last K-1 inputs.

Qwen3-Next (llama.cpp's qwen3next graph) differs in two details of layout, both from keeping HF's grouped
order (``DeltaNetConfig.grouped_heads``): value head h reads key head h // r (r = n_v / n_k), and beta and
alpha come from one fused ``ssm_ba`` [n_k * 2r, hidden] whose rows are, per key head, r betas then r alphas.

Two forms of the same recurrence: the chunked one (the UT-transform form of transformers'
``torch_chunk_gated_delta_rule``; a few matmuls per chunk of tokens) for prefill and uncached passes,
and the token-by-token one for short inputs, which also yields the state after every token --
what :class:`~mtpq.runtime.cache.RecurrentCache` needs under an open checkpoint, so that rolling
back to "a of k verified tokens" is exactly the state of having decoded those a tokens.
The recurrence runs in float32 whatever the compute dtype (as transformers does).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InputError
from .cache import RecurrentCache
from .layers import autograd_records, rms_norm, take_rows
from .weights import Scope, as_dtype

# tokens per chunk of the chunked form: smaller chunks shrink its batched triangular solves, its costliest op, until
# the per-chunk overhead wins (docs/notes/runtime.md, "Constants and the figures behind them")
CHUNK = 32
RECURRENT_MAX_T = 16  # up to this many tokens the token-by-token form is cheaper


@dataclass(frozen=True)
class DeltaNetConfig:
    n_k_heads: int  # ssm.group_count
    n_v_heads: int  # ssm.time_step_rank
    head_k_dim: int  # ssm.state_size
    head_v_dim: int  # ssm.inner_size / n_v_heads
    conv_kernel: int  # ssm.conv_kernel
    eps: float  # of the gated RMSNorm
    grouped_heads: bool = False  # value head h reads key head h // (n_v / n_k) (Qwen3-Next), else h % n_k

    @property
    def conv_channels(self) -> int:
        return 2 * self.n_k_heads * self.head_k_dim + self.n_v_heads * self.head_v_dim


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def tile_key_heads(x: torch.Tensor, n_v_heads: int) -> torch.Tensor:
    """[B, n_k, T, d] -> [B, n_v, T, d] where value head h reads key head h % n_k (the converter's tiled order)."""
    return x.repeat(1, n_v_heads // x.shape[1], 1, 1)


def group_key_heads(x: torch.Tensor, n_v_heads: int) -> torch.Tensor:
    """[B, n_k, T, d] -> [B, n_v, T, d] where value head h reads key head h // (n_v / n_k) (HF's grouped order)."""
    return x.repeat_interleave(n_v_heads // x.shape[1], dim=1)


def recurrent_gated_delta_rule(q, k, v, g, beta, state, keep_all: bool = False):
    """q, k [B, H, T, d_k], v [B, H, T, d_v], g (log decay) [B, H, T] or, one per key channel (KDA: kda.py),
    [B, H, T, d_k], beta [B, H, T], state [B, H, d_k, d_v] or None.

    -> (out [B, H, T, d_v], final state, the state after each token if ``keep_all`` else None)."""
    B, H, T, dk = k.shape
    S = state if state is not None else q.new_zeros(B, H, dk, v.shape[-1])
    out = torch.empty_like(v)
    states = [] if keep_all else None
    per_channel = g.dim() == 4
    for t in range(T):
        decay = g[:, :, t].exp()
        S = S * (decay[..., None] if per_channel else decay[..., None, None])
        delta = (v[:, :, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, :, t])) * beta[:, :, t, None]
        S = S + k[:, :, t, :, None] * delta[:, :, None, :]
        out[:, :, t] = torch.einsum("bhkv,bhk->bhv", S, q[:, :, t])
        if keep_all:
            states.append(S)
    return out, S, states


DECAY_FLOOR = -60.0  # log decays below this are taken as 0 (e^-60 ~ 1e-26: far below float32's resolution)


def masked_exp(log_decay: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """exp(log_decay) where ``keep`` (everywhere without it), exactly 0 elsewhere and where it vanishes.

    exp leaves its fast path when the result under- or overflows (~30x slower per element on this CPU):
    the demo's chunk log decays reach -6000, and the entries outside ``keep`` (j > t) are large and
    positive. Those are replaced by the floor before exp, and the results zeroed after it. ``log_decay``
    is overwritten (pass a temporary): no new [.., chunk, chunk] tensors per pass over it."""
    live = log_decay > DECAY_FLOOR
    if keep is not None:
        live &= keep
    dead = live.logical_not_()
    return log_decay.masked_fill_(dead, DECAY_FLOOR).exp_().masked_fill_(dead, 0.0)


def chunked_gated_delta_rule(q, k, v, g, beta, state, chunk: int = CHUNK, final: bool = True):
    """The same recurrence, ``chunk`` tokens at a time. -> (out [B, H, T, d_v], final state, or None
    without ``final``: an uncached pass needs no state after its last chunk).

    Inside a chunk with cumulative log decay c_t and start state S0, the updates u_t = beta_t (v_t - ...)
    solve the unit lower-triangular system (I + L) U = beta V - beta e^c K S0 with
    L_tj = beta_t e^(c_t - c_j) k_t.k_j (j < t); then out = e^c Q S0 + (QK^T * e^(c_t - c_j), j <= t) U
    and S_end = e^(c_end) S0 + sum_j e^(c_end - c_j) k_j u_j^T.
    """
    B, H, T, dk = k.shape
    dv = v.shape[-1]
    pad = (-T) % chunk
    if pad:  # padded tokens: k = 0 and g = 0 leave the state alone
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (T + pad) // chunk
    q, k, v = (t.reshape(B, H, n, chunk, -1) for t in (q, k, v))
    g, beta = g.reshape(B, H, n, chunk), beta.reshape(B, H, n, chunk)
    c = g.cumsum(dim=-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = masked_exp(c[..., :, None] - c[..., None, :], causal)  # e^(c_t - c_j), j <= t; 0 above the diagonal
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)).mul_(decay)  # its diagonal is ignored: unitriangular
    # one solve for both right-hand sides (U = u_from_v - u_from_s S0), posed transposed (U^T system^T = rhs^T,
    # left=False): the direct form first copies the right-hand sides to column-major; both give the same U to
    # rounding (docs/notes/runtime.md)
    e_c = masked_exp(c.clone())
    rhs = q.new_empty(B, H, n, chunk, dv + dk)  # the products written in place: no temporaries, no cat
    torch.mul(v, beta[..., None], out=rhs[..., :dv])
    torch.mul(k_beta, e_c[..., None], out=rhs[..., dv:])
    both = torch.linalg.solve_triangular(system.mT, rhs.mT, upper=True, left=False, unitriangular=True).mT
    u_from_v, u_from_s = both.split((dv, dk), dim=-1)
    attn = (q @ k.transpose(-1, -2)).mul_(decay)
    # freed before the loop's temporaries: a lower peak of memory, i.e. fewer first-touch page faults on the
    # first long pass
    del decay, k_beta, system, rhs
    q_decayed = q * e_c[..., None]
    k_to_end = k * masked_exp(c[..., -1:] - c)[..., None]
    chunk_decay = e_c[..., -1, None, None]
    S = state  # None: zeros, whose products are skipped (x @ 0 = 0 and 0 + y = y: the same values)
    out = torch.empty(B, H, n, chunk, dv, dtype=q.dtype, device=q.device)
    for i in range(n):
        if S is None:
            u = u_from_v[:, :, i]
            torch.matmul(attn[:, :, i], u, out=out[:, :, i])
        else:
            u = u_from_v[:, :, i] - u_from_s[:, :, i] @ S
            out[:, :, i] = q_decayed[:, :, i] @ S + attn[:, :, i] @ u
        if i + 1 < n or final:
            to_end = k_to_end[:, :, i].transpose(-1, -2) @ u
            S = to_end if S is None else S * chunk_decay[:, :, i] + to_end
    return out.reshape(B, H, n * chunk, dv)[:, :, :T], S if final else None


def causal_conv(window: torch.Tensor, taps: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu of the depthwise causal conv (plus ``bias`` [C], Mamba-2's): window [B, K-1+T, C] (K-1 rows of
    history, then the inputs), taps [K, C] -> [B, T, C].

    K shifted slices times contiguous taps: the same products and sums as (unfold * kernel).sum(-1),
    bit for bit, in ~half the time (both of those operands are strided); accumulated in place (fewer
    fresh multi-megabyte temporaries on long inputs)."""
    T = window.shape[1] - taps.shape[0] + 1
    acc = window[:, :T] * taps[0]
    for i in range(1, taps.shape[0]):
        acc += window[:, i : i + T] * taps[i]
    if bias is not None:
        acc += bias
    return F.silu(acc, inplace=not autograd_records(acc))


def conv_window(cache: RecurrentCache | None, mixed: torch.Tensor, conv_kernel: int) -> torch.Tensor:
    """The short conv's input [B, K-1+T, C]: the cache's last K-1 inputs (zeros at the start), then ``mixed``."""
    state = cache.state if cache is not None else None
    B, _, C = mixed.shape
    prev = state["conv"].to(mixed.dtype) if state is not None else mixed.new_zeros(B, conv_kernel - 1, C)
    return torch.cat((prev, mixed), dim=1)


def delta_rule_through_cache(
    q, k, v, g, beta, cache: RecurrentCache | None, window: torch.Tensor | None, conv_kernel: int, chunked
) -> torch.Tensor:
    """The gated delta rule over T new tokens (:func:`recurrent_gated_delta_rule`'s arguments; the start state is
    the cache's) -> out [B, H, T, d_v], and the cache (if any) advanced: its state becomes the last K-1 rows of the
    conv ``window`` [B, K-1+T, C] (history, then the new inputs) and the final recurrent state; under an open
    checkpoint, with the state after every token. The token-by-token form runs for short inputs and under a
    checkpoint, ``chunked(q, k, v, g, beta, state) -> (out, final state)`` otherwise."""
    T, K = q.shape[2], conv_kernel
    ssm = cache.state["ssm"] if cache is not None and cache.state is not None else None
    recording = cache is not None and cache.recording
    # (the chunked form writes into its buffers, which autograd cannot follow)
    if recording or T <= RECURRENT_MAX_T or autograd_records(q, k, v, g, beta):
        out, final, per_token = recurrent_gated_delta_rule(q, k, v, g, beta, ssm, keep_all=recording)
    else:
        (out, final), per_token = chunked(q, k, v, g, beta, ssm), None
    if recording:  # the state after every token: the conv window ends at that token
        after = [{"conv": window[:, t + 1 : t + K].clone(), "ssm": s} for t, s in enumerate(per_token)]
        cache.push(T, after[-1], after)
    elif cache is not None:
        cache.push(T, {"conv": window[:, T:].clone(), "ssm": final})
    return out


class RecurrentMixer(nn.Module):
    """A sequence-mixing layer whose cache is a :class:`RecurrentCache`: a short-conv window and a fixed-size state
    (DeltaNet's, Kimi's delta attention's, Mamba-2's), not keys and values."""

    def new_cache(self) -> RecurrentCache:
        return RecurrentCache()


class GatedDeltaNet(RecurrentMixer):
    """A sequence-mixing layer with the layers.py signature ``layer(x, start, cache)``; ``cache`` is a
    :class:`RecurrentCache` holding ``{"conv": [B, K-1, C], "ssm": [B, n_v, d_k, d_v]}``."""

    def __init__(self, w: Scope, cfg: DeltaNetConfig):
        super().__init__()
        self.cfg = cfg
        self.wqkv, self.wz = w.linear("attn_qkv"), w.linear("attn_gate")
        # beta and alpha: two projections, or Qwen3-Next's fused one (per key head: r betas, r alphas)
        self.wba = w.linear("ssm_ba") if w.has("ssm_ba") else None
        self.wbeta, self.walpha = (
            (None, None) if self.wba is not None else (w.linear("ssm_beta"), w.linear("ssm_alpha"))
        )
        self.a = w.tensor("ssm_a", torch.float32)  # -exp(A_log), per value head
        self.dt_bias = w.tensor("ssm_dt.bias", torch.float32)
        self.conv = w.tensor("ssm_conv1d")  # [C, K]
        self.taps = self.conv.t().contiguous()  # [K, C]: tap i over every channel, contiguous
        self.norm = w.tensor("ssm_norm")  # [d_v], shared by the heads
        self.wo = w.linear("ssm_out")
        want = (cfg.conv_channels, cfg.conv_kernel)
        if tuple(self.conv.shape) != want or self.wqkv.out_features != cfg.conv_channels:
            raise InputError(
                w.file.path,
                f"{w.name('ssm_conv1d')} / attn_qkv do not fit the ssm metadata "
                f"(conv {tuple(self.conv.shape)}, expected {want})",
            )

    def beta_alpha(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The projections behind beta and the decay, [B, T, n_v] each, value heads in the layer's order."""
        if self.wba is None:
            return self.wbeta(x), self.walpha(x)
        B, T, _ = x.shape
        b, a = self.wba(x).view(B, T, self.cfg.n_k_heads, -1).chunk(2, dim=-1)
        return b.reshape(B, T, -1), a.reshape(B, T, -1)

    def forward(
        self, x: torch.Tensor, start: int, cache: RecurrentCache | None, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = x.shape
        K = cfg.conv_kernel
        mixed = self.wqkv(x)  # [B, T, C]
        window = conv_window(cache, mixed, K)  # [B, K-1+T, C]
        qkv = causal_conv(window, as_dtype(self.taps, mixed.dtype))  # [B, T, C]
        if cache is None:  # the window is no state to keep: freed before the recurrence's temporaries (a lower peak
            mixed = window = None  # of memory: fewer first-touch page faults on a long uncached pass)

        nk, nv, dk, dv = cfg.n_k_heads, cfg.n_v_heads, cfg.head_k_dim, cfg.head_v_dim
        q, k, v = qkv.float().split((nk * dk, nk * dk, nv * dv), dim=-1)
        q = (l2norm(q.view(B, T, nk, dk)) * dk**-0.5).transpose(1, 2)
        k = l2norm(k.view(B, T, nk, dk)).transpose(1, 2)
        expand = group_key_heads if cfg.grouped_heads else tile_key_heads
        q, k = expand(q, nv), expand(k, nv)
        v = v.view(B, T, nv, dv).transpose(1, 2)
        b, a = self.beta_alpha(x)
        g = (self.a * F.softplus(a.float() + self.dt_bias)).transpose(1, 2)  # [B, nv, T]
        beta = torch.sigmoid(b.float()).transpose(1, 2)
        chunked = functools.partial(chunked_gated_delta_rule, final=cache is not None)
        out = delta_rule_through_cache(q, k, v, g, beta, cache, window, K, chunked)
        out = out.transpose(1, 2)  # [B, T, nv, dv]
        if rows is not None:  # outputs for those rows only (the recurrence saw every row)
            x, out, T = take_rows(x, rows), take_rows(out, rows), rows.shape[1]
        z = self.wz(x).view(B, T, nv, dv)
        out = out.to(x.dtype)
        out = rms_norm(out, self.norm, cfg.eps) * F.silu(z.float()).to(x.dtype)
        return self.wo(out.reshape(B, T, nv * dv))
