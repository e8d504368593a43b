"""Importance statistics from the runtime (mtpq.runtime.importance) against independent truth.

- trunk: the squared inputs of attn_q / ffn_gate (dense) are what transformers' own
  Glm4MoeForCausalLM feeds those projections (forward pre-hooks on its nn.Linear);
- experts: per expert, the count and squared inputs of the tokens transformers' own router
  sends to it (a pre-hook on its experts module sees the routing);
- head: run as it drafts (n_ctx - 1 pairs a chunk); the first half of eh_proj's input is
  enorm(E[x_{t+1}]), computed here from the checkpoint's own tensors.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.runcli import run_cli

N_CTX = 64


@pytest.fixture(scope="module")
def setup(glm_ckpt, tmp_path_factory):
    from mtpq.runtime.families import load
    from mtpq.runtime.importance import chunk_tokens, collect

    work = tmp_path_factory.mktemp("imatrix")
    path = work / "glm-f32.gguf"
    assert run_cli("convert", glm_ckpt, path, "--outtype", "f32", "-q").exit_code == 0
    model = load(path)
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, model.vocab_size, (3 * N_CTX + 17,), generator=gen).tolist()
    chunks = chunk_tokens(tokens, N_CTX, None, bos_id=None)
    return model, chunks, collect(model, chunks)


def hf_inputs(glm_ckpt: Path, chunks: list[list[int]]) -> dict[str, np.ndarray]:
    """Sum of squared inputs of every nn.Linear of transformers' model, by module name; for its experts
    modules, per-expert (sums [E, H], counts [E]) from the routing it is called with."""
    from transformers import Glm4MoeForCausalLM
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeExperts

    hf = Glm4MoeForCausalLM.from_pretrained(str(glm_ckpt), dtype=torch.float32).eval()
    sums: dict = {}

    def experts_hook(name):
        def pre(mod, args):
            x, ids = args[0].double(), args[1]
            s = np.zeros((mod.num_experts, x.shape[-1]))
            c = np.zeros(mod.num_experts, dtype=np.int64)
            for e in range(mod.num_experts):
                rows = (ids == e).any(dim=-1)
                s[e] = x[rows].pow(2).sum(0).numpy()
                c[e] = int(rows.sum())
            old = sums.get(name, (0, 0))
            sums[name] = (old[0] + s, old[1] + c)

        return pre

    def hook(name):
        def pre(_mod, args):
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            sums[name] = sums.get(name, 0) + x.pow(2).sum(0).numpy()

        return pre

    for name, mod in hf.named_modules():
        if isinstance(mod, torch.nn.Linear):
            mod.register_forward_pre_hook(hook(name))
        elif isinstance(mod, Glm4MoeExperts):
            mod.register_forward_pre_hook(experts_hook(name))
    with torch.no_grad():
        for c in chunks:
            hf(torch.tensor([c]))
    return sums


def test_trunk_statistics_equal_transformers_inputs(setup, glm_ckpt):
    model, chunks, stats = setup
    ref = hf_inputs(glm_ckpt, chunks)
    n_tok = len(chunks) * N_CTX
    assert stats.chunks == 3 and stats.chunk_size == N_CTX
    for ours, theirs in [
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj"),
        ("blk.1.attn_output.weight", "model.layers.1.self_attn.o_proj"),
        ("blk.0.ffn_gate.weight", "model.layers.0.mlp.gate_proj"),
        ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj"),
        ("blk.1.ffn_up_shexp.weight", "model.layers.1.mlp.shared_experts.up_proj"),
    ]:
        st = stats.tensors[ours]
        assert st.counts.tolist() == [n_tok], ours
        np.testing.assert_allclose(st.sums[0], ref[theirs], rtol=1e-4, err_msg=ours)
    assert "output.weight" not in stats.tensors  # llama-imatrix leaves the output matrix out by default


def test_expert_statistics_are_per_routed_token(setup, glm_ckpt):
    model, chunks, stats = setup
    n_tok = len(chunks) * N_CTX
    cfg = model.cfg.moe
    gate = stats.tensors["blk.1.ffn_gate_exps.weight"]
    assert gate.sums.shape == (cfg.n_experts, model.blocks[1].ffn.gate.shape[-1])
    assert gate.counts.sum() == n_tok * cfg.n_used
    ref_sums, ref_counts = hf_inputs(glm_ckpt, chunks)["model.layers.1.mlp.experts"]
    assert gate.counts.tolist() == ref_counts.tolist() and (ref_counts > 0).all()
    np.testing.assert_allclose(gate.sums, ref_sums, rtol=1e-4)
    router_in = stats.tensors["blk.1.ffn_gate_inp.weight"]
    np.testing.assert_allclose(router_in.sums[0], gate.sums.sum(0) / cfg.n_used, rtol=1e-6)
    assert np.array_equal(stats.tensors["blk.1.ffn_up_exps.weight"].counts, gate.counts)
    assert np.array_equal(stats.tensors["blk.1.ffn_down_exps.weight"].counts, gate.counts)


def test_head_statistics_are_collected_as_it_drafts(setup, glm_ckpt):
    model, chunks, stats = setup
    n = model.blocks.__len__()  # the MTP block's index
    eh = stats.tensors[f"blk.{n}.nextn.eh_proj.weight"]
    assert eh.counts.tolist() == [len(chunks) * (N_CTX - 1)]
    assert f"blk.{n}.attn_q.weight" in stats.tensors and f"blk.{n}.ffn_gate_exps.weight" in stats.tensors
    assert f"blk.{n}.nextn.shared_head_head.weight" in stats.tensors
    # first half of eh_proj's input: enorm(E[x_{t+1}]), from the checkpoint's own head tensors
    t = {}
    for shard in sorted(glm_ckpt.glob("*.safetensors")):
        t.update(load_file(shard))
    emb, w = t[f"model.layers.{n}.embed_tokens.weight"].float(), t[f"model.layers.{n}.enorm.weight"].float()
    eps = 1e-5
    expect = 0
    for c in chunks:
        e = emb[torch.tensor(c[1:])].double()
        e = e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + eps) * w.double()
        expect = expect + e.pow(2).sum(0).numpy()
    np.testing.assert_allclose(eh.sums[0, : emb.shape[1]], expect, rtol=1e-4)


def test_head_only_and_trunk_only(setup):
    from mtpq.runtime.importance import collect

    model, chunks, full = setup
    head = collect(model, chunks[:1], trunk=False)
    trunk = collect(model, chunks[:1], head=False)
    n = len(model.blocks)
    assert all(k.startswith(f"blk.{n}.") for k in head.tensors) and head.tensors
    assert not any(k.startswith(f"blk.{n}.") for k in trunk.tensors) and trunk.tensors


# llama-imatrix's own arithmetic in float32 throughout: K/V cached in f32 and no flash attention (its defaults, an
# f16 cache and flash attention on the CPU, round the attention's inputs to 16 bits)
LLAMA_F32 = ("-ctk", "f32", "-ctv", "f32", "-fa", "off")
# relative bounds (docs/notes/imatrix.md): in f32, llama-imatrix's float32 sums token by token ((n-1) u <= 3.1e-5 for
# the 512 rows of a dense tensor) plus the two engines' f32 operation orders (measured <= 1.5e-5); with its
# defaults, the 16-bit rounding of K and V moves the sums by up to 4.0e-3 on the demo (the largest of 4 chunkings)
BOUND_F32, BOUND_DEFAULT = 1e-4, 1e-2


@pytest.mark.llama_cpp
def test_trunk_statistics_equal_llama_imatrix(llama_cpp_bin, tmp_path):
    """On the demo model and real text, our trunk statistics equal llama-imatrix's, read from its GGUF file with
    gguf-py: within 1e-4 relative when llama-imatrix computes in f32, within 1e-2 with its defaults (where the tight
    bound fails: the 16-bit K/V rounding is what the f32 flags remove); llama-imatrix has no entries for the head,
    ours do."""
    import inspect
    import json as json_module
    from importlib import resources

    import gguf

    from mtpq.runtime.importance import chunk_tokens, collect
    from mtpq.runtime.speculative import load_model
    from tests.helpers.llamacpp_ref import llama_imatrix

    src = Path(str(resources.files("mtpq").joinpath("data/demo")))
    path = tmp_path / "demo-f32.gguf"
    assert run_cli("convert", src, path, "--outtype", "f32", "-q").exit_code == 0
    text = inspect.getsource(json_module.decoder) + inspect.getsource(json_module.encoder)
    calib = tmp_path / "calib.txt"
    calib.write_text(text)
    n_ctx, n_chunks = 128, 4

    def theirs_imatrix(*extra: str) -> dict[str, np.ndarray]:
        out = llama_imatrix(llama_cpp_bin, path, calib, tmp_path / "theirs.gguf", n_ctx, n_chunks, *extra)
        return {t.name: np.array(t.data) for t in gguf.GGUFReader(out).tensors}

    model, tok = load_model(path, device="cpu")
    bos = tok.bos_token_id if getattr(tok, "add_bos_token", False) else None
    ours = collect(model, chunk_tokens(tok.encode(text), n_ctx, n_chunks, bos))
    n_head = len(model.blocks)
    worst = {}
    for label, extra in (("f32", LLAMA_F32), ("default", ())):
        theirs = theirs_imatrix(*extra)
        names = {k[: -len(".in_sum2")] for k in theirs if k.endswith(".in_sum2")}
        assert names == {k for k in ours.tensors if not k.startswith(f"blk.{n_head}.")} and names
        rel = []
        for name in sorted(names):
            st = ours.tensors[name]
            np.testing.assert_array_equal(theirs[name + ".counts"].reshape(-1), st.counts, err_msg=name)
            rel.append(np.max(np.abs(theirs[name + ".in_sum2"].reshape(st.sums.shape) - st.sums) / st.sums))
        worst[label] = max(rel)
    print(
        f"largest relative in_sum2 difference: {worst['f32']:.2e} (llama-imatrix in f32), "
        f"{worst['default']:.2e} (its defaults)"
    )
    assert worst["f32"] < BOUND_F32 < worst["default"] < BOUND_DEFAULT


def hf_head_inputs(glm_ckpt: Path, chunks: list[list[int]]) -> dict[str, np.ndarray]:
    """The head's statistics from an independent forward: transformers' trunk gives the post-norm
    hidden states (its ``last_hidden_state``), the head's nextn tensors come from the checkpoint, and its
    decoder block is transformers' own Glm4MoeDecoderLayer (loaded by from_pretrained with one more
    layer, so transformers' weight conversion fills it). Pairs (h_t, x_{t+1}) at transformers' drafting
    positions (shifted by one: RoPE is relative, so the sums must not change). Keyed by GGUF name."""
    from transformers import Glm4MoeForCausalLM

    hf = Glm4MoeForCausalLM.from_pretrained(str(glm_ckpt), dtype=torch.float32).eval()
    n = hf.config.num_hidden_layers
    layer = (
        Glm4MoeForCausalLM.from_pretrained(str(glm_ckpt), dtype=torch.float32, num_hidden_layers=n + 1)
        .eval()
        .model.layers[n]
    )
    t = {}
    for shard in sorted(glm_ckpt.glob("*.safetensors")):
        t.update({k: v.float() for k, v in load_file(shard).items() if k.startswith(f"model.layers.{n}.")})
    p, eps = f"model.layers.{n}.", hf.config.rms_norm_eps

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    sums: dict = {}

    def add(name, x):
        x = x.reshape(-1, x.shape[-1]).double()
        sums[name] = sums.get(name, 0) + x.pow(2).sum(0).numpy()

    def hook(name):
        return lambda _m, args: add(name, args[0])

    def experts_hook(mod, args):  # per expert: the routed rows, and what its down projection gets
        x, ids = args[0], args[1]
        for e in range(mod.num_experts):
            rows = x[(ids == e).any(dim=-1)]
            gate, up = torch.nn.functional.linear(rows, mod.gate_up_proj[e]).chunk(2, dim=-1)
            for key, v in (("ffn_gate_exps", rows), ("ffn_down_exps", mod.act_fn(gate) * up)):
                s = sums.setdefault(key, [np.zeros((mod.num_experts, v.shape[-1])), np.zeros(mod.num_experts)])
                s[0][e] += v.double().pow(2).sum(0).numpy()
                s[1][e] += rows.shape[0]

    gguf = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate": "ffn_gate_inp",
        "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
        "mlp.shared_experts.down_proj": "ffn_down_shexp",
    }
    for name, mod in layer.named_modules():
        if name in gguf:
            mod.register_forward_pre_hook(hook(gguf[name]))
        elif name == "mlp.experts":
            mod.register_forward_pre_hook(experts_hook)
    eh = torch.nn.Linear(2 * hf.config.hidden_size, hf.config.hidden_size, bias=False)
    eh.weight.data = t[p + "eh_proj.weight"]
    head = torch.nn.Linear(hf.config.hidden_size, hf.config.vocab_size, bias=False)
    head.weight.data = t[p + "shared_head.head.weight"]
    eh.register_forward_pre_hook(hook("nextn.eh_proj"))
    head.register_forward_pre_hook(hook("nextn.shared_head_head"))
    with torch.no_grad():
        for c in chunks:
            ids = torch.tensor([c])
            h = hf.model(ids).last_hidden_state[:, :-1]
            e = t[p + "embed_tokens.weight"][ids[:, 1:]]
            u = eh(torch.cat([rms(e, t[p + "enorm.weight"]), rms(h, t[p + "hnorm.weight"])], dim=-1))
            m = u.shape[1]
            pos = torch.arange(1, m + 1)[None]
            mask = torch.full((m, m), float("-inf")).triu(1)[None, None]
            g = layer(u, attention_mask=mask, position_ids=pos, position_embeddings=hf.model.rotary_emb(u, pos))
            head(rms(g, t[p + "shared_head.norm.weight"]))
    return {f"blk.{n}.{k}.weight": v for k, v in sums.items()}


def test_head_statistics_equal_an_independent_forward(setup, glm_ckpt):
    """Every matrix of the head: our sums and counts are what a forward built from transformers' pieces
    feeds it (eh_proj's whole input [enorm(E[x_{t+1}]); hnorm(h_t)], attention, router, shared and
    routed experts, the head's output matrix)."""
    model, chunks, stats = setup
    ref = hf_head_inputs(glm_ckpt, chunks)
    n = len(model.blocks)
    pairs = len(chunks) * (N_CTX - 1)
    assert len(ref) == 11
    for name, want in ref.items():
        st = stats.tensors[name]
        if isinstance(want, list):  # routed experts: per expert
            np.testing.assert_allclose(st.sums, want[0], rtol=1e-4, err_msg=name)
            assert st.counts.tolist() == want[1].astype(int).tolist(), name
            assert st.counts.sum() == pairs * model.cfg.moe.n_used
        else:
            np.testing.assert_allclose(st.sums[0], want, rtol=1e-4, err_msg=name)
            assert st.counts.tolist() == [pairs], name
    # the other projections read the same inputs as the ones compared above
    for same, as_ in (("attn_k", "attn_q"), ("ffn_up_shexp", "ffn_gate_shexp"), ("ffn_up_exps", "ffn_gate_exps")):
        np.testing.assert_array_equal(
            stats.tensors[f"blk.{n}.{same}.weight"].sums, stats.tensors[f"blk.{n}.{as_}.weight"].sums
        )
