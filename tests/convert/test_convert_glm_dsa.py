"""GLM-5.x (glm-dsa) and GLM-4.7-Flash (deepseek2) conversion: MLA as llama.cpp writes it, GLM-5's
sparse-attention indexer, the MTP block, metadata, modes, FP8, bad input, llama.cpp parity and drafting.

Expected GGUF names are written out here by hand (from llama.cpp's gguf-py tensor map for glm-dsa /
deepseek2 and conversion/glm.py); the kv_b_proj split is derived here per head from the safetensors.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from tests.builders import tiny, tiny_glm_dsa
from tests.helpers import mla
from tests.helpers.familycheck import (
    assert_drafts_in_llama_cpp,
    assert_expected_kv,
    assert_f32_equal,
    assert_mode_files,
    assert_refused,
    assert_same_gguf,
    assert_values_equal,
    checkpoint_fixtures,
    convert_with_both,
    copy_with_config,
    dequant_block_scaled,
)
from tests.helpers.ggufcheck import convert, source_tensors
from tests.helpers.runcli import run_cli

CFG = tiny_glm_dsa.glm_dsa_config()
N_TRUNK = CFG["num_hidden_layers"]  # 4: blk.4 is GLM-5's MTP block
LITE_TRUNK = tiny_glm_dsa.glm4_moe_lite_config()["num_hidden_layers"]  # 2: blk.2 is GLM-4.7-Flash's

F32_ALWAYS = ("ffn_gate_inp.weight", "indexer.proj.weight")  # kept F32 by llama.cpp's converter at any outtype


def expected_gguf(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return mla.expected_mla_gguf(tensors, CFG)


# a tiny GLM-5.2-style checkpoint in f32: 4 layers (indexers full, full, shared, full) + the MTP layer
dsa_ckpt, dsa_f32 = checkpoint_fixtures("dsa", lambda f: tiny_glm_dsa.glm_dsa(f, dtype=torch.float32))


# a tiny GLM-4.7-Flash checkpoint in f32: 2 layers + the MTP layer
lite_ckpt, lite_f32 = checkpoint_fixtures("lite", lambda f: tiny_glm_dsa.glm4_moe_lite(f, dtype=torch.float32))


def _rewrite(ck: Path, edit) -> None:
    """Apply ``edit(name, tensor) -> tensor or None`` (None drops it) to every stored tensor."""
    from safetensors.torch import load_file, save_file

    index_path = ck / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for shard in sorted(set(index["weight_map"].values())):
        kept = {}
        for n, t in load_file(str(ck / shard)).items():
            if (new := edit(n, t)) is not None:
                kept[n] = new
            else:
                del index["weight_map"][n]
        save_file(kept, str(ck / shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))


# ----------------------------------------------------------------------------- GLM-5.x tensors


def test_f32_every_tensor_equals_source(dsa_ckpt, dsa_f32):
    _, tensors = dsa_f32
    exp = expected_gguf(source_tensors(dsa_ckpt))
    assert_f32_equal(tensors, exp)
    assert not any("attn_kv_b" in n for n in tensors)  # only the split k_b / v_b, as llama.cpp writes them


def test_indexer_only_in_full_layers_and_the_mtp_block(dsa_f32):
    kv, tensors = dsa_f32
    kinds = {"attn_q_b", "attn_k", "k_norm", "proj"}
    for bid, kind in enumerate(CFG["indexer_types"] + ["mtp"]):
        got = {n.split(".")[3] for n in tensors if n.startswith(f"blk.{bid}.indexer.")}
        assert got == (set() if kind == "shared" else kinds), (bid, kind)
    assert tensors["blk.0.indexer.attn_q_b.weight"][1].shape == (4 * 64, 256)  # index_n_heads*index_head_dim, q_lora
    assert tensors["blk.0.indexer.proj.weight"][1].shape == (4, 256)
    assert kv["glm-dsa.attention.indexer.types"] == [True, True, False, True]


def test_mtp_block_present(dsa_f32):
    kv, tensors = dsa_f32
    mtp = N_TRUNK
    assert kv["glm-dsa.nextn_predict_layers"] == 1 and kv["glm-dsa.block_count"] == N_TRUNK + 1
    nextn = {n for n in tensors if ".nextn." in n}
    assert nextn == {
        f"blk.{mtp}.nextn.{k}.weight"
        for k in ("eh_proj", "enorm", "hnorm", "embed_tokens", "shared_head_head", "shared_head_norm")
    }
    trunk_kinds = {n.split(".", 2)[2] for n in tensors if n.startswith("blk.3.")}  # a full-indexer MoE layer
    mtp_kinds = {n.split(".", 2)[2] for n in tensors if n.startswith(f"blk.{mtp}.") and ".nextn." not in n}
    assert mtp_kinds == trunk_kinds and {"attn_k_b.weight", "ffn_gate_exps.weight"} <= mtp_kinds


def test_f16_types(dsa_ckpt, tmp_path):
    _, tensors = convert(dsa_ckpt, tmp_path / "m.gguf", "--outtype", "f16")
    exp = expected_gguf(source_tensors(dsa_ckpt))
    for name, (qtype, data) in tensors.items():
        if exp[name].dim() == 1 or name.endswith(F32_ALWAYS):
            assert qtype == T.F32, name  # 1-D tensors, routers and the indexer's head weights stay f32
            np.testing.assert_array_equal(data, exp[name].numpy(), err_msg=name)
        else:
            assert qtype == T.F16, name
            np.testing.assert_array_equal(data, exp[name].numpy().astype(np.float16), err_msg=name)


def test_no_mtp_and_mtp_only(dsa_ckpt, dsa_f32, tmp_path):
    _, full = dsa_f32
    assert_mode_files(dsa_ckpt, tmp_path, "glm-dsa", N_TRUNK, full, "--outtype", "f32", head_equals=full)


def test_mtp_block_without_indexer(tmp_path):
    """The MTP block's indexer is optional (llama.cpp's MTP graph runs dense attention): converts without it."""
    ck = tiny_glm_dsa.glm_dsa(tmp_path / "ck", dtype=torch.float32, mtp_indexer=False)
    _, tensors = convert(ck, tmp_path / "m.gguf", "--outtype", "f32")
    assert not any(n.startswith(f"blk.{N_TRUNK}.indexer.") for n in tensors)
    assert f"blk.{N_TRUNK}.nextn.eh_proj.weight" in tensors and "blk.3.indexer.proj.weight" in tensors


def test_glm5_config_without_indexer_types(dsa_ckpt, dsa_f32, tmp_path):
    """GLM-5 / 5.1 configs list no indexer_types: every layer runs its indexer (transformers' default), so the
    shared layer 2 of the tiny checkpoint now lacks its indexer -> one line naming it; all-full checkpoints convert."""
    cfg = json.loads((dsa_ckpt / "config.json").read_text())
    del cfg["indexer_types"]
    ck = copy_with_config(dsa_ckpt, tmp_path / "ck")
    (ck / "config.json").write_text(json.dumps(cfg))
    line = assert_refused(ck, tmp_path / "o.gguf")
    assert "model.layers.2.self_attn.indexer." in line, line
    full = tiny_glm_dsa.glm_dsa(tmp_path / "full", dtype=torch.float32, indexer_types=None)
    assert "indexer_types" not in json.loads((full / "config.json").read_text())
    kv, tensors = convert(full, tmp_path / "full.gguf", "--outtype", "f32")
    assert kv["glm-dsa.attention.indexer.types"] == [True] * N_TRUNK
    assert all(f"blk.{b}.indexer.proj.weight" in tensors for b in range(N_TRUNK + 1))


@pytest.mark.parametrize(
    "keys",
    [
        {},
        {"index_topk_freq": 4},
        {"index_topk_freq": 3, "index_skip_topk_offset": 1},
        {"index_topk_pattern": "FFSFSSFS"},
        {"index_topk_pattern": ["full", "shared"] * 4},
    ],
)
def test_indexer_types_derived_as_transformers_does(keys):
    """Without indexer_types, the pattern comes from index_topk_freq/offset or index_topk_pattern: ours ==
    transformers' GlmMoeDsaConfig (which llama.cpp's converter reads) on 8 layers."""
    from transformers import GlmMoeDsaConfig

    from mtpq.convert.families.glm_dsa import derived_indexer_types

    cfg = {k: v for k, v in tiny_glm_dsa.glm_dsa_config(num_hidden_layers=8).items() if k != "indexer_types"}
    assert derived_indexer_types({**cfg, **keys}, 8) == GlmMoeDsaConfig(**cfg, **keys).indexer_types


@pytest.mark.parametrize("style", ["block", "per_channel"])
def test_fp8_dequantized(dsa_ckpt, tmp_path, style):
    """GLM-5-FP8 style e4m3 weights (128x128 weight_scale_inv tiles, or a per-channel weight_scale as the
    compressed-tensors copies store them), indexer included; GGUF values = the source dequantized here."""
    ck = shutil.copytree(dsa_ckpt, tmp_path / "fp8")
    (tiny.to_fp8_block_scaled if style == "block" else tiny.to_fp8_per_channel)(ck)
    stored = source_tensors(ck)
    if style == "block":
        dequant = dequant_block_scaled(stored)
    else:  # each row times its scale
        dequant = {
            name: q.float() * stored[name + "_scale"].float() if q.dtype == torch.float8_e4m3fn else q.float()
            for name, q in stored.items()
            if not name.endswith("_scale")
        }
    assert stored["model.layers.0.self_attn.indexer.wq_b.weight"].dtype == torch.float8_e4m3fn
    _, tensors = convert(ck, tmp_path / "m.gguf", "--outtype", "f32")
    exp = expected_gguf(dequant)
    assert_values_equal(tensors, exp)


# ----------------------------------------------------------------------------- GLM-5.x metadata


def test_metadata(dsa_ckpt, dsa_f32):
    kv, _ = dsa_f32
    assert_expected_kv(kv, "glm_dsa")  # tests/convert/expected_kv.json
    for k, v in {
        "glm-dsa.expert_weights_scale": 2.5,
        "glm-dsa.rope.freq_base": 1e6,
        "glm-dsa.attention.layer_norm_rms_epsilon": 1e-5,
    }.items():
        assert kv[k] == pytest.approx(v), k
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(dsa_ckpt))
    # GLM's special ids, as GLM-4.5's vocab sets them; config.json's bos_token_id (0, transformers' default for
    # glm_moe_dsa) is read first and kept by gguf-py, in llama.cpp's converter too
    assert kv["tokenizer.ggml.eot_token_id"] == tok.convert_tokens_to_ids("<|user|>")
    assert kv["tokenizer.ggml.eom_token_id"] == tok.convert_tokens_to_ids("<|observation|>")
    assert kv["tokenizer.ggml.bos_token_id"] == 0


def test_partial_rotary_factor_scales_rope_dims(dsa_ckpt, tmp_path):
    rp = json.loads((dsa_ckpt / "config.json").read_text())["rope_parameters"]
    ck = copy_with_config(dsa_ckpt, tmp_path / "ck", rope_parameters={**rp, "partial_rotary_factor": 0.5})
    kv, _ = convert(ck, tmp_path / "m.gguf", "--outtype", "f32")
    assert kv["glm-dsa.rope.dimension_count"] == 16


# ----------------------------------------------------------------------------- GLM-5.x bad input


def test_missing_indexer_tensor(dsa_ckpt, tmp_path):
    ck = copy_with_config(dsa_ckpt, tmp_path / "ck")
    _rewrite(ck, lambda n, t: None if n == "model.layers.3.self_attn.indexer.wk.weight" else t)
    line = assert_refused(ck, tmp_path / "o.gguf")
    assert "model.layers.3.self_attn.indexer.wk.weight" in line and str(ck) in line, line


def test_indexer_shape_contradicts_config(dsa_ckpt, tmp_path):
    ck = copy_with_config(dsa_ckpt, tmp_path / "ck", index_head_dim=32)
    line = assert_refused(ck, tmp_path / "o.gguf")
    assert "indexer" in line and "config.json implies" in line and ".safetensors" in line, line


def test_indexer_in_a_shared_layer(dsa_ckpt, tmp_path):
    """A "shared" layer stores no indexer: one there contradicts config.json."""
    ck = copy_with_config(dsa_ckpt, tmp_path / "ck", indexer_types=["full", "shared", "shared", "full"])
    line = assert_refused(ck, tmp_path / "o.gguf")
    assert "model.layers.1.self_attn.indexer." in line and "implies no such tensor" in line, line


@pytest.mark.parametrize(
    "keys",
    [
        {"indexer_types": "full"},
        {"indexer_types": ["full", "sparse", "full", "full"]},
        {"indexer_types": ["full"]},
        {"indexer_types": [{}, [], 1, "full"]},
        {"indexer_types": None, "index_topk_freq": "x"},
        {"indexer_types": None, "index_topk_pattern": 7},
    ],
)
def test_bad_indexer_types(dsa_ckpt, tmp_path, keys):
    ck = copy_with_config(dsa_ckpt, tmp_path / "ck", **keys)
    line = assert_refused(ck, tmp_path / "o.gguf")
    assert "config.json" in line and "indexer_types" in line, line


@pytest.mark.parametrize("value", [None, "4", 0])
def test_bad_indexer_hparams(dsa_ckpt, tmp_path, value):
    ck = copy_with_config(dsa_ckpt, tmp_path / "ck", index_n_heads=value)
    line = assert_refused(ck, tmp_path / "o.gguf")
    assert "config.json" in line and "index_n_heads" in line, line


def test_checkpoint_without_mtp_layer(dsa_ckpt, dsa_f32, tmp_path):
    ck = copy_with_config(dsa_ckpt, tmp_path / "ck")
    _rewrite(ck, lambda n, t: None if n.startswith(f"model.layers.{N_TRUNK}.") else t)
    line = assert_refused(ck, tmp_path / "o.gguf")
    assert f"layer {N_TRUNK}" in line and "--no-mtp" in line, line
    _, tensors = convert(ck, tmp_path / "trunk.gguf", "--no-mtp", "--outtype", "f32")
    assert set(tensors) == {n for n in dsa_f32[1] if not n.startswith(f"blk.{N_TRUNK}.")}


# ----------------------------------------------------------------------------- GLM-4.7-Flash


def test_flash_every_tensor_equals_source(lite_ckpt, lite_f32):
    kv, tensors = lite_f32
    exp = expected_gguf(source_tensors(lite_ckpt))
    assert_f32_equal(tensors, exp)
    assert {n for n in tensors if ".nextn." in n} == {
        f"blk.{LITE_TRUNK}.nextn.{k}.weight"
        for k in ("eh_proj", "enorm", "hnorm", "embed_tokens", "shared_head_head", "shared_head_norm")
    }
    assert not any(".indexer." in n for n in tensors)


def test_flash_metadata(lite_ckpt, lite_f32):
    kv, _ = lite_f32
    # expert_gating_func: no scoring_func in the release's config.json: sigmoid is written anyway (see glm4moe_lite.py)
    assert_expected_kv(kv, "glm_dsa_flash")  # tests/convert/expected_kv.json
    assert kv["deepseek2.expert_weights_scale"] == pytest.approx(1.8)
    assert kv["deepseek2.rope.freq_base"] == pytest.approx(1e6)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(lite_ckpt))
    assert kv["tokenizer.ggml.eot_token_id"] == tok.convert_tokens_to_ids("<|user|>")


def test_flash_no_mtp_and_mtp_only(lite_ckpt, lite_f32, tmp_path):
    _, full = lite_f32
    mtp = f"blk.{LITE_TRUNK}."
    kv, tensors = convert(lite_ckpt, tmp_path / "trunk.gguf", "--no-mtp", "--outtype", "f32")
    assert kv["deepseek2.block_count"] == LITE_TRUNK and set(tensors) == {n for n in full if not n.startswith(mtp)}
    kv, tensors = convert(lite_ckpt, tmp_path / "head.gguf", "--mtp-only", "--outtype", "f32")
    assert set(tensors) == (
        {n for n in full if n.startswith(mtp)} | {"token_embd.weight", "output_norm.weight", "output.weight"}
    )


def test_flash_shape_contradicts_config(lite_ckpt, tmp_path):
    ck = copy_with_config(lite_ckpt, tmp_path / "ck", v_head_dim=32)
    line = assert_refused(ck, tmp_path / "o.gguf")
    assert "config.json implies" in line and ".safetensors" in line, line


def test_inspect_shows_the_head(dsa_ckpt, lite_ckpt, tmp_path):
    for ck, arch, n in ((dsa_ckpt, "glm-dsa", N_TRUNK), (lite_ckpt, "deepseek2", LITE_TRUNK)):
        out = tmp_path / f"{arch}.gguf"
        convert(ck, out, "--outtype", "q8_0")
        res = run_cli("inspect", out, "--json")
        assert res.exit_code == 0, res.output
        info = json.loads(res.stdout)
        assert info["arch"] == arch and info["mtp_blocks"] == [n] and info["trunk_blocks"] == n


def test_flash_runs_in_the_torch_runtime_as_transformers(lite_ckpt, lite_f32, tmp_path):
    """The Flash GGUF is deepseek2, so mtpq's runtime (accept) runs it: trunk logits == transformers'
    Glm4MoeLiteForCausalLM on the same checkpoint (f32), over a whole prompt and token by token. Depends on the
    expert_gating_func we write: routed with softmax (what the key's absence means) the logits move by ~0.05."""
    from transformers import Glm4MoeLiteForCausalLM

    from mtpq.runtime.families import load

    out = tmp_path / "m.gguf"
    convert(lite_ckpt, out, "--outtype", "f32")
    model = load(out)
    hf = Glm4MoeLiteForCausalLM.from_pretrained(str(lite_ckpt), dtype=torch.float32).eval()
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    scale = ref.abs().max().item()
    assert (model.trunk(ids, use_cache=False).logits - ref).abs().max().item() <= 1e-4 * scale
    model.reset()
    parts = [model.trunk(ids[:, :12]).logits] + [model.trunk(ids[:, i : i + 1]).logits for i in range(12, 24)]
    assert (torch.cat(parts, dim=1) - ref).abs().max().item() <= 1e-4 * scale


# ----------------------------------------------------------------------------- quantize


@pytest.mark.parametrize("which", ["glm5", "flash"])
def test_q4_k_m_with_the_head_at_q8_0(dsa_ckpt, lite_ckpt, tmp_path, which):
    ck, n = (dsa_ckpt, N_TRUNK) if which == "glm5" else (lite_ckpt, LITE_TRUNK)
    kv, tensors = convert(ck, tmp_path / "q.gguf", "--quant", "Q4_K_M")
    mtp = {name: q for name, (q, d) in tensors.items() if name.startswith(f"blk.{n}.")}
    for name, q in mtp.items():
        if name.endswith(("norm.weight", ".bias", "ffn_gate_inp.weight")):
            assert q == T.F32, name
        else:
            assert q == T.Q8_0, name  # the whole MTP block, its MLA split and (GLM-5) indexer included
    assert tensors["blk.1.ffn_gate_exps.weight"][0] == T.Q4_K and tensors["blk.1.attn_q_b.weight"][0] == T.Q4_K


# ----------------------------------------------------------------------------- llama.cpp


def _same_as_llama_cpp(src: Path, ck: Path, tmp_path: Path, mode: str | None, ignore: tuple[str, ...] = ()):
    # metadata values compared, not their GGUF types; general.* provenance keys left out (see familycheck)
    out, kv, tensors, ref = convert_with_both(src, ck, tmp_path, mode)
    assert_same_gguf(out, kv, tensors, ref, value_types=False, ignore=ignore)
    return kv


@pytest.mark.llama_cpp
@pytest.mark.parametrize("mode", [None, "--no-mtp", "--mtp"])
def test_glm5_same_gguf_as_llama_cpp_converter(dsa_ckpt, tmp_path, llama_cpp_src, mode):
    """llama.cpp's GlmMoeDsaModel keeps the MTP block: names, shapes, types, f32 bytes and every metadata
    key and value are identical, in all three modes."""
    _same_as_llama_cpp(llama_cpp_src, dsa_ckpt, tmp_path, mode)


@pytest.mark.llama_cpp
def test_glm5_config_without_indexer_types_same_as_llama_cpp(tmp_path, llama_cpp_src):
    """A GLM-5 / 5.1 config (no indexer_types): llama.cpp writes the list transformers derives; so do we."""
    ck = tiny_glm_dsa.glm_dsa(tmp_path / "ck", dtype=torch.float32, indexer_types=None)
    kv = _same_as_llama_cpp(llama_cpp_src, ck, tmp_path, None)
    assert kv["glm-dsa.attention.indexer.types"] == [True] * N_TRUNK


@pytest.mark.llama_cpp
@pytest.mark.parametrize("mode", [None, "--no-mtp", "--mtp"])
def test_flash_same_gguf_as_llama_cpp_converter(lite_ckpt, tmp_path, llama_cpp_src, mode):
    """llama.cpp's Glm4MoeLiteModel keeps the MTP block too; the one difference is the gating function key,
    which it leaves to its loader's guess (see glm4moe_lite.py)."""
    kv = _same_as_llama_cpp(llama_cpp_src, lite_ckpt, tmp_path, mode, ignore=("deepseek2.expert_gating_func",))
    assert kv["deepseek2.expert_gating_func"] == 2


@pytest.mark.llama_cpp
@pytest.mark.parametrize("which", ["glm5", "flash"])
def test_loads_and_drafts_in_llama_cpp(dsa_ckpt, lite_ckpt, llama_cpp_bin, tmp_path, which):
    """llama.cpp loads trunk + MTP (both archs have an MTP graph: glm-dsa.cpp, deepseek2.cpp), builds the MTP
    draft context and drafts -- from one Q4_K_M file with the head at q8_0, and from --no-mtp + --mtp-only files."""
    ck = dsa_ckpt if which == "glm5" else lite_ckpt
    full, banner = ("--quant", "Q4_K_M"), "creating MTP draft context"
    assert_drafts_in_llama_cpp(ck, tmp_path, llama_cpp_bin, full=full, banner=banner)
