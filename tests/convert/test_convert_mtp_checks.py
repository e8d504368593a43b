"""The MTP-block checks that are the same for several families, one table row per family: a checkpoint without
its MTP layer, missing or misshaped tensors, Q4_K_M holding the head at q8_0, ``mtpq inspect``, and (llama_cpp)
llama-quantize's bytes and llama.cpp drafting with the head.

What differs between the families (their tensor tables ``expected``, metadata, configs) stays in each
tests/convert/test_convert_<family>.py; the rows here name the tiny builder, the architecture, the MTP blocks
and take ``expected`` from that file.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from tests.builders import tiny_bailingmoe3, tiny_cohere2moe, tiny_hy_v3, tiny_mimo2, tiny_nemotron_h_moe, tiny_step35
from tests.convert import test_convert_bailingmoe3 as bailingmoe3
from tests.convert import test_convert_cohere2moe as cohere2moe
from tests.convert import test_convert_hy_v3 as hy_v3
from tests.convert import test_convert_mimo2 as mimo2
from tests.convert import test_convert_nemotron_h_moe as nemotron_h_moe
from tests.convert import test_convert_step35 as step35
from tests.helpers.familycheck import (
    assert_bad_tensor_refused,
    assert_converts_only_with_no_mtp,
    assert_drafts_in_llama_cpp,
    assert_fp8_source_same_as_llama_cpp,
    assert_head_at_q8_0,
    assert_same_as_llama_quantize,
    built_once,
    inspect_json,
    quantize_q4_k_m,
    vocab,
)


@dataclass(frozen=True)
class CheckedFamily:
    """One row: a family whose tiny checkpoint the MTP-block checks run on."""

    build: Callable[..., Path]  # the tiny checkpoint: build(folder, with_mtp=...)
    arch: str
    expected: Callable[[int], dict]  # vocab -> {GGUF name: (shape, HF name) or shape}, the family file's table
    trunk: int  # trunk blocks; the MTP blocks follow
    n_mtp: int = 1

    @property
    def head(self) -> tuple[str, ...]:
        """The MTP blocks' GGUF name prefixes."""
        return tuple(f"blk.{b}." for b in range(self.trunk, self.trunk + self.n_mtp))


FAMILIES = {
    "bailingmoe3": CheckedFamily(tiny_bailingmoe3.bailingmoe3, "bailingmoe3", bailingmoe3.expected, 4),
    "cohere2moe": CheckedFamily(tiny_cohere2moe.cohere2moe, "cohere2moe", cohere2moe.expected, 4),
    "hy_v3": CheckedFamily(tiny_hy_v3.hy_v3, "hy_v3", hy_v3.expected, 3),
    "mimo2": CheckedFamily(tiny_mimo2.mimo2, "mimo2", mimo2.expected, 3, n_mtp=3),
    "nemotron_h_moe": CheckedFamily(tiny_nemotron_h_moe.nemotron_h_moe, "nemotron_h_moe", nemotron_h_moe.expected, 4),
    "step35": CheckedFamily(tiny_step35.step35, "step35", step35.expected, 3, n_mtp=2),
}


def families(*names: str):
    """``family`` parametrized over the named rows of FAMILIES."""
    return pytest.mark.parametrize("family", names)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """ckpt(family): the family's tiny checkpoint, built once for this module (the checks only read it)."""
    return built_once(tmp_path_factory, lambda folder, family: FAMILIES[family].build(folder))


def _fam(family: str) -> CheckedFamily:
    return FAMILIES[family]


# ----------------------------------------------------------------------------- a checkpoint without its MTP layer


@pytest.mark.parametrize(
    "family,needle",
    [
        ("bailingmoe3", "layer 4"),
        ("cohere2moe", "layer 4"),
        ("hy_v3", "layer 3"),
        ("nemotron_h_moe", "mtp.layers"),
        ("step35", "no tensors for layer 3"),  # both appended layers dropped
    ],
)
def test_checkpoint_without_mtp_layer(tmp_path, family, needle):
    """Published copies may drop layer N: --no-mtp converts them; without it, one clear line and no file."""
    fam = _fam(family)
    ck = fam.build(tmp_path / "stripped", with_mtp=False)
    assert_converts_only_with_no_mtp(ck, tmp_path, fam.arch, fam.trunk, needle)


# ----------------------------------------------------------------------------- missing or misshaped tensors


BAD_TENSORS = {  # family -> (HF tensor, replaced by (None: removed), what the one line says)
    "bailingmoe3": [
        ("model.layers.4.final_layernorm.weight", None, "missing tensor model.layers.4.final_layernorm.weight"),
        ("model.layers.2.attention.dt_bias", None, "missing tensor model.layers.2.attention.dt_bias"),
        ("model.layers.4.attention.kv_b_proj.weight", torch.zeros(512, 128), "config.json implies [512, 256]"),
        ("model.layers.0.attention.k_conv1d.weight", torch.zeros(256, 1, 3), "config.json implies [256, 1, 4]"),
    ],
    "cohere2moe": [
        ("model.layers.4.hnorm.weight", None, "missing tensor model.layers.4.hnorm.weight"),
        ("model.layers.1.mlp.shared_experts.up_proj.weight", None, "missing tensor model.layers.1.mlp.shared_experts"),
        ("model.layers.4.mlp.experts.3.down_proj.weight", torch.zeros(256, 128), "config.json implies [256, 256]"),
        ("model.layers.0.mlp.gate_proj.weight", torch.zeros(256, 256), "config.json implies [512, 256]"),
    ],
    "hy_v3": [
        ("model.layers.3.final_layernorm.weight", None, "missing tensor model.layers.3.final_layernorm.weight"),
        ("model.layers.2.mlp.expert_bias", None, "missing tensor model.layers.2.mlp.expert_bias"),
        ("model.layers.3.mlp.experts.1.up_proj.weight", torch.zeros(128, 256), "[128, 256]"),
        ("model.layers.1.self_attn.k_norm.weight", torch.zeros(32), "config.json implies [64]"),
    ],
    "nemotron_h_moe": [
        ("mtp.layers.1.final_layernorm.weight", None, "missing tensor mtp.layers.1.final_layernorm.weight"),
        ("backbone.layers.0.mixer.A_log", None, "missing tensor backbone.layers.0.mixer.A_log"),
        ("mtp.layers.1.mixer.experts.2.up_proj.weight", torch.zeros(128, 256), "config.json implies [256, 256]"),
        ("backbone.layers.0.mixer.in_proj.weight", torch.zeros(1280, 256), "config.json implies [1288, 256]"),
    ],
}


@pytest.mark.parametrize(
    "family,name,value,needle",
    [pytest.param(f, *row, id=f"{f}-{row[0]}") for f, rows in BAD_TENSORS.items() for row in rows],
)
def test_missing_or_misshaped_tensor_exits_2(ckpt, tmp_path, family, name, value, needle):
    assert_bad_tensor_refused(shutil.copytree(ckpt(family), tmp_path / "ck"), tmp_path, name, value, needle)


# ----------------------------------------------------------------------------- mtpq quantize / inspect


@pytest.mark.parametrize(
    "family,q4_k",
    [
        ("cohere2moe", ("blk.1.ffn_up_exps.weight", "blk.0.attn_q.weight")),
        ("hy_v3", ("blk.1.ffn_up_exps.weight", "blk.0.attn_q.weight")),
        ("mimo2", ("blk.1.ffn_up_exps.weight",)),
        # dense FFNs after MoE layers: quantizing never fails on the MTP blocks
        ("step35", ("blk.1.ffn_up_exps.weight", "blk.0.attn_q.weight")),
    ],
)
def test_q4_k_m_holds_the_mtp_blocks_at_q8_0(ckpt, tmp_path, family, q4_k):
    """1-D tensors and routers F32, the MTP blocks Q8_0, the trunk tensors ``q4_k`` as the preset says."""
    fam = _fam(family)
    tensors = quantize_q4_k_m(ckpt(family), tmp_path)
    assert_head_at_q8_0(tensors, fam.expected(vocab(ckpt(family))), fam.head)
    assert [tensors[n][0] for n in q4_k] == [T.Q4_K] * len(q4_k)


@families("bailingmoe3", "cohere2moe", "hy_v3", "nemotron_h_moe")
def test_inspect_shows_the_head(ckpt, tmp_path, family):
    fam = _fam(family)
    info = inspect_json(ckpt(family), tmp_path)
    assert info["mtp_blocks"] == [fam.trunk] and info["trunk_blocks"] == fam.trunk and info["nextn_predict_layers"] == 1
    mtp = {t["name"] for t in info["tensors"] if t["mtp"]}
    assert mtp == {n for n in fam.expected(vocab(ckpt(family))) if n.startswith(fam.head)}
    assert {t["role"] for t in info["tensors"] if t["mtp"]} == {"mtp"}


# ----------------------------------------------------------------------------- llama.cpp


@pytest.mark.llama_cpp
@families("cohere2moe", "hy_v3", "nemotron_h_moe")
def test_same_bytes_as_llama_quantize(ckpt, tmp_path, llama_cpp_bin, family):
    """With --mtp-type same every tensor's type and bytes equal llama-quantize's Q4_K_M (head included)."""
    _, b = assert_same_as_llama_quantize(ckpt(family), tmp_path, llama_cpp_bin)
    head = _fam(family).head[0]
    assert b[f"{head}nextn.eh_proj.weight"][0] != T.Q8_0  # llama-quantize crushes the head with the trunk


@pytest.mark.llama_cpp
@families("bailingmoe3", "cohere2moe", "hy_v3", "nemotron_h_moe")
def test_loads_and_drafts_in_llama_cpp(ckpt, tmp_path, llama_cpp_bin, family):
    """llama.cpp loads trunk + MTP block and drafts with it: one file (quantized, head at q8_0), and
    a --no-mtp trunk with a --mtp-only head file."""
    assert_drafts_in_llama_cpp(ckpt(family), tmp_path, llama_cpp_bin)


@pytest.mark.llama_cpp
@pytest.mark.parametrize("family,raw_config", [("cohere2moe", False), ("nemotron_h_moe", False), ("step35", True)])
def test_fp8_source_same_gguf_as_llama_cpp_converter(tmp_path, llama_cpp_src, family, raw_config):
    """An FP8 block-scaled source dequantizes to what llama.cpp's converter writes (raw_config: it reads
    config.json as stored, which transformers rewrites for Step3.5: tests/helpers/llamacpp_ref.py)."""
    ck = _fam(family).build(tmp_path / "ckpt")
    assert_fp8_source_same_as_llama_cpp(llama_cpp_src, ck, tmp_path, raw_config=raw_config)
