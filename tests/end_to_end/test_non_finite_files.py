"""Non-finite weights and activations stop every measuring command with one line (issue 35).

Copies of the demo model's f32 GGUF with one tensor damaged in place:
- a NaN output norm, an inf in one layer's matrix, a NaN MTP-head projection: broken files, exit 2 naming the tensor;
- a layer whose finite weights (3e38) overflow its activations: a failed measurement naming the layer and position,
  exit 1 where the command gates (compare with a gate, accept, build), else 2.
Before the checks, ``compare --max-kld`` and ``accept --max-drop`` printed PASS on the NaN norm (every argmax of
all-NaN logits is token 0, so every draft "agreed").
"""

from __future__ import annotations

import inspect
import json
import json.decoder
import shutil
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from tests.helpers.runcli import run_cli

DEMO = Path(str(resources.files("mtpq").joinpath("data/demo")))
# file -> (tensor, the values written into it (all, or one element)): the demo has 4 trunk blocks, its head is blk.4
DAMAGE = {
    "norm-nan": ("output_norm.weight", np.nan, None),
    "norm-inf": ("output_norm.weight", np.inf, None),
    "layer-nan": ("blk.1.attn_q.weight", np.nan, (3, 5)),
    "layer-inf": ("blk.1.attn_q.weight", -np.inf, (3, 5)),
    "head-nan": ("blk.4.nextn.eh_proj.weight", np.nan, (0, 0)),
    "overflow": ("blk.2.ffn_down_shexp.weight", np.float32(3e38), None),
}
BROKEN = [k for k in DAMAGE if k != "overflow"]


def damaged_copy(good: Path, out: Path, tensor: str, value, at) -> Path:
    shutil.copy(good, out)
    for t in GGUFReader(out, "r+").tensors:  # written through the memory map
        if t.name == tensor:
            if at is None:
                t.data[...] = value
            else:
                t.data[at] = value
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("nonfinite")
    out = {"f32": d / "f32.gguf"}
    assert run_cli("convert", DEMO, out["f32"], "--outtype", "f32", "--quiet").exit_code == 0
    for name, (tensor, value, at) in DAMAGE.items():
        out[name] = damaged_copy(out["f32"], d / f"{name}.gguf", tensor, value, at)
    out["text"] = d / "text.txt"
    out["text"].write_text(inspect.getsource(json.decoder))
    return out


def _one_line(res) -> str:
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.output, res.output
    return lines[0]


def _command(cmd: str, f: dict[str, Path], bad: Path, gate: bool = True) -> list:
    text = ("-f", f["text"])
    return {
        "compare": ["compare", f["f32"], bad, *text, "-c", 128, "--chunks", 2, *(("--max-kld", 0.05) if gate else ())],
        "accept": ["accept", bad, "--reference", f["f32"], "--max-drop", 0.05, "--max-prompts", 1, "-n", 8],
        "sweep": ["sweep", bad, "--mtp", "q8_0", "--trunk", "Q8_0", "--max-prompts", 1, "-n", 8],
        "imatrix": ["imatrix", bad, *text, "-o", bad.with_suffix(".imatrix"), "-c", 128, "--chunks", 1],
    }[cmd]


# every damage through compare and accept; one NaN and one inf file through sweep and imatrix
BROKEN_RUNS = [(n, c) for c in ("compare", "accept") for n in BROKEN] + [
    (n, c) for c in ("sweep", "imatrix") for n in ("norm-nan", "layer-inf", "head-nan")
]


@pytest.mark.parametrize("name,cmd", BROKEN_RUNS)
def test_a_file_whose_weights_hold_nan_or_inf_is_refused_naming_the_tensor(files, name, cmd):
    res = run_cli(*_command(cmd, files, files[name]))
    tensor, value, _ = DAMAGE[name]
    assert res.exit_code == 2, res.output
    line = _one_line(res)
    kind = "NaN" if np.isnan(value) else "inf"
    assert f"{name}.gguf: tensor {tensor} holds {kind}" in line and "broken" in line
    assert not files[name].with_suffix(".imatrix").exists()


@pytest.mark.parametrize(
    "cmd,gate,code",
    [("compare", True, 1), ("compare", False, 2), ("accept", True, 1), ("sweep", False, 2), ("imatrix", False, 2)],
)
def test_finite_weights_with_non_finite_activations_name_the_layer(files, cmd, gate, code):
    res = run_cli(*_command(cmd, files, files["overflow"], gate))
    assert res.exit_code == code, res.output
    line = _one_line(res)
    assert "overflow.gguf: non-finite hidden states from the trunk: first in layer 2 (blk.2) at position 0" in line
    assert "its weights are finite" in line and line.startswith("FAIL" if code == 1 else "error:")


def test_the_good_file_passes_the_same_gates(files):
    """The baseline: the same commands on the undamaged file pass (so the damage alone fails them)."""
    for cmd in ("compare", "accept"):
        res = run_cli(*_command(cmd, files, files["f32"]))
        assert res.exit_code == 0, res.output


# ----------------------------------------------------------------------------- mtpq build

RECIPE = """
[model]
name = "demo"
source = "{source}"
output = "dist"
reference_type = "f32"

[gate]
prompts = "builtin"
max_prompts = 1
draft = 1
max_new_tokens = 8
min_rate = 0.0

[[variant]]
name = "Q8_0"
preset = "Q8_0"
"""


def _source_with(folder: Path, tensor: str, value: float) -> Path:
    """A copy of the demo checkpoint with every value of ``tensor`` set to ``value``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(DEMO, folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = folder / index["weight_map"][tensor]
    tensors = load_file(shard)
    tensors[tensor].fill_(value)
    save_file(tensors, shard, metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize(
    "tensor,value,code,words",
    [
        ("model.norm.weight", float("nan"), 2, ["model.norm.weight", "NaN"]),  # refused by the conversion
        (
            "model.layers.2.mlp.shared_experts.down_proj.weight",
            3e38,
            1,
            ["FAIL", "demo-F32.gguf: non-finite hidden states from the trunk: first in layer 2 (blk.2)"],
        ),
    ],
)
def test_build_stops_on_a_source_that_is_not_finite(tmp_path, tensor, value, code, words):
    src = _source_with(tmp_path / "src", tensor, value)
    recipe = tmp_path / "r.toml"
    recipe.write_text(RECIPE.format(source=src))
    res = run_cli("build", recipe)
    assert res.exit_code == code, res.output
    line = res.output.strip().splitlines()[-1]  # after the build's own "reference ..." line
    assert all(w in line for w in words), res.output
    assert not (tmp_path / "dist" / "manifest.json").exists() and not (tmp_path / "dist" / "demo-Q8_0.gguf").exists()


def test_an_activation_that_overflows_the_compute_dtype_is_named_by_position(files, tmp_path):
    """One token's embedding row at 1e5: finite in the f32 file, inf in float16 (max 65504). accept --dtype f16
    stops at that token's position in the prompt; in float32 the same file measures."""
    from mtpq.runtime.speculative import load_model

    prompt = "def add(a, b):\n    return a + b"
    ids = load_model(files["f32"], device="cpu")[1].encode(prompt)
    p = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])  # the first time this token is seen
    bad = damaged_copy(files["f32"], tmp_path / "row.gguf", "token_embd.weight", np.float32(1e5), ids[p])
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"category": "code", "prompt": prompt}) + "\n")
    res = run_cli("accept", bad, "--prompts", prompts, "-n", 4, "--dtype", "f16")
    assert res.exit_code == 1, res.output
    assert _one_line(res) == (
        f"FAIL {bad}: non-finite hidden states from the trunk: first in the token embeddings "
        f"(token_embd) at position {p}; its weights are finite (computed in float16)"
    )
    assert run_cli("accept", bad, "--prompts", prompts, "-n", 4).exit_code == 0


@pytest.mark.llama_cpp
@pytest.mark.parametrize("name", ["norm-nan", "overflow"])
def test_llama_perplexity_on_a_non_finite_file_fails_the_gate(files, llama_cpp_bin, name):
    """The same files through llama.cpp: llama-perplexity prints nan for the quant's statistics, which compare
    names as an engine failure (exit 1 with its gate) instead of reading a number."""
    res = run_cli(
        "compare",
        files["f32"],
        files[name],
        "-f",
        files["text"],
        "-c",
        128,
        "--chunks",
        2,
        "--engine",
        "llama.cpp",
        "--llama-cpp",
        llama_cpp_bin,
        "--max-kld",
        0.05,
        "--threads",
        1,
    )
    assert res.exit_code == 1, res.output
    line = _one_line(res)
    assert line.startswith(f"FAIL {files[name]}: llama-perplexity printed ") and "nan for " in line, line


@pytest.mark.parametrize("defer", [False, True], ids=["checked-at-once", "deferred-as-on-a-gpu"])
def test_a_drafting_round_that_turns_non_finite_stops_with_the_same_line(files, monkeypatch, defer):
    """Greedy rounds test their passes' outputs on the device and read the verdict back with the round's ids (on a
    GPU: no sync of its own); forced here on the CPU, a round whose head turns non-finite after the prefill raises
    what the synchronous check raises, and a finite run equals plain greedy decoding."""
    import torch

    from mtpq.errors import MeasurementError
    from mtpq.runtime import finite
    from mtpq.runtime.speculative import SpeculativeDecoder, load_model, run_plain, run_speculative

    monkeypatch.setattr(finite, "_defers", lambda device: defer)
    model, tok = load_model(files["f32"], device="cpu")
    ids = tok.encode("def add(a, b):\n    return a + b")
    assert run_speculative(model, ids, 24, k=3).tokens == run_plain(model, ids, 24).tokens
    dec = SpeculativeDecoder(model, 3)
    dec.prefill(ids)
    dec.step()
    model.mtp.head_norm = torch.full_like(model.mtp.head_norm, float("nan"))
    with pytest.raises(MeasurementError, match="non-finite .* from the MTP head"):
        dec.step()
