"""``mtpq graft`` and ``mtpq extract-mtp`` on tiny GLM-4.5 checkpoints.

Truth comes from elsewhere: ``mtpq convert`` with and without the head gives the
files a graft must reproduce, gguf-py's reader and dequantizer read the results,
and llama.cpp's ``llama-speculative-simple`` must load and draft with them.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize, quantize
from typer.testing import CliRunner

from mtpq.cli import app  # noqa: E402
from mtpq.convert import BlockSelection, plan_checkpoint  # noqa: E402
from mtpq.gguf_io import plan_from_gguf, write_plan  # noqa: E402
from mtpq.quantize.surgery import plan_graft  # noqa: E402
from tests.builders import tiny  # noqa: E402
from tests.helpers.llamacpp_ref import speculative_simple  # noqa: E402

runner = CliRunner()


def mtpq(*args) -> "object":
    return runner.invoke(app, [str(a) for a in args])


def convert(src: Path, out: Path, mode: BlockSelection) -> Path:
    write_plan(plan_checkpoint(src, mtp=mode), out)
    return out


def contents(path: Path) -> tuple[dict, dict]:
    """(metadata, tensors) as gguf-py reads them, in file order: key -> value, name -> (type, shape, bytes)."""
    r = GGUFReader(path)
    kv = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    tensors = {
        t.name: (T(t.tensor_type), tuple(int(d) for d in t.shape), np.asarray(t.data).tobytes()) for t in r.tensors
    }
    return kv, tensors


def is_mtp(name: str, n_trunk: int = 2) -> bool:
    m = re.match(r"blk\.(\d+)\.", name)
    return m is not None and int(m.group(1)) >= n_trunk


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """From one tiny GLM-4.5 (2 trunk + 1 MTP layer), all f16: A = with MTP head, B = --no-mtp,
    H = --mtp-only, T = A with its head tensors stripped but its metadata kept (block_count 3,
    nextn_predict_layers 1), as some published quants are and llama.cpp's loader accepts."""
    d = tmp_path_factory.mktemp("surgery")
    src = tiny.glm4moe(d / "glm", seed=0)
    out = {
        "dir": d,
        "src": src,
        "A": convert(src, d / "A.gguf", BlockSelection.KEEP),
        "B": convert(src, d / "B.gguf", BlockSelection.DROP),
        "H": convert(src, d / "H.gguf", BlockSelection.ONLY),
    }
    stripped = plan_from_gguf(out["A"])
    stripped.tensors = [s for s in stripped.tensors if not is_mtp(s.name)]
    write_plan(stripped, d / "T.gguf")
    out["T"] = d / "T.gguf"
    return out


def assert_no_output(folder: Path, out: Path) -> None:
    assert not out.exists()
    assert not [p for p in folder.iterdir() if ".partial-" in p.name], "a temporary file was left behind"


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("donor, target", [("A", "B"), ("H", "B"), ("A", "T"), ("H", "T")])
def test_graft_restores_the_converted_file(files, tmp_path, donor, target):
    """A file without head (B, T) + the head of A (full, or head-only H) == A, byte for byte."""
    out = tmp_path / "grafted.gguf"
    res = mtpq("graft", "--mtp-from", files[donor], "--into", files[target], out)
    assert res.exit_code == 0, res.output
    kv_a, t_a = contents(files["A"])
    kv_g, t_g = contents(out)
    assert list(t_g) == list(t_a)  # same names in the same order
    for name in t_a:
        assert t_g[name] == t_a[name], name
    assert list(kv_g) == list(kv_a)
    assert kv_g == kv_a
    assert kv_g["glm4moe.block_count"] == 3 and kv_g["glm4moe.nextn_predict_layers"] == 1
    assert out.read_bytes() == files["A"].read_bytes()


def test_extract_mtp_equals_convert_mtp_only(files, tmp_path):
    out = tmp_path / "mtp-head.gguf"
    res = mtpq("extract-mtp", files["A"], out)
    assert res.exit_code == 0, res.output
    kv_h, t_h = contents(files["H"])
    kv_e, t_e = contents(out)
    assert list(t_e) == list(t_h) and kv_e == kv_h
    assert all(t_e[n] == t_h[n] for n in t_h)
    assert sorted(n for n in t_e if not is_mtp(n)) == ["output.weight", "output_norm.weight", "token_embd.weight"]
    assert "blk.0.attn_norm.weight" not in t_e  # llama.cpp's head-only test
    assert out.read_bytes() == files["H"].read_bytes()
    again = tmp_path / "again.gguf"  # a head-only file extracts to itself
    assert mtpq("extract-mtp", out, again).exit_code == 0
    assert again.read_bytes() == out.read_bytes()


def test_extract_refuses_a_file_without_head(files, tmp_path):
    out = tmp_path / "x.gguf"
    res = mtpq("extract-mtp", files["B"], out)
    assert res.exit_code == 2
    assert "B.gguf" in res.stderr and "no MTP blocks" in res.stderr
    assert_no_output(tmp_path, out)


def test_mtp_type_q8_0_requantizes_only_the_head(files, tmp_path):
    out = tmp_path / "q8head.gguf"
    res = mtpq("graft", "--mtp-from", files["A"], "--into", files["B"], out, "--mtp-type", "q8_0")
    assert res.exit_code == 0, res.output
    _, t_a = contents(files["A"])
    _, t_b = contents(files["B"])
    kv_o, t_o = contents(out)
    assert kv_o["general.quantization_version"] == 2 and kv_o["glm4moe.nextn_predict_layers"] == 1
    for name, (qtype, shape, raw) in t_o.items():
        if not is_mtp(name):
            assert (qtype, shape, raw) == t_b[name], f"trunk tensor {name} changed"
            continue
        a_type, a_shape, a_raw = t_a[name]
        assert shape == a_shape
        if len(shape) == 1 or "ffn_gate_inp" in name:  # norms, biases and the router stay as stored
            assert (qtype, raw) == (a_type, a_raw), name
            continue
        assert qtype == T.Q8_0, name
        want = np.frombuffer(a_raw, dtype=np.float16).astype(np.float32).reshape(-1, 32)
        got = dequantize(np.frombuffer(raw, dtype=np.uint8), T.Q8_0).reshape(-1, 32)
        # q8_0: per 32 values d = amax/127 stored as f16: |error| <= d/2 + 127 * d * 2**-11 (rounding of d)
        bound = np.abs(want).max(axis=1, keepdims=True) / 127 * (0.5 + 127 * 2**-11) + 1e-7
        assert np.all(np.abs(got - want) <= bound), name
        assert raw == quantize(want.reshape(-1, shape[0]), T.Q8_0).tobytes(), name  # gguf-py's reference bytes


def test_graft_into_a_quantized_trunk_with_replace(files, tmp_path):
    """--replace swaps a head the target has; the new head sits where the old one was."""
    q8 = tmp_path / "q8head.gguf"
    assert mtpq("graft", "--mtp-from", files["H"], "--into", files["B"], q8, "--mtp-type", "q8_0").exit_code == 0
    out = tmp_path / "swapped.gguf"
    refused = mtpq("graft", "--mtp-from", q8, "--into", files["A"], out)
    assert refused.exit_code == 2
    assert "A.gguf" in refused.stderr and "already has an MTP head" in refused.stderr and "--replace" in refused.stderr
    assert_no_output(tmp_path, out)
    res = mtpq("graft", "--mtp-from", q8, "--into", files["A"], out, "--replace")
    assert res.exit_code == 0, res.output
    _, t_a = contents(files["A"])
    _, t_q = contents(q8)
    _, t_o = contents(out)
    assert list(t_o) == list(t_a)
    for name in t_o:
        assert t_o[name] == (t_q[name] if is_mtp(name) else t_a[name]), name


def test_per_layer_metadata_arrays_take_the_donors_head_entries(files):
    """A metadata array with one entry per block grows by the donor's MTP entries."""
    donor, target = plan_from_gguf(files["A"]), plan_from_gguf(files["B"])
    key = "glm4moe.attention.sliding_window_pattern"
    donor.set_kv(key, [True, False, False], GGUFValueType.ARRAY, GGUFValueType.BOOL)
    target.set_kv(key, [False, True], GGUFValueType.ARRAY, GGUFValueType.BOOL)
    target.set_kv("glm4moe.rope.dimension_sections", [8, 8, 8, 8], GGUFValueType.ARRAY, GGUFValueType.INT32)
    donor.set_kv("glm4moe.rope.dimension_sections", [8, 8, 8, 8], GGUFValueType.ARRAY, GGUFValueType.INT32)
    out = plan_graft(donor, target)
    assert out.kv_value(key) == [False, True, False]
    assert out.kv_value("glm4moe.rope.dimension_sections") == [8, 8, 8, 8]
    assert out.kv_value("glm4moe.block_count") == 3 and out.n_trunk_layers == 2 and out.n_mtp_layers == 1


# ----------------------------------------------------------------------------- refusals


@pytest.fixture(scope="module")
def other_models(files) -> dict[str, Path]:
    """Trunk-only conversions of models that differ from the fixture's in one way each."""
    d = files["dir"]
    out = {}
    for label, over in {
        "hidden": dict(hidden_size=512),
        "layers": dict(num_hidden_layers=3),
        "vocab": dict(vocab_size=768),
    }.items():
        src = tiny.glm4moe(d / f"glm-{label}", seed=1, **over)
        out[label] = convert(src, d / f"B-{label}.gguf", BlockSelection.DROP)
    plan = plan_from_gguf(files["B"])  # the same file under another architecture name
    plan.arch = "deepseek2"
    plan.kv = {k.replace("glm4moe.", "deepseek2."): v for k, v in plan.kv.items()}
    write_plan(plan, d / "B-arch.gguf")
    out["arch"] = d / "B-arch.gguf"
    return out


@pytest.mark.parametrize(
    "label, message",
    [
        ("hidden", r"hidden size \(glm4moe.embedding_length\) 256 does not match .*B-hidden.gguf \(512\)"),
        ("layers", r"2 trunk layers, but .*B-layers.gguf has 3"),
        ("vocab", r"vocabulary has 512 tokens, but .*B-vocab.gguf has 768"),
        ("arch", r"architecture glm4moe does not match .*B-arch.gguf \(deepseek2\)"),
    ],
)
def test_mismatched_graft_is_refused(files, other_models, tmp_path, label, message):
    out = tmp_path / "never.gguf"
    res = mtpq("graft", "--mtp-from", files["A"], "--into", other_models[label], out)
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "A.gguf" in lines[0], res.stderr
    assert re.search(message, lines[0]), lines[0]
    assert_no_output(tmp_path, out)


def test_bad_mtp_type_is_refused(files, tmp_path):
    out = tmp_path / "never.gguf"
    res = mtpq("graft", "--mtp-from", files["A"], "--into", files["B"], out, "--mtp-type", "q9_9")
    assert res.exit_code == 2 and "--mtp-type" in res.stderr and "q9_9" in res.stderr
    assert_no_output(tmp_path, out)


# ----------------------------------------------------------------------------- llama.cpp


def repeat_head_donor(a_path: Path, out: Path) -> Path:
    """A's file with a head that drafts "the next token repeats the current one".

    u = W_eh [enorm(e_x); hnorm(h)] with W_eh = [I 0] and unit norms keeps only
    the embedding direction; zero attention-output and FFN-down weights make the
    block an identity; shared_head_head = the head's embedding table, so logit_j =
    e_j . e_x / rms(e_x), largest at j = x for random 256-d embeddings. The tiny
    trunk's greedy text ends in a run of one repeated token, so this head gets
    drafts accepted and a random head does not: acceptance shows llama.cpp uses
    the grafted tensors.
    """
    plan = plan_from_gguf(a_path)
    by = {s.name: i for i, s in enumerate(plan.tensors)}
    h = 256
    emb = plan.tensors[by["blk.2.nextn.embed_tokens.weight"]].load()
    values = {
        "blk.2.nextn.eh_proj.weight": torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1),
        "blk.2.nextn.enorm.weight": torch.ones(h),
        "blk.2.nextn.shared_head_norm.weight": torch.ones(h),
        "blk.2.nextn.shared_head_head.weight": emb,
    }
    for name in ("blk.2.attn_output.weight", "blk.2.ffn_down_exps.weight", "blk.2.ffn_down_shexp.weight"):
        values[name] = torch.zeros(plan.tensors[by[name]].shape)
    for name, v in values.items():
        spec = plan.tensors[by[name]]
        plan.tensors[by[name]] = spec.with_values(lambda v=v: v)
    write_plan(plan, out)
    return out


def speculate(bin_dir: Path, model: Path, *extra: str) -> tuple[str, dict[str, int]]:
    """Greedy text and draft counts of one llama-speculative-simple run."""
    # --no-repack: ggml's AMX repacked Q8_0 kernels die with SIGILL on CPUs that list AMX but do not grant it
    proc, stats = speculative_simple(
        bin_dir,
        "-m",
        model,
        "-p",
        "def",
        "-n",
        "16",
        "--temp",
        "0",
        "--spec-type",
        "draft-mtp",
        "-t",
        "1",
        "--no-repack",
        *extra,
    )
    return proc.stdout, {k: stats[k] for k in ("n_drafted", "n_accept")}


@pytest.mark.llama_cpp
def test_llama_cpp_drafts_with_a_grafted_head(files, tmp_path, llama_cpp_bin):
    bin_dir = llama_cpp_bin
    donor = repeat_head_donor(files["A"], tmp_path / "repeat-head.gguf")
    grafted = tmp_path / "B-repeat-q8.gguf"
    assert mtpq("graft", "--mtp-from", donor, "--into", files["B"], grafted, "--mtp-type", "q8_0").exit_code == 0
    random_head = tmp_path / "B-random.gguf"
    assert mtpq("graft", "--mtp-from", files["H"], "--into", files["B"], random_head).exit_code == 0
    head_only = tmp_path / "mtp-repeat.gguf"
    assert mtpq("extract-mtp", donor, head_only).exit_code == 0

    text_ref, stats_ref = speculate(bin_dir, files["A"])
    text_rep, stats_rep = speculate(bin_dir, grafted)
    text_rnd, stats_rnd = speculate(bin_dir, random_head)
    text_md, stats_md = speculate(bin_dir, files["B"], "-md", str(head_only))  # head-only file as the draft model
    # greedy speculative decoding is lossless; accepted drafts may run a token or two past -n
    texts = sorted((t.strip() for t in (text_ref, text_rep, text_rnd, text_md)), key=len)
    assert len(texts[0]) > len("def") and all(t.startswith(texts[0]) for t in texts), texts
    assert stats_rnd == stats_ref and stats_rnd["n_drafted"] > 0
    assert stats_rep["n_drafted"] > 0 and stats_rep["n_accept"] > stats_rnd["n_accept"]
    assert stats_md["n_drafted"] > 0 and stats_md["n_accept"] > stats_rnd["n_accept"]
