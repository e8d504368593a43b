"""Ling 3.0 (BailingMoeV3ForCausalLM) conversion: KDA + MLA + MoE tensors, the MTP layer, metadata, modes, llama.cpp.

The checks it shares with other families are its rows in tests/convert/test_convert_mtp_checks.py.

The expected GGUF names, shapes, value transforms and metadata are written out here by
hand (from llama.cpp's conversion/bailingmoe3.py, its gguf-py tensor map and the loader
src/models/bailingmoe3.cpp), independently of mtpq's tables; the llama_cpp-marked tests
compare against llama.cpp's own converter (which keeps the MTP layer too), llama-quantize
and llama-speculative-simple.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from tests.builders import tiny_bailingmoe3
from tests.helpers.familycheck import (
    LAYER_NORMS,
    assert_expected_kv,
    assert_mode_files,
    assert_same_gguf,
    assert_table_f32,
    checkpoint_fixtures,
    convert_with_both,
    dequant_block_scaled,
    expected_table,
    ffn_table,
    nextn_table,
    quantize_q4_k_m,
    quantize_with_both,
    stack_experts,
    top_table,
    vocab,
)
from tests.helpers.ggufcheck import convert, read_gguf, source_tensors
from tests.helpers.runcli import run_cli

N_HEAD, NOPE, ROPE, V_DIM, KV_LORA = 4, 64, 64, 64, 256
# layer_group_size 2, 4 trunk layers: KDA at 0 and 2, MLA at 1, 3 and the MTP layer 4; layer 0 dense
KDA = {
    "attn_q.weight": ((256, 256), "attention.q_proj.weight"),
    "attn_k.weight": ((256, 256), "attention.k_proj.weight"),
    "attn_v.weight": ((256, 256), "attention.v_proj.weight"),
    "ssm_conv1d_q.weight": ((1, 256, 1, 4), "attention.q_conv1d.weight"),
    "ssm_conv1d_k.weight": ((1, 256, 1, 4), "attention.k_conv1d.weight"),
    "ssm_conv1d_v.weight": ((1, 256, 1, 4), "attention.v_conv1d.weight"),
    "ssm_f_a.weight": ((256, 256), "attention.f_proj.weight"),
    "ssm_beta.weight": ((4, 256), "attention.b_proj.weight"),
    "ssm_a": ((4, 1), "attention.A_log"),
    "ssm_dt.bias": ((256,), "attention.dt_bias"),
    "ssm_g_a.weight": ((256, 256), "attention.g_proj.weight"),
    "ssm_norm.weight": ((64,), "attention.o_norm.weight"),
    "attn_output.weight": ((256, 256), "attention.o_proj.weight"),
}
MLA = {
    "attn_q.weight": ((512, 256), "attention.q_proj.weight"),
    "attn_kv_a_mqa.weight": ((320, 256), "attention.kv_a_proj_with_mqa.weight"),
    "attn_kv_a_norm.weight": ((256,), "attention.kv_a_layernorm.weight"),
    "attn_k_b.weight": ((4, 256, 64), "attention.kv_b_proj.weight"),
    "attn_v_b.weight": ((4, 64, 256), "attention.kv_b_proj.weight"),
    "attn_gate.weight": ((4, 256), "attention.g_proj.weight"),
    "attn_output.weight": ((256, 256), "attention.dense.weight"),
}
NORMS = LAYER_NORMS
DENSE = ffn_table("mlp.", 512)
MOE = {
    "ffn_gate_inp.weight": ((4, 256), "mlp.gate.weight"),
    "exp_probs_b.bias": ((4,), "mlp.gate.expert_bias"),
    **ffn_table("mlp.experts.*.", 256, suffix="_exps", experts=4),
    **ffn_table("mlp.shared_experts.", 256, suffix="_shexp"),
}
NEXTN = nextn_table() | {"layer_output_norm.weight": ((256,), "final_layernorm.weight")}
BLOCKS = [KDA | NORMS | DENSE, MLA | NORMS | MOE, KDA | NORMS | MOE, MLA | NORMS | MOE, MLA | NORMS | MOE | NEXTN]
TOP = top_table(embed="model.word_embeddings.weight")


def expected(vocab: int, blocks=range(5)) -> dict[str, tuple[tuple[int, ...], str]]:
    return expected_table(TOP, BLOCKS, vocab, blocks)


def value(src: dict[str, torch.Tensor], name: str, hf: str) -> torch.Tensor:
    """The GGUF tensor's values from the HF one, by the documented transforms (computed here per head)."""
    if "*" in hf:
        return stack_experts(src, hf)
    t = src[hf].float()
    if ".ssm_conv1d_" in name:
        return t[:, 0, :].reshape(1, 256, 1, 4)
    if name.endswith(".ssm_a"):
        return torch.exp(t).reshape(-1, 1)
    if name.endswith((".attn_k_b.weight", ".attn_v_b.weight")):
        heads = [t[h * (NOPE + V_DIM) : (h + 1) * (NOPE + V_DIM)] for h in range(N_HEAD)]
        if name.endswith(".attn_k_b.weight"):
            return torch.stack([rows[:NOPE].T for rows in heads])
        return torch.stack([rows[NOPE:] for rows in heads])
    return t


bl_ckpt, bl_f32 = checkpoint_fixtures("bl", tiny_bailingmoe3.bailingmoe3)


def test_f32_every_tensor_named_shaped_and_valued(bl_ckpt, bl_f32):
    _, tensors = bl_f32
    assert_table_f32(tensors, expected(vocab(bl_ckpt)), bl_ckpt, value)


def test_metadata(bl_ckpt, bl_f32):
    kv, _ = bl_f32
    # attention.head_count_kv: 1 on MLA layers (and the MTP layer), 0 on KDA
    assert_expected_kv(kv, "bailingmoe3", vocab_size=vocab(bl_ckpt))  # tests/convert/expected_kv.json
    assert kv["bailingmoe3.kda.gate_lower_bound"] == pytest.approx(-5.0)
    assert kv["bailingmoe3.expert_weights_scale"] == pytest.approx(2.5)
    assert kv["bailingmoe3.rope.freq_base"] == pytest.approx(600000.0)
    assert kv["bailingmoe3.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)


def test_f16_keeps_the_short_convolutions_f32(bl_ckpt, tmp_path):
    """ggml's ssm_conv takes f32 weights only: q/k/v_conv1d stay F32 (llama.cpp aborts on an f16 one)."""
    _, tensors = convert(bl_ckpt, tmp_path / "m.gguf", "--outtype", "f16")
    for name, (qtype, data) in tensors.items():
        f32 = (
            data.ndim == 1
            or "ssm_conv1d" in name
            or "ffn_gate_inp" in name
            or name.endswith("ssm_a")
            or name.endswith("norm.weight")
        )
        assert qtype == (T.F32 if f32 else T.F16), name


def test_no_mtp_and_mtp_only(bl_ckpt, tmp_path):
    (kv, _), _ = assert_mode_files(bl_ckpt, tmp_path, "bailingmoe3", 4, expected(vocab(bl_ckpt)))
    assert kv["bailingmoe3.attention.head_count_kv"] == [0, 1, 0, 1]


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"no_kda_lora": False}, "no_kda_lora"),
        ({"gated_attention_proj_granularity_type": "element_wise"}, "gated_attention_proj_granularity_type"),
    ],
)
def test_unsupported_variants_exit_2(bl_ckpt, tmp_path, change, needle):
    ck = shutil.copytree(bl_ckpt, tmp_path / "ck")
    cfg = json.loads((ck / "config.json").read_text())
    cfg.update(change)
    (ck / "config.json").write_text(json.dumps(cfg))
    res = run_cli("convert", ck, tmp_path / "m.gguf", "--quiet")
    assert res.exit_code == 2 and needle in res.stderr and "config.json" in res.stderr, res.output


def test_fp8_block_scaled_dequantized(bl_ckpt, tmp_path):
    """Ling 3.0 also ships FP8: e4m3 matrices with 128x128 weight_scale_inv tiles. GGUF values = the
    dequantized source (computed here tile by tile), through the same transforms (kv_b split included)."""
    from tests.builders import tiny

    ck = shutil.copytree(bl_ckpt, tmp_path / "fp8")
    tiny.to_fp8_block_scaled(ck)
    stored = source_tensors(ck)
    dequant = dequant_block_scaled(stored)
    for n in (
        "model.layers.4.attention.kv_b_proj.weight",
        "model.layers.0.attention.f_proj.weight",
        "model.layers.4.eh_proj.weight",
        "model.layers.2.mlp.experts.3.down_proj.weight",
    ):
        assert stored[n].dtype == torch.float8_e4m3fn, n
    _, tensors = convert(ck, tmp_path / "m.gguf", "--outtype", "f32")
    for name, (_, hf) in expected(vocab(ck)).items():
        np.testing.assert_array_equal(tensors[name][1], value(dequant, name, hf).numpy(), err_msg=name)


@pytest.fixture(scope="module")
def ling_mxfp4(tmp_path_factory):
    """Ling 3.0 Flash's FP8 release with MXFP4 routed experts (tests/releases/ling3_flash.py)."""
    from tests import releases

    return releases.build(releases.manifests()["ling3_flash"], tmp_path_factory.mktemp("mx") / "ckpt", "fp8_mxfp4")


MXFP4_STACKS = [f"blk.{bid}.ffn_{proj}_exps.weight" for bid in (2, 3, 4) for proj in ("gate", "up", "down")]


def test_mxfp4_experts_keep_their_bits(ling_mxfp4, tmp_path):
    """routed_experts_quant_method mxfp4: every expert stack (the MTP layer's too) is written as ggml MXFP4 whatever
    the outtype (file type MOSTLY_MXFP4_MOE), its values the checkpoint's by the OCP definition (E2M1 code x
    2^(e - 127)) bit for bit; the rest is the FP8 dequantized to the outtype."""
    import gguf

    from tests.builders import tiny_mimo2

    kv, tensors = convert(ling_mxfp4, tmp_path / "m.gguf", "--outtype", "f16")
    assert kv["general.file_type"] == gguf.LlamaFileType.MOSTLY_MXFP4_MOE
    src = source_tensors(ling_mxfp4)
    for name in MXFP4_STACKS:
        qtype, data = tensors[name]
        assert qtype == T.MXFP4, name
        got = gguf.dequantize(data, T.MXFP4)
        bid, proj = int(name.split(".")[1]), name.split("_")[1]
        for e in range(4):
            hf = f"model.layers.{bid}.mlp.experts.{e}.{proj}_proj.weight"
            assert src[hf].dtype == torch.uint8 and src[hf + "_scale_inv"].dtype == torch.uint8
            np.testing.assert_array_equal(
                got[e], tiny_mimo2.mxfp4_values(src[hf], src[hf + "_scale_inv"]).numpy(), err_msg=hf
            )
    assert tensors["blk.2.ffn_gate_exps.weight"][1].shape == (4, 256, 512 // 32 * 17)  # full width: 512 values
    assert tensors["blk.3.attn_q.weight"][0] == T.F16 and tensors["blk.0.ssm_f_a.weight"][0] == T.F16


def test_mxfp4_file_quantizes_inspects_and_extracts(ling_mxfp4, tmp_path):
    """Q4_K_M with the head at q8_0 from MXFP4 experts requantizes them only when asked (as llama-quantize);
    inspect reports the MTP block and extract-mtp writes exactly its tensors."""
    f16 = tmp_path / "f16.gguf"
    convert(ling_mxfp4, f16, "--outtype", "f16")
    res = run_cli("quantize", f16, tmp_path / "a.gguf", "Q4_K_M", "--mtp-type", "q8_0", "--quiet")
    assert res.exit_code == 2 and "--allow-requantize" in res.stderr, res.output
    q = tmp_path / "q.gguf"
    res = run_cli("quantize", f16, q, "Q4_K_M", "--mtp-type", "q8_0", "--allow-requantize", "--quiet")
    assert res.exit_code == 0, res.output
    _, tensors = read_gguf(q)
    assert tensors["blk.2.ffn_up_exps.weight"][0] == T.Q4_K and tensors["blk.4.ffn_up_exps.weight"][0] == T.Q8_0
    info = json.loads(run_cli("inspect", q, "--json").stdout)
    assert info["mtp_blocks"] == [4]
    head = tmp_path / "head.gguf"
    assert run_cli("extract-mtp", q, head, "--quiet").exit_code == 0
    _, head_tensors = read_gguf(head)
    assert {n for n in head_tensors if n.startswith("blk.")} == {n for n in tensors if n.startswith("blk.4.")}


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"routed_experts_quant_method": "nvfp4"}, "routed_experts_quant_method"),
        ({"routed_experts_group_size": 16}, "routed_experts_group_size"),
    ],
)
def test_unsupported_mxfp4_declarations_exit_2(ling_mxfp4, tmp_path, change, needle):
    ck = shutil.copytree(ling_mxfp4, tmp_path / "ck")
    cfg = json.loads((ck / "config.json").read_text())
    cfg["quantization_config"].update(change)
    (ck / "config.json").write_text(json.dumps(cfg))
    res = run_cli("convert", ck, tmp_path / "m.gguf", "--quiet")
    assert res.exit_code == 2 and needle in res.stderr and "config.json" in res.stderr, res.output


def test_q4_k_m_holds_the_mtp_block_at_q8_0(bl_ckpt, tmp_path):
    tensors = quantize_q4_k_m(bl_ckpt, tmp_path)
    shapes = expected(vocab(bl_ckpt))
    for name, (qtype, _) in tensors.items():
        if len(shapes[name][0]) == 1 or "ffn_gate_inp" in name or "ssm_conv1d" in name or name.endswith("ssm_a"):
            assert qtype == T.F32, name
        elif name.startswith("blk.4.") and shapes[name][0][-1] % 32 == 0:
            assert qtype == T.Q8_0, name
    assert tensors["blk.1.ffn_up_exps.weight"][0] == T.Q4_K and tensors["blk.0.ssm_f_a.weight"][0] == T.Q4_K


# ----------------------------------------------------------------------------- llama.cpp


@pytest.mark.llama_cpp
@pytest.mark.parametrize(
    "mode,dtype,over",
    [
        (None, torch.float32, {}),
        ("--no-mtp", torch.float32, {}),
        ("--mtp", torch.float32, {}),
        (None, torch.bfloat16, {}),
        (
            None,
            torch.float32,
            {
                "q_lora_rank": 256,
                "expert_swiglu_limit_list": [None, 7.0, 7.0, 7.0],
                "share_expert_swiglu_limit_list": [None, 10.0, 10.0, 10.0],
            },
        ),
    ],
)
def test_same_gguf_as_llama_cpp_converter(tmp_path, llama_cpp_src, mode, dtype, over):
    """Names, shapes, types, every metadata key and value, and f32 bytes equal llama.cpp's converter's
    (which keeps the MTP layer too), in its three modes, from bf16, and with q LoRA + SwiGLU clamps."""
    ck = tiny_bailingmoe3.bailingmoe3(tmp_path / "ckpt", dtype=dtype, **over)
    out, kv, tensors, ref = convert_with_both(llama_cpp_src, ck, tmp_path, mode)
    assert_same_gguf(out, kv, tensors, ref)
    assert any(".nextn." in n for n in tensors) == (mode != "--no-mtp")


@pytest.mark.llama_cpp
def test_f16_types_as_llama_cpp_converter(bl_ckpt, tmp_path, llama_cpp_src):
    from tests.helpers.llamacpp_ref import llama_cpp_convert

    kv, tensors = convert(bl_ckpt, tmp_path / "ours.gguf", "--outtype", "f16")
    _, ref = read_gguf(
        llama_cpp_convert(llama_cpp_src, bl_ckpt, tmp_path / "ref.gguf", kv["tokenizer.ggml.pre"], outtype="f16")
    )
    assert {n: t for n, (t, _) in tensors.items()} == {n: t for n, (t, _) in ref.items()}


@pytest.mark.llama_cpp
def test_same_bytes_as_llama_quantize(bl_ckpt, tmp_path, llama_cpp_bin):
    """With --mtp-type same every tensor's type and bytes equal llama-quantize's Q4_K_M (head included).

    One layout difference: llama-quantize writes each tensor with ggml_n_dims dimensions, dropping
    the KDA convolutions' trailing ne[3] = 1 ([1, d, 1, k] -> [d, 1, k]); mtpq keeps the shape the
    converters wrote. Same bytes, and llama.cpp's loader accepts both.
    """
    a, b = quantize_with_both(bl_ckpt, tmp_path, llama_cpp_bin)
    for name in b:
        ours, theirs = a[name][1], b[name][1]
        if "ssm_conv1d_" in name:
            assert ours.shape == (1, *theirs.shape), name
            ours = ours.reshape(theirs.shape)
        assert a[name][0] == b[name][0] and np.array_equal(ours, theirs), name
    assert b["blk.4.nextn.eh_proj.weight"][0] != T.Q8_0  # llama-quantize crushes the head with the trunk


@pytest.mark.llama_cpp
def test_mxfp4_blocks_as_llama_cpp_repacks_them(ling_mxfp4, tmp_path, llama_cpp_src):
    """The MXFP4 blocks are the bytes llama.cpp's own repacker (conversion/base.py repack_mxfp4_blocks, which its
    mimo/deepseek4/kimi_k3 converters use) makes of each expert's pair. Its bailingmoe3 converter does not use it:
    it writes the experts at half width (the manifest's DIFFERS reason, checked here so that it stays true)."""
    import subprocess
    import sys

    from tests.helpers.llamacpp_ref import llama_cpp_convert_result

    _, tensors = convert(ling_mxfp4, tmp_path / "m.gguf", "--outtype", "f16")
    script = (
        "import sys, numpy as np\n"
        "sys.path[:0] = [sys.argv[1] + '/gguf-py', sys.argv[1]]\n"
        "from conversion.base import ModelBase\n"
        "from safetensors.torch import load_file\n"
        "import glob\n"
        "src = {}\n"
        "for f in sorted(glob.glob(sys.argv[2] + '/*.safetensors')): src.update(load_file(f))\n"
        "out = {}\n"
        "for bid in (2, 3, 4):\n"
        "    for proj in ('gate', 'up', 'down'):\n"
        "        hf = [f'model.layers.{bid}.mlp.experts.{e}.{proj}_proj.weight' for e in range(4)]\n"
        "        out[f'blk.{bid}.ffn_{proj}_exps.weight'] = np.stack(\n"
        "            [ModelBase.repack_mxfp4_blocks(src[n], src[n + '_scale_inv']) for n in hf])\n"
        "np.savez(sys.argv[3], **out)\n"
    )
    ref = tmp_path / "ref.npz"
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", script, str(llama_cpp_src), str(ling_mxfp4), str(ref)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    want = np.load(ref)
    for name in MXFP4_STACKS:
        np.testing.assert_array_equal(tensors[name][1], want[name], err_msg=name)
    ok, log = llama_cpp_convert_result(llama_cpp_src, ling_mxfp4, tmp_path / "llama.gguf", "gpt-2", raw_config=True)
    assert ok, log[-2000:]
    _, theirs = read_gguf(tmp_path / "llama.gguf")
    assert theirs["blk.2.ffn_gate_exps.weight"][1].shape == (4, 256, 256)  # 512 values per row, read as 256
