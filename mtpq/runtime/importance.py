"""Importance statistics (llama-imatrix's) collected with the runtime, for the trunk AND the MTP head.

For every matrix a block multiplies with (``blk.*`` tensors; the output matrix is
left out, as llama-imatrix does by default), the sum over tokens of the squared
input entering it, and how many token rows contributed; per expert for stacked MoE
experts (a token routed to expert e counts for e only). Dense products over fewer
than 16 rows are ignored, like llama-imatrix (it never sees them in one batch).

Chunking follows ``llama-imatrix``: the calibration text is tokenized once (with the
model's BOS rule), cut into ``n_ctx``-token chunks (a trailing partial chunk is
dropped), each chunk evaluated from an empty cache with its first token replaced by
BOS when the vocabulary adds one.

The head is run the way it drafts: on the trunk's hidden states h_t (the state the
family's head is fed) and the next tokens x_{t+1} of each chunk (``n_ctx - 1`` pairs), so
its matrices get importance data that llama-imatrix cannot collect (it never runs the
head). Chained heads (Step-3.5, MiMo-V2.5) each take the same pairs, as every head's cache
takes the real pairs when they draft. The
head's own embedding table (``nextn.embed_tokens``) is looked up, not multiplied:
no input reaches it, so it gets uniform importance (every column weighs 1, i.e. no
preference) -- without an entry llama-quantize refuses to give it a low-bit i-quant.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from . import weights
from .model import MtpModel

MIN_DENSE_ROWS = 16


@dataclass
class TensorStats:
    sums: np.ndarray  # float64 [n_mat, n_in]: sum of squared inputs (n_mat = experts, or 1)
    counts: np.ndarray  # int64 [n_mat]: token rows that contributed


@dataclass
class ImatrixStats:
    tensors: dict[str, TensorStats] = field(default_factory=dict)
    chunks: int = 0
    chunk_size: int = 0


class _Collector:
    def __init__(self, n_experts: dict[str, int], stats: ImatrixStats):
        self.n_experts, self.stats = n_experts, stats

    def __call__(self, name: str, expert: int | None, x: torch.Tensor) -> None:
        if not name.startswith("blk."):
            return
        rows = x.reshape(-1, x.shape[-1])
        if expert is None and rows.shape[0] < MIN_DENSE_ROWS:
            return
        sq = rows.double().pow(2).sum(dim=0).cpu().numpy()
        st = self.stats.tensors.get(name)
        if st is None:
            n_mat = self.n_experts.get(name, 1)
            st = self.stats.tensors[name] = TensorStats(np.zeros((n_mat, sq.size)), np.zeros(n_mat, dtype=np.int64))
        row = 0 if expert is None else expert
        st.sums[row] += sq
        st.counts[row] += rows.shape[0]

    def uniform(self, name: str, n_in: int, n_rows: int) -> None:
        """``n_rows`` uses of a table with no input activations: sums = counts, so every weight is 1."""
        st = self.stats.tensors.setdefault(name, TensorStats(np.zeros((1, n_in)), np.zeros(1, dtype=np.int64)))
        st.sums += n_rows
        st.counts += n_rows


def expert_counts(model: MtpModel) -> dict[str, int]:
    """Stacked-expert weight name -> number of experts (3-D weights)."""
    return {m.name: m.shape[0] for m in model.modules() if isinstance(m, weights.QWeight) and len(m.shape) == 3}


def chunk_tokens(tokens: list[int], n_ctx: int, max_chunks: int | None, bos_id: int | None) -> list[list[int]]:
    """llama-imatrix's chunks: whole n_ctx windows, the first token of each replaced by BOS when set."""
    n = len(tokens) // n_ctx
    if max_chunks is not None and max_chunks > 0:
        n = min(n, max_chunks)
    out = []
    for i in range(n):
        chunk = list(tokens[i * n_ctx : (i + 1) * n_ctx])
        if bos_id is not None:
            chunk[0] = bos_id
        out.append(chunk)
    return out


@torch.no_grad()
def collect(
    model: MtpModel,
    chunks: list[list[int]],
    trunk: bool = True,
    head: bool = True,
    on_chunk: Callable[[int, int], None] | None = None,
) -> ImatrixStats:
    """Statistics over ``chunks`` (see :func:`chunk_tokens`) for the trunk and/or the MTP head."""
    stats = ImatrixStats(chunk_size=len(chunks[0]) if chunks else 0)
    watch = _Collector(expert_counts(model), stats)
    try:
        for i, chunk in enumerate(chunks):
            ids = torch.tensor([chunk])
            weights.observer = watch if trunk else None
            out = model.trunk(ids, use_cache=False)
            for h, module in enumerate([model.mtp, *model.later_heads] if head and model.mtp is not None else []):
                weights.observer = watch
                model.draft(ids[:, 1:], out.hidden[:, :-1], use_cache=False, head=h)
                if not module.tied_embed:
                    watch.uniform(module.embed.name, module.embed.shape[-1], len(chunk) - 1)
            weights.observer = None
            stats.chunks += 1
            if on_chunk:
                on_chunk(i + 1, len(chunks))
    finally:
        weights.observer = None
    return stats
