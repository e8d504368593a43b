"""A trunk-only file and a head file measured as one model (``mtpq accept TRUNK --head mtp-HEAD.gguf``), the way
llama.cpp runs ``-m TRUNK -md mtp-HEAD.gguf``: the same figures as the one file they were cut from; another
model's head drafts differently or is refused; a tied head falls back to the head file's embeddings."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest

from tests.helpers.runcli import run_cli

FLAGS = ("-k", "2", "-n", "8", "--max-prompts", "2", "-t", "1")


DEMO = Path(str(resources.files("mtpq").joinpath("data/demo")))  # a trained head: drafts to compare


@pytest.fixture(scope="module")
def cut(tmp_path_factory):
    d = tmp_path_factory.mktemp("pair")
    for name, flags in (("full", ()), ("trunk", ("--no-mtp",)), ("mtp-head", ("--mtp-only",))):
        assert run_cli("convert", DEMO, d / f"{name}.gguf", "--outtype", "f16", "-q", *flags).exit_code == 0
    return d


def accept(*args) -> dict:
    res = run_cli("accept", *args, *FLAGS, "--json", "-")
    assert res.exit_code == 0, res.output
    return {k: v for k, v in json.loads(res.stdout).items() if k in ("drafted", "accepted", "per_position")}


def test_trunk_with_head_file_measures_as_the_combined_file(cut, tmp_path):

    whole = accept(cut / "full.gguf")
    assert whole["drafted"] > 0
    assert accept(cut / "trunk.gguf", "--head", cut / "mtp-head.gguf") == whole
    # the head file's head is the one used, not the one a combined MODEL carries
    assert accept(cut / "full.gguf", "--head", cut / "mtp-head.gguf") == whole
    stranger = tmp_path / "mtp-q2.gguf"  # the same head at 2 bits: other drafts
    assert run_cli("quantize", cut / "mtp-head.gguf", stranger, "Q2_K", "--mtp-type", "q2_k", "-q").exit_code == 0
    assert accept(cut / "trunk.gguf", "--head", stranger) != whole


def test_head_of_another_shape_is_refused(cut, tmp_path):
    from tests.builders import tiny

    other = tiny.glm4moe(tmp_path / "wide", seed=1, hidden_size=512)
    head = tmp_path / "mtp-wide.gguf"
    assert run_cli("convert", other, head, "--mtp-only", "-q").exit_code == 0
    res = run_cli("accept", cut / "trunk.gguf", "--head", head, *FLAGS)
    assert res.exit_code == 2 and res.stderr.strip() == (
        f"error: {head}: hidden size 512 does not match trunk.gguf's 256: not a head for this trunk"
    ), res.output


def test_tied_head_reads_the_head_files_embeddings(tmp_path):
    """GLM-4.6 ties the head's embedding and output to the model's: with -md llama.cpp takes the head file's."""
    from gguf import GGMLQuantizationType as T

    from mtpq.gguf_io import GGUFFile
    from mtpq.gguf_io.pair import PairedGGUF
    from tests.builders import tiny

    ckpt = tiny.glm4moe(tmp_path / "glm46", glm46=True)
    f16, trunk, head = tmp_path / "f16.gguf", tmp_path / "trunk.gguf", tmp_path / "mtp-h.gguf"
    assert run_cli("convert", ckpt, f16, "--outtype", "f16", "-q").exit_code == 0
    assert run_cli("quantize", f16, trunk, "Q4_K_M", "-q").exit_code == 0
    assert run_cli("extract-mtp", f16, head, "-q").exit_code == 0
    pair, h = PairedGGUF(trunk, head), GGUFFile(head)
    n = pair.n_trunk
    assert "blk.2.nextn.embed_tokens.weight" not in h and pair.qtype("token_embd.weight") == T.Q4_K
    for nextn, top in (("embed_tokens", "token_embd"), ("shared_head_head", "output")):  # what GLM-4.6 omits
        assert f"blk.{n}.nextn.{nextn}.weight" not in h
        mine = pair.tensors[f"blk.{n}.nextn.{nextn}.weight"]
        assert mine.tensor_type == h.qtype(f"{top}.weight") and (mine.data == h.tensors[f"{top}.weight"].data).all()
    assert accept(trunk, "--head", head)["drafted"] > 0
