"""How many bits does a head need? Several MTP-head precisions measured on ONE trunk.

A head's acceptance depends on its own bytes and on the trunk's hidden states. For every candidate head type
only the MTP block's tensors are quantized (from the reference, exactly as ``mtpq quantize --mtp-type T``
would write them) into a small head-only GGUF; the trunk's greedy continuations and its packed teacher-forced
pass run once, and each head drafts from the same hidden states
(:func:`~mtpq.runtime.speculative.teacher_forced_heads`). The rates are the greedy k=1 loop's
(accepted / drafted over the same continuations), which ``mtpq accept --draft 1`` reports for each full file.

    rates = head_rates(trunk_gguf, reference_gguf, parse_options("Q4_K_M"), head_types=["f16", "q8_0", "q4_k"])
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from ..errors import InputError
from ..runtime.speculative import TeacherForcedResult, load_model, run_plain, teacher_forced_heads


@dataclass
class HeadRate:
    head_type: str
    drafts: int
    accepted: int

    @property
    def rate(self) -> float:
        return self.accepted / self.drafts if self.drafts else float("nan")


def head_plan(reference_plan, options, head_type: str):
    """The MTP block's tensors of ``mtpq quantize REF OUT`` with the job's ``options`` (QuantOptions) but
    ``--mtp-type head_type`` (lazy: nothing else is quantized), as a plan with the reference's metadata."""
    from ..gguf_io.pair import OWN
    from ..quantize.pipeline import plan_quantize

    full = plan_quantize(reference_plan, options.with_mtp_type(head_type))
    n = full.n_trunk_layers
    # (a head file's top-level tensors that are the head's own go with it: DeepSeek-V4's output_hc_*)
    own = OWN if reference_plan.n_mtp_layers and not any(_block(s.name) in range(n) for s in full.tensors) else ()
    keep = [s for s in full.tensors if (b := _block(s.name)) is not None and b >= n or s.name in own]
    return replace(full, tensors=keep)


def _block(name: str) -> int | None:
    return int(name.split(".")[1]) if name.startswith("blk.") else None


def _build_head(model, path: Path):
    """A NextNHead for ``model``'s trunk from a head-only GGUF (its missing embed/head fall back to the trunk's)."""
    from ..gguf_io import GGUFFile
    from ..runtime.weights import Weights

    w = Weights(GGUFFile(path), model.device, model.dtype)
    return model.head_at(w, len(model.blocks)).eval()  # the head's block follows the trunk's


def greedy_sequences(model, tok, prompts: list[str], max_new_tokens: int) -> list[tuple[list[int], int]]:
    """(prompt + the trunk's greedy continuation, prompt length) per prompt, stopping at EOS as ``accept`` does."""
    stop = {i for i in (getattr(tok, "eos_token_id", None),) if i is not None}
    out = []
    for text in prompts:
        ids = tok.encode(text)
        cont = run_plain(model, ids, max_new_tokens, stop_ids=stop).tokens
        if len(cont) >= 1:
            out.append((ids + cont, len(ids)))
    return out


def head_rates(
    trunk: Path,
    reference,
    options,
    head_types: list[str],
    prompts: list[str],
    max_new_tokens: int = 48,
    device: str | None = None,
    workdir: Path | None = None,
    on_head: Callable[[str], None] | None = None,
    head: Path | None = None,
) -> dict[str, HeadRate]:
    """Greedy k=1 acceptance of each head type (quantized from ``reference``, a GGUF path or a plan, by the job's
    ``options``, a QuantOptions) on ``trunk``'s trunk, from one trunk pass. ``head``: the head file that drafts for
    ``trunk`` (a trunk-only file) in that pass, as ``accept --head``; ``reference`` is then that head file."""
    from ..gguf_io import plan_from_gguf, write_plan

    model, tok = load_model(trunk, device=device, head=head)
    if model.mtp is None:
        raise InputError(trunk, "has no MTP block to compare heads in")
    seqs = greedy_sequences(model, tok, prompts, max_new_tokens)
    if not seqs:
        raise InputError(trunk, "no prompt gave a continuation to measure on")
    ref_plan = plan_from_gguf(reference) if isinstance(reference, (str, Path)) else reference
    heads = {}
    with tempfile.TemporaryDirectory(prefix="mtpq-heads-", dir=workdir) as tmp:
        for t in head_types:
            if on_head:
                on_head(t)
            path = Path(tmp) / f"head-{t}.gguf"
            write_plan(head_plan(ref_plan, options, t), path)
            heads[t] = _build_head(model, path)
        results = teacher_forced_heads(model, seqs, heads)
        del heads
    return {t: _totals(t, r) for t, r in results.items()}


def _totals(head_type: str, results: list[TeacherForcedResult]) -> HeadRate:
    return HeadRate(head_type, sum(r.loop_drafts for r in results), sum(r.loop_accepted for r in results))


# --mtp-type auto: the candidates, widest first (bits per weight of a 256-wide row: f16 16, q8_0 8.5, q6_k 6.56 ...)
AUTO_CANDIDATES = ("f16", "q8_0", "q6_k", "q5_k", "q4_k", "q3_k", "q2_k")
AUTO_KEY = "mtpq.mtp_type_auto"  # the choice and its figures, recorded in the file (no general.* key)


@dataclass
class AutoChoice:
    head_type: str
    max_drop: float
    rates: dict[str, HeadRate]

    @property
    def baseline(self) -> float:
        return self.rates["f16"].rate

    def to_dict(self) -> dict:
        return {
            "mtp_type": self.head_type,
            "max_drop": self.max_drop,
            "baseline": "f16",
            "rates": {t: {"rate": r.rate, "drafted": r.drafts, "accepted": r.accepted} for t, r in self.rates.items()},
        }


def choose_head_type(rates: dict[str, HeadRate], max_drop: float) -> str:
    """The narrowest candidate whose acceptance stays within ``max_drop`` of the f16 head's."""
    base = rates["f16"].rate
    ok = [t for t in AUTO_CANDIDATES if t in rates and rates[t].rate >= base - max_drop]
    return ok[-1]  # f16 itself always qualifies
