"""``--mtp-type auto``: the narrowest head type within --max-drop of the f16 head, measured on the quantized trunk,
recorded in the file, and the file otherwise the bytes ``quantize --mtp-type <choice>`` writes."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.familycheck import strip_general
from tests.helpers.ggufcheck import read_gguf
from tests.helpers.runcli import run_cli

AUTO_KEY = "mtpq.mtp_type_auto"


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("auto")
    f16 = d / "f16.gguf"
    src = Path(str(resources.files("mtpq").joinpath("data/demo")))
    assert run_cli("convert", src, f16, "--outtype", "f16", "--quiet").exit_code == 0
    prompts = d / "p.jsonl"
    held = resources.files("mtpq").joinpath("data/prompts/demo_heldout.jsonl").read_text().splitlines()[:6]
    prompts.write_text("\n".join(held) + "\n")
    return f16, prompts


@pytest.mark.parametrize("max_drop", [0.0, 0.03, 1.0])
def test_auto_picks_the_narrowest_head_within_the_drop_and_writes_its_bytes(demo, tmp_path, max_drop):
    f16, prompts = demo
    out = tmp_path / "auto.gguf"
    res = run_cli("quantize", f16, out, "Q4_K_M", "--mtp-type", "auto", "--max-drop", max_drop, "--prompts", prompts)
    assert res.exit_code == 0, res.output
    kv, tensors = read_gguf(out)
    choice = json.loads(kv[AUTO_KEY])
    rates = {t: r["rate"] for t, r in choice["rates"].items()}
    order = ["f16", "q8_0", "q6_k", "q5_k", "q4_k", "q3_k", "q2_k"]
    ok = [t for t in order if rates[t] >= rates["f16"] - max_drop]
    assert choice["mtp_type"] == ok[-1] and f"--mtp-type auto: {ok[-1]}" in " ".join(res.output.split())
    if max_drop == 1.0:
        assert choice["mtp_type"] == "q2_k"
    direct = tmp_path / "direct.gguf"
    assert run_cli("quantize", f16, direct, "Q4_K_M", "--mtp-type", choice["mtp_type"], "--quiet").exit_code == 0
    kv2, tensors2 = read_gguf(direct)
    assert {k: v for k, v in strip_general(kv).items() if k != AUTO_KEY} == strip_general(kv2)
    assert list(tensors) == list(tensors2)
    for name, (qt, data) in tensors.items():
        assert qt == tensors2[name][0], name
        np.testing.assert_array_equal(data, tensors2[name][1], err_msg=name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["auto.gguf", "direct.gguf"]  # no temporaries left


def test_auto_needs_a_head_and_refuses_dry_run(demo, tmp_path):
    f16, _ = demo
    res = run_cli("quantize", f16, tmp_path / "x.gguf", "Q4_K_M", "--mtp-type", "auto", "--dry-run")
    assert res.exit_code == 2 and "--dry-run" in res.output
    trunk = tmp_path / "trunk.gguf"
    src = Path(str(resources.files("mtpq").joinpath("data/demo")))
    assert run_cli("convert", src, trunk, "--no-mtp", "--quiet").exit_code == 0
    res = run_cli("quantize", trunk, tmp_path / "y.gguf", "Q4_K_M", "--mtp-type", "auto")
    assert res.exit_code == 2 and "no MTP head" in res.output
    assert not (tmp_path / "y.gguf").exists()


def test_convert_quant_auto_equals_convert_with_the_chosen_type(demo, tmp_path):
    _, prompts = demo
    src = Path(str(resources.files("mtpq").joinpath("data/demo")))
    out = tmp_path / "auto.gguf"
    res = run_cli(
        "convert",
        src,
        out,
        "--outtype",
        "f16",
        "--quant",
        "Q2_K",
        "--mtp-type",
        "auto",
        "--max-drop",
        0.05,
        "--prompts",
        prompts,
    )
    assert res.exit_code == 0, res.output
    kv, tensors = read_gguf(out)
    chosen = json.loads(kv[AUTO_KEY])["mtp_type"]
    direct = tmp_path / "direct.gguf"
    assert (
        run_cli(
            "convert", src, direct, "--outtype", "f16", "--quant", "Q2_K", "--mtp-type", chosen, "--quiet"
        ).exit_code
        == 0
    )
    kv2, tensors2 = read_gguf(direct)
    assert {k: v for k, v in strip_general(kv).items() if k != AUTO_KEY} == strip_general(kv2)
    assert {n: (t, d.tobytes()) for n, (t, d) in tensors.items()} == {
        n: (t, d.tobytes()) for n, (t, d) in tensors2.items()
    }


def test_auto_reads_a_split_model_and_keeps_its_shards(demo, tmp_path):
    """Given shard 2 of a split f16 and --keep-split: the input's shards, each holding what quantize --mtp-type
    <choice> --keep-split writes (the choice recorded in shard 1)."""
    from mtpq.gguf_io import SplitRule, plan_from_gguf, write_plan

    f16, prompts = demo
    prompts = tmp_path / "two.jsonl"  # the choice at --max-drop 1 does not depend on how many
    prompts.write_text("\n".join(demo[1].read_text().splitlines()[:2]) + "\n")
    (tmp_path / "in").mkdir()
    shards = write_plan(plan_from_gguf(f16), tmp_path / "in" / "f16.gguf", split=SplitRule(max_size=4_000_000))
    assert len(shards) > 2
    res = run_cli(
        "quantize",
        shards[1],
        tmp_path / "auto.gguf",
        "Q4_K_M",
        "--mtp-type",
        "auto",
        "--max-drop",
        1.0,
        "--prompts",
        prompts,
        "--keep-split",
    )
    assert res.exit_code == 0, res.output
    choice = json.loads(read_gguf(tmp_path / "auto-00001-of-{:05d}.gguf".format(len(shards)))[0][AUTO_KEY])["mtp_type"]
    assert (
        run_cli(
            "quantize", shards[0], tmp_path / "direct.gguf", "Q4_K_M", "--mtp-type", choice, "--keep-split", "-q"
        ).exit_code
        == 0
    )
    for i, src in enumerate(shards, 1):
        name = f"-{i:05d}-of-{len(shards):05d}.gguf"
        (kv, auto), (kv2, direct) = read_gguf(tmp_path / f"auto{name}"), read_gguf(tmp_path / f"direct{name}")
        assert list(auto) == list(direct) == list(read_gguf(src)[1])
        assert {k: v for k, v in strip_general(kv).items() if k != AUTO_KEY} == strip_general(kv2)
        for t in auto:
            assert auto[t][0] == direct[t][0] and np.array_equal(auto[t][1], direct[t][1]), t
    assert sorted(p.name for p in tmp_path.glob("*.gguf")) == sorted(
        f"{x}-{i:05d}-of-{len(shards):05d}.gguf" for x in ("auto", "direct") for i in range(1, len(shards) + 1)
    )
    assert not list(tmp_path.glob(".*"))  # no temporaries left
