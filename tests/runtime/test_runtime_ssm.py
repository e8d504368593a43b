"""What only Qwen3-Next (qwen3next) and Nemotron-H MoE (nemotron_h_moe) have (test_runtime_contract.py holds what
every family must do; test_llama_cpp_parity.py their parity with llama.cpp, trunk and head):

- Mamba-2's chunked scan == its token-by-token scan; rolling a Mamba-2 layer's cache back to "a of k" == decoding
  those a tokens one by one;
- Nemotron-H's layer pattern from the per-block metadata (llama.cpp's rule), its attention without RoPE, its head
  (attention + LatentMoE, a LayerNorm at the end);
- the details the fixtures hinge on are load-bearing against transformers (Qwen3-Next's grouped key heads and fused
  beta/alpha, Mamba-2's group order, grouped norm and D skip): each break moves the trunk far from transformers';
- greedy speculative != plain greedy when the Mamba-2 states are not rolled back (the contract's check can fail);
- llama.cpp's nemotron_h_moe MTP drafting (llama-speculative-simple) accepts what our k=1 loop does.

Not Qwen3-Next's drafting there: llama-speculative-simple --spec-type draft-mtp reports every qwen3next draft
accepted, at any depth (33/33 at k=1, 39/39 at k=3 on the bigram model), while libllama's own qwen3next MTP
graph, teacher-forced through the harness on that very greedy continuation, drafts 35 of 64 right, as ours
does (and our loop accepts 28 of 37): what that driver drafts with for this architecture is not the head's
output as the MTP graph computes it (its drafts always equal the trunk's next token).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.runtime import REL_TOL, close, hf_model, random_prompts
from tests.runtime.test_llama_cpp_parity import BREAKS

# ----------------------------------------------------------------------------- the Mamba-2 scan


def random_scan_inputs(B, H, T, P, N, seed, decay_scale: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, T, P, generator=gen)
    log_decay = -F.softplus(torch.randn(B, H, T, generator=gen)) * decay_scale
    b, c = torch.randn(B, H, T, N, generator=gen), torch.randn(B, H, T, N, generator=gen)
    return x, log_decay, b, c, torch.randn(B, H, P, N, generator=gen)


@pytest.mark.parametrize("T", [1, 5, 64, 150])
@pytest.mark.parametrize("decay_scale", [1.0, 40.0])  # 40: decays that underflow float32 within a chunk
def test_chunked_scan_equals_recurrent_scan(T, decay_scale):
    from mtpq.runtime.mamba2 import chunked_scan, recurrent_scan

    x, log_decay, b, c, state = random_scan_inputs(2, 3, T, 8, 16, seed=T, decay_scale=decay_scale)
    for init in (None, state):
        ref_y, ref_state, per_token = recurrent_scan(x, log_decay, b, c, init, keep_all=True)
        for chunk in (16, 64):
            y, final = chunked_scan(x, log_decay, b, c, init, chunk=chunk)
            assert (y - ref_y).abs().max() <= 1e-5 * ref_y.abs().max()
            assert (final - ref_state).abs().max() <= 1e-5 * ref_state.abs().max()
        assert len(per_token) == T and torch.equal(per_token[-1], ref_state)


def test_mamba2_rollback_is_decoding_the_kept_tokens_one_by_one(rt):
    """One Mamba-2 layer: verify k tokens under a checkpoint, keep a; == feeding those a one at a time."""
    from mtpq.runtime.families import load
    from mtpq.runtime.mamba2 import Mamba2

    layer = load(rt.gguf("nemotron_h_moe", "release")).blocks[0].attn
    assert isinstance(layer, Mamba2)
    x = torch.randn(1, 90, 512, generator=torch.Generator().manual_seed(0))
    k, n = 4, 80  # a prefill of 80: the chunked form, two chunks
    for a in range(k + 1):
        one_by_one = layer.new_cache()
        layer(x[:, :n], 0, one_by_one)
        outs = [layer(x[:, n + i : n + i + 1], n + i, one_by_one) for i in range(a)]
        verified = layer.new_cache()
        layer(x[:, :n], 0, verified)
        ck = verified.checkpoint()
        batch_out = layer(x[:, n : n + k + 1], n, verified)  # k + 1 tokens at once, recorded
        verified.rollback(ck, a)
        assert verified.length == one_by_one.length == n + a
        for name in ("conv", "ssm"):
            diff = (verified.state[name] - one_by_one.state[name]).abs().max()
            assert diff <= 1e-6 * one_by_one.state[name].abs().max(), (a, name, diff)
        if a:
            assert close(batch_out[:, :a], torch.cat(outs, dim=1))[0] <= 1e-5
        nxt = x[:, n + 6 : n + 7]  # and decoding goes on from there as if nothing else had been seen
        assert close(layer(nxt, n + a, verified), layer(nxt, n + a, one_by_one))[0] <= 1e-5


# ----------------------------------------------------------------------------- Nemotron-H's layout


def test_nemotron_layer_pattern_and_head(rt):
    """``hybrid_override_pattern`` "ME*E" as llama.cpp reads it back from head_count_kv / feed_forward_length; the
    attention has no RoPE; the head is attention + the LatentMoE and ends in a LayerNorm."""
    from mtpq.runtime.families import load
    from mtpq.runtime.layers import Attention, MoE, PositionWise
    from mtpq.runtime.mamba2 import Mamba2

    model = load(rt.gguf("nemotron_h_moe", "release"))
    assert model.cfg.kinds == ("mamba", "ffn", "attention", "ffn")
    assert [type(b.attn) for b in model.blocks] == [Mamba2, PositionWise, Attention, PositionWise]
    assert all(b.ffn is None for b in model.blocks) and model.blocks[2].attn.rope is None
    head = model.mtp
    assert isinstance(head.block.attn, Attention) and head.block.attn.rope is None
    moe = head.block.ffn
    assert isinstance(moe, MoE) and moe.gate is None and moe.latent_down is not None and moe.latent_up is not None
    assert moe.cfg.gating == "sigmoid" and moe.cfg.norm_topk and moe.cfg.scale == 5.0 and moe.bias is not None
    assert head.layer_norm_head and head.head_eps == pytest.approx(1e-5)


# ----------------------------------------------------------------------------- load-bearing details

TRUNK_BREAKS = [
    ("qwen3next", "deltanet_heads_tiled"),
    ("qwen3next", "fused_ba_halved"),
    ("nemotron_h_moe", "mamba_groups_tiled"),
    ("nemotron_h_moe", "mamba_norm_ungrouped"),
    ("nemotron_h_moe", "mamba_d_skip_dropped"),
    ("nemotron_h_moe", "attention_roped"),
]


@pytest.mark.parametrize("family, brk", TRUNK_BREAKS, ids=[b for _, b in TRUNK_BREAKS])
def test_a_broken_detail_leaves_transformers(family, brk, rt):
    from mtpq.runtime.families import load

    model = load(rt.gguf(family, "release"))
    ids = torch.randint(0, model.cfg.vocab_size, (1, 70), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf_model(family, rt.ckpt(family, "release"))(ids).logits
    scale = ref.abs().max().item()
    assert close(model.trunk(ids, use_cache=False).logits, ref)[0] <= REL_TOL * scale
    assert BREAKS[brk](model)
    # (unbroken: ~4e-7 of the scale; the mildest break, the norm over both groups at once, moves ~4e-3: the
    # random fixture's two groups have RMS values within a few per cent of each other)
    assert close(model.trunk(ids, use_cache=False).logits, ref)[0] > 10 * REL_TOL * scale, brk


# ----------------------------------------------------------------------------- speculative loop


def test_speculative_fails_without_mamba_rollback(rt, monkeypatch):
    """The contract's rollback check can fail here: keep the Mamba-2 states of rejected drafts, outputs diverge."""
    from mtpq.runtime.cache import RecurrentCache
    from mtpq.runtime.speculative import run_plain, run_speculative

    model = rt.loop_model("nemotron_h_moe")[0]

    def forgetful_rollback(self, checkpoint, n_kept):  # trims the count, keeps the state after every token
        self.length, self._trail = checkpoint[0] + n_kept, None

    monkeypatch.setattr(RecurrentCache, "rollback", forgetful_rollback)
    same, rejected = True, 0
    for ids in random_prompts(3, 12, model.cfg.vocab_size, seed=0):
        spec = run_speculative(model, ids, 32, k=3)
        same &= spec.tokens == run_plain(model, ids, 32).tokens
        rejected += sum(a < 3 for a in spec.accepted)
    assert rejected > 0 and not same


@pytest.mark.llama_cpp
def test_llama_cpp_acceptance_agrees_on_nemotron(rt, llama_cpp_bin, tmp_path):
    """llama.cpp's nemotron_h_moe MTP drafting one token at a time accepts what our k=1 loop does: within one
    draft per prompt and 1 point overall, on the bigram loop model (8 prompts: ours 169/345, llama.cpp's
    171/351)."""
    from tests.helpers.llamacpp_ref import assert_k1_acceptance_agrees

    assert_k1_acceptance_agrees(llama_cpp_bin, rt.loop_gguf("nemotron_h_moe"), tmp_path, max_gap=0.01)
