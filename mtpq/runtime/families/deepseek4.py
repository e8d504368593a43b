"""DeepSeek-V4 (GGUF arch ``deepseek4``: DeepSeek-V4-Flash, -Pro), as llama.cpp's deepseek4 graph computes it.

Every block (``dsv4.py``): hyper-connection streams around its attention and its FFN; compressed sparse attention
(a sliding window over raw keys, plus per ``attention.compress_ratios[i]`` compressed keys: every 128 tokens, or
every 4 with the lightning indexer's top-k); an MoE with sqrt(softplus) scores, hash-routed by token id
(``ffn_gate_tid2eid``) in the first ``hash_layer_count`` blocks and by score + ``exp_probs_b`` after, a shared
expert, and SwiGLUs clamped as ggml_swiglu_clamp clamps them (``swiglu_clamp_exp`` / ``_shexp``, the gate before
its silu). The trunk enters with the embedding in every stream and leaves through ``output_hc_*`` before
``output_norm``.

The MTP block (llama.cpp's graph_mtp) reads the trunk's streams as they leave the last block (hc * hidden wide, the
state llama.cpp's driver passes): u_s = eh_proj([enorm(E[x]) ; hnorm(stream_s)]) per stream, one block (window
attention only), then the head's own output hyper-connection, ``nextn.shared_head_norm`` and the output. Its
``output_hc_*`` cannot sit beside the trunk's in one GGUF: the head lives in its own file (``convert --mtp-only``,
llama.cpp's ``--mtp``) and pairs with a trunk file (:class:`~mtpq.gguf_io.pair.PairedGGUF`, ``accept --head``),
which puts the head file's ``output_hc_*`` under ``blk.N.nextn.``; a head-only file read alone has them at the top.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from ...errors import InputError
from ..dsv4 import (
    CompressedAttention,
    HashMoE,
    HcConfig,
    HyperHead,
    HyperMix,
    Tokens,
    V4AttnConfig,
    yarn_cancelled_mscale,
)
from ..layers import MoEConfig, Packing, Rope, rms_norm, rope_inv_freq
from ..model import RuntimeFamily
from ..mtp import NextNHead
from ..weights import GGUFFile, Scope, Weights, as_dtype
from .common import per_layer, yarn_rope

GATING_SQRT_SOFTPLUS = 4  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS, the only one its loader takes


@dataclass(frozen=True)
class Deepseek4Config:
    vocab_size: int
    hc: HcConfig
    ratios: tuple[int, ...]
    n_hash: int
    moe: MoEConfig
    clamp_exp: tuple[float, ...]
    clamp_shexp: tuple[float, ...]


class V4Block(nn.Module):
    """streams -> hc_attn.pre -> attn_norm -> attention -> hc_attn.post -> hc_ffn.pre -> ffn_norm -> MoE + shared
    expert -> hc_ffn.post. x [B, T, hc * hidden]."""

    def __init__(self, w: Scope, attn: CompressedAttention, ffn: HashMoE, hc: HcConfig, eps: float):
        super().__init__()
        self.hc_attn, self.hc_ffn = HyperMix(w, "attn", hc), HyperMix(w, "ffn", hc)
        self.attn_norm, self.ffn_norm = w.tensor("attn_norm"), w.tensor("ffn_norm")
        self.attn, self.ffn, self.eps = attn, ffn, eps

    def new_cache(self):
        return self.attn.new_cache()

    def forward(self, x: torch.Tensor, start: int, cache, packing: Packing | None = None) -> torch.Tensor:
        """With ``packing`` (x [1, N, hc * hidden], uncached): attention per sequence on the padded batch, the
        kept rows only out."""
        cur, post, comb = self.hc_attn.pre(x)
        normed = rms_norm(cur, self.attn_norm, self.eps)
        if packing is None:
            out = self.attn(normed, start, cache)
        else:
            out = packing.unpad(self.attn(packing.pad(normed), 0, None, rows=packing.rows))
            if packing.kept is not None:
                x, post, comb = x[:, packing.kept], post[:, packing.kept], comb[:, packing.kept]
        x = self.hc_attn.post(out, x, post, comb)
        cur, post, comb = self.hc_ffn.pre(x)
        return self.hc_ffn.post(self.ffn(rms_norm(cur, self.ffn_norm, self.eps)), x, post, comb)


class V4Ends(nn.Module):
    """The trunk's entry (the embedding copied into every stream; the token ids kept for the hash layers) and exit
    (the streams folded by ``output_hc_*``)."""

    def __init__(self, top: Scope, hc: HcConfig, tokens: Tokens):
        super().__init__()
        self.n, self.tokens = hc.n, tokens
        self.head = HyperHead(top, "output_hc", hc)

    def enter(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        self.tokens.ids = ids
        return x.repeat(1, 1, self.n)

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


class V4Head(NextNHead):
    """DeepSeek-V4's MTP head (llama.cpp's graph_mtp), on the trunk's streams (the attributes of a
    :class:`NextNHead`, its own forward)."""

    def __init__(self, w: Scope, block: V4Block, hc: HcConfig, eps: float, model):
        nn.Module.__init__(self)
        n = w.at("nextn.")
        self.hc, self.eps, self.block = hc, eps, block
        self.hidden_first, self.norm, self.head_eps = False, rms_norm, eps
        self.logit_scale, self.layer_norm_head = 1.0, False
        self.tied_embed, self.tied_head = not n.has("embed_tokens"), not n.has("shared_head_head")
        self.eh_proj = n.linear("eh_proj", bias=False)
        self.enorm, self.hnorm = n.tensor("enorm"), n.tensor("hnorm")
        self.head_norm = n.tensor("shared_head_norm") if n.has("shared_head_norm") else model.out_norm
        self.embed = n.qweight("embed_tokens") if n.has("embed_tokens") else model.tok_embd
        self.head = n.linear("shared_head_head", bias=False) if n.has("shared_head_head") else model.output
        # the head's own output hyper-connection: under nextn. in a trunk + head pair, at the top of a head file
        own = n if n.has("output_hc_fn") else w.weights.at()
        if not own.has("output_hc_fn"):
            raise InputError(w.file.path, f"{w.prefix}: the MTP head has no output hyper-connection (output_hc_*)")
        self.out_hc = HyperHead(own, "output_hc", hc)

    def new_cache(self):
        return self.block.new_cache()

    def forward(self, next_ids: torch.Tensor, hidden: torch.Tensor, start: int, cache, packing: Packing | None = None):
        """-> (logits of x_{t+2}, the normed output, the block's streams [.., hc * hidden])."""
        e = rms_norm(self.embed.rows(next_ids), self.enorm, self.eps)
        h = rms_norm(as_dtype(hidden, e.dtype).unflatten(-1, (self.hc.n, self.hc.hidden)), self.hnorm, self.eps)
        u = self.eh_proj(torch.cat((e[..., None, :].expand_as(h), h), dim=-1))
        g = self.block(u.flatten(-2), start, cache, packing=packing)
        normed = rms_norm(self.out_hc(g), self.head_norm, self.eps)
        return self.head(normed), normed, g


class Deepseek4(RuntimeFamily):
    archs = ("deepseek4",)
    nextn_state = "pre_norm"  # the streams as they leave the last block (llama.cpp's h_nextn)
    head_in_own_file = True  # (a trunk file and a head file: --head)

    def __init__(self, g: GGUFFile):
        super().__init__(g)
        if int(g.value("expert_gating_func", 0) or 0) != GATING_SQRT_SOFTPLUS:
            raise InputError(
                g.path,
                f"{g.arch}.expert_gating_func must be {GATING_SQRT_SOFTPLUS} (sqrt(softplus)), "
                "the only scoring llama.cpp's deepseek4 runs",
            )
        n_all = g.n_trunk + g.n_mtp
        ratios = tuple(int(r) for r in g.require("attention.compress_ratios"))
        if len(ratios) < n_all or any(r not in (0, 4, 128) for r in ratios[:n_all]):
            raise InputError(
                g.path,
                f"{g.arch}.attention.compress_ratios must give 0, 4 or 128 for each of the "
                f"{n_all} blocks, got {list(ratios)}",
            )
        hidden = int(g.require("embedding_length"))
        self.hc = HcConfig(
            n=int(g.require("hyper_connection.count")),
            hidden=hidden,
            iters=int(g.require("hyper_connection.sinkhorn_iterations")),
            eps=float(g.require("hyper_connection.epsilon")),
            norm_eps=self.eps,
        )
        clamp_exp = [float(v) for v in per_layer(g, "swiglu_clamp_exp", n_all, 0.0)]
        clamp_shexp = (
            [float(v) for v in per_layer(g, "swiglu_clamp_shexp", n_all, 0.0)]
            if g.value("swiglu_clamp_shexp") is not None
            else clamp_exp
        )
        self.cfg = Deepseek4Config(
            vocab_size=g.shape("token_embd.weight")[0],
            hc=self.hc,
            ratios=ratios[:n_all],
            n_hash=int(g.value("hash_layer_count", 0) or 0),
            moe=MoEConfig(
                n_experts=int(g.require("expert_count")),
                n_used=int(g.require("expert_used_count")),
                gating="sqrtsoftplus",
                norm_topk=bool(g.value("expert_weights_norm", False)),
                scale=float(g.value("expert_weights_scale", 1.0) or 1.0),
                clamp_gate=True,
            ),
            clamp_exp=tuple(clamp_exp),
            clamp_shexp=tuple(clamp_shexp),
        )
        self.head_dim = int(g.require("attention.key_length"))
        self.attn = dict(
            n_heads=int(g.require("attention.head_count")),
            head_dim=self.head_dim,
            o_groups=int(g.require("attention.output_group_count")),
            o_lora=int(g.require("attention.output_lora_rank")),
            eps=self.eps,
            window=int(g.require("attention.sliding_window")),
            top_k=int(g.value("attention.indexer.top_k", 0) or 0),
            idx_heads=int(g.value("attention.indexer.head_count", 0) or 0),
            idx_dim=int(g.value("attention.indexer.key_length", 0) or 0),
        )
        rope_dim = int(g.require("rope.dimension_count"))
        self.rope = Rope(rope_inv_freq(rope_dim, float(g.value("rope.freq_base", 10000.0))), neox=False)
        comp_base = float(g.require("attention.compress_rope_freq_base"))
        scaling = g.value("rope.scaling.type", "none")
        if scaling == "yarn":
            inv, factor = yarn_rope(g, rope_dim, comp_base, read_ext_factor=False)
            self.comp_rope = Rope(inv, neox=False, mscale=yarn_cancelled_mscale(factor))
        elif scaling in ("none", None):
            self.comp_rope = Rope(rope_inv_freq(rope_dim, comp_base), neox=False)
        else:
            raise InputError(g.path, f"rope scaling {scaling!r} is not supported by the deepseek4 runtime")
        self.tokens = Tokens()

    def ends(self, top: Scope) -> V4Ends:
        return V4Ends(top, self.hc, self.tokens)

    def block(self, w: Scope, index: int) -> V4Block:
        cfg = self.cfg
        ratio = cfg.ratios[index]
        attn = CompressedAttention(
            w, V4AttnConfig(ratio=ratio, **self.attn), self.comp_rope if ratio else self.rope, self.comp_rope
        )
        moe_cfg = replace(cfg.moe, swiglu_limit=cfg.clamp_exp[index], shared_swiglu_limit=cfg.clamp_shexp[index])
        hashed = index < cfg.n_hash and index < self.file.n_trunk  # (llama.cpp's MTP block is never hash-routed)
        return V4Block(w, attn, HashMoE(w, moe_cfg, self.tokens if hashed else None), self.hc, self.eps)

    def nextn_head(self, w: Weights, index: int, model) -> V4Head:
        scope = w.at(f"blk.{index}.")
        return V4Head(scope, self.block(scope, index), self.hc, self.eps, model)
