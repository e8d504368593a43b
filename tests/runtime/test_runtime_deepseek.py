"""The DeepSeek-V3 / R1 runtime (GGUF arch ``deepseek2``) against independent truth.

- trunk logits == transformers' DeepseekV3ForCausalLM (f32 GGUFs from ``mtpq convert``): low-rank
  and plain queries, YaRN with DeepSeek-V3's and V2-Lite's mscale, no scaling; full prompt, and token
  by token through the latent cache;
- the MTP head == transformers' own MtpModel (the layer ``generate(use_mtp=True)`` drafts with);
- greedy speculative == plain greedy (k = 1..4); teacher-forced counts == the k=1 loop's;
- transformers' ``generate(use_mtp=True)`` accepts exactly the drafts our k=1 loop accepts;
- a Q4_K_M GGUF (head at q8_0) runs with its weights quantized == the same model dequantized by gguf-py;
- ``mtpq accept`` end to end.

Random heads draft nothing, so the loop tests use a "trunk copy" head (tests/builders/tiny_deepseek.py): a
one-layer trunk whose MTP block is a copy of that layer fed the next token's embedding; it agrees
with the trunk's next prediction about 60 % of the time.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from tests.builders import tiny_deepseek
from tests.helpers.hfmtp import accepted_like_transformers
from tests.helpers.llamacpp_ref import free_port
from tests.helpers.runcli import run_cli
from tests.runtime.test_runtime_glm import dequantized_copy  # the GLM tests' gguf-py dequantization of a whole GGUF

PROMPTS = ["def add(a, b):\n", "The quick brown fox", "for i in range(10):", "class Point:"]
REL_TOL = 1e-4  # of the logit scale, for f32 agreement
V2_LITE_YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
                "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 10000.0}
VARIANTS = {
    # DeepSeek-V3's layout: low-rank q, YaRN (mscale = mscale_all_dim = 1), one dense lead layer, 2 groups
    "v3": {},
    # "lite" attention (plain q_proj), no RoPE scaling, MoE from layer 0, one group, no renormalisation
    "plain_q": dict(q_lora_rank=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                    first_k_dense_replace=0, n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0),
    # V2-Lite's YaRN: mscale = mscale_all_dim = 0.707, factor 40 (the softmax scale moves, cos/sin do not)
    "v2_lite_yarn": dict(rope_parameters=V2_LITE_YARN, max_position_embeddings=163840, seed=2),
}


def convert(src: Path, out: Path, outtype: str = "f32") -> Path:
    res = run_cli("convert", src, out, "--outtype", outtype, "-q")
    assert res.exit_code == 0, res.output
    return out


def hf_model(folder: Path):
    from transformers import DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def close(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    return (ours.float() - ref.float()).abs().max().item(), ref.abs().max().item()


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runtime_deepseek")


def checkpoint(work: Path, name: str, **over) -> Path:
    folder = work / name
    if not (folder / "config.json").exists():
        tiny_deepseek.deepseek_v3(folder, dtype=torch.float32, **over)
    return folder


@pytest.fixture(scope="module")
def v3_ckpt(work) -> Path:
    return checkpoint(work, "v3")


@pytest.fixture(scope="module")
def v3_gguf(v3_ckpt, work) -> Path:
    return convert(v3_ckpt, work / "v3-f32.gguf")


@pytest.fixture(scope="module")
def copy_ckpt(work) -> Path:
    folder = tiny_deepseek.deepseek_v3(work / "copy", dtype=torch.float32, mtp_head_tensors=False,
                                       num_hidden_layers=1, first_k_dense_replace=0)
    return tiny_deepseek.trunk_copy_head(folder)


@pytest.fixture(scope="module")
def copy_gguf(copy_ckpt, work) -> Path:
    return convert(copy_ckpt, work / "copy-f32.gguf")


@pytest.fixture(scope="module")
def copy_model(copy_gguf):
    from mtpq.runtime.speculative import load_model

    return load_model(copy_gguf, device="cpu")


def prompt_ids(tok) -> list[list[int]]:
    return [tok.encode(s) for s in PROMPTS]


# ----------------------------------------------------------------------------- trunk


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_trunk_logits_match_transformers(variant, work):
    from mtpq.runtime.layers import MoE
    from mtpq.runtime.mla import MLA
    from mtpq.runtime.families import load

    folder = checkpoint(work, variant, **VARIANTS[variant])
    model = load(convert(folder, work / f"{variant}-f32.gguf"))
    hf = hf_model(folder)
    blocks = list(model.blocks)
    assert all(isinstance(b.attn, MLA) for b in blocks) and isinstance(blocks[-1].ffn, MoE)
    low_rank_q = variant != "plain_q"
    assert all((b.attn.wq_a is not None) == low_rank_q for b in blocks)
    assert (not isinstance(blocks[0].ffn, MoE)) == low_rank_q  # v3 layouts: one dense lead layer
    assert model.family.rope.neox is False
    gen = torch.Generator().manual_seed(1)
    for n in (1, 9, 96):
        ids = torch.randint(0, model.cfg.vocab_size, (1, n), generator=gen)
        with torch.no_grad():
            ref = hf(ids).logits
        diff, scale = close(model.trunk(ids, use_cache=False).logits, ref)
        assert diff <= REL_TOL * scale, (n, diff, scale)
        # through the latent cache: a prefill of half the prompt, then one token at a time
        model.reset()
        half = max(1, n // 2)
        parts = [model.trunk(ids[:, :half]).logits] + [model.trunk(ids[:, i:i + 1]).logits for i in range(half, n)]
        diff, scale = close(torch.cat(parts, dim=1), ref)
        assert diff <= REL_TOL * scale, ("cached", n, diff, scale)
        assert model.blocks[0].attn.wkv_a is not None and model.trunk_cache[0].buffers[0].shape[-1] == \
            model.cfg.mla.kv_lora_rank  # the cache holds the latent, not per-head keys


def test_yarn_and_pair_order_matter(v3_ckpt, v3_gguf):
    """The agreement above can fail: NeoX pair order, plain RoPE frequencies or no softmax mscale all miss."""
    from dataclasses import replace

    from mtpq.runtime.layers import rope_inv_freq
    from mtpq.runtime.families import load

    hf = hf_model(v3_ckpt)
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


def test_bf16_compute_matches_transformers_bf16(v3_ckpt, v3_gguf):
    """bf16 compute (weights, latent cache and absorbed products in bf16; softmax and routing in f32) against
    transformers in bf16: on this prompt both flip the same expert choice, far from f32 (0.27 of 1.35)."""
    from transformers import DeepseekV3ForCausalLM

    from mtpq.runtime.families import load
    from mtpq.runtime.speculative import run_speculative

    half = load(v3_gguf, dtype=torch.bfloat16)
    assert half.blocks[0].attn.wkv_a.weight.data.dtype == torch.bfloat16
    hf = DeepseekV3ForCausalLM.from_pretrained(str(v3_ckpt), dtype=torch.bfloat16).eval()
    ids = torch.randint(0, half.cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = hf(ids).logits.float()
    diff, scale = close(half.trunk(ids, use_cache=False).logits, ref)
    assert diff <= 0.02 * scale, (diff, scale)  # a couple of bf16 ulps at the logit scale
    assert len(run_speculative(half, ids[0].tolist(), 8, k=2).tokens) == 8


# ----------------------------------------------------------------------------- MTP head


def test_mtp_head_matches_transformers_mtp_model(work):
    """Our NextN head on (h_t, x_{t+1}) == transformers' MtpModel (random head, YaRN, head tied to the trunk)."""
    from transformers.modeling_layers import MtpModel

    from mtpq.runtime.families import load

    folder = checkpoint(work, "tied", mtp_head_tensors=False, seed=4)
    model = load(convert(folder, work / "tied-f32.gguf"))
    assert model.mtp.tied_embed and model.mtp.tied_head
    hf = hf_model(folder)
    hf._keys_to_ignore_on_load_unexpected = [r"model\.layers\.2\..*"]  # it looks for the head at layer 61
    mtp = MtpModel.from_pretrained(hf).eval()
    n = 40
    ids = torch.randint(0, model.cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        h = hf.model(ids).last_hidden_state
        ref_out = mtp.forward_layer(0, h[:, :-1], torch.arange(1, n)[None], None, input_ids=ids[:, 1:])
        ref = mtp._project_to_logits(ref_out)
    trunk = model.trunk(ids, use_cache=False)
    ours = model.draft(ids[:, 1:], trunk.hidden[:, :-1], use_cache=False)
    diff, scale = close(ours.logits, ref)
    assert diff <= REL_TOL * scale, (diff, scale)
    assert close(ours.hidden, ref_out)[0] <= REL_TOL * ref_out.abs().max().item()
    # the same through the head's own latent cache, pair by pair
    model.reset()
    steps = [model.draft(ids[:, i + 1:i + 2], trunk.hidden[:, i:i + 1]).logits for i in range(n - 1)]
    diff, scale = close(torch.cat(steps, dim=1), ref)
    assert diff <= REL_TOL * scale, ("cached", diff, scale)


# ----------------------------------------------------------------------------- speculative loop


def test_greedy_speculative_equals_plain_greedy(copy_model):
    from mtpq.runtime.speculative import SpeculativeDecoder, run_plain, run_speculative

    model, tok = copy_model
    accepted_any = rejected_any = multi = 0
    for ids in prompt_ids(tok):
        base = run_plain(model, ids, 32)
        for k in (1, 2, 3, 4):
            spec = run_speculative(model, ids, 32, k=k)
            assert spec.tokens == base.tokens, (k, ids)
            assert spec.drafted == [k] * spec.n_drafts and len(spec.accepted) == spec.n_drafts
            accepted_any += spec.n_accepted
            rejected_any += sum(a < k for a in spec.accepted)
            multi += sum(a >= 2 for a in spec.accepted)
    # the comparison means something only if drafts were both accepted and rejected, several at a time too
    assert accepted_any > 0 and rejected_any > 0 and multi > 0
    # latent caches after rollbacks: the trunk holds every token but the last; the head every consumed real pair
    dec = SpeculativeDecoder(model, k=3)
    dec.prefill(prompt_ids(tok)[2])
    for _ in range(10):
        dec.step()
        assert model.trunk_length == len(dec.tokens) - 1
        assert model.mtp_length == len(dec.tokens) - 1 - dec.pending_ids.shape[1]


def test_teacher_forced_acceptance_equals_loop(copy_model):
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
        j, n = len(ids), len(ids)
        for a in loop.accepted:  # round by round: the loop's verdicts are the teacher-forced ones
            assert tf.matches[j - n] == bool(a)
            j += 2 if a else 1
        matched += sum(tf.matches)
        mismatched += len(tf.matches) - sum(tf.matches)
    assert matched > 0 and mismatched > 0


def test_transformers_generate_use_mtp_agrees(copy_ckpt, copy_model):
    """transformers drafts with DeepSeek's MTP layer itself; its per-round acceptance == ours (k=1, greedy)."""
    from mtpq.runtime.speculative import run_speculative

    model, tok = copy_model
    hf = hf_model(copy_ckpt)
    hf._keys_to_ignore_on_load_unexpected = [r"model\.layers\.1\..*"]  # it looks for the head at layer 61
    prompts = prompt_ids(tok)
    accepted = accepted_like_transformers(hf, model, prompts)
    eos = {hf.generation_config.eos_token_id}
    drafts = sum(run_speculative(model, ids, 32, k=1, stop_ids=eos).n_drafts for ids in prompts)
    # the head really drafts (and is sometimes wrong): the agreement means something
    assert 0.3 * drafts <= accepted < drafts, (accepted, drafts)


# ----------------------------------------------------------------------------- quantized


def test_q4_k_m_gguf_stays_quantized_and_equals_dequantized(v3_gguf, work, monkeypatch):
    from mtpq.runtime import weights
    from mtpq.runtime.families import load
    from mtpq.runtime.speculative import run_plain, run_speculative

    qpath = work / "v3-q4_k_m.gguf"
    res = run_cli("quantize", v3_gguf, qpath, "Q4_K_M", "-q")
    assert res.exit_code == 0, res.output
    quant = load(qpath)
    ref = load(dequantized_copy(qpath, work / "v3-q4_k_m-deq.gguf"))
    full = load(v3_gguf)
    attn, ffn = quant.blocks[1].attn, quant.blocks[1].ffn
    # trunk weights are raw GGUF bytes on the device; the head's block is held at q8_0
    assert attn.wq.weight.qtype == T.Q4_K and attn.wq.weight.data.dtype == torch.uint8
    assert ffn.gate.qtype in (T.Q4_K, T.Q5_K, T.Q6_K) and ffn.gate.data.dtype == torch.uint8
    assert attn.k_b.quantized and attn.v_b.quantized
    head_attn = quant.mtp.block.attn
    assert quant.mtp.eh_proj.weight.qtype == T.Q8_0 and head_attn.wq.weight.qtype == T.Q8_0
    assert quant.mtp.block.ffn.down.qtype == T.Q8_0 and head_attn.k_b.qtype == T.Q8_0
    ids = torch.randint(0, quant.cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(2))
    q_out, r_out = quant.trunk(ids, use_cache=False), ref.trunk(ids, use_cache=False)
    diff, scale = close(q_out.logits, r_out.logits)
    assert diff <= REL_TOL * scale, (diff, scale)
    q_head = quant.draft(ids[:, 1:], q_out.hidden[:, :-1], use_cache=False).logits
    r_head = ref.draft(ids[:, 1:], r_out.hidden[:, :-1], use_cache=False).logits
    diff, scale = close(q_head, r_head)
    assert diff <= REL_TOL * scale, ("head", diff, scale)
    assert close(q_out.logits, full.trunk(ids, use_cache=False).logits)[0] > 10 * REL_TOL * scale  # it did quantize
    # the loop runs on the quantized model (slabs of rows for big matrices: same logits)
    monkeypatch.setattr(weights, "DEQUANT_CHUNK", 5000)
    assert close(quant.trunk(ids, use_cache=False).logits, q_out.logits)[0] <= 1e-6 * scale
    prompt = ids[0, :5].tolist()
    assert run_speculative(quant, prompt, 12, k=2).tokens == run_plain(quant, prompt, 12).tokens


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


# llama.cpp's defaults (f16 KV caches, flash attention on CPU) move logits by ~2e-4: enough to flip the
# greedy ties of these tiny models (top-2 margins down to 5e-4). With f32 caches and no flash attention,
# its top-2 margins equal ours to 5 decimals.
F32_CACHES = ["-ctk", "f32", "-ctv", "f32", "-ctkd", "f32", "-ctvd", "f32", "-fa", "off"]


def _llama_server_completions(bin_dir: Path, gguf_path: Path, prompts: list[list[int]], n: int) -> list[dict]:
    """Greedy completions of token prompts from llama-server drafting with the file's MTP head (k=1)."""
    import subprocess
    import time
    import urllib.request

    port = free_port()
    server = subprocess.Popen([str(bin_dir / "llama-server"), "-m", str(gguf_path), "--spec-type", "draft-mtp",
                               "--spec-draft-n-max", "1", "-c", "512", "-t", "1", "-np", "1", "--no-repack",
                               *F32_CACHES,
                               "--host", "127.0.0.1", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if server.poll() is not None:
                pytest.fail(f"llama-server exited: {server.stderr.read()[-2000:]}")
            try:
                if json.loads(urllib.request.urlopen(url + "/health", timeout=1).read()).get("status") == "ok":
                    break
            except OSError:
                pass
            time.sleep(0.1)
        out = []
        for ids in prompts:
            body = {"prompt": ids, "n_predict": n, "temperature": 0, "top_k": 1, "return_tokens": True,
                    "cache_prompt": False}
            req = urllib.request.Request(url + "/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            out.append(json.loads(urllib.request.urlopen(req, timeout=120).read()))
        return out
    finally:
        server.terminate()
        server.wait(timeout=30)


def run_like_llama_cpp(model, ids: list[int], n: int, stop_ids: set[int]):
    """Our k=1 loop with llama.cpp's MTP context convention: its head also consumes a pair
    (zeros, x_0) for the first prompt token (common/speculative.cpp pairs each token with the
    previous position's hidden state, and the first with a zero-initialised one). We and
    transformers start at (h_0, x_1). -> (drafts, accepted)"""
    from mtpq.runtime import speculative as sp

    class LlamaCppPairs(sp.SpeculativeDecoder):
        def prefill(self, prompt_ids):
            first = super().prefill(prompt_ids)
            self.pending_ids = torch.cat([torch.tensor([prompt_ids[:1]]), self.pending_ids], dim=1)
            self.pending_hidden = torch.cat([torch.zeros_like(self.pending_hidden[:, :1]), self.pending_hidden], 1)
            return first

    dec = LlamaCppPairs(model, k=1)
    generated, drafts, accepted = [dec.prefill(ids)], 0, 0
    while len(generated) < n - 1 and not (stop_ids & set(generated)):  # llama-server: no draft for the last token
        emitted, _ = dec.step()
        generated += emitted
        drafts, accepted = drafts + 1, accepted + len(emitted) - 1
    return drafts, accepted


# YaRN without mscale_all_dim: transformers scales only cos/sin by get_mscale(f), llama.cpp also the softmax
# (mla.yarn_mla_scales); greedy outputs of the two differ on every test prompt, ours follow llama.cpp's
BARE_YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
             "beta_slow": 1, "rope_theta": 10000.0}


@pytest.mark.llama_cpp
def test_llama_cpp_agrees(v3_gguf, copy_gguf, copy_model, llama_cpp_bin, work):
    """llama.cpp runs the same GGUFs (MLA, YaRN, its MTP draft context): greedy output == ours, and with
    its pairing convention emulated (see run_like_llama_cpp) it drafts and accepts exactly what we do."""
    from mtpq.runtime.families import load
    from mtpq.runtime.speculative import run_plain, run_speculative

    model, tok = copy_model
    prompts = prompt_ids(tok)
    eos = {tok.eos_token_id}
    bare = convert(checkpoint(work, "bare_yarn", rope_parameters=BARE_YARN, max_position_embeddings=32768, seed=5),
                   work / "bare_yarn-f32.gguf")
    for path, ours in ((v3_gguf, load(v3_gguf)), (bare, load(bare)), (copy_gguf, model)):
        total = 0
        for ids, ref in zip(prompts, _llama_server_completions(llama_cpp_bin, path, prompts, 32)):
            assert ref["tokens"] == run_plain(ours, ids, 32, stop_ids=eos).tokens, (path.name, ids)
            assert ref["tokens"] == run_speculative(ours, ids, 32, k=1, stop_ids=eos).tokens
            timings = ref["timings"]
            assert (timings["draft_n"], timings["draft_n_accepted"]) == run_like_llama_cpp(ours, ids, 32, eos)
            total += timings["draft_n_accepted"]
        if path == copy_gguf:
            assert total > 10  # the comparison covers accepted drafts, not just rejections
