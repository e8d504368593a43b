"""DeepSeek Sparse Attention (DSA): MLA whose queries each read only the keys a lightning indexer picks, as
llama.cpp's deepseek32 and glm-dsa graphs compute it (src/models/deepseek32.cpp, glm-dsa.cpp).

The indexer of a layer (tensors ``blk.N.indexer.*``), for the normed block input x and the query latent
qr = attn_q_a_norm(attn_q_a(x)) that MLA's queries also start from:

    q_h = rope(attn_q_b(qr))_h          H heads of D dims; RoPE on the first n_rot dims ([rope | nope])
    k   = rope(LayerNorm(attn_k(x)))    one key per token (LayerNorm with weight and bias)
    w_h = proj(x)_h / sqrt(D * H)
    score(t, s) = sum_h relu(q_h(t) . k(s)) * w_h(t)       keys s <= t only

and each query t attends to the ``top_k`` keys of highest score (all of them while t + 1 <= top_k). The
indexer's RoPE is the model's (frequencies, YaRN and its cos/sin factor) in the arch's own pair order
(deepseek32: NeoX halves; glm-dsa: adjacent pairs). llama.cpp rotates q and k by an orthonormal
Walsh-Hadamard matrix (q . k stays what it is, up to rounding) and stores k in its KV cache type: f32 here;
with ``llama_cpp_numerics`` (``Weights.round_inputs``) the rotated keys are rounded to f16, as llama.cpp's
default cache stores them. The top-k is a discrete choice that such a rounding can flip where two scores
nearly tie. Exact ties at the k-th score (keys whose dot products are all negative score exactly 0) are broken
as ggml's CPU top-k breaks them: libstdc++'s ``std::partial_sort`` over the keys in cache order
(:func:`heap_select`).

GLM-5.2's "shared" layers have no indexer and reuse the selection of the last "full" layer before them in
the same pass (:class:`Selections`). MTP blocks run dense MLA: llama.cpp's MTP graphs never run the indexer.
The latent cache holds c, k_pe and the indexer key per token (a :class:`~mtpq.runtime.cache.KVCache`;
rolling back is a trim).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .cache import KVCache
from .layers import Packing, Rope, take_rows
from .mla import MLA, MLAConfig
from .weights import Scope, as_dtype

SCORE_CHUNK = 1 << 24  # indexer dot products computed at once (query rows are taken in chunks below this)


@dataclass(frozen=True)
class IndexerConfig:
    n_heads: int
    head_dim: int
    top_k: int
    norm_eps: float  # the keys' LayerNorm epsilon (llama.cpp's f_norm_eps)


def hadamard(n: int) -> torch.Tensor:
    """ggml's orthonormal Walsh-Hadamard matrix [n, n] (n a power of two; llama-kv-cache.cpp ggml_gen_hadamard):
    Sylvester's construction from 1 / sqrtf(n), in float32."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"the indexer's key length {n} is not a power of two")
    h = np.full((1, 1), np.float32(1.0) / np.sqrt(np.float32(n)), dtype=np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return torch.from_numpy(h)


class Selections:
    """The top-k selections of one pass, kept for GLM-5.2's shared layers: a full layer puts its own (per
    sequence of a packed pass: ``key``), the shared layers after it take it."""

    def __init__(self) -> None:
        self._last: dict = {}

    def put(self, key, allowed: torch.Tensor | None) -> None:
        self._last[key] = allowed

    def get(self, key) -> torch.Tensor | None:
        if key not in self._last:
            raise RuntimeError("a shared indexer layer runs before any full one")
        return self._last[key]


class LightningIndexer(nn.Module):
    """The indexer of one layer: its keys (cached beside MLA's latent) and the scores of queries against them."""

    def __init__(self, w: Scope, cfg: IndexerConfig, rope: Rope):
        super().__init__()
        self.cfg, self.rope = cfg, rope
        self.wq_b, self.wk = (
            w.linear("indexer.attn_q_b.weight", bias=False),
            w.linear("indexer.attn_k.weight", bias=False),
        )
        self.k_norm, self.k_norm_b = w.tensor("indexer.k_norm.weight"), w.tensor("indexer.k_norm.bias")
        self.proj = w.linear("indexer.proj.weight", bias=False)
        self.register_buffer("rotation", hadamard(cfg.head_dim).to(w.weights.device), persistent=False)
        self.key_dtype = torch.float16 if w.weights.round_inputs else None  # the keys' storage type in the cache
        self.activation = torch.relu  # on each head's dot products, before the heads' weights

    def keys(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """x [B, T, hidden] at positions start.. -> the keys as the cache holds them [B, 1, T, D]."""
        cfg = self.cfg
        k = F.layer_norm(self.wk(x), (cfg.head_dim,), self.k_norm, self.k_norm_b, cfg.norm_eps)
        k = self._rotated(self.rope.apply(k[:, None], start))
        return k if self.key_dtype is None else k.to(self.key_dtype).to(x.dtype)

    def _rotated(self, t: torch.Tensor) -> torch.Tensor:
        return torch.matmul(t, as_dtype(self.rotation, t.dtype))

    def scores(self, qr: torch.Tensor, xq: torch.Tensor, keys: torch.Tensor, q_at) -> torch.Tensor:
        """Scores [B, T, S] of the query rows (latent ``qr`` [B, T, q_lora], normed input ``xq`` [B, T, hidden],
        positions ``q_at``) against the cached keys [B, 1, S, D]; keys after a query's position are -inf."""
        cfg = self.cfg
        B, T, _ = qr.shape
        S = keys.shape[2]
        q = self._rotated(self.rope.apply(self.wq_b(qr).view(B, T, cfg.n_heads, cfg.head_dim).transpose(1, 2), q_at))
        weights = (self.proj(xq) * (1.0 / math.sqrt(cfg.head_dim * cfg.n_heads))).transpose(1, 2)[..., None]
        step = max(1, SCORE_CHUNK // max(1, B * cfg.n_heads * S))
        out = torch.cat(
            [
                (
                    self.activation(torch.matmul(q[:, :, a : a + step], keys.transpose(-1, -2)))
                    * weights[:, :, a : a + step]
                ).sum(dim=1)
                for a in range(0, T, step)
            ],
            dim=1,
        )
        return out.masked_fill(~_visible(q_at, T, S, out.device), float("-inf"))


def _positions(q_at, T: int, device: torch.device) -> torch.Tensor:
    """The query rows' positions [B or 1, T] (``q_at``: a start, or the positions themselves)."""
    if isinstance(q_at, torch.Tensor):
        return q_at.to(device)
    return torch.arange(q_at, q_at + T, device=device)[None]


def _visible(q_at, T: int, S: int, device: torch.device) -> torch.Tensor:
    """[B or 1, T, S]: key s is at or before the query's position."""
    return torch.arange(S, device=device) <= _positions(q_at, T, device)[..., None]


def top_k_allowed(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """The keys each query reads [B, 1, T, S] (bool) from its scores [B, T, S] (-inf where not visible): the
    ``top_k`` best visible keys, every visible key while a query sees at most ``top_k``. On the CPU, ties at the
    k-th score are broken as ggml's CPU top-k does (:func:`heap_select`); on other devices as torch.topk does,
    with no host sync (llama.cpp's GPU backends have top-k kernels of their own)."""
    B, T, S = scores.shape
    k = min(top_k, S)
    best = scores.topk(min(k + 1, S), dim=-1)
    allowed = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, best.indices[..., :k], True)
    allowed &= scores > float("-inf")
    if k < S and scores.device.type == "cpu":  # a query that sees more than k keys and whose k-th and (k+1)-th
        # scores tie: the heap decides
        kth, nxt = best.values[..., k - 1], best.values[..., k]
        for b, t in ((kth == nxt) & (nxt > float("-inf"))).nonzero().tolist():
            row = scores[b, t]
            visible = int((row > float("-inf")).sum())
            allowed[b, t] = False
            allowed[b, t, heap_select(row[:visible].tolist(), k)] = True
    return allowed[:, None]


def heap_select(values: list[float], k: int) -> list[int]:
    """The indices of the ``k`` largest ``values`` as libstdc++'s ``std::partial_sort(first, first + k, last,
    greater)`` leaves them in its first k slots (ggml_compute_forward_top_k_f32): a heap of the first k
    indices whose top is the smallest, replaced by each later index whose value is strictly greater. Only
    the choice among equal values depends on the heap's order, so it is followed move for move."""
    heap = list(range(k))

    def before(a: int, b: int) -> bool:  # the comparator: a sorts before b
        return values[a] > values[b]

    def adjust(hole: int, n: int, item: int) -> None:  # std::__adjust_heap, then std::__push_heap
        top, child = hole, hole
        while child < (n - 1) // 2:
            child = 2 * (child + 1)
            if before(heap[child], heap[child - 1]):
                child -= 1
            heap[hole] = heap[child]
            hole = child
        if n % 2 == 0 and child == (n - 2) // 2:
            child = 2 * (child + 1)
            heap[hole] = heap[child - 1]
            hole = child - 1
        parent = (hole - 1) // 2
        while hole > top and before(heap[parent], item):
            heap[hole] = heap[parent]
            hole, parent = parent, (parent - 1) // 2
        heap[hole] = item

    if k >= 2:  # std::__make_heap
        for parent in range((k - 2) // 2, -1, -1):
            adjust(parent, k, heap[parent])
    for i in range(k, len(values)):  # std::__heap_select
        if before(i, heap[0]):
            adjust(0, k, i)  # std::__pop_heap with i as the new value
    return heap


class SparseMLA(MLA):
    """MLA (``mla.py``) whose queries read only the keys the indexer selects: a layer with an ``indexer`` selects
    (and puts its selection in ``selections``), one without reuses the last full layer's (GLM-5.2's shared
    layers). While no query sees more than top_k keys, attention is plain causal MLA."""

    def __init__(
        self, w: Scope, cfg: MLAConfig, rope: Rope, indexer: LightningIndexer | None, top_k: int, selections: Selections
    ):
        super().__init__(w, cfg, rope)
        self.indexer, self.top_k, self.selections = indexer, top_k, selections
        self.select = top_k_allowed

    def new_cache(self) -> KVCache:
        return KVCache()  # c, k_pe and (full layers) the indexer's key, per token

    def forward(
        self, x: torch.Tensor, start: int, cache: KVCache | None, rows: torch.Tensor | None = None, key=None
    ) -> torch.Tensor:
        """As :meth:`MLA.forward`; ``key`` names the sequence of a packed pass (:class:`Selections`)."""
        xq = x if rows is None else take_rows(x, rows)
        at = start if rows is None else start + rows
        qr = self.q_latent(xq)
        q, q_pe, c, k_pe = self._project(x, xq, at, start, qr=qr)
        if self.indexer is None:
            if cache is not None:
                c, k_pe = cache.update(c, k_pe)
            return self.attend(q, q_pe, c, k_pe, at, self.selections.get(key))
        keys = self.indexer.keys(x, start)
        if cache is not None:
            c, k_pe, keys = cache.update(c, k_pe, keys)
        S = c.shape[2]
        allowed = None if S <= self.top_k else self.select(self.indexer.scores(qr, xq, keys, at), self.top_k)
        self.selections.put(key, allowed)
        return self.attend(q, q_pe, c, k_pe, at, allowed)

    def forward_packed(self, x: torch.Tensor, packing: Packing) -> torch.Tensor:
        """Packed sequences (layers.Packing), each on its own from position 0: x [1, N, H] -> [1, kept rows, H]."""
        outs, at = [], 0
        for i, (T, first) in enumerate(zip(packing.lengths, packing.firsts)):
            rows = None if first == 0 else torch.arange(first, T, device=x.device)[None]
            outs.append(self.forward(x[:, at : at + T], 0, None, rows, key=i))
            at += T
        return torch.cat(outs, dim=1)
