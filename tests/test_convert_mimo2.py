"""MiMo-V2-Flash conversion: every tensor and its values, the MTP blocks from model.mtp.layers, metadata, modes.

Expected names, shapes and metadata are written out by hand (from llama.cpp's
conversion/mimo.py, gguf-py's tensor map and src/models/mimo2.cpp); the
llama_cpp-marked tests compare against llama.cpp's converter and llama-quantize.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

import tiny_mimo2
from familycheck import (add_tensors, assert_refused, assert_same_gguf, convert_with_both, copy_with_config,
                         quantize_with_both, rewrite_tensor)
from ggufcheck import convert, kv_types, read_gguf, source_tensors
from runcli import run_cli

ATTN_FULL = {"attn_q.weight": ((256, 256), "self_attn.q_proj.weight"), "attn_k.weight": ((128, 256), "self_attn.k_proj.weight"),
             "attn_v.weight": ((64, 256), "self_attn.v_proj.weight"),
             "attn_output.weight": ((256, 128), "self_attn.o_proj.weight")}
ATTN_SWA = {"attn_q.weight": ((256, 256), "self_attn.q_proj.weight"), "attn_k.weight": ((64, 256), "self_attn.k_proj.weight"),
            "attn_v.weight": ((32, 256), "self_attn.v_proj.weight"),
            "attn_output.weight": ((256, 128), "self_attn.o_proj.weight"),
            "attn_sinks.weight": ((4,), "self_attn.attention_sink_bias")}
NORMS = {"attn_norm.weight": ((256,), "input_layernorm.weight"), "ffn_norm.weight": ((256,), "post_attention_layernorm.weight")}
DENSE = {"ffn_gate.weight": ((512, 256), "mlp.gate_proj.weight"), "ffn_up.weight": ((512, 256), "mlp.up_proj.weight"),
         "ffn_down.weight": ((256, 512), "mlp.down_proj.weight")}
MOE = {"ffn_gate_inp.weight": ((4, 256), "mlp.gate.weight"), "exp_probs_b.bias": ((4,), "mlp.gate.e_score_correction_bias"),
       "ffn_gate_exps.weight": ((4, 256, 256), "mlp.experts.{e}.gate_proj.weight"),
       "ffn_up_exps.weight": ((4, 256, 256), "mlp.experts.{e}.up_proj.weight"),
       "ffn_down_exps.weight": ((4, 256, 256), "mlp.experts.{e}.down_proj.weight")}
NEXTN = {"nextn.eh_proj.weight": ((256, 512), "eh_proj.weight"), "nextn.enorm.weight": ((256,), "enorm.weight"),
         "nextn.hnorm.weight": ((256,), "hnorm.weight"), "layer_output_norm.weight": ((256,), "final_layernorm.weight")}
BLOCKS = [ATTN_FULL | DENSE, ATTN_SWA | MOE, ATTN_SWA | MOE] + [ATTN_SWA | DENSE | NEXTN] * 3


def expected(vocab: int, blocks=range(6)) -> dict[str, tuple[tuple[int, ...], str]]:
    """GGUF name -> (shape, HF source name; ``{e}`` for stacked experts)."""
    out = {"token_embd.weight": ((vocab, 256), "model.embed_tokens.weight"),
           "output_norm.weight": ((256,), "model.norm.weight"), "output.weight": ((vocab, 256), "lm_head.weight")}
    for bid in blocks:
        prefix = f"model.layers.{bid}." if bid < 3 else f"model.mtp.layers.{bid - 3}."
        for kind, (shape, hf) in (BLOCKS[bid] | NORMS).items():
            out[f"blk.{bid}.{kind}"] = (shape, prefix + hf)
    return out


@pytest.fixture(scope="module")
def mimo_ckpt(tmp_path_factory):
    return tiny_mimo2.mimo2(tmp_path_factory.mktemp("mimo2") / "ckpt")


def _vocab(folder) -> int:
    return json.loads((folder / "config.json").read_text())["vocab_size"]


def test_f32_every_tensor_named_shaped_and_valued(mimo_ckpt, tmp_path):
    _, tensors = convert(mimo_ckpt, tmp_path / "m.gguf", "--outtype", "f32")
    want = expected(_vocab(mimo_ckpt))
    assert {n: tensors[n][1].shape for n in tensors} == {n: s for n, (s, _) in want.items()}
    src = source_tensors(mimo_ckpt)
    for name, (_, hf) in want.items():
        value = torch.stack([src[hf.format(e=e)] for e in range(4)]) if "{e}" in hf else src[hf]
        assert tensors[name][0] == T.F32, name
        np.testing.assert_array_equal(tensors[name][1], value.float().numpy(), err_msg=name)


def test_metadata(mimo_ckpt, tmp_path):
    out = tmp_path / "m.gguf"
    kv, _ = convert(mimo_ckpt, out)
    want = {
        "general.architecture": "mimo2", "mimo2.block_count": 6, "mimo2.nextn_predict_layers": 3,
        "mimo2.context_length": 4096, "mimo2.embedding_length": 256, "mimo2.feed_forward_length": 512,
        "mimo2.attention.head_count": 4, "mimo2.attention.head_count_kv": [2, 1, 1, 1, 1, 1],
        "mimo2.attention.key_length": 64, "mimo2.attention.value_length": 32,
        "mimo2.attention.sliding_window": 16, "mimo2.attention.sliding_window_pattern": [0, 1, 1, 1, 1, 1],
        "mimo2.expert_count": 4, "mimo2.expert_used_count": 2, "mimo2.expert_feed_forward_length": 256,
        "mimo2.expert_group_count": 1, "mimo2.expert_group_used_count": 1, "mimo2.expert_gating_func": 2,
        "mimo2.rope.dimension_count": 21,  # int(64 * 0.334)
    }
    for k, v in want.items():
        assert kv[k] == v, k
    assert kv_types(out)["mimo2.attention.sliding_window_pattern"][-1] == 5  # INT32 elements, as llama.cpp writes
    assert kv["mimo2.rope.freq_base"] == pytest.approx(5e6) and kv["mimo2.rope.freq_base_swa"] == pytest.approx(1e4)
    assert kv["mimo2.attention.value_scale"] == pytest.approx(0.707)
    assert kv["mimo2.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)


def test_no_mtp_and_mtp_only(mimo_ckpt, tmp_path):
    kv, tensors = convert(mimo_ckpt, tmp_path / "trunk.gguf", "--no-mtp")
    assert kv["mimo2.block_count"] == 3 and "mimo2.nextn_predict_layers" not in kv
    assert set(tensors) == set(expected(_vocab(mimo_ckpt), range(3)))
    assert kv["mimo2.attention.sliding_window_pattern"] == [0, 1, 1]
    kv, tensors = convert(mimo_ckpt, tmp_path / "head.gguf", "--mtp-only")
    assert kv["mimo2.block_count"] == 6 and kv["mimo2.nextn_predict_layers"] == 3
    assert set(tensors) == {n for n in expected(_vocab(mimo_ckpt)) if n.startswith(("blk.3.", "blk.4.", "blk.5."))} | {
        "token_embd.weight", "output_norm.weight", "output.weight"}


def test_mtp_layers_counted_from_the_checkpoint(tmp_path):
    """The config does not say how many MTP layers there are: the checkpoint does (no layers: a trunk-only file)."""
    kv, tensors = convert(tiny_mimo2.mimo2(tmp_path / "one", n_mtp=1), tmp_path / "one.gguf")
    assert kv["mimo2.block_count"] == 4 and kv["mimo2.nextn_predict_layers"] == 1
    kv, tensors = convert(tiny_mimo2.mimo2(tmp_path / "none", n_mtp=0), tmp_path / "none.gguf")
    assert kv["mimo2.block_count"] == 3 and "mimo2.nextn_predict_layers" not in kv


def test_unsupported_config_is_refused(tmp_path):
    ck = tiny_mimo2.mimo2(tmp_path / "bad", swa_head_dim=128)
    res = run_cli("convert", ck, tmp_path / "m.gguf", "--quiet")
    assert res.exit_code == 2 and "config.json" in res.stderr and "swa_head_dim" in res.stderr
    assert not (tmp_path / "m.gguf").exists()


def test_mimo_v25_release_format_is_refused_by_name(mimo_ckpt, tmp_path):
    """MiMo-V2.5's release stores one qkv_proj per layer (FP8, rows sharded per tensor-parallel rank) and
    MXFP4 experts: not converted yet, and the refusal says which, instead of "missing q_proj"."""
    ck = copy_with_config(mimo_ckpt, tmp_path / "fused")
    p = "model.layers.0.self_attn."
    rewrite_tensor(ck, p + "q_proj.weight", None)
    add_tensors(ck, {p + "qkv_proj.weight": torch.zeros(8, 8)})
    assert_refused(ck, tmp_path / "a.gguf", p + "qkv_proj.weight", "fused qkv_proj", "not supported yet")
    ck = copy_with_config(mimo_ckpt, tmp_path / "mxfp4", quantization_config={"quant_method": "fp8",
                                                                              "store_dtype": "mxfp4"})
    assert_refused(ck, tmp_path / "b.gguf", "config.json", "MXFP4 experts")


def test_q4_k_m_holds_the_mtp_blocks_at_q8_0(mimo_ckpt, tmp_path):
    f16 = tmp_path / "f16.gguf"
    convert(mimo_ckpt, f16, "--outtype", "f16")
    out = tmp_path / "q.gguf"
    res = run_cli("quantize", f16, out, "Q4_K_M", "--quiet")
    assert res.exit_code == 0, res.output
    _, tensors = read_gguf(out)
    shapes = expected(_vocab(mimo_ckpt))
    for name, (qtype, _) in tensors.items():
        if len(shapes[name][0]) == 1 or "ffn_gate_inp" in name:
            assert qtype == T.F32, name
        elif name.startswith(("blk.3.", "blk.4.", "blk.5.")):
            assert qtype == T.Q8_0, name
    assert tensors["blk.1.ffn_up_exps.weight"][0] == T.Q4_K


@pytest.mark.llama_cpp
@pytest.mark.parametrize("mode", [None, "--no-mtp", "--mtp"])
def test_same_gguf_as_llama_cpp_converter(mimo_ckpt, tmp_path, llama_cpp_src, mode):
    """Names, shapes, types, every metadata key (value and GGUF type) and f32 bytes equal llama.cpp's converter's."""
    out, kv, tensors, ref = convert_with_both(llama_cpp_src, mimo_ckpt, tmp_path, mode, raw_config=True)
    assert_same_gguf(out, kv, tensors, ref)


@pytest.mark.llama_cpp
def test_same_bytes_as_llama_quantize(mimo_ckpt, tmp_path, llama_cpp_bin):
    a, b = quantize_with_both(mimo_ckpt, tmp_path, llama_cpp_bin)
    for name in b:
        assert a[name][0] == b[name][0] and np.array_equal(a[name][1], b[name][1]), name
