"""Nemotron-H MoE (NemotronHForCausalLM with experts) conversion: Mamba2/attention/MoE tensors, the folded MTP
block, metadata, modes, quantizing, llama.cpp.

The checks it shares with other families are its rows in tests/convert/test_convert_mtp_checks.py.

The expected GGUF names, shapes, value transforms and metadata are written out here by
hand (from llama.cpp's conversion/nemotron.py + mamba.py + granite.py + llama.py, its
gguf-py tensor map and src/models/nemotron-h-moe.cpp), independently of mtpq's tables;
the llama_cpp-marked tests compare against llama.cpp's own converter (which keeps the
MTP head too), llama-quantize and llama-speculative-simple.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from safetensors.torch import load_file, save_file

from tests.builders import tiny_nemotron_h_moe
from tests.helpers.familycheck import (
    assert_expected_kv,
    assert_same_gguf,
    checkpoint_fixtures,
    convert_with_both,
    quantize_q4_k_m,
)
from tests.helpers.ggufcheck import convert, read_gguf, source_tensors
from tests.helpers.runcli import run_cli

MTP = 4  # pattern "ME*E": blk.4 is the folded MTP block
MAMBA = {
    "ssm_in.weight": (1288, 256),
    "ssm_conv1d.weight": (768, 4),
    "ssm_conv1d.bias": (768,),
    "ssm_dt.bias": (8,),
    "ssm_a": (8, 1),
    "ssm_d": (8, 1),
    "ssm_norm.weight": (2, 256),
    "ssm_out.weight": (256, 512),
}
ATTN = {
    "attn_q.weight": (256, 256),
    "attn_k.weight": (128, 256),
    "attn_v.weight": (128, 256),
    "attn_output.weight": (256, 256),
}
MOE = {
    "ffn_gate_inp.weight": (4, 256),
    "exp_probs_b.bias": (4,),
    "ffn_up_exps.weight": (4, 256, 256),
    "ffn_down_exps.weight": (4, 256, 256),
    "ffn_up_shexp.weight": (256, 256),
    "ffn_down_shexp.weight": (256, 256),
}
NEXTN = {
    "nextn.eh_proj.weight": (256, 512),
    "nextn.enorm.weight": (256,),
    "nextn.hnorm.weight": (256,),
    "nextn.shared_head_norm.weight": (256,),
    "post_attention_norm.weight": (256,),
}
NORM = {"attn_norm.weight": (256,)}
BLOCKS = [MAMBA | NORM, MOE | NORM, ATTN | NORM, MOE | NORM, ATTN | MOE | NEXTN | NORM]
TOP = {"token_embd.weight": ("V", 256), "output_norm.weight": (256,), "output.weight": ("V", 256)}


def expected(vocab: int, blocks=range(5)) -> dict[str, tuple[int, ...]]:
    fix = lambda shape: tuple(vocab if d == "V" else d for d in shape)  # noqa: E731
    out = {k: fix(s) for k, s in TOP.items()}
    for bid in blocks:
        out.update({f"blk.{bid}.{k}": s for k, s in BLOCKS[bid].items()})
    return out


def interleave_heads(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Row h*d + 2j + s of the result is row h*d + s*d/2 + j of w (llama.cpp's q/k row order)."""
    d = w.shape[0] // n_head
    out = torch.empty_like(w)
    for h in range(n_head):
        for j in range(d // 2):
            for s in (0, 1):
                out[h * d + 2 * j + s] = w[h * d + s * d // 2 + j]
    return out


def expected_values(src: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """GGUF name -> f32 values, derived from the HF tensors by the documented transforms."""
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    out = {
        "token_embd.weight": src["backbone.embeddings.weight"],
        "output_norm.weight": src["backbone.norm_f.weight"],
        "output.weight": src["lm_head.weight"],
    }

    def mixer(bid: int, p: str):
        if p + "in_proj.weight" in src:
            out.update(
                {
                    f"blk.{bid}.ssm_in.weight": src[p + "in_proj.weight"],
                    f"blk.{bid}.ssm_conv1d.weight": src[p + "conv1d.weight"][:, 0, :],
                    f"blk.{bid}.ssm_conv1d.bias": src[p + "conv1d.bias"],
                    f"blk.{bid}.ssm_dt.bias": src[p + "dt_bias"],
                    f"blk.{bid}.ssm_a": -torch.exp(src[p + "A_log"]).unsqueeze(1),
                    f"blk.{bid}.ssm_d": src[p + "D"].unsqueeze(1),
                    f"blk.{bid}.ssm_norm.weight": src[p + "norm.weight"].view(cfg["n_groups"], -1),
                    f"blk.{bid}.ssm_out.weight": src[p + "out_proj.weight"],
                }
            )
        elif p + "q_proj.weight" in src:
            out.update(
                {
                    f"blk.{bid}.attn_q.weight": interleave_heads(src[p + "q_proj.weight"], nh),
                    f"blk.{bid}.attn_k.weight": interleave_heads(src[p + "k_proj.weight"], nkv),
                    f"blk.{bid}.attn_v.weight": src[p + "v_proj.weight"],
                    f"blk.{bid}.attn_output.weight": src[p + "o_proj.weight"],
                }
            )
        else:
            out.update(
                {
                    f"blk.{bid}.ffn_gate_inp.weight": src[p + "gate.weight"],
                    f"blk.{bid}.exp_probs_b.bias": src[p + "gate.e_score_correction_bias"],
                    f"blk.{bid}.ffn_up_shexp.weight": src[p + "shared_experts.up_proj.weight"],
                    f"blk.{bid}.ffn_down_shexp.weight": src[p + "shared_experts.down_proj.weight"],
                }
            )
            for proj in ("up", "down"):
                out[f"blk.{bid}.ffn_{proj}_exps.weight"] = torch.stack(
                    [src[f"{p}experts.{e}.{proj}_proj.weight"] for e in range(cfg["n_routed_experts"])]
                )

    for bid in range(cfg["num_hidden_layers"]):
        out[f"blk.{bid}.attn_norm.weight"] = src[f"backbone.layers.{bid}.norm.weight"]
        mixer(bid, f"backbone.layers.{bid}.mixer.")
    mixer(MTP, "mtp.layers.0.mixer.")
    mixer(MTP, "mtp.layers.1.mixer.")
    out.update(
        {
            f"blk.{MTP}.nextn.eh_proj.weight": src["mtp.layers.0.eh_proj.weight"],
            f"blk.{MTP}.nextn.enorm.weight": src["mtp.layers.0.enorm.weight"],
            f"blk.{MTP}.nextn.hnorm.weight": src["mtp.layers.0.hnorm.weight"],
            f"blk.{MTP}.attn_norm.weight": src["mtp.layers.0.norm.weight"],
            f"blk.{MTP}.post_attention_norm.weight": src["mtp.layers.1.norm.weight"],
            f"blk.{MTP}.nextn.shared_head_norm.weight": src["mtp.layers.1.final_layernorm.weight"],
        }
    )
    return out


nh_ckpt, nh_f32 = checkpoint_fixtures("nh", tiny_nemotron_h_moe.nemotron_h_moe)


def _cfg(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


def test_f32_every_tensor_named_shaped_and_valued(nh_ckpt, nh_f32):
    _, tensors = nh_f32
    want = expected(_cfg(nh_ckpt)["vocab_size"])
    assert {n: tensors[n][1].shape for n in tensors} == want
    values = expected_values(source_tensors(nh_ckpt), _cfg(nh_ckpt))
    assert set(values) == set(want)
    for name, value in values.items():
        qtype, got = tensors[name]
        assert qtype == T.F32, name
        np.testing.assert_array_equal(got, value.float().numpy(), err_msg=name)


def test_metadata(nh_ckpt, nh_f32):
    kv, _ = nh_f32
    # feed_forward_length: MoE layers and the MTP block
    # attention.head_count_kv: attention layers and the MTP block
    assert_expected_kv(kv, "nemotron_h_moe")  # tests/convert/expected_kv.json
    assert kv["nemotron_h_moe.expert_weights_scale"] == pytest.approx(2.5)
    assert kv["nemotron_h_moe.attention.layer_norm_epsilon"] == pytest.approx(1e-5)
    assert len(kv["tokenizer.ggml.tokens"]) == 304


def test_latent_moe_of_nemotron_3_super(tmp_path):
    """Nemotron 3 Super's LatentMoE (moe_latent_size; tests/releases/nemotron3_super.py): fc1_latent_proj /
    fc2_latent_proj -> ffn_latent_down / ffn_latent_up in every MoE block (the MTP block's too), the routed experts
    on the latent width, and the moe_latent_size key, as llama.cpp's converter writes them."""
    from tests import releases

    ck = releases.build(releases.manifests()["nemotron3_super"], tmp_path / "ckpt")
    kv, tensors = convert(ck, tmp_path / "m.gguf", "--outtype", "f32")
    assert kv["nemotron_h_moe.moe_latent_size"] == 256 and kv["nemotron_h_moe.block_count"] == 5
    src = source_tensors(ck)
    for bid, p in ((1, "backbone.layers.1.mixer."), (3, "backbone.layers.3.mixer."), (4, "mtp.layers.1.mixer.")):
        for gg, hf, shape in (
            ("ffn_latent_down", "fc1_latent_proj", (256, 512)),
            ("ffn_latent_up", "fc2_latent_proj", (512, 256)),
        ):
            got = tensors[f"blk.{bid}.{gg}.weight"][1]
            assert got.shape == shape
            np.testing.assert_array_equal(got, src[p + hf + ".weight"].float().numpy())
        assert tensors[f"blk.{bid}.ffn_up_exps.weight"][1].shape == (4, 256, 256)  # [E, ff, latent]
        assert tensors[f"blk.{bid}.ffn_up_shexp.weight"][1].shape == (512, 512)  # the shared expert: full width


def test_vocab_padded_to_a_multiple_of_8(tmp_path):
    """llama.cpp pads a Mamba model's vocabulary to a multiple of 8 ([PADn] tokens); the tensors keep their rows."""
    ck = tiny_nemotron_h_moe.nemotron_h_moe(tmp_path / "ck")
    cfg = _cfg(ck)
    cfg["vocab_size"] -= 3  # 301 ids in config.json; the checkpoint's embedding rows must follow
    src = source_tensors(ck)
    for f in ck.glob("*.safetensors"):
        part = load_file(str(f))
        part.update({n: t[:301] for n, t in part.items() if n in ("backbone.embeddings.weight", "lm_head.weight")})
        save_file(part, str(f), metadata={"format": "pt"})
    (ck / "config.json").write_text(json.dumps(cfg))
    kv, tensors = convert(ck, tmp_path / "m.gguf", "--outtype", "f32")
    assert kv["nemotron_h_moe.vocab_size"] == 304 and len(kv["tokenizer.ggml.tokens"]) == 304
    assert tensors["token_embd.weight"][1].shape == (301, 256)
    np.testing.assert_array_equal(tensors["output.weight"][1], src["lm_head.weight"][:301].numpy())


def test_no_mtp_and_mtp_only(nh_ckpt, tmp_path):
    kv, tensors = convert(nh_ckpt, tmp_path / "trunk.gguf", "--no-mtp")
    assert kv["nemotron_h_moe.block_count"] == 4 and "nemotron_h_moe.nextn_predict_layers" not in kv
    assert kv["nemotron_h_moe.attention.head_count_kv"] == [0, 0, 2, 0]
    assert set(tensors) == set(expected(304, range(4)))
    kv, tensors = convert(nh_ckpt, tmp_path / "head.gguf", "--mtp-only")
    assert kv["nemotron_h_moe.block_count"] == 5 and kv["nemotron_h_moe.nextn_predict_layers"] == 1
    assert set(tensors) == {n for n in expected(304) if n.startswith("blk.4.")} | {
        "token_embd.weight",
        "output_norm.weight",
        "output.weight",
    }


def test_unsupported_configs_exit_2(nh_ckpt, tmp_path):
    for i, (change, needle) in enumerate(
        (
            ({"mtp_hybrid_override_pattern": "*-"}, "mtp_hybrid_override_pattern"),
            ({"hybrid_override_pattern": "ME*"}, "hybrid_override_pattern"),
            # LatentMoE declared, its projections absent: refused, naming them
            ({"moe_latent_size": 64}, "fc1_latent_proj"),
        )
    ):
        ck = shutil.copytree(nh_ckpt, tmp_path / f"ck{i}")
        cfg = _cfg(ck)
        cfg.update(change)
        (ck / "config.json").write_text(json.dumps(cfg))
        res = run_cli("convert", ck, tmp_path / "m.gguf", "--quiet")
        assert res.exit_code == 2 and needle in res.stderr and "config.json" in res.stderr, res.output
        assert not (tmp_path / "m.gguf").exists()


def test_q4_k_m_holds_the_mtp_block_at_q8_0(nh_ckpt, tmp_path):
    tensors = quantize_q4_k_m(nh_ckpt, tmp_path)
    shapes = expected(304)
    for name, (qtype, _) in tensors.items():
        if (
            len(shapes[name]) == 1
            or "ffn_gate_inp" in name
            or not name.endswith(".weight")
            or "_norm" in name
            or "conv1d" in name
        ):
            assert qtype == T.F32, name
        elif name.startswith("blk.4."):
            assert qtype == T.Q8_0, name
    assert tensors["blk.1.ffn_up_exps.weight"][0] == T.Q4_K and tensors["blk.0.ssm_in.weight"][0] != T.F16


def test_extract_and_graft_restore_the_per_layer_arrays(nh_ckpt, tmp_path):
    """A --no-mtp quant given the head back by graft: the MTP block, and the per-layer arrays
    (head_count_kv, feed_forward_length) regain its entry, as in the full conversion."""
    full, trunk, head, grafted = (tmp_path / f"{n}.gguf" for n in ("full", "trunk", "head", "grafted"))
    full_kv, full_t = convert(nh_ckpt, full, "--outtype", "f16")
    convert(nh_ckpt, trunk, "--outtype", "f16", "--no-mtp", "--quant", "Q4_K_M")
    assert run_cli("extract-mtp", full, head, "--quiet").exit_code == 0
    res = run_cli("graft", "--mtp-from", head, "--into", trunk, grafted, "--mtp-type", "q8_0", "--quiet")
    assert res.exit_code == 0, res.output
    kv, tensors = read_gguf(grafted)
    assert set(tensors) == set(full_t)
    for key in ("block_count", "nextn_predict_layers", "attention.head_count_kv", "feed_forward_length"):
        assert kv[f"nemotron_h_moe.{key}"] == full_kv[f"nemotron_h_moe.{key}"], key
    assert tensors["blk.4.nextn.eh_proj.weight"][0] == T.Q8_0 and tensors["blk.4.ffn_up_exps.weight"][0] == T.Q8_0


# ----------------------------------------------------------------------------- llama.cpp


@pytest.mark.llama_cpp
@pytest.mark.parametrize(
    "mode,dtype,over",
    [
        (None, torch.float32, {}),
        ("--no-mtp", torch.float32, {}),
        ("--mtp", torch.float32, {}),
        (None, torch.bfloat16, {}),
        # 8 heads: rope.dimension_count = hidden / heads = 32, not head_dim (llama.cpp's Granite drops head_dim)
        (None, torch.float32, {"num_attention_heads": 8, "hybrid_override_pattern": "M*EME", "num_hidden_layers": 5}),
    ],
)
def test_same_gguf_as_llama_cpp_converter(tmp_path, llama_cpp_src, mode, dtype, over):
    """Names, shapes, types, every metadata key and value, and f32 bytes equal llama.cpp's converter's
    (which keeps the folded MTP block too), in its three modes, from bf16 and with another layout."""
    ck = tiny_nemotron_h_moe.nemotron_h_moe(tmp_path / "ckpt", dtype=dtype, **over)
    out, kv, tensors, ref = convert_with_both(llama_cpp_src, ck, tmp_path, mode)
    assert_same_gguf(out, kv, tensors, ref)
    assert any(n.startswith("blk.") and ".nextn." in n for n in tensors) == (mode != "--no-mtp")


@pytest.mark.llama_cpp
def test_f16_types_as_llama_cpp_converter(nh_ckpt, tmp_path, llama_cpp_src):
    """At f16 every type equals llama.cpp's but one: its converter forces routers to F32 by matching the
    source block number, which for the MTP router (from mtp.layers.1, written as blk.4) misses, so it
    writes that router in F16. mtpq keeps it F32 like every other router."""
    from tests.helpers.llamacpp_ref import llama_cpp_convert

    kv, tensors = convert(nh_ckpt, tmp_path / "ours.gguf", "--outtype", "f16")
    _, ref = read_gguf(
        llama_cpp_convert(llama_cpp_src, nh_ckpt, tmp_path / "ref.gguf", kv["tokenizer.ggml.pre"], outtype="f16")
    )
    diff = {n: (tensors[n][0], ref[n][0]) for n in ref if tensors[n][0] != ref[n][0]}
    assert diff == {"blk.4.ffn_gate_inp.weight": (T.F32, T.F16)}
