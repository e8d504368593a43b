"""transformers' own MTP drafting (``generate(use_mtp=True)``) against our speculative loop."""

from __future__ import annotations

import torch


def accepted_like_transformers(hf, model, prompts: list[list[int]], max_new: int = 32) -> int:
    """For each prompt, greedy k=1: transformers' output and per-round acceptance must equal ours.

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
    try:
        total = 0
        for ids in prompts:
            rounds.clear()
            out = hf.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, use_mtp=True)
            ours = run_speculative(model, ids, max_new, k=1)
            assert out[0, len(ids):].tolist() == ours.tokens
            # transformers clamps a round's matches to the tokens it may still emit (max_new_tokens), so
            # a last round whose draft was right counts 0 there; we count what the head got right
            emitted_before = 1 + sum(a + 1 for a in ours.accepted[:-1])
            expected = ours.accepted[:-1] + [min(ours.accepted[-1], max_new - emitted_before - 1)]
            assert rounds == expected, (rounds, ours.accepted)
            total += sum(rounds)
        return total
    finally:
        cg.MTPCandidateGenerator.update_candidate_strategy = original
