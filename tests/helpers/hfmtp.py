"""transformers' own MTP drafting (``generate(use_mtp=True)``) against our speculative loop."""

from __future__ import annotations

import torch


def counted_like_transformers(accepted: list[int], tokens: list[int]) -> list[int]:
    """Our per-round acceptance as transformers counts it. Both cut the output at ``max_new`` tokens and
    after an EOS; transformers cuts a round's tokens first and counts what is left of them, ours counts the
    drafts accepted and cuts the output at the end. ``tokens`` is our (cut) output; only the last round
    can differ."""
    out, pos = [], 1  # the prefill emits the first token
    for a in accepted:
        kept = min(a + 1, len(tokens) - pos)
        out.append(kept - 1)
        pos += kept
    return out


def accepted_like_transformers(hf, model, prompts: list[list[int]], max_new: int = 32) -> int:
    """For each prompt, greedy k=1: transformers' output and per-round acceptance must equal ours, with the head's
    pairs started as transformers starts them (``first_pair="none"``: no zero-state pair before (h_0, x_1)).

    Returns the total number of drafts accepted (callers check it is not trivially 0).
    """
    from transformers.generation import candidate_generator as cg

    from mtpq.runtime.speculative import run_speculative

    rounds: list[int] = []
    original = cg.MTPCandidateGenerator.update_candidate_strategy

    def record(self, input_ids, scores, num_matches):
        if scores.shape[1] > 1:  # a verify round (the first call is the prefill, with no candidates)
            rounds.append(int(num_matches))
        return original(self, input_ids, scores, num_matches)

    cg.MTPCandidateGenerator.update_candidate_strategy = record
    own_first_pair, model.first_pair = model.first_pair, "none"
    eos = hf.generation_config.eos_token_id  # transformers stops there: so must we
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    try:
        total = 0
        for ids in prompts:
            rounds.clear()
            out = hf.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, use_mtp=True)
            ours = run_speculative(model, ids, max_new, k=1, stop_ids=eos)
            assert out[0, len(ids) :].tolist() == ours.tokens
            assert rounds == counted_like_transformers(ours.accepted, ours.tokens), (rounds, ours.accepted)
            total += sum(rounds)
        return total
    finally:
        cg.MTPCandidateGenerator.update_candidate_strategy = original
        model.first_pair = own_first_pair
