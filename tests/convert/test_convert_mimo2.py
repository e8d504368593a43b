"""MiMo-V2-Flash conversion: every tensor and its values, the MTP blocks from model.mtp.layers, metadata, modes.

The checks it shares with other families are its rows in tests/convert/test_convert_mtp_checks.py.

Expected names, shapes and metadata are written out by hand (from llama.cpp's
conversion/mimo.py, gguf-py's tensor map and src/models/mimo2.cpp); the
llama_cpp-marked tests compare against llama.cpp's converter and llama-quantize.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from tests.builders import tiny_mimo2
from tests.helpers.familycheck import (
    LAYER_NORMS,
    add_tensors,
    assert_drafts_in_llama_cpp,
    assert_kv_holds,
    assert_mode_files,
    assert_refused,
    assert_same_as_llama_quantize,
    assert_same_gguf,
    assert_table_f32,
    attn_table,
    convert_with_both,
    copy_with_config,
    ffn_table,
    nextn_table,
    rewrite_tensor,
    run,
    vocab,
)
from tests.helpers.ggufcheck import convert, kv_types, read_gguf, source_tensors
from tests.helpers.llamacpp_ref import speculative_simple
from tests.helpers.runcli import run_cli

ATTN_FULL = attn_table(256, 128, v=64, out_in=128)
ATTN_SWA = attn_table(256, 64, v=32, out_in=128) | {"attn_sinks.weight": ((4,), "self_attn.attention_sink_bias")}
NORMS = LAYER_NORMS
MTP_NORMS = {**NORMS, "ffn_norm.weight": ((256,), "pre_mlp_layernorm.weight")}  # the MTP blocks' name, as released
DENSE = ffn_table("mlp.", 512)
MOE = {
    "ffn_gate_inp.weight": ((4, 256), "mlp.gate.weight"),
    "exp_probs_b.bias": ((4,), "mlp.gate.e_score_correction_bias"),
    **ffn_table("mlp.experts.*.", 256, suffix="_exps", experts=4),
}
NEXTN = nextn_table() | {"layer_output_norm.weight": ((256,), "final_layernorm.weight")}
BLOCKS = [ATTN_FULL | DENSE, ATTN_SWA | MOE, ATTN_SWA | MOE] + [ATTN_SWA | DENSE | NEXTN] * 3


def expected(vocab: int, blocks=range(6)) -> dict[str, tuple[tuple[int, ...], str]]:
    """GGUF name -> (shape, HF source name; ``*`` = the experts, stacked in order)."""
    out = {
        "token_embd.weight": ((vocab, 256), "model.embed_tokens.weight"),
        "output_norm.weight": ((256,), "model.norm.weight"),
        "output.weight": ((vocab, 256), "lm_head.weight"),
    }
    for bid in blocks:
        prefix = f"model.layers.{bid}." if bid < 3 else f"model.mtp.layers.{bid - 3}."
        for kind, (shape, hf) in (BLOCKS[bid] | (NORMS if bid < 3 else MTP_NORMS)).items():
            out[f"blk.{bid}.{kind}"] = (shape, prefix + hf)
    return out


@pytest.fixture(scope="module")
def mimo_ckpt(tmp_path_factory):
    return tiny_mimo2.mimo2(tmp_path_factory.mktemp("mimo2") / "ckpt")


def test_f32_every_tensor_named_shaped_and_valued(mimo_ckpt, tmp_path):
    _, tensors = convert(mimo_ckpt, tmp_path / "m.gguf", "--outtype", "f32")
    assert_table_f32(tensors, expected(vocab(mimo_ckpt)), mimo_ckpt)


def test_metadata(mimo_ckpt, tmp_path):
    out = tmp_path / "m.gguf"
    kv, _ = convert(mimo_ckpt, out)
    want = {
        "general.architecture": "mimo2",
        "mimo2.block_count": 6,
        "mimo2.nextn_predict_layers": 3,
        "mimo2.context_length": 4096,
        "mimo2.embedding_length": 256,
        "mimo2.feed_forward_length": 512,
        "mimo2.attention.head_count": 4,
        "mimo2.attention.head_count_kv": [2, 1, 1, 1, 1, 1],
        "mimo2.attention.key_length": 64,
        "mimo2.attention.value_length": 32,
        "mimo2.attention.sliding_window": 16,
        "mimo2.attention.sliding_window_pattern": [0, 1, 1, 1, 1, 1],
        "mimo2.expert_count": 4,
        "mimo2.expert_used_count": 2,
        "mimo2.expert_feed_forward_length": 256,
        "mimo2.expert_group_count": 1,
        "mimo2.expert_group_used_count": 1,
        "mimo2.expert_gating_func": 2,
        "mimo2.rope.dimension_count": 21,  # int(64 * 0.334)
    }
    assert_kv_holds(kv, want)
    assert kv_types(out)["mimo2.attention.sliding_window_pattern"][-1] == 5  # INT32 elements, as llama.cpp writes
    assert kv["mimo2.rope.freq_base"] == pytest.approx(5e6) and kv["mimo2.rope.freq_base_swa"] == pytest.approx(1e4)
    assert kv["mimo2.attention.value_scale"] == pytest.approx(0.707)
    assert kv["mimo2.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)


def test_no_mtp_and_mtp_only(mimo_ckpt, tmp_path):
    (kv, _), _ = assert_mode_files(mimo_ckpt, tmp_path, "mimo2", 3, expected(vocab(mimo_ckpt)), n_mtp=3)
    assert kv["mimo2.attention.sliding_window_pattern"] == [0, 1, 1]


def test_mtp_layers_counted_from_the_checkpoint(tmp_path):
    """The config does not say how many MTP layers there are: the checkpoint does (no layers: a trunk-only file)."""
    kv, tensors = convert(tiny_mimo2.mimo2(tmp_path / "one", n_mtp=1), tmp_path / "one.gguf")
    assert kv["mimo2.block_count"] == 4 and kv["mimo2.nextn_predict_layers"] == 1
    kv, tensors = convert(tiny_mimo2.mimo2(tmp_path / "none", n_mtp=0), tmp_path / "none.gguf")
    assert kv["mimo2.block_count"] == 3 and "mimo2.nextn_predict_layers" not in kv


def test_mtp_ffn_norm_as_released_or_as_the_trunk_names_it(mimo_ckpt, tmp_path):
    """The MTP blocks' FFN norm is pre_mlp_layernorm as released (vLLM's and SGLang's MTP loaders; the fixture's
    name, converted above); post_attention_layernorm in its place, which llama.cpp's converter maps to ffn_norm
    alike, gives the same file; both at once is refused (which one is the block's?)."""
    _, want = convert(mimo_ckpt, tmp_path / "released.gguf", "--outtype", "f32")
    legacy = copy_with_config(mimo_ckpt, tmp_path / "legacy")
    src = source_tensors(mimo_ckpt)
    for i in range(3):
        p = f"model.mtp.layers.{i}."
        rewrite_tensor(legacy, p + "pre_mlp_layernorm.weight", None)
        add_tensors(legacy, {p + "post_attention_layernorm.weight": src[p + "pre_mlp_layernorm.weight"]})
    _, got = convert(legacy, tmp_path / "legacy.gguf", "--outtype", "f32")
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_array_equal(got[name][1], want[name][1], err_msg=name)
    both = copy_with_config(mimo_ckpt, tmp_path / "both")
    extra = "model.mtp.layers.1.post_attention_layernorm.weight"
    add_tensors(both, {extra: src["model.mtp.layers.1.pre_mlp_layernorm.weight"]})
    assert_refused(both, tmp_path / "both.gguf", extra, "implies no such tensor")


@pytest.mark.parametrize(
    "model_type,arch", [("mimo_v2_flash", "MiMoV2FlashForCausalLM"), ("mimo_v2", "MiMoV2ForCausalLM")]
)
def test_sliding_window_size_alone_is_read_as_transformers_reads_it(mimo_ckpt, tmp_path, model_type, arch):
    """A config with sliding_window_size and no sliding_window: transformers' MiMoV2FlashConfig (the view
    llama.cpp's converter reads) makes it sliding_window = sliding_window_size + 1 (the reference attends to
    that many previous tokens plus the query); the same for MiMo-V2.5's model type, which transformers does
    not know."""
    ck = copy_with_config(
        mimo_ckpt, tmp_path / "ck", model_type=model_type, architectures=[arch], sliding_window_size=16
    )
    cfg = json.loads((ck / "config.json").read_text())
    del cfg["sliding_window"]
    (ck / "config.json").write_text(json.dumps(cfg))
    kv, _ = convert(ck, tmp_path / "m.gguf")
    assert kv["mimo2.attention.sliding_window"] == 17
    del cfg["sliding_window_size"]
    (ck / "config.json").write_text(json.dumps(cfg))
    if model_type == "mimo_v2":  # (transformers gives MiMo-V2-Flash its default window)
        assert_refused(ck, tmp_path / "n.gguf", "config.json", "sliding_window")


def test_qkv_ranks_are_the_kv_heads_where_8_and_4_both_fit(tmp_path):
    """A fused qkv_proj of 8 heads of 64 with 4 KV heads (values 32) has 896 rows: 4 ranks of 224 rows and 8 ranks
    of 112 both need 8 scale rows. The checkpoint is sharded over num_key_value_heads (4) ranks (SGLang's
    get_mimo_v2_fused_qkv_expected_tp_size; vLLM groups the rows per KV head too): read as 8 ranks, rows of one
    rank's Q would land in another's K."""
    heads = dict(num_attention_heads=8, swa_num_attention_heads=8, num_key_value_heads=4, swa_num_key_value_heads=8)
    plain = source_tensors(tiny_mimo2.mimo2(tmp_path / "plain", **heads))
    ck = tiny_mimo2.as_v25_fused_fp8(tiny_mimo2.mimo2(tmp_path / "v25", **heads))
    _, tensors = convert(ck, tmp_path / "v25.gguf", "--outtype", "f32")
    for bid in range(6):
        p = f"model.layers.{bid}." if bid < 3 else f"model.mtp.layers.{bid - 3}."
        want = torch.cat([plain[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]).float()
        got = torch.from_numpy(tensors[f"blk.{bid}.attn_qkv.weight"][1].copy())
        torch.testing.assert_close(got, want, rtol=1 / 8, atol=want.abs().max().item() * 2**-16, msg=str(bid))


def test_unsupported_config_is_refused(tmp_path):
    ck = tiny_mimo2.mimo2(tmp_path / "bad", swa_head_dim=128)
    res = run_cli("convert", ck, tmp_path / "m.gguf", "--quiet")
    assert res.exit_code == 2 and "config.json" in res.stderr and "swa_head_dim" in res.stderr
    assert not (tmp_path / "m.gguf").exists()


def _v25(tmp_path, tp: int = 4):
    """MiMo-V2.5's layout (tp 4) or V2.5-Pro's (tp 8): qkv_proj sharded over num_key_value_heads ranks."""
    return tiny_mimo2.as_v25_fused_fp8(tiny_mimo2.mimo2(tmp_path / "v25", **tiny_mimo2.v25_heads(tp)))


@pytest.mark.parametrize("tp", [4, 8])
def test_mimo_v25_fused_fp8_qkv_is_q_k_v(tmp_path, tp):
    """MiMo-V2.5 (-Pro: 8 ranks): attn_qkv holds q, k and v of the block, in that order, each at the values the
    unfused checkpoint has (within e4m3's rounding; a row from another rank or another projection would be off
    by its whole size); the vision and audio towers are not in the file."""
    plain = source_tensors(tiny_mimo2.mimo2(tmp_path / "plain", **tiny_mimo2.v25_heads(tp)))
    kv, tensors = convert(_v25(tmp_path, tp), tmp_path / "v25.gguf", "--outtype", "f32")
    assert set(tensors) == {
        n
        for n in expected(vocab(tmp_path / "plain"))
        if not n.endswith(("attn_q.weight", "attn_k.weight", "attn_v.weight"))
    } | {f"blk.{b}.attn_qkv.weight" for b in range(6)}
    for bid in range(6):
        p = f"model.layers.{bid}." if bid < 3 else f"model.mtp.layers.{bid - 3}."
        want = torch.cat([plain[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]).float()
        got = torch.from_numpy(tensors[f"blk.{bid}.attn_qkv.weight"][1].copy())
        assert got.shape == want.shape
        # twice e4m3-rounded (the unfused file's tiles, then the ranks'): 1/16 each relative, and the tiles'
        # subnormal steps (max / 448 * 2^-9) absolute
        torch.testing.assert_close(got, want, rtol=1 / 8, atol=want.abs().max().item() * 2**-16, msg=str(bid))
    assert kv["general.architecture"] == "mimo2" and kv["mimo2.block_count"] == 6


def test_mimo_v25_bad_rank_tiles_are_refused(tmp_path):
    ck = _v25(tmp_path)
    p = "model.layers.1.self_attn.qkv_proj.weight"
    rewrite_tensor(ck, p + "_scale_inv", torch.ones(3, 2))  # neither 4 nor 8 ranks' tiles
    assert_refused(ck, tmp_path / "a.gguf", p + "_scale_inv", "tensor-parallel ranks")
    ck = _v25(tmp_path / "stray")  # a fused qkv_proj in a block config.json does not declare: refused, no crash
    stray = "model.layers.9.self_attn.qkv_proj.weight"
    add_tensors(ck, {stray: torch.zeros(448, 256).to(torch.float8_e4m3fn), stray + "_scale_inv": torch.ones(4, 2)})
    assert_refused(ck, tmp_path / "c.gguf", stray)


def _mxfp4(tmp_path):
    return tiny_mimo2.as_mxfp4_experts(_v25(tmp_path))


def test_mxfp4_experts_keep_their_bits(tmp_path):
    """MXFP4 experts are written as ggml MXFP4 whatever the outtype (file type MOSTLY_MXFP4_MOE), and the values
    gguf-py reads from them are the checkpoint's by the OCP definition (E2M1 code x 2^(e - 127)), bit for bit."""
    ck = _mxfp4(tmp_path)
    kv, tensors = convert(ck, tmp_path / "m.gguf", "--outtype", "f16")
    assert kv["general.file_type"] == gguf.LlamaFileType.MOSTLY_MXFP4_MOE
    src = source_tensors(ck)
    for bid, proj in ((1, "gate"), (1, "down"), (2, "up")):
        qtype, data = tensors[f"blk.{bid}.ffn_{proj}_exps.weight"]
        assert qtype == T.MXFP4
        got = gguf.dequantize(data, T.MXFP4)
        for e in range(tiny_mimo2.config(0)["n_routed_experts"]):
            hf = f"model.layers.{bid}.mlp.experts.{e}.{proj}_proj.weight"
            want = tiny_mimo2.mxfp4_values(src[hf], src[hf + "_scale"]).numpy()
            assert np.array_equal(got[e], want), hf
    assert tensors["blk.0.attn_qkv.weight"][0] == T.F16 and tensors["blk.1.ffn_gate_inp.weight"][0] == T.F32


def test_mxfp4_experts_requantize_only_when_asked(tmp_path):
    ck = _mxfp4(tmp_path)
    res = run_cli("convert", ck, tmp_path / "a.gguf", "--quant", "Q4_K_M", "--quiet")
    assert res.exit_code == 2 and "--allow-requantize" in res.stderr and "mxfp4" in res.stderr
    assert not (tmp_path / "a.gguf").exists()
    kv, tensors = convert(ck, tmp_path / "b.gguf", "--quant", "Q4_K_M", "--allow-requantize")
    assert tensors["blk.1.ffn_gate_exps.weight"][0] == T.Q4_K and tensors["blk.3.attn_qkv.weight"][0] == T.Q8_0


def test_bad_mxfp4_layouts_are_refused(tmp_path):
    ck = _mxfp4(tmp_path)
    hf = "model.layers.1.mlp.experts.0.up_proj.weight"
    rewrite_tensor(ck, hf + "_scale", torch.zeros(256, 4, dtype=torch.uint8))  # 8 groups of 32 values per row
    assert_refused(ck, tmp_path / "a.gguf", hf + "_scale", "E8M0")
    ck = copy_with_config(
        _mxfp4(tmp_path / "b"),
        tmp_path / "c",
        quantization_config={
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
            "store_dtype": "mxfp4",
            "mxfp4_block_size": 16,
        },
    )
    assert_refused(ck, tmp_path / "c.gguf", "config.json", "mxfp4_block_size")


@pytest.mark.llama_cpp
@pytest.mark.parametrize("mode", [None, "--no-mtp", "--mtp"])
def test_same_gguf_as_llama_cpp_converter(mimo_ckpt, tmp_path, llama_cpp_src, mode):
    """Names, shapes, types, every metadata key (value and GGUF type) and f32 bytes equal llama.cpp's converter's."""
    out, kv, tensors, ref = convert_with_both(llama_cpp_src, mimo_ckpt, tmp_path, mode, raw_config=True)
    assert_same_gguf(out, kv, tensors, ref)


@pytest.mark.llama_cpp
@pytest.mark.parametrize("tp", [4, 8])
def test_mimo_v25_same_gguf_as_llama_cpp_converter(tmp_path, llama_cpp_src, tp):
    """MiMo-V2.5's fused FP8 qkv_proj sharded over 4 (V2.5) or 8 (V2.5-Pro) ranks: dequantized with each rank's
    tiles and regrouped exactly as llama.cpp's converter does (f32 bytes equal)."""
    out, kv, tensors, ref = convert_with_both(llama_cpp_src, _v25(tmp_path, tp), tmp_path, None, raw_config=True)
    assert_same_gguf(out, kv, tensors, ref)


@pytest.mark.llama_cpp
def test_mimo_v25_same_bytes_as_llama_quantize(tmp_path, llama_cpp_bin):
    a, b = assert_same_as_llama_quantize(_v25(tmp_path), tmp_path, llama_cpp_bin)
    assert a["blk.0.attn_qkv.weight"][0] == b["blk.0.attn_qkv.weight"][0]


@pytest.mark.llama_cpp
@pytest.mark.parametrize("mode", [None, "--no-mtp", "--mtp"])
def test_mxfp4_same_gguf_as_llama_cpp_converter(tmp_path, llama_cpp_src, mode):
    """MXFP4 experts: the same ggml blocks, file type and every other tensor as llama.cpp's converter."""
    out, kv, tensors, ref = convert_with_both(llama_cpp_src, _mxfp4(tmp_path), tmp_path, mode, raw_config=True)
    assert_same_gguf(out, kv, tensors, ref)


@pytest.mark.llama_cpp
def test_mxfp4_requantized_as_llama_quantize_and_drafts(tmp_path, llama_cpp_bin):
    """Q4_K_M from MXFP4 experts (--allow-requantize on both sides): llama-quantize's bytes; the f16 file with
    its MXFP4 experts drafts in llama.cpp."""
    ck = tiny_mimo2.as_mxfp4_experts(
        tiny_mimo2.as_v25_fused_fp8(
            tiny_mimo2.mimo2(tmp_path / "ckpt", partial_rotary_factor=0.5, **tiny_mimo2.v25_heads(4))
        )
    )
    f16 = tmp_path / "f16.gguf"
    convert(ck, f16, "--outtype", "f16")
    run([llama_cpp_bin / "llama-quantize", "--allow-requantize", f16, tmp_path / "ref.gguf", "Q4_K_M", "1"])
    res = run_cli(
        "quantize", f16, tmp_path / "ours.gguf", "Q4_K_M", "--mtp-type", "same", "--allow-requantize", "--quiet"
    )
    assert res.exit_code == 0, res.output
    (_, a), (_, b) = read_gguf(tmp_path / "ours.gguf"), read_gguf(tmp_path / "ref.gguf")
    assert set(a) == set(b) and a["blk.1.ffn_up_exps.weight"][0] == T.Q4_K
    for name in b:
        assert a[name][0] == b[name][0] and np.array_equal(a[name][1], b[name][1]), name
    spec = ("--spec-type", "draft-mtp", "-c", "256", "-t", "1", "--temp", "0", "--no-repack")
    res, stats = speculative_simple(llama_cpp_bin, "-m", f16, *spec, "-p", "def add(a, b):", "-n", 16)
    assert "MTP draft context" in res.stderr and stats["n_drafted"] > 0, res.stderr[-2000:]


@pytest.mark.llama_cpp
def test_mimo_v25_drafts_in_llama_cpp(tmp_path, llama_cpp_bin):
    """llama.cpp's mimo2 MTP graph needs the fused attn_qkv (MiMo-V2-Flash's split q/k/v files load but cannot
    draft: "MIMO2 MTP requires fused attn_qkv"): the V2.5 layout drafts, as one Q4_K_M file and as trunk + head
    file. (A RoPE width of 32: llama.cpp's CPU rope needs an even one, the tiny default 0.334 x 64 is 21.)"""
    ck = tiny_mimo2.as_v25_fused_fp8(
        tiny_mimo2.mimo2(tmp_path / "v25", partial_rotary_factor=0.5, **tiny_mimo2.v25_heads(4))
    )
    assert_drafts_in_llama_cpp(ck, tmp_path, llama_cpp_bin)


@pytest.mark.llama_cpp
def test_same_bytes_as_llama_quantize(mimo_ckpt, tmp_path, llama_cpp_bin):
    assert_same_as_llama_quantize(mimo_ckpt, tmp_path, llama_cpp_bin)
