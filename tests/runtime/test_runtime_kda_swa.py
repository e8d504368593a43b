"""The layers hy_v3 / cohere2moe / bailingmoe3 brought: Kimi delta attention (kda.py), sliding-window attention
(swa.py) and the clamped SwiGLU (layers.swiglu_), each against a direct computation of what it must compute, and
KDA's cache rolled back to any point of a checkpointed run equal to a run that never went past it. Their parity
with llama.cpp is test_llama_cpp_parity.py's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.runtime import close


def kda_inputs(B: int, H: int, T: int, d: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, H, T, d, generator=gen), dim=-1) * d**-0.5
    k = F.normalize(torch.randn(B, H, T, d, generator=gen), dim=-1)
    v = torch.randn(B, H, T, d, generator=gen)
    g = -5.0 * torch.sigmoid(torch.randn(B, H, T, d, generator=gen))  # per channel, in (-5, 0) as Ling's
    beta = torch.sigmoid(torch.randn(B, H, T, generator=gen))
    return q, k, v, g, beta


@pytest.mark.parametrize("T, with_state", [(16, False), (37, False), (37, True), (64, True)])
def test_chunked_kda_equals_the_recurrence(T, with_state):
    from mtpq.runtime.deltanet import recurrent_gated_delta_rule as recurrent_kda
    from mtpq.runtime.kda import chunked_kda

    q, k, v, g, beta = kda_inputs(2, 3, T, 8, seed=T)
    state = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1)) if with_state else None
    out, final, _ = recurrent_kda(q, k, v, g, beta, state)
    c_out, c_final = chunked_kda(q, k, v, g, beta, state)
    assert close(c_out, out)[0] <= 1e-5 * out.abs().max() and close(c_final, final)[0] <= 1e-5 * final.abs().max()
    # the decay is per key channel: one decay per head (their mean) computes something else
    other, _, _ = recurrent_kda(q, k, v, g.mean(-1, keepdim=True).expand_as(g), beta, state)
    assert close(other, out)[0] > 1e-2 * out.abs().max()


def test_the_recurrence_is_the_delta_rule_written_out():
    """One token at a time, as llama.cpp's ggml_gated_delta_net states it (state S[k][v]): S[i][:] *= exp(g[i]),
    delta = (v - S^T k) beta, S += k delta^T, o = S^T q."""
    from mtpq.runtime.deltanet import recurrent_gated_delta_rule as recurrent_kda

    q, k, v, g, beta = kda_inputs(1, 1, 5, 4, seed=3)
    S = torch.zeros(4, 4, dtype=torch.float64)
    want = []
    for t in range(5):
        S = S * g[0, 0, t].double().exp()[:, None]
        delta = (v[0, 0, t].double() - S.T @ k[0, 0, t].double()) * beta[0, 0, t].double()
        S = S + torch.outer(k[0, 0, t].double(), delta)
        want.append(S.T @ q[0, 0, t].double())
    out, _, _ = recurrent_kda(q, k, v, g, beta, None)
    assert close(out[0, 0], torch.stack(want))[0] <= 1e-6


def test_kda_rolls_back_to_any_kept_prefix(rt):
    """Under a checkpoint the layer records its state after each token: keeping n of them is the state of having
    seen those n, and the next outputs are the uncheckpointed run's."""
    from mtpq.runtime.families import load
    from mtpq.runtime.kda import KimiDeltaAttention

    model = load(rt.gguf("bailingmoe3", "default"))
    layer = model.blocks[0].attn
    assert isinstance(layer, KimiDeltaAttention)
    x = torch.randn(1, 12, model.blocks[0].attn_norm.numel(), generator=torch.Generator().manual_seed(0))
    for kept in (0, 1, 3, 5):
        cache = layer.new_cache()
        layer(x[:, :4], 0, cache)
        ck = cache.checkpoint()
        layer(x[:, 4:9], 4, cache)  # five tokens, of which `kept` survive
        cache.rollback(ck, kept)
        straight = layer.new_cache()
        layer(x[:, : 4 + kept], 0, straight)
        assert cache.length == straight.length == 4 + kept
        for key in ("conv", "ssm"):  # (to rounding: projections of 9 rows and of 4 + 5 differ in the last bits)
            diff, scale = close(cache.state[key], straight.state[key])
            assert diff <= 1e-6 * scale, (kept, key, diff)
        diff, scale = close(layer(x[:, 9:12], 4 + kept, cache), layer(x[:, 9:12], 4 + kept, straight))
        assert diff <= 1e-5 * scale, (kept, diff)
    # and a rollback to the wrong point is seen: the state after 3 kept tokens is not the one after 2
    cache = layer.new_cache()
    ck = cache.checkpoint()
    layer(x[:, :3], 0, cache)
    cache.rollback(ck, 2)
    straight = layer.new_cache()
    layer(x[:, :3], 0, straight)
    assert close(cache.state["ssm"], straight.state["ssm"])[0] > 1e-3 * straight.state["ssm"].abs().max()


def masked_reference(q, k, v, positions, scale, window):
    """Softmax attention with the mask written out: query at position p sees keys j with p - window < j <= p."""
    keys = torch.arange(k.shape[2])
    allowed = (keys <= positions[..., None]) & (positions[..., None] - keys < window)
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) * scale
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v


@pytest.mark.parametrize(
    "start, T, S, window", [(0, 20, 20, 6), (14, 1, 15, 6), (9, 4, 13, 5), (0, 10, 10, 16), (30, 3, 33, 1)]
)
def test_windowed_attention_masks_what_llama_cpp_masks(start, T, S, window):
    from mtpq.runtime.swa import windowed_attention

    gen = torch.Generator().manual_seed(start + T)
    q, k, v = (
        torch.randn(2, 4, T, 8, generator=gen),
        torch.randn(2, 2, S, 8, generator=gen),
        torch.randn(2, 2, S, 8, generator=gen),
    )
    want = masked_reference(q, k, v, torch.arange(start, start + T), 0.3, window)
    assert close(windowed_attention(q, k, v, start, 0.3, window), want)[0] <= 1e-5
    # positions per row (a packing's), the same answer
    pos = torch.arange(start, start + T).expand(2, T)
    if start + T == S:
        assert close(windowed_attention(q, k, v, pos, 0.3, window), want)[0] <= 1e-5


def test_clamped_swiglu_is_llama_cpps():
    """llama.cpp (build_ffn / build_moe_ffn with swiglu_clamp_*): up clamped to [-limit, limit], silu(gate) to at
    most limit, then their product; limit 0: the plain SwiGLU."""
    from mtpq.runtime.layers import swiglu_

    gen = torch.Generator().manual_seed(0)
    gate, up = 3 * torch.randn(50, 16, generator=gen), 3 * torch.randn(50, 16, generator=gen)
    want = torch.minimum(F.silu(gate), torch.tensor(1.5)) * up.clamp(-1.5, 1.5)
    assert torch.equal(swiglu_(gate.clone(), up, 1.5), want)
    assert torch.equal(swiglu_(gate.clone(), up, 0.0), F.silu(gate) * up)
    assert not torch.equal(want, F.silu(gate) * up)
