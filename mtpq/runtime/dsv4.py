"""DeepSeek-V4's layers, as llama.cpp's deepseek4 graph computes them (src/models/deepseek4.cpp): hyper-connections
and compressed sparse attention.

**Hyper-connections (mHC).** The residual stream is ``hc`` streams of the hidden size (a block's input and output
are [.., hc * hidden], stream s at [s * hidden, (s + 1) * hidden); the trunk starts with the embedding in every
stream). Around each of a block's attention and FFN, ``hc_{attn,ffn}_{fn,base,scale}`` mix them
(:class:`HyperMix`): from mixes = fn · rms_norm(streams) (no weight),

    pre  = sigmoid(mixes[:hc] * scale[0] + base[:hc]) + hc_eps        the layer's input: sum_s pre_s * stream_s
    post = 2 sigmoid(mixes[hc:2hc] * scale[1] + base[hc:2hc])         where the layer's output goes
    comb = sinkhorn(mixes[2hc:] * scale[2] + base[2hc:])               [src, dst]: how the streams carry over
    stream'_d = post_d * out + sum_s comb[s, d] * stream_s

(Sinkhorn: a softmax over dst, + hc_eps, then columns and rows normalised in turn, ``sinkhorn_iterations`` passes.)
Before the final norm :class:`HyperHead` (``output_hc_*``; the MTP head's own in its file) folds the streams into
one with ``pre`` alone. The MTP head is fed the trunk's streams as they leave the last block (hc * hidden wide).

**Attention** (:class:`CompressedAttention`): multi-query attention with a low-rank query (``attn_q_a`` ->
``attn_q_a_norm`` -> ``attn_q_b``, each head then RMS-normed without weight), one shared key that is also the value
(``attn_kv`` -> ``attn_kv_a_norm``), RoPE on the last ``rope.dimension_count`` dims of each head (adjacent pairs),
per-head sinks, a sliding window over the raw keys, the output de-rotated (RoPE at minus the query's position), then
a grouped low-rank output (``attn_output_a`` per group of heads, ``attn_output_b``). Per ``compress_ratios[i]``:

- 0: the window only (the MTP block too);
- 128 (HCA): every complete block of 128 tokens is compressed into one more key: per dimension a softmax over the
  block's tokens of ``attn_compressor_gate`` · x + ``attn_compressor_ape[pos % 128]`` weighs
  ``attn_compressor_kv`` · x; RMS-normed (``attn_compressor_norm``) and rotated at the block's first position;
- 4 (CSA): blocks of 4 over overlapping windows (the compressor is twice as wide: the previous block's tokens give
  the first half, the block's own the second, softmax over the 8), and the lightning indexer picks ``top_k`` of
  them per query: its own compressor gives one key per block (``indexer_compressor_*``), its queries come from the
  query latent (``indexer.attn_q_b``), scores are sum_h relu(q_h . k) * w_h with w = ``indexer.proj`` · x /
  sqrt(D * H), q and k rotated by a Walsh-Hadamard matrix; ties at the k-th score broken as ggml's CPU top-k.

A query at position p sees compressed block b once it is complete (b < (p + 1) / ratio); layers with a compressor
rotate with ``attention.compress_rope_freq_base`` and YaRN (whose cos/sin factor llama.cpp cancels), the others with
``rope.freq_base`` and no scaling. Raw and compressed keys share one softmax with the sink.

The cache (a :class:`~mtpq.runtime.cache.KVCache`) holds per token what the keys are made from: the rotated raw key
and the compressors' kv and score rows. Compressed keys are recomputed from them on each forward, so rolling back
stays a trim and a block completes exactly where llama.cpp's does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from . import weights as weight_io
from .cache import KVCache
from .dsa import hadamard, top_k_allowed
from .layers import MoE, MoEConfig, Rope, rms_norm
from .weights import Scope, as_dtype, vec_dot_input


def rope_tail(rope: Rope, x: torch.Tensor, pos) -> torch.Tensor:
    """RoPE on the last ``rope.dim`` dims of x [B, H, T, D] (ggml_rope_set_offset(n_nope))."""
    d = rope.dim
    return torch.cat((x[..., :-d], rope.apply(x[..., -d:], pos)), dim=-1)


def inverse(rope: Rope) -> Rope:
    """The rotation by minus the angle, as ggml_rope_ext_back computes it (the same cos/sin factor)."""
    return Rope(-rope.inv_freq, neox=rope.neox, mscale=rope.mscale)


def yarn_cancelled_mscale(factor: float) -> float:
    """The cos/sin factor of llama.cpp's deepseek4 YaRN: its attn_factor 1 / (1 + 0.1 ln(1/freq_scale)) times the
    1 + 0.1 ln(1/freq_scale) ggml's rope_yarn multiplies in, in float32 (1 up to rounding)."""
    f32 = np.float32
    fs = f32(1.0) / f32(factor)
    m = f32(1.0) + f32(0.1) * np.log(f32(1.0) / fs, dtype=np.float32)
    return float((f32(1.0) / m) * m)


# ----------------------------------------------------------------------------- hyper-connections


@dataclass(frozen=True)
class HcConfig:
    n: int  # streams (hyper_connection.count)
    hidden: int
    iters: int  # sinkhorn iterations
    eps: float  # hyper_connection.epsilon
    norm_eps: float  # the streams' RMSNorm (the model's)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """comb [.., src, dst] as llama.cpp's build_hc_sinkhorn: softmax over dst, + eps, columns normalised, then
    rows and columns in turn."""
    comb = torch.softmax(comb, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(1, iters):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def _mixes(x: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    return F.linear(F.rms_norm(x.float(), (x.shape[-1],), None, eps), fn)


def _fold(x: torch.Tensor, pre: torch.Tensor, cfg: HcConfig) -> torch.Tensor:
    """sum_s pre_s * stream_s: x [.., n * hidden], pre [.., n] -> [.., hidden] (streams added in order)."""
    xs = x.unflatten(-1, (cfg.n, cfg.hidden))
    out = xs[..., 0, :] * pre[..., 0:1]
    for s in range(1, cfg.n):
        out = out + xs[..., s, :] * pre[..., s : s + 1]
    return out


class HyperMix(nn.Module):
    """One hyper-connection of a block (``hc_{name}_{fn,base,scale}``): :meth:`pre` before its layer, :meth:`post`
    after it."""

    def __init__(self, w: Scope, name: str, cfg: HcConfig):
        super().__init__()
        self.cfg = cfg
        self.fn_name = w.name(f"hc_{name}_fn")
        self.fn = w.tensor(f"hc_{name}_fn", torch.float32)  # [(2 + n) n, n hidden]
        self.base = w.tensor(f"hc_{name}_base", torch.float32)
        self.scale = w.tensor(f"hc_{name}_scale", torch.float32)  # [3]: pre, post, comb

    def pre(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [.., n * hidden] -> (the layer's input [.., hidden], post [.., n], comb [.., n, n])."""
        n = self.cfg.n
        if weight_io.observer is not None:  # (llama.cpp multiplies the normed streams by fn: imatrix sees it)
            weight_io.observer(self.fn_name, None, F.rms_norm(x.float(), (x.shape[-1],), None, self.cfg.norm_eps))
        mixes = _mixes(x, self.fn, self.cfg.norm_eps)
        pre = torch.sigmoid(mixes[..., :n] * self.scale[0] + self.base[:n]) + self.cfg.eps
        post = torch.sigmoid(mixes[..., n : 2 * n] * self.scale[1] + self.base[n : 2 * n]) * 2.0
        comb = (mixes[..., 2 * n :] * self.scale[2] + self.base[2 * n :]).unflatten(-1, (n, n))
        comb = sinkhorn(comb, self.cfg.iters, self.cfg.eps)
        return as_dtype(_fold(x, pre.to(x.dtype), self.cfg), x.dtype), post.to(x.dtype), comb.to(x.dtype)

    def post(self, out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """The streams after the layer: out [.., hidden], residual [.., n * hidden] -> [.., n * hidden]."""
        rs = residual.unflatten(-1, (self.cfg.n, self.cfg.hidden))
        mixed = out[..., None, :] * post[..., :, None] + torch.einsum("...sd,...sh->...dh", comb, rs)
        return mixed.flatten(-2)


class HyperHead(nn.Module):
    """The streams folded into one before the final norm (``{prefix}_{fn,base,scale}``: ``output_hc``)."""

    def __init__(self, w: Scope, prefix: str, cfg: HcConfig):
        super().__init__()
        self.cfg = cfg
        self.fn = w.tensor(f"{prefix}_fn", torch.float32)  # [n, n hidden]
        self.base = w.tensor(f"{prefix}_base", torch.float32)
        self.scale = w.tensor(f"{prefix}_scale", torch.float32)  # [1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = torch.sigmoid(_mixes(x, self.fn, self.cfg.norm_eps) * self.scale[0] + self.base) + self.cfg.eps
        return _fold(x, pre.to(x.dtype), self.cfg)


# ----------------------------------------------------------------------------- routing


class Tokens:
    """The token ids of the trunk's current pass, for the hash-routed layers (set by the trunk's entry)."""

    ids: torch.Tensor | None = None


class HashMoE(MoE):
    """DeepSeek-V4's MoE: sqrt(softplus) scores (ggml's softplus: x past 20, else log(1 + e^x)); the first
    ``hash_layer_count`` layers take their experts from ``ffn_gate_tid2eid`` [vocab, k] by token id, the others
    by score + ``exp_probs_b``; the chosen scores weigh them (renormalised, the sum clamped at f16's smallest
    normal, as llama.cpp), times ``expert_weights_scale``."""

    def __init__(self, w: Scope, cfg: MoEConfig, tokens: Tokens | None):
        super().__init__(w, cfg)
        self.tokens = tokens
        # llama_cpp_numerics: the router's inputs rounded as llama.cpp rounds them for its stored type (BF16 as
        # released; the base MoE's routers are F32)
        self.router_type = w.file.tensors[w.name("ffn_gate_inp")].tensor_type if w.weights.round_inputs else None
        self.register_buffer("tid2eid", None, persistent=False)
        if w.has("ffn_gate_tid2eid"):
            t = w.file.tensors[w.name("ffn_gate_tid2eid")]
            table = np.array(t.data, copy=True).astype(np.int64).reshape(w.shape("ffn_gate_tid2eid"))
            self.register_buffer("tid2eid", torch.from_numpy(table).to(w.weights.device), persistent=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        if weight_io.observer is not None:
            weight_io.observer(self.router_name, None, x)
        xr = as_dtype(x, torch.float32)
        if self.router_type is not None:
            xr = vec_dot_input(xr, GGMLQuantizationType(self.router_type))
        logits = F.linear(xr, self.router)
        scores = torch.where(logits > 20.0, logits, torch.log(1.0 + torch.exp(logits))).sqrt()
        if self.tid2eid is not None:
            if self.tokens is None or self.tokens.ids is None:
                raise RuntimeError("a hash-routed layer needs the pass's token ids")
            ids = self.tid2eid[self.tokens.ids.reshape(-1).to(self.tid2eid.device)]
        else:
            choice = scores if self.bias is None else scores + self.bias
            ids = choice.topk(cfg.n_used, dim=-1).indices
        weights = scores.gather(1, ids)
        if cfg.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=6.103515625e-5)
        return weights * cfg.scale, ids


# ----------------------------------------------------------------------------- attention


@dataclass(frozen=True)
class V4AttnConfig:
    n_heads: int
    head_dim: int
    o_groups: int
    o_lora: int
    eps: float
    window: int
    ratio: int  # 0, 4 (CSA, with the indexer) or 128 (HCA)
    top_k: int = 0
    idx_heads: int = 0
    idx_dim: int = 0


class Compressor(nn.Module):
    """One compressor's per-token rows (``{prefix}_{kv,gate,ape,norm}``) and the keys it makes of complete blocks."""

    def __init__(self, w: Scope, prefix: str, ratio: int, dim: int, eps: float, rope: Rope):
        super().__init__()
        self.ratio, self.dim, self.eps, self.rope = ratio, dim, eps, rope
        self.overlap = ratio == 4
        self.wkv, self.wgate = w.linear(f"{prefix}_kv", bias=False), w.linear(f"{prefix}_gate", bias=False)
        self.ape = w.tensor(f"{prefix}_ape")  # [ratio, coff * dim]
        self.norm = w.tensor(f"{prefix}_norm")

    def rows(self, x: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, hidden] at positions start.. -> (kv, score) [B, 1, T, coff * dim], as the cache keeps them."""
        pos = torch.arange(start, start + x.shape[1], device=x.device) % self.ratio
        return self.wkv(x)[:, None], (self.wgate(x) + as_dtype(self.ape, x.dtype)[pos])[:, None]

    def keys(self, kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
        """The complete blocks' keys [B, 1, n_blocks, dim] from every cached token's rows."""
        B, _, S, W = kv.shape
        r, d = self.ratio, self.dim
        nb = S // r
        if nb == 0:
            return kv.new_zeros(B, 1, 0, d)
        kv, score = kv[:, 0, : nb * r].view(B, nb, r, W), score[:, 0, : nb * r].view(B, nb, r, W)
        if self.overlap:  # the previous block's tokens (first half; none before block 0) and the block's own
            prev_kv = torch.cat((kv.new_zeros(B, 1, r, d), kv[:, :-1, :, :d]), dim=1)
            prev_sc = torch.cat((score.new_full((B, 1, r, d), float("-inf")), score[:, :-1, :, :d]), dim=1)
            kv, score = torch.cat((prev_kv, kv[..., d:]), dim=2), torch.cat((prev_sc, score[..., d:]), dim=2)
        comp = (kv * torch.softmax(score, dim=2)).sum(dim=2)  # [B, nb, d]
        comp = rms_norm(comp, self.norm, self.eps)
        pos = (torch.arange(nb, device=comp.device) * r)[None]
        return rope_tail(self.rope, comp[:, None], pos)


class CompressedAttention(nn.Module):
    """DeepSeek-V4's attention of one block (see the module docstring). ``rope``: the layer's (the compress rope
    where it has a compressor); ``comp_rope``: the indexer's."""

    def __init__(self, w: Scope, cfg: V4AttnConfig, rope: Rope, comp_rope: Rope):
        super().__init__()
        self.cfg, self.rope, self.rope_back = cfg, rope, inverse(rope)
        self.wq_a, self.q_a_norm = w.linear("attn_q_a", bias=False), w.tensor("attn_q_a_norm")
        self.wq_b = w.linear("attn_q_b", bias=False)
        self.wkv, self.kv_norm = w.linear("attn_kv", bias=False), w.tensor("attn_kv_a_norm")
        self.wo_a, self.wo_b = w.qweight("attn_output_a"), w.linear("attn_output_b", bias=False)
        self.sinks = w.tensor("attn_sinks", torch.float32)
        self.window = cfg.window
        self.compressor = (
            Compressor(w, "attn_compressor", cfg.ratio, cfg.head_dim, cfg.eps, rope) if cfg.ratio else None
        )
        self.indexer = None
        if cfg.ratio == 4:
            self.indexer = Compressor(w, "indexer_compressor", 4, cfg.idx_dim, cfg.eps, comp_rope)
            self.idx_q, self.idx_proj = (
                w.linear("indexer.attn_q_b.weight", bias=False),
                w.linear("indexer.proj.weight", bias=False),
            )
            self.idx_rope = comp_rope
            self.register_buffer("rotation", hadamard(cfg.idx_dim).to(w.weights.device), persistent=False)
            # llama_cpp_numerics: the indexer's keys as llama.cpp's default cache stores them (f16)
            self.key_dtype = torch.float16 if w.weights.round_inputs else None
            self.top_k = cfg.top_k
            self.select = top_k_allowed
            self.activation = torch.relu

    def new_cache(self) -> KVCache:
        return KVCache()  # per token: the raw key, and the compressors' kv / score rows

    def forward(
        self, x: torch.Tensor, start: int, cache: KVCache | None, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = x.shape
        qr = rms_norm(self.wq_a(x), self.q_a_norm, cfg.eps)
        kv = rms_norm(self.wkv(x), self.kv_norm, cfg.eps)[:, None]  # [B, 1, T, d]
        kv = rope_tail(self.rope, kv, start)
        parts = [kv]
        if self.compressor is not None:
            parts += self.compressor.rows(x, start)
        if self.indexer is not None:
            parts += self.indexer.rows(x, start)
        if cache is not None:
            parts = list(cache.update(*parts))
        kv = parts[0]
        S = kv.shape[2]
        if rows is None:
            xq, qrq, q_pos = x, qr, torch.arange(start, start + T, device=x.device)[None]
        else:
            idx = torch.arange(B, device=x.device)[:, None]
            xq, qrq, q_pos = x[idx, rows], qr[idx, rows], start + rows
        Tq = xq.shape[1]
        q = self.wq_b(qrq).view(B, Tq, cfg.n_heads, cfg.head_dim)
        q = (
            F.rms_norm(q, (cfg.head_dim,), None, cfg.eps)
            if q.dtype == torch.float32
            else rms_norm(q, torch.ones((), dtype=q.dtype, device=q.device), cfg.eps)
        )
        q = rope_tail(self.rope, q.transpose(1, 2), q_pos)  # [B, H, Tq, d]

        k_pos = torch.arange(S, device=x.device)
        qp = q_pos[:, :, None]  # [B or 1, Tq, 1]
        allowed = (k_pos <= qp) & (qp - k_pos < self.window)  # [B, Tq, S]
        keys = kv
        if self.compressor is not None:
            comp = self.compressor.keys(parts[1], parts[2])
            nb = comp.shape[2]
            seen = torch.arange(nb, device=x.device) < torch.div(qp + 1, cfg.ratio, rounding_mode="floor")
            if self.indexer is not None and nb:
                scores = self._index_scores(qrq, xq, self.indexer.keys(parts[3], parts[4]), q_pos)
                scores = scores.masked_fill(~seen, float("-inf"))
                seen = seen & self.select(scores, self.top_k)[:, 0]
            keys = torch.cat((kv, comp), dim=2)
            allowed = torch.cat((allowed.expand(B, Tq, S), seen.expand(B, Tq, nb)), dim=-1)
        out = self._attend(q, keys, allowed)  # [B, H, Tq, d]
        out = rope_tail(self.rope_back, out, q_pos).transpose(1, 2)  # [B, Tq, H, d]
        og = cfg.o_groups
        wa = as_dtype(self.wo_a.matrix(), out.dtype).view(og, cfg.o_lora, -1)
        groups = out.reshape(B, Tq, og, -1)
        if weight_io.observer is not None:  # (every group's rows, for the one matrix they are stored in)
            weight_io.observer(self.wo_a.name, None, groups.reshape(-1, groups.shape[-1]))
        oa = torch.einsum("btgi,goi->btgo", self.wo_a.input(groups), wa)
        return self.wo_b(oa.reshape(B, Tq, og * cfg.o_lora))

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """One softmax over the allowed keys [B, 1, S', d] (also the values) and each head's sink."""
        B, H, Tq, _ = q.shape
        scores = torch.matmul(q, keys.transpose(-1, -2)) * (1.0 / math.sqrt(self.cfg.head_dim))
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        sink = self.sinks.to(scores.dtype).view(1, H, 1, 1).expand(B, H, Tq, 1)
        p = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
        return torch.matmul(p, keys)

    def _index_scores(self, qr: torch.Tensor, xq: torch.Tensor, keys: torch.Tensor, q_pos) -> torch.Tensor:
        """The indexer's scores [B, Tq, n_blocks] of the query rows against the compressed indexer keys."""
        cfg = self.cfg
        B, Tq, _ = qr.shape
        rot = as_dtype(self.rotation, qr.dtype)
        q = self.idx_q(qr).view(B, Tq, cfg.idx_heads, cfg.idx_dim).transpose(1, 2)
        q = torch.matmul(rope_tail(self.idx_rope, q, q_pos), rot)
        k = torch.matmul(keys, rot)  # [B, 1, nb, D]
        if self.key_dtype is not None:
            k = k.to(self.key_dtype).to(q.dtype)
        w = (self.idx_proj(xq) * (1.0 / math.sqrt(cfg.idx_dim * cfg.idx_heads))).transpose(1, 2)[..., None]
        return (self.activation(torch.matmul(q, k.transpose(-1, -2))) * w).sum(dim=1)
