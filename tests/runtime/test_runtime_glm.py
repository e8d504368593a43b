"""The bundled GLM-4.5 runtime against independent truth.

- trunk logits == transformers' Glm4MoeForCausalLM (f32 GGUFs from ``mtpq convert``);
- quantized GGUFs (q8_0, q4_K) == the same model on weights dequantized by gguf-py;
- the MTP head == the MTP math written here with transformers' Glm4MoeDecoderLayer;
- greedy speculative == plain greedy; teacher-forced counts == the k=1 loop's;
- rejection sampling keeps the target distribution (chi-square, with a power check);
- transformers' own ``generate(use_mtp=True)`` accepts the same drafts as our loop;
- the tokenizer rebuilt from GGUF metadata == the original HF tokenizer.

Random tiny models draft nothing useful, so the loop tests use a "copy head": its
eh_proj passes hnorm(h_t) through, its block is shrunk towards identity and its
output head is the token embedding, so it predicts x_t again -- right whenever
greedy decoding of the random trunk falls into a 2-cycle, wrong elsewhere: a mix
of accepted and rejected drafts, including runs of several accepted ones.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from statistics import NormalDist

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from safetensors.torch import load_file

from tests.builders import tiny
from tests.helpers.hfmtp import accepted_like_transformers
from tests.helpers.runcli import run_cli

PROMPTS = ["def add(a, b):\n", "The quick brown fox", "for i in range(10):", "class Point:"]
REL_TOL = 1e-4  # of the logit scale, for f32 agreement



# ----------------------------------------------------------------------------- fixtures


def convert(src: Path, out: Path, outtype: str = "f32") -> Path:
    res = run_cli("convert", src, out, "--outtype", outtype, "-q")
    assert res.exit_code == 0, res.output
    return out


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runtime")


@pytest.fixture(scope="module")
def f32_gguf(glm_ckpt, work) -> Path:
    return convert(glm_ckpt, work / "glm-f32.gguf")


@pytest.fixture(scope="module")
def alt_ckpt(work) -> Path:
    """Other code paths: group-limited routing, no renormalisation, no q/k norm or bias, MoE from layer 0."""
    return tiny.glm4moe(work / "alt", dtype=torch.float32, seed=3, glm46=True, n_group=2, topk_group=1,
                        norm_topk_prob=False, use_qk_norm=False, attention_bias=False, first_k_dense_replace=0,
                        num_hidden_layers=3)


@pytest.fixture(scope="module")
def copy_gguf(work) -> Path:
    src = tiny.copy_head(tiny.glm4moe(work / "copy", dtype=torch.float32))
    return convert(src, work / "copy-f32.gguf")


@pytest.fixture(scope="module")
def model_f32(f32_gguf):
    from mtpq.runtime.speculative import load_model

    return load_model(f32_gguf, device="cpu")


@pytest.fixture(scope="module")
def copy_model(copy_gguf):
    from mtpq.runtime.speculative import load_model

    return load_model(copy_gguf, device="cpu")


def hf_model(folder: Path):
    from transformers import Glm4MoeForCausalLM

    return Glm4MoeForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def prompt_ids(tok) -> list[list[int]]:
    return [tok.encode(s) for s in PROMPTS]


def close(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    return (ours.float() - ref.float()).abs().max().item(), ref.abs().max().item()


# ----------------------------------------------------------------------------- trunk


@pytest.mark.parametrize("which", ["default", "alt"])
def test_trunk_logits_match_transformers(which, glm_ckpt, alt_ckpt, work):
    from mtpq.runtime.layers import MoE
    from mtpq.runtime.families import load

    folder = glm_ckpt if which == "default" else alt_ckpt
    model = load(convert(folder, work / f"trunk-{which}.gguf"))
    hf = hf_model(folder)
    blocks = list(model.blocks)
    assert any(isinstance(b.ffn, MoE) for b in blocks)  # the MoE path is exercised
    if which == "default":
        assert blocks[1].attn.q_norm is not None and blocks[1].attn.wq.bias is not None
        assert not isinstance(blocks[0].ffn, MoE)  # dense first layer
    else:
        assert model.cfg.moe.n_group == 2 and model.cfg.moe.topk_group == 1 and not model.cfg.moe.norm_topk
    gen = torch.Generator().manual_seed(1)
    for n in (1, 7, 40):
        ids = torch.randint(0, model.cfg.vocab_size, (1, n), generator=gen)
        with torch.no_grad():
            ref = hf(ids).logits
        diff, scale = close(model.trunk(ids, use_cache=False).logits, ref)
        assert diff <= REL_TOL * scale, (n, diff, scale)
        # the same through the KV cache, fed in uneven chunks
        model.reset()
        parts = [model.trunk(ids[:, a:b]).logits for a, b in ((0, n // 3), (n // 3, n - 1), (n - 1, n)) if b > a]
        diff, scale = close(torch.cat(parts, dim=1), ref)
        assert diff <= REL_TOL * scale, ("cached", n, diff, scale)


def dequantized_copy(src: Path, out: Path) -> Path:
    """The GGUF ``src`` with every quantized tensor replaced by gguf-py's dequantization, as F32."""
    from mtpq.gguf_io import plan_from_gguf, write_plan

    plan = plan_from_gguf(src)
    specs = []
    for s in plan.tensors:
        if s.source_type in (T.F32, T.F16, T.BF16):
            specs.append(s)
            continue
        load = (lambda s=s: torch.from_numpy(gguf.quants.dequantize(np.asarray(s.load_raw()), s.source_type)
                                             .astype(np.float32)).reshape(s.shape))
        specs.append(replace(s, ggml_type=T.F32, load=load, load_raw=None, source_type=None))
    plan.tensors = specs
    write_plan(plan, out)
    return out


def requantized(src: Path, out: Path, qtype: T) -> Path:
    from mtpq.gguf_io import plan_from_gguf, write_plan
    from mtpq.ggml.kernels import SUPPORTED_TYPES

    assert qtype in SUPPORTED_TYPES, f"no {qtype.name} kernel"  # a dropped kernel fails here, never skips
    plan = plan_from_gguf(src)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    plan.tensors = [s.with_type(qtype, "test") if len(s.shape) >= 2 and s.shape[-1] % block == 0
                    and "ffn_gate_inp" not in s.name else s for s in plan.tensors]
    write_plan(plan, out)
    return out


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K], ids=lambda t: t.name.lower())
def test_quantized_gguf_equals_dequantized_weights(qtype, glm_ckpt, f32_gguf, work, monkeypatch):
    from mtpq.runtime import weights
    from mtpq.runtime.families import load

    if qtype == T.Q8_0:
        qpath = convert(glm_ckpt, work / "glm-q8_0.gguf", "q8_0")
    else:
        qpath = requantized(f32_gguf, work / "glm-q4_k.gguf", qtype)
    ref_path = dequantized_copy(qpath, work / f"glm-{qtype.name}-deq.gguf")
    quant, ref, full = load(qpath), load(ref_path), load(f32_gguf)
    # the weights really stay quantized on the device: raw GGUF bytes, not floats
    w = quant.blocks[1].ffn.gate
    assert w.qtype == qtype and w.data.dtype == torch.uint8
    assert quant.tok_embd.qtype == qtype and quant.mtp.eh_proj.weight.qtype == qtype
    ids = torch.randint(0, quant.cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(2))
    q_out, r_out, f_out = (m.trunk(ids, use_cache=False) for m in (quant, ref, full))
    diff, scale = close(q_out.logits, r_out.logits)
    assert diff <= REL_TOL * scale, (diff, scale)
    q_head = quant.draft(ids[:, 1:], q_out.hidden[:, :-1], use_cache=False).logits
    r_head = ref.draft(ids[:, 1:], r_out.hidden[:, :-1], use_cache=False).logits
    diff, scale = close(q_head, r_head)
    assert diff <= REL_TOL * scale, ("head", diff, scale)
    assert close(q_out.logits, f_out.logits)[0] > 10 * REL_TOL * scale  # quantization did change the model
    # big quantized matrices are decoded in slabs of rows: force slabs everywhere, same logits
    monkeypatch.setattr(weights, "DEQUANT_CHUNK", 5000)
    diff, scale = close(quant.trunk(ids, use_cache=False).logits, q_out.logits)
    assert diff <= 1e-6 * scale, ("slabs", diff)


def test_bf16_compute_matches_transformers_bf16(glm_ckpt, f32_gguf):
    """bf16 compute: against transformers in bf16 (bf16 vs f32 differs far more, by routing flips, in both)."""
    from transformers import Glm4MoeForCausalLM

    from mtpq.runtime.families import load
    from mtpq.runtime.speculative import run_speculative

    half = load(f32_gguf, dtype=torch.bfloat16)
    assert half.blocks[0].attn.wq.weight.data.dtype == torch.bfloat16
    hf = Glm4MoeForCausalLM.from_pretrained(str(glm_ckpt), dtype=torch.bfloat16).eval()
    ids = torch.randint(0, half.cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = hf(ids).logits.float()
    diff, scale = close(half.trunk(ids, use_cache=False).logits, ref)
    assert diff <= 0.02 * scale, (diff, scale)  # a couple of bf16 ulps at the logit scale
    assert len(run_speculative(half, ids[0].tolist(), 8, k=2).tokens) == 8


# ----------------------------------------------------------------------------- MTP head oracle


class MtpOracle:
    """The MTP math of DESIGN.md, written with transformers' own decoder layer and plain torch."""

    def __init__(self, folder: Path):
        from transformers import Glm4MoeConfig
        from transformers.models.glm4_moe.modeling_glm4_moe import (Glm4MoeDecoderLayer, Glm4MoeRMSNorm,
                                                                    Glm4MoeRotaryEmbedding)

        self.hf = hf_model(folder)
        cfg = Glm4MoeConfig.from_pretrained(str(folder))
        cfg.first_k_dense_replace = 0  # the MTP block is a MoE block
        cfg._attn_implementation = "eager"
        n = cfg.num_hidden_layers
        p = f"model.layers.{n}."
        sd = {}
        for f in sorted(folder.glob("*.safetensors")):
            sd.update({k[len(p):]: v.float() for k, v in load_file(str(f)).items() if k.startswith(p)})
        self.layer = Glm4MoeDecoderLayer(cfg, layer_idx=0).eval()
        layer_sd = {k: v for k, v in sd.items() if k.startswith(("self_attn.", "input_layernorm.",
                                                                  "post_attention_layernorm.", "mlp.gate.",
                                                                  "mlp.shared_experts."))}
        E = cfg.n_routed_experts
        layer_sd["mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([sd[f"mlp.experts.{e}.gate_proj.weight"], sd[f"mlp.experts.{e}.up_proj.weight"]]) for e in range(E)])
        layer_sd["mlp.experts.down_proj"] = torch.stack([sd[f"mlp.experts.{e}.down_proj.weight"] for e in range(E)])
        self.layer.load_state_dict(layer_sd, strict=True)

        def norm(key: str):
            m = Glm4MoeRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
            m.weight.data.copy_(sd[key])
            return m

        self.enorm, self.hnorm, self.head_norm = norm("enorm.weight"), norm("hnorm.weight"), norm("shared_head.norm.weight")
        self.eh_proj = sd["eh_proj.weight"]
        self.embed = sd.get("embed_tokens.weight", self.hf.model.embed_tokens.weight.detach())
        self.head = sd.get("shared_head.head.weight", self.hf.lm_head.weight.detach())
        self.rotary = Glm4MoeRotaryEmbedding(cfg)

    @torch.no_grad()
    def trunk_hidden(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(post-norm, pre-norm) last hidden states of transformers' trunk."""
        seen = {}
        hook = self.hf.model.norm.register_forward_pre_hook(lambda mod, args: seen.setdefault("pre", args[0]))
        try:
            post = self.hf.model(ids).last_hidden_state
        finally:
            hook.remove()
        return post, seen["pre"]

    @torch.no_grad()
    def __call__(self, next_ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and post-norm output for the pairs (hidden[t], next_ids[t]), positions 0..T-1, causal."""
        T_ = next_ids.shape[1]
        e = F.embedding(next_ids, self.embed)
        u = F.linear(torch.cat([self.enorm(e), self.hnorm(hidden)], dim=-1), self.eh_proj)
        pos = torch.arange(T_)[None]
        mask = torch.full((T_, T_), float("-inf")).triu(1)[None, None]
        g = self.layer(u, attention_mask=mask, position_ids=pos, position_embeddings=self.rotary(u, pos))
        normed = self.head_norm(g)
        return F.linear(normed, self.head), normed


@pytest.mark.parametrize("glm46", [False, True])
def test_mtp_head_matches_independent_implementation(glm46, glm_ckpt, f32_gguf, work):
    from mtpq.runtime.families import load

    if glm46:  # head's embed_tokens / shared_head.head absent: must fall back to token_embd / output
        folder = tiny.glm4moe(work / "glm46", dtype=torch.float32, glm46=True, seed=4)
        path = convert(folder, work / "glm46-f32.gguf")
    else:
        folder, path = glm_ckpt, f32_gguf
    model = load(path)
    assert (model.mtp.tied_embed and model.mtp.tied_head) == glm46
    oracle = MtpOracle(folder)
    ids = torch.randint(0, model.cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(5))
    h_ref, _ = oracle.trunk_hidden(ids)
    ref_logits, ref_out = oracle(ids[:, 1:], h_ref[:, :-1])

    trunk = model.trunk(ids, use_cache=False)
    ours = model.draft(ids[:, 1:], trunk.hidden[:, :-1], use_cache=False)
    diff, scale = close(ours.logits, ref_logits)
    assert diff <= REL_TOL * scale, (diff, scale)

    # cached: the real pairs, then a second draft fed the head's own post-norm output and drafted token
    model.reset()
    first = model.draft(ids[:, 1:], trunk.hidden[:, :-1])
    d1 = first.logits[0, -1].argmax().view(1, 1)
    second = model.draft(d1, first.hidden[:, -1:])
    chained_logits, _ = oracle(torch.cat([ids[:, 1:], d1], dim=1), torch.cat([h_ref[:, :-1], ref_out[:, -1:]], dim=1))
    diff, scale = close(second.logits[:, -1], chained_logits[:, -1])
    assert diff <= REL_TOL * scale, ("draft 2", diff, scale)


def test_pre_norm_switch_feeds_the_pre_norm_state(glm_ckpt, f32_gguf):
    from mtpq.runtime.families import load

    post, pre = load(f32_gguf), load(f32_gguf, hidden="pre_norm")
    oracle = MtpOracle(glm_ckpt)
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


# ----------------------------------------------------------------------------- speculative loop


def test_greedy_speculative_equals_plain_greedy(copy_model):
    from mtpq.runtime.speculative import SpeculativeDecoder, run_plain, run_speculative

    model, tok = copy_model
    accepted_any, rejected_any, multi = 0, 0, 0
    for ids in prompt_ids(tok):
        base = run_plain(model, ids, 32)
        for k in (1, 2, 3, 4):
            spec = run_speculative(model, ids, 32, k=k)
            assert spec.tokens == base.tokens, (k, ids)
            assert spec.drafted == [k] * spec.n_drafts and len(spec.accepted) == spec.n_drafts
            accepted_any += spec.n_accepted
            rejected_any += sum(a < k for a in spec.accepted)
            multi += sum(a >= 2 for a in spec.accepted)
            assert spec.trunk_forwards == 1 + spec.n_drafts
    # the comparison means something only if drafts were both accepted and rejected, several at a time too
    assert accepted_any > 0 and rejected_any > 0 and multi > 0
    # cache bookkeeping: the trunk holds every token but the last; the head every consumed real pair
    dec = SpeculativeDecoder(model, k=3)
    dec.prefill(prompt_ids(tok)[2])
    for _ in range(10):
        dec.step()
        assert model.trunk_length == len(dec.tokens) - 1
        assert model.mtp_length == len(dec.tokens) - 1 - dec.pending_ids.shape[1]


def test_teacher_forced_acceptance_equals_loop(copy_model):
    from mtpq.acceptance.metrics import metrics_from_rounds
    from mtpq.runtime.speculative import (run_plain, run_speculative, teacher_forced_acceptance,
                                          teacher_forced_acceptances)

    model, tok = copy_model
    matched = mismatched = 0
    prompts = prompt_ids(tok)
    bases = [run_plain(model, ids, 40) for ids in prompts]
    # all sequences packed into one pass == each on its own (the packing keeps them apart)
    packed = teacher_forced_acceptances(model, [(ids + b.tokens, len(ids)) for ids, b in zip(prompts, bases)])
    for ids, base, tf in zip(prompts, bases, packed):
        assert tf.matches == teacher_forced_acceptance(model, ids + base.tokens, prompt_len=len(ids)).matches
        loop = run_speculative(model, ids, 40, k=1)
        assert (tf.loop_drafts, tf.loop_accepted) == (loop.n_drafts, loop.n_accepted)
        assert metrics_from_rounds([loop]).per_position[0] == pytest.approx(tf.loop_rate)
        # round by round: the loop's verdicts are the teacher-forced ones at the positions it visits
        j, n = len(ids), len(ids)
        for a in loop.accepted:
            assert tf.matches[j - n] == bool(a)
            j += 2 if a else 1
        assert len(tf.matches) == len(base.tokens)
        matched += sum(tf.matches)
        mismatched += len(tf.matches) - sum(tf.matches)
    assert matched > 0 and mismatched > 0


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


def test_transformers_generate_use_mtp_agrees(work):
    """transformers 5 drafts with GLM's MTP layer itself; its per-round acceptance == ours (k=1, greedy)."""
    from mtpq.runtime.speculative import load_model

    # transformers ties the head's embedding and output to the trunk's: use a GLM-4.6-style head
    folder = tiny.copy_head(tiny.glm4moe(work / "copy46", dtype=torch.float32, glm46=True))
    model, tok = load_model(convert(folder, work / "copy46.gguf"), device="cpu")
    hf = hf_model(folder)
    # the loader finds the head by the real models' layer numbers (92 / 46); point it at layer 2
    hf._keys_to_ignore_on_load_unexpected = [r"model\.layers\.2\..*"]
    total = accepted_like_transformers(hf, model, prompt_ids(tok)[:3])
    assert total > 0  # transformers did load and use the head


# ----------------------------------------------------------------------------- tokenizer, metrics, input


def test_tokenizer_rebuilt_from_gguf_matches_original(glm_ckpt, f32_gguf):
    from transformers import AutoTokenizer

    from mtpq.runtime.tokenizer import tokenizer_from_gguf
    from mtpq.runtime.weights import GGUFFile

    ours = tokenizer_from_gguf(GGUFFile(f32_gguf))
    ref = AutoTokenizer.from_pretrained(str(glm_ckpt))
    texts = ["def add(a, b):\n    return a + b\n", "The quick brown fox   jumps!! 12345 3.14 ünïcödé 🚀",
             "[gMASK]<sop><|user|>\nhi there<|assistant|>", "  leading\t\ttabs\n\n\nx's it'll  ", "",
             "for i in range(10):\n    print(i, i * i)  # comment"]
    for s in texts:
        a, b = ours.encode(s), ref.encode(s)
        assert a == b, s
        assert ours.decode(a) == ref.decode(b) == s
    assert ours.convert_tokens_to_ids("[gMASK]") == ref.convert_tokens_to_ids("[gMASK]")
    assert ours.eos_token == ref.eos_token
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
        ref.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


GLM_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")  # the split regex of GLM-4.5's tokenizer.json


def test_tokenizer_glm4_pre_tokenizer(glm_ckpt, f32_gguf, work):
    """tokenizer.ggml.pre=glm4: llama.cpp's transcription of GLM's split regex behaves like the original."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from mtpq.gguf_io import plan_from_gguf, write_plan
    from mtpq.runtime.tokenizer import tokenizer_from_gguf
    from mtpq.runtime.weights import GGUFFile

    plan = plan_from_gguf(f32_gguf)
    plan.set_kv("tokenizer.ggml.pre", "glm4", gguf.GGUFValueType.STRING)
    path = work / "glm4-pre.gguf"
    write_plan(plan, path)
    ours = tokenizer_from_gguf(GGUFFile(path))
    raw = Tokenizer.from_file(str(glm_ckpt / "tokenizer.json"))
    raw.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GLM_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
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
