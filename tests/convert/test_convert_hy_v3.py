"""Hy3 (HYV3ForCausalLM) conversion: every tensor and its values, the MTP block, metadata, modes, FP8, quantizing.

The checks it shares with other families are its rows in tests/convert/test_convert_mtp_checks.py.

The expected GGUF names, shapes and metadata are written out here by hand (from
llama.cpp's conversion/hunyuan.py HYV3Model, its gguf-py tensor map for hy_v3 and
the loader src/models/hy-v3.cpp), independently of mtpq's tables; the
llama_cpp-marked tests compare against llama.cpp's own converter (which keeps
Hy3's MTP block too), llama-quantize and llama-speculative-simple.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from tests.builders import tiny, tiny_hy_v3
from tests.helpers.familycheck import (
    LAYER_NORMS,
    assert_expected_kv,
    assert_mode_files,
    assert_same_gguf,
    assert_table_f32,
    attn_table,
    checkpoint_fixtures,
    convert_with_both,
    dequant_block_scaled,
    expected_table,
    ffn_table,
    nextn_table,
    stack_experts,
    top_table,
    vocab,
)
from tests.helpers.ggufcheck import convert, source_tensors

N_TRUNK, MTP = 3, 3  # blk.3 is the MTP block
ATTN = {
    **LAYER_NORMS,
    **attn_table(256, 128),
    "attn_q_norm.weight": ((64,), "self_attn.q_norm.weight"),
    "attn_k_norm.weight": ((64,), "self_attn.k_norm.weight"),
}
DENSE = ffn_table("mlp.", 512)
MOE = {
    "ffn_gate_inp.weight": ((4, 256), "mlp.router.gate.weight"),
    "exp_probs_b": ((4,), "mlp.expert_bias"),  # no .bias suffix: hy-v3.cpp loads tn(FFN_EXP_PROBS_B, i)
    **ffn_table("mlp.experts.*.", 256, suffix="_exps", experts=4),
    **ffn_table("mlp.shared_mlp.", 256, suffix="_shexp"),
}
NEXTN = nextn_table() | {"nextn.shared_head_norm.weight": ((256,), "final_layernorm.weight")}
BLOCKS = [ATTN | DENSE, ATTN | MOE, ATTN | MOE, ATTN | MOE | NEXTN]
TOP = top_table()


def expected(vocab: int, blocks=range(4)) -> dict[str, tuple[tuple[int, ...], str]]:
    """GGUF name -> (shape, HF source name; ``*`` = the experts, stacked in order)."""
    return expected_table(TOP, BLOCKS, vocab, blocks)


hy_ckpt, hy_f32 = checkpoint_fixtures("hy", tiny_hy_v3.hy_v3)


def test_f32_every_tensor_named_shaped_and_valued(hy_ckpt, hy_f32):
    _, tensors = hy_f32
    assert_table_f32(tensors, expected(vocab(hy_ckpt)), hy_ckpt)


def test_metadata(hy_f32):
    kv, _ = hy_f32
    assert_expected_kv(kv, "hy_v3")  # tests/convert/expected_kv.json
    assert kv["hy_v3.rope.freq_base"] == pytest.approx(11158840.0)
    assert kv["hy_v3.expert_weights_scale"] == pytest.approx(2.826)
    assert kv["hy_v3.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    # llama.cpp's converter writes neither for hy_v3 (its loader infers dense/MoE from the tensors present)
    assert "hy_v3.leading_dense_block_count" not in kv and "hy_v3.rope.dimension_count" not in kv


def test_f16_types(hy_ckpt, tmp_path):
    _, tensors = convert(hy_ckpt, tmp_path / "m.gguf", "--outtype", "f16")
    for name, (qtype, data) in tensors.items():
        one_d = data.ndim == 1 or name.endswith("norm.weight")
        assert qtype == (T.F32 if one_d or "ffn_gate_inp" in name else T.F16), name


def test_no_mtp_and_mtp_only(hy_ckpt, tmp_path):
    assert_mode_files(hy_ckpt, tmp_path, "hy_v3", 3, expected(vocab(hy_ckpt)))


def test_fp8_block_scaled_dequantized(hy_ckpt, tmp_path):
    """e4m3 weights with 128x128 weight_scale_inv tiles: GGUF values = the dequantized source, computed here."""
    ck = shutil.copytree(hy_ckpt, tmp_path / "fp8")
    tiny.to_fp8_block_scaled(ck)
    stored = source_tensors(ck)
    dequant = dequant_block_scaled(stored)
    assert stored["model.layers.3.eh_proj.weight"].dtype == torch.float8_e4m3fn
    assert stored["model.layers.3.mlp.experts.2.down_proj.weight"].dtype == torch.float8_e4m3fn
    _, tensors = convert(ck, tmp_path / "m.gguf", "--outtype", "f32")
    for name, (_, hf) in expected(vocab(ck)).items():
        np.testing.assert_array_equal(tensors[name][1], stack_experts(dequant, hf).numpy(), err_msg=name)


@pytest.mark.parametrize(
    "stored,dense",
    [
        ({"first_k_dense_replace": 2}, [0, 1]),
        ({"first_k_dense_replace": None, "mlp_layer_types": None}, [0]),
        ({"mlp_layer_types": ["dense", "dense", "sparse"]}, [0, 1]),
    ],
)
def test_dense_layers_as_config_json_declares_them(tmp_path, stored, dense):
    """The dense layers are config.json's (``mlp_layer_types``, else ``first_k_dense_replace``, which vLLM's hy_v3
    builds them from), else transformers' default (layer 0). transformers' derived ``mlp_layer_types`` ignores a
    stored ``first_k_dense_replace``: read first, it refused a checkpoint whose layer 1 is dense as config.json says."""
    first_k = max(dense) + 1
    ck = tiny_hy_v3.hy_v3(tmp_path / "ckpt", first_k_dense_replace=first_k)
    _edit(ck, stored)
    _, tensors = convert(ck, tmp_path / "m.gguf")
    assert sorted(int(n.split(".")[1]) for n in tensors if n.endswith("ffn_gate.weight")) == dense
    assert {int(n.split(".")[1]) for n in tensors if "ffn_gate_exps" in n} == set(range(len(dense), 4))


def _edit(ck, changes: dict) -> None:
    """config.json with ``changes`` (None: the key removed)."""
    import json

    path = ck / "config.json"
    cfg = json.loads(path.read_text())
    for k, v in changes.items():
        cfg.pop(k, None) if v is None else cfg.__setitem__(k, v)
    path.write_text(json.dumps(cfg, indent=2))


# ----------------------------------------------------------------------------- llama.cpp


@pytest.mark.llama_cpp
@pytest.mark.parametrize(
    "mode,dtype", [(None, torch.float32), ("--no-mtp", torch.float32), ("--mtp", torch.float32), (None, torch.bfloat16)]
)
def test_same_gguf_as_llama_cpp_converter(tmp_path, llama_cpp_src, mode, dtype):
    """Names, shapes, types, every metadata key and value, and f32 bytes equal llama.cpp's converter's
    (which keeps Hy3's MTP block, as ours does), in all three modes and from a bf16 source."""
    ck = tiny_hy_v3.hy_v3(tmp_path / "ckpt", dtype=dtype)
    out, kv, tensors, ref = convert_with_both(llama_cpp_src, ck, tmp_path, mode)
    assert_same_gguf(out, kv, tensors, ref)
    assert any(n.startswith("blk.3.nextn.") for n in tensors) == (mode != "--no-mtp")


@pytest.mark.llama_cpp
def test_two_dense_layers_same_gguf_as_llama_cpp_converter(tmp_path, llama_cpp_src):
    """``first_k_dense_replace: 2`` (layers 0 and 1 dense): llama.cpp's converter maps what is stored; so do we."""
    ck = tiny_hy_v3.hy_v3(tmp_path / "ckpt", first_k_dense_replace=2)
    out, kv, tensors, ref = convert_with_both(llama_cpp_src, ck, tmp_path)
    assert_same_gguf(out, kv, tensors, ref)
    assert "blk.1.ffn_gate.weight" in tensors
