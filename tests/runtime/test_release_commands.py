"""The commands that need the runtime run on each architecture's release-shaped fixture (tests/releases): ``accept
--engine torch``, ``compare`` (its head column) and ``imatrix --mtp`` in the default suite; ``sweep`` and ``quantize
--mtp-type auto`` (every candidate head type quantized) among the slow tests.

One tiny prompt and a few tokens each: that the command works end to end on the architecture (its heads, caches,
tokenizer, quantized types); what the numbers mean is checked elsewhere (the runtime contract, the parity test).
"""

from __future__ import annotations

import json

import pytest

from tests import releases
from tests.helpers.ggufcheck import read_gguf
from tests.helpers.runcli import run_cli
from tests.helpers.runtime import convert

# GGUF architecture -> (release manifest, form)
RELEASES = {"step35": ("step35_flash", "bf16"), "mimo2": ("mimo_v25", "fp8")}
TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0\n" * 6


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """get(arch) -> (f16 GGUF, its Q4_K_M, a one-prompt JSONL, a text file), built once per module run."""
    cache: dict = {}

    def get(arch: str):
        if arch not in cache:
            name, form = RELEASES[arch]
            work = tmp_path_factory.mktemp(f"cmd-{arch}")
            f16 = convert(releases.build(releases.manifests()[name], work / "ckpt", form), work / "f16.gguf", "f16")
            q4 = work / "q4km.gguf"
            assert run_cli("quantize", f16, q4, "Q4_K_M", "--quiet").exit_code == 0
            prompts, text = work / "p.jsonl", work / "text.txt"
            prompts.write_text(json.dumps({"category": "code", "prompt": "def add(a, b):"}) + "\n")
            text.write_text(TEXT)
            cache[arch] = f16, q4, prompts, text
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", sorted(RELEASES))
def test_accept_compare_and_imatrix(arch, release, tmp_path):
    f16, q4, prompts, text = release(arch)
    report = tmp_path / "accept.json"
    res = run_cli("accept", q4, "--engine", "torch", "--prompts", prompts, "-k", 3, "-n", 12, "--json", report)
    assert res.exit_code == 0, res.output
    doc = json.loads(report.read_text())
    assert doc["drafts"] > 0 and doc["greedy_outputs_identical"] is True and doc["hidden"] == "pre_norm"
    out = tmp_path / "compare.json"
    res = run_cli("compare", f16, q4, "-f", text, "-c", 64, "--chunks", 2, "--json", out, "--threads", 1)
    assert res.exit_code == 0, res.output
    (quant,) = json.loads(out.read_text())["files"]
    assert 0 <= quant["accept_rate"] <= 1 and quant["kld_mean"] > 0
    imatrix = tmp_path / "head.imatrix.gguf"
    res = run_cli("imatrix", f16, "-f", text, "-o", imatrix, "--mtp", "-c", 32, "--chunks", 2)
    assert res.exit_code == 0, res.output
    # statistics for every head's block (chained heads each take the real pairs), none for the trunk's
    heads = {n.split(".")[1] for n in read_gguf(f16)[1] if ".nextn." in n}
    blocks = {n.split(".")[1] for n in read_gguf(imatrix)[1] if n.startswith("blk.")}
    assert len(heads) == 3 and blocks == heads, (heads, blocks)


@pytest.mark.slow  # ~15 s an architecture: every candidate head type quantized
@pytest.mark.parametrize("arch", sorted(RELEASES))
def test_sweep_and_auto_head(arch, release, tmp_path):
    f16, _, prompts, _ = release(arch)
    grid = tmp_path / "grid.json"
    res = run_cli("sweep", f16, "--mtp", "q8_0,q4_k", "--trunk", "Q4_K_M", "--prompts", prompts, "-n", 8,
                  "--json", grid, "--threads", 1)
    assert res.exit_code == 0, res.output
    assert json.loads(grid.read_text())["mtp_types"] == ["q8_0", "q4_k"]
    auto = tmp_path / "auto.gguf"
    res = run_cli("quantize", f16, auto, "Q4_K_M", "--mtp-type", "auto", "--prompts", prompts, "--quiet")
    assert res.exit_code == 0, res.output
    assert "mtpq.mtp_type_auto" in read_gguf(auto)[0]
