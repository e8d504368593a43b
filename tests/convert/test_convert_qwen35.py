"""Qwen3.5 / Qwen3.6 conversion (qwen35, qwen35moe): tensors, MTP head, metadata, modes, FP8, llama.cpp.

The expected GGUF names and transforms are written out here by hand, from
llama.cpp's conversion/qwen.py and gguf-py tensor map, independently of the
converter: the V-head reorder is an explicit index permutation (new value head
j takes old head (j % n_k) * r + j // n_k, so that ggml's tiled broadcast pairs
it with key head j % n_k, as HF's repeat_interleave paired old head h with key
head h // r).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T
from safetensors.torch import load_file, save_file

from tests.builders import tiny, tiny_qwen35
from tests.helpers.familycheck import (
    Experts,
    assert_f32_equal,
    assert_kv_holds,
    assert_refused,
    assert_same_gguf,
    assert_targets_are_greedy,
    assert_values_equal,
    built_once,
    convert_with_both,
    to_fp8_dequantized,
    transformers_greedy,
)
from tests.helpers.ggufcheck import convert, read_gguf, source_tensors
from tests.helpers.llamacpp_ref import speculative_simple
from tests.helpers.names import QWEN_GDN_LAYER_NAMES, QWEN_MTP_HEAD_NAMES, QWEN_ZERO_CENTRED, TOP_NAMES
from tests.helpers.runcli import run_cli

VARIANTS = {
    "dense": dict(),  # Qwen3_5ForCausalLM, model.layers.*
    "moe_cg": dict(moe=True, conditional=True),  # Qwen3_5MoeForConditionalGeneration, per-expert tensors + vision tower
    "moe_fused": dict(moe=True, fused_experts=True, mtp_fused_experts=False),  # fused trunk experts
    "dense_cg_tied": dict(conditional=True, tie_word_embeddings=True),  # no lm_head
}
LAYER = {
    **QWEN_GDN_LAYER_NAMES,
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
HEAD = QWEN_MTP_HEAD_NAMES
TOP = TOP_NAMES
ZERO_CENTRED = QWEN_ZERO_CENTRED


# ----------------------------------------------------------------------------- expected values


def tiled_rows(cfg: dict, head_dim: int) -> torch.Tensor:
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    r = nv // nk
    old_heads = [(j % nk) * r + j // nk for j in range(nv)]
    return torch.tensor([h * head_dim + i for h in old_heads for i in range(head_dim)])


def expected_values(inner: str, t: torch.Tensor, cfg: dict) -> torch.Tensor:
    """The documented transform of one tensor inside a layer (name relative to the layer)."""
    t = t.float()
    qk = 2 * cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    dv = cfg["linear_value_head_dim"]
    if inner.endswith(ZERO_CENTRED):
        return t + 1
    if inner == "linear_attn.A_log":
        return -torch.exp(t[tiled_rows(cfg, 1)])
    if inner in ("linear_attn.dt_bias", "linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight"):
        return t[tiled_rows(cfg, 1)]
    if inner == "linear_attn.in_proj_z.weight":
        return t[tiled_rows(cfg, dv)]
    if inner == "linear_attn.in_proj_qkv.weight":
        return torch.cat([t[:qk], t[qk:][tiled_rows(cfg, dv)]])
    if inner == "linear_attn.conv1d.weight":
        c = t[:, 0, :]
        return torch.cat([c[:qk], c[qk:][tiled_rows(cfg, dv)]])
    if inner == "linear_attn.out_proj.weight":
        return t[:, tiled_rows(cfg, dv)]
    return t


def expected_gguf(folder: Path, src: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """GGUF name -> float32 values, from the HF tensors by the documented transforms."""
    cfg = tiny_qwen35.read_config(folder)
    n = cfg["num_hidden_layers"]
    src = source_tensors(folder) if src is None else src
    exp: dict[str, torch.Tensor] = {}
    experts = Experts()
    for name, t in src.items():
        if name.startswith("model.visual.") or name.endswith("_scale_inv"):
            continue
        short = name.replace("model.language_model.", "model.")
        if short in TOP:
            exp[TOP[short]] = t.float() + 1 if short == "model.norm.weight" else t.float()
            continue
        if short in HEAD:
            exp[f"blk.{n}.{HEAD[short]}"] = expected_values(short, t, cfg)
            continue
        m = re.fullmatch(r"(?:model\.layers\.(\d+)|mtp\.layers\.(\d+))\.(.+)", short)
        bid = int(m[1]) if m[1] is not None else n + int(m[2])
        if not experts.take(exp, bid, m[3], t.float()):
            exp[f"blk.{bid}.{LAYER[m[3]]}"] = expected_values(m[3], t, cfg)
    return {**exp, **experts.stacked()}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Tiny f32 checkpoints by variant name, built once per module."""
    return built_once(
        tmp_path_factory, lambda folder, variant: tiny_qwen35.qwen35(folder, dtype=torch.float32, **VARIANTS[variant])
    )


# ----------------------------------------------------------------------------- tensors


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_f32_every_tensor_equals_source(ckpt, tmp_path, variant):
    folder = ckpt(variant)
    kv, tensors = convert(folder, tmp_path / "m.gguf", "--outtype", "f32")
    exp = expected_gguf(folder)
    assert_f32_equal(tensors, exp)
    arch = kv["general.architecture"]
    assert arch == ("qwen35moe" if "moe" in variant else "qwen35")
    assert kv[f"{arch}.block_count"] == 5 and kv[f"{arch}.nextn_predict_layers"] == 1
    # the MTP block is block 4: its nextn tensors AND a full-attention decoder block
    mtp = {n for n in tensors if n.startswith("blk.4.")}
    for kind in (
        "nextn.eh_proj",
        "nextn.enorm",
        "nextn.hnorm",
        "nextn.shared_head_norm",
        "attn_norm",
        "post_attention_norm",
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "attn_q_norm",
        "attn_k_norm",
    ):
        assert f"blk.4.{kind}.weight" in mtp, kind
    ffn = (
        ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_shexp", "ffn_gate_inp_shexp")
        if "moe" in variant
        else ("ffn_gate", "ffn_up", "ffn_down")
    )
    assert all(f"blk.4.{k}.weight" in mtp for k in ffn)
    assert not any("ssm" in n for n in mtp)
    assert tensors["blk.4.nextn.eh_proj.weight"][1].shape == (256, 512)  # [n_embd out, 2*n_embd in]
    assert ("output.weight" in tensors) == (variant != "dense_cg_tied")


def test_plan_roles_and_types(ckpt):
    from mtpq.convert import plan_checkpoint
    from mtpq.tensors import Role

    plan = plan_checkpoint(ckpt("moe_cg"), outtype=T.F16)
    by_name = {s.name: s for s in plan.tensors}
    assert plan.n_trunk_layers == 4 and plan.n_mtp_layers == 1
    assert {s.role for s in plan.tensors if s.name.startswith("blk.4.")} == {Role.MTP}
    assert by_name["blk.0.ssm_out.weight"].role == Role.SSM
    assert by_name["blk.0.ffn_up_exps.weight"].role == Role.FFN_EXPS
    for s in plan.tensors:  # as llama.cpp's converter types them
        f32 = len(s.shape) == 1 or s.name.endswith(
            ("_norm.weight", "ssm_a", ".bias", "ssm_conv1d.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")
        )
        assert s.ggml_type == (T.F32 if f32 else T.F16), s.name


# ----------------------------------------------------------------------------- metadata


@pytest.mark.parametrize("variant", ["dense", "moe_cg"])
def test_metadata(ckpt, tmp_path, variant):
    folder = ckpt(variant)
    kv, _ = convert(folder, tmp_path / "m.gguf")
    a = kv["general.architecture"]
    want = {
        f"{a}.block_count": 5,
        f"{a}.nextn_predict_layers": 1,
        f"{a}.context_length": 1024,
        f"{a}.embedding_length": 256,
        f"{a}.attention.head_count": 4,
        f"{a}.attention.head_count_kv": 2,
        f"{a}.attention.key_length": 64,
        f"{a}.attention.value_length": 64,
        f"{a}.ssm.conv_kernel": 4,
        f"{a}.ssm.state_size": 64,
        f"{a}.ssm.group_count": 2,
        f"{a}.ssm.time_step_rank": 4,
        f"{a}.ssm.inner_size": 256,
        f"{a}.full_attention_interval": 4,
        f"{a}.attention.recurrent_layers": [True, True, True, False, False],  # the MTP block is full attention
        f"{a}.rope.dimension_count": 16,
        f"{a}.rope.dimension_sections": [3, 3, 2, 0],
        "tokenizer.ggml.model": "gpt2",
        "general.file_type": 1,
        "tokenizer.chat_template": tiny.CHAT_TEMPLATE,
    }
    if a == "qwen35moe":
        want.update(
            {
                f"{a}.expert_count": 4,
                f"{a}.expert_used_count": 2,
                f"{a}.expert_feed_forward_length": 256,
                f"{a}.expert_shared_feed_forward_length": 256,
            }
        )
        assert f"{a}.feed_forward_length" not in kv
    else:
        want[f"{a}.feed_forward_length"] = 512
    assert_kv_holds(kv, want)
    assert kv["tokenizer.ggml.pre"]  # the name is vocab.py's business (tests/convert/test_convert_glm4moe.py)
    assert kv[f"{a}.rope.freq_base"] == pytest.approx(1e7)
    assert kv[f"{a}.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    tokens = kv["tokenizer.ggml.tokens"]
    assert len(tokens) == 512 and all(tokens[i] == t for t, i in tok.get_vocab().items())
    assert kv["tokenizer.ggml.eos_token_id"] == tok.convert_tokens_to_ids("<|endoftext|>")


def test_default_mrope_sections_when_absent(ckpt, tmp_path):
    folder = tmp_path / "ck"
    shutil.copytree(ckpt("dense"), folder)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["rope_parameters"]["mrope_section"]
    (folder / "config.json").write_text(json.dumps(cfg))
    kv, _ = convert(folder, tmp_path / "m.gguf")
    assert kv["qwen35.rope.dimension_sections"] == [11, 11, 10, 0]  # llama.cpp's converter default


# ----------------------------------------------------------------------------- modes


def test_no_mtp_and_mtp_only(ckpt, tmp_path):
    from mtpq.convert import BlockSelection, plan_checkpoint
    from mtpq.gguf_io import write_plan

    folder = ckpt("moe_cg")
    exp = expected_gguf(folder)
    write_plan(plan_checkpoint(folder, mtp=BlockSelection.DROP), tmp_path / "trunk.gguf")
    kv, tensors = read_gguf(tmp_path / "trunk.gguf")
    assert kv["qwen35moe.block_count"] == 4 and "qwen35moe.nextn_predict_layers" not in kv
    assert kv["qwen35moe.attention.recurrent_layers"] == [True, True, True, False]
    assert set(tensors) == {n for n in exp if not n.startswith("blk.4.")}

    kv, tensors = convert(folder, tmp_path / "head.gguf", "--mtp-only")
    assert kv["qwen35moe.block_count"] == 5 and kv["qwen35moe.nextn_predict_layers"] == 1
    assert set(tensors) == {n for n in exp if n.startswith("blk.4.")} | {
        "token_embd.weight",
        "output_norm.weight",
        "output.weight",
    }


def test_checkpoint_without_mtp_tensors(tmp_path):
    """A checkpoint whose MTP tensors were stripped converts as a trunk; --mtp-only refuses it."""
    folder = tiny_qwen35.qwen35(tmp_path / "ck", with_mtp=False)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = 1  # what the config of the unstripped model said
    (folder / "config.json").write_text(json.dumps(cfg))
    kv, tensors = convert(folder, tmp_path / "m.gguf")
    assert kv["qwen35.block_count"] == 4 and "qwen35.nextn_predict_layers" not in kv
    res = run_cli("convert", folder, tmp_path / "h.gguf", "--quiet", "--mtp-only")
    assert res.exit_code == 2 and "no MTP layers" in res.stderr


# ----------------------------------------------------------------------------- FP8


def test_fp8_block_scaled_dequantized(tmp_path):
    folder = tiny_qwen35.qwen35(tmp_path / "ck", moe=True, dtype=torch.float32)
    stored, dequant = to_fp8_dequantized(folder)
    n_fp8 = sum(q.dtype == torch.float8_e4m3fn for q in stored.values())
    assert n_fp8 > 40 and any(k.endswith("in_proj_qkv.weight_scale_inv") for k in stored)
    _, tensors = convert(folder, tmp_path / "m.gguf", "--outtype", "f32")
    exp = expected_gguf(folder, dequant)
    assert_values_equal(tensors, exp)


# ----------------------------------------------------------------------------- bad input


def _copy(ckpt, variant: str, tmp_path: Path) -> Path:
    dst = tmp_path / "ck"
    shutil.copytree(ckpt(variant), dst)
    return dst


def _edit_text_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    (cfg.get("text_config") or cfg).update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_mtp_layer_count_contradicts_config(ckpt, tmp_path):
    folder = _copy(ckpt, "moe_cg", tmp_path)
    _edit_text_config(folder, mtp_num_hidden_layers=2)
    assert_refused(folder, tmp_path / "o.gguf", "config.json", "mtp_num_hidden_layers")


def test_linear_attention_shape_contradicts_config(ckpt, tmp_path):
    folder = _copy(ckpt, "dense", tmp_path)
    _edit_text_config(folder, linear_num_value_heads=8)
    assert_refused(folder, tmp_path / "o.gguf", "linear_attn", "config.json")


def test_missing_expert(ckpt, tmp_path):
    folder = _copy(ckpt, "moe_cg", tmp_path)
    victim = "mtp.layers.0.mlp.experts.3.up_proj.weight"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = folder / index["weight_map"].pop(victim)
    tensors = load_file(str(shard))
    del tensors[victim]
    save_file(tensors, str(shard))
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_refused(folder, tmp_path / "o.gguf", "missing tensor mtp.layers.0.mlp.experts.3.up_proj.weight")


# ----------------------------------------------------------------------------- llama.cpp


# Runs llama.cpp's own converter with its own gguf-py. Its pre-tokenizer lookup refuses the tiny
# tokenizer's unknown fingerprint, so it is told the name mtpq chose (argv[2]).
@pytest.mark.llama_cpp
@pytest.mark.parametrize(
    "variant,mode",
    [
        ("dense", None),
        ("moe_cg", None),
        ("moe_fused", None),
        ("dense_cg_tied", None),
        ("moe_cg", "--no-mtp"),
        ("moe_cg", "--mtp"),
    ],
)
def test_same_gguf_as_llama_cpp_converter(ckpt, tmp_path, llama_cpp_src, variant, mode):
    """Names, shapes, types, metadata keys and values, and f32 bytes equal llama.cpp's converter's output."""
    folder = ckpt(variant)
    out, kv, tensors, ref = convert_with_both(llama_cpp_src, folder, tmp_path, mode)
    # other general.* keys are provenance (name, basename, version) read from the folder name and HF card
    assert_same_gguf(out, kv, tensors, ref, value_types=False)


@pytest.mark.llama_cpp
@pytest.mark.parametrize("variant", ["dense", "moe_fused"])
def test_llama_cpp_runs_it_with_mtp_drafting(ckpt, tmp_path, llama_cpp_bin, variant):
    """llama.cpp loads the GGUF (trunk + MTP block), drafts with the MTP head, and its greedy tokens
    equal transformers' greedy tokens on the same checkpoint (so norms, ssm_a and the V reorder are right)."""
    folder = ckpt(variant)
    gguf_path = tmp_path / "m.gguf"
    convert(folder, gguf_path, "--outtype", "f32")
    prompt, n = "def add(a, b):", 10
    proc, stats = speculative_simple(
        llama_cpp_bin,
        "-m",
        gguf_path,
        "-p",
        prompt,
        "-n",
        n,
        "--spec-type",
        "draft-mtp",
        "--temp",
        "0",
        "-t",
        "1",
        "-c",
        "256",
        "-lv",
        "5",
    )
    log = proc.stdout + proc.stderr
    assert stats["n_drafted"] > 0  # the MTP head ran
    step = r"accepted (\d+)/\d+ draft tokens, the last target token is: \((\d+)\)"
    steps = [(int(a), int(t)) for a, t in re.findall(step, log)]
    model_class = "Qwen3_5MoeForCausalLM" if "num_experts" in tiny_qwen35.read_config(folder) else "Qwen3_5ForCausalLM"
    want = transformers_greedy(model_class, folder, prompt, n + 4)
    assert_targets_are_greedy(steps, want)
