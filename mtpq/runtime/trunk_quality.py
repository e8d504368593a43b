"""One quality report per quant: the trunk's KLD/PPL/top-1 as llama-perplexity measures them, next to the MTP
head's acceptance.

    ref = QualityRun("f16.gguf"); q = QualityRun("q4km.gguf")
    compare_runs(ref, [q], text, n_ctx=512)       # -> FileQuality per file

Chunking is llama-perplexity's (tools/perplexity/perplexity.cpp): the text is tokenized once (BOS first when
the vocabulary adds one), cut into ``n_chunk = len(tokens) // n_ctx`` chunks of ``n_ctx`` tokens (at most
``--chunks``), each chunk's first token replaced by BOS when the vocabulary adds one, evaluated from position 0
without a cache, and scored from ``first = n_ctx // 2``: the logits at positions first..n_ctx-2 against the
next token. Its statistics, per scored position: NLL of the quant and of the reference, KLD(ref || quant) over
the vocabulary (terms where the reference's log-probability is above -16, as llama-perplexity keeps them),
whether both top tokens agree, and p_quant(next) - p_ref(next).

The head column is the teacher-forced estimator's depth-1 acceptance on the same chunks: at every position
j >= first, the head's draft from the pair (h_{j-1}, x_j) against the file's own trunk's argmax at j.

Reference and quants run a group of chunks at a time (all files loaded; as many chunks per packed pass as keep
its logits under PACK_LOGITS values, one chunk for a 150k vocabulary): a group's reference log-probabilities are
computed once, compared with every quant's and dropped; nothing vocabulary-sized is kept across groups.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..errors import InputError
from .importance import chunk_tokens
from .layers import Packing
from .speculative import PACK_LOGITS, block_argmax, pack_rows

# "llama.cpp": every weight's input rounded as llama.cpp's CPU backend rounds it before its dot products (Q8_K for
# k-quants, Q8_0 for legacy types, f16 for f16 weights), so the figures are llama-perplexity's; "exact": f32
# products of the stored weights, the quantization error alone
NUMERICS = ("llama.cpp", "exact")
KLD_LOG_FLOOR = -16.0  # llama-perplexity skips reference log-probabilities at or below this in its KLD sum


def perplexity_chunks(tokens: list[int], n_ctx: int, n_chunks: int | None, bos: int | None) -> list[list[int]]:
    """llama-perplexity's chunks: ``n_ctx`` tokens each, the first replaced by BOS when the vocabulary adds one
    (llama-imatrix cuts its text the same way)."""
    return chunk_tokens(tokens, n_ctx, n_chunks, bos)


def percentile(sorted_values: list[float], fraction: float) -> float:
    """llama-perplexity's percentile: linear interpolation between the two nearest of the sorted values."""
    if fraction <= 0:
        return sorted_values[0]
    if fraction >= 1:
        return sorted_values[-1]
    p = fraction * (len(sorted_values) - 1)
    i = int(p)
    p -= i
    return (1 - p) * sorted_values[i] + p * sorted_values[min(i + 1, len(sorted_values) - 1)]


def median(sorted_values: list[float]) -> float:
    n = len(sorted_values)
    return sorted_values[n // 2] if n % 2 else 0.5 * (sorted_values[n // 2] + sorted_values[n // 2 - 1])


@dataclass
class FileQuality:
    """The figures of one file (the reference's trunk columns compare it with itself)."""

    file: str
    size_bytes: int
    bits_per_weight: float
    nll: list[float] = field(default_factory=list)  # per scored position
    nll_ref: list[float] = field(default_factory=list)
    kld: list[float] = field(default_factory=list)
    p_diff: list[float] = field(default_factory=list)
    same_top: int = 0
    head_matches: int = 0
    head_positions: int = 0
    has_head: bool = True

    @property
    def count(self) -> int:
        return len(self.nll)

    @property
    def ppl(self) -> float:
        return math.exp(sum(self.nll) / self.count)

    @property
    def accept_rate(self) -> float | None:
        return self.head_matches / self.head_positions if self.has_head and self.head_positions else None

    def summary(self, reference: "FileQuality | None" = None) -> dict:
        """The report's figures (llama-perplexity's definitions; fractions, nats)."""
        kld = sorted(self.kld)
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        out = {
            "file": self.file,
            "size_bytes": self.size_bytes,
            "bits_per_weight": round(self.bits_per_weight, 4),
            "positions": self.count,
            "ppl": self.ppl,
            "ppl_ratio": math.exp(mean(self.nll) - mean(self.nll_ref)),
            "kld_mean": mean(kld),
            "kld_median": median(kld),
            "kld_p99": percentile(kld, 0.99),
            "kld_max": kld[-1],
            "top1": self.same_top / self.count,
            "dp_rms": math.sqrt(mean([d * d for d in self.p_diff])),
            "accept_rate": self.accept_rate,
        }
        ref_rate = reference.accept_rate if reference is not None else None
        out["accept_drop"] = (
            (ref_rate - self.accept_rate) if ref_rate is not None and self.accept_rate is not None else None
        )
        return out


class QualityRun:
    """One GGUF loaded for the runtime, and the figures gathered for it."""

    def __init__(
        self,
        path: Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        numerics: str = "llama.cpp",
        head: Path | None = None,
    ):
        """``head``: a head file drafting for the trunk at ``path`` (:class:`~mtpq.gguf_io.pair.PairedGGUF`)."""
        from ..gguf_io import GGUFFile
        from ..gguf_io.pair import PairedGGUF
        from .families import load
        from .tokenizer import tokenizer_from_gguf

        self.path = Path(path)
        g = GGUFFile(self.path) if head is None else PairedGGUF(self.path, Path(head))
        if numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {NUMERICS}, got {numerics!r}")
        self.model = load(self.path, device=device, dtype=dtype, g=g, llama_cpp_numerics=numerics == "llama.cpp")
        self.tokenizer = tokenizer_from_gguf(g)
        size, n = g.nbytes, g.n_elements
        self.add_bos = bool(g.kv.get("tokenizer.ggml.add_bos_token"))
        self.quality = FileQuality(str(self.path), size, 8 * size / max(n, 1), has_head=self.model.mtp is not None)

    @torch.inference_mode()
    def chunk(self, ids: list[int], first: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log-probabilities at positions first..n-1 [n - first, V] in float32, the head's depth-1 matches at
        those positions [n - first] or None without a head), from one uncached trunk pass and one head pass."""
        return self.chunks([ids], first)[0]

    @torch.inference_mode()
    def chunks(self, group: list[list[int]], first: int) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """:meth:`chunk` of each of ``group``, packed into one trunk pass and one head pass (a pass over one short
        chunk is mostly per-op overhead and dequantizing every weight)."""
        model = self.model
        dev = model.device
        lengths = [len(ids) for ids in group]
        at = [0, *itertools.accumulate(lengths)]
        seq = torch.tensor([[t for ids in group for t in ids]])
        rows = torch.cat([torch.arange(a + first, a + n) for a, n in zip(at, lengths)])
        trunk = model.trunk(seq, use_cache=False, packing=Packing(lengths, dev), logit_rows=rows.to(dev))
        logits = trunk.logits[0]
        counts = [n - first for n in lengths]
        matches = [None] * len(group)
        if model.mtp is not None:
            # per chunk the pairs (h_t, x_{t+1}), t = 0..n-2; the drafts from t = first-1.. predict x_{t+2}:
            # compared with the trunk's argmax at t+1 = first..n-1
            head_ids, states, packing = model.head_rows(seq, trunk.hidden, lengths, out_from=[first - 1] * len(group))
            head = model.draft(head_ids, states, use_cache=False, packing=packing)
            matches = list((block_argmax(head.logits[0]) == block_argmax(logits)).split(counts))
        logp = torch.log_softmax(logits.float(), dim=-1).split(counts)
        return list(zip(logp, matches))


def score_chunk(q: FileQuality, logp: torch.Tensor, logp_ref: torch.Tensor, next_ids: torch.Tensor) -> None:
    """Add one chunk's scored positions (rows of logp/logp_ref predict next_ids) to ``q``."""
    nll = -logp.gather(1, next_ids[:, None])[:, 0].double()
    nll_ref = -logp_ref.gather(1, next_ids[:, None])[:, 0].double()
    kept = logp_ref > KLD_LOG_FLOOR
    terms = torch.where(kept, logp_ref.exp() * (logp_ref - logp), torch.zeros((), dtype=logp.dtype))
    kld = terms.double().sum(dim=1)
    q.nll += nll.tolist()
    q.nll_ref += nll_ref.tolist()
    q.kld += kld.tolist()
    q.p_diff += (torch.exp(-nll) - torch.exp(-nll_ref)).tolist()
    q.same_top += int((block_argmax(logp) == block_argmax(logp_ref)).sum())


def compare_runs(
    reference: QualityRun,
    quants: list[QualityRun],
    text: str,
    n_ctx: int = 512,
    n_chunks: int | None = None,
    on_chunk: Callable[[int, int], None] | None = None,
) -> int:
    """Score every quant against the reference on llama-perplexity's chunks of ``text``; returns the chunk count.
    The reference's own figures (its PPL, its head's rate) land in ``reference.quality``."""
    if n_ctx < 4:
        raise InputError("--ctx-size", f"must be at least 4, got {n_ctx}")
    vocab = reference.model.vocab_size
    for q in quants:
        if q.model.vocab_size != vocab:
            raise InputError(q.path, f"vocabulary of {q.model.vocab_size} tokens; the reference has {vocab}")
    bos = reference.tokenizer.bos_token_id if reference.add_bos else None
    tokens = reference.tokenizer.encode(text)  # BOS first when the vocabulary adds one, as common_tokenize
    if len(tokens) < 2 * n_ctx:
        raise InputError(
            "--text",
            f"tokenizes to {len(tokens)} tokens; a context of {n_ctx} needs at least "
            f"{2 * n_ctx} (llama-perplexity's rule): give more text or a smaller --ctx-size",
        )
    chunks = perplexity_chunks(tokens, n_ctx, n_chunks, bos)
    first = n_ctx // 2
    per_pass = max(1, min(pack_rows(reference.model) // n_ctx, PACK_LOGITS // ((n_ctx - first) * vocab)))
    done = 0
    for g in range(0, len(chunks), per_pass):
        group = chunks[g : g + per_pass]
        refs = reference.chunks(group, first)
        for ids, (logp_ref, matches) in zip(group, refs):
            _add(reference, logp_ref, logp_ref, matches, torch.tensor(ids[first + 1 :], device=logp_ref.device))
        for q in quants:  # one quant's group at a time beside the reference's
            for ids, (logp_ref, _), (logp, matches) in zip(group, refs, q.chunks(group, first)):
                _add(
                    q,
                    logp.to(logp_ref.device),
                    logp_ref,
                    matches,
                    torch.tensor(ids[first + 1 :], device=logp_ref.device),
                )
        del refs
        done += len(group)
        if on_chunk is not None:
            on_chunk(done, len(chunks))
    return len(chunks)


def compare_with_base(
    base, quants: list[QualityRun], n_chunks: int | None = None, on_chunk: Callable[[int, int], None] | None = None
) -> FileQuality:
    """Score every quant against a reference's log-probabilities as ``llama-perplexity --kl-divergence-base``
    saved them (``base``: a :class:`~mtpq.engines.kld_base.KldBase`), on the file's own tokens and chunks.
    Returns the reference's figures (its PPL; it has no head here)."""
    for q in quants:
        if q.model.vocab_size != base.n_vocab:
            raise InputError(
                q.path, f"vocabulary of {q.model.vocab_size} tokens; {base.path.name} was written for {base.n_vocab}"
            )
    reference = FileQuality(str(base.path), base.path.stat().st_size, 0.0, has_head=False)
    n = base.n_chunk if n_chunks is None else min(n_chunks, base.n_chunk)
    first = base.first
    per_pass = max(
        1, min(pack_rows(quants[0].model) // base.n_ctx, PACK_LOGITS // ((base.n_ctx - first) * base.n_vocab))
    )
    for g in range(0, n, per_pass):
        chunks = list(range(g, min(n, g + per_pass)))
        group = [base.tokens(c) for c in chunks]
        logp_refs = [torch.from_numpy(base.log_probs(c)) for c in chunks]
        for ids, logp_ref in zip(group, logp_refs):  # the reference against itself: its NLL, hence its PPL
            score_chunk(reference, logp_ref, logp_ref, torch.tensor(ids[first + 1 :]))
        for q in quants:
            bos = q.tokenizer.bos_token_id if q.add_bos else None  # as llama-perplexity, by the quant's vocabulary
            seqs = [[bos, *ids[1:]] if bos is not None else ids for ids in group]
            for ids, logp_ref, (logp, matches) in zip(group, logp_refs, q.chunks(seqs, first)):
                _add(
                    q,
                    logp,
                    logp_ref.to(logp.device),
                    matches,
                    torch.tensor(ids[first + 1 :], device=logp.device),
                    ref_rows=True,
                )
        if on_chunk is not None:
            on_chunk(chunks[-1] + 1, n)
    return reference


def _add(
    run: QualityRun,
    logp: torch.Tensor,
    logp_ref: torch.Tensor,
    matches: torch.Tensor | None,
    next_ids: torch.Tensor,
    ref_rows: bool = False,
) -> None:
    """One chunk of one file: the trunk's statistics on positions first..n-2, the head's on first..n-1
    (``ref_rows``: ``logp_ref`` holds the scored positions only, as a base file does)."""
    score_chunk(run.quality, logp[:-1], logp_ref if ref_rows else logp_ref[:-1], next_ids)
    if matches is not None:
        run.quality.head_matches += int(matches.sum())
        run.quality.head_positions += int(matches.numel())
