"""A GGUF's big tensors are quantized slab by slab (whole experts, bands of rows), read with pread rather than
through a mapping of the file: the same bytes as encoding each tensor at once, for every kind of source and
target -- k-quants, legacy quants, i-quants with an imatrix (per-expert rows), floats, requantized sources --
while memory stays near one tensor (measured at scale in test_scale.py). A float tensor is read by the kernels'
threads where the file stores it (mtpq.ggml.engine.Stored): the whole run below takes that path, the slab run
reads rows into arrays, and both give the same bytes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

import mtpq.gguf_io.buffers as buffers
from tests.helpers.runcli import run_cli


@pytest.fixture(scope="module")
def inputs(glm_ckpt, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("slabs")
    full, q8, text, im = root / "full.gguf", root / "q8.gguf", root / "text.txt", root / "im.gguf"
    assert run_cli("convert", glm_ckpt, full, "--quiet").exit_code == 0
    assert run_cli("quantize", full, q8, "Q8_0", "--mtp-type", "same", "-q").exit_code == 0
    text.write_text("def add(a, b):\n    return a + b\n\n" * 40)
    assert run_cli("imatrix", full, "--text", text, "-o", im, "-c", "32", "--chunks", "2").exit_code == 0
    return {"full": full, "q8": q8, "im": im}


RUNS = {  # (input, preset, extra options)
    "Q5_0": ("full", "Q5_0", ()),
    "IQ4_XS-imatrix": ("full", "IQ4_XS", ("--imatrix", "im")),
    "Q4_K_M-imatrix-head-too": ("full", "Q4_K_M", ("--imatrix", "im", "--mtp-type", "same")),
    "BF16": ("full", "BF16", ()),
    "requantized-Q8_0-to-Q3_K_M": ("q8", "Q3_K_M", ("--allow-requantize",)),
}


@pytest.mark.parametrize("run", sorted(RUNS))
def test_slabs_give_the_whole_tensors_bytes(run, inputs, tmp_path, monkeypatch):
    src, preset, extra = RUNS[run]
    extra = [str(inputs[x]) if x in inputs else x for x in extra]
    whole, slabs = tmp_path / "whole.gguf", tmp_path / "slabs.gguf"
    assert run_cli("quantize", inputs[src], whole, preset, "-q", *extra).exit_code == 0
    calls = []
    real = buffers._encode_slabs
    monkeypatch.setattr(buffers, "SLAB_ELEMENTS", 20000)  # the tiny model's matrices: 2-7 slabs, stacks: 1 expert
    monkeypatch.setattr(buffers, "_encode_slabs", lambda spec, q: calls.append(spec.name) or real(spec, q))
    # not read where the file stores it: a float tensor then goes by slabs too, as arrays
    encode = buffers.encode_tensor
    monkeypatch.setattr(buffers, "encode_tensor", lambda spec: encode(replace(spec, stored_at=None)))
    assert run_cli("quantize", inputs[src], slabs, preset, "-q", *extra).exit_code == 0
    assert any("_exps" in n for n in calls) and len(calls) > 15  # expert stacks and matrices went by slabs
    assert slabs.read_bytes() == whole.read_bytes()


@pytest.mark.parametrize("target", ["F32", "Q8_0"])
def test_a_plans_new_values_are_written_not_the_stored_ones(target, inputs, tmp_path):
    """A spec given other values (with_values) is written from them: the file's own readers (its bytes, its rows,
    its offset for the kernels' threads) would write the old values instead -- they once did, and the tests'
    edited models were silently their unedited sources."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFReader

    from mtpq.gguf_io import plan_from_gguf, write_plan

    plan = plan_from_gguf(inputs["full"])
    name = "blk.0.attn_output.weight"
    plan.tensors = [
        s.with_values(lambda s=s: torch.zeros(s.shape)).with_type(T[target], "test") if s.name == name else s
        for s in plan.tensors
    ]
    out = tmp_path / "edited.gguf"
    write_plan(plan, out)
    written = {t.name: t for t in GGUFReader(out).tensors}
    assert not np.asarray(written[name].data).any()  # all zeros, in either type
    assert np.asarray(
        written["blk.0.ffn_norm.weight" if "blk.0.ffn_norm.weight" in written else "output_norm.weight"].data
    ).any()  # the others kept
