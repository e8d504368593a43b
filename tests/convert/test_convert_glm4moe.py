"""GLM-4.5 conversion: every tensor, the MTP head, metadata, modes, FP8, bad input.

The expected GGUF names are written out here by hand (from llama.cpp's
gguf-py tensor map for glm4moe), independently of mtpq's use of TensorNameMap.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.builders import tiny
from tests.helpers.familycheck import (
    assert_f16_as_llama_cpp,
    assert_f32_equal,
    assert_kv_holds,
    assert_mode_files,
    assert_same_gguf,
    convert_with_both,
    mtp_drafting_log,
)
from tests.helpers.ggufcheck import convert, source_tensors
from tests.helpers.names import FFN_MOE_NEXTN_NAMES, TOP_NAMES
from tests.helpers.runcli import run_cli

LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    **FFN_MOE_NEXTN_NAMES,
}


def gguf_name_of(hf_name: str) -> tuple[str, int | None]:
    """GGUF name of an HF tensor, and the expert index for per-expert tensors (stacked in GGUF)."""
    if hf_name in TOP_NAMES:
        return TOP_NAMES[hf_name], None
    parts = hf_name.split(".")
    bid, rest = int(parts[2]), ".".join(parts[3:])
    if rest.startswith("mlp.experts."):
        return f"blk.{bid}.ffn_{parts[6].split('_')[0]}_exps.weight", int(parts[5])
    return f"blk.{bid}.{LAYER_NAMES[rest]}", None


def expected_gguf(folder: Path) -> dict[str, torch.Tensor]:
    """GGUF name -> float32 values, derived from the HF tensors by the documented transforms."""
    exp: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in source_tensors(folder).items():
        gname, expert = gguf_name_of(name)
        if expert is None:
            exp[gname] = t.float()
        else:
            experts.setdefault(gname, {})[expert] = t.float()
    for gname, d in experts.items():
        exp[gname] = torch.stack([d[e] for e in sorted(d)])
    return exp


def test_f32_every_tensor_equals_source(glm_ckpt, tmp_path):
    kv, tensors = convert(glm_ckpt, tmp_path / "m.gguf", "--outtype", "f32")
    exp = expected_gguf(glm_ckpt)
    assert_f32_equal(tensors, exp)
    # the MTP block is the layer after the trunk, with its nextn tensors and its own MoE block
    n = kv["glm4moe.block_count"] - kv["glm4moe.nextn_predict_layers"]
    assert n == 2 and kv["glm4moe.nextn_predict_layers"] == 1
    for kind in (
        "nextn.eh_proj",
        "nextn.enorm",
        "nextn.hnorm",
        "nextn.embed_tokens",
        "nextn.shared_head_head",
        "nextn.shared_head_norm",
        "attn_q",
        "ffn_gate_exps",
        "ffn_down_shexp",
        "ffn_gate_inp",
    ):
        assert f"blk.2.{kind}.weight" in tensors, kind
    assert tensors["blk.2.nextn.eh_proj.weight"][1].shape == (256, 512)


def test_metadata_matches_llama_cpp_keys(glm_ckpt, tmp_path):
    kv, _ = convert(glm_ckpt, tmp_path / "m.gguf")
    cfg = json.loads((glm_ckpt / "config.json").read_text())
    want = {
        "general.architecture": "glm4moe",
        "glm4moe.block_count": 3,
        "glm4moe.nextn_predict_layers": 1,
        "glm4moe.context_length": cfg["max_position_embeddings"],
        "glm4moe.embedding_length": 256,
        "glm4moe.feed_forward_length": 512,
        "glm4moe.attention.head_count": 4,
        "glm4moe.attention.head_count_kv": 2,
        "glm4moe.attention.key_length": 64,
        "glm4moe.attention.value_length": 64,
        "glm4moe.rope.dimension_count": 32,
        "glm4moe.expert_count": 4,
        "glm4moe.expert_used_count": 2,
        "glm4moe.expert_shared_count": 1,
        "glm4moe.expert_feed_forward_length": 256,
        "glm4moe.leading_dense_block_count": 1,
        "glm4moe.expert_gating_func": 2,
        "glm4moe.expert_weights_norm": True,
        "glm4moe.expert_group_count": 1,
        "glm4moe.expert_group_used_count": 1,
        "tokenizer.ggml.model": "gpt2",
        "general.file_type": 1,
    }
    assert_kv_holds(kv, want)
    assert kv["glm4moe.expert_weights_scale"] == pytest.approx(1.5)
    assert kv["glm4moe.rope.freq_base"] == pytest.approx(10000.0)
    assert kv["glm4moe.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    # vocab: one token per id up to vocab_size, merges, GLM's special ids, chat template
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(glm_ckpt))
    tokens = kv["tokenizer.ggml.tokens"]
    assert len(tokens) == cfg["vocab_size"]
    for text, i in tok.get_vocab().items():
        assert tokens[i] == text
    assert tokens[len(tok)] == f"[PAD{len(tok)}]"
    assert len(kv["tokenizer.ggml.merges"]) > 0
    assert kv["tokenizer.ggml.bos_token_id"] == tok.convert_tokens_to_ids("[gMASK]")
    assert kv["tokenizer.ggml.eot_token_id"] == tok.convert_tokens_to_ids("<|user|>")
    assert kv["tokenizer.chat_template"] == tiny.CHAT_TEMPLATE


def test_f16_types(glm_ckpt, tmp_path):
    _, tensors = convert(glm_ckpt, tmp_path / "m.gguf", "--outtype", "f16")
    exp = expected_gguf(glm_ckpt)
    assert_f16_as_llama_cpp(tensors, exp)


def test_no_mtp_and_mtp_only(glm_ckpt, tmp_path):
    assert_mode_files(glm_ckpt, tmp_path, "glm4moe", 2, expected_gguf(glm_ckpt))


def test_glm46_head_without_embed_and_head(tmp_path):
    ck = tiny.glm4moe(tmp_path / "glm46", glm46=True)
    _, tensors = convert(ck, tmp_path / "m.gguf")
    assert "blk.2.nextn.eh_proj.weight" in tensors
    assert "blk.2.nextn.embed_tokens.weight" not in tensors
    assert "blk.2.nextn.shared_head_head.weight" not in tensors


@pytest.mark.parametrize("style", ["block", "channel"])
def test_fp8_dequantized_on_the_fly(tmp_path, style):
    ck = tiny.glm4moe(tmp_path / "fp8", dtype=torch.float32)
    reference = source_tensors(ck)
    (tiny.to_fp8_block_scaled if style == "block" else tiny.to_fp8_per_channel)(ck)
    stored = source_tensors(ck)
    _, tensors = convert(ck, tmp_path / "m.gguf", "--outtype", "f32")
    checked = 0
    for name, q in stored.items():
        if q.dtype != torch.float8_e4m3fn:
            continue
        w = q.float()
        if style == "block":  # independent dequant: loop over 128x128 tiles
            s = stored[name + "_scale_inv"]
            want = torch.empty_like(w)
            for i in range(s.shape[0]):
                for j in range(s.shape[1]):
                    want[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (
                        w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] * s[i, j]
                    )
        else:
            want = w * stored[name + "_scale"].float()
        gname, expert = gguf_name_of(name)
        got = tensors[gname][1] if expert is None else tensors[gname][1][expert]
        np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=0, err_msg=name)
        # and the FP8 round trip stays close to the original weights
        assert (torch.from_numpy(np.array(got)) - reference[name]).abs().max() <= 0.07 * reference[name].abs().max()
        checked += 1
    assert checked > 20


def test_reproducible_bytes(glm_ckpt, tmp_path):
    convert(glm_ckpt, tmp_path / "a.gguf", "--outtype", "q8_0")
    convert(glm_ckpt, tmp_path / "b.gguf", "--outtype", "q8_0")
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()


# ----------------------------------------------------------------------------- bad input


def _bad(ck: Path, out: Path, needle: str):
    before = {p.name: p.read_bytes() for p in ck.iterdir() if p.is_file()}
    res = run_cli("convert", ck, out, "--quiet")
    assert res.exit_code == 2, res.output
    line = res.stderr.strip()
    assert "\n" not in line and needle in line, line
    assert not out.exists() or out.name in before
    assert not list(out.parent.glob(f".{out.name}.partial-*"))
    assert {p.name: p.read_bytes() for p in ck.iterdir() if p.is_file()} == before  # nothing lost
    return line


@pytest.fixture
def ck_copy(glm_ckpt, tmp_path) -> Path:
    dst = tmp_path / "ck"
    shutil.copytree(glm_ckpt, dst)
    return dst


def test_missing_shard(ck_copy, tmp_path):
    shard = sorted(ck_copy.glob("*.safetensors"))[1]
    shard.unlink()
    line = _bad(ck_copy, tmp_path / "o.gguf", shard.name)
    assert "index" in line


def test_truncated_shard(ck_copy, tmp_path):
    shard = sorted(ck_copy.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    assert "truncated" in _bad(ck_copy, tmp_path / "o.gguf", shard.name)


def test_corrupt_header(ck_copy, tmp_path):
    shard = sorted(ck_copy.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[8:20] = b"#not-json!!#"
    shard.write_bytes(bytes(data))
    assert "corrupt" in _bad(ck_copy, tmp_path / "o.gguf", shard.name)


def test_shape_contradicts_config(ck_copy, tmp_path):
    cfg = json.loads((ck_copy / "config.json").read_text())
    cfg["vocab_size"] = 600
    (ck_copy / "config.json").write_text(json.dumps(cfg))
    assert "config.json" in _bad(ck_copy, tmp_path / "o.gguf", "model.embed_tokens.weight")


def test_unknown_architecture(ck_copy, tmp_path):
    cfg = json.loads((ck_copy / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (ck_copy / "config.json").write_text(json.dumps(cfg))
    assert "FancyNewForCausalLM" in _bad(ck_copy, tmp_path / "o.gguf", "config.json")


def test_output_equal_to_input(ck_copy):
    shard = sorted(ck_copy.glob("*.safetensors"))[0]
    assert "is an input" in _bad(ck_copy, shard, shard.name)


def test_failed_write_leaves_nothing(ck_copy, tmp_path, monkeypatch):
    """A failure in the middle of writing (here: a NaN in one tensor) leaves no file under either name."""
    from mtpq.convert import checkpoint

    real = checkpoint.HFCheckpoint.load

    def poisoned(self, name):
        t = real(self, name)
        return t * float("nan") if name.endswith("layers.1.self_attn.o_proj.weight") else t

    monkeypatch.setattr(checkpoint.HFCheckpoint, "load", poisoned)
    out = tmp_path / "o.gguf"
    res = run_cli("convert", ck_copy, out, "--quiet", "--outtype", "q8_0")
    assert res.exit_code == 2, res.output
    assert "o_proj" in res.stderr or "attn_output" in res.stderr
    assert not out.exists() and not list(tmp_path.glob(".o.gguf.partial-*"))


# ----------------------------------------------------------------------------- parity with llama.cpp


@pytest.mark.llama_cpp
@pytest.mark.parametrize("mode", [None, "--no-mtp", "--mtp"])
def test_same_gguf_as_llama_cpp_converter(glm_ckpt, tmp_path, llama_cpp_src, mode):
    """Names, shapes, types, metadata keys and values, and f32 bytes equal llama.cpp's own converter's."""
    out, kv, tensors, ref = convert_with_both(llama_cpp_src, glm_ckpt, tmp_path, mode)
    # other general.* keys are provenance (name, basename) that llama.cpp reads from folder names and model cards
    assert_same_gguf(out, kv, tensors, ref, value_types=False)


@pytest.mark.llama_cpp
def test_llama_cpp_loads_and_drafts(glm_ckpt, tmp_path, llama_cpp_bin):
    out = tmp_path / "m.gguf"
    convert(glm_ckpt, out, "--outtype", "f16")
    mtp_drafting_log(llama_cpp_bin, out, "def add", 16, "--no-repack")
