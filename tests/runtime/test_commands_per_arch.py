"""The commands that need the runtime run on each architecture's release-shaped checkpoint (tests/releases):
``accept --engine torch``, ``compare`` (its head column), ``sweep``, ``quantize --mtp-type auto`` and
``imatrix --mtp``, on a tiny f16 file and one prompt. The heads are random, so the figures are not the point (the
parity and contract tests check the numbers): each command must run the family end to end, measure the head it
has, and agree with itself where it can (greedy speculative == plain greedy in ``accept``).

DeepSeek-V4's head lives in a file of its own (HEAD_FILE: ``convert --no-mtp`` and ``--mtp-only``, as llama.cpp's
converter writes them): every command takes it with ``--head``, ``quantize --mtp-type auto`` quantizes the head file
measured on ``--trunk``, and its converted files keep the FP8 weights as Q8_0 (``--allow-requantize``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import releases
from tests.helpers.runcli import run_cli

# GGUF architecture -> (release manifest, form)
ARCHS = {a: releases.BY_ARCH[a] for a in ("hy_v3", "cohere2moe", "bailingmoe3", "step35", "mimo2", "deepseek4")}
HEAD_FILE = releases.HEAD_FILE
PROMPT = {"category": "code", "prompt": "def add(a, b):\n    return a + b\n"}
TEXT = "The quick brown fox jumps over the lazy dog. " * 30


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """get(arch) -> (f16 GGUF, prompts file, text file, its head file or None), converted once per module run."""
    cache: dict = {}

    def get(arch: str) -> tuple[Path, Path, Path, Path | None]:
        if arch not in cache:
            name, form = ARCHS[arch]
            work = tmp_path_factory.mktemp(f"cmd-{arch}")
            ckpt = releases.build(releases.manifests()[name], work / "ckpt", form)
            f16, head = work / "f16.gguf", None
            if arch in HEAD_FILE:
                head = work / "mtp-f16.gguf"
                assert run_cli("convert", ckpt, f16, "--outtype", "f16", "--no-mtp", "-q").exit_code == 0
                assert run_cli("convert", ckpt, head, "--outtype", "f16", "--mtp-only", "-q").exit_code == 0
            else:
                assert run_cli("convert", ckpt, f16, "--outtype", "f16", "-q").exit_code == 0
            (work / "p.jsonl").write_text(json.dumps(PROMPT) + "\n")
            (work / "text.txt").write_text(TEXT)
            cache[arch] = f16, work / "p.jsonl", work / "text.txt", head
        return cache[arch]

    return get


def with_head(head: Path | None) -> list:
    return ["--head", head] if head is not None else []


def requantize(head: Path | None) -> list:
    return ["--allow-requantize"] if head is not None else []


def mtp_blocks(path: Path) -> list[str]:
    """The prefixes of the file's MTP blocks (Step-3.5 and MiMo-V2.5 have 3)."""
    from mtpq.runtime.weights import GGUFFile

    g = GGUFFile(path)
    return [f"blk.{i}." for i in range(g.n_trunk, g.n_trunk + g.n_mtp)]


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_accept(arch, release):
    f16, prompts, _, head = release(arch)
    res = run_cli(
        "accept", f16, *with_head(head), "--prompts", prompts, "-k", 2, "-n", 8, "--json", "-", "--threads", 1
    )
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert report["engine"] == "torch" and report["drafted"] > 0 and report["greedy_outputs_identical"]


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_quantize_auto_then_compare(arch, release, tmp_path):
    f16, prompts, text, head = release(arch)
    q = tmp_path / "q.gguf"
    if head is None:
        res = run_cli("quantize", f16, q, "Q4_K_M", "--mtp-type", "auto", "--prompts", prompts)
    else:  # the head file measured on the trunk it drafts for, then the trunk quantized on its own
        q_head = tmp_path / "mtp-q.gguf"
        res = run_cli(
            "quantize",
            head,
            q_head,
            "Q4_K_M",
            "--mtp-type",
            "auto",
            "--trunk",
            f16,
            "--prompts",
            prompts,
            "--allow-requantize",
        )
        assert run_cli("quantize", f16, q, "Q4_K_M", "--allow-requantize", "-q").exit_code == 0
        head = q_head
    assert res.exit_code == 0, res.output
    assert "--mtp-type auto:" in " ".join(res.output.split())
    res = run_cli(
        "compare", f16, q, *with_head(head), "-f", text, "-c", 64, "--chunks", 2, "--json", "-", "--threads", 1
    )
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    (row,) = report["files"]
    assert row["accept_rate"] is not None and report["reference"]["accept_rate"] is not None  # the head column
    assert 0 < row["kld_mean"] and row["positions"] > 0


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_sweep(arch, release, tmp_path):
    f16, prompts, _, head = release(arch)
    out = tmp_path / "grid.json"
    res = run_cli(
        "sweep",
        f16,
        *with_head(head),
        *requantize(head),
        "--mtp",
        "f16,q4_k",
        "--trunk",
        "Q4_K_M",
        "--prompts",
        prompts,
        "-n",
        8,
        "--json",
        out,
        "--threads",
        1,
    )
    assert res.exit_code == 0, res.output
    grid = json.loads(out.read_text())
    assert grid["mtp_types"] == ["f16", "q4_k"] and len(grid["acceptance"]) == 2 and len(grid["acceptance"][0]) == 1


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_imatrix_of_the_head(arch, release, tmp_path):
    from gguf import GGUFReader

    f16, _, text, head = release(arch)
    out = tmp_path / "head.imatrix"
    res = run_cli(
        "imatrix", f16, *with_head(head), "-f", text, "-o", out, "--mtp", "-c", 64, "--chunks", 1, "--threads", 1
    )
    assert res.exit_code == 0, res.output
    names = {t.name.rsplit(".", 1)[0] for t in GGUFReader(out).tensors}
    heads = mtp_blocks(head or f16)  # every head's block (chained heads each take the real pairs), nothing else
    assert names and all(n.startswith(tuple(heads)) for n in names), names
    for head in heads:  # its FFN: experts (Hy3, Cohere, Ling) or dense (Step-3.5's, MiMo's heads)
        assert head + "nextn.eh_proj.weight" in names and names & {
            head + "ffn_gate_exps.weight",
            head + "ffn_gate.weight",
        }, names
