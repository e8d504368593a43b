"""Reading what a conversion wrote, for tests: the source safetensors and the GGUF (through gguf-py's reader);
and the smallest valid GGUF, for commands that check a file they never run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFWriter
from safetensors.torch import load_file

from tests.helpers.runcli import run_cli


def source_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def read_gguf(path: Path) -> tuple[dict[str, object], dict[str, tuple[T, np.ndarray]]]:
    """(metadata, {name: (type, data)}); float data in torch-order shape, quantized data as stored bytes."""
    r = GGUFReader(path)
    kv = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    tensors = {}
    for t in r.tensors:
        shape = tuple(reversed([int(d) for d in t.shape]))
        data = np.asarray(t.data)
        tensors[t.name] = (T(t.tensor_type), data.reshape(shape) if t.tensor_type in (T.F32, T.F16) else data)
    return kv, tensors


def convert(src: Path, out: Path, *args: str):
    """``mtpq convert src out --quiet *args``; asserts success; returns read_gguf(out)."""
    res = run_cli("convert", src, out, "--quiet", *args)
    assert res.exit_code == 0, res.output
    return read_gguf(out)


def f32_gguf(src: Path, out: Path) -> Path:
    """``mtpq convert src out --outtype f32 --quiet``; asserts success; returns out."""
    res = run_cli("convert", src, out, "--outtype", "f32", "--quiet")
    assert res.exit_code == 0, res.output
    return out


def glm4moe_fixtures(num_hidden_layers: int):
    """Module fixtures ``ckpt`` (a tiny f32 GLM-4.5 checkpoint: ``num_hidden_layers`` trunk blocks, block 0 dense,
    then its MTP block) and ``f32`` (its f32 GGUF). Bind both in the test module: ``ckpt, f32 = glm4moe_fixtures(n)``.
    """
    import pytest

    from tests.builders import tiny

    name = f"glm{num_hidden_layers}"

    @pytest.fixture(scope="module", name="ckpt")
    def ckpt(tmp_path_factory) -> Path:
        folder = tmp_path_factory.mktemp(name) / "ckpt"
        return tiny.glm4moe(folder, num_hidden_layers=num_hidden_layers, dtype=torch.float32)

    @pytest.fixture(scope="module", name="f32")
    def f32(ckpt, tmp_path_factory) -> Path:
        return f32_gguf(ckpt, tmp_path_factory.mktemp("f32") / f"{name}-f32.gguf")

    return ckpt, f32


def one_tensor_gguf(path: Path, arch: str = "llama") -> Path:
    """A valid GGUF of one zero tensor (token_embd) at ``path``: what a command checks before it hands the file on."""
    w = GGUFWriter(str(path), arch)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_tensors(path: Path) -> dict:
    """gguf-py's ReaderTensor of every tensor, by name."""
    return {t.name: t for t in GGUFReader(path).tensors}


def gguf_field(path: Path, key: str):
    """Metadata value ``key`` (None when absent)."""
    f = GGUFReader(path).fields.get(key)
    return None if f is None else f.contents()


def kv_types(path: Path) -> dict[str, list[int]]:
    """Each metadata key's GGUF value types (an array's element type included): 0/1 ints are not bools."""
    return {k: [int(t) for t in f.types] for k, f in GGUFReader(path).fields.items() if not k.startswith("GGUF.")}
