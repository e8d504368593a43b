"""The commands that need the runtime, on each architecture's release-shaped loop model (tests/helpers/runtime.py:
LOOP_VARIANT; one prompt, a few tokens): ``accept --engine torch``, ``compare``'s head column, ``sweep``, ``quantize
--mtp-type auto`` and ``imatrix --mtp``, each held to a figure computed another way (the teacher-forced estimator, the
packed passes against one sequence at a time, accept on the file the sweep stands for, ...).

ARCHS lists the architectures this file covers; the four older families have their own tests of each command.
For qwen3next and nemotron_h_moe the loop models are "bigram" models made from their release checkpoints; for
deepseek4 too, its trunk and head files written as one (tests/helpers/runtime.py paired_file), whose FP8 weights the
converter keeps as Q8_0 (REQUANTIZE: ``--allow-requantize``).
"""

from __future__ import annotations

import inspect
import json
import json.decoder

import pytest

from tests.helpers.runcli import run_cli

ARCHS = ("glm-dsa", "deepseek32", "qwen3next", "nemotron_h_moe", "deepseek4")
REQUANTIZE = {"deepseek4": ("--allow-requantize",)}
PROMPT = "def add(a, b):\n    return a + b\n"
N_NEW = 16
CTX, CHUNKS = 64, 2

EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
SHARED_EXPERT = ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
GQA = ("attn_q", "attn_k", "attn_v", "attn_output")
DSA_HEAD = ("nextn.eh_proj", "attn_q_a", "attn_q_b", "attn_kv_a_mqa", "attn_output", "ffn_gate_inp")
# per architecture: the head's matrices llama.cpp's MTP graph multiplies (what imatrix --mtp records), one of them
# fed every pair, the routed experts' first matrix, and a head matrix beside its trunk twin's block
HEAD_MATRICES = {
    "glm-dsa": DSA_HEAD + EXPERTS + SHARED_EXPERT,
    "deepseek32": DSA_HEAD + EXPERTS + SHARED_EXPERT,
    "qwen3next": ("nextn.eh_proj", *GQA, "ffn_gate_inp", "ffn_gate_inp_shexp", *EXPERTS, *SHARED_EXPERT),
    "nemotron_h_moe": ("nextn.eh_proj", *GQA, "ffn_gate_inp", "ffn_latent_down", "ffn_latent_up")
    + ("ffn_up_exps", "ffn_down_exps", "ffn_up_shexp", "ffn_down_shexp"),
    # (the hyper-connections' fn multiply the normed streams; the window-only MTP block has no compressor)
    "deepseek4": ("nextn.eh_proj", "hc_attn_fn", "attn_q_a", "attn_q_b", "attn_kv", "attn_output_a", "attn_output_b")
    + ("hc_ffn_fn", "ffn_gate_inp", *EXPERTS, *SHARED_EXPERT),
}
EVERY_PAIR = {
    "glm-dsa": "attn_q_a",
    "deepseek32": "attn_q_a",
    "qwen3next": "attn_q",
    "nemotron_h_moe": "attn_q",
    "deepseek4": "attn_q_a",
}
FIRST_EXPERT = {
    "glm-dsa": "ffn_gate_exps",
    "deepseek32": "ffn_gate_exps",
    "qwen3next": "ffn_gate_exps",
    "nemotron_h_moe": "ffn_up_exps",
    "deepseek4": "ffn_gate_exps",
}
TRUNK_TWIN = {
    "glm-dsa": ("attn_q_b", 0),
    "deepseek32": ("attn_q_b", 0),
    "qwen3next": ("attn_q", 3),
    "nemotron_h_moe": ("attn_q", 2),
    "deepseek4": ("attn_q_b", 0),
}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("commands")
    (d / "p.jsonl").write_text(json.dumps({"category": "code", "prompt": PROMPT}) + "\n")
    (d / "text.txt").write_text(inspect.getsource(json.decoder))
    return d


def _accept(path, work, *extra) -> dict:
    res = run_cli("accept", path, "--prompts", work / "p.jsonl", "-n", N_NEW, "--json", "-", "--threads", 1, *extra)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


@pytest.mark.parametrize("arch", ARCHS)
def test_accept_counts_are_the_teacher_forced_estimators(arch, rt, work):
    from mtpq.runtime.speculative import run_plain, teacher_forced_acceptance

    rep = _accept(rt.loop_gguf(arch), work, "-k", 1)
    model, tok = rt.loop_model(arch)
    ids = tok.encode(PROMPT)
    cont = run_plain(model, ids, N_NEW, stop_ids={tok.eos_token_id}).tokens
    tf = teacher_forced_acceptance(model, ids + cont, prompt_len=len(ids))
    assert (rep["drafts"], rep["accepted"]) == (tf.loop_drafts, tf.loop_accepted)
    assert rep["engine"] == "torch" and rep["greedy_outputs_identical"] is True and 0 < rep["accepted"] < rep["drafts"]


@pytest.mark.parametrize("arch", ARCHS)
def test_compare_head_column_is_the_estimator_on_each_chunk(arch, rt, work):
    """The reference's head column (its chunks packed into one pass) == the estimator run on each chunk alone."""
    from mtpq.runtime.speculative import teacher_forced_acceptance
    from mtpq.runtime.trunk_quality import QualityRun, perplexity_chunks

    path = rt.loop_gguf(arch)
    q8 = work / f"{arch}-q8.gguf"
    assert run_cli("quantize", path, q8, "Q8_0", "-q", *REQUANTIZE.get(arch, ())).exit_code == 0
    res = run_cli(
        "compare", path, q8, "-f", work / "text.txt", "-c", CTX, "--chunks", CHUNKS, "--json", "-", "--threads", 1
    )
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    run = QualityRun(path)  # compare's numerics: llama.cpp's
    bos = run.tokenizer.bos_token_id if run.add_bos else None
    matches = []
    for ids in perplexity_chunks(run.tokenizer.encode((work / "text.txt").read_text()), CTX, CHUNKS, bos):
        matches += teacher_forced_acceptance(run.model, ids, CTX // 2).matches
    assert rep["reference"]["accept_rate"] == pytest.approx(sum(matches) / len(matches), abs=1e-12)
    assert rep["files"][0]["accept_rate"] is not None and rep["files"][0]["kld_mean"] > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_sweep_cell_is_accept_on_the_file_it_stands_for(arch, rt, work, tmp_path):
    path = rt.loop_gguf(arch)
    res = run_cli(
        "sweep",
        path,
        "--mtp",
        "q4_k",
        "--trunk",
        "Q8_0",
        "--prompts",
        work / "p.jsonl",
        "-n",
        N_NEW,
        "--json",
        tmp_path / "grid.json",
        "--threads",
        1,
        *REQUANTIZE.get(arch, ()),
    )
    assert res.exit_code == 0, res.output
    grid = json.loads((tmp_path / "grid.json").read_text())
    full = tmp_path / "q8-q4k.gguf"
    assert run_cli("quantize", path, full, "Q8_0", "--mtp-type", "q4_k", "-q", *REQUANTIZE.get(arch, ())).exit_code == 0
    assert grid["acceptance"][0][0] == pytest.approx(_accept(full, work, "-k", 1)["acceptance_rate"], abs=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
def test_quantize_mtp_type_auto_writes_the_chosen_head(arch, rt, work, tmp_path):
    from mtpq.gguf_io import GGUFFile

    out = tmp_path / "auto.gguf"
    auto = ("--mtp-type", "auto", "--max-drop", 1.0, "--prompts", work / "p.jsonl", *REQUANTIZE.get(arch, ()))
    res = run_cli("quantize", rt.loop_gguf(arch), out, "Q4_K_M", *auto)
    assert res.exit_code == 0, res.output
    g = GGUFFile(out)
    choice = json.loads(g.kv["mtpq.mtp_type_auto"])
    assert choice["mtp_type"] == "q2_k" and set(choice["rates"]) >= {"f16", "q8_0", "q2_k"}  # max-drop 1: narrowest
    head, (twin, block) = f"blk.{g.n_trunk}.", TRUNK_TWIN[arch]
    assert g.tensors[head + "nextn.eh_proj.weight"].tensor_type.name == "Q2_K"
    types = (g.tensors[f"{prefix}{twin}.weight"].tensor_type.name for prefix in (head, f"blk.{block}."))
    assert len(set(types)) == 2  # the head's type, not the trunk's


@pytest.mark.parametrize("arch", ARCHS)
def test_imatrix_mtp_covers_the_head_as_llama_cpp_runs_it(arch, rt, work, tmp_path):
    """--mtp: entries for the head's matrices only, each fed every pair of every chunk (the routed experts per
    routed pair); a DSA head's own indexer has none (llama.cpp's MTP graph runs dense MLA)."""
    import gguf
    import numpy as np

    path = rt.loop_gguf(arch)
    out = tmp_path / "im.gguf"
    res = run_cli("imatrix", path, "-f", work / "text.txt", "-o", out, "-c", CTX, "--chunks", CHUNKS, "--mtp")
    assert res.exit_code == 0, res.output
    stats = {t.name: np.array(t.data) for t in gguf.GGUFReader(out).tensors}
    n = len(rt.loop_model(arch)[0].blocks)
    names = {k[: -len(".in_sum2")] for k in stats if k.endswith(".in_sum2")}
    head = f"blk.{n}."
    assert names == {head + w + ".weight" for w in HEAD_MATRICES[arch]}
    pairs = CHUNKS * (CTX - 1)  # the pairs (h_t, x_{t+1}) of each chunk
    assert int(stats[head + EVERY_PAIR[arch] + ".weight.counts"].sum()) == pairs
    assert int(stats[head + FIRST_EXPERT[arch] + ".weight.counts"].sum()) == pairs * 2  # two experts per token
