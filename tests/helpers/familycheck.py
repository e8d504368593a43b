"""Checks every converter family's tests repeat: bad-input refusals, quantizing with the head at q8_0, and
the comparisons with llama.cpp (its converter, llama-quantize, llama-speculative-simple).

The expectations themselves (name/shape tables, metadata, needles) stay in each family's test file;
these helpers only run the commands and compare, so every family checks the same way.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from safetensors.torch import load_file, save_file

from tests.helpers.ggufcheck import convert, kv_types, read_gguf, source_tensors
from tests.helpers.llamacpp_ref import speculative_simple
from tests.helpers.runcli import run_cli

# our flag for each of llama.cpp's converter modes (None = the full file)
OUR_MODE = {None: (), "--no-mtp": ("--no-mtp",), "--mtp": ("--mtp-only",)}
_KEEP = ("general.architecture", "general.file_type", "general.quantization_version", "general.size_label")


def vocab(folder: Path) -> int:
    return json.loads((folder / "config.json").read_text())["vocab_size"]


def stack_experts(src: dict[str, torch.Tensor], hf: str, n_experts: int = 4) -> torch.Tensor:
    """``src[hf]``; a ``*`` in hf stands for the experts, stacked in order."""
    if "*" in hf:
        return torch.stack([src[hf.replace("*", str(e))] for e in range(n_experts)])
    return src[hf]


def expected_table(top: dict, blocks: list[dict], vocab: int, block_ids) -> dict[str, tuple[tuple[int, ...], str]]:
    """GGUF name -> (shape, HF source name) from a family's TOP and per-block tables ("V" = vocab)."""
    fix = lambda shape: tuple(vocab if d == "V" else d for d in shape)  # noqa: E731
    out = {k: (fix(s), hf) for k, (s, hf) in top.items()}
    for bid in block_ids:
        for kind, (shape, hf) in blocks[bid].items():
            out[f"blk.{bid}.{kind}"] = (fix(shape), f"model.layers.{bid}.{hf}")
    return out


def ffn_table(hf_prefix: str, ff: int, hidden: int = 256, suffix: str = "", experts: int = 0) -> dict:
    """llama.cpp's gate/up/down projections for a family's table (name -> (shape, HF name inside the block)):
    ``ffn_{gate,up,down}{suffix}.weight`` from ``{hf_prefix}{gate,up,down}_proj.weight``, gate and up
    [ff, hidden], down [hidden, ff], each behind the expert count when ``experts``."""
    lead = (experts,) if experts else ()
    return {
        f"ffn_gate{suffix}.weight": ((*lead, ff, hidden), f"{hf_prefix}gate_proj.weight"),
        f"ffn_up{suffix}.weight": ((*lead, ff, hidden), f"{hf_prefix}up_proj.weight"),
        f"ffn_down{suffix}.weight": ((*lead, hidden, ff), f"{hf_prefix}down_proj.weight"),
    }


def attn_table(q: int, kv: int, v: int | None = None, out_in: int | None = None, hidden: int = 256) -> dict:
    """attn_q/k/v/output from ``self_attn.{q,k,v,o}_proj.weight`` for a family's table: q [q, hidden], k
    [kv, hidden], v [v (kv by default), hidden], output [hidden, out_in (q by default)]."""
    return {
        "attn_q.weight": ((q, hidden), "self_attn.q_proj.weight"),
        "attn_k.weight": ((kv, hidden), "self_attn.k_proj.weight"),
        "attn_v.weight": ((kv if v is None else v, hidden), "self_attn.v_proj.weight"),
        "attn_output.weight": ((hidden, q if out_in is None else out_in), "self_attn.o_proj.weight"),
    }


def nextn_table(hidden: int = 256) -> dict:
    """The NextN block's eh_proj ([hidden, 2 * hidden]), enorm and hnorm, from HF's eh_proj, enorm, hnorm."""
    return {
        "nextn.eh_proj.weight": ((hidden, 2 * hidden), "eh_proj.weight"),
        "nextn.enorm.weight": ((hidden,), "enorm.weight"),
        "nextn.hnorm.weight": ((hidden,), "hnorm.weight"),
    }


# a block's two RMSNorms under transformers' usual names
LAYER_NORMS = {
    "attn_norm.weight": ((256,), "input_layernorm.weight"),
    "ffn_norm.weight": ((256,), "post_attention_layernorm.weight"),
}


def top_table(embed: str = "model.embed_tokens.weight", output: str | None = "lm_head.weight") -> dict:
    """token_embd, output_norm (model.norm) and, unless tied (output None), output; "V" = the vocab."""
    out = {"token_embd.weight": (("V", 256), embed), "output_norm.weight": ((256,), "model.norm.weight")}
    return out | ({"output.weight": (("V", 256), output)} if output else {})


class Experts:
    """Expected expert tensors as llama.cpp writes them: per-expert ``mlp.experts.{e}.{gate,up,down}_proj``
    stacked by expert number, or transformers' fused ``gate_up_proj`` (split in halves) and ``down_proj``."""

    def __init__(self):
        self.per_expert: dict[str, dict[int, torch.Tensor]] = {}

    def take(self, exp: dict[str, torch.Tensor], bid: int, inner: str, t: torch.Tensor) -> bool:
        """Record ``inner`` (a name inside block ``bid``) if it is an expert tensor; False if it is not."""
        if mm := re.fullmatch(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", inner):
            self.per_expert.setdefault(f"blk.{bid}.ffn_{mm[2]}_exps.weight", {})[int(mm[1])] = t
        elif inner == "mlp.experts.gate_up_proj":
            ff = t.shape[1] // 2
            exp[f"blk.{bid}.ffn_gate_exps.weight"], exp[f"blk.{bid}.ffn_up_exps.weight"] = t[:, :ff], t[:, ff:]
        elif inner == "mlp.experts.down_proj":
            exp[f"blk.{bid}.ffn_down_exps.weight"] = t
        else:
            return False
        return True

    def stacked(self) -> dict[str, torch.Tensor]:
        return {name: torch.stack([d[e] for e in sorted(d)]) for name, d in self.per_expert.items()}


def assert_values_equal(tensors: dict, exp: dict[str, torch.Tensor]):
    """The file holds exactly exp's tensors, each equal to its expected values."""
    assert set(tensors) == set(exp)
    for name, want in exp.items():
        np.testing.assert_array_equal(tensors[name][1], want.numpy(), err_msg=name)


def assert_f32_equal(tensors: dict, exp: dict[str, torch.Tensor]):
    """The file holds exactly exp's tensors, each F32 and equal to its expected values."""
    assert_values_equal(tensors, exp)
    for name in exp:
        assert tensors[name][0] == T.F32, name


def assert_f16_as_llama_cpp(tensors: dict, exp: dict[str, torch.Tensor]):
    """An f16 conversion: 1-D tensors and routers stay F32 (as llama.cpp writes them), the rest are exp in F16."""
    for name, (qtype, data) in tensors.items():
        if exp[name].dim() == 1 or "ffn_gate_inp" in name:
            assert qtype == T.F32, name
        else:
            assert qtype == T.F16, name
            np.testing.assert_array_equal(data, exp[name].numpy().astype(np.float16), err_msg=name)


HEAD_FILE_TOP = ("token_embd.weight", "output_norm.weight", "output.weight")  # what a --mtp-only file carries


def assert_kv_holds(kv: dict, want: dict) -> None:
    """Every key of ``want`` is in the metadata ``kv`` with exactly its value (the failing key named)."""
    for k, v in want.items():
        assert kv[k] == v, k


EXPECTED_KV = Path(__file__).parents[1] / "convert" / "expected_kv.json"


def assert_expected_kv(kv: dict, name: str, **from_fixture) -> None:
    """The metadata ``kv`` holds what tests/convert/expected_kv.json lists under ``name`` (a family's tiny
    release-shaped checkpoint converted to f32), each key with exactly its value; a null there is a value the
    fixture decides, passed by the key's last part (``vocab_size=...``)."""
    want = json.loads(EXPECTED_KV.read_text())[name]
    assert_kv_holds(kv, {k: from_fixture[k.rsplit(".", 1)[1]] if v is None else v for k, v in want.items()})


def assert_mode_files(
    ckpt: Path,
    tmp_path: Path,
    arch: str,
    n_trunk: int,
    names,
    *args: str,
    top: tuple[str, ...] = HEAD_FILE_TOP,
    n_mtp: int = 1,
    head_equals: dict | None = None,
) -> tuple[tuple[dict, dict], tuple[dict, dict]]:
    """``--no-mtp``: n_trunk blocks, no NextN count, every one of ``names`` (the full file's) but the n_mtp MTP
    blocks' (from block n_trunk on); ``--mtp-only``: n_trunk + n_mtp blocks, n_mtp NextN layers, the MTP blocks'
    names and ``top``, with ``head_equals`` (the full file's tensors) each tensor's values equal to its own there.
    ``args``: more convert flags. -> ((kv, tensors) of the trunk file, (kv, tensors) of the head file)."""
    mtp = tuple(f"blk.{bid}." for bid in range(n_trunk, n_trunk + n_mtp))
    trunk = convert(ckpt, tmp_path / "trunk.gguf", "--no-mtp", *args)
    assert trunk[0][f"{arch}.block_count"] == n_trunk and f"{arch}.nextn_predict_layers" not in trunk[0]
    assert set(trunk[1]) == {n for n in names if not n.startswith(mtp)}
    head = convert(ckpt, tmp_path / "head.gguf", "--mtp-only", *args)
    assert head[0][f"{arch}.block_count"] == n_trunk + n_mtp and head[0][f"{arch}.nextn_predict_layers"] == n_mtp
    assert set(head[1]) == {n for n in names if n.startswith(mtp)} | set(top)
    if head_equals is not None:
        for name, (_, data) in head[1].items():
            np.testing.assert_array_equal(data, head_equals[name][1], err_msg=name)
    return trunk, head


def assert_table_f32(tensors: dict, want: dict[str, tuple[tuple[int, ...], str]], ckpt: Path, value=None) -> None:
    """The file holds exactly ``want``'s names (GGUF name -> (shape, HF name)) at those shapes, each F32 and equal
    to ``value(src, name, hf)`` over the checkpoint's tensors ``src`` (by default the HF tensor as stored, or the
    experts stacked where hf has a ``*``: stack_experts)."""
    value = value or (lambda src, name, hf: stack_experts(src, hf))
    assert {n: tensors[n][1].shape for n in tensors} == {n: s for n, (s, _) in want.items()}
    src = source_tensors(ckpt)
    assert_f32_equal(tensors, {name: value(src, name, hf).float() for name, (_, hf) in want.items()})


def checkpoint_fixtures(prefix: str, build):
    """Module fixtures ``{prefix}_ckpt`` (the tiny checkpoint ``build(folder)`` writes) and ``{prefix}_f32``
    ((kv, tensors) of its f32 conversion, shared by the read-only checks). Bind both in the test module:
    ``x_ckpt, x_f32 = checkpoint_fixtures("x", build)``."""

    @pytest.fixture(scope="module", name=f"{prefix}_ckpt")
    def ckpt(tmp_path_factory) -> Path:
        return build(tmp_path_factory.mktemp(prefix) / "ckpt")

    @pytest.fixture(scope="module", name=f"{prefix}_f32")
    def f32(request, tmp_path_factory):
        folder = request.getfixturevalue(f"{prefix}_ckpt")
        return convert(folder, tmp_path_factory.mktemp(f"{prefix}_out") / "m.gguf", "--outtype", "f32")

    return ckpt, f32


def dequant_block_scaled(stored: dict[str, torch.Tensor], block: int = 128) -> dict[str, torch.Tensor]:
    """The float value of each stored tensor: e4m3 weights times their weight_scale_inv tile, done tile by tile."""
    dequant: dict[str, torch.Tensor] = {}
    for name, q in stored.items():
        if name.endswith("_scale_inv"):
            continue
        if q.dtype != torch.float8_e4m3fn:
            dequant[name] = q.float()
            continue
        w, s = q.float(), stored[name + "_scale_inv"]
        want = torch.empty_like(w)  # independent dequant: loop over the tiles (the last ones may be partial)
        for i in range(s.shape[0]):
            for j in range(s.shape[1]):
                tile = (slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block))
                want[tile] = w[tile] * s[i, j]
        dequant[name] = want
    return dequant


def to_fp8_dequantized(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Checkpoint folder rewritten as FP8 (e4m3, 128x128 weight_scale_inv tiles) -> (its stored tensors, their
    values by dequant_block_scaled); asserts each e4m3 tensor's round trip stays close to the weights it was made
    from (within 7% of their largest magnitude)."""
    from tests.builders.tiny import to_fp8_block_scaled

    reference = source_tensors(folder)
    to_fp8_block_scaled(folder)
    stored = source_tensors(folder)
    dequant = dequant_block_scaled(stored)
    for name, q in stored.items():
        if q.dtype == torch.float8_e4m3fn:
            assert (dequant[name] - reference[name]).abs().max() <= 0.07 * reference[name].abs().max(), name
    return stored, dequant


def built_once(tmp_path_factory, build):
    """get(variant): the checkpoint ``build(folder, variant)`` writes on first use, the same folder after."""
    cache: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in cache:
            cache[variant] = build(tmp_path_factory.mktemp(variant) / "ckpt", variant)
        return cache[variant]

    return get


# ----------------------------------------------------------------------------- bad input


def copy_with_config(src: Path, dst: Path, **config_changes) -> Path:
    """A copy of checkpoint src at dst, its config.json updated with config_changes."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(config_changes)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def rewrite_tensor(folder: Path, name: str, value: torch.Tensor | None) -> Path:
    """Replace (or with None, delete) one stored tensor, keeping the index consistent; returns its shard."""
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = folder / index["weight_map"][name]
    tensors = load_file(str(shard))
    if value is None:
        del tensors[name], index["weight_map"][name]
    else:
        tensors[name] = value
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    return shard


def add_tensors(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """Store tensors under new names in the checkpoint's last shard, keeping the index consistent; returns it."""
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = folder / sorted(set(index["weight_map"].values()))[-1]
    stored = load_file(str(shard))
    for name, value in tensors.items():
        assert name not in index["weight_map"], name
        stored[name] = value
        index["weight_map"][name] = shard.name
    save_file(stored, str(shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    return shard


def assert_bad_tensor_refused(ck: Path, tmp_path: Path, name: str, value: torch.Tensor | None, needle: str, *args: str):
    """After rewrite_tensor(ck, name, value): convert (with ``args``) exits 2 with one line holding needle and
    naming the shard (a misshaped tensor) or the folder (a missing one), writes nothing, and leaves ck unchanged."""
    shard = rewrite_tensor(ck, name, value)
    before = {p.name: p.read_bytes() for p in ck.iterdir()}
    res = run_cli("convert", ck, tmp_path / "m.gguf", "--quiet", *args)
    assert res.exit_code == 2, res.output
    line = res.stderr.strip()
    assert "\n" not in line and needle in line, line
    assert (shard.name in line) if value is not None else (str(ck) in line), line  # names the file (or folder)
    assert not (tmp_path / "m.gguf").exists() and not list(tmp_path.glob(".m.gguf*"))
    assert {p.name: p.read_bytes() for p in ck.iterdir()} == before


def assert_converts_only_with_no_mtp(ck: Path, tmp_path: Path, arch: str, n_trunk: int, needle: str):
    """A checkpoint without its MTP weights: ``--no-mtp`` converts its n_trunk blocks (no blk.{n_trunk} tensor);
    without it, convert exits 2 naming what is missing (needle) and --no-mtp, and writes no file."""
    kv, tensors = convert(ck, tmp_path / "trunk.gguf", "--no-mtp")
    assert kv[f"{arch}.block_count"] == n_trunk and not any(n.startswith(f"blk.{n_trunk}.") for n in tensors)
    res = run_cli("convert", ck, tmp_path / "m.gguf", "--quiet")
    assert res.exit_code == 2 and needle in res.stderr and "--no-mtp" in res.stderr
    assert not (tmp_path / "m.gguf").exists()


# ----------------------------------------------------------------------------- mtpq quantize / inspect


def quantize_q4_k_m(ckpt: Path, tmp_path: Path, one_pass: bool = True) -> dict:
    """f16 conversion then ``mtpq quantize Q4_K_M``; with one_pass, asserts ``convert --quant Q4_K_M`` in one
    pass chooses the same type for every tensor; returns the quantized file's tensors for the family's type
    checks."""
    f16 = tmp_path / "f16.gguf"
    convert(ckpt, f16, "--outtype", "f16")
    out = tmp_path / "q.gguf"
    res = run_cli("quantize", f16, out, "Q4_K_M", "--quiet")
    assert res.exit_code == 0, res.output
    _, tensors = read_gguf(out)
    if not one_pass:
        return tensors
    one = tmp_path / "one.gguf"  # convert --quant makes the same choices straight from the checkpoint
    res = run_cli("convert", ckpt, one, "--outtype", "f16", "--quant", "Q4_K_M", "--quiet")
    assert res.exit_code == 0, res.output
    _, direct = read_gguf(one)
    assert {n: t for n, (t, _) in direct.items()} == {n: t for n, (t, _) in tensors.items()}
    return tensors


def assert_head_at_q8_0(tensors: dict, shapes: dict, head: str | tuple[str, ...]) -> None:
    """A Q4_K_M file's types: 1-D tensors (by their ``shapes`` entry, (shape, HF name)) and routers F32, the MTP
    blocks' other tensors (names starting with ``head``) Q8_0."""
    for name, (qtype, _) in tensors.items():
        if len(shapes[name][0]) == 1 or "ffn_gate_inp" in name:
            assert qtype == T.F32, name
        elif name.startswith(head):
            assert qtype == T.Q8_0, name


def inspect_json(ckpt: Path, tmp_path: Path) -> dict:
    """``mtpq inspect --json`` of the checkpoint's f16 conversion."""
    out = tmp_path / "m.gguf"
    convert(ckpt, out, "--outtype", "f16")
    res = run_cli("inspect", out, "--json")
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


# ----------------------------------------------------------------------------- llama.cpp


def strip_general(kv: dict) -> dict:
    """Metadata without the general.* keys that name the writer (kept: the ones that describe the model)."""
    return {k: v for k, v in kv.items() if not k.startswith("general.") or k in _KEEP}


def run(cmd: list, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run a llama.cpp binary; asserts exit 0."""
    res = subprocess.run(
        [str(c) for c in cmd],
        capture_output=True,
        text=True,
        errors="replace",
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )  # a random model prints invalid UTF-8
    assert res.returncode == 0, (cmd, res.stderr[-3000:])
    return res


def mtp_drafting_log(
    llama_cpp_bin: Path, model: Path, prompt: str, n: int, *flags, banner: str = "MTP draft context"
) -> str:
    """``llama-speculative-simple -m model -p prompt -n n --temp 0 --spec-type draft-mtp *flags``: llama.cpp
    drafting with the file's MTP head. Asserts it exits 0 having built its draft context (banner in stderr);
    returns its stdout and stderr."""
    cmd = [llama_cpp_bin / "llama-speculative-simple", "-m", model, "-p", prompt, "-n", n, "--temp", "0"]
    res = run([*cmd, "--spec-type", "draft-mtp", *flags])
    assert banner in res.stderr, res.stderr[-3000:]
    return res.stdout + res.stderr


def mtp_draft_steps(llama_cpp_bin: Path, model: Path, prompt: str, n: int, *flags, **kw) -> list[tuple[int, int, int]]:
    """mtp_drafting_log at -lv 5 (kw: its banner) -> (accepted, drafted, target token) per verification step;
    asserts the head drafted."""
    log = mtp_drafting_log(llama_cpp_bin, model, prompt, n, *flags, "-lv", "5", **kw)
    step = r"accepted (\d+)/(\d+) draft tokens, the last target token is: \((\d+)\)"
    steps = [(int(a), int(d), int(t)) for a, d, t in re.findall(step, log)]
    assert sum(d for _, d, _ in steps) > 0, log[-3000:]  # the MTP head drafted
    return steps


def convert_with_both(
    llama_cpp_src: Path, ck: Path, tmp_path: Path, mode: str | None = None, *ref_args: str, raw_config: bool = False
):
    """Our f32 conversion in llama.cpp converter mode ``mode`` and llama.cpp's own (ref_args and raw_config
    passed to llamacpp_ref.llama_cpp_convert): (our path, our kv, our tensors, reference path)."""
    from tests.helpers.llamacpp_ref import llama_cpp_convert

    out = tmp_path / "ours.gguf"
    kv, tensors = convert(ck, out, "--outtype", "f32", *OUR_MODE[mode])
    ref = llama_cpp_convert(
        llama_cpp_src,
        ck,
        tmp_path / "ref.gguf",
        kv["tokenizer.ggml.pre"],
        *([mode] if mode else []),
        *ref_args,
        raw_config=raw_config,
    )
    return out, kv, tensors, ref


def assert_fp8_source_same_as_llama_cpp(llama_cpp_src: Path, ck: Path, tmp_path: Path, raw_config: bool = False):
    """Checkpoint ck rewritten as FP8 (e4m3, 128x128 weight_scale_inv tiles) dequantizes to llama.cpp's
    converter's bytes."""
    from tests.builders.tiny import to_fp8_block_scaled

    to_fp8_block_scaled(ck)
    out, kv, tensors, ref = convert_with_both(llama_cpp_src, ck, tmp_path, None, raw_config=raw_config)
    assert_same_gguf(out, kv, tensors, ref)


def assert_same_gguf(
    out: Path, kv: dict, tensors: dict, ref: Path, value_types: bool = True, ignore: tuple[str, ...] = ()
) -> dict:
    """Every metadata key and value (and with value_types, each value's GGUF type), every tensor name, type,
    shape and byte equal the reference file's (general.* writer keys aside; the keys in ignore left out of
    both); returns the reference tensors."""
    ref_kv, ref_tensors = read_gguf(ref)
    kept = lambda table: {k: v for k, v in strip_general(table).items() if k not in ignore}  # noqa: E731
    assert kept(kv) == kept(ref_kv)
    if value_types:  # bool arrays stay bools, floats stay f32
        assert kept(kv_types(out)) == kept(kv_types(ref))
    assert set(tensors) == set(ref_tensors)
    for name, (qtype, data) in tensors.items():
        ref_type, ref_data = ref_tensors[name]
        assert qtype == ref_type and data.shape == ref_data.shape, name
        np.testing.assert_array_equal(data, ref_data, err_msg=name)
    return ref_tensors


def quantize_with_both(ckpt: Path, tmp_path: Path, llama_cpp_bin: Path) -> tuple[dict, dict]:
    """f16 conversion quantized to Q4_K_M by llama-quantize and by ``mtpq quantize --mtp-type same``:
    (our tensors, llama-quantize's), asserted to hold the same names."""
    f16 = tmp_path / "f16.gguf"
    convert(ckpt, f16, "--outtype", "f16")
    ref = tmp_path / "ref.gguf"
    run([llama_cpp_bin / "llama-quantize", f16, ref, "Q4_K_M", "1"])
    ours = tmp_path / "ours.gguf"
    assert run_cli("quantize", f16, ours, "Q4_K_M", "--mtp-type", "same", "--quiet").exit_code == 0
    _, a = read_gguf(ours)
    _, b = read_gguf(ref)
    assert set(a) == set(b)
    return a, b


def assert_same_as_llama_quantize(ckpt: Path, tmp_path: Path, llama_cpp_bin: Path) -> tuple[dict, dict]:
    """quantize_with_both, and every tensor's type and bytes equal llama-quantize's: (our tensors, its)."""
    a, b = quantize_with_both(ckpt, tmp_path, llama_cpp_bin)
    for name in b:
        assert a[name][0] == b[name][0] and np.array_equal(a[name][1], b[name][1]), name
    return a, b


# --no-repack: AMX buffers cannot run MLA's 3-D attn_k_b product (see tests/convert/test_convert_deepseek2.py)
DRAFT_FLAGS = ("-c", "256", "-t", "1", "--temp", "0", "--no-repack")


def assert_drafts_in_llama_cpp(
    ckpt: Path,
    tmp_path: Path,
    llama_cpp_bin: Path,
    one_file: bool = True,
    full: tuple = ("--outtype", "f16", "--quant", "Q4_K_M"),
    flags: tuple = DRAFT_FLAGS,
    banner: str = "MTP draft context",
):
    """llama.cpp loads trunk + MTP block and drafts with it (--spec-type draft-mtp, more ``flags``): one file
    (tmp_path/full.gguf converted with ``full``, by default quantized, head at q8_0; its log shows ``banner``;
    unless not ``one_file``: a head that converts only into its own file), and a --no-mtp trunk with a
    --mtp-only head file."""
    convert(ckpt, tmp_path / "trunk.gguf", "--no-mtp")
    convert(ckpt, tmp_path / "head.gguf", "--mtp-only")
    flags = [*flags, "-p", "def add(a, b):", "-n", 16]
    runs = {"loading draft model": ["-m", tmp_path / "trunk.gguf", "-md", tmp_path / "head.gguf"]}
    if one_file:
        convert(ckpt, tmp_path / "full.gguf", *full)
        runs[banner] = ["-m", tmp_path / "full.gguf"]
    for shown, models in runs.items():
        res, stats = speculative_simple(llama_cpp_bin, *models, "--spec-type", "draft-mtp", *flags)
        assert shown in res.stderr, res.stderr[-2000:]
        assert stats["n_drafted"] > 0, res.stderr[-2000:]


def assert_refused(folder: Path, out: Path, *needles: str) -> str:
    """``mtpq convert folder out`` exits 2 with one line holding every needle, and leaves no output (nor a
    partial one); returns the line."""
    res = run_cli("convert", folder, out, "--quiet")
    assert res.exit_code == 2, res.output
    line = res.stderr.strip()
    assert "\n" not in line and all(n in line for n in needles), line
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.partial-*"))
    return line


def transformers_greedy(model_class: str, folder: Path, prompt: str, n: int) -> list[int]:
    """The ``n`` tokens transformers' ``model_class`` (its name in transformers) generates greedily in f32 after
    ``prompt``, from the checkpoint in ``folder``: the continuation llama.cpp's targets must follow."""
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(str(folder))
    model = getattr(tf, model_class).from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


def assert_targets_are_greedy(steps: list[tuple[int, int]], want: list[int], at_least: int = 5):
    """llama-speculative-simple's verification steps, (accepted drafts, target token) each, follow the greedy
    continuation want: a step accepts some drafts, then emits one target token, which must be the next of
    want. At least at_least targets are checked."""
    pos, checked = 0, 0
    for accepted, target in steps:
        pos += accepted
        if pos >= len(want):
            break
        assert target == want[pos], (steps, want)
        pos, checked = pos + 1, checked + 1
    assert checked >= at_least, steps
