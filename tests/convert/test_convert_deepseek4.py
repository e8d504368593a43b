"""DeepSeek-V4 (DeepseekV4ForCausalLM) conversion: the release-shaped checkpoint (tests/releases/deepseek_v4_flash.py,
FP8 + FP4 experts as DeepSeek ships it) into a trunk file and a head-only file, every tensor's name, type and
value, the refusals, quantizing with the head at q8_0, inspect, extract-mtp, and drafting in llama.cpp.

Expected names and types are written out here by hand (from llama.cpp's conversion/deepseek.py DeepseekV4Model,
gguf-py's TENSOR_NAMES and src/models/deepseek4.cpp), values computed here from the stored codes and scales,
independently of mtpq's decoding; the llama_cpp-marked tests compare with llama.cpp's converter,
llama-quantize and llama-speculative-simple.
"""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from tests import releases
from tests.builders.tiny_mimo2 import mxfp4_values
from tests.helpers.familycheck import (
    assert_bad_tensor_refused,
    assert_drafts_in_llama_cpp,
    assert_expected_kv,
    assert_same_gguf,
    convert_with_both,
    rewrite_tensor,
    run,
)
from tests.helpers.ggufcheck import convert, read_gguf, source_tensors
from tests.helpers.runcli import run_cli

M = releases.manifests()["deepseek_v4_flash"]
N_TRUNK, MTP = 4, 4  # blk.4 is the MTP block
OUTPUT_HC = {
    "output_hc_fn.weight": "hc_head_fn",
    "output_hc_base.weight": "hc_head_base",
    "output_hc_scale.weight": "hc_head_scale",
}
# GGUF name in blk.N -> DeepSeek name in layers.N / mtp.0
LAYER = {
    "attn_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    **{f"hc_{a}_{b}.weight": f"hc_{a}_{b}" for a in ("attn", "ffn") for b in ("fn", "base", "scale")},
    "attn_sinks.weight": "attn.attn_sink",
    "attn_q_a.weight": "attn.wq_a.weight",
    "attn_q_a_norm.weight": "attn.q_norm.weight",
    "attn_q_b.weight": "attn.wq_b.weight",
    "attn_kv.weight": "attn.wkv.weight",
    "attn_kv_a_norm.weight": "attn.kv_norm.weight",
    "attn_output_a.weight": "attn.wo_a.weight",
    "attn_output_b.weight": "attn.wo_b.weight",
    "ffn_gate_inp.weight": "ffn.gate.weight",
    "ffn_gate_shexp.weight": "ffn.shared_experts.w1.weight",
    "ffn_down_shexp.weight": "ffn.shared_experts.w2.weight",
    "ffn_up_shexp.weight": "ffn.shared_experts.w3.weight",
    "ffn_gate_exps.weight": "ffn.experts.*.w1.weight",
    "ffn_down_exps.weight": "ffn.experts.*.w2.weight",
    "ffn_up_exps.weight": "ffn.experts.*.w3.weight",
}
COMPRESSOR = {
    f"attn_compressor_{k}.weight": f"attn.compressor.{v}"
    for k, v in (("ape", "ape"), ("kv", "wkv.weight"), ("gate", "wgate.weight"), ("norm", "norm.weight"))
}
INDEXER = {
    "indexer.attn_q_b.weight": "attn.indexer.wq_b.weight",
    "indexer.proj.weight": "attn.indexer.weights_proj.weight",
    **{
        f"indexer_compressor_{k}.weight": f"attn.indexer.compressor.{v}"
        for k, v in (("ape", "ape"), ("kv", "wkv.weight"), ("gate", "wgate.weight"), ("norm", "norm.weight"))
    },
}
NEXTN = {
    "nextn.enorm.weight": "enorm.weight",
    "nextn.hnorm.weight": "hnorm.weight",
    "nextn.shared_head_norm.weight": "norm.weight",
    "nextn.eh_proj.weight": "e_proj.weight|h_proj.weight",
}
RATIOS = M.CONFIG["compress_ratios"]  # [0, 0, 4, 128] + the MTP layer's 0


def block(bid: int) -> dict[str, str]:
    """GGUF name -> source name of block bid (compressor and indexer by its ratio; tid2eid in hash layers)."""
    p = f"layers.{bid}." if bid < N_TRUNK else "mtp.0."
    names = dict(LAYER)
    if RATIOS[bid]:
        names |= COMPRESSOR
    if RATIOS[bid] == 4:
        names |= INDEXER
    names |= (
        {"ffn_gate_tid2eid.weight": "ffn.gate.tid2eid"}
        if bid < M.CONFIG["num_hash_layers"]
        else {"exp_probs_b.bias": "ffn.gate.bias"}
    )
    if bid >= N_TRUNK:
        names |= NEXTN
    return {f"blk.{bid}.{k}": "|".join(p + x for x in v.split("|")) for k, v in names.items()}


def expected(head_only: bool) -> dict[str, str]:
    top = {"token_embd.weight": "embed.weight", "output_norm.weight": "norm.weight", "output.weight": "head.weight"}
    if head_only:
        return top | {k: "mtp.0." + v for k, v in OUTPUT_HC.items()} | block(MTP)
    out = top | OUTPUT_HC
    for bid in range(N_TRUNK):
        out |= block(bid)
    return out


def fp8_values(src: dict, name: str) -> torch.Tensor:
    """e4m3 code x 2^(e - 127) of its 128x128 tile, computed here."""
    w, e = src[name].float(), src[name.removesuffix(".weight") + ".scale"].view(torch.uint8).float()
    s = torch.exp2(e - 127).repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
    return w * s


def want(src: dict, hf: str) -> tuple[T, np.ndarray]:
    """The type and stored bytes (or values) llama.cpp's converter writes for source hf."""
    if "|" in hf:  # eh_proj = [e_proj | h_proj], Q8_0
        return T.Q8_0, gguf.quants.quantize(torch.cat([fp8_values(src, n) for n in hf.split("|")], 1).numpy(), T.Q8_0)
    if "*" in hf:  # FP4 experts -> MXFP4: their values
        parts = [hf.replace("*", str(e)) for e in range(M.CONFIG["n_routed_experts"])]
        return T.MXFP4, torch.stack(
            [
                mxfp4_values(src[n].view(torch.uint8), src[n.removesuffix("weight") + "scale"].view(torch.uint8))
                for n in parts
            ]
        ).numpy()
    t = src[hf]
    if t.dtype == torch.float8_e4m3fn:
        return T.Q8_0, gguf.quants.quantize(fp8_values(src, hf).numpy(), T.Q8_0)
    if t.dtype == torch.int64:
        return T.I32, t.to(torch.int32).numpy()
    if t.dim() == 1 or hf.endswith("norm.weight") or t.dtype == torch.float32:
        return T.F32, t.float().numpy()
    return T.BF16, t.view(torch.int16).numpy()  # bf16 matrices kept bf16, whatever the outtype


@pytest.fixture(scope="module")
def ds4(tmp_path_factory):
    return releases.build(M, tmp_path_factory.mktemp("ds4") / "ckpt", "fp8")


@pytest.fixture(scope="module")
def files(ds4, tmp_path_factory):
    """(trunk, head): the --no-mtp and --mtp-only conversions, f32 outtype."""
    d = tmp_path_factory.mktemp("ds4_out")
    return (
        convert(ds4, d / "trunk.gguf", "--outtype", "f32", "--no-mtp"),
        convert(ds4, d / "head.gguf", "--outtype", "f32", "--mtp-only"),
    )


@pytest.mark.parametrize("head_only", [False, True], ids=["trunk", "head"])
def test_every_tensor_named_typed_and_valued(ds4, files, head_only):
    _, tensors = files[head_only]
    names = expected(head_only)
    assert set(tensors) == set(names)
    src = source_tensors(ds4)
    for name, hf in names.items():
        qtype, data = tensors[name]
        wtype, value = want(src, hf)
        assert qtype == wtype, name
        if qtype == T.MXFP4:
            np.testing.assert_array_equal(
                gguf.quants.dequantize(data, T.MXFP4).reshape(value.shape), value, err_msg=name
            )
        else:
            np.testing.assert_array_equal(data.reshape(-1).view(value.dtype), value.reshape(-1), err_msg=name)


def test_metadata(files):
    (kv, _), (head_kv, _) = files
    a = "deepseek4"
    assert_expected_kv(kv, "deepseek4")  # tests/convert/expected_kv.json (general.file_type 38: MOSTLY_MXFP4_MOE)
    for k, v in {
        f"{a}.rope.freq_base": 10000.0,
        f"{a}.attention.compress_rope_freq_base": 160000.0,
        f"{a}.rope.scaling.factor": 16.0,
        f"{a}.rope.scaling.yarn_beta_fast": 32.0,
        f"{a}.hyper_connection.epsilon": 1e-6,
        f"{a}.expert_weights_scale": 1.5,
    }.items():
        assert kv[k] == pytest.approx(v), k
    assert list(kv[f"{a}.swiglu_clamp_exp"]) == [10.0] * 4 and f"{a}.nextn_predict_layers" not in kv
    assert head_kv[f"{a}.block_count"] == 5 and head_kv[f"{a}.nextn_predict_layers"] == 1
    assert list(head_kv[f"{a}.swiglu_clamp_shexp"]) == [10.0] * 5


def test_one_file_keeping_the_head_is_refused_with_the_two_file_route(ds4, tmp_path):
    res = run_cli("convert", ds4, tmp_path / "m.gguf", "--quiet")
    line = res.stderr.strip()
    assert res.exit_code == 2 and "\n" not in line, res.output
    assert all(s in line for s in ("hc_head", "--no-mtp", "--mtp-only")), line
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize(
    "name,value,needle",
    [
        ("mtp.0.hnorm.weight", None, "missing tensor mtp.0.hnorm.weight"),
        ("mtp.0.hc_head_fn", None, "missing tensor mtp.0.hc_head_fn"),
        ("mtp.0.ffn.experts.1.w3.scale", None, "has no mtp.0.ffn.experts.1.w3.scale"),
        ("mtp.0.enorm.weight", torch.zeros(128, dtype=torch.bfloat16), "config.json implies [256]"),
        ("layers.1.attn.wkv.scale", torch.zeros(1, 1, dtype=torch.uint8), "expected F8_E8M0 [2, 2]"),
        ("layers.2.ffn.experts.0.w1.weight", torch.zeros(256, 256, dtype=torch.bfloat16), "which is BF16"),
    ],
)
def test_damaged_checkpoint_exits_2(ds4, tmp_path, name, value, needle):
    assert_bad_tensor_refused(shutil.copytree(ds4, tmp_path / "ck"), tmp_path, name, value, needle, "--mtp-only")


def test_experts_not_in_fp4_exit_2(ds4, tmp_path):
    """A bf16 cast of the experts: llama.cpp's converter cannot convert it either (it only repacks FP4)."""
    ck = shutil.copytree(ds4, tmp_path / "ck")
    rewrite_tensor(ck, "layers.3.ffn.experts.2.w2.scale", None)
    assert_bad_tensor_refused(
        ck,
        tmp_path,
        "layers.3.ffn.experts.2.w2.weight",
        torch.zeros(256, 256, dtype=torch.bfloat16),
        "must be FP4",
        "--mtp-only",
    )


def test_trunk_without_the_mtp_layer(ds4, tmp_path):
    """Copies without mtp.*: --no-mtp converts them; --mtp-only says which layer is missing."""
    ck = shutil.copytree(ds4, tmp_path / "ck")
    for n in [n for n in source_tensors(ck) if n.startswith("mtp.")]:
        rewrite_tensor(ck, n, None)
    kv, tensors = convert(ck, tmp_path / "trunk.gguf", "--no-mtp")
    assert set(tensors) == set(expected(False))
    res = run_cli("convert", ck, tmp_path / "head.gguf", "--mtp-only", "--quiet")
    assert res.exit_code == 2 and "mtp.0.*" in res.stderr and "--no-mtp" in res.stderr, res.output


def test_dspark_stages_in_place_of_the_head(ds4, tmp_path):
    """DeepSeek-V4-Flash-0731 stores DSpark draft stages under mtp.0..2 (main_proj, markov_head, confidence_head,
    each beside a layer; names as public loaders list them, stage layers left out here): the trunk converts with
    --no-mtp, as llama.cpp's default does; keeping them says why not."""
    from tests.helpers.familycheck import add_tensors

    ck = shutil.copytree(ds4, tmp_path / "ck")
    for n in [n for n in source_tensors(ck) if n.startswith("mtp.")]:
        rewrite_tensor(ck, n, None)
    add_tensors(
        ck,
        {
            f"mtp.{i}.{n}": torch.zeros(256, 256, dtype=torch.bfloat16)
            for i in range(3)
            for n in ("main_proj.weight", "markov_head.markov_w1.weight", "confidence_head.proj.weight")
        },
    )
    _, tensors = convert(ck, tmp_path / "trunk.gguf", "--no-mtp")
    assert set(tensors) == set(expected(False))
    for args in ((), ("--mtp-only",)):
        res = run_cli("convert", ck, tmp_path / "m.gguf", "--quiet", *args)
        assert res.exit_code == 2 and "DSpark" in res.stderr and "--no-mtp" in res.stderr, res.output


@pytest.fixture(scope="module")
def head_q4(ds4, tmp_path_factory):
    """The head-only file (f16 outtype) quantized Q4_K_M with the head at q8_0 (default --mtp-type)."""
    d = tmp_path_factory.mktemp("ds4_q")
    convert(ds4, d / "head.gguf", "--mtp-only")
    res = run_cli("quantize", d / "head.gguf", d / "q.gguf", "Q4_K_M", "--allow-requantize", "--quiet")
    assert res.exit_code == 0, res.output
    return d


def test_quantize_needs_allow_requantize(head_q4, tmp_path):
    """Its FP8 tensors are Q8_0 and its experts MXFP4 already: like llama-quantize, a requantization is asked for."""
    res = run_cli("quantize", head_q4 / "head.gguf", tmp_path / "q.gguf", "Q4_K_M", "--quiet")
    assert res.exit_code == 2 and "--allow-requantize" in res.stderr, res.output


def test_q4_k_m_holds_the_head_at_q8_0(head_q4):
    _, before = read_gguf(head_q4 / "head.gguf")
    _, tensors = read_gguf(head_q4 / "q.gguf")
    for name, (qtype, data) in tensors.items():
        if name.startswith("blk.4.") and not name.endswith(
            ("norm.weight", "_base.weight", "_scale.weight", "ffn_gate_inp.weight", "attn_sinks.weight", ".bias")
        ):
            assert qtype == T.Q8_0, name  # experts (MXFP4) and the hyper-connection matrices included
        elif name.startswith("blk.4."):
            assert qtype == before[name][0], name  # norms, routers, 1-D tensors as converted
    assert tensors["token_embd.weight"][0] == T.Q4_K and tensors["output.weight"][0] == T.Q6_K


def test_inspect_and_extract_mtp(head_q4, tmp_path):
    import json

    res = run_cli("inspect", head_q4 / "q.gguf", "--json")
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    assert info["mtp_blocks"] == [4] and info["nextn_predict_layers"] == 1
    assert {t["name"] for t in info["tensors"] if t["mtp"]} == set(block(MTP))
    res = run_cli("extract-mtp", head_q4 / "q.gguf", tmp_path / "head.gguf", "--quiet")
    assert res.exit_code == 0, res.output
    _, got = read_gguf(tmp_path / "head.gguf")
    _, src = read_gguf(head_q4 / "q.gguf")
    assert set(got) == set(src)  # the head's output hyper-connection kept with its blocks
    for name, (qtype, data) in got.items():
        assert qtype == src[name][0] and np.array_equal(data, src[name][1]), name


def test_accept_on_the_head_file_alone_says_what_to_pass(head_q4):
    """The runtime runs deepseek4 (tests/runtime): a head file given as the model is one line naming --head."""
    res = run_cli("accept", head_q4 / "q.gguf")
    line = res.stderr.strip()
    assert res.exit_code == 2 and "is a head file" in line and "--head" in line and "\n" not in line, res.output


def without_chat_template(ds4, folder):
    """The checkpoint as DeepSeek ships it: no Jinja chat template (its encoding is Python code)."""
    import json

    ck = shutil.copytree(ds4, folder)
    (ck / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((ck / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (ck / "tokenizer_config.json").write_text(json.dumps(cfg))
    return ck


def test_without_a_chat_template_llama_cpps_is_written(ds4, tmp_path):
    from importlib import resources

    kv, _ = convert(without_chat_template(ds4, tmp_path / "ck"), tmp_path / "m.gguf", "--no-mtp")
    bundled = resources.files("mtpq").joinpath("data/templates/deepseek-ai-DeepSeek-V4.jinja").read_text()
    assert kv["tokenizer.chat_template"] == bundled
    kv, _ = convert(ds4, tmp_path / "own.gguf", "--no-mtp")  # the tokenizer's own wins
    assert kv["tokenizer.chat_template"] != bundled


# ----------------------------------------------------------------------------- llama.cpp


@pytest.mark.llama_cpp
@pytest.mark.parametrize("mode", ["--no-mtp", "--mtp"])
@pytest.mark.parametrize("template", [True, False], ids=["own-template", "no-template"])
def test_same_gguf_as_llama_cpp_converter(ds4, tmp_path, llama_cpp_src, mode, template):
    ck = ds4 if template else without_chat_template(ds4, tmp_path / "ck")
    out, kv, tensors, ref = convert_with_both(llama_cpp_src, ck, tmp_path, mode)
    assert_same_gguf(out, kv, tensors, ref)


@pytest.mark.llama_cpp
@pytest.mark.parametrize("mode", ["--no-mtp", "--mtp-only"])
def test_same_bytes_as_llama_quantize(ds4, tmp_path, llama_cpp_bin, mode):
    """Q4_K_M of the trunk and of the head file (--allow-requantize, --mtp-type same): every tensor's type and
    bytes equal llama-quantize's (which also requantizes the Q8_0 and MXFP4 tensors)."""
    f16 = tmp_path / "f16.gguf"
    convert(ds4, f16, "--outtype", "f16", mode)
    run([llama_cpp_bin / "llama-quantize", "--allow-requantize", f16, tmp_path / "ref.gguf", "Q4_K_M", "1"])
    res = run_cli(
        "quantize", f16, tmp_path / "ours.gguf", "Q4_K_M", "--mtp-type", "same", "--allow-requantize", "--quiet"
    )
    assert res.exit_code == 0, res.output
    (_, a), (_, b) = read_gguf(tmp_path / "ours.gguf"), read_gguf(tmp_path / "ref.gguf")
    assert set(a) == set(b)
    for name in b:
        assert a[name][0] == b[name][0] and np.array_equal(a[name][1], b[name][1]), name


@pytest.mark.llama_cpp
def test_drafts_in_llama_cpp(ds4, tmp_path, llama_cpp_bin):
    """llama.cpp loads the --no-mtp trunk with the --mtp-only head as its draft model and drafts with it."""
    assert_drafts_in_llama_cpp(ds4, tmp_path, llama_cpp_bin, one_file=False)
