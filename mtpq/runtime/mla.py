"""DeepSeek's multi-head latent attention (MLA), as llama.cpp's deepseek2 graph runs it on our GGUFs.

Tensors (``mtpq/convert/families/deepseek2.py`` writes them as llama.cpp's converter does):
``attn_q_a`` -> ``attn_q_a_norm`` -> ``attn_q_b`` (or a plain ``attn_q`` when q_lora_rank is null)
gives per head [q_nope | q_pe]; ``attn_kv_a_mqa`` gives the latent ``c`` (kv_lora_rank wide, then
``attn_kv_a_norm``) and one rope key ``k_pe`` shared by all heads; ``kv_b_proj`` is stored split per
head as ``attn_k_b`` [H, kv_lora, nope] (k part, transposed) and ``attn_v_b`` [H, v, kv_lora].

With those, attention runs on the latent itself (llama.cpp's "absorption"), as MQA with one wide head:

    Q_h = [q_nope_h @ k_b_h^T | rope(q_pe_h)]     K = [c | rope(k_pe)]     V = c
    out_h = softmax(Q_h K^T * kq_scale) V @ v_b_h^T   -> attn_output

which is transformers' ``k_nope = kv_b(c)`` form with the matrix products reassociated. The cache
therefore holds only ``c`` and ``k_pe`` per token (a :class:`~mtpq.runtime.cache.KVCache`; rollback
is a trim). RoPE rotates adjacent pairs (llama.cpp's ROPE_TYPE_NORM; transformers' ``rope_interleave``
gives the same dot products with its output de-interleaved).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .cache import KVCache
from .layers import Packing, Rope, causal_attention, packed_attention, rms_norm, take_rows
from .weights import Scope, as_dtype


@dataclass(frozen=True)
class MLAConfig:
    n_heads: int
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_dim: int
    eps: float
    kq_scale: float  # softmax scale: 1/sqrt(nope + rope), times YaRN's mscale^2 (see yarn_mla_scales)


def yarn_get_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_mla_scales(
    factor: float, mscale_all_dim: float | None, attn_factor: float = 1.0, mscale: float | None = None
) -> tuple[float, float]:
    """(cos/sin multiplier, softmax-scale multiplier) of DeepSeek's YaRN as llama.cpp derives them from the
    GGUF: ``factor`` (1 without YaRN), ``mscale_all_dim`` (``rope.scaling.yarn_log_multiplier`` / 0.1) and
    ``rope.scaling.attn_factor``; ``mscale`` is config.json's, which llama.cpp assumes (None: equal to
    mscale_all_dim, its deepseek2 rule; deepseek32 takes 1).

    The GGUF does not carry config.json's ``mscale``; llama.cpp takes it equal to ``mscale_all_dim``
    (DeepSeek-V3/R1: both 1; V2-Lite: both 0.707), so transformers' cos/sin ``attention_factor`` =
    get_mscale(f, mscale) / get_mscale(f, mscale_all_dim) is 1, and the softmax scale grows by
    get_mscale(f, mscale_all_dim)^2 as in transformers' ``yarn_apply_mscale``. Without
    mscale_all_dim llama.cpp scales cos/sin by get_mscale(f) and the softmax by its square too, where
    transformers scales only cos/sin: we follow llama.cpp, the engine that runs these files.
    """
    if mscale_all_dim:
        if mscale is None or mscale == mscale_all_dim:
            return attn_factor, (attn_factor * yarn_get_mscale(factor, mscale_all_dim)) ** 2
        return (
            attn_factor * yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim),
            (attn_factor * yarn_get_mscale(factor, mscale)) ** 2,
        )
    rope_scale = attn_factor * yarn_get_mscale(factor)
    return rope_scale, rope_scale**2


EXPAND_MIN_T = 16  # from this many new tokens on, attention runs on expanded keys/values (fewer FLOPs)
MASKED_SCORES = 1 << 24  # scores a masked attention (sparse attention's top-k) computes at once


class MLA(nn.Module):
    """Multi-head latent attention; ``forward(x, start, cache)`` like every sequence mixer (layers.py)."""

    def __init__(self, w: Scope, cfg: MLAConfig, rope: Rope):
        super().__init__()
        self.cfg, self.rope = cfg, rope
        if w.has("attn_q_a"):  # low-rank query (DeepSeek-V3/R1); the "lite" models have a plain attn_q
            self.wq_a, self.q_a_norm, self.wq = w.linear("attn_q_a"), w.tensor("attn_q_a_norm"), w.linear("attn_q_b")
        else:
            self.wq_a, self.q_a_norm, self.wq = None, None, w.linear("attn_q")
        self.wkv_a = w.linear("attn_kv_a_mqa")
        self.kv_a_norm = w.tensor("attn_kv_a_norm")
        self.k_b, self.v_b = w.qweight("attn_k_b"), w.qweight("attn_v_b")  # [H, kv_lora, nope], [H, v, kv_lora]
        self.wo = w.linear("attn_output")

    def new_cache(self) -> KVCache:
        return KVCache()  # latent c [B, 1, T, kv_lora] and k_pe [B, 1, T, rope]

    def _expansion(self, dtype: torch.dtype) -> torch.Tensor:
        """k_b and v_b as one [kv_lora, H*nope | H*v] matrix: both expansions of the latent rows in one GEMM
        (a broadcast matmul per head would copy c once per head and run H small GEMMs)."""
        cfg = self.cfg
        return torch.cat(
            (
                as_dtype(self.k_b.matrix(), dtype).permute(1, 0, 2).reshape(cfg.kv_lora_rank, -1),
                as_dtype(self.v_b.matrix(), dtype).permute(2, 0, 1).reshape(cfg.kv_lora_rank, -1),
            ),
            dim=1,
        )

    def q_latent(self, xq: torch.Tensor) -> torch.Tensor:
        """The query rows' normed low-rank latent (``attn_q_a`` -> ``attn_q_a_norm``); ``xq`` itself without one."""
        return xq if self.wq_a is None else rms_norm(self.wq_a(xq), self.q_a_norm, self.cfg.eps)

    def _project(self, x: torch.Tensor, xq: torch.Tensor, q_at, k_at, qr: torch.Tensor | None = None):
        """From the query rows ``xq`` (or their latent ``qr``, :meth:`q_latent`): q [B, H, Tq, nope + rope] (its
        rope part not yet rotated: the expanded form writes the rotated q_pe into it instead of a cat of both) and
        the rotated q_pe; from all rows ``x``: the normed latent c [B, 1, T, kv_lora] (one head shared by all) and
        the rotated k_pe [B, 1, T, rope]; positions ``q_at`` / ``k_at`` as :meth:`Rope.apply` takes them."""
        cfg = self.cfg
        B, Tq, _ = xq.shape
        q = self.wq(self.q_latent(xq) if qr is None else qr)
        q = q.view(B, Tq, cfg.n_heads, cfg.qk_nope_dim + cfg.qk_rope_dim).transpose(1, 2)
        c, k_pe = self.wkv_a(x).split((cfg.kv_lora_rank, cfg.qk_rope_dim), dim=-1)
        c = rms_norm(c, self.kv_a_norm, cfg.eps)[:, None]
        return q, self.rope.apply(q[..., cfg.qk_nope_dim :], q_at), c, self.rope.apply(k_pe[:, None], k_at)

    def _expanded_kv(
        self, c: torch.Tensor, k_pe: torch.Tensor, expansion: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values expanded per head from the latent rows c [B, 1, S, kv_lora] and k_pe [B, 1, S, rope]
        (``expansion``: :meth:`_expansion`): k [B, H, S, nope + rope], v [B, H, S, v]."""
        cfg = self.cfg
        H, (B, _, S, _) = cfg.n_heads, c.shape
        k_nope, v = torch.matmul(c[:, 0], expansion).split((H * cfg.qk_nope_dim, H * cfg.v_dim), dim=-1)
        k = torch.cat((k_nope.view(B, S, H, -1).transpose(1, 2), k_pe.expand(-1, H, -1, -1)), dim=-1)
        return k, v.view(B, S, H, -1).transpose(1, 2)

    def forward_packed(self, x: torch.Tensor, packing: Packing) -> torch.Tensor:
        """The expanded form over packed sequences (layers.Packing), x [1, N, H] -> [1, kept rows, H]: the
        projections run on the real rows; keys and values are expanded one sequence at a time, right before
        its attention reads them (in cache then, and never the whole pack's expanded rows in memory)."""
        cfg = self.cfg
        xq = x if packing.kept is None else x[:, packing.kept]
        q, q_pe, c, k_pe = self._project(x, xq, packing.out_positions, packing.positions)
        q[..., cfg.qk_nope_dim :] = q_pe
        expansion = self._expansion(x.dtype)

        def kv(a: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
            k, v = self._expanded_kv(c[:, :, a : a + n], k_pe[:, :, a : a + n], expansion)
            return k[0].transpose(0, 1), v[0].transpose(0, 1)

        out = packed_attention(q[0].transpose(0, 1), kv, packing, cfg.kq_scale)
        return self.wo(out.view(1, -1, cfg.n_heads * cfg.v_dim))

    def forward(
        self, x: torch.Tensor, start: int, cache: KVCache | None, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``rows`` [B, M]: outputs for those positions only (every row still gives its latent key/value)."""
        xq = x if rows is None else take_rows(x, rows)
        at = start if rows is None else start + rows  # the queries' positions
        q, q_pe, c, k_pe = self._project(x, xq, at, start)
        if cache is not None:
            c, k_pe = cache.update(c, k_pe)
        return self.attend(q, q_pe, c, k_pe, at)

    def attend(
        self,
        q: torch.Tensor,
        q_pe: torch.Tensor,
        c: torch.Tensor,
        k_pe: torch.Tensor,
        at,
        allowed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The queries (:meth:`_project`, at positions ``at``) on the latent rows c / k_pe at positions 0..S-1,
        through ``attn_output``. ``allowed`` [B, 1, T, S] (bool): the keys each query reads; None: causal."""
        cfg = self.cfg
        B, _, T, _ = q.shape
        if T >= EXPAND_MIN_T:
            # many queries (prefill, teacher forcing): keys and values expanded per head, as transformers does;
            # attention over nope + rope dims costs a fraction of the latent form's kv_lora + rope
            k, v = self._expanded_kv(c, k_pe, self._expansion(q.dtype))
            q[..., cfg.qk_nope_dim :] = q_pe
            out = _attention(q, k, v, at, cfg.kq_scale, allowed)
            return self.wo(out.transpose(1, 2).reshape(B, T, cfg.n_heads * cfg.v_dim))
        # absorb k_b into the query: q_nope . (W_k c) == (W_k^T q_nope) . c
        q_lat = torch.matmul(
            q[..., : cfg.qk_nope_dim],  # [B, H, T, kv_lora]
            as_dtype(self.k_b.matrix(), q.dtype).transpose(1, 2),
        )
        # attention in the latent space: every head reads the one latent "head" (GQA with 1 kv head)
        lat = _attention(torch.cat((q_lat, q_pe), dim=-1), torch.cat((c, k_pe), dim=-1), c, at, cfg.kq_scale, allowed)
        out = torch.matmul(lat, as_dtype(self.v_b.matrix(), q.dtype).transpose(1, 2))  # [B, H, T, v]
        return self.wo(out.transpose(1, 2).reshape(B, T, cfg.n_heads * cfg.v_dim))


def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, at, scale: float, allowed: torch.Tensor | None
) -> torch.Tensor:
    """Causal attention (``allowed`` None), or attention on the keys ``allowed`` [B, 1, T, S] marks."""
    if allowed is None:
        return causal_attention(q, k, v, at, scale)
    H, Hk = q.shape[1], k.shape[1]
    if Hk == 1 and H > 1:  # one latent head: the heads become rows of one query (as causal_attention does)
        B, _, T, _ = q.shape
        out = F.scaled_dot_product_attention(
            q.reshape(B, 1, H * T, -1), k, v, attn_mask=allowed.repeat(1, 1, H, 1), scale=scale
        )
        return out.view(B, H, T, -1)
    # SDPA with a mask holds every score: query rows in chunks of at most MASKED_SCORES
    step = max(1, MASKED_SCORES // (q.shape[0] * H * k.shape[2]))
    return torch.cat(
        [
            F.scaled_dot_product_attention(
                q[:, :, a : a + step], k, v, attn_mask=allowed[:, :, a : a + step], scale=scale, enable_gqa=H != Hk
            )
            for a in range(0, q.shape[2], step)
        ],
        dim=2,
    )
