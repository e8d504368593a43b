"""``mtpq inspect --check``: the broken MTP files people report, each made with mtpq (``--override-kv``, by hand,
``--mtp-type q2_k``), are caught with one line naming the file and the problem, exit 1; sound files pass (the
demo build's every file: tests/release/test_sidecar.py)."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from tests.helpers.runcli import run_cli


@pytest.fixture(scope="module")
def made(glm_ckpt, tmp_path_factory):
    """A tiny GLM (2 trunk blocks + blk.2, the head) as f16, trunk-only and head-only files."""
    d = tmp_path_factory.mktemp("check")
    for name, flags in (("f16", ()), ("trunk", ("--no-mtp",)), ("head", ("--mtp-only",))):
        res = run_cli("convert", glm_ckpt, d / f"{name}.gguf", "--outtype", "f16", "-q", *flags)
        assert res.exit_code == 0, res.output
    return d


def check(*files):
    res = run_cli("inspect", "--check", *files)
    return res.exit_code, [line for line in res.stdout.splitlines() if line.strip()]


def test_sound_files_pass(made):
    code, lines = check(made / "f16.gguf", made / "trunk.gguf", made / "head.gguf")
    assert code == 0, lines
    assert lines == [
        f"{made / 'f16.gguf'}: ok (trunk + head blk.2)",
        f"{made / 'trunk.gguf'}: ok (trunk only, no head)",
        f"{made / 'head.gguf'}: ok (head file blk.2)",
    ]


@pytest.mark.parametrize(
    "override, says",
    [
        (
            "glm4moe.nextn_predict_layers=int:2",
            "nextn_predict_layers is 2 with block_count 3, so the head should be "
            "blk.1, blk.2, but MTP tensors (nextn.*) are in blk.2",
        ),
        (
            "glm4moe.nextn_predict_layers=int:0",
            "nextn_predict_layers is 0, but blk.2 hold MTP tensors (nextn.*): llama.cpp will not load the head",
        ),
        (
            "glm4moe.block_count=int:2",
            "block_count is 2, but tensors reach blk.2: block_count must count the trunk and the MTP blocks",
        ),
    ],
)
def test_wrong_metadata(made, tmp_path, override, says):
    out = tmp_path / "bad.gguf"
    res = run_cli("quantize", made / "f16.gguf", out, "Q8_0", "--override-kv", override, "-q")
    assert res.exit_code == 0, res.output
    code, lines = check(out)
    assert code == 1 and lines == [f"{out}: glm4moe.{says}"], lines


def test_missing_nextn_key(made, tmp_path):
    from mtpq.gguf_io import plan_from_gguf, write_plan

    plan = plan_from_gguf(made / "f16.gguf")
    plan.drop_kv("glm4moe.nextn_predict_layers")
    write_plan(plan, tmp_path / "bad.gguf")
    code, lines = check(tmp_path / "bad.gguf")
    assert code == 1 and lines == [
        f"{tmp_path / 'bad.gguf'}: glm4moe.nextn_predict_layers is missing, but blk.2 "
        "hold MTP tensors (nextn.*): llama.cpp will not load the head"
    ], lines


@pytest.mark.parametrize("drop", ["blk.2.nextn.eh_proj.weight", "blk.2.ffn_down_exps.weight"])
@pytest.mark.parametrize("source", ["f16", "head"])
def test_missing_head_tensor(made, tmp_path, drop, source):
    from mtpq.gguf_io import plan_from_gguf, write_plan

    plan = plan_from_gguf(made / f"{source}.gguf")
    write_plan(dataclasses.replace(plan, tensors=[s for s in plan.tensors if s.name != drop]), tmp_path / "bad.gguf")
    code, lines = check(tmp_path / "bad.gguf")
    if source == "head" and "exps" in drop:  # a head file has no trunk block to say what the head block holds
        assert code == 0, lines
        return
    assert code == 1 and lines == [f"{tmp_path / 'bad.gguf'}: head tensors missing: {drop}"], lines


def test_two_bit_head_is_a_warning_naming_the_risk(made, tmp_path):
    out = tmp_path / "q2.gguf"
    assert run_cli("quantize", made / "f16.gguf", out, "Q2_K", "--mtp-type", "q2_k", "-q").exit_code == 0
    code, lines = check(out)
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"{out}: warning: ") and "Q2_K (2.62 bits/weight" in lines[0]
    assert "0-4 %" in lines[0] and "--mtp-type q8_0" in lines[0]
    out8 = tmp_path / "q8.gguf"
    assert run_cli("quantize", made / "f16.gguf", out8, "Q2_K", "-q").exit_code == 0  # head held at q8_0
    assert check(out8)[0] == 0


def test_head_file_of_another_model(made, tmp_path):
    from tests.builders import tiny

    other = tiny.glm4moe(tmp_path / "other", seed=1, hidden_size=512)
    head = tmp_path / "mtp-other.gguf"
    assert run_cli("convert", other, head, "--mtp-only", "-q").exit_code == 0
    code, lines = check(made / "trunk.gguf", head)
    assert code == 1 and lines[-1] == f"{head}: hidden size 512 does not match trunk.gguf's 256", lines


def test_any_shard_checks_the_set_and_needs_no_torch(made, tmp_path):
    import subprocess

    assert (
        run_cli("quantize", made / "f16.gguf", tmp_path / "s.gguf", "Q8_0", "--split-max-size", "1M", "-q").exit_code
        == 0
    )
    shards = sorted(tmp_path.glob("s-*-of-*.gguf"))
    assert len(shards) > 1
    code, lines = check(shards[-1], shards[0])  # one set, counted once
    assert code == 0 and len(lines) == 1, lines
    probe = "import sys, mtpq.gguf_io.check as c; c.check_files(sys.argv[1:]); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe, str(shards[0])], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


FAMILIES = [  # (builder module, function, keyword arguments): every family mtpq converts, as tiny checkpoints
    ("tiny", "glm4moe", {}),
    ("tiny", "glm4moe", {"glm46": True}),
    ("tiny_deepseek2", "deepseek_v3", {}),
    ("tiny_deepseek32", "deepseek_v32", {}),
    ("tiny_glm_dsa", "glm_dsa", {}),
    ("tiny_glm_dsa", "glm4_moe_lite", {}),
    ("tiny_qwen35", "qwen35", {}),
    ("tiny_qwen35", "qwen35", {"moe": True}),
    ("tiny_qwen3next", "qwen3next", {}),
    ("tiny_step35", "step35", {}),
    ("tiny_mimo2", "mimo2", {}),
    ("tiny_hy_v3", "hy_v3", {}),
    ("tiny_cohere2moe", "cohere2moe", {}),
    ("tiny_nemotron_h_moe", "nemotron_h_moe", {}),
    ("tiny_bailingmoe3", "bailingmoe3", {}),
]


@pytest.mark.slow
@pytest.mark.parametrize("module, builder, kwargs", FAMILIES, ids=lambda x: x if isinstance(x, str) else "")
def test_every_family_passes_whole_trunk_and_head_file(tmp_path, module, builder, kwargs):
    """No false alarm on any family's layout: the head block's tensors are compared with the trunk block most like
    it, and families differ in what their blocks hold (dense first layers, linear attention, MLA, experts)."""
    import importlib

    ckpt = getattr(importlib.import_module(f"tests.builders.{module}"), builder)(tmp_path / "ckpt", **kwargs)
    files = []
    for name, flags in (("whole", ()), ("trunk", ("--no-mtp",)), ("mtp-head", ("--mtp-only",))):
        res = run_cli("convert", ckpt, tmp_path / f"{name}.gguf", "-q", *flags)
        assert res.exit_code == 0, res.output
        files.append(tmp_path / f"{name}.gguf")
    code, lines = check(*files)
    assert code == 0 and len(lines) == 3 and all(": ok (" in line for line in lines), lines
