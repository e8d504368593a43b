"""Qwen3-Next conversion (qwen3next): tensors, MTP head, metadata, modes, FP8, bad input, quantize, llama.cpp.

The expected GGUF names and transforms are written out here by hand, from
llama.cpp's conversion/qwen.py (``Qwen3NextModel``) and gguf-py's tensor map,
independently of the converter. The ``in_proj_qkvz`` split is an explicit list of
source rows: key head k owns the row block [k*B, (k+1)*B) with B = 2*d_k + 2*r*d_v,
laid out q (d_k rows), k (d_k), v (r*d_v), z (r*d_v); ``attn_qkv`` takes every head's
q rows, then every head's k rows, then every head's v rows; ``attn_gate`` every z.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from safetensors.torch import load_file, save_file

from tests.builders import tiny_qwen3next
from tests.helpers.familycheck import (
    Experts,
    assert_expected_kv,
    assert_f32_equal,
    assert_refused,
    assert_same_gguf,
    assert_targets_are_greedy,
    assert_values_equal,
    built_once,
    convert_with_both,
    mtp_draft_steps,
    quantize_q4_k_m,
    quantize_with_both,
    rewrite_tensor,
    to_fp8_dequantized,
    transformers_greedy,
)
from tests.helpers.ggufcheck import convert, read_gguf, source_tensors
from tests.helpers.names import QWEN_GDN_LAYER_NAMES, QWEN_MTP_HEAD_NAMES, QWEN_ZERO_CENTRED, TOP_NAMES
from tests.helpers.runcli import run_cli

VARIANTS = {
    "release": dict(),  # config.json as the release has it, per-expert tensors
    "tf5_fused": dict(release_config=False, fused_experts=True),  # transformers 5's config keys, fused trunk experts
    "release_bf16": dict(dtype=torch.bfloat16),  # the norms' +1 happens in f32, as llama.cpp adds it
}
N = 4  # trunk layers; the MTP block is blk.4
LAYER = {
    **QWEN_GDN_LAYER_NAMES,
    "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
}
HEAD = QWEN_MTP_HEAD_NAMES
TOP = TOP_NAMES
ZERO_CENTRED = QWEN_ZERO_CENTRED


# ----------------------------------------------------------------------------- expected values


def qkvz_rows(cfg: dict) -> tuple[list[int], list[int]]:
    """Source rows of attn_qkv and attn_gate in in_proj_qkvz (see the module docstring)."""
    nk, dk, dv = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    rdv = cfg["linear_num_value_heads"] // nk * dv
    block = 2 * dk + 2 * rdv
    q = [k * block + i for k in range(nk) for i in range(dk)]
    kk = [k * block + dk + i for k in range(nk) for i in range(dk)]
    v = [k * block + 2 * dk + i for k in range(nk) for i in range(rdv)]
    z = [k * block + 2 * dk + rdv + i for k in range(nk) for i in range(rdv)]
    return q + kk + v, z


def expected_gguf(folder: Path, src: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """GGUF name -> float32 values, from the HF tensors by the documented transforms."""
    cfg = tiny_qwen3next.read_config(folder)
    src = source_tensors(folder) if src is None else src
    exp: dict[str, torch.Tensor] = {}
    experts = Experts()
    for name, t in src.items():
        t = t.float()
        if name.endswith("_scale_inv"):
            continue
        if name in TOP or name in HEAD:
            gname = TOP.get(name) or f"blk.{N}.{HEAD[name]}"
            exp[gname] = t + 1 if name.endswith(ZERO_CENTRED) else t
            continue
        m = re.fullmatch(r"(?:model\.layers\.(\d+)|mtp\.layers\.(\d+))\.(.+)", name)
        bid = int(m[1]) if m[1] is not None else N + int(m[2])
        inner = m[3]
        if experts.take(exp, bid, inner, t):
            pass
        elif inner == "linear_attn.in_proj_qkvz.weight":
            qkv, z = qkvz_rows(cfg)
            exp[f"blk.{bid}.attn_qkv.weight"], exp[f"blk.{bid}.attn_gate.weight"] = t[qkv], t[z]
        elif inner == "linear_attn.A_log":
            exp[f"blk.{bid}.ssm_a"] = -torch.exp(t)
        elif inner == "linear_attn.conv1d.weight":
            exp[f"blk.{bid}.ssm_conv1d.weight"] = t[:, 0, :]
        else:
            exp[f"blk.{bid}.{LAYER[inner]}"] = t + 1 if inner.endswith(ZERO_CENTRED) else t
    return {**exp, **experts.stacked()}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Tiny f32 checkpoints by variant name, built once per module."""
    return built_once(
        tmp_path_factory,
        lambda folder, variant: tiny_qwen3next.qwen3next(folder, **{"dtype": torch.float32, **VARIANTS[variant]}),
    )


# ----------------------------------------------------------------------------- tensors and metadata


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_f32_every_tensor_equals_source(ckpt, tmp_path, variant):
    folder = ckpt(variant)
    kv, tensors = convert(folder, tmp_path / "m.gguf", "--outtype", "f32")
    exp = expected_gguf(folder)
    assert_f32_equal(tensors, exp)
    assert tensors["blk.0.attn_qkv.weight"][1].shape == (512, 256) and tensors["blk.0.attn_gate.weight"][1].shape == (
        256,
        256,
    )
    # the MTP block: its nextn tensors AND a full-attention MoE decoder block
    mtp = {n for n in tensors if n.startswith(f"blk.{N}.")}
    for kind in (
        "nextn.eh_proj",
        "nextn.enorm",
        "nextn.hnorm",
        "nextn.shared_head_norm",
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "attn_q_norm",
        "attn_k_norm",
        "ffn_gate_inp",
        "ffn_gate_exps",
        "ffn_up_exps",
        "ffn_down_exps",
        "ffn_gate_shexp",
        "ffn_gate_inp_shexp",
    ):
        assert f"blk.{N}.{kind}.weight" in mtp, kind
    assert not any("ssm" in n for n in mtp)


def test_f16_types(ckpt, tmp_path):
    _, tensors = convert(ckpt("release"), tmp_path / "m.gguf", "--outtype", "f16")
    for name, (qtype, data) in tensors.items():  # as llama.cpp's converter types them
        f32 = data.ndim == 1 or name.endswith(
            ("_norm.weight", "ssm_conv1d.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")
        )
        assert qtype == (T.F32 if f32 else T.F16), name


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_metadata(ckpt, tmp_path, variant):
    kv, _ = convert(ckpt(variant), tmp_path / "m.gguf", "--outtype", "f32")
    a = "qwen3next"
    # attention.recurrent_layers: from full_attention_interval when config.json has no layer_types; the MTP block
    # is full attention
    # rope.dimension_count: head_dim 64 * partial_rotary_factor 0.25
    assert_expected_kv(kv, "qwen3next")  # tests/convert/expected_kv.json
    assert f"{a}.rope.dimension_sections" not in kv  # plain partial RoPE, no MRoPE
    assert kv[f"{a}.rope.freq_base"] == pytest.approx(1e7)
    assert kv[f"{a}.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)


# ----------------------------------------------------------------------------- modes, inspect


def test_no_mtp_mtp_only_and_inspect(ckpt, tmp_path):
    folder = ckpt("release")
    exp = expected_gguf(folder)
    kv, tensors = convert(folder, tmp_path / "trunk.gguf", "--no-mtp")
    assert kv["qwen3next.block_count"] == 4 and "qwen3next.nextn_predict_layers" not in kv
    assert kv["qwen3next.attention.recurrent_layers"] == [True, True, True, False]
    assert set(tensors) == {n for n in exp if not n.startswith(f"blk.{N}.")}

    kv, tensors = convert(folder, tmp_path / "head.gguf", "--mtp-only")
    assert kv["qwen3next.block_count"] == 5 and kv["qwen3next.nextn_predict_layers"] == 1
    assert set(tensors) == {n for n in exp if n.startswith(f"blk.{N}.")} | {
        "token_embd.weight",
        "output_norm.weight",
        "output.weight",
    }
    convert(folder, tmp_path / "full.gguf")
    res = run_cli("inspect", tmp_path / "full.gguf", "--json")
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    assert info["arch"] == "qwen3next" and len(info["mtp_blocks"]) == 1, info.get("mtp_blocks")


def test_extract_and_graft(ckpt, tmp_path):
    """The head cut out of one file and grafted onto a Q4_K_M trunk: per-block recurrent flags gain its entry."""
    full, trunk, head, grafted = (tmp_path / f"{n}.gguf" for n in ("full", "trunk", "head", "grafted"))
    convert(ckpt("release"), full, "--outtype", "f16")
    convert(ckpt("release"), trunk, "--outtype", "f16", "--no-mtp", "--quant", "Q4_K_M")
    assert run_cli("extract-mtp", full, head, "--quiet").exit_code == 0
    res = run_cli("graft", "--mtp-from", head, "--into", trunk, grafted, "--mtp-type", "q8_0", "--quiet")
    assert res.exit_code == 0, res.output
    kv, tensors = read_gguf(grafted)
    assert set(tensors) == set(expected_gguf(ckpt("release")))
    assert kv["qwen3next.block_count"] == 5 and kv["qwen3next.nextn_predict_layers"] == 1
    assert kv["qwen3next.attention.recurrent_layers"] == [True, True, True, False, False]
    assert tensors["blk.4.nextn.eh_proj.weight"][0] == T.Q8_0 and tensors["blk.1.ffn_up_exps.weight"][0] == T.Q4_K


def test_checkpoint_without_mtp_tensors(tmp_path):
    """Copies stripped of the head convert as a trunk; --mtp-only refuses them."""
    folder = tiny_qwen3next.qwen3next(tmp_path / "ck", with_mtp=False)
    kv, _ = convert(folder, tmp_path / "m.gguf")
    assert kv["qwen3next.block_count"] == 4 and "qwen3next.nextn_predict_layers" not in kv
    res = run_cli("convert", folder, tmp_path / "h.gguf", "--quiet", "--mtp-only")
    assert res.exit_code == 2 and "no MTP layers" in res.stderr


# ----------------------------------------------------------------------------- FP8


def test_fp8_block_scaled_dequantized(tmp_path):
    """Qwen3-Next-80B-A3B-*-FP8 stores e4m3 weights with 128x128 weight_scale_inv tiles."""
    folder = tiny_qwen3next.qwen3next(tmp_path / "ck", dtype=torch.float32)
    stored, dequant = to_fp8_dequantized(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    fp8 = {n for n, q in stored.items() if q.dtype == torch.float8_e4m3fn}
    assert {
        "model.layers.0.linear_attn.in_proj_qkvz.weight",
        "mtp.fc.weight",
        "mtp.layers.0.mlp.experts.3.down_proj.weight",
    } <= fp8
    _, tensors = convert(folder, tmp_path / "m.gguf", "--outtype", "f32")
    exp = expected_gguf(folder, dequant)
    assert_values_equal(tensors, exp)


# ----------------------------------------------------------------------------- bad input


def _copy(ckpt, tmp_path: Path, variant: str = "release") -> Path:
    dst = tmp_path / "ck"
    shutil.copytree(ckpt(variant), dst)
    return dst


def _edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "victim",
    [
        "model.layers.1.linear_attn.in_proj_ba.weight",
        "mtp.layers.0.self_attn.q_norm.weight",
        "mtp.layers.0.mlp.experts.2.up_proj.weight",
    ],
)
def test_missing_tensor(ckpt, tmp_path, victim):
    folder = _copy(ckpt, tmp_path)
    rewrite_tensor(folder, victim, None)
    assert_refused(folder, tmp_path / "o.gguf", str(folder), f"missing tensor {victim}")


def test_fused_projection_shape_contradicts_config(ckpt, tmp_path):
    folder = _copy(ckpt, tmp_path)
    victim = "model.layers.1.linear_attn.in_proj_qkvz.weight"  # one head's z rows short: 704 rows, not 768
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = folder / index["weight_map"][victim]
    tensors = load_file(str(shard))
    tensors[victim] = tensors[victim][:704].clone()
    save_file(tensors, str(shard))
    assert_refused(folder, tmp_path / "o.gguf", shard.name, victim, "[704, 256]", "config.json implies [768, 256]")


@pytest.mark.parametrize(
    "change", [dict(mlp_only_layers=[0]), dict(decoder_sparse_step=2), dict(decoder_sparse_step="two")]
)
def test_dense_layers_are_refused(ckpt, tmp_path, change):
    folder = _copy(ckpt, tmp_path)
    _edit_config(folder, **change)
    assert_refused(folder, tmp_path / "o.gguf", "config.json", "mlp_only_layers")


# ----------------------------------------------------------------------------- quantize, accept


def test_q4_k_m_holds_the_mtp_block_at_q8_0(ckpt, tmp_path):
    folder = ckpt("release")
    tensors = quantize_q4_k_m(folder, tmp_path)
    n_mtp = 0
    for name, (qtype, data) in tensors.items():
        if name.startswith(f"blk.{N}.") and qtype != T.F32:
            assert qtype == T.Q8_0, name
            n_mtp += 1
    assert n_mtp >= 10  # eh_proj, attention, router-free FFN: the whole block
    assert tensors["blk.4.ffn_gate_inp.weight"][0] == T.F32  # routers are never quantized
    assert tensors["blk.1.ffn_up_exps.weight"][0] == T.Q4_K and tensors["blk.0.attn_qkv.weight"][0] != T.Q8_0


# ----------------------------------------------------------------------------- llama.cpp


@pytest.mark.llama_cpp
@pytest.mark.parametrize(
    "variant,mode",
    [("release", None), ("tf5_fused", None), ("release_bf16", None), ("release", "--no-mtp"), ("release", "--mtp")],
)
def test_same_gguf_as_llama_cpp_converter(ckpt, tmp_path, llama_cpp_src, variant, mode):
    """Names, shapes, types, metadata keys, values and value types, and f32 bytes equal llama.cpp's converter's
    (which keeps the MTP block for qwen3next)."""
    folder = ckpt(variant)
    out, kv, tensors, ref = convert_with_both(llama_cpp_src, folder, tmp_path, mode)
    assert_same_gguf(out, kv, tensors, ref)


@pytest.mark.llama_cpp
def test_llama_cpp_drafts_with_the_head_and_agrees_with_transformers(ckpt, tmp_path, llama_cpp_bin):
    """llama.cpp loads trunk + MTP block, drafts with the head (draft-mtp), and its greedy tokens equal
    transformers' Qwen3NextForCausalLM on the same checkpoint (so the qkvz split, norms and ssm_a are right)."""
    folder = ckpt("release")
    gguf_path = tmp_path / "m.gguf"
    convert(folder, gguf_path, "--outtype", "f32")
    prompt, n = "def add(a, b):", 10
    steps = mtp_draft_steps(llama_cpp_bin, gguf_path, prompt, n, "-t", "1", "-c", "256")
    want = transformers_greedy("Qwen3NextForCausalLM", folder, prompt, n + 4)
    assert_targets_are_greedy([(accepted, target) for accepted, _, target in steps], want)


@pytest.mark.llama_cpp
def test_same_types_and_bytes_as_llama_quantize(ckpt, tmp_path, llama_cpp_bin):
    """With --mtp-type same, Q4_K_M equals llama-quantize tensor for tensor (types and bytes), MTP block included."""
    a, b = quantize_with_both(ckpt("release"), tmp_path, llama_cpp_bin)
    for name in b:
        # llama-quantize rewrites the [1, n_embd] shared-expert gate as 1-D (ggml's n_dims drops the 1); mtpq keeps
        # the converter's 2-D shape: the same values, which llama.cpp's loader accepts either way
        assert a[name][0] == b[name][0] and np.array_equal(a[name][1].squeeze(), b[name][1].squeeze()), name
