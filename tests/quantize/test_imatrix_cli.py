"""``mtpq imatrix``: importance data from the runtime, for the trunk and the MTP head, in llama-imatrix's format."""

from __future__ import annotations

import inspect
import json
import subprocess
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.llamacpp_ref import llama_imatrix
from tests.helpers.runcli import run_cli


@pytest.fixture(scope="module")
def work(tmp_path_factory, glm_ckpt) -> Path:
    w = tmp_path_factory.mktemp("imatrix_cli")
    assert run_cli("convert", glm_ckpt, w / "glm.gguf", "--outtype", "f32", "-q").exit_code == 0
    gen = torch.Generator().manual_seed(3)
    words = ["def", "return", "self", "x", "(", ")", ":", "\n", "    ", "import", "json", "1", "2"]
    (w / "calib.txt").write_text(" ".join(words[int(i)] for i in torch.randint(0, len(words), (3000,), generator=gen)))
    return w


def test_file_holds_the_runtime_statistics(work):
    from mtpq.quantize.imatrix import read_imatrix
    from mtpq.runtime.importance import chunk_tokens, collect
    from mtpq.runtime.speculative import load_model

    res = run_cli(
        "imatrix", work / "glm.gguf", "-f", work / "calib.txt", "-o", work / "im.gguf", "-c", "64", "--chunks", "3"
    )
    assert res.exit_code == 0, res.output
    im = read_imatrix(work / "im.gguf")
    model, tok = load_model(work / "glm.gguf", device="cpu")
    stats = collect(model, chunk_tokens(tok.encode((work / "calib.txt").read_text()), 64, 3, None))
    n = len(model.blocks)
    assert set(im.entries) == set(stats.tensors) | {f"blk.{n}.nextn.embed_tokens.weight"}
    assert im.chunk_count == 3 and im.chunk_size == 64
    for name, st in stats.tensors.items():
        np.testing.assert_allclose(im.entries[name].sums.reshape(st.sums.shape), st.sums, rtol=1e-6)
        assert im.entries[name].counts.reshape(-1).tolist() == st.counts.tolist()
    # the head's embedding table is looked up, not multiplied: uniform importance (every weight 1)
    w = im.importance(f"blk.{n}.nextn.embed_tokens.weight", model.mtp.embed.shape[-1])
    assert np.all(w == 1.0)


def test_merge_keeps_the_base_and_adds_the_head(work):
    from mtpq.quantize.imatrix import read_imatrix

    assert (
        run_cli(
            "imatrix",
            work / "glm.gguf",
            "-f",
            work / "calib.txt",
            "-o",
            work / "trunk.gguf",
            "-c",
            "64",
            "--chunks",
            "2",
        ).exit_code
        == 0
    )
    base = read_imatrix(work / "trunk.gguf")
    n = 2  # tiny GLM: two trunk blocks, the head at 2
    trunk_only = {k: v for k, v in base.entries.items() if not k.startswith(f"blk.{n}.")}
    base.entries = trunk_only
    from mtpq.quantize.imatrix import write_imatrix

    write_imatrix(base, work / "base.gguf")
    res = run_cli(
        "imatrix",
        work / "glm.gguf",
        "-f",
        work / "calib.txt",
        "-o",
        work / "merged.gguf",
        "-c",
        "64",
        "--mtp",
        "--merge-into",
        work / "base.gguf",
    )
    assert res.exit_code == 0, res.output
    merged = read_imatrix(work / "merged.gguf")
    assert set(merged.entries) - set(trunk_only) and all(
        k.startswith(f"blk.{n}.") for k in set(merged.entries) - set(trunk_only)
    )
    for k, e in trunk_only.items():
        assert np.array_equal(merged.entries[k].sums, e.sums) and np.array_equal(merged.entries[k].counts, e.counts)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["{w}/glm.gguf", "-f", "{w}/nope.txt", "-o", "{w}/x.gguf"], "nope.txt"),
        (["{w}/glm.gguf", "-f", "{w}/calib.txt", "-o", "{w}/glm.gguf"], "glm.gguf"),
        (["{w}/glm.gguf", "-f", "{w}/calib.txt", "-o", "{w}/x.gguf", "-c", "100000"], "--chunk"),
        (["{w}/glm.gguf", "-f", "{w}/calib.txt", "-o", "{w}/x.gguf", "--chunks", "0"], "--chunks"),
        (["{w}/glm.gguf", "-f", "{w}/calib.txt", "-o", "{w}/x.gguf", "--merge-into", "{w}/calib.txt"], "calib.txt"),
    ],
)
def test_bad_input_is_one_line(work, args, needle):
    res = run_cli("imatrix", *[a.format(w=work) for a in args])
    assert res.exit_code == 2, res.output
    assert needle in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (work / "x.gguf").exists()


def _demo_f32_and_calibration(tmp_path: Path) -> tuple[Path, Path]:
    """The packaged demo checkpoint as an f32 GGUF, and a calibration text (Python's json sources)."""
    src = Path(str(resources.files("mtpq").joinpath("data/demo")))
    model = tmp_path / "demo.gguf"
    assert run_cli("convert", src, model, "--outtype", "f32", "-q").exit_code == 0
    calib = tmp_path / "calib.txt"
    calib.write_text(inspect.getsource(json.decoder) + inspect.getsource(json.encoder))
    return model, calib


@pytest.mark.llama_cpp
def test_merged_head_lets_llama_quantize_make_an_iq2_xxs_head(llama_cpp_bin, tmp_path):
    """llama-imatrix has no entries for the head: llama-quantize refuses an IQ2_XXS head. Merged with ours,
    the same quantization goes through."""
    model, calib = _demo_f32_and_calibration(tmp_path)
    theirs = tmp_path / "theirs.gguf"
    run = lambda *a: subprocess.run(
        [str(x) for x in a],
        capture_output=True,
        text=True,
        timeout=600,  # noqa: E731
        stdin=subprocess.DEVNULL,
        errors="replace",
    )
    llama_imatrix(llama_cpp_bin, model, calib, theirs, 128, 4)
    p = run(llama_cpp_bin / "llama-quantize", "--imatrix", theirs, model, tmp_path / "a.gguf", "IQ2_XXS")
    assert p.returncode != 0 and "Missing importance matrix for tensor blk.4." in p.stdout + p.stderr
    res = run_cli(
        "imatrix",
        model,
        "-f",
        calib,
        "-o",
        tmp_path / "merged.gguf",
        "-c",
        "128",
        "--chunks",
        "4",
        "--mtp",
        "--merge-into",
        theirs,
    )
    assert res.exit_code == 0, res.output
    p = run(
        llama_cpp_bin / "llama-quantize", "--imatrix", tmp_path / "merged.gguf", model, tmp_path / "b.gguf", "IQ2_XXS"
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-2000:]
    assert "blk.4.nextn.eh_proj.weight" in p.stdout + p.stderr


@pytest.mark.llama_cpp
def test_iq2_xxs_head_from_our_imatrix_equals_llama_quantize(llama_cpp_bin, tmp_path):
    """Q4_K_M with the head at IQ2_XXS, importance data from `mtpq imatrix`: mtpq quantize writes the same
    bytes as llama-quantize given the same imatrix file and a tensor-type override for the head."""
    import gguf

    model, calib = _demo_f32_and_calibration(tmp_path)
    im = tmp_path / "im.gguf"
    assert run_cli("imatrix", model, "-f", calib, "-o", im, "-c", "128", "--chunks", "4").exit_code == 0
    ours = tmp_path / "ours.gguf"
    res = run_cli("quantize", model, ours, "Q4_K_M", "--mtp-type", "iq2_xxs", "--imatrix", im, "-q")
    assert res.exit_code == 0, res.output
    theirs = tmp_path / "theirs.gguf"
    p = subprocess.run(
        [
            str(llama_cpp_bin / "llama-quantize"),
            "--imatrix",
            str(im),
            "--tensor-type",
            r"blk\.4\.=iq2_xxs",
            str(model),
            str(theirs),
            "Q4_K_M",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
        errors="replace",
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-2000:]
    a = {t.name: (t.tensor_type, np.array(t.data)) for t in gguf.GGUFReader(ours).tensors}
    b = {t.name: (t.tensor_type, np.array(t.data)) for t in gguf.GGUFReader(theirs).tensors}
    assert a.keys() == b.keys()
    assert a["blk.4.nextn.eh_proj.weight"][0] == gguf.GGMLQuantizationType.IQ2_XXS
    for name in a:
        assert a[name][0] == b[name][0] and np.array_equal(a[name][1], b[name][1]), name
