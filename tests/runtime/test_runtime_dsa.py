"""DeepSeek sparse attention's pieces (mtpq/runtime/dsa.py) against independent truth: the top-k's tie-break
against libstdc++'s own std::partial_sort (what ggml's CPU top-k calls), the Walsh-Hadamard matrix against its
definition, and the indexer metadata llama.cpp refuses, refused with one line. Parity of whole models with
llama.cpp is tests/runtime/test_llama_cpp_parity.py; the cache and loop contract is test_runtime_contract.py."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
import torch

from tests.helpers.runcli import run_cli

PARTIAL_SORT = r"""
#include <algorithm>
#include <cstdio>
#include <vector>
int main() {
    int n, k;
    while (scanf("%d %d", &n, &k) == 2) {
        std::vector<float> v(n);
        std::vector<int> idx(n);
        for (int i = 0; i < n; ++i) { scanf("%f", &v[i]); idx[i] = i; }
        std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int a, int b) { return v[a] > v[b]; });
        std::sort(idx.begin(), idx.begin() + k);
        for (int i = 0; i < k; ++i) printf("%d ", idx[i]);
        printf("\n");
    }
}
"""


def tied_rows(n_rows: int, seed: int) -> list[tuple[list[float], int]]:
    """Rows like the indexer's: many exact zeros (every head's dot product negative) among other scores, k cut
    through the zeros."""
    gen = np.random.default_rng(seed)
    rows = []
    for _ in range(n_rows):
        n = int(gen.integers(5, 90))
        v = np.round(gen.normal(size=n), 2) * (gen.random(n) < 0.6)  # ~40 % zeros, some other values repeated
        rows.append((v.tolist(), int(gen.integers(1, n))))
    return rows


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler (libstdc++'s std::partial_sort)")
def test_ties_are_broken_as_std_partial_sort_breaks_them(tmp_path):
    from mtpq.runtime.dsa import heap_select

    exe = tmp_path / "partial_sort"
    (tmp_path / "p.cpp").write_text(PARTIAL_SORT)
    subprocess.run(["g++", "-O1", "-o", str(exe), str(tmp_path / "p.cpp")], check=True)
    rows = tied_rows(300, seed=0)
    stdin = "".join(f"{len(v)} {k} " + " ".join(repr(x) for x in v) + "\n" for v, k in rows)
    out = subprocess.run([str(exe)], input=stdin, capture_output=True, text=True, check=True).stdout.splitlines()
    plain_differs = 0
    for (v, k), line in zip(rows, out, strict=True):
        assert sorted(heap_select(v, k)) == [int(t) for t in line.split()], (v, k)
        plain_differs += sorted(torch.tensor(v).topk(k).indices.tolist()) != [int(t) for t in line.split()]
    assert plain_differs > 30  # the rows do tie, and the heap's choice is not torch.topk's


def test_top_k_allowed_is_causal_and_takes_every_key_while_few():
    from mtpq.runtime.dsa import top_k_allowed

    T = S = 12
    scores = torch.randn(2, T, S, generator=torch.Generator().manual_seed(0))
    scores = scores.masked_fill(torch.ones(T, S, dtype=torch.bool).triu(1), float("-inf"))
    allowed = top_k_allowed(scores, 5)[:, 0]
    assert allowed.shape == (2, T, S) and not (allowed & torch.ones(T, S, dtype=torch.bool).triu(1)).any()
    assert allowed.sum(-1).tolist() == [[min(t + 1, 5) for t in range(T)]] * 2
    best = scores[:, -1].topk(5).indices.sort().values
    assert (allowed[:, -1].nonzero()[:, 1].view(2, 5) == best).all()


@pytest.mark.parametrize("n", [64, 128])
def test_hadamard_is_ggmls_orthonormal_walsh_matrix(n):
    from mtpq.runtime.dsa import hadamard

    h = hadamard(n).double()
    assert torch.allclose(h @ h, torch.eye(n, dtype=torch.float64), atol=1e-6) and torch.equal(h, h.T)
    signs = torch.tensor([[(-1) ** bin(i & j).count("1") for j in range(n)] for i in range(n)], dtype=torch.float64)
    assert torch.equal(h, signs * h[0, 0]) and h[0, 0].item() == pytest.approx(n**-0.5)


def _with_metadata(src, out, **kv):
    from gguf import GGUFValueType
    from gguf.gguf_writer import GGUFValue

    from mtpq.gguf_io import plan_from_gguf, write_plan

    plan = plan_from_gguf(src)
    for key, value in kv.items():
        if value is None:
            del plan.kv[key]
        else:
            plan.kv[key] = GGUFValue(list(value), GGUFValueType.ARRAY, GGUFValueType.BOOL)
    write_plan(plan, out)
    return out


@pytest.mark.parametrize(
    "types, needle",
    [([True, False, True, True], "has 4 entries for 3 trunk blocks"), ([False, True, True], "block 0 is shared")],
)
def test_indexer_types_llama_cpp_refuses_are_refused(types, needle, rt, tmp_path):
    bad = _with_metadata(
        rt.gguf("glm-dsa", "glm52"), tmp_path / "bad.gguf", **{"glm-dsa.attention.indexer.types": types}
    )
    res = run_cli("accept", bad, "-n", 2, "--max-prompts", 1)
    assert res.exit_code == 2 and needle in res.output and str(bad) in " ".join(res.output.split())


def test_without_indexer_types_every_block_of_glm5_is_full(rt, tmp_path):
    """Without indexer types, llama.cpp takes a file trained for fewer than 1M tokens as GLM-5 / 5.1 (every block
    full), a longer one as GLM-5.2 (its released pattern: blocks 0, 1, 2, 6, 10, ... of 78 full)."""
    from mtpq.runtime.dsa import SparseMLA
    from mtpq.runtime.families import load
    from mtpq.runtime.families.glm_dsa import glm52_indexer_types

    assert glm52_indexer_types(80)[:11] == (True, True, True, False, False, False, True, False, False, False, True)
    assert glm52_indexer_types(80)[74:] == (True, False, False, False, False, False)  # 78 entries, shared after
    path = _with_metadata(
        rt.gguf("glm-dsa", "glm5"), tmp_path / "untyped.gguf", **{"glm-dsa.attention.indexer.types": None}
    )
    assert [m.indexer is not None for m in load(path).modules() if isinstance(m, SparseMLA)] == [True, True]
    typed = load(rt.gguf("glm-dsa", "glm52"))
    assert [m.indexer is not None for m in typed.modules() if isinstance(m, SparseMLA)] == [True, False, True]


def _positive_index_weights(folder):
    """The indexer's per-head weights made positive in place (tiny_deepseek32's option, for any checkpoint)."""
    from safetensors.torch import load_file, save_file

    for shard in sorted(folder.glob("*.safetensors")):
        t = load_file(str(shard))
        t.update({k: v.abs() for k, v in t.items() if k.endswith("indexer.weights_proj.weight")})
        save_file(t, str(shard), metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("family", ["glm-dsa", "deepseek32"])
def test_trunk_logits_match_transformers_where_no_keys_tie(family, tmp_path):
    """transformers runs both (DeepseekV32ForCausalLM; GlmMoeDsaForCausalLM with GLM-5.2's full/full/shared/full
    blocks): with 16 indexer heads and positive head weights no key scores exactly 0, so its torch.topk and
    llama.cpp's heap pick the same keys, and the logits agree (40 tokens, top-k 8: most queries drop keys;
    the same checkpoint with a top-k above the context gives other logits). GLM's indexer LayerNorm epsilon
    (transformers 1e-6, llama.cpp 0) moves nothing visible here."""
    import transformers as tf

    from mtpq.runtime.dsa import SparseMLA
    from mtpq.runtime.families import load
    from tests.builders import tiny_deepseek32, tiny_glm_dsa
    from tests.helpers.runtime import REL_TOL, close, convert

    over = dict(index_n_heads=16, index_topk=8)
    if family == "deepseek32":
        folder = tiny_deepseek32.deepseek_v32(tmp_path / "ck", dtype=torch.float32, positive_index_weights=True, **over)
        cls = tf.DeepseekV32ForCausalLM
    else:
        folder = _positive_index_weights(tiny_glm_dsa.glm_dsa(tmp_path / "ck", dtype=torch.float32, **over))
        cls = tf.GlmMoeDsaForCausalLM
    model = load(convert(folder, tmp_path / "f32.gguf"))
    ids = torch.randint(0, model.cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = cls.from_pretrained(str(folder), dtype=torch.float32).eval()(ids).logits
    ours = model.trunk(ids, use_cache=False).logits
    diff, scale = close(ours, ref)
    assert diff <= REL_TOL * scale, (diff, scale)
    for m in model.modules():  # every key read: the indexer's choice showed
        if isinstance(m, SparseMLA):
            m.top_k = 10**6
    assert close(model.trunk(ids, use_cache=False).logits, ref)[0] > 100 * REL_TOL * scale


@pytest.mark.llama_cpp
@pytest.mark.parametrize("family", ["glm-dsa", "deepseek32"])
def test_llama_server_drafts_and_accepts_what_we_do(family, rt, llama_cpp_bin):
    """llama-server drafting with the file's MTP head (k=1, f32 caches) on the release-shaped loop models, whose
    contexts pass the top-k (16): the same greedy tokens, and exactly the drafts and acceptances of our loop --
    the indexer's keys rolled back after each rejection on both sides."""
    from mtpq.runtime.speculative import run_plain
    from tests.helpers.llama_server import llama_server_completions, run_like_llama_cpp
    from tests.helpers.runtime import PROMPTS

    model, tok = rt.loop_model(family)
    prompts, eos = [tok.encode(s) for s in PROMPTS], {tok.eos_token_id}
    accepted = 0
    for ids, ref in zip(
        prompts, llama_server_completions(llama_cpp_bin, rt.loop_gguf(family), prompts, 32), strict=True
    ):
        assert ref["tokens"] == run_plain(model, ids, 32, stop_ids=eos).tokens, ids
        counts = run_like_llama_cpp(model, ids, 32, eos)
        assert (ref["timings"]["draft_n"], ref["timings"]["draft_n_accepted"]) == counts, ids
        accepted += counts[1]
    assert accepted > 0
