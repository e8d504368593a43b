"""DeepSeek-V3.2 conversion (deepseek32): the lightning indexer, the MTP block, metadata, modes, FP8, bad input,
quantize, llama.cpp.

Expected GGUF names are written out here by hand: DeepSeek-V3's table and kv_b
split from tests/convert/test_convert_deepseek2.py (independent of mtpq), plus the indexer's
names from llama.cpp's gguf-py tensor map (``model.layers.{bid}.self_attn.indexer.*``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from tests.builders import tiny_deepseek32
from tests.helpers import mla
from tests.helpers.familycheck import (
    assert_expected_kv,
    assert_f32_equal,
    assert_mode_files,
    assert_refused,
    assert_same_as_llama_quantize,
    assert_same_gguf,
    assert_targets_are_greedy,
    assert_values_equal,
    convert_with_both,
    copy_with_config,
    mtp_draft_steps,
    quantize_q4_k_m,
    rewrite_tensor,
    to_fp8_dequantized,
    transformers_greedy,
)
from tests.helpers.ggufcheck import convert, source_tensors
from tests.helpers.runcli import run_cli

N_TRUNK, MTP = 2, 2  # 2 trunk layers; the MTP block is blk.2
INDEXER = mla.INDEXER_NAMES


def expected_gguf(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return mla.expected_mla_gguf(tensors, tiny_deepseek32.deepseek_v32_config())


@pytest.fixture(scope="module")
def ck(tmp_path_factory) -> Path:
    """A tiny DeepSeek-V3.2 checkpoint in f32 with its MTP layer, 2 shards."""
    return tiny_deepseek32.deepseek_v32(tmp_path_factory.mktemp("dsv32") / "ckpt", dtype=torch.float32)


@pytest.fixture(scope="module")
def f32(ck, tmp_path_factory):
    return convert(ck, tmp_path_factory.mktemp("dsv32_out") / "m.gguf", "--outtype", "f32")


# ----------------------------------------------------------------------------- tensors and metadata


def test_f32_every_tensor_equals_source(ck, f32):
    kv, tensors = f32
    exp = expected_gguf(source_tensors(ck))
    assert_f32_equal(tensors, exp)
    for bid in range(N_TRUNK + 1):  # every layer has its indexer, the MTP block's included
        assert {f"blk.{bid}.{g}" for g in INDEXER.values()} <= set(tensors), bid
    assert tensors["blk.2.indexer.attn_q_b.weight"][1].shape == (4 * 64, 256)
    assert tensors["blk.2.indexer.proj.weight"][1].shape == (4, 256)
    nextn = {n for n in tensors if ".nextn." in n}
    assert nextn == {
        f"blk.{MTP}.nextn.{k}.weight"
        for k in ("eh_proj", "enorm", "hnorm", "embed_tokens", "shared_head_head", "shared_head_norm")
    }


def test_f16_types(ck, tmp_path):
    """As llama.cpp's converter types them: 1-D tensors, norms, routers and the indexer's proj stay F32."""
    _, tensors = convert(ck, tmp_path / "m.gguf", "--outtype", "f16")
    for name, (qtype, data) in tensors.items():
        f32 = data.ndim == 1 or "ffn_gate_inp" in name or name.endswith("indexer.proj.weight")
        assert qtype == (T.F32 if f32 else T.F16), name


def test_metadata(f32):
    kv, _ = f32
    a = "deepseek32"
    assert_expected_kv(kv, "deepseek32")  # tests/convert/expected_kv.json
    assert kv[f"{a}.rope.scaling.yarn_log_multiplier"] == pytest.approx(0.1)  # 0.1 * mscale_all_dim


# ----------------------------------------------------------------------------- modes, inspect


def test_no_mtp_mtp_only_and_inspect(ck, f32, tmp_path):
    _, full = f32
    assert_mode_files(ck, tmp_path, "deepseek32", N_TRUNK, full, "--outtype", "f32")
    res = run_cli("inspect", tmp_path / "head.gguf", "--json")
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    assert info["arch"] == "deepseek32" and len(info["mtp_blocks"]) == 1, info.get("mtp_blocks")


# ----------------------------------------------------------------------------- FP8


def test_fp8_block_scaled_dequantized(ck, tmp_path):
    """V3.2 ships e4m3 weights (the indexer's wq_b and wk too) with 128x128 weight_scale_inv tiles."""
    fp8 = shutil.copytree(ck, tmp_path / "fp8")
    stored, dequant = to_fp8_dequantized(fp8)
    assert stored["model.layers.2.self_attn.indexer.wq_b.weight"].dtype == torch.float8_e4m3fn
    assert stored["model.layers.0.self_attn.indexer.wk.weight"].dtype == torch.float8_e4m3fn
    _, tensors = convert(fp8, tmp_path / "m.gguf", "--outtype", "f32")
    exp = expected_gguf(dequant)
    assert_values_equal(tensors, exp)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "victim", ["model.layers.2.self_attn.indexer.k_norm.bias", "model.layers.0.self_attn.indexer.weights_proj.weight"]
)
def test_missing_indexer_tensor(ck, tmp_path, victim):
    folder = copy_with_config(ck, tmp_path / "ck")
    rewrite_tensor(folder, victim, None)
    assert_refused(folder, tmp_path / "o.gguf", str(folder), f"missing tensor {victim}")


def test_indexer_shape_contradicts_config(ck, tmp_path):
    folder = copy_with_config(ck, tmp_path / "ck", index_n_heads=8)  # wq_b would have 8 * 64 rows; it has 256
    assert_refused(folder, tmp_path / "o.gguf", "indexer.wq_b.weight", "config.json implies [512, 256]", ".safetensors")


@pytest.mark.parametrize("value", [None, "2048", 0])
def test_config_without_indexer_hparams(ck, tmp_path, value):
    folder = copy_with_config(ck, tmp_path / "ck", index_topk=value)
    assert_refused(folder, tmp_path / "o.gguf", "config.json", "index_topk")


# ----------------------------------------------------------------------------- quantize, accept


def test_q4_k_m_holds_the_mtp_block_at_q8_0(ck, tmp_path):
    tensors = quantize_q4_k_m(ck, tmp_path)
    n_mtp = 0
    for name, (qtype, _) in tensors.items():
        if name.startswith(f"blk.{MTP}.") and qtype not in (T.F32, T.F16):  # F16: rows not a multiple of 32
            assert qtype == T.Q8_0, name
            n_mtp += 1
    assert n_mtp >= 12 and tensors[f"blk.{MTP}.indexer.attn_q_b.weight"][0] == T.Q8_0
    assert tensors["blk.1.ffn_up_exps.weight"][0] == T.Q4_K
    assert tensors["blk.1.indexer.proj.weight"][0] != T.Q8_0  # the trunk follows the preset


def test_accept_runs_deepseek32(f32, ck, tmp_path):
    """The torch runtime runs the file (tests/runtime/test_runtime_dsa.py and the parity tests hold it to
    transformers and llama.cpp): greedy speculative output equals plain greedy output."""
    gguf_path = tmp_path / "m.gguf"
    convert(ck, gguf_path)
    res = run_cli("accept", gguf_path, "--device", "cpu", "--max-prompts", 1, "-n", 8, "--json", "-")
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["engine"] == "torch" and rep["drafts"] > 0 and rep["greedy_outputs_identical"] is True


# ----------------------------------------------------------------------------- llama.cpp


@pytest.mark.llama_cpp
@pytest.mark.parametrize("mode", [None, "--no-mtp", "--mtp"])
def test_same_gguf_as_llama_cpp_converter(ck, tmp_path, llama_cpp_src, mode):
    """Names, shapes, types, metadata keys, values and value types, and f32 bytes equal llama.cpp's
    DeepseekV32Model output (which keeps the MTP block, indexer included)."""
    out, kv, tensors, ref = convert_with_both(llama_cpp_src, ck, tmp_path, mode)
    assert_same_gguf(out, kv, tensors, ref)


@pytest.mark.llama_cpp
def test_same_types_and_bytes_as_llama_quantize(ck, tmp_path, llama_cpp_bin):
    """With --mtp-type same, Q4_K_M equals llama-quantize tensor for tensor, MTP block and indexer included."""
    assert_same_as_llama_quantize(ck, tmp_path, llama_cpp_bin)


def _speculative(llama_cpp_bin: Path, gguf_path: Path, prompt: str, n: int) -> list[tuple[int, int, int]]:
    """llama-speculative-simple with the MTP head: (accepted, drafted, target token) per verification step."""
    # --no-repack: AMX repacking cannot run MLA's 3-D attn_k_b product (see tests/convert/test_convert_deepseek2.py)
    flags = ("-t", "1", "-c", "256", "--no-repack")
    return mtp_draft_steps(llama_cpp_bin, gguf_path, prompt, n, *flags, banner="creating MTP draft context")


@pytest.mark.llama_cpp
def test_llama_cpp_drafts_with_the_head(ck, tmp_path, llama_cpp_bin):
    """index_topk 4: on this prompt the indexer drops keys in every layer, the head's included."""
    gguf_path = tmp_path / "m.gguf"
    convert(ck, gguf_path, "--outtype", "f32")
    assert len(_speculative(llama_cpp_bin, gguf_path, "def add(a, b):", 10)) >= 5


@pytest.mark.llama_cpp
@pytest.mark.parametrize("indexer", ["keeps_every_key", "top_4"])
def test_llama_cpp_greedy_tokens_equal_transformers(tmp_path, llama_cpp_bin, indexer):
    """llama.cpp's greedy tokens, produced while drafting with the head, equal transformers'
    DeepseekV32ForCausalLM on the same checkpoint.

    keeps_every_key: index_topk above the sequence length, so MLA, MoE, yarn and the MTP wiring are compared
    alone. top_4: the indexer picks 4 keys per query in every layer, and the continuation differs from
    keeping every key (checked), so its four tensors and three metadata keys are compared end to end. That
    needs a model without exact ties at the top-k boundary: with 4 heads and random-sign weights many keys
    score exactly 0 (every head's ReLU(q.k) is 0), and the two engines break such ties differently.
    """
    prompt, n = "def add(a, b):", 10
    config = (
        dict(index_topk=2048) if indexer == "keeps_every_key" else dict(index_n_heads=16, positive_index_weights=True)
    )
    folder = tiny_deepseek32.deepseek_v32(tmp_path / "ck", dtype=torch.float32, **config)
    gguf_path = tmp_path / "m.gguf"
    convert(folder, gguf_path, "--outtype", "f32")
    steps = _speculative(llama_cpp_bin, gguf_path, prompt, n)
    want = transformers_greedy("DeepseekV32ForCausalLM", folder, prompt, n + 4)
    if indexer == "top_4":
        every_key = copy_with_config(folder, tmp_path / "every_key", index_topk=2048)
        # the indexer's choice shows in the tokens
        assert transformers_greedy("DeepseekV32ForCausalLM", every_key, prompt, n + 4)[:8] != want[:8]
    assert_targets_are_greedy([(accepted, target) for accepted, _, target in steps], want)
