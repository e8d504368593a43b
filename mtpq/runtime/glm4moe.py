"""GLM-4.5 / 4.6 / 4.7 (GGUF arch ``glm4moe``) with its MTP head, in plain torch.

Read top to bottom: config from GGUF metadata, RMSNorm, partial RoPE, KV cache,
attention, dense FFN, MoE, decoder block, MTP head, model. Weights come from
:mod:`mtpq.runtime.weights` and stay in their GGUF type (dequantized at use).

Trunk: token_embd -> blocks (the first ``leading_dense_block_count`` with a dense
SwiGLU FFN, the rest MoE) -> output_norm -> output. Attention is GQA with
optional q/k biases and per-head q/k RMSNorm, and RoPE on the first
``rope.dimension_count`` dims of each head in NeoX order (halves rotated), as
llama.cpp's glm4moe and transformers' Glm4Moe do. MoE: sigmoid router scores,
``exp_probs_b`` correction bias used for choosing experts only, group-limited
top-k, optional renormalisation (``expert_weights_norm``), ``expert_weights_scale``,
plus a shared expert.

MTP head (block ``n_layer``, DESIGN.md): for the pair (h_t, x_{t+1})
    u = eh_proj([enorm(E[x_{t+1}]); hnorm(h_t)]);  g = Block(u);  logits = head(shared_head_norm(g))
E and head are the block's ``nextn.embed_tokens`` / ``nextn.shared_head_head``, or the
trunk's ``token_embd`` / ``output`` when absent (GLM-4.6). h_t is the trunk's hidden
state after ``output_norm`` (``hidden="post_norm"``, as llama.cpp and transformers);
``hidden="pre_norm"`` feeds the last block's raw output instead (and, for drafts
2..k, the head's own output before ``shared_head_norm``). The head has its own KV cache.

Caches hold one sequence (batch 1 when cached); ``truncate`` rolls them back.
Uncached calls (``use_cache=False``) take any batch and start at position 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from gguf import ExpertGatingFuncType
from torch import nn

from ..errors import InputError
from .weights import GGUFFile, QuantLinear

ARCH = "glm4moe"


# ----------------------------------------------------------------------------- config


@dataclass
class Glm4MoeConfig:
    vocab_size: int
    hidden_size: int
    n_layers: int  # trunk blocks (block_count - nextn_predict_layers)
    n_mtp_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_dim: int
    rope_base: float
    rope_linear_factor: float
    rms_eps: float
    n_dense_lead: int
    n_experts: int
    n_experts_used: int
    n_group: int
    topk_group: int
    routed_scale: float
    norm_topk: bool
    gating: str  # "sigmoid" | "softmax"
    context_length: int

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "Glm4MoeConfig":
        if g.arch != ARCH:
            raise InputError(g.path, f"architecture is {g.arch!r}, this runtime reads {ARCH!r}")
        n_blocks = int(g.require("block_count"))
        n_mtp = int(g.value("nextn_predict_layers", 0) or 0)
        hidden = int(g.require("embedding_length"))
        n_heads = int(g.require("attention.head_count"))
        head_dim = int(g.value("attention.key_length", hidden // n_heads))
        scaling = g.value("rope.scaling.type", "none")
        factor = 1.0
        if scaling == "linear":
            factor = float(g.require("rope.scaling.factor"))
        elif scaling not in ("none", None):
            raise InputError(g.path, f"rope scaling {scaling!r} is not supported by the glm4moe runtime")
        gating = int(g.value("expert_gating_func", ExpertGatingFuncType.SIGMOID) or ExpertGatingFuncType.SIGMOID)
        if "token_embd.weight" not in g:
            raise InputError(g.path, "missing tensor token_embd.weight")
        return cls(
            vocab_size=g.shape("token_embd.weight")[0],
            hidden_size=hidden,
            n_layers=n_blocks - n_mtp,
            n_mtp_layers=n_mtp,
            n_heads=n_heads,
            n_kv_heads=int(g.value("attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            rope_dim=int(g.value("rope.dimension_count", head_dim)),
            rope_base=float(g.value("rope.freq_base", 10000.0)),
            rope_linear_factor=factor,
            rms_eps=float(g.require("attention.layer_norm_rms_epsilon")),
            n_dense_lead=int(g.value("leading_dense_block_count", 0)),
            n_experts=int(g.value("expert_count", 0)),
            n_experts_used=int(g.value("expert_used_count", 0)),
            n_group=int(g.value("expert_group_count", 1) or 1),
            topk_group=int(g.value("expert_group_used_count", 1) or 1),
            routed_scale=float(g.value("expert_weights_scale", 1.0) or 1.0),
            norm_topk=bool(g.value("expert_weights_norm", False)),
            gating="softmax" if gating == ExpertGatingFuncType.SOFTMAX else "sigmoid",
            context_length=int(g.value("context_length", 4096)),
        )


# ----------------------------------------------------------------------------- pieces


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, scaled in the input dtype (as transformers does)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, cfg: Glm4MoeConfig, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, rope_dim] for NeoX-ordered RoPE on the first rope_dim dims of a head."""
    d = cfg.rope_dim
    inv_freq = 1.0 / (cfg.rope_base ** (torch.arange(0, d, 2, dtype=torch.float, device=positions.device) / d))
    freqs = (positions.float() / cfg.rope_linear_factor)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, head_dim]: rotate the first cos.shape[-1] dims (halves), pass the rest through."""
    d = cos.shape[-1]
    rot, rest = x[..., :d], x[..., d:]
    x1, x2 = rot[..., : d // 2], rot[..., d // 2 :]
    rotated = torch.cat((-x2, x1), dim=-1)
    return torch.cat((rot * cos + rotated * sin, rest), dim=-1)


class KVCache:
    """Keys/values of one attention layer for one sequence; grows as needed, ``truncate`` rolls back."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v [B, H_kv, T, D] at ``length``; return everything cached so far."""
        need = self.length + k.shape[2]
        if self.k is None or need > self.k.shape[2]:
            cap = max(need, 2 * (self.k.shape[2] if self.k is not None else 0), 64)
            new_k = k.new_zeros(k.shape[0], k.shape[1], cap, k.shape[3])
            new_v = v.new_zeros(v.shape[0], v.shape[1], cap, v.shape[3])
            if self.k is not None:
                new_k[:, :, : self.length] = self.k[:, :, : self.length]
                new_v[:, :, : self.length] = self.v[:, :, : self.length]
            self.k, self.v = new_k, new_v
        self.k[:, :, self.length : need] = k
        self.v[:, :, self.length : need] = v
        self.length = need
        return self.k[:, :, :need], self.v[:, :, :need]

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)


class Attention(nn.Module):
    def __init__(self, g: GGUFFile, p: str, cfg: Glm4MoeConfig, device, dtype):
        super().__init__()
        self.cfg = cfg
        self.wq = QuantLinear(g.weight(p + "attn_q.weight", device, dtype), g.optional(p + "attn_q.bias", device, dtype))
        self.wk = QuantLinear(g.weight(p + "attn_k.weight", device, dtype), g.optional(p + "attn_k.bias", device, dtype))
        self.wv = QuantLinear(g.weight(p + "attn_v.weight", device, dtype), g.optional(p + "attn_v.bias", device, dtype))
        self.wo = QuantLinear(g.weight(p + "attn_output.weight", device, dtype))
        self.q_norm = g.optional(p + "attn_q_norm.weight", device, dtype)
        self.k_norm = g.optional(p + "attn_k_norm.weight", device, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int,
                cache: KVCache | None) -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, cfg.n_heads, cfg.head_dim)
        k = self.wk(x).view(B, T, cfg.n_kv_heads, cfg.head_dim)
        v = self.wv(x).view(B, T, cfg.n_kv_heads, cfg.head_dim)
        if self.q_norm is not None:  # per-head RMSNorm before RoPE
            q = rms_norm(q, self.q_norm, cfg.rms_eps)
        if self.k_norm is not None:
            k = rms_norm(k, self.k_norm, cfg.rms_eps)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v)
        # query i sits at position start + i and sees keys 0..start + i
        q_pos = torch.arange(start, start + T, device=x.device)
        allowed = torch.arange(k.shape[2], device=x.device)[None, :] <= q_pos[:, None]
        rep = cfg.n_heads // cfg.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=cfg.head_dim**-0.5)
        return self.wo(out.transpose(1, 2).reshape(B, T, cfg.n_heads * cfg.head_dim))


class DenseFFN(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). Also the shared expert (suffix ``_shexp``)."""

    def __init__(self, g: GGUFFile, p: str, device, dtype, suffix: str = ""):
        super().__init__()
        self.gate = QuantLinear(g.weight(f"{p}ffn_gate{suffix}.weight", device, dtype))
        self.up = QuantLinear(g.weight(f"{p}ffn_up{suffix}.weight", device, dtype))
        self.down = QuantLinear(g.weight(f"{p}ffn_down{suffix}.weight", device, dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class MoE(nn.Module):
    def __init__(self, g: GGUFFile, p: str, cfg: Glm4MoeConfig, device, dtype):
        super().__init__()
        self.cfg = cfg
        self.router = g.float_tensor(p + "ffn_gate_inp.weight", device, torch.float32)  # [E, H], routed in f32
        self.bias = g.optional(p + "exp_probs_b.bias", device, torch.float32)
        self.gate = g.weight(p + "ffn_gate_exps.weight", device, dtype)  # [E, ff, H]
        self.up = g.weight(p + "ffn_up_exps.weight", device, dtype)
        self.down = g.weight(p + "ffn_down_exps.weight", device, dtype)  # [E, H, ff]
        self.shared = DenseFFN(g, p, device, dtype, "_shexp") if p + "ffn_gate_shexp.weight" in g else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (weights [N, k] f32, expert ids [N, k])."""
        cfg = self.cfg
        logits = F.linear(x.float(), self.router)
        scores = logits.sigmoid() if cfg.gating == "sigmoid" else logits.softmax(dim=-1)
        choice = scores if self.bias is None else scores + self.bias  # the bias picks experts, never weighs them
        if cfg.n_group > 1 and cfg.topk_group < cfg.n_group:
            grouped = choice.view(-1, cfg.n_group, cfg.n_experts // cfg.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # a group's score: its two best experts
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(cfg.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(-1, cfg.n_experts)
        ids = choice.topk(cfg.n_experts_used, dim=-1).indices
        weights = scores.gather(1, ids)
        if cfg.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scale, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():  # dequantize only the experts some token uses
            tok, slot = torch.where(ids == e)
            h = x[tok]
            h = F.silu(F.linear(h, self.gate.dequant(e).to(x.dtype))) * F.linear(h, self.up.dequant(e).to(x.dtype))
            h = F.linear(h, self.down.dequant(e).to(x.dtype))
            out.index_add_(0, tok, (h * weights[tok, slot, None]).to(x.dtype))
        if self.shared is not None:
            out = out + self.shared(x)
        return out.view(shape)


class Block(nn.Module):
    def __init__(self, g: GGUFFile, bid: int, cfg: Glm4MoeConfig, device, dtype):
        super().__init__()
        p = f"blk.{bid}."
        self.eps = cfg.rms_eps
        self.attn_norm = g.float_tensor(p + "attn_norm.weight", device, dtype)
        self.attn = Attention(g, p, cfg, device, dtype)
        self.ffn_norm = g.float_tensor(p + "post_attention_norm.weight", device, dtype)
        # MoE wherever a router exists: dense lead blocks have none, MTP blocks always have one
        self.ffn = MoE(g, p, cfg, device, dtype) if p + "ffn_gate_inp.weight" in g else DenseFFN(g, p, device, dtype)

    def forward(self, x: torch.Tensor, cos, sin, start: int, cache: KVCache | None) -> torch.Tensor:
        h = x + self.attn(rms_norm(x, self.attn_norm, self.eps), cos, sin, start, cache)
        return h + self.ffn(rms_norm(h, self.ffn_norm, self.eps))


# ----------------------------------------------------------------------------- model


@dataclass
class TrunkOut:
    logits: torch.Tensor  # [B, T, V] (or [B, 1, V] with last_only)
    hidden: torch.Tensor  # [B, T, H]: what the MTP head is fed (post- or pre-norm, see Glm4Moe.hidden)


@dataclass
class MtpOut:
    logits: torch.Tensor  # [B, T, V]: predictions of x_{t+2}
    hidden: torch.Tensor  # [B, T, H]: the head's output, fed back for drafts 2..k


class MtpHead(nn.Module):
    def __init__(self, g: GGUFFile, bid: int, cfg: Glm4MoeConfig, device, dtype):
        super().__init__()
        p = f"blk.{bid}.nextn."
        self.eps = cfg.rms_eps
        self.eh_proj = QuantLinear(g.weight(p + "eh_proj.weight", device, dtype))
        self.enorm = g.float_tensor(p + "enorm.weight", device, dtype)
        self.hnorm = g.float_tensor(p + "hnorm.weight", device, dtype)
        norm = p + "shared_head_norm.weight" if p + "shared_head_norm.weight" in g else "output_norm.weight"
        self.head_norm = g.float_tensor(norm, device, dtype)
        # None -> the trunk's token_embd / output (GLM-4.6 ties them and omits these)
        self.embed = g.weight(p + "embed_tokens.weight", device, dtype) if p + "embed_tokens.weight" in g else None
        self.head = QuantLinear(g.weight(p + "shared_head_head.weight", device, dtype)) \
            if p + "shared_head_head.weight" in g else None
        self.block = Block(g, bid, cfg, device, dtype)


class Glm4Moe(nn.Module):
    """The trunk plus (when the GGUF has one) the first MTP head, with KV caches for both."""

    HIDDEN_CHOICES = ("post_norm", "pre_norm")

    def __init__(self, g: GGUFFile, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 hidden: str = "post_norm"):
        super().__init__()
        if hidden not in self.HIDDEN_CHOICES:
            raise ValueError(f"hidden must be one of {self.HIDDEN_CHOICES}, got {hidden!r}")
        self.cfg = cfg = Glm4MoeConfig.from_gguf(g)
        self.path = g.path
        self.device, self.dtype, self.hidden = torch.device(device), dtype, hidden
        self.tok_embd = g.weight("token_embd.weight", device, dtype)
        self.blocks = nn.ModuleList(Block(g, i, cfg, device, dtype) for i in range(cfg.n_layers))
        self.out_norm = g.float_tensor("output_norm.weight", device, dtype)
        self.output = QuantLinear(g.weight("output.weight" if "output.weight" in g else "token_embd.weight", device, dtype))
        has_head = cfg.n_mtp_layers > 0 and f"blk.{cfg.n_layers}.nextn.eh_proj.weight" in g
        self.mtp = MtpHead(g, cfg.n_layers, cfg, device, dtype) if has_head else None
        self.reset()

    # -- caches ---------------------------------------------------------------------------

    def reset(self) -> None:
        self.trunk_cache = [KVCache() for _ in self.blocks]
        self.mtp_cache = KVCache()

    @property
    def trunk_length(self) -> int:
        return self.trunk_cache[0].length if self.trunk_cache else 0

    @property
    def mtp_length(self) -> int:
        return self.mtp_cache.length

    def truncate(self, trunk: int | None = None, mtp: int | None = None) -> None:
        """Roll the caches back to the first ``trunk`` / ``mtp`` positions."""
        if trunk is not None:
            for c in self.trunk_cache:
                c.truncate(trunk)
        if mtp is not None:
            self.mtp_cache.truncate(mtp)

    # -- forward --------------------------------------------------------------------------

    def _rope(self, start: int, T: int):
        return rope_cos_sin(torch.arange(start, start + T, device=self.device), self.cfg, self.dtype)

    @torch.no_grad()
    def trunk(self, ids: torch.Tensor, use_cache: bool = True, last_only: bool = False) -> TrunkOut:
        """Run the trunk on ids [B, T] (appended to the cache when ``use_cache``)."""
        ids = ids.to(self.device)
        start = self.trunk_length if use_cache else 0
        cos, sin = self._rope(start, ids.shape[1])
        x = self.tok_embd.rows(ids)
        for block, cache in zip(self.blocks, self.trunk_cache):
            x = block(x, cos, sin, start, cache if use_cache else None)
        normed = rms_norm(x, self.out_norm, self.cfg.rms_eps)
        logits = self.output(normed[:, -1:] if last_only else normed)
        return TrunkOut(logits.float(), normed if self.hidden == "post_norm" else x)

    @torch.no_grad()
    def draft(self, next_ids: torch.Tensor, hidden: torch.Tensor, use_cache: bool = True) -> MtpOut:
        """The MTP head on pairs (hidden[t], next_ids[t]) = (h_t, x_{t+1}); logits predict x_{t+2}."""
        head = self.mtp
        if head is None:
            raise InputError(self.path, "this GGUF has no MTP head (no blk.N.nextn.* tensors)")
        next_ids = next_ids.to(self.device)
        start = self.mtp_length if use_cache else 0
        cos, sin = self._rope(start, next_ids.shape[1])
        e = (head.embed if head.embed is not None else self.tok_embd).rows(next_ids)
        u = head.eh_proj(torch.cat((rms_norm(e, head.enorm, head.eps),
                                    rms_norm(hidden.to(self.dtype), head.hnorm, head.eps)), dim=-1))
        g = head.block(u, cos, sin, start, self.mtp_cache if use_cache else None)
        normed = rms_norm(g, head.head_norm, head.eps)
        logits = (head.head if head.head is not None else self.output)(normed)
        return MtpOut(logits.float(), normed if self.hidden == "post_norm" else g)


def load_glm4moe(path: Path | str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 hidden: str = "post_norm") -> Glm4Moe:
    return Glm4Moe(GGUFFile(Path(path)), device=device, dtype=dtype, hidden=hidden).eval()
