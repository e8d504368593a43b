"""Causal attention, every path the runtime takes, against one written out in float64.

The reference is the definition: scores q.k * scale, keys after a query's position masked out, softmax,
times v. Cases cover what the families give it: GQA (4 query heads over 2 key heads), v narrower than
q/k (MLA's expanded form: 96-wide keys, 64-wide values), queries that are the last rows of the keys (the
MTP head's compared pairs, a cached prefill), rows that do not fill the last block, and blocks bounded
by the score budget rather than ATTN_BLOCK.
"""

from __future__ import annotations

import pytest
import torch

from mtpq.runtime import layers


def reference(q, k, v, start: int, scale: float) -> torch.Tensor:
    q, k, v = q.double(), k.double(), v.double()
    Hq, Hkv = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(Hq // Hkv, dim=1), v.repeat_interleave(Hq // Hkv, dim=1)
    T, S = q.shape[2], k.shape[2]
    s = q @ k.transpose(-1, -2) * scale
    seen = torch.arange(S)[None, :] <= torch.arange(start, start + T)[:, None]
    return (s.masked_fill(~seen, float("-inf")).softmax(-1) @ v).float()


SHAPES = [(4, 2, 64, 64), (4, 4, 96, 64), (2, 1, 32, 32)]  # (query heads, key heads, q/k width, v width)


@pytest.mark.parametrize("heads", SHAPES, ids=lambda h: "x".join(map(str, h)))
@pytest.mark.parametrize("T,start", [(1, 0), (7, 0), (127, 0), (128, 0), (300, 0), (200, 137), (150, 5)])
def test_causal_attention_is_the_definition(heads, T, start):
    Hq, Hkv, D, Dv = heads
    g = torch.Generator().manual_seed(T + start)
    q = torch.randn(2, Hq, T, D, generator=g)
    k, v = torch.randn(2, Hkv, start + T, D, generator=g), torch.randn(2, Hkv, start + T, Dv, generator=g)
    out = layers.causal_attention(q, k, v, start, D**-0.5)
    assert out.shape == (2, Hq, T, Dv)
    torch.testing.assert_close(out, reference(q, k, v, start, D**-0.5), atol=5e-6, rtol=1e-5)


@pytest.mark.parametrize("heads", SHAPES, ids=lambda h: "x".join(map(str, h)))
@pytest.mark.parametrize("budget", [1 << 22, 3000])  # the second: blocks of a few rows, most of them ragged
def test_blocked_attention_is_the_definition(heads, budget, monkeypatch):
    monkeypatch.setattr(layers, "ATTN_BLOCK_SCORES", budget)
    Hq, Hkv, D, Dv = heads
    g = torch.Generator().manual_seed(budget)
    for T, start in ((1, 0), (65, 0), (200, 0), (90, 31)):
        # strided inputs, as the packed passes give them ([T, H, D] rows transposed)
        q = torch.randn(T, Hq, D, generator=g).transpose(0, 1)[None]
        k = torch.randn(start + T, Hkv, D, generator=g).transpose(0, 1)[None]
        v = torch.randn(start + T, Hkv, Dv, generator=g).transpose(0, 1)[None]
        out = layers.blocked_causal_attention(q, k, v, start, 0.3)
        torch.testing.assert_close(out, reference(q, k, v, start, 0.3), atol=5e-6, rtol=1e-5)


def test_packed_attention_is_each_sequence_on_its_own():
    """Three sequences packed as rows, the second and third with outputs from a later row on (as the MTP
    head's pass asks): each equals its own attention, whatever path its length takes."""
    g = torch.Generator().manual_seed(0)
    lengths, firsts = [150, 40, 300], [0, 10, 170]
    packing = layers.Packing(lengths, torch.device("cpu"), out_from=firsts)
    N, Nq = sum(lengths), sum(T - f for T, f in zip(lengths, firsts))
    q, k, v = (
        torch.randn(Nq, 4, 96, generator=g),
        torch.randn(N, 4, 96, generator=g),
        torch.randn(N, 4, 64, generator=g),
    )
    out = layers.packed_attention(q, lambda a, n: (k[a : a + n], v[a : a + n]), packing, 0.1)
    at = aq = 0
    for T, f in zip(lengths, firsts):
        ref = reference(
            q[aq : aq + T - f].transpose(0, 1)[None],
            k[at : at + T].transpose(0, 1)[None],
            v[at : at + T].transpose(0, 1)[None],
            f,
            0.1,
        )
        torch.testing.assert_close(out[aq : aq + T - f], ref[0].transpose(0, 1), atol=5e-6, rtol=1e-5)
        at, aq = at + T, aq + T - f


def test_many_heads_times_keys_take_sdpa_and_stay_the_definition(monkeypatch):
    """Where a block would hold fewer than MIN_BLOCK_ROWS rows (the score budget over heads x keys), long
    queries go to SDPA instead; both paths give the definition."""
    monkeypatch.setattr(layers, "blocked_causal_attention", lambda *a: pytest.fail("blocked path taken"))
    monkeypatch.setattr(layers, "ATTN_BLOCK_SCORES", 4 * 300 * (layers.MIN_BLOCK_ROWS - 1))
    g = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(1, 4, 300, 96, generator=g),
        torch.randn(1, 4, 300, 96, generator=g),
        torch.randn(1, 4, 300, 64, generator=g),
    )
    torch.testing.assert_close(
        layers.causal_attention(q, k, v, 0, 0.1), reference(q, k, v, 0, 0.1), atol=5e-6, rtol=1e-5
    )
