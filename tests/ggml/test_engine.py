"""mtpq.ggml's one entry point: shapes and dtypes in, errors out (each naming the tensor), importance per
column and per expert, the float types as ggml converts them, the C float helpers, the i-quant grids."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from mtpq.ggml import engine, iqtables, jit
from mtpq.ggml.engine import Stored, dequantize, quantize
from mtpq.ggml.registry import TYPES, bytes_per_row, record
from tests.helpers.golden_quants import load_golden


def test_leading_dims_and_input_dtypes(inputs):
    x = inputs["gauss_512"]
    ref = load_golden("Q4_K.npz")["gauss_512"]
    assert np.array_equal(quantize(x.reshape(2, 2, 512), T.Q4_K), ref.reshape(2, 2, -1))
    assert np.array_equal(quantize(np.asfortranarray(x), T.Q4_K), ref)  # not C-ordered
    assert np.array_equal(quantize(x.astype(np.float64), T.Q4_K), ref)
    ro = x.copy()
    ro.flags.writeable = False  # a read-only mapping of a file
    assert np.array_equal(quantize(ro, T.Q4_K), ref)
    h = x.astype(np.float16)  # float16 and bf16 bits are widened exactly
    assert np.array_equal(quantize(h, T.Q8_0), quantize(h.astype(np.float32), T.Q8_0))
    b = (x.view(np.uint32) >> 16).astype(np.uint16)
    assert np.array_equal(quantize(b, T.Q6_K), quantize((b.astype(np.uint32) << 16).view(np.float32), T.Q6_K))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_K, T.IQ4_XS, T.TQ2_0], ids=lambda t: t.name)
def test_nan_inf_is_refused_naming_the_tensor(qtype, bad):
    x = np.zeros((2, 256), np.float32)
    x[1, 77] = bad
    with pytest.raises(ValueError) as e:
        quantize(x, qtype, "blk.3.ffn_up.weight")
    assert str(e.value) == "blk.3.ffn_up.weight: contains NaN/Inf values"


@pytest.mark.parametrize("qtype,n", [(T.Q8_0, 48), (T.Q5_1, 100), (T.Q4_K, 384), (T.IQ4_XS, 32), (T.Q1_0, 64)])
def test_a_row_of_part_blocks_is_refused(qtype, n):
    with pytest.raises(ValueError) as e:
        quantize(np.zeros((3, n), np.float32), qtype, "blk.0.attn_q.weight")
    assert str(e.value).startswith("blk.0.attn_q.weight:") and qtype.name in str(e.value) and str(n) in str(e.value)
    with pytest.raises(ValueError, match=qtype.name):
        bytes_per_row(qtype, n)


def test_types_without_kernels_and_without_importance():
    with pytest.raises(ValueError, match="no kernel for type Q8_1"):
        quantize(np.zeros((1, 32), np.float32), T.Q8_1)
    with pytest.raises(ValueError, match="w: IQ2_XXS needs an importance matrix"):
        quantize(np.zeros((1, 256), np.float32), T.IQ2_XXS, "w")
    assert [t.name for t in TYPES if record(t).requires_imatrix] == ["IQ2_XXS", "IQ2_XS", "IQ1_S"]


def test_importance_per_expert_is_each_experts_own(inputs):
    imp = load_golden("importance.npz")
    x = np.stack([inputs["gauss_512"], inputs["misc"][:4]])  # two experts of 4 rows
    w = np.stack([imp["gauss_512"], imp["misc"]])
    got = quantize(x, T.Q4_K, "exps", importance=w)
    assert np.array_equal(got[0], load_golden("Q4_K_imatrix.npz")["gauss_512"])
    assert np.array_equal(got[1], quantize(x[1], T.Q4_K, importance=w[1]))
    assert np.array_equal(quantize(x[0], T.Q4_K, importance=w[0][None]), got[0])  # (1, n) is one row
    with pytest.raises(ValueError, match="exps: importance data of shape \\(3, 512\\)"):
        quantize(x, T.Q4_K, "exps", importance=np.ones((3, 512), np.float32))
    assert np.array_equal(quantize(x, T.Q8_0, importance=w), quantize(x, T.Q8_0))  # ggml ignores it there


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q2_K, T.Q6_K, T.IQ4_XS, T.IQ1_M, T.TQ1_0], ids=lambda t: t.name)
def test_a_scale_overflowing_fp16_is_refused(qtype):
    big = 1e7 if qtype is T.IQ1_M else 1e10  # its squares' sums stay finite: the searches run, the scales overflow
    x = np.full((1, 256), big, np.float32)
    x[0, ::2] = -big
    kw = {"importance": np.ones(256, np.float32)} if record(qtype).requires_imatrix else {}
    with pytest.raises(ValueError, match=f"w: values too large for {qtype.name}"):
        quantize(x, qtype, "w", **kw)
    assert quantize(x, qtype, "w", check_scales=False, **kw).shape == (1, bytes_per_row(qtype, 256))


def test_a_file_that_ends_inside_the_tensor_is_refused(tmp_path):
    p = tmp_path / "short.bin"
    p.write_bytes(np.zeros(100, np.float32).tobytes())
    with pytest.raises(ValueError, match="truncated"):
        quantize(Stored(p, 0, T.F32, (2, 256)), T.Q8_0, "w")


def _special_f32() -> np.ndarray:
    bits = np.array(
        [
            0x00000000,
            0x80000000,
            0x00000001,
            0x807FFFFF,
            0x3F808000,
            0x3F818000,
            0x3F807FFF,
            0x3F80C000,
            0x7F7FFFFF,
            0xFF7FFFFF,
            0x387FC000,
            0x33800000,
            0x33800001,
            0x477FEFFF,
            0x477FF000,
            0x0001FFFF,
        ],
        dtype=np.uint32,
    )  # zeros, subnormals, ties, fp16 / bf16 edges
    rng = np.random.default_rng(7)
    rand = (rng.standard_normal(4096) * 10.0 ** rng.uniform(-8, 4, 4096)).astype(np.float32)
    return np.concatenate([bits.view(np.float32), rand]).reshape(-1, 16)


def test_float_types_round_as_ggml():
    x = _special_f32()
    f32 = quantize(x, T.F32)
    assert f32.dtype == np.float32 and np.array_equal(f32.view(np.uint32), x.view(np.uint32))
    small = np.where(np.abs(x) < 65520, x, 0).astype(np.float32)  # 65520 and up round to inf
    f16 = quantize(small, T.F16)
    assert f16.dtype == np.float16 and np.array_equal(f16.view(np.uint16), small.astype(np.float16).view(np.uint16))
    with pytest.raises(ValueError, match="w: values exceed the F16 range"):
        quantize(x, T.F16, "w")
    with pytest.raises(ValueError, match="w: values exceed the BF16 range"):  # FLT_MAX rounds to bf16 inf
        quantize(x, T.BF16, "w")
    bf = quantize(x, T.BF16, check_scales=False)
    assert bf.dtype == np.uint16 and np.array_equal(bf.view(np.uint8), gguf.quants.quantize(x, T.BF16))
    finite_bf = quantize(np.where(np.abs(x) < 1e38, x, 0).astype(np.float32), T.BF16)
    assert np.array_equal(quantize(finite_bf, T.BF16), finite_bf)
    for qt, arr in [(T.F32, f32), (T.F16, f16), (T.BF16, bf)]:
        ref = np.asarray(gguf.quants.dequantize(arr.view(np.uint8) if qt == T.BF16 else arr, qt), np.float32)
        assert np.array_equal(dequantize(arr, qt, arr.shape).view(np.uint32), ref.reshape(arr.shape).view(np.uint32))


def test_fp16_conversion_is_round_to_nearest_even_on_every_half_step():
    """ggml's software fp32 -> fp16 on the values around every fp16 number (and its halfway points)."""
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    f = h.view(np.float16).astype(np.float32)
    f = f[np.isfinite(f)]
    bits = f.view(np.uint32)
    probes = np.concatenate([bits, bits + 1, bits - 1, bits + (1 << 12), bits + (1 << 12) + 1]).view(np.float32)
    probes = probes[np.isfinite(probes)]
    got = np.empty(probes.size * 2, np.uint8)
    ok = __import__("mtpq.ggml.floats", fromlist=["to_f16"]).to_f16(probes, got)
    with np.errstate(over="ignore"):
        want = probes.astype(np.float16).view(np.uint16)
    assert np.array_equal(got.view(np.uint16), want) and not ok  # 65520 and up overflow: reported
    assert jit.fp16(np.float32("nan")) == 0x7E00 and jit.fp16_to_f32(np.uint16(0x0001)) == np.float32(2.0**-24)


def test_c_rounding_helpers():
    for v, want in [(0.5, 0), (1.5, 2), (2.5, 2), (-0.5, 0), (-1.5, -2), (4194303.0, 4194303)]:
        assert jit.nearest_int(np.float32(v)) == want  # the 12582912.f trick: halves to even
    for v, want in [(0.5, 1.0), (-0.5, -1.0), (2.5, 3.0), (0.49999997, 0.0), (-2.5, -3.0)]:
        assert jit.roundf(np.float32(v)) == np.float32(want)  # C roundf: halves away from zero
    assert jit.c_int(np.float32("nan")) == -(2**31) and jit.c_int(np.float32(3e9)) == -(2**31)
    assert jit.c_int(np.float32(-7.9)) == -7


def test_grid_neighbour_lists_follow_ggml_rules():
    """Grid points map to themselves; an off-grid lattice point's list holds the grid points at its nwant
    smallest squared distances, ordered by (distance, index), as iq2xs_init_impl's qsort leaves them."""
    pos, kmap, neighbours = iqtables.grid_tables("IQ2_XXS")
    assert pos.shape == (256, 8) and set(np.unique(pos)) == {1, 3, 5}
    rng = np.random.default_rng(0)
    reachable = [u for u in range(1 << 16) if all(((u >> (2 * k)) & 3) <= 2 for k in range(8))]
    off = [u for u in reachable if kmap[u] < 0]
    assert len(off) == 3**8 - 256
    for u in rng.choice(off, 20, replace=False):
        at = -int(kmap[u]) - 1
        lst = neighbours[at + 1 : at + 1 + int(neighbours[at])].tolist()
        p = 2 * ((u >> (2 * np.arange(8))) & 3) + 1
        d2 = ((pos.astype(np.int64) - p) ** 2).sum(1)
        two = np.unique(d2)[:2]
        assert lst == sorted(np.nonzero(np.isin(d2, two))[0].tolist(), key=lambda j: (d2[j], j))


@pytest.mark.parametrize("family", ["IQ1_S", "IQ3_S"])
def test_grid_lists_are_kept_on_disk_and_a_bad_copy_is_rebuilt(tmp_path, monkeypatch, family):
    """A later command loads the neighbour lists a first one stored; a cut-short, corrupt, foreign or altered
    copy, or a folder it cannot write, costs only the build, never wrong tables."""
    build, builds = iqtables._neighbour_lists, []

    def counted(*args):
        builds.append(family)
        return build(*args)

    monkeypatch.setattr(iqtables, "_neighbour_lists", counted)
    monkeypatch.setattr(iqtables.jit, "CACHE_DIR", str(tmp_path / "cache"))

    def tables():
        iqtables.grid_tables.cache_clear()
        builds.clear()
        return iqtables.grid_tables(family)

    want = tables()
    stored = tmp_path / "cache" / f"grid-{family}.npz"
    assert builds and stored.is_file() and [p.name for p in stored.parent.iterdir()] == [stored.name]

    def check(built_again):
        got = tables()
        assert bool(builds) == built_again
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b)

    check(built_again=False)
    good = stored.read_bytes()
    kmap = want[1].copy()
    on_grid = np.nonzero(kmap >= 0)[0][:2]
    kmap[on_grid] = kmap[on_grid[::-1]]  # two grid points swapped
    flip = len(good) // 3  # inside kmap's bytes: the zip's CRC catches it
    for bad in [good[: len(good) // 2], good[:flip] + bytes([good[flip] ^ 1]) + good[flip + 1 :], b"not a zip", None]:
        if bad is None:
            np.savez(stored, kmap=kmap, neighbours=want[2])
        else:
            stored.write_bytes(bad)
        check(built_again=True)
        assert stored.read_bytes() == good  # stored again, whole
    (tmp_path / "file").write_bytes(b"")
    monkeypatch.setattr(iqtables.jit, "CACHE_DIR", str(tmp_path / "file" / "cache"))  # cannot be made
    check(built_again=True)
    iqtables.grid_tables.cache_clear()


def test_gguf_writer_takes_the_arrays(tmp_path):
    """Every type's output goes straight into gguf-py's writer and reads back unchanged."""
    rng = np.random.default_rng(3)
    tensors = {
        t: quantize(rng.standard_normal((4, 256)).astype(np.float32), t, t.name, importance=np.ones(256, np.float32))
        for t in TYPES
    }
    p = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(p, "llama")
    for t, arr in tensors.items():
        w.add_tensor(f"t.{t.name}", arr, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for t in gguf.GGUFReader(p).tensors:
        qt = T[t.name[2:]]
        assert t.tensor_type == qt and [int(s) for s in t.shape] == [256, 4]
        assert np.asarray(t.data).tobytes() == tensors[qt].tobytes()


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("every", [1, 2, 8])
def test_out_buffer_and_progress(inputs, threads, every, monkeypatch):
    """The output fills ``out``; progress reports whole finished prefixes, growing, at most every ``every``
    tasks and at the end."""
    x = np.tile(inputs["gauss_512"], (4, 1))  # 16 rows: 16 tasks of one row
    ref = np.tile(load_golden("Q6_K.npz")["gauss_512"], (4, 1))
    out = np.empty(ref.nbytes, np.uint8)
    row = ref.shape[1]
    seen = []
    monkeypatch.setattr(engine, "CHUNK", 512)
    monkeypatch.setattr(engine, "REPORT_EVERY", every)
    monkeypatch.setitem(engine._state, "n", threads)
    got = quantize(x, T.Q6_K, out=out, progress=seen.append)
    assert np.shares_memory(got, out) and np.array_equal(got, ref)
    assert seen == sorted(set(seen)) and seen[-1] == out.nbytes and all(s % row == 0 for s in seen)
    assert all(b - a >= every * row for a, b in zip([0, *seen[:-2]], seen[:-1]))  # the last: when all are done
    if threads == 1:  # one thread finishes the tasks in order: a report every ``every``
        assert seen == [*range(every * row, out.nbytes, every * row), out.nbytes]


@pytest.mark.parametrize("bad_row", [0, 9, 15])
def test_a_failed_task_among_threads_is_raised_once_all_have_stopped(bad_row, monkeypatch):
    x = np.random.default_rng(2).normal(size=(16, 512)).astype(np.float32)
    x[bad_row, 100] = np.nan
    monkeypatch.setattr(engine, "CHUNK", 512)
    monkeypatch.setitem(engine._state, "n", 3)
    ran = []
    check = engine.floats.all_finite

    def checked(x):  # a good chunk takes 20 ms: the bad one is found while the others are still in theirs,
        ran.append(1)  # whichever thread the 2 cores run first (without it, the bound below was once missed)
        return check(x) and not time.sleep(0.02)

    monkeypatch.setattr(engine.floats, "all_finite", checked)
    with pytest.raises(ValueError, match="^blk.0.attn_q.weight: contains NaN/Inf values$"):
        quantize(x, T.Q8_0, "blk.0.attn_q.weight")
    count = len(ran)
    # task 0 runs alone; then tasks are taken in order and each thread stops after its current one
    assert count == 1 if bad_row == 0 else count <= min(16, bad_row + 3)
    assert engine._pool(2).submit(len, ran).result() == count  # and none ran on after the error came back


_LOAD_THEN_COMPILE = """
import hashlib, sys
import numpy as np
from gguf import GGMLQuantizationType as T
from mtpq.ggml.engine import quantize
x = np.random.default_rng(5).normal(size=(8, 512)).astype(np.float32)
for name in sys.argv[1:]:
    digest = hashlib.sha256(quantize(x, T[name]).tobytes()).hexdigest()
    print(name, digest, "numba.np.random.generator_core" in sys.modules)
"""


def test_kernels_load_from_the_cache_without_numbas_compiler_context(tmp_path):
    """jit._KernelCache: a kernel found in the cache is loaded without numba's context refresh (which imports
    every lowering numba has: 0.1-0.3 s of each command's start-up); a kernel missing from the same cache still
    compiles after such a load; both give the bytes this process gives."""
    x = np.random.default_rng(5).normal(size=(8, 512)).astype(np.float32)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}

    def run(*names: str) -> list[list[str]]:
        cmd = [sys.executable, "-c", _LOAD_THEN_COMPILE, *names]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=600).stdout
        return [line.split() for line in out.splitlines()]

    digest = {n: hashlib.sha256(quantize(x, T[n]).tobytes()).hexdigest() for n in ("Q4_0", "Q8_0")}
    assert run("Q4_0") == [["Q4_0", digest["Q4_0"], "True"]]  # an empty cache: compiled, the context refreshed
    loaded, compiled = run("Q4_0", "Q8_0")
    assert loaded == ["Q4_0", digest["Q4_0"], "False"]  # from the cache: numba's lowerings never imported
    assert compiled == ["Q8_0", digest["Q8_0"], "True"]
