"""Self-speculative decoding with the MTP head, plain decoding, and a teacher-forced estimator.

API (what ``mtpq accept`` builds on):

    model, tok = load_model("m.gguf", device="cpu", dtype=torch.float32)
    ids = tok.encode("def f(x):")
    spec = run_speculative(model, ids, max_new_tokens=64, k=3)                 # greedy
    spec = run_speculative(model, ids, 64, k=3, temperature=0.8, top_p=0.95, seed=1)
    base = run_plain(model, ids, 64)                                          # no drafting
    tf = teacher_forced_acceptance(model, ids + base.tokens, prompt_len=len(ids))
    from mtpq.acceptance.metrics import metrics_from_rounds; metrics_from_rounds([spec]).acceptance_rate

One speculative round (``SpeculativeDecoder.step``), with x_j the last emitted token:
1. the head consumes the pending real pairs (h_t, x_{t+1}) -- the trunk states of the
   tokens accepted last round -- and drafts d_1 from the last one;
2. drafts d_2..d_k reuse the head on (its own output, its own last draft); with several heads
   (:attr:`MtpModel.chained`: llama.cpp's ``chain_heads``) every head the decoder drafts with
   consumes the same real pairs, and d_{i+1} comes from head i run on the chain
   (d_1, o_0) .. (d_i, o_{i-1}), o_j being head j's output for its last row; k is capped at
   the number of heads, as llama.cpp caps it;
3. the trunk verifies [x_j, d_1..d_k] in one forward (k+1 logits);
4. greedy: accept while d_i == argmax; sampling: accept d_i with probability
   min(1, p(d_i)/q(d_i)), else emit a token drawn from norm(max(0, p - q)) and stop;
   if all k are accepted, a bonus token is drawn from the last logits;
5. every KV cache is rolled back: the trunk's to the accepted tokens, the heads' to
   their real pairs (entries written while drafting 2..k are discarded).
Greedy speculative output equals plain greedy output; sampling keeps the target
distribution (p and q both pass through the same temperature/top-k/top-p).

A round that drafted k tokens and accepted a of them emits a + 1 tokens;
``GenerationResult.accepted[i]`` is a for round i (vLLM's counting, see mtpq.acceptance.metrics).
Generation stops after ``max_new_tokens`` (the last round's surplus is cut) or a
token in ``stop_ids``. ``SpeculativeDecoder.save``/``restore`` rewind a decoder to a
saved point (the caches are rolled back), e.g. to repeat one round many times.

Randomness: a CPU ``torch.Generator`` seeded with ``seed`` drives every draw, so a
run is reproducible for a given seed (the model may run on CUDA).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..acceptance.metrics import ROUNDS, GenerationResult
from . import finite
from .families import load
from .layers import Packing
from .model import MtpModel
from .weights import GGUFFile

# ----------------------------------------------------------------------------- loading


def load_model(
    path: Path | str,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    hidden: str = "auto",
    head: Path | str | None = None,
) -> tuple[MtpModel, object]:
    """(model, tokenizer) from a GGUF of any family the runtime has. device: CUDA when available unless
    given. hidden: see model.py. head: a head file (``mtp-*.gguf``) whose MTP blocks draft for the trunk at
    ``path``, as llama.cpp's ``-md`` (:class:`~mtpq.gguf_io.pair.PairedGGUF`)."""
    from ..gguf_io.pair import PairedGGUF
    from .tokenizer import tokenizer_from_gguf

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    g = GGUFFile(Path(path)) if head is None else PairedGGUF(Path(path), Path(head))
    return load(path, device=device, dtype=dtype, hidden=hidden, g=g), tokenizer_from_gguf(g)


# ----------------------------------------------------------------------------- sampling


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Sampling distribution [..., V] (float32) after temperature, top-k and top-p."""
    logits = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly above each token
        sorted_p = sorted_p.masked_fill(before >= params.top_p, 0.0)  # keep the smallest set reaching top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _draw(probs: torch.Tensor, gen: torch.Generator) -> int:
    return int(torch.multinomial(probs.cpu(), 1, generator=gen).item())


def accept_drafts(
    target_logits: torch.Tensor,
    drafts: list[int],
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    gen: torch.Generator | None,
) -> tuple[int, int]:
    """Verify k drafts against k+1 target logits -> (number accepted, next token).

    Greedy: accept while the draft is the target's argmax; the next token is the argmax
    after the accepted prefix. Sampling (``draft_probs`` [k, V] = the q the drafts were
    drawn from): the rejection rule of speculative sampling (Leviathan et al. 2023, alg. 1).
    """
    if params.greedy:
        best = target_logits.argmax(dim=-1).tolist()
        a = 0
        while a < len(drafts) and drafts[a] == best[a]:
            a += 1
        return a, best[a]
    p = probs_from_logits(target_logits, params).cpu()
    q = draft_probs.cpu()
    for i, d in enumerate(drafts):
        ratio = p[i, d] / q[i, d]
        if torch.rand((), generator=gen) < ratio:  # accept with probability min(1, p/q)
            continue
        residual = (p[i] - q[i]).clamp(min=0.0)
        if residual.sum() <= 0:  # p == q up to rounding: rejection had probability ~0
            residual = p[i]
        return i, _draw(residual / residual.sum(), gen)
    return len(drafts), _draw(p[len(drafts)], gen)  # all accepted: the bonus token


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _choose(
    logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None
) -> tuple[int, torch.Tensor | None]:
    """Pick a token from logits [V]: (token, the distribution it was drawn from or None when greedy)."""
    if params.greedy:
        return int(logits.argmax().item()), None
    probs = probs_from_logits(logits, params).cpu()
    return _draw(probs, gen), probs


# ----------------------------------------------------------------------------- decoding


@dataclass
class DecoderState:
    """Everything needed to resume a speculative decoder (the caches are rolled back to ``caches``)."""

    tokens: list[int]
    caches: object  # MtpModel.checkpoint()
    pending_ids: torch.Tensor  # [1, n] tokens x_{t+1} of real pairs the head has not consumed yet
    pending_hidden: torch.Tensor  # [1, n, H] their trunk states h_t
    rng_state: torch.Tensor | None


class SpeculativeDecoder:
    """MTP self-speculative decoding of one sequence. ``prefill`` once, then ``step`` repeatedly."""

    def __init__(self, model: MtpModel, k: int, params: SamplingParams = SamplingParams(), seed: int = 0):
        if not 1 <= k <= 8:
            raise ValueError(f"draft length k must be in 1..8, got {k}")
        if model.mtp is None:
            from ..errors import InputError

            raise InputError(model.path, "this GGUF has no MTP head: nothing to draft with")
        # chained heads: draft step i runs head i, so a round drafts at most one token per head
        self.model, self.k, self.params = model, min(k, model.n_heads) if model.chained else k, params
        self.heads = self.k if model.chained else 1  # the heads this decoder drafts with
        self.gen = None if params.greedy else torch.Generator().manual_seed(seed)
        self.tokens: list[int] = []
        self.trunk_forwards = 0

    def prefill(self, prompt_ids: list[int], draft_first: bool = False) -> int | None:
        """Run the trunk on the prompt and emit its first token. ``draft_first``: run it on all but the prompt's
        last token, which starts the first round, so the first new token is drafted and verified too (as
        llama.cpp's speculative drivers start); nothing is emitted (None)."""
        m = self.model
        m.reset()
        if draft_first:
            if len(prompt_ids) < 2:
                raise ValueError("draft_first needs a prompt of at least two tokens")
            *prompt_ids, first = prompt_ids
        out = m.trunk(torch.tensor([prompt_ids]))
        self.trunk_forwards += 1
        if not draft_first:
            first, _ = _choose(out.logits[0, -1], self.params, self.gen)
        self.tokens = list(prompt_ids) + [first]
        # real pairs (h_t, x_{t+1}) for t = 0..n-1, after the head's first pair (MtpModel.first_pair)
        self.pending_ids, self.pending_hidden = m.prompt_pairs(prompt_ids, first, out.hidden)
        return None if draft_first else first

    def step(self, k: int | None = None) -> tuple[list[int], list[int]]:
        """One draft-verify round drafting ``k`` tokens (at most, and by default, the decoder's) -> (emitted
        tokens, drafted tokens)."""
        k = self.k if k is None else max(1, min(k, self.k))
        if self.params.greedy:
            return self._greedy_step(k)
        m = self.model
        out = self._take_pending()
        ck = m.checkpoint()  # the heads have consumed every real pair; the trunk sits at x_j
        drafts, qs, chain = [], [], []
        logits, hidden = out.logits[0, -1], out.hidden[:, -1:]
        for i in range(k):
            d, q = _choose(logits, self.params, self.gen)
            drafts.append(d)
            qs.append(q)
            if i + 1 < k:
                out = self._draft_next(torch.tensor([drafts], device=m.device), hidden, chain)
                logits, hidden = out.logits[0, -1], out.hidden[:, -1:]
        verify = m.trunk(torch.tensor([[self.tokens[-1]] + drafts]))
        self.trunk_forwards += 1
        draft_probs = None if self.params.greedy else torch.stack(qs)
        a, nxt = accept_drafts(verify.logits[0], drafts, draft_probs, self.params, self.gen)
        m.rollback(ck, trunk_kept=1 + a, mtp_kept=0)  # keep x_j, d_1..d_a; drop the heads' draft-time entries
        emitted = drafts[:a] + [nxt]
        self.pending_ids = torch.tensor([emitted])
        self.pending_hidden = verify.hidden[:, : a + 1]
        self.tokens.extend(emitted)
        return emitted, drafts

    def _greedy_step(self, k: int) -> tuple[list[int], list[int]]:
        """:meth:`step` for greedy decoding, on the model's device: drafts, verification and the accepted count
        stay device tensors until one read-back at the end of the round (one host sync per round on a GPU)."""
        m = self.model
        with finite.deferred(m) as tests:  # (the passes' finite tests join the round's read-back)
            out = self._take_pending()
            ck = m.checkpoint()  # the heads have consumed every real pair; the trunk sits at x_j
            drafts, chain = [], []
            logits, hidden = out.logits[0, -1], out.hidden[:, -1:]
            for i in range(k):
                drafts.append(logits.argmax().view(1))
                if i + 1 < k:
                    out = self._draft_next(torch.cat(drafts)[None], hidden, chain)
                    logits, hidden = out.logits[0, -1], out.hidden[:, -1:]
            drafted = torch.cat(drafts)
            verify = m.trunk(torch.cat((self.pending_ids[0, -1:], drafted))[None])  # x_j: the last pending pair's
        self.trunk_forwards += 1
        best = verify.logits[0].argmax(dim=-1)  # [k + 1]
        accepted = (drafted == best[:k]).int().cumprod(dim=0).sum().view(1)  # drafts before the first miss
        finite_ok = tests.all_ok(best.device).view(1).to(best.dtype)
        ok, a, *values = torch.cat((finite_ok, accepted, best, drafted)).tolist()  # the round's one read-back
        if not ok:
            tests.settle()  # raises, naming the pass
        best_ids, draft_ids = values[: k + 1], values[k + 1 :]
        m.rollback(ck, trunk_kept=1 + a, mtp_kept=0)  # keep x_j, d_1..d_a; drop the heads' draft-time entries
        emitted = draft_ids[:a] + [best_ids[a]]
        self.pending_ids = torch.cat((drafted[:a], best[a : a + 1]))[None]
        self.pending_hidden = verify.hidden[:, : a + 1]
        self.tokens.extend(emitted)
        return emitted, draft_ids

    def _take_pending(self):
        """Every head this decoder drafts with consumes the pending real pairs (chained heads: the same pairs,
        as llama.cpp's catch-up pass gives every head) -> the first head's output."""
        m = self.model
        out = m.draft(self.pending_ids, self.pending_hidden)
        for head in range(1, self.heads):
            m.draft(self.pending_ids, self.pending_hidden, head=head)
        return out

    def _draft_next(self, drafted: torch.Tensor, hidden: torch.Tensor, chain: list):
        """The head output that drafts the round's next token after ``drafted`` [1, n] (``hidden``: the output
        that drafted the last). Chained: head n on the chain, each draft beside the output that drafted it
        (``chain`` collects them); else the one head on (its last output, the last draft), its cache holding the
        rest."""
        m = self.model
        if not m.chained:
            return m.draft(drafted[:, -1:], hidden)
        chain.append(hidden)
        return m.draft(drafted, torch.cat(chain, dim=1), head=drafted.shape[1])

    def save(self) -> DecoderState:
        return DecoderState(
            list(self.tokens),
            self.model.checkpoint(),
            self.pending_ids,
            self.pending_hidden,
            None if self.gen is None else self.gen.get_state(),
        )

    def restore(self, s: DecoderState) -> None:
        """Return to a saved state (valid until the model is reset)."""
        self.tokens = list(s.tokens)
        self.model.rollback(s.caches, trunk_kept=0, mtp_kept=0)
        self.pending_ids, self.pending_hidden = s.pending_ids, s.pending_hidden
        if s.rng_state is not None:
            self.gen.set_state(s.rng_state)


def _finish(tokens: list[int], max_new_tokens: int, stop_ids: set[int] | None) -> list[int]:
    tokens = tokens[:max_new_tokens]
    if stop_ids:
        for i, t in enumerate(tokens):
            if t in stop_ids:
                return tokens[: i + 1]
    return tokens


def _stopped(tokens: list[int], stop_ids: set[int] | None) -> bool:
    return bool(stop_ids) and any(t in stop_ids for t in tokens)


def run_speculative(
    model: MtpModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    k: int = 1,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_ids: set[int] | None = None,
    rounds: str = "llama-server",
) -> GenerationResult:
    """Generate ``max_new_tokens`` tokens (fewer after a stop token) with k-token MTP drafts.

    ``rounds`` says where the rounds fall, as one of llama.cpp's two drivers places them (greedy drafting
    accepts a different count on each, since a run of accepted drafts keeps its phase until a miss):
    - ``llama-server``: the prompt's pass emits the first new token, and drafting starts after it;
    - ``llama-speculative-simple``: the prompt's last token starts the first round, so the first new token is
      drafted and verified too; a round drafts at most the tokens still wanted less one (llama.cpp: 0 means no
      cap), and rounds go on until more than ``max_new_tokens`` were generated (the surplus is cut from
      ``tokens``, not from the counts). A one-token prompt has no pair to draft from: server rounds."""
    if rounds not in ROUNDS:
        raise ValueError(f"rounds must be one of {', '.join(ROUNDS)}, got {rounds!r}")
    dec = SpeculativeDecoder(model, k, SamplingParams(temperature, top_k, top_p), seed)
    t0 = time.perf_counter()
    simple = rounds == "llama-speculative-simple" and len(prompt_ids) >= 2
    first = dec.prefill(list(prompt_ids), draft_first=simple)
    generated = [] if simple else [first]
    res = GenerationResult(prompt_len=len(prompt_ids), tokens=[], k=dec.k)
    limit = max_new_tokens + 1 if simple else max_new_tokens  # (simple: stops once it has more than asked)
    while len(generated) < limit and not _stopped(generated, stop_ids):
        cap = max_new_tokens - len(generated) - 1 if simple else 0
        emitted, drafts = dec.step(cap if cap > 0 else None)
        generated.extend(emitted)
        res.accepted.append(len(emitted) - 1)
        res.drafted.append(len(drafts))
        res.draft_ids.append(drafts)
    _sync(model.device)
    res.seconds = time.perf_counter() - t0
    res.tokens = _finish(generated, max_new_tokens, stop_ids)
    res.trunk_forwards = dec.trunk_forwards
    return res


def run_plain(
    model: MtpModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_ids: set[int] | None = None,
) -> GenerationResult:
    """Ordinary autoregressive decoding with the trunk (the baseline for output and tokens/s)."""
    params = SamplingParams(temperature, top_k, top_p)
    gen = None if params.greedy else torch.Generator().manual_seed(seed)
    model.reset()
    t0 = time.perf_counter()
    out = model.trunk(torch.tensor([list(prompt_ids)]), last_only=True)
    generated = []
    while True:
        tok, _ = _choose(out.logits[0, -1], params, gen)
        generated.append(tok)
        if len(generated) >= max_new_tokens or _stopped(generated, stop_ids):
            break
        out = model.trunk(torch.tensor([[tok]]))
    _sync(model.device)
    return GenerationResult(
        prompt_len=len(prompt_ids),
        tokens=_finish(generated, max_new_tokens, stop_ids),
        k=0,
        seconds=time.perf_counter() - t0,
        trunk_forwards=len(generated),
    )


# ----------------------------------------------------------------------------- teacher forcing


@dataclass
class TeacherForcedResult:
    """Depth-1 greedy acceptance from one batched pass.

    ``matches[i]``: would the head's draft of token prompt_len+1+i be accepted, i.e. does
    its argmax from the pair (h_{j-1}, x_j), j = prompt_len+i, equal the trunk's argmax at j?
    ``loop_drafts``/``loop_accepted``: the counts a greedy k=1 loop over the same
    continuation makes (it visits only some positions: after an accepted draft plus
    bonus token it skips one); they equal ``run_speculative(k=1)``'s exactly.
    """

    prompt_len: int
    matches: list[bool]
    loop_drafts: int
    loop_accepted: int

    @property
    def rate(self) -> float:
        return sum(self.matches) / len(self.matches) if self.matches else float("nan")

    @property
    def loop_rate(self) -> float:
        return self.loop_accepted / self.loop_drafts if self.loop_drafts else float("nan")


# rows (tokens) per packed pass: as many as keep one hidden-wide activation near PACK_VALUES (4 MB in float32),
# within PACK_ROWS: bigger per-op tensors outgrow the caches, more rows give each expert's GEMMs more work
# (docs/notes/runtime.md, "Constants and the figures behind them")
PACK_VALUES = 1 << 20
PACK_ROWS = (1024, 4096)
PACK_LOGITS = 1 << 26  # and its logits (compared rows x vocabulary): 256 MB in float32


def teacher_forced_acceptance(model: MtpModel, ids: list[int], prompt_len: int) -> TeacherForcedResult:
    """``ids`` = prompt + continuation (a greedy one, for agreement with the loop)."""
    return teacher_forced_acceptances(model, [(ids, prompt_len)])[0]


@torch.no_grad()
def teacher_forced_acceptances(model: MtpModel, seqs: list[tuple[list[int], int]]) -> list[TeacherForcedResult]:
    """:func:`teacher_forced_acceptance` of each (ids, prompt_len), the sequences packed into few passes.

    A pass over one short sequence is mostly per-op overhead (hundreds of small ops per layer) and
    widening each 16-bit weight; packed (:class:`~mtpq.runtime.layers.Packing`), every per-row op runs
    once over all the sequences' rows and only the sequence mixers see them apart. Passes take
    consecutive sequences up to :func:`pack_rows` rows and PACK_LOGITS logits (a longer sequence gets its own)."""
    return teacher_forced_heads(model, seqs, {"": model.mtp})[""]


@torch.no_grad()
def teacher_forced_heads(
    model: MtpModel, seqs: list[tuple[list[int], int]], heads: dict[str, object]
) -> dict[str, list[TeacherForcedResult]]:
    """:func:`teacher_forced_acceptances` for several MTP heads on one trunk: each packed trunk pass runs once
    and every head (a :class:`~mtpq.runtime.mtp.NextNHead` built for this trunk) drafts from its hidden states
    (``mtpq sweep`` and ``--mtp-type auto`` compare head precisions this way)."""
    for ids, n in seqs:
        if not 1 <= n < len(ids):
            raise ValueError("need 1 <= prompt_len < len(ids)")
    matches: dict[str, list[list[bool]]] = {h: [] for h in heads}
    group, rows, logits = [], 0, 0
    limit = pack_rows(model)

    def flush():
        for h, m in _packed_matches(model, group, heads).items():
            matches[h] += m

    for ids, n in seqs:
        more = (len(ids) - n) * model.vocab_size
        if group and (rows + len(ids) > limit or logits + more > PACK_LOGITS):
            flush()
            group, rows, logits = [], 0, 0
        group.append((ids, n))
        rows, logits = rows + len(ids), logits + more
    flush()
    return {
        h: [TeacherForcedResult(n, m, *_loop_counts(m)) for (_, n), m in zip(seqs, ms)] for h, ms in matches.items()
    }


def pack_rows(model: MtpModel) -> int:
    """Rows per packed pass for ``model`` (see PACK_VALUES)."""
    return min(PACK_ROWS[1], max(PACK_ROWS[0], PACK_VALUES // model.tok_embd.shape[-1]))


def _packed_matches(
    model: MtpModel, group: list[tuple[list[int], int]], heads: dict[str, object]
) -> dict[str, list[list[bool]]]:
    """One packed trunk pass, then each head's: for each sequence, matches[i] compares the head's draft from the
    pair (h_{j-1}, x_j) with the trunk's argmax at j, j = prompt_len + i (see TeacherForcedResult)."""
    dev = model.device
    lengths, firsts = [len(ids) for ids, _ in group], [n for _, n in group]
    at = [0, *itertools.accumulate(lengths)]
    seq = torch.tensor([[t for ids, _ in group for t in ids]])
    # logits only where they are compared (the prompt's are most of a long prompt's output GEMMs)
    compared = torch.cat([torch.arange(a + n, a + T) for a, n, T in zip(at, firsts, lengths)])
    trunk = model.trunk(seq, use_cache=False, packing=Packing(lengths, dev), logit_rows=compared.to(dev))
    target = block_argmax(trunk.logits[0])  # per sequence: the trunk's choice for x_{j+1}, j = n..T-1
    hidden = trunk.hidden
    del trunk  # its logits: the head's reuse their memory
    # the head's pairs (h_t, x_{t+1}) of each sequence; drafts from t = n-1.. are compared
    head_ids, head_states, head_packing = model.head_rows(seq, hidden, lengths, out_from=[n - 1 for n in firsts])
    counts = [T - n for T, n in zip(lengths, firsts)]
    out = {}
    own = model.mtp
    try:
        for name, head in heads.items():
            model.mtp = head
            drafted = model.draft(head_ids, head_states, use_cache=False, packing=head_packing)
            same = (block_argmax(drafted.logits[0]) == target).tolist()
            out[name] = [same[end - c : end] for c, end in zip(counts, itertools.accumulate(counts))]
    finally:
        model.mtp = own
    return out


ARGMAX_BLOCK = 128  # vocabulary entries per block of block_argmax


def block_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of [N, V], the same indices (the first maximum; NaN counts as the maximum)
    ~4x faster: the maximum of each block of ARGMAX_BLOCK entries (a vectorized reduction, where argmax's
    is not), the first block holding the row's maximum, then argmax inside that block only."""
    N, V = logits.shape
    if V % ARGMAX_BLOCK or V < 4 * ARGMAX_BLOCK:
        return logits.argmax(dim=-1)
    blocks = logits.view(N, V // ARGMAX_BLOCK, ARGMAX_BLOCK)
    best = blocks.amax(dim=-1).argmax(dim=-1)  # [N]
    inside = blocks[torch.arange(N, device=logits.device), best].argmax(dim=-1)
    return best * ARGMAX_BLOCK + inside


def _loop_counts(matches: list[bool]) -> tuple[int, int]:
    """(drafts, accepted) of the k=1 loop over the same continuation: the round at j drafts x_{j+1};
    accepted -> the next round is at j+2, else at j+1; rounds run while fewer than len(matches) tokens
    were generated (i = j - prompt_len, i + 1 < len(matches))."""
    i, drafts, accepted = 0, 0, 0
    while i + 1 < len(matches):
        ok = matches[i]
        drafts += 1
        accepted += int(ok)
        i += 2 if ok else 1
    return drafts, accepted
