"""DeepSeek-V3 / R1 conversion: MLA as llama.cpp writes it, the MTP block, metadata, modes, FP8.

Expected GGUF names are written out here by hand (from llama.cpp's gguf-py
tensor map for deepseek2); the kv_b_proj split is derived here per head from the
safetensors, and checked against the attention math transformers runs.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.builders import tiny, tiny_deepseek2
from tests.helpers import mla
from tests.helpers.familycheck import (
    assert_drafts_in_llama_cpp,
    assert_expected_kv,
    assert_f16_as_llama_cpp,
    assert_f32_equal,
    assert_mode_files,
    assert_refused,
    assert_values_equal,
    checkpoint_fixtures,
    copy_with_config,
    dequant_block_scaled,
    run,
)
from tests.helpers.ggufcheck import convert, read_gguf, source_tensors
from tests.helpers.llamacpp_ref import llama_cpp_convert

N_TRUNK, MTP = 2, 2  # tiny model: 2 trunk layers, the MTP block is blk.2
CFG = tiny_deepseek2.deepseek_v3_config()
N_HEAD, NOPE, ROPE, V = CFG["num_attention_heads"], CFG["qk_nope_head_dim"], CFG["qk_rope_head_dim"], CFG["v_head_dim"]
KV_LORA = CFG["kv_lora_rank"]


def split_kv_b(kv_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return mla.split_kv_b(kv_b, N_HEAD, NOPE, V)


def expected_gguf(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return mla.expected_mla_gguf(tensors, CFG)


# a tiny DeepSeek-V3 checkpoint in f32 (exact comparisons) with its MTP layer, 2 shards
ds_ckpt, ds_f32 = checkpoint_fixtures("ds", lambda f: tiny_deepseek2.deepseek_v3(f, dtype=torch.float32))


# ----------------------------------------------------------------------------- tensors


def test_f32_every_tensor_equals_source(ds_ckpt, ds_f32):
    kv, tensors = ds_f32
    exp = expected_gguf(source_tensors(ds_ckpt))
    assert_f32_equal(tensors, exp)
    assert not any("attn_kv_b" in n for n in tensors)  # llama.cpp's converter writes only the split k_b / v_b


def test_kv_b_split_matches_mla_attention_math(ds_ckpt, ds_f32):
    """k_b / v_b reproduce what transformers computes from kv_b_proj: k_nope = c·k_b[h], v = v_b[h]·c per head."""
    _, tensors = ds_f32
    src = source_tensors(ds_ckpt)
    c = torch.randn(5, KV_LORA, generator=torch.Generator().manual_seed(3))  # compressed kv (after kv_a_layernorm)
    for bid in range(N_TRUNK + 1):
        kv_b = src[f"model.layers.{bid}.self_attn.kv_b_proj.weight"]
        kv = torch.nn.functional.linear(c, kv_b).view(5, N_HEAD, NOPE + V)
        k_nope, value = torch.split(kv, [NOPE, V], dim=-1)  # as DeepseekV3Attention splits it
        k_b = torch.from_numpy(np.array(tensors[f"blk.{bid}.attn_k_b.weight"][1]))
        v_b = torch.from_numpy(np.array(tensors[f"blk.{bid}.attn_v_b.weight"][1]))
        assert k_b.shape == (N_HEAD, KV_LORA, NOPE) and v_b.shape == (N_HEAD, V, KV_LORA)
        torch.testing.assert_close(torch.einsum("tc,hcn->thn", c, k_b), k_nope)
        torch.testing.assert_close(torch.einsum("hvc,tc->thv", v_b, c), value)


def test_mtp_block_present(ds_f32):
    kv, tensors = ds_f32
    assert kv["deepseek2.nextn_predict_layers"] == 1
    assert kv["deepseek2.block_count"] == N_TRUNK + 1
    nextn = {n for n in tensors if ".nextn." in n}
    assert nextn == {
        f"blk.{MTP}.nextn.{k}.weight"
        for k in ("eh_proj", "enorm", "hnorm", "embed_tokens", "shared_head_head", "shared_head_norm")
    }
    # the MTP block's own MLA attention and MoE, named as in the trunk's MoE layer
    trunk_kinds = {n.split(".", 2)[2] for n in tensors if n.startswith("blk.1.")}
    mtp_kinds = {n.split(".", 2)[2] for n in tensors if n.startswith(f"blk.{MTP}.") and ".nextn." not in n}
    assert mtp_kinds == trunk_kinds and "attn_k_b.weight" in mtp_kinds and "ffn_gate_exps.weight" in mtp_kinds
    assert tensors[f"blk.{MTP}.nextn.eh_proj.weight"][1].shape == (256, 512)


def test_f16_types(ds_ckpt, tmp_path):
    _, tensors = convert(ds_ckpt, tmp_path / "m.gguf", "--outtype", "f16")
    exp = expected_gguf(source_tensors(ds_ckpt))
    assert_f16_as_llama_cpp(tensors, exp)


def test_no_mtp_and_mtp_only(ds_ckpt, ds_f32, tmp_path):
    _, full = ds_f32
    assert_mode_files(ds_ckpt, tmp_path, "deepseek2", N_TRUNK, full, "--outtype", "f32", head_equals=full)


def test_plain_q_proj_and_tied_output(tmp_path):
    """q_lora_rank null (DeepSeek-V2-Lite style attention) writes attn_q; a tied lm_head is not written."""
    ck = tiny_deepseek2.deepseek_v3(tmp_path / "ck", dtype=torch.float32, q_lora_rank=None)
    kv, tensors = convert(ck, tmp_path / "m.gguf", "--outtype", "f32")
    src = source_tensors(ck)
    assert "deepseek2.attention.q_lora_rank" not in kv
    for bid in range(N_TRUNK + 1):
        assert not any(n.startswith(f"blk.{bid}.attn_q_") for n in tensors)
        np.testing.assert_array_equal(
            tensors[f"blk.{bid}.attn_q.weight"][1], src[f"model.layers.{bid}.self_attn.q_proj.weight"].numpy()
        )
        assert tensors[f"blk.{bid}.attn_q.weight"][1].shape == (N_HEAD * (NOPE + ROPE), 256)
    assert "output.weight" in tensors
    cfg = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    _, tensors = convert(ck, tmp_path / "tied.gguf", "--outtype", "f32")
    assert "lm_head.weight" in src and "output.weight" not in tensors  # llama.cpp skips a tied lm_head too


def test_fp8_block_scaled_dequantized(ds_ckpt, tmp_path):
    """DeepSeek-V3 ships e4m3 weights with 128x128 weight_scale_inv tiles; GGUF values = dequantized source."""
    ck = shutil.copytree(ds_ckpt, tmp_path / "fp8")
    reference = source_tensors(ck)
    tiny.to_fp8_block_scaled(ck)
    stored = source_tensors(ck)
    dequant = dequant_block_scaled(stored)
    n_fp8 = sum(q.dtype == torch.float8_e4m3fn for q in stored.values())
    assert n_fp8 > 30 and any(stored[n].shape[0] % 128 for n in stored if n.endswith("kv_a_proj_with_mqa.weight"))
    _, tensors = convert(ck, tmp_path / "m.gguf", "--outtype", "f32")
    exp = expected_gguf(dequant)
    assert_values_equal(tensors, exp)
    # and the FP8 round trip stays close to the original weights
    orig = expected_gguf(reference)
    for name in ("blk.2.attn_k_b.weight", "blk.2.nextn.eh_proj.weight", "blk.1.ffn_down_exps.weight"):
        got = torch.from_numpy(np.array(tensors[name][1]))
        assert (got - orig[name]).abs().max() <= 0.07 * orig[name].abs().max(), name


# ----------------------------------------------------------------------------- metadata


def test_metadata(ds_ckpt, ds_f32):
    kv, _ = ds_f32
    # attention.head_count_kv: MLA runs as MQA over the compressed cache
    assert_expected_kv(kv, "deepseek2")  # tests/convert/expected_kv.json
    approx = {
        "deepseek2.expert_weights_scale": 2.5,
        "deepseek2.rope.freq_base": 10000.0,
        "deepseek2.rope.scaling.factor": 4.0,
        "deepseek2.rope.scaling.yarn_beta_fast": 32.0,
        "deepseek2.rope.scaling.yarn_beta_slow": 1.0,
        "deepseek2.attention.layer_norm_rms_epsilon": 1e-6,
        "deepseek2.rope.scaling.yarn_log_multiplier": 0.1,
    }  # 0.1 * mscale_all_dim, as llama.cpp stores it
    for k, v in approx.items():
        assert kv[k] == pytest.approx(v), k
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ds_ckpt))
    assert len(kv["tokenizer.ggml.tokens"]) == 512
    assert kv["tokenizer.ggml.bos_token_id"] == tok.convert_tokens_to_ids(tiny_deepseek2.BOS)
    assert kv["tokenizer.ggml.eos_token_id"] == tok.convert_tokens_to_ids(tiny_deepseek2.EOS)
    assert kv["tokenizer.chat_template"] == tiny.CHAT_TEMPLATE


def test_config_as_deepseek_ships_it(ds_ckpt, ds_f32, tmp_path):
    """DeepSeek-V3's own config.json: rope_scaling {"type": "yarn"} + top-level rope_theta, no head_dim."""
    cfg = json.loads((ds_ckpt / "config.json").read_text())
    rp = cfg.pop("rope_parameters")
    for k in ("head_dim", "qk_head_dim"):
        cfg.pop(k, None)
    cfg["rope_theta"] = rp.pop("rope_theta")
    rp["type"] = rp.pop("rope_type")
    ck = copy_with_config(ds_ckpt, tmp_path / "ck")
    (ck / "config.json").write_text(json.dumps({**cfg, "rope_scaling": rp}, indent=2))
    kv, _ = convert(ck, tmp_path / "m.gguf", "--outtype", "f32")
    assert kv == ds_f32[0]


def _without_keys(ck: Path, dst: Path, *keys: str) -> Path:
    copy_with_config(ck, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k in keys:
        cfg.pop(k, None)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def test_config_saved_by_transformers_keeps_the_correction_bias(ds_ckpt, ds_f32, tmp_path):
    """transformers' DeepseekV3Config has no topk_method (nor scoring_func), so save_pretrained writes neither,
    while its router always stores e_score_correction_bias: the bias converts as from the release (it was
    refused as "not implied by config.json"), and routing stays sigmoid."""
    ck = _without_keys(ds_ckpt, tmp_path / "ck", "topk_method", "scoring_func")
    kv, tensors = convert(ck, tmp_path / "m.gguf", "--outtype", "f32")
    assert kv == ds_f32[0]
    for name in ("blk.1.exp_probs_b.bias", f"blk.{MTP}.exp_probs_b.bias"):
        np.testing.assert_array_equal(tensors[name][1], ds_f32[1][name][1])


def test_correction_bias_required_where_the_reference_creates_it(ds_ckpt, tmp_path):
    """Without topk_method (transformers) or with "noaux_tc" (DeepSeek's code) every reference creates the
    bias: a router without it is an incomplete checkpoint. With another topk_method DeepSeek's own code
    creates none and transformers' does: both are accepted."""
    from tests.helpers.familycheck import rewrite_tensor

    victim = "model.layers.1.mlp.gate.e_score_correction_bias"
    ck = _without_keys(ds_ckpt, tmp_path / "ck", "topk_method")
    rewrite_tensor(ck, victim, None)
    line = assert_refused(ck, tmp_path / "o.gguf")
    assert victim in line, line
    greedy = copy_with_config(ck, tmp_path / "greedy", topk_method="greedy")
    _, tensors = convert(greedy, tmp_path / "g.gguf", "--outtype", "f32")
    assert "blk.1.exp_probs_b.bias" not in tensors and f"blk.{MTP}.exp_probs_b.bias" in tensors


def test_kv_b_shape_contradicts_config(ds_ckpt, tmp_path):
    ck = copy_with_config(ds_ckpt, tmp_path / "ck", qk_nope_head_dim=32)
    line = assert_refused(ck, tmp_path / "o.gguf")
    assert "kv_b_proj" in line and "config.json" in line and ".safetensors" in line, line


def test_config_without_mla_dims(ds_ckpt, tmp_path):
    ck = copy_with_config(ds_ckpt, tmp_path / "ck", kv_lora_rank=None)
    line = assert_refused(ck, tmp_path / "o.gguf")
    assert "config.json" in line and "kv_lora_rank" in line, line


def test_checkpoint_without_mtp_layer(ds_ckpt, ds_f32, tmp_path):
    """Many published DeepSeek-V3 copies drop layer 61: --no-mtp converts them, the default says why it cannot."""
    from safetensors.torch import load_file, save_file

    ck = copy_with_config(ds_ckpt, tmp_path / "ck")
    index = json.loads((ck / "model.safetensors.index.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        kept = {n: t for n, t in load_file(str(ck / shard)).items() if not n.startswith(f"model.layers.{MTP}.")}
        save_file(kept, str(ck / shard), metadata={"format": "pt"})
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if not n.startswith(f"model.layers.{MTP}.")}
    (ck / "model.safetensors.index.json").write_text(json.dumps(index))
    line = assert_refused(ck, tmp_path / "o.gguf")
    assert f"layer {MTP}" in line and "--no-mtp" in line, line
    kv, tensors = convert(ck, tmp_path / "trunk.gguf", "--no-mtp", "--outtype", "f32")
    _, full = ds_f32
    assert kv["deepseek2.block_count"] == N_TRUNK and "deepseek2.nextn_predict_layers" not in kv
    assert set(tensors) == {n for n in full if not n.startswith(f"blk.{MTP}.")}


# ----------------------------------------------------------------------------- llama.cpp


def _llama_cpp_convert(src: Path, ck: Path, out: Path, outtype: str = "f32"):
    return read_gguf(llama_cpp_convert(src, ck, out, "gpt-2", outtype=outtype))


def _same_tensors(ours: dict, theirs: dict, names: set[str]):
    for name in names:
        (qa, a), (qb, b) = ours[name], theirs[name]
        assert qa == qb and a.shape == b.shape, name
        np.testing.assert_array_equal(a, b, err_msg=name)


# llama.cpp's deepseek2 converter drops the MTP block, so its parameter count (size label) is smaller
_NOT_COMPARED = {"general.size_label"}


def _same_kv(ours: dict, theirs: dict):
    """Same keys and values; tokenizer.ggml.pre only as a key, since the harness above forces llama.cpp's value."""
    assert set(ours) == set(theirs)
    assert {k: v for k, v in ours.items() if k != "tokenizer.ggml.pre"} == {
        k: v for k, v in theirs.items() if k != "tokenizer.ggml.pre"
    }


@pytest.mark.llama_cpp
def test_matches_llama_cpp_converter(ds_ckpt, ds_f32, llama_cpp_src, tmp_path):
    """llama.cpp's DeepseekV2Model (deepseek2) drops the MTP block: everything else is identical."""
    kv, tensors = ds_f32
    ref_kv, ref = _llama_cpp_convert(llama_cpp_src, ds_ckpt, tmp_path / "ref.gguf")
    assert set(ref) == {n for n in tensors if not n.startswith(f"blk.{MTP}.")}
    _same_tensors(tensors, ref, set(ref))
    ours = {
        k: v
        for k, v in kv.items()
        if k not in _NOT_COMPARED | {"deepseek2.nextn_predict_layers", "deepseek2.block_count"}
    }
    theirs = {k: v for k, v in ref_kv.items() if k not in _NOT_COMPARED | {"deepseek2.block_count"}}
    _same_kv(ours, theirs)
    assert ref_kv["deepseek2.block_count"] == N_TRUNK and kv["deepseek2.block_count"] == N_TRUNK + 1


@pytest.mark.llama_cpp
def test_mtp_block_matches_llama_cpp_deepseek32_converter(ds_ckpt, ds_f32, llama_cpp_src, tmp_path):
    """llama.cpp keeps the same MTP block for DeepSeek-V3.2 (arch deepseek32): its names, shapes and values
    for blk.2.* must equal ours (same checkpoint relabelled DeepseekV32ForCausalLM; no indexer tensors)."""
    kv, tensors = ds_f32
    ck = copy_with_config(
        ds_ckpt,
        tmp_path / "ck32",
        architectures=["DeepseekV32ForCausalLM"],
        index_n_heads=4,
        index_head_dim=64,
        index_topk=64,
    )
    ref_kv, ref = _llama_cpp_convert(llama_cpp_src, ck, tmp_path / "ref32.gguf")
    assert set(ref) == set(tensors)
    _same_tensors(tensors, ref, set(ref))
    renamed = {re.sub(r"^deepseek32\.", "deepseek2.", k): v for k, v in ref_kv.items() if ".indexer." not in k}
    renamed["general.architecture"] = "deepseek2"
    _same_kv(kv, renamed)


# --no-repack: on CPUs with AMX, llama.cpp puts f16/q8_0 weights in its AMX buffer, which cannot run MLA's 3-D
# attn_k_b product, and aborts (GGML_ASSERT(*cur_backend_id != -1)) -- with its own converter's GGUF as well.
_LLAMA_FLAGS = ["-c", "256", "-t", "2", "--temp", "0", "--no-repack"]


@pytest.mark.llama_cpp
def test_loads_and_drafts_in_llama_cpp(ds_ckpt, llama_cpp_bin, tmp_path):
    """llama.cpp loads trunk + MTP (it checks every MTP tensor's presence and dims, and aborts otherwise),
    builds the MTP draft context and generates with it -- from one file, and from --no-mtp + --mtp-only files."""
    banner = "creating MTP draft context"
    assert_drafts_in_llama_cpp(
        ds_ckpt, tmp_path, llama_cpp_bin, full=("--outtype", "q8_0"), flags=_LLAMA_FLAGS, banner=banner
    )
    run([llama_cpp_bin / "llama-cli", "-m", tmp_path / "full.gguf", "-p", "hi", "-n", 4, "-st", *_LLAMA_FLAGS])
