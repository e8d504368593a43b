"""``mtpq quantize`` and ``mtpq convert --quant`` end to end, on a tiny GLM-4.5 (1 trunk layer + MTP).

The written files are read back with gguf-py (types, metadata) and dequantized
with gguf-py's own dequantizers (values) -- independent of mtpq's kernels. Which
type each tensor gets is tested against llama-quantize in test_policy.py; the
llama_cpp-marked tests here compare bytes with llama-quantize's output and load
the result in llama.cpp.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize

from tests.helpers.ggufcheck import gguf_tensors as tensors
from tests.helpers.ggufcheck import glm4moe_fixtures
from tests.helpers.llamacpp_ref import speculative_simple
from tests.helpers.runcli import run_cli

# relative RMS error of a Gaussian weight after a round trip: about half these bounds
MAX_REL_ERROR = {
    "F32": 0.0,
    "F16": 1e-3,
    "Q8_0": 0.01,
    "Q6_K": 0.03,
    "Q5_K": 0.05,
    "Q5_0": 0.06,
    "Q5_1": 0.06,
    "Q4_K": 0.1,
    "Q4_0": 0.12,
    "Q4_1": 0.12,
    "Q3_K": 0.2,
    "Q2_K": 0.4,
}


# one trunk layer keeps the K-quant work small; the MTP block (layer 1) is a full MoE block
ckpt, f32 = glm4moe_fixtures(1)


@pytest.fixture(scope="module")
def q4km(f32, tmp_path_factory) -> tuple[Path, dict]:
    """The default: Q4_K_M trunk, MTP block at q8_0; with the --json account of every decision."""
    out = tmp_path_factory.mktemp("q4km") / "tiny-q4km.gguf"
    res = run_cli("quantize", f32, out, "Q4_K_M", "--json")
    assert res.exit_code == 0, res.output
    return out, json.loads(res.stdout)


def field(path: Path, key: str):
    return GGUFReader(path).fields[key].contents()


def rel_error(t, source) -> float:
    got = dequantize(np.asarray(t.data), T(t.tensor_type)).reshape(-1).astype(np.float64)
    want = np.asarray(source.data).reshape(-1).astype(np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def files_in(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


# ----------------------------------------------------------------------------- the quantized file


def test_file_holds_the_decided_types_and_mtp_at_q8_0(q4km):
    path, info = q4km
    got = {n: T(t.tensor_type).name for n, t in tensors(path).items()}
    assert [r["name"] for r in info["tensors"]] == list(got)
    assert {r["name"]: r["type"] for r in info["tensors"]} == got
    mtp_2d = [r for r in info["tensors"] if r["role"] == "mtp" and len(r["shape"]) > 1 and "gate_inp" not in r["name"]]
    assert len(mtp_2d) >= 10 and {r["type"] for r in mtp_2d} == {"Q8_0"}
    assert all(r["rule"] in ("mtp block held at q8_0", "mtp experts held at q8_0") for r in mtp_2d)
    assert got["blk.1.ffn_gate_inp.weight"] == "F32" and got["blk.1.nextn.enorm.weight"] == "F32"
    # trunk: llama-quantize's Q4_K_M mix (with 2 blocks no layer is a "more bits" one; output at q6_k)
    assert got["blk.0.attn_v.weight"] == "Q4_K" and got["blk.0.ffn_down.weight"] == "Q4_K"
    assert got["blk.0.attn_q.weight"] == "Q4_K" and got["output.weight"] == "Q6_K"
    assert {r["name"] for r in info["tensors"] if r["type"] == "F32"} == {
        n for n, t in tensors(path).items() if len(t.shape) == 1 or t.shape[1] == 1 or "gate_inp" in n
    }


def test_metadata_like_llama_quantize(q4km, f32):
    path, _ = q4km
    assert field(path, "general.file_type") == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    assert field(path, "general.quantization_version") == 2
    for key in ("glm4moe.block_count", "glm4moe.nextn_predict_layers", "glm4moe.expert_count", "tokenizer.ggml.tokens"):
        assert field(path, key) == field(f32, key)


def test_values_survive_the_round_trip(q4km, f32):
    path, _ = q4km
    source = tensors(f32)
    worst: dict[str, float] = {}
    for name, t in tensors(path).items():
        q = T(t.tensor_type).name
        worst[q] = max(worst.get(q, 0.0), rel_error(t, source[name]))
    assert set(worst) >= {"F32", "Q4_K", "Q6_K", "Q8_0"}
    for q, err in worst.items():
        assert err <= MAX_REL_ERROR[q], (q, err)


# ----------------------------------------------------------------------------- dry run, options


def test_dry_run_prints_the_table_and_writes_nothing(f32, tmp_path):
    out = tmp_path / "never.gguf"
    res = run_cli("quantize", f32, out, "Q4_K_M", "--dry-run")
    assert res.exit_code == 0, res.output
    assert files_in(tmp_path) == set()
    for name in tensors(f32):
        assert name in res.stdout
    assert "mtp block held at q8_0" in res.stdout and "totals by role" in res.stdout
    row = next(line for line in res.stdout.splitlines() if line.startswith("blk.0.attn_v.weight"))
    assert row.split()[1:] == ["attn", "F32", "Q4_K", "18,432", "Q4_K_M", "base", "type"]
    row = next(line for line in res.stdout.splitlines() if line.startswith("blk.1.attn_v.weight"))
    assert row.split()[1:] == ["mtp", "F32", "Q8_0", "34,816", "mtp", "block", "held", "at", "q8_0"]

    res = run_cli("quantize", f32, out, "Q4_K_M", "--dry-run", "--json")
    info = json.loads(res.stdout)
    assert files_in(tmp_path) == set() and info["dry_run"] is True
    assert info["totals"]["bytes"] == sum(r["bytes"] for r in info["tensors"])
    assert info["totals"]["bits_per_weight"] == round(8 * info["totals"]["bytes"] / info["totals"]["elements"], 3)
    mtp = info["by_role"]["mtp"]
    assert 8.0 < mtp["bits_per_weight"] < 9.0  # q8_0 is 8.5 bits/weight; the 1-D tensors add a little


def test_options_reach_the_policy(f32, tmp_path):
    res = run_cli(
        "quantize",
        f32,
        tmp_path / "x.gguf",
        "Q4_0",
        "--dry-run",
        "--json",
        "--pure",
        "--tensor-type",
        r"blk\.0\.attn_q=q8_0",
        "--mtp-experts-type",
        "q4_k",
        "--mtp-type",
        "f16",
        "--output-tensor-type",
        "q5_k",
        "--token-embedding-type",
        "bf16",
    )
    assert res.exit_code == 0, res.output
    got = {r["name"]: r["type"] for r in json.loads(res.stdout)["tensors"]}
    assert got["blk.0.attn_q.weight"] == "Q8_0" and got["blk.0.attn_v.weight"] == "Q4_0"  # --pure: no attn_v bump
    assert got["blk.1.ffn_up_exps.weight"] == "Q4_K" and got["blk.1.attn_q.weight"] == "F16"
    assert got["output.weight"] == "Q5_K" and got["token_embd.weight"] == "BF16"


@pytest.mark.parametrize(
    "args,where",
    [
        (["Q9_X"], "PRESET"),
        (["IQ2_XXS"], "--imatrix"),  # an i-quant preset without importance data, as llama-quantize refuses it
        (["Q4_K_M", "--tensor-type", "(blk=q8_0"], "--tensor-type"),
        (["Q4_K_M", "--tensor-type", "attn_v=q9_0"], "--tensor-type"),
        (["Q4_K_M", "--tensor-type", "attn_v"], "--tensor-type"),
        (["Q4_K_M", "--mtp-type", "fp8"], "--mtp-type"),
        (["Q4_K_M", "--mtp-experts-type", "q4"], "--mtp-experts-type"),
        (["Q4_K_M", "--output-tensor-type", "int4"], "--output-tensor-type"),
        (["Q4_K_M", "--token-embedding-type", "q4_k_m"], "--token-embedding-type"),
        (["Q4_K_M", "--threads", "0"], "--threads"),
    ],
)
def test_bad_options_exit_2_and_leave_nothing(f32, tmp_path, args, where):
    out = tmp_path / "out.gguf"
    res = run_cli("quantize", f32, out, *args)
    assert res.exit_code == 2, res.output
    assert files_in(tmp_path) == set()
    line = res.output.strip().splitlines()[-1]
    assert line.startswith(f"error: {where}:"), res.output


def test_threads_option_sets_the_workers_and_changes_no_byte(q4km, f32, tmp_path):
    out = tmp_path / "t3.gguf"
    before = torch.get_num_threads()
    try:
        res = run_cli("quantize", f32, out, "Q4_K_M", "--threads", "3", "-q")
        assert res.exit_code == 0, res.output
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
    assert out.read_bytes() == q4km[0].read_bytes()


def test_bad_files_exit_2(f32, tmp_path):
    res = run_cli("quantize", tmp_path / "missing.gguf", tmp_path / "out.gguf", "Q8_0")
    assert res.exit_code == 2 and "missing.gguf" in res.output and files_in(tmp_path) == set()
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    res = run_cli("quantize", tmp_path / "junk.gguf", tmp_path / "out.gguf", "Q8_0")
    assert res.exit_code == 2 and "junk.gguf" in res.output and files_in(tmp_path) == {"junk.gguf"}
    res = run_cli("quantize", f32, f32, "Q8_0")
    assert res.exit_code == 2 and "input" in res.output


def test_requantizing_needs_the_flag_and_warns(f32, tmp_path, caplog):
    q8 = tmp_path / "q8.gguf"
    assert run_cli("quantize", f32, q8, "Q8_0", "--quiet").exit_code == 0
    keep_output = ["--tensor-type", r"^output\.=q8_0"]  # saves a slow q6_k pass; not what is tested here
    # same types: tensors are copied byte for byte, no requantization
    again = tmp_path / "q8-again.gguf"
    res = run_cli("quantize", q8, again, "Q8_0", "--quiet")
    assert res.exit_code == 0, res.output
    a, b = tensors(q8), tensors(again)
    assert all(np.array_equal(np.asarray(a[n].data), np.asarray(b[n].data)) for n in a)

    out = tmp_path / "q4.gguf"
    res = run_cli("quantize", q8, out, "Q4_0", *keep_output)
    assert res.exit_code == 2 and "--allow-requantize" in res.output and "q8.gguf" in res.output
    assert not out.exists()
    res = run_cli("quantize", q8, out, "Q4_0", "--allow-requantize", "--json", *keep_output)
    assert res.exit_code == 0, res.output
    assert any("requantized" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    rules = {r["name"]: r["rule"] for r in json.loads(res.stdout)["tensors"]}
    assert rules["blk.0.attn_q.weight"] == "Q4_0 base type (requantized from q8_0)"
    got = {n: T(t.tensor_type).name for n, t in tensors(out).items()}
    assert got["blk.0.attn_q.weight"] == "Q4_0" and got["blk.1.nextn.eh_proj.weight"] == "Q8_0"


# ----------------------------------------------------------------------------- one pass from HF


def test_convert_quant_in_one_pass_equals_convert_then_quantize(ckpt, f32, tmp_path):
    one = tmp_path / "one-pass.gguf"
    opts = ["--tensor-type", r"^output\.=q8_0", "--mtp-experts-type", "q5_1"]
    res = run_cli("convert", ckpt, one, "--quant", "Q5_0", "--quiet", *opts)
    assert res.exit_code == 0, res.output
    two = tmp_path / "two-pass.gguf"
    assert run_cli("quantize", f32, two, "Q5_0", "--quiet", *opts).exit_code == 0
    assert one.read_bytes() == two.read_bytes()  # the f32 checkpoint's values are what both quantize
    got = {n: T(t.tensor_type).name for n, t in tensors(one).items()}
    assert got["blk.0.attn_q.weight"] == "Q5_0" and got["output.weight"] == "Q8_0"
    assert got["blk.1.ffn_down_exps.weight"] == "Q5_1" and got["blk.1.nextn.eh_proj.weight"] == "Q8_0"
    assert field(one, "general.file_type") == 8  # LLAMA_FTYPE_MOSTLY_Q5_0


@pytest.mark.parametrize(
    "args,where",
    [
        (["--quant", "Q4_K_X"], "--quant"),
        (["--quant", "Q4_K_M", "--mtp-type", "q7_0"], "--mtp-type"),
        (["--quant", "Q4_K_M", "--tensor-type", "[=q8_0"], "--tensor-type"),
        (["--mtp-type", "q8_0"], "--mtp-type"),  # needs --quant
    ],
)
def test_convert_quant_bad_options(ckpt, tmp_path, args, where):
    res = run_cli("convert", ckpt, tmp_path / "out.gguf", *args)
    assert res.exit_code == 2, res.output
    assert res.output.strip().splitlines()[-1].startswith(f"error: {where}:"), res.output
    assert files_in(tmp_path) == set()


# ----------------------------------------------------------------------------- against llama.cpp itself


def _llama(bin_dir: Path, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "LD_LIBRARY_PATH": str(bin_dir)}
    proc = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, errors="replace", timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.llama_cpp
@pytest.mark.slow
@pytest.mark.parametrize("preset", ["Q4_K_M", "Q3_K_M", "Q5_1", "TQ1_0", "TQ2_0", "Q2_0", "Q1_0", "MXFP4_MOE"])
def test_same_bytes_as_llama_quantize_with_mtp_type_same(f32, llama_cpp_bin, tmp_path, preset):
    ours, theirs = tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
    assert run_cli("quantize", f32, ours, preset, "--mtp-type", "same", "--quiet").exit_code == 0
    _llama(llama_cpp_bin, llama_cpp_bin / "llama-quantize", f32, theirs, preset, "1")
    a, b = tensors(ours), tensors(theirs)
    assert set(a) == set(b)
    for name in a:
        assert a[name].tensor_type == b[name].tensor_type, name
        assert np.array_equal(np.asarray(a[name].data).view(np.uint8), np.asarray(b[name].data).view(np.uint8)), name
    for key in ("general.file_type", "general.quantization_version"):
        assert field(ours, key) == field(theirs, key)


@pytest.mark.llama_cpp
def test_quantized_file_loads_and_drafts_in_llama_cpp(q4km, llama_cpp_bin):
    path, _ = q4km
    flags = ["-c", "256", "-t", "1", "--temp", "0", "--no-repack"]
    _llama(llama_cpp_bin, llama_cpp_bin / "llama-cli", "-m", path, "-p", "hi", "-n", 4, "-st", *flags)
    res, stats = speculative_simple(
        llama_cpp_bin, "-m", path, "--spec-type", "draft-mtp", "-p", "def add(a, b):", "-n", 16, *flags
    )
    assert "creating MTP draft context" in res.stderr, res.stderr[-2000:]
    assert stats["n_drafted"] > 0
