"""Importance matrices: llama.cpp's file formats, and ``--imatrix`` end to end.

Test data (tests/data/imatrix/) was written by llama.cpp's own ``llama-imatrix``
(the build named in tests/ggml/test_quant_kernels.py) on tiny GLM-4.5 checkpoints
(tests/builders/tiny.py ``glm4moe(dtype=float32, num_hidden_layers=N)`` -> ``mtpq convert
--outtype f32``) and 3000 words of Python keywords (``random.seed(1)``)::

    llama-imatrix -m tiny-f32.gguf -f calib.txt -o X -c 64 --chunks 4 -t 1 --no-ppl [--output-format dat]

* ``glm1.imatrix.gguf`` / ``glm1.imatrix.dat``: N = 1 (one dense trunk layer;
  llama-imatrix never runs the MTP block, blk.1: no entries for it);
* ``glm2_moe.imatrix.gguf``: N = 2, blk.1 an MoE layer: per-expert rows and counts.

The llama_cpp-marked tests make fresh files with llama-imatrix and compare
``mtpq quantize --imatrix`` with ``llama-quantize --imatrix`` byte for byte.
"""

from __future__ import annotations

import os
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader

from mtpq.errors import InputError
from mtpq.quantize.imatrix import Entry, Imatrix, imatrix_bytes, read_imatrix, select_entries, write_imatrix
from tests.builders import tiny
from tests.helpers.ggufcheck import f32_gguf
from tests.helpers.ggufcheck import gguf_field as _field
from tests.helpers.ggufcheck import gguf_tensors as _tensors
from tests.helpers.runcli import run_cli

DATA = Path(__file__).parents[1] / "data" / "imatrix"
FILES = ["glm1.imatrix.gguf", "glm1.imatrix.dat", "glm2_moe.imatrix.gguf"]


# ----------------------------------------------------------------------------- the file formats


@pytest.mark.parametrize("name", FILES)
def test_llama_imatrix_files_round_trip_byte_identically(name, tmp_path):
    im = read_imatrix(DATA / name)
    assert im.legacy == name.endswith(".dat")
    assert im.datasets == ["calib.txt"] and im.chunk_count == 4
    assert imatrix_bytes(im) == (DATA / name).read_bytes()
    write_imatrix(im, tmp_path / name)
    assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes()


def test_gguf_and_dat_hold_the_same_statistics():
    g, d = read_imatrix(DATA / "glm1.imatrix.gguf"), read_imatrix(DATA / "glm1.imatrix.dat")
    assert set(g.entries) == set(d.entries) and all(n.startswith("blk.0.") for n in g.entries)
    for name, e in g.entries.items():
        n = e.sums.shape[1]
        assert g.chunk_size == 64 and e.counts.tolist() == [256.0]  # 4 chunks of 64 tokens
        # legacy: (sum / count) * ncall, and llama-quantize divides by ncall again
        np.testing.assert_allclose(g.importance(name, n), d.importance(name, n), rtol=1e-6)


def test_per_expert_rows_and_llama_quantize_normalisation():
    im = read_imatrix(DATA / "glm2_moe.imatrix.gguf")
    e = im.entries["blk.1.ffn_up_exps.weight"]
    assert e.sums.shape == (4, 256) and e.counts.shape == (4,) and len(set(e.counts.tolist())) > 1
    w = im.importance("blk.1.ffn_up_exps.weight", 256, 4)
    assert w.shape == (4, 256) and w.dtype == np.float32
    assert np.array_equal(w, e.sums / e.counts[:, None].astype(np.float32))
    # an expert that saw no token gets weights of 1, as llama-quantize gives it
    e.counts[2] = 0.0
    w = im.importance("blk.1.ffn_up_exps.weight", 256, 4)
    assert np.all(w[2] == 1.0) and np.array_equal(w[0], e.sums[0] / e.counts[0])
    with pytest.raises(InputError, match="blk.1.ffn_up_exps.weight has 1024 values, the tensor needs 2048"):
        im.importance("blk.1.ffn_up_exps.weight", 256, 8)
    assert im.importance("blk.9.nothing.weight", 256) is None


def test_written_files_read_back(tmp_path):
    entries = {
        "blk.0.ffn_down_exps.weight": Entry(
            np.arange(12, dtype=np.float32).reshape(3, 4), np.array([1, 2, 3], dtype=np.float32)
        ),
        "blk.0.attn_q.weight": Entry(np.ones((1, 8), np.float32), np.array([5], np.float32)),
    }
    for legacy in (False, True):
        im = Imatrix(entries, datasets=["a.txt", "b.txt"], chunk_count=7, chunk_size=32, legacy=legacy)
        path = tmp_path / ("x.dat" if legacy else "x.gguf")
        write_imatrix(im, path)
        back = read_imatrix(path)
        assert back.legacy == legacy and back.chunk_count == 7 and set(back.entries) == set(entries)
        assert back.datasets == (["b.txt"] if legacy else ["a.txt", "b.txt"])  # .dat keeps the last one
        for n, e in entries.items():
            assert np.array_equal(back.entries[n].sums.reshape(-1), e.sums.reshape(-1))
        if not legacy:  # gguf-py reads what we write as llama.cpp's loader would
            r = GGUFReader(path)
            assert {t.name for t in r.tensors} == {f"{n}.{k}" for n in entries for k in ("in_sum2", "counts")}
            assert bytes(r.fields["general.type"].parts[-1]) == b"imatrix"


def test_include_and_exclude_weights_select_by_substring():
    im = read_imatrix(DATA / "glm2_moe.imatrix.gguf")
    assert set(select_entries(im, ["exps"], None).entries) == {
        "blk.1.ffn_down_exps.weight",
        "blk.1.ffn_gate_exps.weight",
        "blk.1.ffn_up_exps.weight",
    }
    kept = select_entries(im, None, ["attn", "blk.0."]).entries
    assert kept and not any("attn" in n or n.startswith("blk.0.") for n in kept)


def _gguf_cut_points(data: bytes) -> list[int]:
    return [0, 3, 4, 10, 30, 100, len(data) // 2, len(data) - 200, len(data) - 1]


@pytest.mark.parametrize("name", FILES)
def test_truncated_files_are_refused(name):
    data = (DATA / name).read_bytes()
    for cut in _gguf_cut_points(data):
        bad = data[:cut]
        path = Path(os.environ.get("TMPDIR", "/tmp")) / f"mtpq-trunc-{os.getpid()}-{cut}-{name}"
        path.write_bytes(bad)
        try:
            with pytest.raises(InputError) as exc:
                read_imatrix(path)
            assert exc.value.where == str(path) and "\n" not in exc.value.problem
        finally:
            path.unlink()


def test_other_files_are_refused(tmp_path):
    junk = tmp_path / "junk.dat"
    junk.write_bytes(b"\x05\x00\x00\x00hello world, this is not an imatrix")
    with pytest.raises(InputError, match="truncated imatrix file|not an imatrix"):
        read_imatrix(junk)
    text = tmp_path / "notes.txt"
    text.write_text("just some text\n" * 10)
    with pytest.raises(InputError, match="not an imatrix"):
        read_imatrix(text)
    with pytest.raises(InputError, match="cannot read imatrix file"):
        read_imatrix(tmp_path / "missing.gguf")
    # a non-F32 tensor, and an in_sum2 without counts
    im = read_imatrix(DATA / "glm1.imatrix.gguf")
    raw = bytearray(imatrix_bytes(im))
    first = b"blk.0.attn_k.weight.in_sum2"
    i = raw.index(first) + len(first)
    n_dims = struct.unpack_from("<I", raw, i)[0]
    struct.pack_into("<I", raw, i + 4 + 8 * n_dims, 1)  # type F16
    (tmp_path / "f16.gguf").write_bytes(bytes(raw))
    with pytest.raises(InputError, match="is not F32"):
        read_imatrix(tmp_path / "f16.gguf")
    only_sums = Imatrix(
        {"a.weight": Entry(np.ones((1, 4), np.float32), np.ones(1, np.float32))}, chunk_count=1, chunk_size=1
    )
    raw = imatrix_bytes(only_sums).replace(b"a.weight.counts", b"a.weight.countz")
    (tmp_path / "nocounts.gguf").write_bytes(raw)
    with pytest.raises(InputError, match="neither <name>.in_sum2 nor <name>.counts"):
        read_imatrix(tmp_path / "nocounts.gguf")


# ----------------------------------------------------------------------------- --imatrix on the CLI


@pytest.fixture(scope="module")
def glm1_f32(tmp_path_factory) -> Path:
    """The 1-layer GLM the committed glm1 imatrix files were made on (same builder, same seed)."""
    folder = tmp_path_factory.mktemp("glm1im")
    ckpt = tiny.glm4moe(folder / "ckpt", num_hidden_layers=1, dtype=torch.float32)
    return f32_gguf(ckpt, folder / "tiny-f32.gguf")


def test_quantize_with_imatrix_uses_it_where_it_has_entries(glm1_f32, tmp_path):
    plain, weighted = tmp_path / "plain.gguf", tmp_path / "weighted.gguf"
    imf = DATA / "glm1.imatrix.gguf"
    assert run_cli("quantize", glm1_f32, plain, "Q4_K_M", "--quiet").exit_code == 0
    res = run_cli("quantize", glm1_f32, weighted, "Q4_K_M", "--imatrix", imf, "--quiet")
    assert res.exit_code == 0, res.output
    a, b = _tensors(plain), _tensors(weighted)
    im = read_imatrix(imf)
    for name in a:
        same = np.array_equal(np.asarray(a[name].data).view(np.uint8), np.asarray(b[name].data).view(np.uint8))
        quantized_with_weights = name in im.entries and T(a[name].tensor_type) not in (T.F32, T.Q8_0)
        assert same != quantized_with_weights, name
    assert _field(weighted, "quantize.imatrix.file") == str(imf)
    assert _field(weighted, "quantize.imatrix.dataset") == "calib.txt"
    assert _field(weighted, "quantize.imatrix.entries_count") == len(im.entries)
    assert _field(weighted, "quantize.imatrix.chunks_count") == 4
    assert _field(plain, "quantize.imatrix.file") is None
    # the legacy file holds the same statistics: the same bytes
    dat = tmp_path / "dat.gguf"
    assert (
        run_cli("quantize", glm1_f32, dat, "Q4_K_M", "--imatrix", DATA / "glm1.imatrix.dat", "--quiet").exit_code == 0
    )
    c = _tensors(dat)
    n_same = sum(np.array_equal(np.asarray(b[n].data).view(np.uint8), np.asarray(c[n].data).view(np.uint8)) for n in b)
    assert n_same >= len(b) - 2  # (sum/count*ncall)/ncall may differ from sum/count in the last bit


def test_convert_quant_with_imatrix_equals_convert_then_quantize(glm1_f32, tmp_path):
    ckpt = glm1_f32.parent / "ckpt"
    one, two = tmp_path / "one.gguf", tmp_path / "two.gguf"
    imf = DATA / "glm1.imatrix.gguf"
    res = run_cli("convert", ckpt, one, "--quant", "IQ4_XS", "--imatrix", imf, "--exclude-weights", "attn_q", "-q")
    assert res.exit_code == 0, res.output
    res = run_cli("quantize", glm1_f32, two, "IQ4_XS", "--imatrix", imf, "--exclude-weights", "attn_q", "-q")
    assert res.exit_code == 0, res.output
    a, b = _tensors(one), _tensors(two)
    assert set(a) == set(b)
    for n in a:
        assert np.array_equal(np.asarray(a[n].data).view(np.uint8), np.asarray(b[n].data).view(np.uint8)), n


@pytest.mark.parametrize(
    "make_bad,says",
    [
        (lambda p: p.write_bytes((DATA / "glm1.imatrix.gguf").read_bytes()[:5000]), "truncated imatrix file"),
        (lambda p: p.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 16), "truncated imatrix file"),
        (
            lambda p: p.write_bytes((DATA / "glm1.imatrix.gguf").read_bytes().replace(b"blk.0.", b"blk.7.")),
            "names a tensor of this model",
        ),
        (
            lambda p: write_imatrix(
                Imatrix(
                    {"blk.0.attn_q.weight": Entry(np.ones((1, 128), np.float32), np.ones(1, np.float32))},
                    chunk_count=1,
                    chunk_size=1,
                ),
                p,
            ),
            "entry blk.0.attn_q.weight has 128 values, the tensor needs 256",
        ),
    ],
)
def test_bad_imatrix_exits_2_with_one_line_and_writes_nothing(glm1_f32, tmp_path, make_bad, says):
    bad = tmp_path / "bad.imatrix"
    make_bad(bad)
    out = tmp_path / "out.gguf"
    res = run_cli("quantize", glm1_f32, out, "Q4_K_M", "--imatrix", bad)
    assert res.exit_code == 2, res.output
    line = res.output.strip()
    assert "\n" not in line and str(bad) in line and says in line, line
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["bad.imatrix"]


def test_include_with_exclude_and_without_imatrix_exit_2(glm1_f32, tmp_path):
    imf = DATA / "glm1.imatrix.gguf"
    res = run_cli(
        "quantize",
        glm1_f32,
        tmp_path / "o.gguf",
        "Q4_K_M",
        "--imatrix",
        imf,
        "--include-weights",
        "attn",
        "--exclude-weights",
        "ffn",
    )
    assert res.exit_code == 2 and "cannot be combined" in res.output
    res = run_cli("quantize", glm1_f32, tmp_path / "o.gguf", "Q4_K_M", "--exclude-weights", "ffn")
    assert res.exit_code == 2 and "needs --imatrix" in res.output
    res = run_cli("convert", glm1_f32.parent / "ckpt", tmp_path / "o.gguf", "--imatrix", imf)
    assert res.exit_code == 2 and "--imatrix: needs --quant" in res.output
    assert not (tmp_path / "o.gguf").exists()


def test_head_in_a_type_needing_an_imatrix_without_head_data_exits_2(glm1_f32, tmp_path):
    """llama-imatrix's file has no entries for the MTP block (blk.1 here). Q2_K in a Q2_K_S file
    needs importance data: the head at q8_0 (the default) is fine; the head at Q2_K too
    (--mtp-type same) exits 2 naming the head's tensors and both remedies, before writing."""
    imf = DATA / "glm1.imatrix.gguf"
    ok = tmp_path / "ok.gguf"
    res = run_cli("quantize", glm1_f32, ok, "Q2_K_S", "--imatrix", imf, "-q")
    assert res.exit_code == 0, res.output
    assert {
        T(t.tensor_type)
        for n, t in _tensors(ok).items()
        if n.startswith("blk.1.") and t.shape.size > 1 and "gate_inp" not in n and "norm" not in n
    } == {T.Q8_0}
    out = tmp_path / "head.gguf"
    res = run_cli("quantize", glm1_f32, out, "Q2_K_S", "--imatrix", imf, "--mtp-type", "same")
    assert res.exit_code == 2
    line = res.output.strip()
    assert "\n" not in line and line.startswith(f"error: {imf}:")
    assert "blk.1." in line and "q2_k" in line and "--mtp-type q8_0" in line and "mtpq imatrix --mtp" in line
    assert "Missing importance matrix" not in line and not out.exists()
    res = run_cli("quantize", glm1_f32, out, "Q2_K_S")  # no imatrix at all
    assert res.exit_code == 2 and "--imatrix" in res.output and not out.exists()


# ----------------------------------------------------------------------------- against llama.cpp itself


def _llama(bin_dir: Path, *args, ok: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "LD_LIBRARY_PATH": str(bin_dir)}
    proc = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, errors="replace", timeout=600, env=env
    )
    if ok:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def glm2(tmp_path_factory, llama_cpp_bin) -> tuple[Path, Path, Path]:
    """A 2-layer GLM (blk.1 MoE; MTP block blk.2), f32, and llama-imatrix's GGUF and .dat for it."""
    import random

    folder = tmp_path_factory.mktemp("glm2im")
    ckpt = tiny.glm4moe(folder / "ckpt", num_hidden_layers=2, dtype=torch.float32)
    f32 = folder / "tiny-f32.gguf"
    assert run_cli("convert", ckpt, f32, "--outtype", "f32", "--quiet").exit_code == 0
    rnd = random.Random(1)
    words = "def class return import for while if else print self value list dict range len int str".split()
    calib = folder / "calib.txt"
    calib.write_text(" ".join(rnd.choice(words) for _ in range(3000)))
    out = {}
    for fmt in ("gguf", "dat"):
        out[fmt] = folder / f"imatrix.{fmt}"
        _llama(
            llama_cpp_bin,
            llama_cpp_bin / "llama-imatrix",
            "-m",
            f32,
            "-f",
            calib,
            "-o",
            out[fmt],
            "--output-format",
            fmt,
            "-c",
            "64",
            "--chunks",
            "4",
            "-t",
            "1",
            "--no-ppl",
        )
    return f32, out["gguf"], out["dat"]


@pytest.mark.llama_cpp
def test_fresh_llama_imatrix_files_round_trip(glm2):
    _, g, d = glm2
    for path in (g, d):
        assert imatrix_bytes(read_imatrix(path)) == path.read_bytes(), path.name
    assert read_imatrix(g).entries["blk.1.ffn_up_exps.weight"].sums.shape[0] == 4


def _same_bytes(ours: Path, theirs: Path) -> None:
    a, b = _tensors(ours), _tensors(theirs)
    assert set(a) == set(b)
    diff = [
        n
        for n in a
        if a[n].tensor_type != b[n].tensor_type
        or not np.array_equal(np.asarray(a[n].data).view(np.uint8), np.asarray(b[n].data).view(np.uint8))
    ]
    assert not diff, f"{len(diff)} tensors differ from llama-quantize's: {diff[:5]}"


@pytest.mark.llama_cpp
@pytest.mark.parametrize(
    "preset", ["Q4_K_M", "Q6_K", "Q5_K_S", "Q3_K_M", "Q2_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS"]
)
def test_same_bytes_as_llama_quantize_with_imatrix(glm2, llama_cpp_bin, tmp_path, preset):
    f32, g, _ = glm2
    ours, theirs = tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
    res = run_cli("quantize", f32, ours, preset, "--imatrix", g, "--mtp-type", "same", "--quiet")
    assert res.exit_code == 0, res.output
    _llama(llama_cpp_bin, llama_cpp_bin / "llama-quantize", "--imatrix", g, f32, theirs, preset, "1")
    _same_bytes(ours, theirs)
    for key in ("quantize.imatrix.entries_count", "quantize.imatrix.chunks_count", "quantize.imatrix.dataset"):
        assert _field(ours, key) == _field(theirs, key), key


@pytest.mark.llama_cpp
def test_same_bytes_with_dat_file_and_weight_selection(glm2, llama_cpp_bin, tmp_path):
    f32, g, d = glm2
    for imf, extra in ((d, []), (g, ["--include-weights", "ffn_"]), (g, ["--exclude-weights", "exps"])):
        ours, theirs = tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
        res = run_cli("quantize", f32, ours, "Q4_K_S", "--imatrix", imf, *extra, "--mtp-type", "same", "-q")
        assert res.exit_code == 0, res.output
        _llama(llama_cpp_bin, llama_cpp_bin / "llama-quantize", "--imatrix", imf, *extra, f32, theirs, "Q4_K_S", "1")
        _same_bytes(ours, theirs)


@pytest.mark.llama_cpp
def test_q2_k_s_head_rule_against_llama_quantize(glm2, llama_cpp_bin, tmp_path):
    """llama-quantize aborts on the head without importance data; mtpq says so up front. With the
    head at q8_0 (mtpq's default; llama-quantize told so with --tensor-type) both write the same file."""
    f32, g, _ = glm2
    theirs = tmp_path / "theirs.gguf"
    proc = _llama(llama_cpp_bin, llama_cpp_bin / "llama-quantize", "--imatrix", g, f32, theirs, "Q2_K_S", "1", ok=False)
    assert proc.returncode != 0 and "Missing importance matrix for tensor blk.2." in proc.stdout + proc.stderr
    res = run_cli("quantize", f32, tmp_path / "x.gguf", "Q2_K_S", "--imatrix", g, "--mtp-type", "same")
    assert res.exit_code == 2 and "mtpq imatrix --mtp" in res.output
    ours = tmp_path / "ours.gguf"
    assert run_cli("quantize", f32, ours, "Q2_K_S", "--imatrix", g, "-q").exit_code == 0
    _llama(
        llama_cpp_bin,
        llama_cpp_bin / "llama-quantize",
        "--imatrix",
        g,
        "--tensor-type",
        r"blk\.2\.=q8_0",
        f32,
        theirs,
        "Q2_K_S",
        "1",
    )
    _same_bytes(ours, theirs)
