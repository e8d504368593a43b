"""Cohere2 MoE (Cohere2MoeForCausalLM) conversion: tensors and values, the MTP block, metadata, modes, quantizing.

The checks it shares with other families are its rows in tests/convert/test_convert_mtp_checks.py.

The expected GGUF names, shapes and metadata are written out here by hand (from
llama.cpp's conversion/command_r.py Cohere2MoeModel, its gguf-py tensor map for
cohere2moe and the loader src/models/cohere2moe.cpp), independently of mtpq's
tables; the llama_cpp-marked tests compare against llama.cpp's own converter
(which keeps the MTP block too), llama-quantize and llama-speculative-simple.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from tests.builders import tiny_cohere2moe
from tests.helpers.familycheck import (
    assert_expected_kv,
    assert_mode_files,
    assert_same_gguf,
    assert_table_f32,
    attn_table,
    checkpoint_fixtures,
    convert_with_both,
    expected_table,
    ffn_table,
    nextn_table,
    rewrite_tensor,
    strip_general,
    top_table,
    vocab,
)
from tests.helpers.ggufcheck import convert, read_gguf
from tests.helpers.runcli import run_cli

N_TRUNK, MTP = 4, 4  # blk.4 is the MTP block
ATTN = {
    "attn_norm.weight": ((256,), "input_layernorm.weight"),
    **attn_table(256, 128),
}
DENSE = ffn_table("mlp.", 512)
MOE = {
    "ffn_gate_inp.weight": ((4, 256), "mlp.gate.weight"),
    **ffn_table("mlp.experts.*.", 256, suffix="_exps", experts=4),
    **ffn_table("mlp.shared_experts.", 256, suffix="_shexp"),
}
NEXTN = nextn_table() | {"nextn.shared_head_norm.weight": ((256,), "shared_head.norm.weight")}
BLOCKS = [ATTN | DENSE, ATTN | MOE, ATTN | MOE, ATTN | MOE, ATTN | MOE | NEXTN]
TOP = top_table(output=None)  # tied: no output.weight


def expected(vocab: int, blocks=range(5)) -> dict[str, tuple[tuple[int, ...], str]]:
    """GGUF name -> (shape, HF source name; ``*`` = the experts, stacked in order)."""
    return expected_table(TOP, BLOCKS, vocab, blocks)


co_ckpt, co_f32 = checkpoint_fixtures("co", tiny_cohere2moe.cohere2moe)


def test_f32_every_tensor_named_shaped_and_valued(co_ckpt, co_f32):
    _, tensors = co_f32
    assert_table_f32(tensors, expected(vocab(co_ckpt)), co_ckpt)


def test_metadata(co_ckpt, co_f32):
    kv, _ = co_f32
    # feed_forward_length: the dense prefix's width (prefix_dense_intermediate_size)
    # attention.sliding_window_pattern: trunk layers only
    assert_expected_kv(kv, "cohere2moe", vocab_size=vocab(co_ckpt))  # tests/convert/expected_kv.json
    assert kv["cohere2moe.logit_scale"] == pytest.approx(0.0625)
    assert kv["cohere2moe.rope.freq_base"] == pytest.approx(50000.0)
    assert kv["cohere2moe.attention.layer_norm_epsilon"] == pytest.approx(1e-5)
    # rms_norm_eps null: llama.cpp then runs LayerNorm (its loader needs one of the two epsilons)
    assert "cohere2moe.attention.layer_norm_rms_epsilon" not in kv


def test_no_mtp_and_mtp_only(co_ckpt, tmp_path):
    # tied embeddings: the head file carries token_embd (its lm_head too) and output_norm
    assert_mode_files(
        co_ckpt, tmp_path, "cohere2moe", 4, expected(vocab(co_ckpt)), top=("token_embd.weight", "output_norm.weight")
    )


def test_zero_biases_dropped_nonzero_refused(tmp_path):
    """attention_bias: llama.cpp's graph has no biases; zero ones are dropped, others refused (exit 2)."""
    ck = tiny_cohere2moe.cohere2moe(tmp_path / "bias", attention_bias=True)
    _, tensors = convert(ck, tmp_path / "m.gguf", "--outtype", "f32")
    assert set(tensors) == set(expected(vocab(ck)))
    shard = rewrite_tensor(ck, "model.layers.2.self_attn.k_proj.bias", torch.full((128,), 0.5))
    res = run_cli("convert", ck, tmp_path / "bad.gguf", "--quiet")
    assert res.exit_code == 2 and "k_proj.bias is not zero" in res.stderr and shard.name in res.stderr
    assert not (tmp_path / "bad.gguf").exists()


def _drop_config_keys(ck, *keys: str, **changes) -> None:
    import json

    path = ck / "config.json"
    cfg = json.loads(path.read_text())
    for k in keys:
        cfg.pop(k)
    path.write_text(json.dumps({**cfg, **changes}, indent=2))


def test_layer_types_derived_where_config_json_omits_them(tmp_path):
    """A config without layer_types (transformers derives them: the dense prefix every
    prefix_dense_sliding_window_pattern-th layer full, the rest every sliding_window_pattern-th) converts with
    that derived pattern, as llama.cpp's converter (which reads the derived view) writes it."""
    ck = tiny_cohere2moe.cohere2moe(tmp_path / "ckpt", num_hidden_layers=6)
    _drop_config_keys(ck, "layer_types", "mlp_layer_types", first_k_dense_replace=1)
    kv, tensors = convert(ck, tmp_path / "m.gguf")
    # layer 0: the dense prefix (pattern 1: full); layers 1-5: sliding, sliding, sliding, full, sliding
    assert kv["cohere2moe.attention.sliding_window_pattern"] == [False, True, True, True, False, True]
    assert kv["cohere2moe.leading_dense_block_count"] == 1 and "blk.0.ffn_gate.weight" in tensors


def test_layer_types_neither_stored_nor_derivable_exits_2(co_ckpt, tmp_path):
    """transformers does not know the model type: config.json is read as stored, and without layer_types
    one clear line names the key (llama.cpp's converter stops with KeyError 'layer_types' there)."""
    ck = shutil.copytree(co_ckpt, tmp_path / "ck")
    _drop_config_keys(ck, "layer_types", model_type="cohere2_moe_unknown")
    res = run_cli("convert", ck, tmp_path / "m.gguf", "--quiet")
    assert res.exit_code == 2 and "missing layer_types" in res.stderr and "config.json" in res.stderr, res.output
    assert not (tmp_path / "m.gguf").exists()


# ----------------------------------------------------------------------------- llama.cpp


@pytest.mark.llama_cpp
@pytest.mark.parametrize(
    "dtype,over",
    [(torch.float32, {}), (torch.bfloat16, {}), (torch.float32, {"attention_bias": True, "rms_norm_eps": 1e-6})],
)
def test_same_gguf_as_llama_cpp_converter(tmp_path, llama_cpp_src, dtype, over):
    """Names, shapes, types, every metadata key and value, and f32 bytes equal llama.cpp's converter's
    (which keeps the MTP block too), from f32 and bf16, and with zero biases + RMSNorm.

    llama.cpp's converter crashes on Cohere's bias check in its default lazy mode ("len() of a
    0-d tensor"), so the bias case runs it with --no-lazy.
    """
    ck = tiny_cohere2moe.cohere2moe(tmp_path / "ckpt", dtype=dtype, **over)
    out, kv, tensors, ref = convert_with_both(
        llama_cpp_src, ck, tmp_path, None, *(["--no-lazy"] if over.get("attention_bias") else [])
    )
    assert_same_gguf(out, kv, tensors, ref)
    assert "blk.4.nextn.eh_proj.weight" in tensors


@pytest.mark.llama_cpp
def test_no_mtp_and_mtp_only_are_parts_of_llama_cpp_conversion(co_ckpt, tmp_path, llama_cpp_src):
    """llama.cpp's converter refuses --no-mtp / --mtp for Cohere2MoeForCausalLM ("not supported"); ours
    gives its full file's trunk (block_count 4, no nextn key) and its MTP block + shared tensors."""
    from tests.helpers.llamacpp_ref import llama_cpp_convert

    full = tmp_path / "full.gguf"
    kv, _ = convert(co_ckpt, full, "--outtype", "f32")
    ref_kv, ref = read_gguf(llama_cpp_convert(llama_cpp_src, co_ckpt, tmp_path / "ref.gguf", kv["tokenizer.ggml.pre"]))
    trunk_kv, trunk = convert(co_ckpt, tmp_path / "trunk.gguf", "--outtype", "f32", "--no-mtp")
    want_kv = {k: v for k, v in strip_general(ref_kv).items() if k != "cohere2moe.nextn_predict_layers"}
    want_kv["cohere2moe.block_count"] = 4
    want_kv["general.size_label"] = trunk_kv["general.size_label"]  # counts the parameters written
    assert strip_general(trunk_kv) == want_kv
    assert set(trunk) == {n for n in ref if not n.startswith("blk.4.")}
    head_kv, head = convert(co_ckpt, tmp_path / "head.gguf", "--outtype", "f32", "--mtp-only")
    assert {k: v for k, v in strip_general(head_kv).items() if k != "general.size_label"} == {
        k: v for k, v in strip_general(ref_kv).items() if k != "general.size_label"
    }
    assert set(head) == {n for n in ref if n.startswith("blk.4.") or n in ("token_embd.weight", "output_norm.weight")}
    for part in (trunk, head):
        for name, (qtype, data) in part.items():
            assert qtype == ref[name][0], name
            np.testing.assert_array_equal(data, ref[name][1], err_msg=name)
