"""What only DeepSeek-V4 has: its head lives in a file of its own, and llama.cpp drafts with it as ``-md``.

The parity of the logits (trunk and head, against libllama) is in test_llama_cpp_parity.py, the contract (caches,
loops, quantized files) in test_runtime_contract.py on the pair written as one file. Here the drafting itself:
``llama-speculative-simple -m TRUNK -md HEAD --spec-type draft-mtp`` and the torch loop driven on its schedule
(tests/helpers/llamacpp_ref.py ``speculative_simple_counts``) give the same counters, prompt by prompt, at k=1 and at
k=3 (drafts 2..k fed the head's own streams), on bigram models of the release-shaped fixture (window 16, indexer
top-k 2: the prompts cross both), every float tensor F32 and llama.cpp's caches f32 (as the parity test: llama.cpp
rounds the activations of Q8_0 / MXFP4 / BF16 weights, batch-dependently, which flips near-ties of these models).
"""

from __future__ import annotations

import pytest

from tests.helpers.runtime import bigram_gguf, convert


@pytest.fixture(scope="module")
def pair(rt, tmp_path_factory):
    """(trunk file, head file): the fixture's bigram models, as llama.cpp's converter lays them out, all F32."""
    from tests.runtime.test_llama_cpp_parity import sharpened

    work = tmp_path_factory.mktemp("ds4-pair")
    ckpt = rt.ckpt("deepseek4", "release")
    out = []
    for what in ("no-mtp", "mtp-only"):
        f32 = convert(ckpt, work / f"{what}.gguf", "f32", f"--{what}")
        out.append(
            sharpened(bigram_gguf(f32, work / f"{what}-bigram.gguf"), work / f"{what}-f32.gguf", factor=1.0, f32=True)
        )
    return tuple(out)


def test_paired_view_is_the_one_file_fixture(pair, tmp_path):
    """The runtime on (trunk, head) through PairedGGUF == on the two written as one (paired_file: the contract's)."""
    import torch

    from mtpq.gguf_io.pair import PairedGGUF
    from mtpq.runtime.families import load
    from tests.helpers.runtime import paired_file

    trunk, head = pair
    a, b = load(trunk, g=PairedGGUF(trunk, head)), load(paired_file(trunk, head, tmp_path / "one.gguf"))
    ids = torch.randint(0, a.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    ta, tb = a.trunk(ids, use_cache=False), b.trunk(ids, use_cache=False)
    assert torch.equal(ta.logits, tb.logits) and torch.equal(ta.hidden, tb.hidden)
    da, db = (m.draft(ids[:, 1:], t.hidden[:, :-1], use_cache=False) for m, t in ((a, ta), (b, tb)))
    assert torch.equal(da.logits, db.logits) and torch.equal(da.hidden, db.hidden)


@pytest.mark.llama_cpp
@pytest.mark.parametrize("k", [1, 3])
def test_draft_counts_equal_llama_cpp(pair, k, llama_cpp_bin, tmp_path):
    from mtpq.runtime.speculative import load_model
    from tests.helpers.llamacpp_ref import LOOP_PROMPTS, greedy_drafting, speculative_simple, speculative_simple_counts

    trunk, head = pair
    model, tok = load_model(trunk, device="cpu", head=head)
    accepted = drafted = 0
    for i, text in enumerate(LOOP_PROMPTS):
        prompt = tmp_path / f"p{i}.txt"
        prompt.write_text(text)
        flags = (*greedy_drafting(k), "-t", "1", "-ctk", "f32", "-ctv", "f32", "-fa", "off")
        _, theirs = speculative_simple(
            llama_cpp_bin, "-m", trunk, "-md", head, "-f", prompt, "--no-escape", "-n", 32, *flags
        )
        ours = speculative_simple_counts(model, tok.encode(text), 32, k, {tok.eos_token_id})
        assert ours == {key: theirs[key] for key in ours}, (i, ours, theirs)
        accepted, drafted = accepted + ours["n_accept"], drafted + ours["n_drafted"]
    print(f"\ndeepseek4 k={k}: {drafted} drafted / {accepted} accepted over {len(LOOP_PROMPTS)} prompts, as llama.cpp")
    assert accepted > 0
