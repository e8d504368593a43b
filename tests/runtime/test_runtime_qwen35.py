"""The Qwen3.5 / Qwen3.6 runtime (qwen35, qwen35moe): what only these families have
(test_runtime_contract.py holds what every family must do: trunk and MTP head against transformers and an
independent head, the speculative loop, quantized == dequantized, bf16).

- the gated DeltaNet's chunked form == its token-by-token form; rolling a recurrent cache back
  to "a of k" == decoding those a tokens one by one;
- the layer pattern (DeltaNet x 3, gated attention), with and without the recurrent-layer flags; the tiled
  value-head order is load-bearing;
- greedy speculative != plain greedy when the DeltaNet states are not rolled back (the contract's check can fail);
- ``mtpq accept`` runs on a Qwen3.5 GGUF; llama.cpp's qwen35 MTP drafting accepts what our loop does.

The loop tests use the "bigram" models of tests/helpers/runtime.py (``bigram_model``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.runcli import run_cli
from tests.helpers.runtime import REL_TOL, close, hf_model, random_prompts

CHECKPOINTS = {"dense": "qwen35", "moe": "qwen35moe", "dense_tied": "qwen35"}  # the small Qwen3.5s: no output.weight


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def ckpts(rt) -> dict[str, Path]:
    return {v: rt.ckpt(f, v) for v, f in CHECKPOINTS.items()}


@pytest.fixture(scope="module")
def ggufs(rt) -> dict[str, Path]:
    return {v: rt.gguf(f, v) for v, f in CHECKPOINTS.items()}


@pytest.fixture(scope="module")
def bigram_dense(rt):
    return rt.loop_model("qwen35")[0]


# ----------------------------------------------------------------------------- the DeltaNet rule


def random_rule_inputs(B, H, T, dk, dv, seed, decay_scale: float = 1.0):
    from mtpq.runtime.deltanet import l2norm

    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(B, H, T, dk, generator=gen)) * dk**-0.5
    k = l2norm(torch.randn(B, H, T, dk, generator=gen))
    v = torch.randn(B, H, T, dv, generator=gen)
    g = -F.softplus(torch.randn(B, H, T, generator=gen)) * decay_scale  # log decay <= 0
    beta = torch.rand(B, H, T, generator=gen)
    state = torch.randn(B, H, dk, dv, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("T", [1, 5, 64, 150])
@pytest.mark.parametrize("decay_scale", [1.0, 40.0])  # 40: decays that underflow float32 within a chunk (the demo's)
def test_chunked_rule_equals_recurrent_rule(T, decay_scale):
    from mtpq.runtime.deltanet import chunked_gated_delta_rule, recurrent_gated_delta_rule

    q, k, v, g, beta, state = random_rule_inputs(2, 3, T, 16, 8, seed=T, decay_scale=decay_scale)
    for init in (None, state):
        ref_out, ref_state, per_token = recurrent_gated_delta_rule(q, k, v, g, beta, init, keep_all=True)
        out, final = chunked_gated_delta_rule(q, k, v, g, beta, init, chunk=64)
        assert (out - ref_out).abs().max() <= 1e-5 * ref_out.abs().max()
        assert (final - ref_state).abs().max() <= 1e-5 * ref_state.abs().max()
        assert len(per_token) == T and torch.equal(per_token[-1], ref_state)


def test_recurrent_rollback_is_decoding_the_kept_tokens_one_by_one(ggufs):
    """One DeltaNet layer: verify k tokens under a checkpoint, keep a; == feeding those a one at a time."""
    from mtpq.runtime.deltanet import GatedDeltaNet
    from mtpq.runtime.families import load

    model = load(ggufs["dense"])
    layer = model.blocks[0].attn
    assert isinstance(layer, GatedDeltaNet)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 30, 256, generator=gen)
    k = 4
    for a in range(k + 1):
        one_by_one = layer.new_cache()
        layer(x[:, :20], 0, one_by_one)  # prefill (chunked form)
        outs = [layer(x[:, 20 + i : 21 + i], 20 + i, one_by_one) for i in range(a)]
        verified = layer.new_cache()
        layer(x[:, :20], 0, verified)
        ck = verified.checkpoint()
        batch_out = layer(x[:, 20 : 21 + k], 20, verified)  # k + 1 tokens at once, recorded
        verified.rollback(ck, a)
        assert verified.length == one_by_one.length == 20 + a
        for name in ("conv", "ssm"):
            diff = (verified.state[name] - one_by_one.state[name]).abs().max()
            assert diff <= 1e-6 * one_by_one.state[name].abs().max(), (a, name, diff)
        if a:
            assert close(batch_out[:, :a], torch.cat(outs, dim=1))[0] <= 1e-5
        # and decoding goes on from there as if nothing else had been seen
        nxt = x[:, 25:26]
        assert close(layer(nxt, 20 + a, verified), layer(nxt, 20 + a, one_by_one))[0] <= 1e-5


# ----------------------------------------------------------------------------- trunk


@pytest.mark.parametrize("variant", CHECKPOINTS)
def test_layer_layout(variant, ggufs):
    """The layer_types of the checkpoints: three DeltaNet layers, then gated attention; the head attends."""
    from mtpq.runtime.deltanet import GatedDeltaNet
    from mtpq.runtime.families import load
    from mtpq.runtime.layers import Attention, MoE

    model = load(ggufs[variant])
    assert ("output.weight" in model.family.file) == (variant != "dense_tied")
    kinds = [type(b.attn) for b in model.blocks]
    assert kinds == [GatedDeltaNet, GatedDeltaNet, GatedDeltaNet, Attention]  # layer_types of the checkpoint
    assert model.blocks[3].attn.cfg.gated and isinstance(model.mtp.block.attn, Attention)
    assert isinstance(model.blocks[0].ffn, MoE) == (variant == "moe")


def test_layer_pattern_without_recurrent_flags(ggufs, tmp_path):
    """Files without attention.recurrent_layers: llama.cpp's full_attention_interval rule gives the same model."""
    from mtpq.gguf_io import plan_from_gguf, write_plan
    from mtpq.runtime.families import load

    plan = plan_from_gguf(ggufs["dense"])
    del plan.kv["qwen35.attention.recurrent_layers"]
    write_plan(plan, tmp_path / "no-flags.gguf")
    with_flags, without = load(ggufs["dense"]), load(tmp_path / "no-flags.gguf")
    assert without.family.file.value("attention.recurrent_layers") is None
    assert without.cfg.recurrent == with_flags.cfg.recurrent == (True, True, True, False)
    ids = torch.randint(0, without.cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(4))
    assert torch.equal(without.trunk(ids, use_cache=False).logits, with_flags.trunk(ids, use_cache=False).logits)


def test_value_head_order_matters(ckpts, ggufs, monkeypatch):
    """The tiled value-head order is load-bearing: reading key heads grouped breaks the agreement."""
    from mtpq.runtime.families import load

    model = load(ggufs["dense"])
    ids = torch.randint(0, model.cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf_model("qwen35", ckpts["dense"])(ids).logits
    assert close(model.trunk(ids, use_cache=False).logits, ref)[0] <= REL_TOL * ref.abs().max()
    from mtpq.runtime import deltanet

    monkeypatch.setattr(deltanet, "tile_key_heads", lambda x, n: x.repeat_interleave(n // x.shape[1], dim=1))
    assert close(model.trunk(ids, use_cache=False).logits, ref)[0] > 100 * REL_TOL * ref.abs().max()


# ----------------------------------------------------------------------------- speculative loop


def speculative_matches_plain(model, prompts, n_new=32) -> tuple[bool, dict]:
    from mtpq.runtime.speculative import run_plain, run_speculative

    same, stats = True, dict(accepted=0, rejected=0, multi=0)
    for ids in prompts:
        base = run_plain(model, ids, n_new)
        for k in (1, 2, 3, 4):
            spec = run_speculative(model, ids, n_new, k=k)
            same &= spec.tokens == base.tokens
            stats["accepted"] += spec.n_accepted
            stats["rejected"] += sum(a < k for a in spec.accepted)
            stats["multi"] += sum(a >= 2 for a in spec.accepted)
    return same, stats


def test_speculative_fails_without_recurrent_rollback(bigram_dense, monkeypatch):
    """The rollback test can fail: keep the DeltaNet states of rejected drafts, and outputs diverge."""
    from mtpq.runtime.cache import RecurrentCache

    model = bigram_dense
    prompts = random_prompts(3, 12, model.cfg.vocab_size, seed=0)

    def forgetful_rollback(self, checkpoint, n_kept):  # trims the count, keeps the state after every token
        self.length, self._trail = checkpoint[0] + n_kept, None

    monkeypatch.setattr(RecurrentCache, "rollback", forgetful_rollback)
    same, stats = speculative_matches_plain(model, prompts)
    assert stats["rejected"] > 0 and not same


# ----------------------------------------------------------------------------- mtpq accept


def test_accept_cli_on_qwen35(rt, tmp_path):
    """``mtpq accept`` end to end on a Qwen3.5 GGUF: its k=1 figures == the teacher-forced estimator's."""
    from mtpq.runtime.speculative import load_model, run_plain, teacher_forced_acceptance

    path = rt.loop_gguf("qwen35")
    texts = ["def add(a, b):", "The quick brown fox", "for i in range(10):"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"category": "code", "prompt": t}) + "\n" for t in texts))
    res = run_cli("accept", path, "--prompts", prompts, "-k", "1", "-n", "24", "--json", "-")
    assert res.exit_code in (0, 1), res.output
    rep = json.loads(res.stdout)
    model, tok = load_model(path, device="cpu")
    drafts = accepted = 0
    for text in texts:
        ids = tok.encode(text)
        tf = teacher_forced_acceptance(model, ids + run_plain(model, ids, 24).tokens, prompt_len=len(ids))
        drafts, accepted = drafts + tf.loop_drafts, accepted + tf.loop_accepted
    assert rep["drafts"] == drafts and rep["accepted"] == accepted
    assert 0 < rep["acceptance_rate"] < 1
    assert rep["greedy_outputs_identical"] is True


# ----------------------------------------------------------------------------- llama.cpp


@pytest.mark.llama_cpp
def test_llama_cpp_acceptance_agrees(rt, llama_cpp_bin, tmp_path):
    """llama.cpp's qwen35 MTP drafting one token at a time (--spec-type draft-mtp) accepts what our k=1 loop
    does, on the same GGUF and prompts: within 3 points overall, and within one accepted draft per prompt
    (prompts llama.cpp ends early are left out)."""
    from tests.helpers.llamacpp_ref import assert_k1_acceptance_agrees

    assert_k1_acceptance_agrees(llama_cpp_bin, rt.loop_gguf("qwen35"), tmp_path, max_gap=0.03)
