"""The DeepSeek-V3 / R1 runtime (GGUF arch ``deepseek2``): what only DeepSeek has (test_runtime_contract.py
holds what every family must do: trunk and MTP head against transformers, the speculative loop, quantized ==
dequantized, bf16).

- the layouts the contract runs: MLA everywhere, low-rank or plain queries, a latent cache;
- YaRN's frequencies and softmax mscale and the pair order are load-bearing (the agreement can fail);
- transformers' ``generate(use_mtp=True)`` accepts exactly the drafts our k=1 loop accepts;
- ``mtpq accept`` end to end; unsupported RoPE scaling and unsplit kv_b are refused with the file named;
- llama.cpp runs the same GGUFs to the same greedy output and drafts.

The loop tests use a "trunk copy" head (tests/builders/tiny_deepseek2.py): a one-layer trunk whose MTP block is
a copy of that layer fed the next token's embedding; it agrees with the trunk's next prediction ~60 % of the time.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.hfmtp import accepted_like_transformers
from tests.helpers.llama_server import llama_server_completions, run_like_llama_cpp
from tests.helpers.runcli import run_cli
from tests.helpers.runtime import PROMPTS, REL_TOL, close, hf_model

FAMILY = "deepseek2"


@pytest.fixture(scope="module")
def v3_ckpt(rt) -> Path:
    return rt.ckpt(FAMILY, "v3")


@pytest.fixture(scope="module")
def v3_gguf(rt) -> Path:
    return rt.gguf(FAMILY, "v3")


@pytest.fixture(scope="module")
def copy_ckpt(rt) -> Path:
    return rt.ckpt(FAMILY, "copy")


@pytest.fixture(scope="module")
def copy_gguf(rt) -> Path:
    return rt.loop_gguf(FAMILY)


@pytest.fixture(scope="module")
def copy_model(rt):
    return rt.loop_model(FAMILY)


def prompt_ids(tok) -> list[list[int]]:
    return [tok.encode(s) for s in PROMPTS]


# ----------------------------------------------------------------------------- trunk


@pytest.mark.parametrize("variant", ["v3", "plain_q", "v2_lite_yarn"])
def test_mla_layout(variant, rt):
    from mtpq.runtime.families import load
    from mtpq.runtime.layers import MoE
    from mtpq.runtime.mla import MLA

    model = load(rt.gguf(FAMILY, variant))
    blocks = list(model.blocks)
    assert all(isinstance(b.attn, MLA) for b in blocks) and isinstance(blocks[-1].ffn, MoE)
    low_rank_q = variant != "plain_q"
    assert all((b.attn.wq_a is not None) == low_rank_q for b in blocks)
    assert (not isinstance(blocks[0].ffn, MoE)) == low_rank_q  # v3 layouts: one dense lead layer
    assert model.family.rope.neox is False
    model.trunk(torch.arange(9)[None])
    assert (
        model.blocks[0].attn.wkv_a is not None
        and model.trunk_cache[0].buffers[0].shape[-1] == model.cfg.mla.kv_lora_rank
    )  # the cache holds the latent, not per-head keys


def test_yarn_and_pair_order_matter(v3_ckpt, v3_gguf):
    """The agreement above can fail: NeoX pair order, plain RoPE frequencies or no softmax mscale all miss."""
    from dataclasses import replace

    from mtpq.runtime.families import load
    from mtpq.runtime.layers import rope_inv_freq

    hf = hf_model(FAMILY, v3_ckpt)
    ids = torch.randint(0, 512, (1, 96), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids).logits
    scale = ref.abs().max().item()

    def diff(mutate) -> float:
        model = load(v3_gguf)
        mutate(model)
        model.family.rope._memo = None
        return close(model.trunk(ids, use_cache=False).logits, ref)[0]

    assert diff(lambda m: None) <= REL_TOL * scale
    assert diff(lambda m: setattr(m.family.rope, "neox", True)) > 100 * REL_TOL * scale
    rope_dim = load(v3_gguf).family.rope.dim
    assert diff(lambda m: setattr(m.family.rope, "inv_freq", rope_inv_freq(rope_dim, 10000.0))) > 10 * REL_TOL * scale

    def plain_softmax_scale(m):
        for b in m.blocks:
            b.attn.cfg = replace(b.attn.cfg, kq_scale=(b.attn.cfg.qk_nope_dim + b.attn.cfg.qk_rope_dim) ** -0.5)

    assert diff(plain_softmax_scale) > 100 * REL_TOL * scale


# ----------------------------------------------------------------------------- MTP head in transformers


def test_transformers_generate_use_mtp_agrees(copy_ckpt, copy_model):
    """transformers drafts with DeepSeek's MTP layer itself; its per-round acceptance == ours (k=1, greedy)."""
    from mtpq.runtime.speculative import run_speculative

    model, tok = copy_model
    hf = hf_model(FAMILY, copy_ckpt)
    hf._keys_to_ignore_on_load_unexpected = [r"model\.layers\.1\..*"]  # it looks for the head at layer 61
    prompts = prompt_ids(tok)
    accepted = accepted_like_transformers(hf, model, prompts)
    eos = {hf.generation_config.eos_token_id}
    drafts = sum(run_speculative(model, ids, 32, k=1, stop_ids=eos).n_drafts for ids in prompts)
    # the head really drafts (and is sometimes wrong): the agreement means something
    assert 0.3 * drafts <= accepted < drafts, (accepted, drafts)


# ----------------------------------------------------------------------------- CLI and bad input


def test_accept_cli_end_to_end(copy_gguf, copy_model, tmp_path):
    """``mtpq accept`` on a DeepSeek GGUF: its k=1 figures == the teacher-forced estimator's."""
    from mtpq.runtime.speculative import run_plain, teacher_forced_acceptance

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"category": "code", "prompt": p}) + "\n" for p in PROMPTS))
    res = run_cli("accept", copy_gguf, "--prompts", prompts, "-k", "1", "-n", "24", "--json", "-")
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    model, tok = copy_model
    drafts = accepted = 0
    for p in PROMPTS:
        ids = tok.encode(p)
        cont = run_plain(model, ids, 24, stop_ids={tok.eos_token_id}).tokens  # accept stops at EOS
        tf = teacher_forced_acceptance(model, ids + cont, prompt_len=len(ids))
        drafts += tf.loop_drafts
        accepted += tf.loop_accepted
    assert (rep["drafts"], rep["accepted"]) == (drafts, accepted)
    assert 0.3 < rep["acceptance_rate"] < 1 and rep["greedy_outputs_identical"] is True


def test_unsupported_rope_scaling_names_the_file(v3_gguf, tmp_path):
    import gguf

    from mtpq.errors import InputError
    from mtpq.gguf_io import plan_from_gguf, write_plan
    from mtpq.runtime.families import load

    plan = plan_from_gguf(v3_gguf)
    plan.set_kv("deepseek2.rope.scaling.type", "linear", gguf.GGUFValueType.STRING)
    path = tmp_path / "linear.gguf"
    write_plan(plan, path)
    with pytest.raises(InputError) as e:
        load(path)
    assert "linear.gguf" in e.value.where and "linear" in str(e.value)
    res = run_cli("accept", path)
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1, res.output


def test_gguf_without_split_kv_b_is_refused(v3_gguf, tmp_path):
    """Old GGUFs keep MLA's kv_b unsplit (attn_kv_b): refused with the file named, not misread."""
    from mtpq.errors import InputError
    from mtpq.gguf_io import plan_from_gguf, write_plan
    from mtpq.runtime.families import load

    plan = plan_from_gguf(v3_gguf)
    plan.tensors = [t for t in plan.tensors if not t.name.startswith(("blk.1.attn_k_b", "blk.1.attn_v_b"))]
    path = tmp_path / "legacy.gguf"
    write_plan(plan, path)
    with pytest.raises(InputError) as e:
        load(path)
    assert "legacy.gguf" in e.value.where and "blk.1.attn_k_b" in e.value.problem


# ----------------------------------------------------------------------------- llama.cpp


@pytest.mark.llama_cpp
def test_llama_cpp_agrees(v3_gguf, copy_gguf, copy_model, llama_cpp_bin, rt):
    """llama.cpp runs the same GGUFs (MLA, YaRN, its MTP draft context): greedy output == ours, and with
    its pairing convention emulated (see run_like_llama_cpp) it drafts and accepts exactly what we do."""
    from mtpq.runtime.families import load
    from mtpq.runtime.speculative import run_plain, run_speculative

    model, tok = copy_model
    prompts = prompt_ids(tok)
    eos = {tok.eos_token_id}
    bare = rt.gguf(FAMILY, "bare_yarn")  # YaRN without mscale_all_dim (tests/helpers/runtime.py)
    for path, ours in ((v3_gguf, load(v3_gguf)), (bare, load(bare)), (copy_gguf, model)):
        total = 0
        for ids, ref in zip(prompts, llama_server_completions(llama_cpp_bin, path, prompts, 32)):
            assert ref["tokens"] == run_plain(ours, ids, 32, stop_ids=eos).tokens, (path.name, ids)
            assert ref["tokens"] == run_speculative(ours, ids, 32, k=1, stop_ids=eos).tokens
            timings = ref["timings"]
            assert (timings["draft_n"], timings["draft_n_accepted"]) == run_like_llama_cpp(ours, ids, 32, eos)
            total += timings["draft_n_accepted"]
        if path == copy_gguf:
            assert total > 10  # the comparison covers accepted drafts, not just rejections
