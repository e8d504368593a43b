"""Step3.5 Flash conversion: every tensor and its values, the appended MTP blocks, metadata, modes, quantizing.

The checks it shares with other families are its rows in tests/convert/test_convert_mtp_checks.py.

The expected GGUF names, shapes and metadata are written out here by hand (from
llama.cpp's conversion/step3.py, gguf-py's tensor map and the loader
src/models/step35.cpp), independently of mtpq's tables; the llama_cpp-marked
tests compare against llama.cpp's own converter and llama-quantize.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from tests.builders import tiny_step35
from tests.helpers.familycheck import (
    LAYER_NORMS,
    add_tensors,
    assert_kv_holds,
    assert_mode_files,
    assert_refused,
    assert_same_as_llama_quantize,
    assert_same_gguf,
    assert_table_f32,
    attn_table,
    convert_with_both,
    copy_with_config,
    expected_table,
    ffn_table,
    mtp_drafting_log,
    nextn_table,
    strip_general,
    top_table,
    vocab,
)
from tests.helpers.ggufcheck import convert, read_gguf
from tests.helpers.runcli import run_cli

FULL = attn_table(256, 128) | {"attn_gate.weight": ((4, 256), "self_attn.g_proj.weight")}
SLIDING = attn_table(512, 128) | {"attn_gate.weight": ((8, 256), "self_attn.g_proj.weight")}
NORMS = {
    **LAYER_NORMS,
    "attn_q_norm.weight": ((64,), "self_attn.q_norm.weight"),
    "attn_k_norm.weight": ((64,), "self_attn.k_norm.weight"),
}
DENSE = ffn_table("mlp.", 512)
MOE = {
    "ffn_gate_inp.weight": ((4, 256), "moe.gate.weight"),
    "exp_probs_b.bias": ((4,), "moe.router_bias"),
    **ffn_table("moe.", 256, suffix="_exps", experts=4),
    **ffn_table("share_expert.", 256, suffix="_shexp"),
}
NEXTN = nextn_table() | {
    "nextn.shared_head_norm.weight": ((256,), "transformer.shared_head.norm.weight"),
    "nextn.shared_head_head.weight": (("V", 256), "transformer.shared_head.output.weight"),
}
BLOCKS = [FULL | DENSE, SLIDING | MOE, FULL | MOE, SLIDING | DENSE | NEXTN, SLIDING | DENSE | NEXTN]
TOP = top_table()


def expected(vocab: int, blocks=range(5)) -> dict[str, tuple[tuple[int, ...], str]]:
    """GGUF name -> (shape, HF source name)."""
    return expected_table(TOP, [block | NORMS for block in BLOCKS], vocab, blocks)


@pytest.fixture(scope="module")
def step_ckpt(tmp_path_factory):
    return tiny_step35.step35(tmp_path_factory.mktemp("step35") / "ckpt")


def test_f32_every_tensor_named_shaped_and_valued(step_ckpt, tmp_path):
    kv, tensors = convert(step_ckpt, tmp_path / "m.gguf", "--outtype", "f32")
    # zero-centred norms: 1 + w
    assert_table_f32(
        tensors,
        expected(vocab(step_ckpt)),
        step_ckpt,
        lambda src, name, hf: src[hf].float() + (1.0 if hf.endswith("norm.weight") else 0.0),
    )


def test_metadata(step_ckpt, tmp_path):
    kv, _ = convert(step_ckpt, tmp_path / "m.gguf")
    want = {
        "general.architecture": "step35",
        "step35.block_count": 5,
        "step35.nextn_predict_layers": 2,
        "step35.context_length": 4096,
        "step35.embedding_length": 256,
        "step35.feed_forward_length": 512,
        "step35.attention.head_count": [4, 8, 4, 8, 8],
        "step35.attention.head_count_kv": [2, 2, 2, 2, 2],
        "step35.attention.key_length": 64,
        "step35.attention.value_length": 64,
        "step35.attention.sliding_window": 16,
        "step35.attention.sliding_window_pattern": [False, True, False, True, True],
        "step35.expert_count": 4,
        "step35.expert_used_count": 2,
        "step35.expert_feed_forward_length": 256,
        "step35.expert_shared_feed_forward_length": 256,
        "step35.expert_weights_norm": True,
        "step35.expert_gating_func": 2,
        "step35.leading_dense_block_count": 1,
        "step35.moe_every_n_layers": 1,
        "step35.swiglu_clamp_exp": [0.0, 7.0, 7.0, 0.0, 0.0],  # MTP blocks: no clamp
        "step35.swiglu_clamp_shexp": [0.0, 16.0, 16.0, 0.0, 0.0],
        "general.file_type": 1,
    }
    assert_kv_holds(kv, want)
    assert kv["step35.rope.freq_base"] == pytest.approx(1e6)
    assert kv["step35.rope.freq_base_swa"] == pytest.approx(1e4)
    assert kv["step35.expert_weights_scale"] == pytest.approx(3.0)
    assert kv["step35.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert "step35.rope.dimension_count" not in kv  # llama.cpp's converter does not write it for step35


def test_no_mtp_and_mtp_only(step_ckpt, tmp_path):
    (kv, _), _ = assert_mode_files(step_ckpt, tmp_path, "step35", 3, expected(vocab(step_ckpt)), n_mtp=2)
    assert kv["step35.attention.head_count"] == [4, 8, 4] and kv["step35.swiglu_clamp_exp"] == [0.0, 7.0, 7.0]


@pytest.mark.parametrize("nested", [True, False], ids=["text_config", "flat_config"])
def test_step37_layout_converts_as_its_text_model(step_ckpt, tmp_path, nested):
    """Step3.7 Flash (Step3p7ForConditionalGeneration): hparams under text_config, a vision tower beside the
    text tensors. The GGUF is the text model's, tensor for tensor and key for key (the tower is llama.cpp's
    mmproj file's, not this one's); a tensor that is neither text nor tower is still refused."""
    want_kv, want = convert(step_ckpt, tmp_path / "s35.gguf", "--outtype", "f32")
    ck = tiny_step35.as_step37(copy_with_config(step_ckpt, tmp_path / "s37"), nested=nested)
    kv, tensors = convert(ck, tmp_path / "s37.gguf", "--outtype", "f32")
    assert strip_general(kv) == strip_general(want_kv)
    assert set(tensors) == set(want)
    for name, (qtype, data) in tensors.items():
        assert qtype == want[name][0] and np.array_equal(data, want[name][1]), name
    add_tensors(ck, {"model.stray_adapter.weight": torch.zeros(4, 4)})
    assert_refused(ck, tmp_path / "bad.gguf", "not recognised", "model.stray_adapter.weight")


def test_bad_rotary_factors_are_refused(tmp_path):
    ck = tiny_step35.step35(tmp_path / "bad", partial_rotary_factors=[0.5] * 5)
    res = run_cli("convert", ck, tmp_path / "m.gguf", "--quiet")
    assert res.exit_code == 2 and "config.json" in res.stderr and "partial_rotary_factors" in res.stderr
    assert not (tmp_path / "m.gguf").exists()


# The releases' RoPE: Llama-3 scaling on the full-attention layers only, per-layer bases (tiny_step35: 1e6 full,
# 1e4 sliding).
LLAMA3 = tiny_step35.RELEASE_ROPE_SCALING


def llama3_factors(base: float, head_dim: int, rotary_share: float, factor=2.0, old_ctx=131072, low=1.0, high=32.0):
    """Llama-3 frequency factors (transformers' _compute_llama3_parameters, as a ratio inv_freq / scaled), over
    the rotary dims of the full-attention layers, padded with 1.0 to head_dim / 2 (llama.cpp's layout)."""
    rot = int(head_dim * rotary_share)
    inv_freq = 1.0 / base ** (np.arange(0, rot, 2) / rot)
    wavelen = 2 * np.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = np.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    mid = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    scaled = np.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    return np.concatenate([inv_freq / scaled, np.ones(head_dim // 2 - len(inv_freq))])


@pytest.fixture(scope="module")
def llama3_ckpt(tmp_path_factory):
    return tiny_step35.step35(tmp_path_factory.mktemp("step35-llama3") / "ckpt", **LLAMA3)


@pytest.mark.parametrize("mode", [None, "--no-mtp", "--mtp-only"])
def test_llama3_rope_scaling_writes_rope_freqs(llama3_ckpt, tmp_path, mode):
    """Every Step release was refused ("llama3 RoPE scaling is not supported"); llama.cpp converts it into one
    F32 ``rope_freqs.weight`` [head_dim / 2] (no scaling keys): factors from the full-attention base (rope_theta[0],
    not the sliding layers' 1e4) over the full layers' rotary dims (0.5 x 64), the rest 1.0. Every mode writes it."""
    kv, tensors = convert(llama3_ckpt, tmp_path / "m.gguf", "--outtype", "bf16", *([mode] if mode else []))
    qtype, data = tensors["rope_freqs.weight"]
    assert qtype == T.F32 and data.shape == (32,)
    want = llama3_factors(1e6, 64, 0.5)
    np.testing.assert_allclose(data, want, rtol=1e-6)
    assert set(np.round(data[:16], 4)) - {1.0, 2.0} and (data[16:] == 1.0).all()  # all three Llama-3 regimes
    assert not np.allclose(data, llama3_factors(1e4, 64, 0.5))  # not the sliding base
    assert not any(k.startswith("step35.rope.scaling") for k in kv)
    assert kv["step35.rope.freq_base"] == pytest.approx(1e6) and kv["step35.rope.freq_base_swa"] == pytest.approx(1e4)


def test_llama3_rope_scaling_without_full_attention_layers_is_refused(tmp_path):
    """llama.cpp's factors need a full-attention layer's rotary share; without one its converter stops too."""
    ck = tiny_step35.step35(
        tmp_path / "ck", **LLAMA3, layer_types=["sliding_attention"] * 5, partial_rotary_factors=[1.0] * 5
    )
    assert_refused(ck, tmp_path / "m.gguf", "config.json", "full-attention")


def test_llama3_rope_freqs_survive_quantize_and_extract(llama3_ckpt, tmp_path):
    """Q4_K_M with the head at q8_0 keeps rope_freqs F32 (1-D); the head-only file keeps it, as llama.cpp's
    --mtp export does (its graph reads it from the file whatever the blocks)."""
    f16, q, head = (tmp_path / f"{n}.gguf" for n in ("f16", "q", "head"))
    convert(llama3_ckpt, f16, "--outtype", "f16")
    assert run_cli("quantize", f16, q, "Q4_K_M", "--mtp-type", "q8_0", "--quiet").exit_code == 0
    _, tensors = read_gguf(q)
    assert tensors["rope_freqs.weight"][0] == T.F32 and tensors["blk.3.nextn.eh_proj.weight"][0] == T.Q8_0
    assert run_cli("extract-mtp", q, head, "--quiet").exit_code == 0
    _, head_tensors = read_gguf(head)
    np.testing.assert_array_equal(head_tensors["rope_freqs.weight"][1], tensors["rope_freqs.weight"][1])


@pytest.mark.llama_cpp
@pytest.mark.parametrize(
    "mode,dtype", [(None, torch.float32), ("--no-mtp", torch.float32), ("--mtp", torch.float32), (None, torch.bfloat16)]
)
def test_same_gguf_as_llama_cpp_converter(tmp_path, llama_cpp_src, mode, dtype):
    """Names, shapes, types, every metadata key and value, and f32 bytes equal llama.cpp's converter's.

    Its Step3.5 code reads config.json as stored (see llamacpp_ref); the bf16 source checks that
    the +1 of the zero-centred norms happens where llama.cpp does it (in f32).
    """
    ck = tiny_step35.step35(tmp_path / "ckpt", dtype=dtype)
    out, kv, tensors, ref = convert_with_both(llama_cpp_src, ck, tmp_path, mode, raw_config=True)
    assert_same_gguf(out, kv, tensors, ref)


@pytest.mark.llama_cpp
@pytest.mark.parametrize("mode", [None, "--no-mtp", "--mtp"])
def test_llama3_rope_freqs_same_as_llama_cpp_converter(llama3_ckpt, tmp_path, llama_cpp_src, mode):
    """rope_freqs.weight byte for byte (and everything else) as llama.cpp's converter writes it, in every mode."""
    out, kv, tensors, ref = convert_with_both(llama_cpp_src, llama3_ckpt, tmp_path, mode, raw_config=True)
    assert "rope_freqs.weight" in tensors
    assert_same_gguf(out, kv, tensors, ref)


@pytest.mark.llama_cpp
def test_step37_same_gguf_as_llama_cpp_converter(tmp_path, llama_cpp_src):
    ck = tiny_step35.as_step37(tiny_step35.step35(tmp_path / "ckpt"))
    out, kv, tensors, ref = convert_with_both(llama_cpp_src, ck, tmp_path, None, raw_config=True)
    assert_same_gguf(out, kv, tensors, ref)


@pytest.mark.llama_cpp
def test_same_bytes_as_llama_quantize_and_drafts(step_ckpt, tmp_path, llama_cpp_bin):
    assert_same_as_llama_quantize(step_ckpt, tmp_path, llama_cpp_bin)
    f16 = tmp_path / "f16.gguf"  # the f16 file both quantized
    # llama.cpp builds its MTP draft context from the appended blocks
    mtp_drafting_log(llama_cpp_bin, f16, "def add", 8, "--no-repack", "-t", "1")


def test_inspect_extract_and_graft(step_ckpt, tmp_path):
    full, trunk, head, grafted = (tmp_path / f"{n}.gguf" for n in ("full", "trunk", "head", "grafted"))
    convert(step_ckpt, full, "--outtype", "f16")
    convert(step_ckpt, trunk, "--outtype", "f16", "--no-mtp", "--quant", "Q4_K_M")
    res = run_cli("inspect", full, "--json")
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    assert len(info["mtp_blocks"]) == 2
    assert run_cli("extract-mtp", full, head, "--quiet").exit_code == 0
    res = run_cli("graft", "--mtp-from", head, "--into", trunk, grafted, "--mtp-type", "q8_0", "--quiet")
    assert res.exit_code == 0, res.output
    kv, tensors = read_gguf(grafted)
    assert set(tensors) == set(expected(vocab(step_ckpt)))
    assert kv["step35.block_count"] == 5 and kv["step35.nextn_predict_layers"] == 2
    assert kv["step35.attention.head_count"] == [4, 8, 4, 8, 8]  # per-block arrays gain the donor's MTP entries
    assert tensors["blk.3.nextn.eh_proj.weight"][0] == T.Q8_0 and tensors["blk.1.ffn_up_exps.weight"][0] == T.Q4_K
