"""mtpq's GGUF reader parses metadata arrays in one pass (mtpq.gguf_fields): the same values as gguf-py's
GGUFReader, truncated arrays refused; and the commands that only read metadata start without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from mtpq.errors import InputError
from mtpq.gguf_io import open_gguf

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def meta_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fields") / "m.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(2)
    w.add_token_list(["a", "", "ünïcode", "x" * 300] + [f"t{i}" for i in range(1000)])
    w.add_token_types([1, 2, 3, 4] + [1] * 1000)
    w.add_token_scores(np.linspace(-1, 1, 1004, dtype=np.float32).tolist())
    w.add_array("llama.empty_ints", [])
    w.add_array("llama.flags", [True, False, True])
    w.add_key_value("llama.i64", [-(2**40), 2**40], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT64)
    w.add_string("general.name", "fields")
    w.add_tensor("blk.0.attn_q.weight", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_same_fields_as_gguf_py(meta_file):
    ours, theirs = open_gguf(meta_file), gguf.GGUFReader(meta_file)
    assert list(ours.fields) == list(theirs.fields)
    for name, f in theirs.fields.items():
        g = ours.fields[name]
        assert g.contents() == f.contents(), name
        assert g.types == f.types and g.offset == f.offset, name
    assert [(t.name, t.data.tobytes()) for t in ours.tensors] == [(t.name, t.data.tobytes()) for t in theirs.tensors]


def test_a_truncated_string_array_is_refused(meta_file, tmp_path):
    data = meta_file.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: data.index(b"t500")])  # inside tokenizer.ggml.tokens
    with pytest.raises(InputError, match="truncated or corrupt GGUF header"):
        open_gguf(cut)


@pytest.mark.parametrize(
    "args",
    [
        ["inspect", "{f}"],
        ["quantize", "{f}", "{out}", "Q4_K_M", "--dry-run"],
        ["--help"],
        ["quantize", "{f}", "{out}", "Q8_0", "--pure", "--quiet"],
        ["quantize", "{f}", "{out}", "Q4_0", "--pure", "--threads", "2", "--quiet"],
    ],
)
def test_metadata_only_commands_start_without_torch(meta_file, tmp_path, args):
    """inspect, quantize --dry-run and --help never import torch (1.5-4 s of a start-up on a 2-core machine),
    nor does quantizing (the kernels are mtpq.ggml's, compiled: see the next test)."""
    argv = [a.format(f=meta_file, out=tmp_path / "o.gguf") for a in args]
    assert _run_cli(argv) == "0 NO TORCH"


@pytest.fixture(scope="module")
def k_source(tmp_path_factory) -> tuple[Path, Path]:
    """A float GGUF of 256-wide rows, and an imatrix (the legacy format, written here) with an entry per matrix."""
    from mtpq.quantize.imatrix import Entry, Imatrix, write_imatrix

    root = tmp_path_factory.mktemp("no_torch")
    src, im = root / "k.gguf", root / "k.imatrix.dat"
    w = gguf.GGUFWriter(src, "llama")
    w.add_block_count(1)
    g = np.random.default_rng(7)
    names = ("blk.0.attn_q.weight", "blk.0.attn_v.weight", "blk.0.ffn_down.weight", "output.weight")
    for name in names:
        w.add_tensor(name, (g.standard_normal((8, 512)) * 0.02).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    entries = {n: Entry(g.uniform(0.1, 2, (1, 512)).astype(np.float32), np.ones(1, np.float32)) for n in names}
    write_imatrix(Imatrix(entries, legacy=True), im)
    return src, im


@pytest.mark.parametrize(
    "mix,extra,types",
    [
        ("Q4_K_M", [], {"Q4_K", "Q6_K"}),
        ("Q3_K_S", ["--threads", "1"], {"Q3_K"}),
        ("Q2_K", [], {"Q2_K", "Q3_K"}),
        ("IQ4_XS", [], {"IQ4_XS"}),
        ("Q5_1", ["--pure"], {"Q5_1"}),
        ("TQ1_0", ["--pure"], {"TQ1_0"}),
        ("Q4_K_M", ["--imatrix", "IM"], {"Q4_K", "Q6_K"}),
        ("IQ2_XXS", ["--imatrix", "IM"], {"IQ2_XXS"}),
        ("IQ1_M", ["--imatrix", "IM", "--pure"], {"IQ1_M"}),
        ("Q4_0", ["--imatrix", "IM", "--pure"], {"Q4_0"}),
    ],
)
def test_quantize_starts_without_torch(k_source, tmp_path, mix, extra, types):
    """Nor does quantizing to any type, with an imatrix or without, on one thread or several."""
    src, im = k_source
    out = tmp_path / "o.gguf"
    extra = [str(im) if a == "IM" else a for a in extra]
    assert _run_cli(["quantize", str(src), str(out), mix, *extra, "--quiet"]) == "0 NO TORCH"
    assert types <= {t.tensor_type.name for t in gguf.GGUFReader(out).tensors}


def _run_cli(argv: list[str]) -> str:
    """``mtpq ARGV`` in a fresh interpreter: its exit code, and whether torch was imported."""
    code = (
        "import sys\nfrom mtpq.cli import app\nsys.argv = ['mtpq', *sys.argv[1:]]\nrc = 0\n"
        "try:\n    app()\nexcept SystemExit as e:\n    rc = e.code or 0\n"
        "print(rc, 'TORCH' if 'torch' in sys.modules else 'NO TORCH')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    lines = proc.stdout.strip().splitlines()
    return lines[-1] if lines else proc.stderr[-2000:]
