"""The cache protocol the speculative loop relies on: checkpoint, then roll back to n of the tokens since."""

import pytest
import torch

from mtpq.runtime.cache import KVCache, RecurrentCache


def test_kv_cache_rolls_back_to_the_kept_prefix():
    c = KVCache()
    seq = torch.arange(2 * 3 * 10 * 4, dtype=torch.float32).view(2, 3, 10, 4)
    c.update(seq[:, :, :6], -seq[:, :, :6])
    ck = c.checkpoint()
    k, v = c.update(seq[:, :, 6:], -seq[:, :, 6:])
    assert c.length == 10 and torch.equal(k, seq) and torch.equal(v, -seq)
    c.rollback(ck, 2)
    assert c.length == 8
    k, _ = c.update(seq[:, :, :1] + 100, seq[:, :, :1])  # the next token overwrites position 8
    assert torch.equal(k[:, :, :8], seq[:, :, :8]) and torch.equal(k[:, :, 8], seq[:, :, 0] + 100)
    with pytest.raises(ValueError):
        c.rollback(ck, 5)  # only 3 tokens past the checkpoint are cached


def test_kv_cache_grows_past_its_capacity_without_losing_entries():
    c = KVCache()
    rows = [torch.full((1, 1, 1, 2), float(i)) for i in range(200)]  # initial capacity is 64
    for r in rows:
        (k,) = c.update(r)
    assert torch.equal(k.flatten()[::2], torch.arange(200, dtype=torch.float32))


def _toy_recurrence(cache: RecurrentCache, xs: list[float]) -> None:
    """A stand-in recurrent layer: state s <- 0.5 s + x, reporting every state when a checkpoint is open."""
    s = cache.state["s"] if cache.state is not None else torch.zeros(())
    trail = []
    for x in xs:
        s = 0.5 * s + x
        trail.append({"s": s})
    cache.push(len(xs), trail[-1], trail if cache.recording else None)


@pytest.mark.parametrize("kept", [0, 1, 3, 4])
def test_recurrent_cache_rollback_equals_decoding_the_kept_tokens(kept):
    prompt, verified = [1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]
    spec = RecurrentCache()
    _toy_recurrence(spec, prompt)
    ck = spec.checkpoint()
    _toy_recurrence(spec, verified)  # one call for all k+1 tokens, as verification does
    spec.rollback(ck, kept)
    one_by_one = RecurrentCache()
    for x in prompt + verified[:kept]:
        _toy_recurrence(one_by_one, [x])
    assert spec.length == one_by_one.length == len(prompt) + kept
    assert torch.equal(spec.state["s"], one_by_one.state["s"])
    assert not spec.recording  # rollback closes the checkpoint


def test_recurrent_cache_refuses_a_layer_that_hides_its_intermediate_states():
    c = RecurrentCache()
    c.checkpoint()
    with pytest.raises(ValueError):
        c.push(3, {"s": torch.zeros(())}, None)


def test_recurrent_cache_restores_an_older_checkpoint():
    """DecoderState.save/restore: an earlier checkpoint stays valid after later rounds rolled back."""
    c = RecurrentCache()
    _toy_recurrence(c, [1.0, 2.0])
    saved = c.checkpoint()
    before = c.state["s"].clone()
    for _ in range(3):
        ck = c.checkpoint()
        _toy_recurrence(c, [5.0, 6.0])
        c.rollback(ck, 1)
    c.rollback(saved, 0)
    assert c.length == 2 and torch.equal(c.state["s"], before)
