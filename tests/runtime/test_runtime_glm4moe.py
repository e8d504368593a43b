"""The bundled GLM-4.5 runtime: what only GLM has (test_runtime_contract.py holds what every family must do:
trunk and MTP head against transformers, the speculative loop, quantized == dequantized, bf16).

- the two layouts the contract runs (GLM-4.5's, and group-limited routing without q/k norm or bias);
- the pre-norm switch feeds the head the trunk's pre-norm state (the MTP math written with transformers'
  Glm4MoeDecoderLayer, tests/helpers/runtime.py);
- rejection sampling keeps the target distribution (chi-square, with a power check);
- transformers' own ``generate(use_mtp=True)`` accepts the same drafts as our loop;
- the tokenizer rebuilt from GGUF metadata == the original HF tokenizer.

The loop tests use a "copy head" (tests/builders/tiny.py): its eh_proj passes hnorm(h_t) through, its block
is shrunk towards identity and its output head is the token embedding, so it predicts x_t again -- right
whenever greedy decoding of the random trunk falls into a 2-cycle, wrong elsewhere.
"""

from __future__ import annotations

import math
from pathlib import Path
from statistics import NormalDist

import gguf
import numpy as np
import pytest
import torch

from tests.helpers.hfmtp import accepted_like_transformers
from tests.helpers.runtime import PROMPTS, REL_TOL, GlmMtpOracle, close, hf_model

# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def glm_folder(rt) -> Path:
    return rt.ckpt("glm4moe", "default")


@pytest.fixture(scope="module")
def f32_gguf(rt) -> Path:
    return rt.gguf("glm4moe", "default")


@pytest.fixture(scope="module")
def copy_model(rt):
    return rt.loop_model("glm4moe")


def prompt_ids(tok) -> list[list[int]]:
    return [tok.encode(s) for s in PROMPTS]


# ----------------------------------------------------------------------------- layouts and the pre-norm switch


@pytest.mark.parametrize("which", ["default", "alt"])
def test_block_layout(which, rt):
    """The two layouts whose logits the contract compares: dense lead layer, q/k norm and bias; or MoE from
    layer 0 with group-limited routing and no renormalisation."""
    from mtpq.runtime.families import load
    from mtpq.runtime.layers import MoE

    model = load(rt.gguf("glm4moe", which))
    blocks = list(model.blocks)
    assert any(isinstance(b.ffn, MoE) for b in blocks)  # the MoE path is exercised
    if which == "default":
        assert blocks[1].attn.q_norm is not None and blocks[1].attn.wq.bias is not None
        assert not isinstance(blocks[0].ffn, MoE)  # dense first layer
    else:
        assert all(isinstance(b.ffn, MoE) for b in blocks) and blocks[0].attn.q_norm is None
        assert model.cfg.moe.n_group == 2 and model.cfg.moe.topk_group == 1 and not model.cfg.moe.norm_topk


def test_pre_norm_switch_feeds_the_pre_norm_state(glm_folder, f32_gguf):
    from mtpq.runtime.families import load

    post, pre = load(f32_gguf), load(f32_gguf, hidden="pre_norm")
    oracle = GlmMtpOracle(glm_folder)
    ids = torch.randint(0, post.cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(6))
    h_post, h_pre = oracle.trunk_hidden(ids)
    ref_post, _ = oracle(ids[:, 1:], h_post[:, :-1])
    ref_pre, _ = oracle(ids[:, 1:], h_pre[:, :-1])
    out_post = post.draft(ids[:, 1:], post.trunk(ids, use_cache=False).hidden[:, :-1], use_cache=False).logits
    out_pre = pre.draft(ids[:, 1:], pre.trunk(ids, use_cache=False).hidden[:, :-1], use_cache=False).logits
    scale = ref_post.abs().max().item()
    assert close(out_pre, ref_pre)[0] <= REL_TOL * scale
    assert close(out_post, ref_post)[0] <= REL_TOL * scale
    # the switch matters: the two variants disagree far beyond the tolerance, and on drafts
    assert close(out_pre, ref_post)[0] > 100 * REL_TOL * scale
    assert (out_pre.argmax(-1) != out_post.argmax(-1)).any()


# ----------------------------------------------------------------------------- sampling


def chi2_critical(df: int, alpha: float) -> float:
    """Upper chi-square quantile (Wilson-Hilferty approximation, good to ~1% here)."""
    z = NormalDist().inv_cdf(1 - alpha)
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_stat(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token with zero target probability was emitted"
    expected = probs[keep] * counts.sum()
    return float(((counts[keep] - expected) ** 2 / expected).sum()), int(keep.sum()) - 1


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=4, top_p=0.9)])
def test_rejection_sampling_is_unbiased(params):
    from mtpq.runtime.speculative import SamplingParams, accept_drafts, probs_from_logits

    sp = SamplingParams(**params)
    gen = torch.Generator().manual_seed(0)
    V, k, N = 6, 3, 12000
    target = torch.randn(k + 1, V, generator=gen) * 1.5
    draft = target[:k] + torch.randn(k, V, generator=gen) * 1.5  # a drafter that is often wrong
    p, q = probs_from_logits(target, sp).numpy(), probs_from_logits(draft, sp)
    first, second, from_q = np.zeros(V), np.zeros(V), np.zeros(V)
    for _ in range(N):
        drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(k)]
        a, nxt = accept_drafts(target, drafts, q, sp, gen)
        emitted = drafts[:a] + [nxt]
        first[emitted[0]] += 1
        if len(emitted) > 1:
            second[emitted[1]] += 1
        from_q[drafts[0]] += 1
    alpha = 1e-3
    stat, df = chi2_stat(first, p[0])
    assert stat < chi2_critical(df, alpha), ("first token", stat)
    stat, df = chi2_stat(second, p[1])  # given the first draft was accepted, the next token ~ p[1]
    assert stat < chi2_critical(df, alpha), ("second token", stat)
    # power: the same test rejects the draft distribution itself (what "always accept" would emit)
    keep = p[0] > 0
    exp = p[0][keep] * N
    assert float(((from_q[keep] - exp) ** 2 / exp).sum()) > 10 * chi2_critical(int(keep.sum()) - 1, alpha)


def test_sampled_rounds_follow_the_trunk(copy_model):
    """In the real loop: from one fixed state, the first token of a sampled round ~ the trunk's distribution."""
    from mtpq.runtime.speculative import SamplingParams, SpeculativeDecoder, probs_from_logits, run_plain

    model, tok = copy_model
    sp = SamplingParams(temperature=0.8, top_k=4)
    # a state inside the trunk's greedy 2-cycle (greedy prefill), where the copy head is often right
    dec = SpeculativeDecoder(model, k=2)
    ids = prompt_ids(tok)[2]
    dec.prefill(ids + run_plain(model, ids, 20).tokens)
    dec.params, dec.gen = sp, torch.Generator()  # from here on: sampled rounds
    state = dec.save()
    p = probs_from_logits(model.trunk(torch.tensor([dec.tokens]), use_cache=False).logits[0, -1], sp).numpy()
    counts = np.zeros(len(p))
    verdicts = []
    for i in range(400):
        dec.restore(state)
        dec.gen.manual_seed(1000 + i)
        emitted, drafts = dec.step()
        counts[emitted[0]] += 1
        verdicts.append(emitted[0] == drafts[0])
    stat, df = chi2_stat(counts, p)
    assert stat < chi2_critical(df, 1e-3), (stat, counts, p)
    assert 0 < sum(verdicts) < len(verdicts)  # both accepted and resampled first tokens occurred


# ----------------------------------------------------------------------------- transformers' own MTP


def test_transformers_generate_use_mtp_agrees(rt):
    """transformers 5 drafts with GLM's MTP layer itself; its per-round acceptance == ours (k=1, greedy)."""
    from mtpq.runtime.speculative import load_model

    # transformers ties the head's embedding and output to the trunk's: use a GLM-4.6-style head
    folder = rt.ckpt("glm4moe", "copy46")
    model, tok = load_model(rt.gguf("glm4moe", "copy46"), device="cpu")
    hf = hf_model("glm4moe", folder)
    # the loader finds the head by the real models' layer numbers (92 / 46); point it at layer 2
    hf._keys_to_ignore_on_load_unexpected = [r"model\.layers\.2\..*"]
    total = accepted_like_transformers(hf, model, prompt_ids(tok)[:3])
    assert total > 0  # transformers did load and use the head


# ----------------------------------------------------------------------------- tokenizer, metrics, input


def test_tokenizer_rebuilt_from_gguf_matches_original(glm_folder, f32_gguf):
    from transformers import AutoTokenizer

    from mtpq.runtime.tokenizer import tokenizer_from_gguf
    from mtpq.runtime.weights import GGUFFile

    ours = tokenizer_from_gguf(GGUFFile(f32_gguf))
    ref = AutoTokenizer.from_pretrained(str(glm_folder))
    texts = [
        "def add(a, b):\n    return a + b\n",
        "The quick brown fox   jumps!! 12345 3.14 ünïcödé 🚀",
        "[gMASK]<sop><|user|>\nhi there<|assistant|>",
        "  leading\t\ttabs\n\n\nx's it'll  ",
        "",
        "for i in range(10):\n    print(i, i * i)  # comment",
    ]
    for s in texts:
        a, b = ours.encode(s), ref.encode(s)
        assert a == b, s
        assert ours.decode(a) == ref.decode(b) == s
    assert ours.convert_tokens_to_ids("[gMASK]") == ref.convert_tokens_to_ids("[gMASK]")
    assert ours.eos_token == ref.eos_token
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == ref.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False
    )


GLM_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)  # the split regex of GLM-4.5's tokenizer.json


def test_tokenizer_glm4_pre_tokenizer(glm_folder, f32_gguf, tmp_path):
    """tokenizer.ggml.pre=glm4: llama.cpp's transcription of GLM's split regex behaves like the original."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from mtpq.gguf_io import plan_from_gguf, write_plan
    from mtpq.runtime.tokenizer import tokenizer_from_gguf
    from mtpq.runtime.weights import GGUFFile

    plan = plan_from_gguf(f32_gguf)
    plan.set_kv("tokenizer.ggml.pre", "glm4", gguf.GGUFValueType.STRING)
    path = tmp_path / "glm4-pre.gguf"
    write_plan(plan, path)
    ours = tokenizer_from_gguf(GGUFFile(path))
    raw = Tokenizer.from_file(str(glm_folder / "tokenizer.json"))
    raw.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(GLM_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    ref = PreTrainedTokenizerFast(tokenizer_object=raw)
    for s in ["It's 12345 apples'LL do\r\n\n  x", "def f(x):\n\treturn x**2  # ünï 🚀", "  a  b   c"]:
        assert ours.encode(s) == ref.encode(s), s
        assert ours.decode(ours.encode(s)) == s


def test_metrics_follow_vllm_definitions():
    from mtpq.acceptance.metrics import GenerationResult, metrics_from_rounds

    a = GenerationResult(prompt_len=3, tokens=list(range(9)), k=3, accepted=[0, 2, 3], drafted=[3, 3, 3], seconds=2.0)
    b = GenerationResult(prompt_len=3, tokens=list(range(3)), k=3, accepted=[1], drafted=[3], seconds=1.0)
    m = metrics_from_rounds([a, b])
    assert (m.n_drafts, m.n_drafted, m.n_accepted) == (4, 12, 6)
    assert m.acceptance_rate == pytest.approx(6 / 12)
    assert m.per_position == pytest.approx([3 / 4, 2 / 4, 1 / 4])  # drafts that accepted > i tokens
    assert m.mean_acceptance_length == pytest.approx(1 + 6 / 4)
    assert m.tokens_per_s == pytest.approx(12 / 3.0)
    assert m.ci[0] <= m.acceptance_rate <= m.ci[1]
    wide = m.ci[1] - m.ci[0]
    many = metrics_from_rounds([a, b] * 25)
    assert many.acceptance_rate == pytest.approx(m.acceptance_rate)
    assert many.ci[1] - many.ci[0] < wide / 3  # the interval shrinks like 1/sqrt(n)


def test_bad_input_names_the_file(tmp_path, f32_gguf):
    from mtpq.errors import InputError
    from mtpq.runtime.speculative import SpeculativeDecoder, load_model

    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all")
    with pytest.raises(InputError) as e:
        load_model(junk, device="cpu")
    assert "junk.gguf" in e.value.where
    with pytest.raises(InputError):
        load_model(tmp_path / "missing.gguf", device="cpu")
    model, _ = load_model(f32_gguf, device="cpu")
    with pytest.raises(ValueError):
        SpeculativeDecoder(model, k=9)


def test_runtime_tokenizer_ids_match_transformers_view(f32_gguf):
    """The light tokenizer's own bos/eos ids equal those of the full transformers tokenizer it stands for."""
    from mtpq.runtime.tokenizer import tokenizer_from_gguf
    from mtpq.runtime.weights import GGUFFile

    tok = tokenizer_from_gguf(GGUFFile(f32_gguf))
    own = (tok.bos_token_id, tok.eos_token_id)
    full = tok._build_full()
    assert own == (full.bos_token_id, full.eos_token_id) and tok.eos_token_id is not None
