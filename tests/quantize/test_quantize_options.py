"""llama-quantize's remaining options on ``mtpq quantize`` / ``convert --quant``: ``--tensor-type-file``,
``--leave-output-tensor``, ``--override-kv``, ``--prune-layers``.

Which type each tensor gets with them is recorded against llama-quantize in test_policy.py (its
``_OPTION_RUNS``); here: the bytes (llama_cpp-marked, against llama-quantize on the same file, an
imatrix included so that a renumbered block's weights are looked up under its old name), the MTP rule
with every option, the one-line refusals, and the files llama-quantize's --prune-layers breaks, loaded
in llama.cpp next to ours.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader

from tests.helpers.ggufcheck import gguf_field as field
from tests.helpers.ggufcheck import gguf_tensors as tensors
from tests.helpers.ggufcheck import glm4moe_fixtures
from tests.helpers.runcli import run_cli

ckpt, f32 = glm4moe_fixtures(3)  # 3 trunk blocks (block 0 dense, 1-2 MoE) + the MTP block 3


def quantize(src: Path, out: Path, *args) -> None:
    res = run_cli("quantize", src, out, *args, "--quiet")
    assert res.exit_code == 0, res.output


# ----------------------------------------------------------------------------- the options and the MTP rule


def test_prune_renumbers_and_the_head_stays_at_q8_0(f32, tmp_path):
    out = tmp_path / "p.gguf"
    quantize(f32, out, "Q4_K_M", "--prune-layers", "1")
    got = tensors(out)
    assert {int(n.split(".")[1]) for n in got if n.startswith("blk.")} == {0, 1, 2}
    assert field(out, "glm4moe.block_count") == 3 and field(out, "glm4moe.nextn_predict_layers") == 1
    # the MTP block (was 3) is now block 2, still held at q8_0; block 1 is the old block 2, Q4_K_M's
    assert T(got["blk.2.nextn.eh_proj.weight"].tensor_type) == T.Q8_0
    assert T(got["blk.2.ffn_up_exps.weight"].tensor_type) == T.Q8_0
    assert T(got["blk.1.ffn_up_exps.weight"].tensor_type) == T.Q4_K
    src = tensors(f32)
    assert np.array_equal(
        np.asarray(got["blk.2.nextn.enorm.weight"].data), np.asarray(src["blk.3.nextn.enorm.weight"].data)
    )


def test_pruning_the_head_drops_nextn_predict_layers(f32, tmp_path):
    out = tmp_path / "p.gguf"
    quantize(f32, out, "Q4_K_M", "--prune-layers", "3")
    assert field(out, "glm4moe.block_count") == 3 and field(out, "glm4moe.nextn_predict_layers") is None
    assert not any("nextn" in n for n in tensors(out))


def test_leave_output_tensor_file_and_overrides(f32, tmp_path):
    types_file = tmp_path / "types.txt"
    types_file.write_text("attn_q=q5_0\nblk\\.3\\.=f16  ffn_down=q2_k\n")
    out = tmp_path / "o.gguf"
    quantize(
        f32,
        out,
        "Q4_K_M",
        "--leave-output-tensor",
        "--output-tensor-type",
        "q8_0",
        "--tensor-type",
        "attn_k=q8_0",
        "--tensor-type-file",
        types_file,
        "--override-kv",
        "general.name=str:tiny pruned",
        "--override-kv",
        "glm4moe.expert_weights_scale=float:2.5",
    )
    got = {n: T(t.tensor_type) for n, t in tensors(out).items()}
    assert got["output.weight"] == T.F32  # left as in IN, --output-tensor-type notwithstanding
    assert got["blk.1.attn_q.weight"] == T.Q5_0 and got["blk.1.attn_k.weight"] == T.Q8_0
    assert got["blk.0.ffn_down.weight"] == T.Q2_K
    assert got["blk.3.nextn.eh_proj.weight"] == T.F16  # a file entry beats the MTP rule, as --tensor-type does
    assert field(out, "general.name") == "tiny pruned"
    assert field(out, "glm4moe.expert_weights_scale") == 2.5


def test_dry_run_shows_the_renamed_tensors_and_rules(f32, tmp_path):
    res = run_cli(
        "quantize",
        f32,
        tmp_path / "x.gguf",
        "Q4_K_M",
        "--prune-layers",
        "0",
        "--leave-output-tensor",
        "--dry-run",
        "--json",
    )
    assert res.exit_code == 0, res.output
    import json

    info = json.loads(res.stdout)
    rows = {r["name"]: r for r in info["tensors"]}
    assert rows["blk.0.ffn_up_exps.weight"]["input_name"] == "blk.1.ffn_up_exps.weight"
    assert rows["output.weight"]["rule"].startswith("--leave-output-tensor")
    assert rows["blk.2.nextn.eh_proj.weight"]["rule"] == "mtp block held at q8_0"
    assert info["totals"]["pruned_tensors"] > 0
    assert not (tmp_path / "x.gguf").exists()


def test_convert_quant_takes_the_options_and_equals_convert_then_quantize(ckpt, f32, tmp_path):
    args = ["--prune-layers", "2", "--leave-output-tensor", "--override-kv", "general.name=str:x"]
    one = tmp_path / "one.gguf"
    res = run_cli("convert", ckpt, one, "--outtype", "f32", "--quant", "Q4_K_M", *args, "--quiet")
    assert res.exit_code == 0, res.output
    two = tmp_path / "two.gguf"
    quantize(f32, two, "Q4_K_M", *args)
    a, b = tensors(one), tensors(two)
    assert list(a) == list(b)
    for name in a:
        assert np.asarray(a[name].data).tobytes() == np.asarray(b[name].data).tobytes(), name
    assert field(one, "general.name") == "x" and field(one, "glm4moe.block_count") == 3
    plain = tmp_path / "plain.gguf"  # --override-kv also without --quant
    assert run_cli("convert", ckpt, plain, "--override-kv", "general.name=str:y", "--quiet").exit_code == 0
    assert field(plain, "general.name") == "y"


@pytest.mark.parametrize(
    "args,where,says",
    [
        (["--override-kv", "general.name"], "--override-kv", "KEY=TYPE:VALUE"),
        (["--override-kv", "a=double:1"], "--override-kv", "KEY=TYPE:VALUE"),
        (["--override-kv", "a=int:-1"], "--override-kv", "uint32"),
        (["--override-kv", "a=int:12abc"], "--override-kv", "not an integer"),
        (["--override-kv", "a=bool:yes"], "--override-kv", "true or false"),
        (["--override-kv", f"a=str:{'x' * 128}"], "--override-kv", "at most 127"),
        (["--override-kv", "general.architecture=str:llama"], "--override-kv", "written by mtpq"),
        (["--override-kv", "split.count=int:2"], "--override-kv", "written by mtpq"),
        (["--override-kv", "glm4moe.block_count=float:3"], "--override-kv", "holds a uint32, not float"),
        (["--override-kv", "tokenizer.ggml.tokens=str:x"], "--override-kv", "is an array"),
        (["--prune-layers", "1,x"], "--prune-layers", "not a block number"),
        (["--prune-layers", "-1"], "--prune-layers", "not a block number"),
        (["--prune-layers", "9"], "--prune-layers", "block 9 does not exist"),
        (["--prune-layers", "0,1,2"], "--prune-layers", "every trunk block"),
        (["--tensor-type-file", "missing.txt"], "missing.txt", "cannot read"),
    ],
)
def test_bad_options_exit_2_and_leave_nothing(f32, tmp_path, args, where, says):
    args = [a.replace("missing.txt", str(tmp_path / "missing.txt")) for a in args]
    res = run_cli("quantize", f32, tmp_path / "out.gguf", "Q4_K_M", *args)
    assert res.exit_code == 2, res.output
    line = res.output.strip().splitlines()[-1]
    assert line.startswith("error: ") and where in line and says in line, line
    assert not list(tmp_path.glob("out*"))


def test_a_bad_entry_in_the_tensor_type_file_names_the_file(f32, tmp_path):
    bad = tmp_path / "types.txt"
    bad.write_text("attn_q=q8_0\n# a comment\n")  # llama-quantize has no comments either
    res = run_cli("quantize", f32, tmp_path / "out.gguf", "Q4_K_M", "--tensor-type-file", bad)
    assert res.exit_code == 2 and f"error: {bad}:" in res.output and "'#'" in res.output, res.output


def test_pruning_against_the_layer_pattern_is_refused(tmp_path):
    """Qwen3-Next writes no per-layer array, only full_attention_interval: a block moved onto a position of
    the other kind would load as the wrong kind, so the pruning is refused; whole runs of the period pass."""
    from gguf import GGUFValueType

    from mtpq.errors import InputError
    from mtpq.quantize.prune import prune_blocks
    from mtpq.tensors import Plan

    plan = Plan("qwen3next", {}, [], n_trunk_layers=8, n_mtp_layers=1)
    plan.set_kv("qwen3next.full_attention_interval", 4, GGUFValueType.UINT32)
    with pytest.raises(InputError, match="block 3 .full-attention. would become block 2"):
        prune_blocks(plan, [1])
    assert prune_blocks(plan, [0, 1, 2, 3]).n_trunk_layers == 4


# ----------------------------------------------------------------------------- against llama-quantize


def _llama(bin_dir: Path, *args, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "LD_LIBRARY_PATH": str(bin_dir)}
    proc = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, errors="replace", timeout=600, env=env
    )
    assert not check or proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.llama_cpp
def test_same_bytes_as_llama_quantize_with_every_option(f32, llama_cpp_bin, tmp_path):
    """--prune-layers, --tensor-type-file, --leave-output-tensor, --override-kv and an imatrix (random
    weights, so that each tensor's bytes depend on the entry found under its old block number)."""
    from mtpq.quantize.imatrix import Entry, Imatrix, write_imatrix

    rng = np.random.default_rng(0)
    entries = {
        t.name: Entry(
            rng.uniform(0.1, 4.0, (int(t.shape[2]) if len(t.shape) == 3 else 1, int(t.shape[0]))).astype(np.float32),
            np.ones(int(t.shape[2]) if len(t.shape) == 3 else 1, dtype=np.float32),
        )
        for t in GGUFReader(f32).tensors
        if len(t.shape) >= 2 and t.name.endswith("weight")
    }
    imatrix = tmp_path / "im.gguf"
    write_imatrix(Imatrix(entries, datasets=["random"], chunk_count=1, chunk_size=1), imatrix)
    types_file = tmp_path / "types.txt"
    types_file.write_text("attn_q=q5_0 ffn_down_exps=q5_k\n")
    args = [
        "--prune-layers",
        "1",
        "--tensor-type-file",
        types_file,
        "--leave-output-tensor",
        "--imatrix",
        imatrix,
        "--override-kv",
        "general.name=str:pruned",
        "--override-kv",
        "glm4moe.expert_count=int:8",
    ]
    ours, theirs = tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
    quantize(f32, ours, "Q4_K_M", "--mtp-type", "same", *args)
    _llama(llama_cpp_bin, llama_cpp_bin / "llama-quantize", *args, f32, theirs, "Q4_K_M", "1")
    a, b = tensors(ours), tensors(theirs)
    assert set(a) == set(b)
    for name in a:
        assert a[name].tensor_type == b[name].tensor_type, name
        assert np.asarray(a[name].data).tobytes() == np.asarray(b[name].data).tobytes(), name
    for key in (
        "general.name",
        "glm4moe.expert_count",
        "glm4moe.block_count",
        "glm4moe.nextn_predict_layers",
        "general.file_type",
        "quantize.imatrix.entries_count",
    ):
        fa, fb = GGUFReader(ours).fields[key], GGUFReader(theirs).fields[key]
        assert fa.contents() == fb.contents() and fa.types == fb.types, key
    # the default head type on top of the same options: only the MTP block (now blk.2) changes, but for the
    # file's entries, which beat the MTP rule as --tensor-type does
    held = tmp_path / "held.gguf"
    quantize(f32, held, "Q4_K_M", *args)
    for name, t in tensors(held).items():
        if (
            name.startswith("blk.2.")
            and len(t.shape) >= 2
            and "gate_inp" not in name
            and not re.search("attn_q|ffn_down_exps", name)
        ):
            assert T(t.tensor_type) == T.Q8_0, name
        else:
            assert np.asarray(t.data).tobytes() == np.asarray(b[name].data).tobytes(), name


def _n_layer(bin_dir: Path, path: Path) -> tuple[int | None, str]:
    """llama.cpp's trunk layer count for ``path`` (None: it refused the file), and its error line."""
    proc = _llama(
        bin_dir,
        bin_dir / "llama-cli",
        "-m",
        path,
        "-p",
        "hi",
        "-n",
        1,
        "-st",
        "-c",
        128,
        "-t",
        1,
        "--temp",
        0,
        "--no-repack",
        "-lv",
        4,
        check=False,
    )
    m = re.search(r"print_info: n_layer\s+= (\d+)", proc.stdout + proc.stderr)
    err = next((line for line in (proc.stdout + proc.stderr).splitlines() if "error loading model" in line), "")
    return (int(m.group(1)) if m and proc.returncode == 0 else None), err


@pytest.mark.llama_cpp
def test_where_llama_quantize_breaks_a_pruned_file_ours_loads(f32, llama_cpp_bin, tmp_path):
    """llama-quantize --prune-layers keeps nextn_predict_layers and leading_dense_block_count as they were:
    pruning the head makes llama.cpp run the last trunk block as the head (a trunk one block short), pruning
    the dense block 0 makes it look for a dense FFN in an MoE block. mtpq's files load as meant."""

    def both(prune: str) -> tuple[Path, Path]:
        ours, theirs = tmp_path / f"ours-{prune}.gguf", tmp_path / f"theirs-{prune}.gguf"
        quantize(f32, ours, "Q8_0", "--prune-layers", prune)
        _llama(llama_cpp_bin, llama_cpp_bin / "llama-quantize", "--prune-layers", prune, f32, theirs, "Q8_0", "1")
        return ours, theirs

    ours, theirs = both("3")  # the MTP block: 3 trunk blocks are left
    assert _n_layer(llama_cpp_bin, ours)[0] == 3
    assert _n_layer(llama_cpp_bin, theirs)[0] == 2  # llama-quantize's: the last trunk block taken for the head
    ours, theirs = both("0")  # the dense block
    assert _n_layer(llama_cpp_bin, ours)[0] == 2
    n, err = _n_layer(llama_cpp_bin, theirs)
    assert n is None and "blk.0.ffn_gate.weight" in err, err


@pytest.mark.llama_cpp
def test_pruned_file_drafts_with_its_head_in_llama_cpp(f32, llama_cpp_bin, tmp_path):
    from tests.helpers.llamacpp_ref import speculative_simple

    out = tmp_path / "p.gguf"
    quantize(f32, out, "Q4_K_M", "--prune-layers", "1")
    flags = ["-c", "256", "-t", "1", "--temp", "0", "--no-repack"]
    res, stats = speculative_simple(
        llama_cpp_bin, "-m", out, "--spec-type", "draft-mtp", "-p", "def add(a, b):", "-n", 16, *flags
    )
    assert "creating MTP draft context" in res.stderr, res.stderr[-2000:]
    assert stats["n_drafted"] > 0


@pytest.mark.llama_cpp
def test_pruned_per_layer_arrays_load(llama_cpp_bin, tmp_path):
    """Qwen3.5 lists each block's kind in attention.recurrent_layers: llama-quantize keeps the old array
    (llama.cpp: wrong array length); ours drops the pruned entries and loads."""
    from tests.builders import tiny_qwen35

    ckpt = tiny_qwen35.qwen35(tmp_path / "ckpt", num_hidden_layers=8, dtype=torch.float32)
    f32 = tmp_path / "q-f32.gguf"
    assert run_cli("convert", ckpt, f32, "--outtype", "f32", "--quiet").exit_code == 0
    ours, theirs = tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
    quantize(f32, ours, "Q8_0", "--prune-layers", "2")
    _llama(llama_cpp_bin, llama_cpp_bin / "llama-quantize", "--prune-layers", "2", f32, theirs, "Q8_0", "1")
    assert field(ours, "qwen35.attention.recurrent_layers") == [True, True, False, True, True, True, False, False]
    assert _n_layer(llama_cpp_bin, ours)[0] == 7
    n, err = _n_layer(llama_cpp_bin, theirs)
    assert n is None and "wrong array length" in err, err
