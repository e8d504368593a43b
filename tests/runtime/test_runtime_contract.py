"""What every runtime family (glm4moe, qwen35, qwen35moe, deepseek2, glm-dsa, deepseek32, hy_v3, cohere2moe,
bailingmoe3, qwen3next, nemotron_h_moe, step35, mimo2, deepseek4) must do, against independent truth.

- trunk logits == transformers' causal LM of the family (f32 GGUFs from ``mtpq convert``), for the whole
  prompt and through the caches (a prefill, a chunk on top of it, then token by token); where transformers does
  not run the family (NO_TRANSFORMERS), the cached passes == the uncached one (llama.cpp's parity test,
  test_llama_cpp_parity.py, is the truth there);
- the MTP head == an independent head (tests/helpers/runtime.py: transformers' own layers, or its MtpModel;
  hy_v3, cohere2moe and bailingmoe3 have none: their heads are checked against llama.cpp's MTP context only),
  uncached, pair by pair through the head's cache, and for a second draft fed the head's own output; the
  pre-norm switch feeds something else, which the head notices;
- greedy speculative == plain greedy for k = 1..4, with both accepted and rejected drafts, and the caches
  hold what they should after rollbacks; teacher-forced counts == the k=1 loop's;
- a quantized GGUF stays quantized in memory and equals its copy dequantized by gguf-py (trunk and head);
- bf16 compute is as close to transformers as transformers' own bf16.

transformers runs DeepSeek-V3.2 and GLM-5 without their MTP heads and breaks the sparse attention's ties at the top-k
its own way (test_runtime_dsa.py compares it where no keys tie): they are in NO_TRANSFORMERS, with release-shaped
fixtures (tests/releases) of top-k 8, so the contexts below drop keys (glm52: a GLM-5.2 shared block).
qwen3next and nemotron_h_moe run on their release-shaped checkpoints; transformers runs their trunks but not their
heads, whose truth is llama.cpp's MTP graph: their heads take the cached == uncached check (NO_HEAD_ORACLE).
transformers runs neither Step-3.5 nor MiMo-V2 (remote code): NO_TRANSFORMERS too, on tiny fixtures whose sliding
window (16) the contexts below cross; their several heads draft chained (every head checked through its cache).
Nor DeepSeek-V4: NO_TRANSFORMERS, on its release-shaped fixture with a window of 16 and an indexer top-k of 2 (150
tokens also cross an HCA block of 128); its head lives in a file of its own, and the fixture is the trunk and head
pair written as one file (tests/helpers/runtime.py paired_file: what PairedGGUF shows the runtime).

What only one family has (its layouts, RoPE variants, DeltaNet, tokenizers, sampling...) stays in
test_runtime_<family>.py.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from mtpq.runtime.archs import RUNTIME_ARCHS_IN_ORDER
from tests.helpers.runcli import run_cli
from tests.helpers.runtime import (
    LOOP_VARIANT,
    PROMPTS,
    REL_TOL,
    close,
    convert,
    dequantized_copy,
    hf_model,
    oracle,
    random_prompts,
    requantized,
)

FAMILIES = RUNTIME_ARCHS_IN_ORDER  # every family the runtime runs
# transformers 5.25's bailing_hybrid reads Ling 3.0 under other tensor names and shapes (A_log [n_head], its own
# head_dim): it does not load the release's checkpoints
NO_TRANSFORMERS = ("bailingmoe3", "glm-dsa", "deepseek32", "step35", "mimo2", "deepseek4")
HF_FAMILIES = tuple(f for f in FAMILIES if f not in NO_TRANSFORMERS)
NO_HEAD_ORACLE = ("qwen3next", "nemotron_h_moe")  # transformers runs their trunks only
TRUNK_VARIANTS = {
    "glm4moe": ("default", "alt"),
    "qwen35": ("dense", "dense_tied"),
    "qwen35moe": ("moe",),
    "deepseek2": ("v3", "plain_q", "v2_lite_yarn"),
    "hy_v3": ("default",),
    "cohere2moe": ("default", "rms"),
    "bailingmoe3": ("default", "alt"),
    "glm-dsa": ("glm5", "glm52"),
    "deepseek32": ("v32",),
    "qwen3next": ("release",),
    "nemotron_h_moe": ("release",),
    "step35": ("tiny",),
    "mimo2": ("tiny", "flash"),
    "deepseek4": ("release",),
}
TRUNK_LENGTHS = {
    "glm4moe": (1, 7, 40),
    "qwen35": (1, 9, 40, 150),
    "qwen35moe": (1, 9, 40, 150),
    "deepseek2": (1, 9, 96),
    "hy_v3": (1, 7, 40),
    "cohere2moe": (1, 9, 40),
    "bailingmoe3": (1, 9, 40),
    "glm-dsa": (1, 9, 40),
    "deepseek32": (1, 9, 40),
    "qwen3next": (1, 9, 40, 150),
    "nemotron_h_moe": (1, 9, 100),
    "step35": (1, 9, 40),
    "mimo2": (1, 9, 40),
    "deepseek4": (1, 9, 40, 150),
}
# qwen35, qwen3next, bailingmoe3: the token-by-token form, one chunk, several; nemotron_h_moe: Mamba-2 token by
# token, then chunks of 64; cohere2moe, step35, mimo2: past their window (16)
# (variant, whether the head shares the trunk's token_embd and output)
HEAD_VARIANTS = {
    "glm4moe": (("default", False), ("glm46", True)),
    "qwen35": (("dense", True), ("dense_tied", True)),
    "qwen35moe": (("moe", True),),
    "deepseek2": (("tied", True),),
}
DEFAULT = {
    "glm4moe": "default",
    "qwen35": "dense",
    "qwen35moe": "moe",
    "deepseek2": "v3",
    "hy_v3": "default",
    "cohere2moe": "default",
    "bailingmoe3": "default",
    "glm-dsa": "glm5",
    "deepseek32": "v32",
    "qwen3next": "release",
    "nemotron_h_moe": "release",
    "step35": "tiny",
    "mimo2": "tiny",
    "deepseek4": "release",
}


def cases(table: dict, families: tuple[str, ...] = FAMILIES) -> list:
    return [
        pytest.param(f, *([v] if isinstance(v, str) else v), id=f"{f}-{v if isinstance(v, str) else v[0]}")
        for f in families
        for v in table.get(f, ())
    ]


# ----------------------------------------------------------------------------- trunk


def check_trunk(model, family: str, reference) -> None:
    """The trunk's logits == ``reference(ids)`` for random prompts of the family's lengths, uncached and through the
    caches (a prefill, an uneven chunk on top of it, then the rest one token at a time)."""
    gen = torch.Generator().manual_seed(1)
    for n in TRUNK_LENGTHS[family]:
        ids = torch.randint(0, model.cfg.vocab_size, (1, n), generator=gen)
        ref = reference(ids)
        diff, scale = close(model.trunk(ids, use_cache=False).logits, ref)
        assert diff <= REL_TOL * scale, (n, diff, scale)
        model.reset()
        a, b = n // 4, 3 * n // 4
        parts = [model.trunk(ids[:, i:j]).logits for i, j in ((0, a), (a, b)) if j > i]
        parts += [model.trunk(ids[:, i : i + 1]).logits for i in range(b, n)]
        diff, scale = close(torch.cat(parts, dim=1), ref)
        assert diff <= REL_TOL * scale, ("cached", n, diff, scale)
        assert model.trunk_length == n and {c.length for c in model.trunk_cache} == {n}


@pytest.mark.parametrize("family, variant", cases(TRUNK_VARIANTS, HF_FAMILIES))
def test_trunk_logits_match_transformers(family, variant, rt):
    from mtpq.runtime.families import load

    hf = hf_model(family, rt.ckpt(family, variant))
    with torch.no_grad():
        check_trunk(load(rt.gguf(family, variant)), family, lambda ids: hf(ids).logits)


@pytest.mark.parametrize("family, variant", cases(TRUNK_VARIANTS, NO_TRANSFORMERS))
def test_cached_trunk_equals_uncached(family, variant, rt):
    """Where transformers does not run the family: the caches give the uncached pass's logits."""
    from mtpq.runtime.families import load

    check_trunk(
        load(rt.gguf(family, variant)),
        family,
        lambda ids: load(rt.gguf(family, variant)).trunk(ids, use_cache=False).logits,
    )


@pytest.mark.parametrize("family, variant", cases(TRUNK_VARIANTS, NO_TRANSFORMERS + NO_HEAD_ORACLE))
def test_cached_head_equals_uncached(family, variant, rt):
    """Where transformers does not run the head: each head pair by pair through its cache gives its uncached pass."""
    from mtpq.runtime.families import load

    model = load(rt.gguf(family, variant))
    n = 40
    ids = torch.randint(0, model.cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(1))
    full = model.trunk(ids, use_cache=False)
    for h in range(model.n_heads):
        head = model.draft(ids[:, 1:], full.hidden[:, :-1], use_cache=False, head=h).logits
        steps = [model.draft(ids[:, i + 1 : i + 2], full.hidden[:, i : i + 1], head=h).logits for i in range(n - 1)]
        diff, scale = close(torch.cat(steps, dim=1), head)
        assert diff <= REL_TOL * scale, ("head", h, diff, scale)
        assert model.head_cache(h).length == n - 1


BF16_WEIGHT = {
    "glm4moe": lambda m: m.blocks[0].attn.wq.weight,
    "qwen35": lambda m: m.blocks[0].attn.wqkv.weight,
    "qwen35moe": lambda m: m.blocks[0].attn.wqkv.weight,
    "deepseek2": lambda m: m.blocks[0].attn.wkv_a.weight,
    "hy_v3": lambda m: m.blocks[0].attn.wq.weight,
    "cohere2moe": lambda m: m.blocks[0].attn.wq.weight,
}
BF16_WEIGHT["qwen3next"] = BF16_WEIGHT["qwen35moe"]
BF16_LENGTH = {
    "glm4moe": 24,
    "qwen35": 100,
    "qwen35moe": 100,
    "deepseek2": 24,
    "hy_v3": 24,
    "cohere2moe": 24,
    "qwen3next": 100,
}
# not nemotron_h_moe: transformers' NemotronH multiplies its norms' weights in f32 before rounding to bf16 (ours, as
# for Llama-style norms, in bf16), and on the release-shaped model one rounding apart flips a top-2 expert pick here
# and there: the largest error is which flips land where (transformers' own: 0.015 to 0.080 over three seeds), while
# the mean error is transformers' (0.0031 against 0.0030)
BF16_FAMILIES = [f for f in HF_FAMILIES if f in BF16_WEIGHT]


@pytest.mark.parametrize("family", BF16_FAMILIES)
def test_bf16_compute_matches_transformers_bf16(family, rt):
    """bf16 compute: as far from the f32 truth as transformers in bf16 is, and (GLM, DeepSeek: both flip the
    same routing choices, far from f32) within a couple of bf16 ulps of transformers in bf16."""
    from mtpq.runtime.families import load
    from mtpq.runtime.speculative import run_speculative

    folder = rt.ckpt(family, DEFAULT[family])
    half = load(rt.gguf(family, DEFAULT[family]), dtype=torch.bfloat16)
    assert BF16_WEIGHT[family](half).data.dtype == torch.bfloat16
    ids = torch.randint(0, half.cfg.vocab_size, (1, BF16_LENGTH[family]), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        truth = hf_model(family, folder)(ids).logits
        hf_half = hf_model(family, folder, torch.bfloat16)(ids).logits.float()
    ours = half.trunk(ids, use_cache=False).logits
    assert 0 < close(ours, truth)[0] <= 2 * close(hf_half, truth)[0]
    if family in ("glm4moe", "deepseek2"):
        diff, scale = close(ours, hf_half)
        assert diff <= 0.02 * scale, (diff, scale)
    assert len(run_speculative(half, ids[0, :10].tolist(), 8, k=2).tokens) == 8


# ----------------------------------------------------------------------------- MTP head


@pytest.mark.parametrize("family, variant, tied", cases(HEAD_VARIANTS))
def test_mtp_head_matches_independent_implementation(family, variant, tied, rt):
    from mtpq.runtime.families import load

    path = rt.gguf(family, variant)
    model = load(path)
    assert (model.mtp.tied_embed and model.mtp.tied_head) == tied  # a head without them uses the trunk's
    ref_head = oracle(family, rt.ckpt(family, variant))
    n = 20
    ids = torch.randint(0, model.cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        h_ref = ref_head.hf.model(ids).last_hidden_state
    ref_logits, ref_out = ref_head(ids[:, 1:], h_ref[:, :-1])

    trunk = model.trunk(ids, use_cache=False)
    assert close(trunk.hidden, h_ref)[0] <= 1e-5  # the head is fed the trunk's post-norm state
    ours = model.draft(ids[:, 1:], trunk.hidden[:, :-1], use_cache=False)
    diff, scale = close(ours.logits, ref_logits)
    assert diff <= REL_TOL * scale, (diff, scale)
    assert close(ours.hidden, ref_out)[0] <= REL_TOL * ref_out.abs().max().item()

    # the same through the head's own cache, pair by pair
    model.reset()
    steps = [model.draft(ids[:, i + 1 : i + 2], trunk.hidden[:, i : i + 1]).logits for i in range(n - 1)]
    diff, scale = close(torch.cat(steps, dim=1), ref_logits)
    assert diff <= REL_TOL * scale, ("pair by pair", diff, scale)

    # cached: the real pairs, then a second draft fed the head's own post-norm output and drafted token
    model.reset()
    first = model.draft(ids[:, 1:], trunk.hidden[:, :-1])
    d1 = first.logits[0, -1].argmax().view(1, 1)
    second = model.draft(d1, first.hidden[:, -1:])
    chained, _ = ref_head(torch.cat([ids[:, 1:], d1], dim=1), torch.cat([h_ref[:, :-1], ref_out[:, -1:]], dim=1))
    diff, scale = close(second.logits[:, -1], chained[:, -1])
    assert diff <= REL_TOL * scale, ("draft 2", diff, scale)

    # the pre-norm switch feeds something else, which the head notices
    pre = load(path, hidden="pre_norm")
    pre_logits = pre.draft(ids[:, 1:], pre.trunk(ids, use_cache=False).hidden[:, :-1], use_cache=False).logits
    assert close(pre_logits, ref_logits)[0] > 100 * REL_TOL * scale


# ----------------------------------------------------------------------------- speculative loop


def loop_prompts(family: str, model, tok, varied: bool = False) -> list[list[int]]:
    """The loop model's prompts: the trunk-copy models' tokenizers have real text; the bigram models take random
    ids (``varied``: lengths 8, 10, 12, which the packed teacher-forced pass pads)."""
    if LOOP_VARIANT[family] != "bigram":
        return [tok.encode(s) for s in PROMPTS]
    if varied:
        return [p[: 8 + 2 * i] for i, p in enumerate(random_prompts(3, 12, model.cfg.vocab_size, seed=1))]
    return random_prompts(3, 12, model.cfg.vocab_size, seed=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_speculative_equals_plain_greedy(family, rt):
    from mtpq.runtime.speculative import SpeculativeDecoder, run_plain, run_speculative

    model, tok = rt.loop_model(family)
    prompts = loop_prompts(family, model, tok)
    accepted_any = rejected_any = multi = 0
    for ids in prompts:
        base = run_plain(model, ids, 32)
        for k in (1, 2, 3, 4):
            spec = run_speculative(model, ids, 32, k=k)
            assert spec.tokens == base.tokens, (k, ids)
            drafted = min(k, model.n_heads) if model.chained else k  # chained heads: one draft per head
            assert spec.drafted == [drafted] * spec.n_drafts and len(spec.accepted) == spec.n_drafts
            assert spec.trunk_forwards == 1 + spec.n_drafts
            accepted_any += spec.n_accepted
            rejected_any += sum(a < k for a in spec.accepted)
            multi += sum(a >= 2 for a in spec.accepted)
            if k in (1, 3):  # llama-speculative-simple's rounds: drafting from the prompt's last token on
                simple = run_speculative(model, ids, 32, k=k, rounds="llama-speculative-simple")
                assert simple.tokens == base.tokens, (k, ids)
                assert sum(simple.accepted) + simple.n_drafts > 32 and simple.trunk_forwards == 1 + simple.n_drafts
    # the comparison means something only if drafts were both accepted and rejected, several at a time too
    assert accepted_any > 0 and rejected_any > 0 and multi > 0, (accepted_any, rejected_any, multi)
    # caches after rollbacks: every trunk layer holds every token but the last; each head the decoder drafts with
    # every consumed real pair after its first pair (llama.cpp's (zero state, x_0))
    dec = SpeculativeDecoder(model, k=3)
    dec.prefill(prompts[0])
    for _ in range(10):
        dec.step()
        assert {c.length for c in model.trunk_cache} == {len(dec.tokens) - 1} and model.trunk_length == len(
            dec.tokens
        ) - 1
        assert model.mtp_length == len(dec.tokens) - dec.pending_ids.shape[1]
        assert {model.head_cache(h).length for h in range(dec.heads)} == {model.mtp_length}


@pytest.mark.parametrize("family", FAMILIES)
def test_teacher_forced_acceptance_equals_loop(family, rt):
    from mtpq.acceptance.metrics import metrics_from_rounds
    from mtpq.runtime.speculative import (
        run_plain,
        run_speculative,
        teacher_forced_acceptance,
        teacher_forced_acceptances,
    )

    model, tok = rt.loop_model(family)
    matched = mismatched = 0
    prompts = loop_prompts(family, model, tok, varied=True)
    bases = [run_plain(model, ids, 40) for ids in prompts]
    # all sequences packed into one pass == each on its own (the packing keeps them apart)
    packed = teacher_forced_acceptances(model, [(ids + b.tokens, len(ids)) for ids, b in zip(prompts, bases)])
    for ids, base, tf in zip(prompts, bases, packed):
        assert tf.matches == teacher_forced_acceptance(model, ids + base.tokens, prompt_len=len(ids)).matches
        loop = run_speculative(model, ids, 40, k=1)
        assert (tf.loop_drafts, tf.loop_accepted) == (loop.n_drafts, loop.n_accepted)
        assert metrics_from_rounds([loop]).per_position[0] == pytest.approx(tf.loop_rate)
        j, n = len(ids), len(ids)
        for a in loop.accepted:  # round by round: the loop's verdicts are the teacher-forced ones
            assert tf.matches[j - n] == bool(a)
            j += 2 if a else 1
        assert len(tf.matches) == len(base.tokens)
        matched += sum(tf.matches)
        mismatched += len(tf.matches) - sum(tf.matches)
    assert matched > 0 and mismatched > 0


# ----------------------------------------------------------------------------- quantized


K_TYPES = (T.Q4_K, T.Q5_K, T.Q6_K)  # what Q4_K_M gives the trunk's matrices


def quantized_weights(family: str, m, qtype) -> list[tuple[object, tuple | None]]:
    """(weight, the types it may have; None: any quantized one) for weights that must stay quantized."""
    if family == "glm4moe":  # one type everywhere
        return [(m.blocks[1].ffn.gate, (qtype,)), (m.tok_embd, (qtype,)), (m.mtp.eh_proj.weight, (qtype,))]
    head = m.mtp
    if family in (
        "deepseek2",
        "glm-dsa",
        "deepseek32",
    ):  # the head's block at q8_0, the latent's k_b / v_b quantized too
        attn, ha = m.blocks[1].attn, head.block.attn
        dsa = [(attn.indexer.wq_b.weight, K_TYPES), (attn.indexer.wk.weight, K_TYPES)] if family != "deepseek2" else []
        return [
            (attn.wq.weight, (T.Q4_K,)),
            (m.blocks[1].ffn.gate, K_TYPES),
            (attn.k_b, None),
            (attn.v_b, None),
            (head.eh_proj.weight, (T.Q8_0,)),
            (ha.wq.weight, (T.Q8_0,)),
            (head.block.ffn.down, (T.Q8_0,)),
            (ha.k_b, (T.Q8_0,)),
            *dsa,
        ]
    if family in ("hy_v3", "cohere2moe"):  # GQA and experts in 4-6 bits, the head's block at q8_0
        moe = m.blocks[1].ffn
        moe, head_moe = getattr(moe, "moe", moe), getattr(head.block.ffn, "moe", head.block.ffn)  # (Cohere's average)
        return [
            (m.blocks[1].attn.wq.weight, K_TYPES),
            (m.blocks[1].attn.wo.weight, K_TYPES),
            (moe.gate, K_TYPES),
            (head.eh_proj.weight, (T.Q8_0,)),
            (head.block.attn.wq.weight, (T.Q8_0,)),
            (head_moe.down, (T.Q8_0,)),
        ]
    if family == "nemotron_h_moe":  # Mamba-2, the LatentMoE (experts and latent projections), attention
        moe, hb = m.blocks[1].attn.ffn, head.block
        return [
            (m.blocks[0].attn.w_in.weight, K_TYPES),
            (m.blocks[0].attn.w_out.weight, K_TYPES),
            (moe.up, K_TYPES),
            (moe.down, K_TYPES),
            (moe.latent_down.weight, K_TYPES),
            (moe.shared.up.weight, K_TYPES),
            (m.blocks[2].attn.wq.weight, K_TYPES),
            (head.eh_proj.weight, (T.Q8_0,)),
            (hb.attn.wq.weight, (T.Q8_0,)),
            (hb.ffn.up, (T.Q8_0,)),
            (hb.ffn.latent_up.weight, (T.Q8_0,)),
        ]
    if family == "bailingmoe3":  # KDA, gated MLA and experts in 4-6 bits, the head's MLA block at q8_0
        kda, mla = m.blocks[0].attn, m.blocks[1].attn
        return [
            (kda.wq.weight, K_TYPES),
            (kda.w_decay.weight, K_TYPES),
            (kda.wo.weight, K_TYPES),
            (mla.wq.weight, K_TYPES),
            (mla.k_b, None),
            (m.blocks[1].ffn.gate, K_TYPES),
            (head.eh_proj.weight, (T.Q8_0,)),
            (head.block.attn.wq.weight, (T.Q8_0,)),
            (head.block.ffn.gate, (T.Q8_0,)),
        ]
    if family == "deepseek4":  # compressed attention and experts requantized, the head's block at q8_0
        a, ha = m.blocks[2].attn, head.block.attn
        return [
            (a.wq_a.weight, K_TYPES),
            (a.wkv.weight, K_TYPES),
            (a.wo_a, None),
            (a.idx_q.weight, None),
            (m.blocks[2].ffn.gate, None),
            (head.eh_proj.weight, (T.Q8_0,)),
            (ha.wq_b.weight, (T.Q8_0,)),
            (head.block.ffn.down, (T.Q8_0,)),
        ]
    if family in ("step35", "mimo2"):  # windowed attention and experts in 4-6 bits, every head's block at q8_0
        attn = m.blocks[1].attn
        qkv = attn.qkv.weight if hasattr(attn.qkv, "weight") else attn.qkv.parts[0].weight
        later = m.later_heads[-1]
        return [
            (qkv, K_TYPES),
            (attn.wo.weight, K_TYPES),
            (m.blocks[1].ffn.gate, K_TYPES),
            (head.eh_proj.weight, (T.Q8_0,)),
            (later.eh_proj.weight, (T.Q8_0,)),
            (later.block.ffn.down, (T.Q8_0,)),
        ]
    dn = m.blocks[0].attn  # DeltaNet, attention and FFN in 4-6 bits, the head at q8_0
    return [
        (dn.wqkv.weight, K_TYPES),
        (dn.wz.weight, K_TYPES),
        (dn.wo.weight, K_TYPES),
        (m.blocks[0].ffn.gate, K_TYPES),
        (m.blocks[3].attn.wq.weight, K_TYPES),
        (head.eh_proj.weight, (T.Q8_0,)),
        (head.block.attn.wq.weight, (T.Q8_0,)),
        (head.block.ffn.gate, (T.Q8_0,)),
    ]


def quantized_gguf(family: str, recipe: str, rt, work):
    """-> (path, the one type of the whole file or None for a mix)."""
    out = work / f"{family}-{recipe}.gguf"
    if recipe == "q8_0":  # straight from the checkpoint
        return convert(rt.ckpt(family, DEFAULT[family]), out, "q8_0"), T.Q8_0
    if recipe == "q4_k":  # every matrix requantized
        return requantized(rt.gguf(family, DEFAULT[family]), out, T.Q4_K), T.Q4_K
    # (DeepSeek-V4's converted files keep its FP8 weights as Q8_0)
    res = run_cli(
        "quantize",
        rt.gguf(family, DEFAULT[family]),
        out,
        recipe,
        "-q",
        *(["--allow-requantize"] if family == "deepseek4" else []),
    )
    assert res.exit_code == 0, res.output
    return out, None


QUANT_CASES = [
    ("glm4moe", "q8_0"),
    ("glm4moe", "q4_k"),
    ("qwen35", "Q4_K_M"),
    ("qwen35moe", "Q4_K_M"),
    ("deepseek2", "Q4_K_M"),
    ("glm-dsa", "Q4_K_M"),
    ("deepseek32", "Q4_K_M"),
    ("hy_v3", "Q4_K_M"),
    ("cohere2moe", "Q4_K_M"),
    ("bailingmoe3", "Q4_K_M"),
    ("qwen3next", "Q4_K_M"),
    ("nemotron_h_moe", "Q4_K_M"),
    ("step35", "Q4_K_M"),
    ("mimo2", "Q4_K_M"),
    ("deepseek4", "Q4_K_M"),
]


@pytest.mark.parametrize("family, recipe", QUANT_CASES, ids=[f"{f}-{r.lower()}" for f, r in QUANT_CASES])
def test_quantized_gguf_equals_dequantized_weights(family, recipe, rt, tmp_path, monkeypatch):
    from mtpq.runtime import weights
    from mtpq.runtime.families import load
    from mtpq.runtime.speculative import run_plain, run_speculative

    qpath, qtype = quantized_gguf(family, recipe, rt, tmp_path)
    quant, ref = load(qpath), load(dequantized_copy(qpath, tmp_path / "deq.gguf"))
    full = load(rt.gguf(family, DEFAULT[family]))
    # the weights really stay quantized on the device: raw GGUF bytes, not floats
    for w, types in quantized_weights(family, quant, qtype):
        w = getattr(w, "weight", w)  # a dense FFN's projections are QuantLinear layers, experts bare weights
        assert w.quantized and w.data.dtype == torch.uint8 and (types is None or w.qtype in types), w
    ids = torch.randint(0, quant.cfg.vocab_size, (1, 80), generator=torch.Generator().manual_seed(2))
    q_out, r_out, f_out = (m.trunk(ids, use_cache=False) for m in (quant, ref, full))
    diff, scale = close(q_out.logits, r_out.logits)
    assert diff <= REL_TOL * scale, (diff, scale)
    q_head = quant.draft(ids[:, 1:], q_out.hidden[:, :-1], use_cache=False).logits
    r_head = ref.draft(ids[:, 1:], r_out.hidden[:, :-1], use_cache=False).logits
    diff, scale = close(q_head, r_head)
    assert diff <= REL_TOL * scale, ("head", diff, scale)
    assert close(q_out.logits, f_out.logits)[0] > 10 * REL_TOL * scale  # quantization did change the model
    # a tiny model keeps its matrices dequantized after first use; a big one dequantizes them at each use: the
    # same values, so the same logits
    kept = [getattr(w, "weight", w) for w, _ in quantized_weights(family, quant, qtype)]
    assert all(w.kept is not None for w in kept) and any(w.kept for w in kept), "the tiny model kept nothing"
    monkeypatch.setattr(weights, "KEEP_DEQUANTIZED_BYTES", 0)
    each_use = load(qpath)
    assert all(getattr(w, "weight", w).kept is None for w, _ in quantized_weights(family, each_use, qtype))
    diff, scale = close(each_use.trunk(ids, use_cache=False).logits, q_out.logits)
    assert diff <= 1e-6 * scale, ("dequantized at each use", diff)
    # big quantized matrices are decoded in slabs of rows: force slabs everywhere, the same logits up to the
    # GEMM's summation order, which a narrower matrix may change by an ulp per product (the recurrent layers
    # carry it along the 80 tokens: qwen3next 1.8e-6 of the scale on an AVX-512 CPU); a wrong row would be O(1)
    monkeypatch.setattr(weights, "DEQUANT_CHUNK", 5000)
    diff, scale = close(each_use.trunk(ids, use_cache=False).logits, q_out.logits)
    assert diff <= 1e-5 * scale, ("slabs", diff)
    prompt = ids[0, :10].tolist()  # the loop runs on the quantized model
    assert run_speculative(quant, prompt, 12, k=2).tokens == run_plain(quant, prompt, 12).tokens


@pytest.mark.parametrize(
    "family, recipe",
    [("glm4moe", None), ("deepseek2", "Q4_K_M"), ("qwen35moe", "Q4_K_M"), ("nemotron_h_moe", "Q4_K_M")],
)  # (non-gated experts on a latent)
def test_gathered_experts_equal_the_sparse_path(family, recipe, rt, tmp_path):
    """The MoE path GPUs decode with (experts gathered by id on the device, no host sync) gives what the sparse
    path gives, on float and quantized expert stacks (forced here on the CPU, where it is not chosen)."""
    from mtpq.runtime.families import load
    from mtpq.runtime.layers import MoE

    path = rt.gguf(family, DEFAULT[family]) if recipe is None else quantized_gguf(family, recipe, rt, tmp_path)[0]
    moe = next(m for m in load(path).modules() if isinstance(m, MoE))
    x = torch.randn(4, moe.router.shape[1], generator=torch.Generator().manual_seed(3))
    weights, ids = moe.route(x)
    x = x if moe.latent_down is None else moe.latent_down(x)  # what the experts read
    gathered, sparse = moe._gathered_experts(x, weights, ids), moe._used_experts(x, weights, ids, None)
    diff, scale = close(gathered, sparse)
    assert diff <= 1e-5 * scale and scale > 0, (diff, scale)
