"""The damaged-input corpus: every bad input is one line on stderr, the right exit code, nothing written.

Each case builds one damaged input (a checkpoint, a GGUF, a prompts file, a recipe or
an option) in its own folder, runs the command as a user would, and checks the
promise the README makes for bad input:
- the exit code (2 for bad input or usage),
- exactly one line on stderr, starting with ``error:``, naming the file/option/key
  (the case's ``needles``), and no traceback anywhere in the output,
- no file left in the output folder (neither the output nor a ``.partial-PID``),
- every input byte-identical afterwards.

The damaged files are made from good ones that convert, so each case's failure is
caused by its damage alone (``test_the_good_inputs_pass`` checks the baseline).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.gguf_writer import GGUFValue
from safetensors.torch import load_file, save_file

from mtpq.convert import BlockSelection, plan_checkpoint  # noqa: E402
from mtpq.gguf_io import SplitRule, plan_from_gguf, write_plan  # noqa: E402
from tests.builders import (
    tiny,  # noqa: E402
    tiny_deepseek2,  # noqa: E402
    tiny_mimo2,  # noqa: E402
    tiny_qwen35,  # noqa: E402
    tiny_step35,  # noqa: E402
)
from tests.helpers.runcli import run_cli  # noqa: E402

# ----------------------------------------------------------------------------- the good inputs


@pytest.fixture(scope="module")
def bases(tmp_path_factory, glm_ckpt) -> dict[str, Path]:
    """Good inputs every case copies from: five checkpoints, two GGUFs (with and without head) and the full one
    split in 4 and in 3 shards (folders of ``model-0000k-of-0000N.gguf``)."""
    root = tmp_path_factory.mktemp("bases")
    qwen = tiny_qwen35.qwen35(root / "qwen35")
    ds = tiny_deepseek2.deepseek_v3(root / "ds", dtype=torch.float32)
    step = tiny_step35.step35(root / "step35")
    mimo = tiny_mimo2.mimo2(root / "mimo2")
    full, trunk = root / "full.gguf", root / "trunk.gguf"
    write_plan(plan_checkpoint(glm_ckpt), full)
    write_plan(plan_checkpoint(glm_ckpt, mtp=BlockSelection.DROP), trunk)
    prompts = root / "prompts.jsonl"
    prompts.write_text('{"category": "code", "prompt": "def f(x):"}\n')
    splits = {}
    for key, size, n in (("split", 2_000_000, 4), ("split3", 3_000_000, 3)):
        (root / key).mkdir()
        assert len(write_plan(plan_from_gguf(full), root / key / "model.gguf", split=SplitRule(max_size=size))) == n
        splits[key] = root / key
    return {
        "glm": glm_ckpt,
        "qwen35": qwen,
        "ds": ds,
        "step35": step,
        "mimo2": mimo,
        "full": full,
        "trunk": trunk,
        "prompts": prompts,
        **splits,
    }


@dataclass
class Case:
    """A folder of inputs (``inp``) and an empty output folder (``out``) for one damaged run."""

    root: Path
    bases: dict[str, Path]

    @property
    def inp(self) -> Path:
        return self.root / "in"

    @property
    def out(self) -> Path:
        return self.root / "out"

    def copy(self, key: str, name: str | None = None) -> Path:
        src = self.bases[key]
        dst = self.inp / (name or src.name)
        (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
        return dst

    # -- checkpoint edits ---------------------------------------------------------------

    def ckpt(self, key: str = "glm") -> Path:
        return self.copy(key, key)

    def config(self, folder: Path, **changes) -> Path:
        cfg = json.loads((folder / "config.json").read_text())
        for k, v in changes.items():
            if v is _DELETE:
                cfg.pop(k, None)
            else:
                cfg[k] = v
        (folder / "config.json").write_text(json.dumps(cfg))
        return folder

    def shard_of(self, folder: Path, tensor: str) -> Path:
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        return folder / index["weight_map"][tensor]

    def edit_tensors(self, folder: Path, fn: Callable[[dict], None]) -> Path:
        """Rewrite every shard through ``fn(tensors)`` (which may add, drop or replace) and the index to match."""
        index_path = folder / "model.safetensors.index.json"
        index = json.loads(index_path.read_text())
        weight_map = {}
        for shard in sorted(set(index["weight_map"].values())):
            tensors = load_file(str(folder / shard))
            if shard == sorted(set(index["weight_map"].values()))[0]:
                tensors["__first_shard__"] = torch.zeros(0)
            fn(tensors)
            tensors.pop("__first_shard__", None)
            save_file(tensors, str(folder / shard), metadata={"format": "pt"})
            weight_map.update({n: shard for n in tensors})
        index["weight_map"] = weight_map
        index_path.write_text(json.dumps(index))
        return folder

    def drop(self, folder: Path, *names: str) -> Path:
        def fn(t: dict) -> None:
            for n in list(t):
                if n in names or any(n.startswith(p) for p in names if p.endswith(".")):
                    del t[n]

        return self.edit_tensors(folder, fn)

    def replace(self, folder: Path, name: str, make: Callable[[torch.Tensor], torch.Tensor]) -> Path:
        def fn(t: dict) -> None:
            if name in t:
                t[name] = make(t[name])

        return self.edit_tensors(folder, fn)

    def add(self, folder: Path, name: str, value: torch.Tensor) -> Path:
        def fn(t: dict) -> None:
            if "__first_shard__" in t:
                t[name] = value

        return self.edit_tensors(folder, fn)

    def header(self, shard: Path, fn: Callable[[dict, bytearray], bytes | None]) -> Path:
        """Rewrite one shard's safetensors header (and optionally its data) through ``fn(header, data)``."""
        raw = shard.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        data = bytearray(raw[8 + n :])
        new_data = fn(header, data)
        text = json.dumps(header).encode()
        shard.write_bytes(struct.pack("<Q", len(text)) + text + bytes(new_data if new_data is not None else data))
        return shard

    # -- GGUF edits ---------------------------------------------------------------------

    def gguf(self, key: str = "full", name: str = "model.gguf", **kv) -> Path:
        """A copy of a good GGUF, its metadata changed by ``kv`` (key -> (value, GGUFValueType))."""
        if not kv:
            return self.copy(key, name)
        plan = plan_from_gguf(self.bases[key])
        for k, (value, vtype) in kv.items():
            plan.set_kv(k, value, vtype)
        dst = self.inp / name
        write_plan(plan, dst)
        return dst

    def tensor_info(self, name: str, **fields: int | str) -> Path:
        """A copy of the full GGUF with one tensor info patched: ``ggml_type=N``, ``offset_of=OTHER``
        (claim another tensor's data offset) or ``zero_dim=D`` (dimension D, GGUF's order, set to 0)."""
        dst = self.copy("full", "model.gguf")
        raw = bytearray(dst.read_bytes())

        def info_at(tensor: str) -> int:  # where the n_dims field of ``tensor``'s info starts
            key = struct.pack("<Q", len(tensor)) + tensor.encode()
            return raw.index(key) + len(key)

        def layout(at: int) -> tuple[int, int]:  # (type offset, data-offset offset)
            n_dims = struct.unpack_from("<I", raw, at)[0]
            t = at + 4 + 8 * n_dims
            return t, t + 4

        type_at, off_at = layout(info_at(name))
        if "zero_dim" in fields:
            struct.pack_into("<Q", raw, info_at(name) + 4 + 8 * fields["zero_dim"], 0)
        if "ggml_type" in fields:
            struct.pack_into("<I", raw, type_at, fields["ggml_type"])
        if "offset_of" in fields:
            _, other = layout(info_at(fields["offset_of"]))
            raw[off_at : off_at + 8] = raw[other : other + 8]
        dst.write_bytes(bytes(raw))
        return dst

    def shards(self, key: str = "split") -> list[Path]:
        """A copy of a split set in the input folder: its shards, in order."""
        for p in sorted(self.bases[key].iterdir()):
            shutil.copy(p, self.inp / p.name)
        return sorted(self.inp.glob("model-*-of-*.gguf"))

    def rewrite(
        self,
        path: Path,
        kv: dict | None = None,
        drop_keys: tuple[str, ...] = (),
        add: list | None = None,
        drop_last: bool = False,
    ) -> Path:
        """Rewrite one GGUF (a shard) through gguf-py: metadata ``kv`` set (key -> (value, type)) or dropped,
        tensors (gguf-py ReaderTensors) added or its last one dropped."""
        r = GGUFReader(path)
        arch = r.fields.get("general.architecture")
        tensors = list(r.tensors)[:-1] if drop_last else list(r.tensors)
        tmp = path.with_name("rewritten.tmp")
        w = GGUFWriter(tmp, arch.contents() if arch else "none")
        w.kv_data[0].clear()  # the fields as they are, general.architecture included where it is
        for name, f in r.fields.items():
            if not name.startswith("GGUF.") and name not in drop_keys:
                vtype = GGUFValueType(f.types[0])
                sub = GGUFValueType(f.types[-1]) if vtype == GGUFValueType.ARRAY else None
                w.kv_data[0][name] = GGUFValue(f.contents(), vtype, sub)
        for name, (value, vtype) in (kv or {}).items():
            w.kv_data[0][name] = GGUFValue(value, vtype)
        for t in [*tensors, *(add or [])]:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=GGMLQuantizationType(t.tensor_type))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        del r
        tmp.replace(path)
        return path

    def truncated(self, key: str = "full", cut: int = 1000) -> Path:
        dst = self.copy(key, "model.gguf")
        with open(dst, "r+b") as f:
            f.truncate(dst.stat().st_size - cut)
        return dst


_DELETE = object()


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


U32 = GGUFValueType.UINT32


def _first(header: dict, pred: Callable[[str], bool] = lambda n: True) -> str:
    return next(
        n
        for n in sorted(header, key=lambda n: header[n]["data_offsets"][0] if n != "__metadata__" else -1)
        if n != "__metadata__" and pred(n)
    )


def _by_offset(header: dict) -> list[str]:
    return sorted((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][0])


# ----------------------------------------------------------------------------- the corpus

CASES: dict[str, Callable[[Case], tuple]] = {}


def case(name: str):
    def deco(fn):
        assert name not in CASES, name
        CASES[name] = fn
        return fn

    return deco


def conv(c: Case, folder: Path, *extra: str) -> list:
    return ["convert", folder, c.out / "o.gguf", "--quiet", *extra]


def file_cases(table: dict[str, tuple[str, str | bytes | None, list[str]]]) -> None:
    """Cases ``{name: (file, content, needles)}``: convert a checkpoint whose ``file`` holds ``content`` (text or
    bytes; None: the file removed) and expect the ``needles``."""

    def run(c: Case, file: str, content, needles: list[str]) -> tuple:
        f = c.ckpt()
        if content is None:
            (f / file).unlink()
        elif isinstance(content, bytes):
            (f / file).write_bytes(content)
        else:
            (f / file).write_text(content)
        return conv(c, f), needles

    for name, (file, content, needles) in table.items():
        case(name)(lambda c, fi=file, co=content, nd=needles: run(c, fi, co, nd))


# --- convert: config.json ----------------------------------------------------------------

_CONFIG_CASES = {
    "layers-string": (dict(num_hidden_layers="four"), "num_hidden_layers must be an integer"),
    "layers-bool": (dict(num_hidden_layers=True), "num_hidden_layers must be an integer"),
    "layers-float": (dict(num_hidden_layers=2.5), "num_hidden_layers must be an integer"),
    "hidden-negative": (dict(hidden_size=-256), "hidden_size must be positive"),
    "vocab-zero": (dict(vocab_size=0), "vocab_size must be positive"),
    "heads-zero": (dict(num_attention_heads=0), "num_attention_heads must be positive"),
    "nextn-negative": (dict(num_nextn_predict_layers=-1), "num_nextn_predict_layers must be at least 0"),
    "experts-string": (dict(n_routed_experts="4"), "n_routed_experts must be an integer"),
    "eps-string": (dict(rms_norm_eps="small"), "rms_norm_eps must be a number"),
    "tie-string": (dict(tie_word_embeddings="no"), "tie_word_embeddings must be true or false"),
    "architectures-string": (dict(architectures="Glm4MoeForCausalLM"), "architectures must be a list of strings"),
    "architectures-unknown": (dict(architectures=["FooForCausalLM"]), "unsupported architecture"),
    "architectures-missing": (dict(architectures=_DELETE), "unsupported architecture"),
    # MiMo-7B has an MTP head but no GGUF architecture anywhere: the refusal says so rather than "unknown"
    "architectures-mimo-7b": (dict(architectures=["MiMoForCausalLM"]), "llama.cpp's converter does not register"),
    "rope-scaling-string": (dict(rope_scaling="yarn"), "rope_scaling must be a JSON object"),
    "text-config-number": (dict(text_config=5), "text_config must be a JSON object"),
    "text-config-bad-value": (dict(text_config={"hidden_size": "big"}), "text_config.hidden_size must be an integer"),
    "missing-hidden-size": (dict(hidden_size=_DELETE), "missing hidden_size"),
    "missing-layers": (dict(num_hidden_layers=_DELETE), "missing num_hidden_layers"),
    "missing-vocab": (dict(vocab_size=_DELETE), "missing vocab_size"),
    "missing-moe-ff": (dict(moe_intermediate_size=_DELETE), "missing moe_intermediate_size"),
    "head-dim-contradicts": (dict(head_dim=32), "config.json implies"),
    "vocab-contradicts": (dict(vocab_size=1024), "model.embed_tokens.weight has shape"),
    "ffn-contradicts": (dict(intermediate_size=1024), "config.json implies"),
    "experts-more-than-stored": (dict(n_routed_experts=8), "config.json implies [8, 256]"),
    "experts-fewer-than-stored": (dict(n_routed_experts=2), "shape"),
    "two-mtp-layers-declared": (dict(num_nextn_predict_layers=2), "no tensors for layer 3"),
    "a-billion-layers": (
        dict(num_hidden_layers=10**9),
        "no tensors for layer 3 (model.layers.3.*; config.json has 1000000000 layers",
    ),
    "a-billion-experts": (dict(n_routed_experts=10**9), "config.json implies [1000000000, 256]"),
    "a-billion-nextn-layers": (dict(num_nextn_predict_layers=10**9), "no tensors for layer 3"),
    "dense-layer-declared-moe": (dict(first_k_dense_replace=0), "missing tensor model.layers.0.mlp.gate.weight"),
    "qk-norm-off-but-stored": (dict(use_qk_norm=False), "config.json implies no such tensor"),
    "bias-off-but-stored": (dict(attention_bias=False), "config.json implies no such tensor"),
    "bias-on-heads-contradict": (dict(num_key_value_heads=4), "config.json implies"),
    "mtp-only-without-mtp": (dict(num_nextn_predict_layers=0), "not recognised"),
    "shared-experts-zero": (dict(n_shared_experts=0), "config.json implies no such tensor"),
}
for _name, (_changes, _needle) in _CONFIG_CASES.items():
    # a bad value is blamed on config.json; a tensor that contradicts a (valid) value names the tensor
    _blames_config = any(w in _needle for w in ("must", "missing ", "unsupported", "implies"))
    case(f"convert-config-{_name}")(
        lambda c, ch=_changes, nd=_needle, cfg=_blames_config: (
            conv(c, c.config(c.ckpt(), **ch)),
            ["config.json", nd] if cfg else [nd],
        )
    )


file_cases(
    {  # config.json damaged or gone
        "convert-config-missing": ("config.json", None, ["config.json", "missing config.json"]),
        "convert-config-not-json": ("config.json", "{ not json", ["config.json", "invalid JSON"]),
        "convert-config-list": ("config.json", "[1, 2, 3]", ["config.json", "expected a JSON object"]),
        "convert-config-not-utf8": ("config.json", b'{"hidden_size": "\xff\xfe"}', ["config.json", "not UTF-8"]),
        "convert-config-empty": ("config.json", "", ["config.json", "invalid JSON"]),
    }
)


@case("convert-config-is-folder")
def _(c):
    f = c.ckpt()
    (f / "config.json").unlink()
    (f / "config.json").mkdir()
    return conv(c, f), ["config.json", "is a folder"]


# --- convert: tensors the config implies ---------------------------------------------------

_MISSING = {
    "trunk-q-proj": "model.layers.1.self_attn.q_proj.weight",
    "trunk-k-bias": "model.layers.0.self_attn.k_proj.bias",
    "trunk-q-norm": "model.layers.1.self_attn.q_norm.weight",
    "trunk-input-norm": "model.layers.0.input_layernorm.weight",
    "trunk-post-norm": "model.layers.1.post_attention_layernorm.weight",
    "trunk-dense-down": "model.layers.0.mlp.down_proj.weight",
    "trunk-router": "model.layers.1.mlp.gate.weight",
    "trunk-router-bias": "model.layers.1.mlp.gate.e_score_correction_bias",
    "trunk-expert": "model.layers.1.mlp.experts.3.up_proj.weight",
    "trunk-shared-expert": "model.layers.1.mlp.shared_experts.down_proj.weight",
    "mtp-eh-proj": "model.layers.2.eh_proj.weight",
    "mtp-enorm": "model.layers.2.enorm.weight",
    "mtp-hnorm": "model.layers.2.hnorm.weight",
    "mtp-shared-head-norm": "model.layers.2.shared_head.norm.weight",
    "mtp-attn-o": "model.layers.2.self_attn.o_proj.weight",
    "mtp-expert": "model.layers.2.mlp.experts.0.gate_proj.weight",
    "mtp-router": "model.layers.2.mlp.gate.weight",
    "output-norm": "model.norm.weight",
    "lm-head": "lm_head.weight",
    "embed-tokens": "model.embed_tokens.weight",
}
for _name, _tensor in _MISSING.items():
    case(f"convert-missing-{_name}")(lambda c, t=_tensor: (conv(c, c.drop(c.ckpt(), t)), [f"missing tensor {t}"]))


@case("convert-missing-whole-mtp-layer")
def _(c):
    return conv(c, c.drop(c.ckpt(), "model.layers.2.")), ["no tensors for layer 2", "--no-mtp"]


@case("convert-missing-whole-trunk-layer")
def _(c):
    return conv(c, c.drop(c.ckpt(), "model.layers.1.")), ["no tensors for layer 1"]


@case("convert-unknown-extra-tensor")
def _(c):
    return conv(c, c.add(c.ckpt(), "model.layers.0.foo.weight", torch.zeros(4))), [
        "model.layers.0.foo.weight",
        "implies no such tensor",
    ]


_SHAPES = {
    "k-proj-transposed": ("model.layers.0.self_attn.k_proj.weight", lambda t: t.t().contiguous()),
    "eh-proj-square": ("model.layers.2.eh_proj.weight", lambda t: t[:, :256].contiguous()),
    "lm-head-short": ("lm_head.weight", lambda t: t[:-1].contiguous()),
    "norm-long": ("model.norm.weight", lambda t: torch.cat([t, t[:1]])),
    "expert-short": ("model.layers.1.mlp.experts.2.down_proj.weight", lambda t: t[:, :128].contiguous()),
    "enorm-2d": ("model.layers.2.enorm.weight", lambda t: t[None, :].contiguous()),
    "router-bias-short": ("model.layers.1.mlp.gate.e_score_correction_bias", lambda t: t[:3].contiguous()),
}
for _name, (_tensor, _make) in _SHAPES.items():
    case(f"convert-shape-{_name}")(
        lambda c, t=_tensor, mk=_make: (conv(c, c.replace(c.ckpt(), t, mk)), [t, "config.json implies"])
    )

_DTYPES = {
    "int-lm-head": ("lm_head.weight", lambda t: t.to(torch.int32), "dtype I32"),
    "int8-q-proj": ("model.layers.0.self_attn.q_proj.weight", lambda t: t.to(torch.int8), "dtype I8"),
    "bool-norm": ("model.norm.weight", lambda t: t > 1, "dtype BOOL"),
    "int64-embed": ("model.embed_tokens.weight", lambda t: t.to(torch.int64), "dtype I64"),
    "uint8-eh-proj": ("model.layers.2.eh_proj.weight", lambda t: t.to(torch.uint8), "dtype U8"),
    "fp8-without-scale": ("model.layers.0.mlp.up_proj.weight", lambda t: t.to(torch.float8_e4m3fn), "no weight_scale"),
}
for _name, (_tensor, _make, _needle) in _DTYPES.items():
    case(f"convert-dtype-{_name}")(
        lambda c, t=_tensor, mk=_make, nd=_needle: (conv(c, c.replace(c.ckpt(), t, mk)), [t, nd, ".safetensors"])
    )


def _fp8(c: Case, per_channel: bool = False) -> Path:
    f = c.ckpt()
    (tiny.to_fp8_per_channel if per_channel else tiny.to_fp8_block_scaled)(f)
    return f


_Q = "model.layers.0.self_attn.q_proj.weight"
_FP8 = {
    "block-scale-wrong-shape": (
        lambda c: c.replace(_fp8(c), _Q + "_scale_inv", lambda t: t[:1].contiguous()),
        [_Q + "_scale_inv", "128x128 tiles"],
    ),
    "channel-scale-wrong-shape": (
        lambda c: c.replace(_fp8(c, True), _Q + "_scale", lambda t: t[:7].contiguous()),
        [_Q + "_scale", "one scale per output row"],
    ),
    "block-size-string": (
        lambda c: c.config(_fp8(c), quantization_config={"quant_method": "fp8", "weight_block_size": "128"}),
        ["config.json", "weight_block_size must be two positive integers"],
    ),
    "block-size-zero": (
        lambda c: c.config(_fp8(c), quantization_config={"quant_method": "fp8", "weight_block_size": [0, 128]}),
        ["config.json", "weight_block_size"],
    ),
    "scale-int": (
        lambda c: c.replace(_fp8(c), _Q + "_scale_inv", lambda t: t.to(torch.int32)),
        [_Q + "_scale_inv", "dtype I32"],
    ),
    "scale-missing": (lambda c: c.drop(_fp8(c), _Q + "_scale_inv"), [_Q, "no weight_scale_inv"]),
}
for _name, (_make, _needles) in _FP8.items():
    case(f"convert-fp8-{_name}")(lambda c, mk=_make, nd=_needles: (conv(c, mk(c)), nd))


# --- convert: the safetensors container ----------------------------------------------------


def _shard(c: Case) -> tuple[Path, Path]:
    f = c.ckpt()
    return f, sorted(f.glob("*.safetensors"))[0]


def _header_case(name: str, edit: Callable[[dict, bytearray], bytes | None], *needles: str):
    @case(f"convert-safetensors-{name}")
    def _(c):
        f, shard = _shard(c)
        c.header(shard, edit)
        return conv(c, f), [shard.name, *needles]


def _overlap_full(h, d):
    a, b = _by_offset(h)[:2]
    h[b]["data_offsets"] = list(h[a]["data_offsets"])
    h[b]["shape"], h[b]["dtype"] = h[a]["shape"], h[a]["dtype"]


def _overlap_partial(h, d):
    names = _by_offset(h)
    x = names[3]
    s, e = h[x]["data_offsets"]
    h[x]["data_offsets"] = [s - 8, e - 8]


def _hole(h, d):
    names = _by_offset(h)
    cut = h[names[2]]["data_offsets"][0]
    for n in names[2:]:
        s, e = h[n]["data_offsets"]
        h[n]["data_offsets"] = [s + 16, e + 16]
    return bytes(d[:cut]) + b"\0" * 16 + bytes(d[cut:])


def _swap_order(h, d):  # both tensors keep their bytes but claim each other's range: different sizes overlap
    names = _by_offset(h)
    a, b = names[0], names[-1]
    h[a]["data_offsets"], h[b]["data_offsets"] = h[b]["data_offsets"], h[a]["data_offsets"]


def _set(key, value, which=0):
    def edit(h, d):
        h[_by_offset(h)[which]][key] = value

    return edit


_header_case("overlap-full", _overlap_full, "overlap")
_header_case("overlap-partial", _overlap_partial, "overlap")
_header_case("hole", _hole, "belong to no tensor")
_header_case("trailing-bytes", lambda h, d: bytes(d) + b"\0" * 10, "after the last tensor")
_header_case("ranges-swapped", _swap_order, "corrupt safetensors header")
_header_case("shape-not-list", _set("shape", "256"), "not a list of integers")
_header_case("shape-negative", _set("shape", [-256]), "negative dimension")
_header_case("shape-float", _set("shape", [256.0]), "not a list of integers")
_header_case("shape-bigger", _set("shape", [4096, 4096]), "does not match its shape")
_header_case("dtype-unknown", _set("dtype", "F4"), "unsupported dtype F4")
_header_case("dtype-number", _set("dtype", 7), "unsupported dtype")
_header_case("offsets-one", _set("data_offsets", [0]), "data_offsets")
_header_case("offsets-reversed", _set("data_offsets", [8, 0]), "data_offsets")
_header_case("offsets-strings", _set("data_offsets", ["0", "8"]), "data_offsets")
_header_case(
    "entry-no-dtype", lambda h, d: h[_by_offset(h)[0]].pop("dtype") and None, "corrupt safetensors header entry"
)
_header_case(
    "entry-not-object", lambda h, d: h.__setitem__(_by_offset(h)[0], [1, 2]), "corrupt safetensors header entry"
)


@case("convert-safetensors-truncated")
def _(c):
    f, shard = _shard(c)
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size - 100)
    return conv(c, f), [shard.name, "truncated safetensors file", "ends at byte"]


@case("convert-safetensors-empty-file")
def _(c):
    f, shard = _shard(c)
    shard.write_bytes(b"")
    return conv(c, f), [shard.name, "truncated safetensors file (no header)"]


@case("convert-safetensors-header-length-huge")
def _(c):
    f, shard = _shard(c)
    raw = bytearray(shard.read_bytes())
    raw[:8] = struct.pack("<Q", 1 << 40)
    shard.write_bytes(bytes(raw))
    return conv(c, f), [shard.name, "header length"]


@case("convert-safetensors-header-garbage")
def _(c):
    f, shard = _shard(c)
    raw = bytearray(shard.read_bytes())
    raw[8:20] = b"\xff" * 12
    shard.write_bytes(bytes(raw))
    return conv(c, f), [shard.name, "corrupt safetensors header"]


@case("convert-safetensors-header-list")
def _(c):
    f, shard = _shard(c)
    text = b"[1, 2, 3]"
    shard.write_bytes(struct.pack("<Q", len(text)) + text)
    return conv(c, f), [shard.name, "not a JSON object"]


@case("convert-safetensors-duplicate-key")
def _(c):
    f, shard = _shard(c)
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    name = _by_offset(header)[0]
    text = json.dumps(header)[:-1] + f', "{name}": {json.dumps(header[name])}' + "}"
    shard.write_bytes(struct.pack("<Q", len(text)) + text.encode() + raw[8 + n :])
    return conv(c, f), [shard.name, "listed twice"]


@case("convert-safetensors-shard-is-folder")
def _(c):
    f, shard = _shard(c)
    shard.unlink()
    shard.mkdir()
    return conv(c, f), ["model.safetensors.index.json", "does not exist"]


@case("convert-safetensors-tensor-in-two-shards")
def _(c):
    f = c.ckpt()
    shards = sorted(f.glob("*.safetensors"))
    first = load_file(str(shards[0]))
    second = load_file(str(shards[1]))
    name = sorted(first)[0]
    second[name] = first[name]
    save_file(second, str(shards[1]))
    return conv(c, f), ["also stored in", name]


_INDEX = "model.safetensors.index.json"
file_cases(
    {  # the safetensors index damaged
        "convert-index-not-json": (_INDEX, "{", [_INDEX, "invalid index"]),
        "convert-index-no-weight-map": (_INDEX, '{"metadata": {}}', [_INDEX, "invalid index"]),
        "convert-index-weight-map-list": (_INDEX, '{"weight_map": [1, 2]}', [_INDEX, "invalid index"]),
        "convert-index-not-utf8": (_INDEX, b'{"weight_map": {"\xff": 1}}', [_INDEX, "invalid index"]),
    }
)


@case("convert-index-shard-missing")
def _(c):
    f = c.ckpt()
    sorted(f.glob("*.safetensors"))[1].unlink()
    return conv(c, f), ["model.safetensors.index.json", "does not exist"]


@case("convert-index-wrong-shard")
def _(c):
    f = c.ckpt()
    index = json.loads((f / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, s in index["weight_map"].items() if s == shards[0])
    index["weight_map"][name] = shards[1]
    (f / "model.safetensors.index.json").write_text(json.dumps(index))
    return conv(c, f), ["model.safetensors.index.json", name]


@case("convert-no-weights")
def _(c):
    f = c.ckpt()
    for p in [*f.glob("*.safetensors"), f / "model.safetensors.index.json"]:
        p.unlink()
    return conv(c, f), ["no *.safetensors"]


# --- convert: tokenizer ---------------------------------------------------------------------

file_cases(
    {  # the tokenizer's files damaged or gone
        "convert-tokenizer-json-missing": ("tokenizer.json", None, ["tokenizer.json", "missing"]),
        "convert-tokenizer-json-corrupt": ("tokenizer.json", '{"model": ', ["tokenizer.json", "invalid JSON"]),
        "convert-tokenizer-json-list": ("tokenizer.json", "[]", ["tokenizer.json", "expected a JSON object"]),
        "convert-tokenizer-config-corrupt": (
            "tokenizer_config.json",
            "{ broken",
            ["tokenizer_config.json", "invalid JSON"],
        ),
        "convert-tokenizer-config-not-utf8": (
            "tokenizer_config.json",
            b"\xff\xfe{}",
            ["tokenizer_config.json", "not UTF-8"],
        ),
        "convert-tokenizer-json-not-a-tokenizer": (
            "tokenizer.json",
            '{"hello": 1}',
            ["tokenizer.json", "'model' (missing)"],
        ),
        "convert-tokenizer-json-empty-object": (
            "tokenizer.json",
            "{}",
            ["tokenizer.json", "'added_tokens' (missing), 'model' (missing)"],
        ),
        "convert-tokenizer-json-no-merges": (
            "tokenizer.json",
            '{"added_tokens": [], "model": {"type": "BPE", "vocab": {}}}',
            ["tokenizer.json", "'model.merges' (missing)"],
        ),
    }
)


@case("convert-tokenizer-vocab-too-small")
def _(c):
    f = c.config(c.ckpt(), vocab_size=256)
    return conv(c, f), ["config.json implies"]


# --- convert: paths and options ----------------------------------------------------------


@case("convert-src-missing")
def _(c):
    return ["convert", c.inp / "nope", c.out / "o.gguf"], ["nope", "no such directory"]


@case("convert-src-is-file")
def _(c):
    p = c.inp / "file"
    p.write_text("x")
    return ["convert", p, c.out / "o.gguf"], ["file", "not a checkpoint folder (a file)"]


@case("convert-out-is-folder")
def _(c):
    (c.out / "sub").mkdir()
    return conv(c, c.ckpt())[:2] + [c.out / "sub"], ["sub", "output path is a directory"]


@case("convert-out-folder-missing")
def _(c):
    return ["convert", c.ckpt(), c.out / "missing" / "o.gguf"], ["does not exist"]


@case("convert-out-is-an-input")
def _(c):
    f = c.ckpt()
    return ["convert", f, sorted(f.glob("*.safetensors"))[0]], ["output path is an input"]


@case("convert-out-under-a-file")
def _(c):
    f = c.ckpt()
    return ["convert", f, f / "config.json" / "o.gguf"], ["config.json"]


_OPTION_CASES = {
    "outtype-unknown": (["--outtype", "q9"], ["--outtype", "unknown type"]),
    "no-mtp-and-mtp-only": (["--no-mtp", "--mtp-only"], ["--no-mtp/--mtp-only"]),
    "mtp-type-without-quant": (["--mtp-type", "q8_0"], ["--mtp-type", "needs --quant"]),
    "tensor-type-without-quant": (["--tensor-type", "a=q8_0"], ["--tensor-type", "needs --quant"]),
    "quant-unknown": (["--quant", "Q9_K"], ["Q9_K"]),
    "quant-bad-mtp-type": (["--quant", "Q4_K_M", "--mtp-type", "q9"], ["q9"]),
    "quant-bad-regex": (["--quant", "Q4_K_M", "--tensor-type", "(=q8_0"], ["--tensor-type"]),
    "threads-zero": (["--threads", "0"], ["--threads", "at least 1"]),
    "threads-not-int": (["--threads", "two"], ["'--threads'", "try 'mtpq convert --help'"]),
    "unknown-option": (["--frobnicate"], ["--frobnicate", "try 'mtpq convert --help'"]),
}
for _name, (_extra, _needles) in _OPTION_CASES.items():
    case(f"convert-option-{_name}")(lambda c, ex=_extra, nd=_needles: (conv(c, c.ckpt(), *ex), nd))


@case("convert-usage-missing-out")
def _(c):
    return ["convert", c.ckpt()], ["Missing argument 'out'", "try 'mtpq convert --help'"]


@case("cli-unknown-command")
def _(c):
    return ["frobnicate"], ["No such command", "try 'mtpq --help'"]


@case("convert-mtp-only-on-trunk-checkpoint")
def _(c):
    f = c.drop(c.config(c.ckpt(), num_nextn_predict_layers=0), "model.layers.2.")
    return conv(c, f, "--mtp-only"), ["--mtp-only", "no MTP layers"]


# --- convert: the other families --------------------------------------------------------------

_QWEN = {
    "missing-mtp-fc": (lambda c, f: c.drop(f, "mtp.fc.weight"), ["mtp.fc.weight"]),
    "missing-mtp-enorm": (lambda c, f: c.drop(f, "mtp.pre_fc_norm_embedding.weight"), ["mtp.pre_fc_norm_embedding"]),
    "missing-mtp-layer-q": (
        lambda c, f: c.drop(f, "mtp.layers.0.self_attn.q_proj.weight"),
        ["missing tensor mtp.layers.0.self_attn.q_proj.weight"],
    ),
    "missing-a-log": (
        lambda c, f: c.drop(f, "model.layers.0.linear_attn.A_log"),
        ["missing tensor model.layers.0.linear_attn.A_log"],
    ),
    "missing-full-attn-q": (
        lambda c, f: c.drop(f, "model.layers.3.self_attn.q_proj.weight"),
        ["missing tensor model.layers.3.self_attn.q_proj.weight"],
    ),
    "missing-conv1d": (lambda c, f: c.drop(f, "model.layers.1.linear_attn.conv1d.weight"), ["conv1d"]),
    "missing-output-norm": (lambda c, f: c.drop(f, "model.norm.weight"), ["missing tensor model.norm.weight"]),
    "value-heads-not-multiple": (lambda c, f: c.config(f, linear_num_value_heads=3), ["linear_num_value_heads"]),
    "mtp-layers-declared-2": (lambda c, f: c.config(f, mtp_num_hidden_layers=2), ["mtp_num_hidden_layers"]),
    "missing-linear-key-dim": (lambda c, f: c.config(f, linear_key_head_dim=_DELETE), ["missing linear_key_head_dim"]),
    "layer-types-not-strings": (lambda c, f: c.config(f, layer_types=[1, 2, 3, 4]), ["layer_types must be a list"]),
    "q-proj-not-gated": (
        lambda c, f: c.replace(f, "model.layers.3.self_attn.q_proj.weight", lambda t: t[:256].contiguous()),
        ["config.json implies"],
    ),
}
for _name, (_damage, _needles) in _QWEN.items():
    case(f"convert-qwen35-{_name}")(lambda c, d=_damage, nd=_needles: (conv(c, d(c, c.ckpt("qwen35"))), nd))

_DS = {
    "missing-kv-b": (lambda c, f: c.drop(f, "model.layers.0.self_attn.kv_b_proj.weight"), ["kv_b_proj"]),
    "missing-mtp-eh-proj": (
        lambda c, f: c.drop(f, "model.layers.2.eh_proj.weight"),
        ["missing tensor model.layers.2.eh_proj.weight"],
    ),
    "missing-mtp-hnorm": (lambda c, f: c.drop(f, "model.layers.2.hnorm.weight"), ["model.layers.2.hnorm.weight"]),
    "missing-q-a-norm": (lambda c, f: c.drop(f, "model.layers.1.self_attn.q_a_layernorm.weight"), ["q_a_layernorm"]),
    "kv-lora-contradicts": (lambda c, f: c.config(f, kv_lora_rank=128), ["config.json implies"]),
    "missing-kv-lora": (lambda c, f: c.config(f, kv_lora_rank=_DELETE), ["missing kv_lora_rank"]),
    "rope-dim-string": (lambda c, f: c.config(f, qk_rope_head_dim="32"), ["qk_rope_head_dim must be an integer"]),
    "int-kv-a": (
        lambda c, f: c.replace(f, "model.layers.0.self_attn.kv_a_proj_with_mqa.weight", lambda t: t.to(torch.int16)),
        ["dtype I16"],
    ),
}
for _name, (_damage, _needles) in _DS.items():
    case(f"convert-deepseek-{_name}")(lambda c, d=_damage, nd=_needles: (conv(c, d(c, c.ckpt("ds"))), nd))


def _missing(t: str) -> tuple[Callable, list[str]]:
    return (lambda c, f: c.drop(f, t)), [f"missing tensor {t}"]


def _extra(t: str, value: torch.Tensor) -> tuple[Callable, list[str]]:
    return (lambda c, f: c.add(f, t, value)), [t, "is stored, but config.json implies no such tensor"]


def _shape(t: str, make: Callable) -> tuple[Callable, list[str]]:
    return (lambda c, f: c.replace(f, t, make)), [t, "config.json implies", ".safetensors"]


# Step3.5: blocks 0 (full, dense), 1 (sliding, MoE), 2 (full, MoE); MTP blocks 3, 4 (sliding, dense)
_STEP = {
    "missing-attn-gate": _missing("model.layers.1.self_attn.g_proj.weight"),
    "missing-q-norm": _missing("model.layers.2.self_attn.q_norm.weight"),
    "missing-router-bias": _missing("model.layers.1.moe.router_bias"),
    "missing-stacked-experts": _missing("model.layers.2.moe.down_proj.weight"),
    "missing-shared-expert": _missing("model.layers.1.share_expert.up_proj.weight"),
    "missing-dense-mlp": _missing("model.layers.0.mlp.gate_proj.weight"),
    "missing-mtp-eh-proj": _missing("model.layers.4.eh_proj.weight"),
    "missing-mtp-shared-head-norm": _missing("model.layers.3.transformer.shared_head.norm.weight"),
    "missing-mtp-mlp": _missing("model.layers.3.mlp.down_proj.weight"),
    "missing-mtp-attn-k": _missing("model.layers.4.self_attn.k_proj.weight"),
    "missing-whole-mtp-layer": ((lambda c, f: c.drop(f, "model.layers.4.")), ["no tensors for layer 4", "--no-mtp"]),
    "extra-router-on-dense-layer": _extra("model.layers.0.moe.gate.weight", torch.zeros(4, 256)),
    "extra-unknown-in-mtp-block": _extra("model.layers.3.foo.weight", torch.zeros(4)),
    "extra-q-bias": _extra("model.layers.1.self_attn.q_proj.bias", torch.zeros(512)),
    "router-bias-switched-off": (
        (lambda c, f: c.config(f, use_moe_router_bias=False)),
        ["model.layers.1.moe.router_bias", "implies no such tensor"],
    ),
    "gate-switched-off": (
        (lambda c, f: c.config(f, use_head_wise_attn_gate=False)),
        ["model.layers.0.self_attn.g_proj.weight", "implies no such tensor"],
    ),
    "sliding-q-with-full-heads": _shape("model.layers.1.self_attn.q_proj.weight", lambda t: t[:256].contiguous()),
    "mtp-o-proj-full-heads": _shape("model.layers.3.self_attn.o_proj.weight", lambda t: t[:, :256].contiguous()),
    "gate-heads-short": _shape("model.layers.0.self_attn.g_proj.weight", lambda t: t[:2].contiguous()),
    "stacked-experts-short": _shape("model.layers.2.moe.up_proj.weight", lambda t: t[:3].contiguous()),
    "experts-per-expert-2d": _shape("model.layers.1.moe.gate_proj.weight", lambda t: t[0].contiguous()),
    "mtp-eh-proj-square": _shape("model.layers.3.eh_proj.weight", lambda t: t[:, :256].contiguous()),
    "mtp-head-short": _shape("model.layers.4.transformer.shared_head.output.weight", lambda t: t[:-1].contiguous()),
    "sliding-heads-changed": (
        (lambda c, f: c.config(f, attention_other_setting={"num_attention_heads": 4})),
        ["model.layers.1.self_attn.q_proj.weight", "config.json implies [256, 256]"],
    ),
    "layer-types-swapped": (
        (lambda c, f: c.config(f, layer_types=["sliding_attention", *tiny_step35.LAYER_TYPES[1:]])),
        ["model.layers.0.self_attn.q_proj.weight", "config.json implies [512, 256]"],
    ),
    "moe-layers-changed": (
        (lambda c, f: c.config(f, moe_layers_enum="1")),
        ["missing tensor model.layers.2.mlp.gate_proj.weight"],
    ),
    "moe-layers-not-numbers": (
        (lambda c, f: c.config(f, moe_layers_enum="one,two")),
        ["moe_layers_enum", "config.json"],
    ),
    "more-mtp-layers-declared": (
        (lambda c, f: c.config(f, num_nextn_predict_layers=3)),
        ["no tensors for layer 5", "--no-mtp"],
    ),
    "missing-share-expert-dim": ((lambda c, f: c.config(f, share_expert_dim=_DELETE)), ["missing share_expert_dim"]),
    "experts-count-string": ((lambda c, f: c.config(f, moe_num_experts="4")), ["moe_num_experts must be an integer"]),
    "gate-switch-string": (
        (lambda c, f: c.config(f, use_head_wise_attn_gate="yes")),
        ["use_head_wise_attn_gate must be true or false"],
    ),
    "other-heads-string": (
        (lambda c, f: c.config(f, attention_other_setting={"num_attention_heads": "8"})),
        ["attention_other_setting.num_attention_heads must be a positive integer"],
    ),
}
for _name, (_damage, _needles) in _STEP.items():
    case(f"convert-step35-{_name}")(lambda c, d=_damage, nd=_needles: (conv(c, d(c, c.ckpt("step35"))), nd))

# MiMo-V2: blocks 0 (full, dense), 1, 2 (sliding, MoE); MTP blocks model.mtp.layers.{0,1,2} (sliding, dense)
_MIMO = {
    "missing-sinks": _missing("model.layers.1.self_attn.attention_sink_bias"),
    "missing-router-bias": _missing("model.layers.2.mlp.gate.e_score_correction_bias"),
    "missing-expert": _missing("model.layers.2.mlp.experts.3.down_proj.weight"),
    "missing-dense-up": _missing("model.layers.0.mlp.up_proj.weight"),
    "missing-mtp-eh-proj": _missing("model.mtp.layers.0.eh_proj.weight"),
    "missing-mtp-final-norm": _missing("model.mtp.layers.1.final_layernorm.weight"),
    "missing-mtp-ffn-norm": _missing("model.mtp.layers.1.pre_mlp_layernorm.weight"),
    "missing-mtp-v-proj": _missing("model.mtp.layers.2.self_attn.v_proj.weight"),
    "missing-mtp-sinks": _missing("model.mtp.layers.0.self_attn.attention_sink_bias"),
    "missing-middle-mtp-layer": (
        (lambda c, f: c.drop(f, "model.mtp.layers.1.")),
        ["model.mtp.layers.0..N-1", "[0, 2]"],
    ),
    "extra-sinks-on-full-layer": _extra("model.layers.0.self_attn.attention_sink_bias", torch.zeros(4)),
    "extra-unknown-in-mtp-layer": _extra("model.mtp.layers.0.foo.weight", torch.zeros(4)),
    "extra-shared-experts": _extra("model.layers.1.mlp.shared_experts.up_proj.weight", torch.zeros(256, 256)),
    "sinks-switched-off": (
        (lambda c, f: c.config(f, add_swa_attention_sink_bias=False)),
        ["model.layers.1.self_attn.attention_sink_bias", "implies no such tensor"],
    ),
    "v-proj-with-qk-head-dim": _shape("model.layers.0.self_attn.v_proj.weight", lambda t: t.repeat(2, 1).contiguous()),
    "o-proj-with-qk-head-dim": _shape("model.layers.1.self_attn.o_proj.weight", lambda t: t.repeat(1, 2).contiguous()),
    "mtp-k-with-full-kv-heads": _shape(
        "model.mtp.layers.0.self_attn.k_proj.weight", lambda t: t.repeat(2, 1).contiguous()
    ),
    "expert-short": _shape("model.layers.1.mlp.experts.0.up_proj.weight", lambda t: t[:128].contiguous()),
    "mtp-enorm-short": _shape("model.mtp.layers.2.enorm.weight", lambda t: t[:-1].contiguous()),
    "swa-kv-heads-changed": (
        (lambda c, f: c.config(f, swa_num_key_value_heads=2)),
        ["model.layers.1.self_attn.k_proj.weight", "config.json implies [128, 256]"],
    ),
    "hybrid-pattern-changed": (
        (lambda c, f: c.config(f, hybrid_layer_pattern=[1, 1, 1])),
        ["model.layers.0.self_attn.k_proj.weight", "config.json implies [64, 256]"],
    ),
    "moe-freq-changed": (
        (lambda c, f: c.config(f, moe_layer_freq=[0, 0, 1])),
        ["missing tensor model.layers.1.mlp.gate_proj.weight"],
    ),
    "moe-freq-short": ((lambda c, f: c.config(f, moe_layer_freq=[0, 1])), ["moe_layer_freq", "config.json"]),
    "hybrid-pattern-not-flags": (
        (lambda c, f: c.config(f, hybrid_layer_pattern=[0, 2, 1])),
        ["hybrid_layer_pattern must be a list of 0/1 flags"],
    ),
    "missing-swa-kv-heads": (
        (lambda c, f: c.config(f, swa_num_key_value_heads=_DELETE)),
        ["missing swa_num_key_value_heads"],
    ),
    "sinks-switch-number": (
        (lambda c, f: c.config(f, add_swa_attention_sink_bias=1)),
        ["add_swa_attention_sink_bias must be true or false"],
    ),
}
for _name, (_damage, _needles) in _MIMO.items():
    case(f"convert-mimo2-{_name}")(lambda c, d=_damage, nd=_needles: (conv(c, d(c, c.ckpt("mimo2"))), nd))


# --- GGUF inputs: inspect, quantize, graft, extract-mtp --------------------------------------


def _gguf_commands(c: Case, bad: Path) -> dict[str, list]:
    good = c.copy("full", "good.gguf")
    trunk = c.copy("trunk", "trunk.gguf")
    return {
        "inspect": ["inspect", bad],
        "quantize": ["quantize", bad, c.out / "q.gguf", "Q8_0", "-q"],
        "extract-mtp": ["extract-mtp", bad, c.out / "h.gguf", "-q"],
        "graft-donor": ["graft", c.out / "g.gguf", "--mtp-from", bad, "--into", trunk, "-q"],
        "graft-target": ["graft", c.out / "g.gguf", "--mtp-from", good, "--into", bad, "-q"],
    }


_BAD_GGUF = {
    "truncated": (lambda c: c.truncated(cut=1000), ["truncated: tensor", "ends at byte", "the file has"]),
    "truncated-header": (
        lambda c: c.truncated(cut=c.bases["full"].stat().st_size - 200),
        ["truncated or corrupt GGUF header (the file has 200 bytes)"],
    ),
    "nextn-above-blocks": (
        lambda c: c.gguf(**{"glm4moe.nextn_predict_layers": (5, U32)}),
        ["nextn_predict_layers is 5", "block_count is 3"],
    ),
    "nextn-equals-blocks": (
        lambda c: c.gguf(**{"glm4moe.nextn_predict_layers": (3, U32)}),
        ["nextn_predict_layers is 3"],
    ),
    "block-beyond-count": (
        lambda c: c.gguf(**{"glm4moe.block_count": (2, U32), "glm4moe.nextn_predict_layers": (1, U32)}),
        ["is in block 2", "block_count is 2"],
    ),
    "block-count-string": (
        lambda c: c.gguf(**{"glm4moe.block_count": ("three", GGUFValueType.STRING)}),
        ["block_count must be an integer"],
    ),
    "not-gguf": (lambda c: _write(c.inp / "model.gguf", b"PK\x03\x04" + b"\0" * 100), ["not a readable GGUF file"]),
    "empty": (lambda c: _write(c.inp / "model.gguf", b""), ["model.gguf"]),
    "unknown-ggml-type": (
        lambda c: c.tensor_info("blk.0.attn_q.weight", ggml_type=99),
        ["tensor blk.0.attn_q.weight has unknown ggml type 99"],
    ),
    "overlapping-data": (
        lambda c: c.tensor_info("blk.0.attn_k.weight", offset_of="blk.0.attn_v.weight"),
        ["overlap", "blk.0.attn_k.weight", "blk.0.attn_v.weight"],
    ),
    "zero-length-rows": (
        lambda c: c.tensor_info("blk.0.attn_q.weight", zero_dim=0),
        ["tensor blk.0.attn_q.weight has a zero-length dimension"],
    ),
    "zero-rows": (
        lambda c: c.tensor_info("blk.0.attn_q.weight", zero_dim=1),
        ["tensor blk.0.attn_q.weight has a zero-length dimension"],
    ),
}
for _name, (_make, _needles) in _BAD_GGUF.items():
    for _cmd in ("inspect", "quantize", "extract-mtp", "graft-donor", "graft-target"):
        case(f"{_cmd}-{_name}")(
            lambda c, mk=_make, cmd=_cmd, nd=_needles: (lambda bad: (_gguf_commands(c, bad)[cmd], ["model.gguf", *nd]))(
                mk(c)
            )
        )


@case("quantize-q4_k_m-zero-length-dimension")
def _(c):  # "internal error in quantize: ZeroDivisionError" (exit 3) before the reader refused it
    bad = c.tensor_info("blk.1.ffn_down_exps.weight", zero_dim=1)
    return ["quantize", bad, c.out / "q.gguf", "Q4_K_M", "-q"], [
        "model.gguf",
        "blk.1.ffn_down_exps.weight",
        "zero-length dimension",
    ]


@case("inspect-missing-file")
def _(c):
    return ["inspect", c.inp / "nope.gguf"], ["nope.gguf", "no such file"]


@case("inspect-folder")
def _(c):
    return ["inspect", c.inp], ["is a folder, not a GGUF file"]


@case("quantize-bad-preset")
def _(c):
    return ["quantize", c.copy("full"), c.out / "q.gguf", "Q9_Z"], ["Q9_Z"]


@case("quantize-out-is-input")
def _(c):
    src = c.copy("full")
    return ["quantize", src, src, "Q8_0", "-q"], ["output path is an input"]


@case("quantize-out-folder-missing")
def _(c):
    return ["quantize", c.copy("full"), c.out / "x" / "q.gguf", "Q8_0", "-q"], ["does not exist"]


@case("quantize-out-is-folder")
def _(c):
    (c.out / "d").mkdir()
    return ["quantize", c.copy("full"), c.out / "d", "Q8_0", "-q"], ["output path is a directory"]


@case("quantize-bad-mtp-type")
def _(c):
    return ["quantize", c.copy("full"), c.out / "q.gguf", "Q4_K_M", "--mtp-type", "q9"], ["q9"]


@case("quantize-bad-regex")
def _(c):
    return ["quantize", c.copy("full"), c.out / "q.gguf", "Q4_K_M", "--tensor-type", "[=q8_0"], ["--tensor-type"]


@case("quantize-threads-zero")
def _(c):
    return ["quantize", c.copy("full"), c.out / "q.gguf", "Q8_0", "-t", "0"], ["--threads"]


@case("quantize-usage-missing-preset")
def _(c):
    return ["quantize", c.copy("full"), c.out / "q.gguf"], ["Missing argument 'PRESET'", "try 'mtpq quantize --help'"]


@case("extract-mtp-from-trunk-only")
def _(c):
    return ["extract-mtp", c.copy("trunk"), c.out / "h.gguf"], ["no MTP blocks to extract"]


@case("extract-mtp-out-is-input")
def _(c):
    src = c.copy("full")
    return ["extract-mtp", src, src], ["output path is an input"]


@case("graft-donor-without-head")
def _(c):
    t = c.copy("trunk")
    return ["graft", c.out / "g.gguf", "--mtp-from", t, "--into", c.copy("trunk", "t2.gguf")], [
        "no MTP blocks to graft"
    ]


@case("graft-target-has-head")
def _(c):
    return ["graft", c.out / "g.gguf", "--mtp-from", c.copy("full"), "--into", c.copy("full", "f2.gguf")], [
        "already has an MTP head",
        "--replace",
    ]


@case("graft-bad-mtp-type")
def _(c):
    return ["graft", c.out / "g.gguf", "--mtp-from", c.copy("full"), "--into", c.copy("trunk"), "--mtp-type", "q9"], [
        "--mtp-type",
        "unknown",
        "q9",
    ]


@case("graft-out-is-target")
def _(c):
    t = c.copy("trunk")
    return ["graft", t, "--mtp-from", c.copy("full"), "--into", t], ["output path is an input"]


@case("graft-usage-missing-into")
def _(c):
    return ["graft", c.out / "g.gguf", "--mtp-from", c.copy("full")], ["--into", "try 'mtpq graft --help'"]


@case("graft-different-model")
def _(c):
    donor = c.gguf("full", "donor.gguf", **{"glm4moe.embedding_length": (512, U32)})
    return ["graft", c.out / "g.gguf", "--mtp-from", donor, "--into", c.copy("trunk")], ["hidden size"]


# --- split GGUFs: every command that reads a model, given a shard of a broken set ---------------------


def _split_commands(c: Case, bad: Path) -> dict[str, list]:
    cmds = _gguf_commands(c, bad)
    text = _write(c.inp / "text.txt", b"def f(x):\n    return x + 1\n" * 30)
    return {
        **cmds,
        "accept": ["accept", bad, "--max-prompts", "1", "-n", "2"],
        "imatrix": ["imatrix", bad, "--text", text, "-o", c.out / "im.gguf"],
        "sweep": ["sweep", bad, "--mtp", "q8_0", "--trunk", "Q8_0", "--max-prompts", "1"],
        "compare": ["compare", bad, c.inp / "good.gguf", "--text", text],
    }


U16, I32 = GGUFValueType.UINT16, GGUFValueType.INT32


def _swap_in(c: Case, shards: list[Path], i: int, src: Path) -> None:
    shutil.copy(src, shards[i])


_BAD_SPLIT = {  # (damage the copied set, return the shard to give and the needles)
    "missing-last-shard": lambda c, s: (s[3].unlink(), s[0], [s[3].name, "missing: shard 4 of 4"]),
    "missing-first-shard": lambda c, s: (s[0].unlink(), s[1], [s[0].name, "missing: shard 1 of 4", s[1].name]),
    "shard-of-another-split": lambda c, s: (
        _swap_in(c, s, 1, sorted(c.bases["split3"].iterdir())[1]),
        s[0],
        [s[1].name, "split.count is 3", "another split"],
    ),
    "shard-of-another-set": lambda c, s: (_swap_in(c, s, 1, s[2]), s[0], [s[1].name, "split.no is 2", "another set"]),
    "shard-of-another-model": lambda c, s: (
        c.rewrite(s[2], {"split.tensors.count": (99, I32)}),
        s[0],
        [s[2].name, "split.tensors.count is 99", "another model"],
    ),
    "shard-of-another-arch": lambda c, s: (
        c.rewrite(s[1], {"general.architecture": ("llama", GGUFValueType.STRING)}),
        s[0],
        [s[1].name, "general.architecture is 'llama'", "another model"],
    ),
    "tensor-duplicated": lambda c, s: (
        c.rewrite(s[1], add=[GGUFReader(s[0]).tensors[0]]),
        s[0],
        [s[1].name, "is also in", s[0].name, "duplicated"],
    ),
    "tensor-missing": lambda c, s: (
        c.rewrite(s[3], drop_last=True),
        s[1],
        [s[0].name, "split.tensors.count is 61", "hold 60 tensors"],
    ),
    "shard-renamed": lambda c, s: (
        s[0].rename(c.inp / "model.gguf"),
        c.inp / "model.gguf",
        ["model.gguf", "must be named PREFIX-00001-of-00004.gguf"],
    ),
    "no-split-no": lambda c, s: (c.rewrite(s[0], drop_keys=("split.no",)), s[0], [s[0].name, "no split.no"]),
    "split-no-out-of-range": lambda c, s: (
        c.rewrite(s[0], {"split.no": (7, U16)}),
        s[0],
        [s[0].name, "split.no = 7 is outside split.count = 4"],
    ),
}
_EVERY_COMMAND = (
    "inspect",
    "quantize",
    "extract-mtp",
    "graft-donor",
    "graft-target",
    "accept",
    "imatrix",
    "sweep",
    "compare",
)
for _name, _damage in _BAD_SPLIT.items():  # the checks live in one place (gguf_io.open_model): every command
    # meets the first two damages, the rest are met by two commands
    for _cmd in (
        _EVERY_COMMAND if _name in ("missing-last-shard", "shard-of-another-split") else ("inspect", "quantize")
    ):
        case(f"split-{_cmd}-{_name}")(
            lambda c, dmg=_damage, cmd=_cmd: (lambda r: (_split_commands(c, r[1])[cmd], r[2]))(dmg(c, c.shards()))
        )


_SPLIT_OPTIONS = {
    "size-zero": (["--split-max-size", "0"], ["--split-max-size", "must be positive"]),
    "size-unit": (["--split-max-size", "12X"], ["--split-max-size", "expected bytes or a number with K, M or G"]),
    "size-empty": (["--split-max-size", ""], ["--split-max-size", "expected bytes"]),
    "tensors-zero": (["--split-max-tensors", "0"], ["--split-max-tensors", "must be at least 1"]),
}
for _name, (_opts, _needles) in _SPLIT_OPTIONS.items():
    case(f"quantize-split-{_name}")(
        lambda c, o=_opts, nd=_needles: (["quantize", c.copy("full"), c.out / "q.gguf", "Q8_0", *o], nd)
    )
    case(f"convert-split-{_name}")(lambda c, o=_opts, nd=_needles: (conv(c, c.ckpt(), *o), nd))
    case(f"graft-split-{_name}")(
        lambda c, o=_opts, nd=_needles: (
            ["graft", c.out / "g.gguf", "--mtp-from", c.copy("full"), "--into", c.copy("trunk"), *o],
            nd,
        )
    )


@case("quantize-keep-split-with-size")
def _(c):
    return (
        ["quantize", c.copy("full"), c.out / "q.gguf", "Q8_0", "--keep-split", "--split-max-size", "1M"],
        ["--keep-split", "not with --split-max-size"],
    )


@case("quantize-keep-split-over-its-input")
def _(c):
    s = c.shards()
    return ["quantize", s[0], s[0], "Q8_0", "--keep-split", "-q"], [f"{s[0]}: output path is an input"]


# --- accept: options checked before any measuring ------------------------------------------------


def acc(c: Case, *extra) -> list:
    return ["accept", c.copy("full"), "--max-prompts", "1", "-n", "2", *extra]


_ACCEPT = {
    "device-tpu9": (["--device", "tpu9"], ["--device", "tpu9"]),
    "device-cuda7": (["--device", "cuda:7"], ["--device", "cuda:7"]),
    "device-empty": (["--device", ""], ["--device"]),
    "temperature-negative": (["--temperature", "-1"], ["--temperature", "got -1.0"]),
    "temperature-nan": (["--temperature", "nan"], ["--temperature"]),
    "temperature-inf": (["--temperature", "inf"], ["--temperature"]),
    "top-p-two": (["--top-p", "2"], ["--top-p", "got 2.0"]),
    "top-p-zero": (["--top-p", "0"], ["--top-p"]),
    "top-k-negative": (["--top-k", "-1"], ["--top-k"]),
    "n-negative": (["-n", "-5"], ["--max-new-tokens", "got -5"]),
    "n-zero": (["-n", "0"], ["--max-new-tokens"]),
    "draft-zero": (["--draft", "0"], ["--draft"]),
    "draft-nine": (["-k", "9"], ["--draft"]),
    "draft-not-int": (["--draft", "x"], ["'--draft'", "try 'mtpq accept --help'"]),
    "max-prompts-zero": (["--max-prompts", "0"], ["--max-prompts"]),
    "min-rate-above-one": (["--min-rate", "1.5"], ["--min-rate"]),
    "max-drop-without-reference": (["--max-drop", "0.1"], ["--max-drop", "needs --reference"]),
    "dtype-unknown": (["--dtype", "f8"], ["--dtype"]),
    "hidden-unknown": (["--hidden", "middle"], ["--hidden"]),
    "rounds-unknown": (["--rounds", "vllm"], ["--rounds", "llama-speculative-simple"]),
    "prompts-missing": (["--prompts", "nope.jsonl"], ["nope.jsonl", "no such prompts file"]),
}
for _name, (_extra, _needles) in _ACCEPT.items():
    case(f"accept-{_name}")(lambda c, ex=_extra, nd=_needles: (acc(c, *ex), nd))


# the other commands that compute check --device the same way, before any work
@case("imatrix-device-tpu9")
def _(c):
    t = c.inp / "calib.txt"
    t.write_text("def f(x):\n    return x\n" * 50)
    return ["imatrix", c.copy("full"), "-f", t, "-o", c.out / "i.gguf", "--device", "tpu9"], ["--device", "tpu9"]


@case("sweep-device-cuda7")
def _(c):
    return ["sweep", c.copy("full"), "--mtp", "q8_0", "--trunk", "Q8_0", "--device", "cuda:7"], ["--device", "cuda:7"]


@case("demo-device-tpu9")
def _(c):
    return ["demo", "--workdir", c.out / "w", "--device", "tpu9"], ["--device", "tpu9"]


def accept_with_prompts_file(c: Case, text: str) -> list:
    """``accept`` on the full file, its prompts read from a p.jsonl holding ``text``."""
    p = c.inp / "p.jsonl"
    p.write_text(text)
    return ["accept", c.copy("full"), "--prompts", p]


_PROMPTS_FILES = {  # case -> (the file's text, what the error names)
    "empty-prompt": (
        '{"prompt": "def f(x):"}\n{"category": "chat", "prompt": "   "}\n',
        ["p.jsonl", "prompt 2 is empty"],
    ),
    "prompts-bad-line": ('{"prompt": "a"}\nnot json\n', ["p.jsonl", "line 2"]),
    "prompts-empty-file": ("\n", ["p.jsonl", "no prompts"]),
}
for _name, (_text, _needles) in _PROMPTS_FILES.items():
    case(f"accept-{_name}")(lambda c, tx=_text, nd=_needles: (accept_with_prompts_file(c, tx), nd))


@case("accept-json-folder-missing")
def _(c):
    return acc(c, "--json", c.out / "nope" / "r.json"), ["--json", "does not exist"]


@case("accept-json-is-folder")
def _(c):
    return acc(c, "--json", c.out), ["--json", "is a folder"]


@case("accept-md-folder-missing")
def _(c):
    return acc(c, "--md", c.out / "nope" / "r.md"), ["--md", "does not exist"]


@case("accept-json-is-the-model")
def _(c):
    m = c.copy("full")
    return ["accept", m, "--json", m], ["--json", "is an input"]


@case("accept-model-missing")
def _(c):
    return ["accept", c.inp / "nope.gguf"], ["nope.gguf", "no such file"]


@case("accept-reference-missing")
def _(c):
    return acc(c, "--reference", c.inp / "ref.gguf"), ["ref.gguf", "no such file"]


@case("accept-unknown-gating-function")
def _(c):
    bad = c.gguf(**{"glm4moe.expert_gating_func": (3, U32)})  # neither softmax (1) nor sigmoid (2)
    return ["accept", bad, "-n", "2", "--max-prompts", "1"], ["model.gguf", "expert_gating_func 3"]


@case("accept-model-truncated")
def _(c):
    return ["accept", c.truncated(), "-n", "2", "--max-prompts", "1"], ["model.gguf"]


# --- build: the recipe ---------------------------------------------------------------------------


def _recipe(c: Case, model: dict | None = None, variant: dict | None = None, extra: str = "") -> Path:
    src = c.ckpt()
    m = {"name": "tiny", "source": src.name, "output": "../out/dist", **(model or {})}
    v = {"name": "Q8", "preset": "Q8_0", **(variant or {})}

    def toml(d: dict) -> str:
        return "\n".join(f"{k} = {json.dumps(x)}" for k, x in d.items())

    p = c.inp / "recipe.toml"
    p.write_text(f"[model]\n{toml(m)}\n\n[[variant]]\n{toml(v)}\n{extra}")
    return p


_BUILD = {
    "output-is-file": (lambda c: _write(c.out / "dist", b"x") and _recipe(c), ["model.output", "is a file"]),
    "output-is-source": (lambda c: _recipe(c, {"output": "glm"}), ["model.output", "inside the source"]),
    "output-inside-source": (lambda c: _recipe(c, {"output": "glm/dist"}), ["model.output", "inside the source"]),
    "source-missing": (lambda c: _recipe(c, {"source": "nope"}), ["model.source", "not a folder"]),
    "unknown-key": (lambda c: _recipe(c, {"colour": "red"}), ["model.colour", "unknown key"]),
    "bad-preset": (lambda c: _recipe(c, variant={"preset": "Q9_Z"}), ["variant[0].preset"]),
    "bad-name": (lambda c: _recipe(c, {"name": "a b"}), ["model.name"]),
    "gate-draft-zero": (lambda c: _recipe(c, extra="[gate]\ndraft = 0\n"), ["gate.draft"]),
    "gate-n-negative": (lambda c: _recipe(c, extra="[gate]\nmax_new_tokens = -5\n"), ["gate.max_new_tokens"]),
    "gate-temperature-negative": (lambda c: _recipe(c, extra="[gate]\ntemperature = -1.0\n"), ["gate.temperature"]),
    "gate-min-rate-string": (lambda c: _recipe(c, extra='[gate]\nmin_rate = "high"\n'), ["gate.min_rate"]),
    "graft-into-missing": (lambda c: _recipe(c, variant={"graft_into": "nope.gguf"}), ["graft_into", "does not exist"]),
    "split-size-word": (lambda c: _recipe(c, {"split_max_size": "big"}), ["model.split_max_size", "expected bytes"]),
    "split-size-zero": (
        lambda c: _recipe(c, variant={"split_max_size": 0}),
        ["variant[0].split_max_size", "must be positive"],
    ),
    "split-size-bool": (lambda c: _recipe(c, variant={"split_max_size": True}), ["variant[0].split_max_size"]),
    "not-toml": (lambda c: _write(c.inp / "recipe.toml", b"[model\n"), ["not valid TOML"]),
    "missing": (lambda c: c.inp / "nope.toml", ["nope.toml", "no such recipe file"]),
}
for _name, (_make, _needles) in _BUILD.items():
    case(f"build-{_name}")(lambda c, mk=_make, nd=_needles: (["build", mk(c)], nd))


@case("build-jobs-zero")
def _(c):
    return ["build", _recipe(c), "--jobs", "0"], ["--jobs", "try 'mtpq build --help'"]


# ----------------------------------------------------------------------------- the check


def _snapshot(folder: Path) -> dict[str, str]:
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            out[str(p.relative_to(folder))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def test_corpus_is_large_enough():
    assert len(CASES) >= 150, len(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_damaged_input(name, bases, tmp_path):
    c = Case(tmp_path, bases)
    c.inp.mkdir()
    c.out.mkdir()
    argv, needles, *code = CASES[name](c)
    code = code[0] if code else 2
    before_in, before_out = _snapshot(c.inp), _snapshot(c.out)
    res = run_cli(*argv)
    lines = res.stderr.splitlines()
    assert res.exit_code == code, (res.exit_code, res.output)
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert all(n in lines[0] for n in needles), (needles, lines[0])
    assert "Traceback" not in res.output, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert _snapshot(c.out) == before_out, "something was written to the output folder"
    assert _snapshot(c.inp) == before_in, "an input changed"
    assert not list(tmp_path.rglob("*.partial-*"))


def test_the_good_inputs_pass(bases, tmp_path):
    """The baseline every case damages converts, inspects, quantizes and extracts without a word on stderr."""
    for key in ("glm", "qwen35", "ds", "step35", "mimo2"):
        res = run_cli("convert", bases[key], tmp_path / f"{key}.gguf", "--quiet")
        assert res.exit_code == 0 and not res.stderr.strip(), res.output
    assert run_cli("inspect", bases["full"]).exit_code == 0
    assert run_cli("extract-mtp", bases["full"], tmp_path / "h.gguf", "-q").exit_code == 0
    assert (
        run_cli("graft", tmp_path / "g.gguf", "--mtp-from", bases["full"], "--into", bases["trunk"], "-q").exit_code
        == 0
    )
