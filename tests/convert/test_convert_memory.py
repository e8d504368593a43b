"""Memory of converting FP8 experts (issue 11): the stacked ``*_exps`` tensor is built expert by expert in
its output type, never as the whole stack in float32.

Measured in a fresh child process per output type: its peak RSS (VmHWM) is reset just before the write,
so the figure is what writing the file added. The writer's look-ahead is switched off there so that one
tensor is in flight.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFReader

from tests.builders import tiny, tiny_deepseek2

ROOT = Path(__file__).resolve().parents[2]
N_EXP, FF, H = 32, 2048, 256  # one stack: 16 M values, 67 MB in float32, 34 MB in bf16

CHILD = r"""
import gc, json, sys
from pathlib import Path
import mtpq.gguf_io as gio
import mtpq.ggml.engine  # imported before the measurement
from mtpq.convert import OUTTYPES, plan_checkpoint

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

gio.buffers.PREFETCH_BUDGET = 0  # one tensor at a time: the peak is one tensor's encoding
src, out, outtype = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
plan = plan_checkpoint(src, outtype=OUTTYPES[outtype])
gc.collect()
base = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM to the current RSS
gio.write_plan(plan, out)
print(json.dumps(status("VmHWM") - base))
"""


def fp8_moe_checkpoint(folder: Path, n_exp: int) -> Path:
    """DeepSeek-V3 layout, block-scaled FP8; one MoE layer (the MTP block) of n_exp experts of FF x H."""
    folder = tiny_deepseek2.deepseek_v3(
        folder, n_routed_experts=n_exp, moe_intermediate_size=FF, first_k_dense_replace=2, n_group=1, topk_group=1
    )
    tiny.to_fp8_block_scaled(folder)
    return folder


@pytest.fixture(scope="module")
def fp8_experts(tmp_path_factory) -> Path:
    """32 experts of 2048 x 256."""
    return fp8_moe_checkpoint(tmp_path_factory.mktemp("ds") / "fp8", N_EXP)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's resettable VmHWM")
def test_fp8_experts_are_stacked_in_the_output_type(fp8_experts, tmp_path):
    outtypes = ("bf16", "q8_0")
    children = {
        ot: subprocess.Popen(
            [sys.executable, "-c", CHILD, str(fp8_experts), str(tmp_path / f"{ot}.gguf"), ot],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for ot in outtypes
    }
    f32_stack = N_EXP * FF * H * 4
    for outtype, child in children.items():
        stdout, stderr = child.communicate(timeout=120)
        assert child.returncode == 0, stderr[-2000:]
        peak = json.loads(stdout.strip().splitlines()[-1])
        exps = [t for t in GGUFReader(tmp_path / f"{outtype}.gguf").tensors if t.name.endswith("_exps.weight")]
        assert sorted(tuple(int(d) for d in t.shape) for t in exps) == sorted([(H, FF, N_EXP)] * 2 + [(FF, H, N_EXP)])
        out_stack = max(int(t.n_bytes) for t in exps)
        # the measurement sees q8_0's output buffer itself (so a float32 copy could not hide; a bf16 stack
        # is written slab by slab as it is encoded, stream.SlabWrites, with no buffer of the stack) ...
        if outtype == "q8_0":
            assert peak >= 0.9 * out_stack, (outtype, peak, out_stack)
        # ... and not the stack in float32 as well: one expert in float32 is 2 MB, the stack 67 MB (measured
        # here: about 30 MB above the output; 170-340 MB when the experts were stacked in float32)
        assert peak < out_stack + f32_stack, (
            f"{outtype}: writing added {peak / 1e6:.0f} MB for a {out_stack / 1e6:.0f} MB experts stack "
            f"({f32_stack / 1e6:.0f} MB in float32)"
        )


def test_streamed_float_encoding_is_quantizes_encoding():
    """The streamed F32/F16/BF16 encoding (torch's conversion into the output buffer) gives quantize's bytes
    (ggml's rounding) on the hard cases: exact ties, subnormals, the largest finite values; and refuses what
    quantize refuses, with its message."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType as T

    from mtpq.convert.stream import encode_slabs
    from mtpq.errors import InputError
    from mtpq.ggml.engine import quantize

    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (64, 256), generator=gen, dtype=torch.int64).to(torch.int32)
    bits[:16] = (bits[:16] & ~0xFFFF) | 0x8000  # ties to even for bf16
    bits[16:24] &= 0x807FFFFF  # subnormals
    x = bits.view(torch.float32)
    x[~torch.isfinite(x)] = 1.0
    x[24, :8] = torch.tensor([3.3895e38, -3.3895e38, 65504.0, -65519.0, 1e-45, -0.0, 6e-8, 2.9e-8])
    for qtype in (T.F32, T.BF16, T.F16):
        v = x.clone()
        if qtype == T.F16:
            v = v.clamp(-65504, 65504) * torch.rand(v.shape, generator=gen)  # F16 refuses larger values
        slabs = [(r, r + 5, (lambda a: lambda: v[a : a + 5])(r)) for r in range(0, 64, 5)]
        got = encode_slabs("t", "src", tuple(v.shape), qtype, slabs)
        want = quantize(v.numpy(), qtype, "t")
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), qtype.name
    for qtype, bad in ((T.F16, 70000.0), (T.BF16, 3.4e38), (T.F32, float("nan"))):
        v = x.clone().clamp(-60000, 60000)
        v[3, 7] = bad
        with pytest.raises(ValueError) as want:
            quantize(v.numpy(), qtype, "t")
        with pytest.raises(InputError) as got:
            encode_slabs("t", "src", tuple(v.shape), qtype, [(0, 64, lambda: v)])
        assert str(want.value) in str(got.value)


def test_fp8_tile_tables_give_the_rounded_float32_bytes(tmp_path):
    """Block-scaled FP8 rows rounded straight into the output type (HFCheckpoint.rows_as) give the bytes of
    rounding the float32 rows (load_rows): every byte value, ragged edge tiles, scales from
    tiny (subnormal products) to huge. Rows that may hold a value that is not finite in the output type (a
    NaN byte, a product past F16's range) are left to the float32 path, whose checks and messages the
    conversion keeps."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType as T
    from safetensors.torch import save_file

    from mtpq.convert.checkpoint import HFCheckpoint
    from mtpq.convert.stream import encode_tensor
    from mtpq.errors import InputError

    gen = torch.Generator().manual_seed(0)
    rows, cols = 300, 520  # 3 x 5 tiles of 128, the last row and column of tiles ragged
    q = torch.randint(0, 256, (rows, cols), generator=gen, dtype=torch.uint8)
    for i in range(0, rows, 128):  # every byte value in every tile
        for j in range(0, cols, 128):
            tile = q[i : i + 128, j : j + 128]
            flat = tile.flatten()
            flat[:256] = torch.arange(256, dtype=torch.uint8)
            tile.copy_(flat.view(tile.shape))
    q[(q & 0x7F) == 0x7F] = 0x3C  # no NaN byte yet
    s = torch.exp(torch.randn(3, 5, generator=gen) * 4).clamp(max=100.0)  # 448 * 100 fits F16
    s[0, 1], s[2, 0], s[2, 4] = 1e-41, 2e-6, 3e-3  # subnormal float32 products; F16 subnormals; a ragged corner
    s[1, 2] = 300.0  # 448 * 300 is past F16's 65504: rows 128:256 leave F16 to the float32 path

    def checkpoint(q: torch.Tensor, folder: Path) -> HFCheckpoint:
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        save_file({"w": q.view(torch.float8_e4m3fn), "w_scale_inv": s}, str(folder / "model.safetensors"))
        return HFCheckpoint(folder)

    ck = checkpoint(q, tmp_path / "ok")
    direct = {}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for r0, r1 in ((0, 128), (128, 256), (256, 300), (0, 300)):
            want = ck.load_rows("w", r0, r1).to(dtype)
            out = torch.full((r1 - r0, cols), float("nan"), dtype=dtype)
            direct[dtype, r0, r1] = ck.rows_as("w", r0, r1, out)
            if direct[dtype, r0, r1]:
                assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), (dtype, r0, r1)
            else:
                assert not torch.isfinite(want).all(), (dtype, r0, r1)  # only when the rows need the checks
    assert [k for k, ok in direct.items() if not ok] == [(torch.float16, 128, 256), (torch.float16, 0, 300)]

    # the conversion's bytes and errors: quantize's, from the float32 values
    from mtpq.ggml.engine import quantize

    for qtype in (T.BF16, T.F32):
        got = encode_tensor(ck, "w", "t", "src", qtype)
        assert np.array_equal(got.view(np.uint8), quantize(ck.load("w").numpy(), qtype, "t").view(np.uint8))
    with pytest.raises(InputError, match="exceed the F16 range"):
        encode_tensor(ck, "w", "t", "src", T.F16)
    q[200, 300] = 0xFF  # NaN
    nan = checkpoint(q, tmp_path / "nan")
    assert not nan.rows_as("w", 128, 256, torch.empty(128, cols, dtype=torch.bfloat16))
    assert nan.rows_as("w", 0, 128, torch.empty(128, cols, dtype=torch.bfloat16))
    with pytest.raises(InputError, match="contains NaN/Inf values"):
        encode_tensor(nan, "w", "t", "src", T.BF16)


def test_fp8_block_scaled_values_are_torchs_products(tmp_path):
    """load_rows' float32 values of block-scaled FP8 (the bit decoding rows_as shares) are torch's own: the
    FP8 value ``.to(torch.float32)`` times its tile's scale, one rounding. Every byte of e4m3fn and e5m2, NaN
    and Inf ones too (they stay NaN and Inf, for the conversion's checks), ragged tiles, scales from tiny to
    past float32's range once scaled by the decoding's power of two; a stack [E, rows, cols] too."""
    import torch
    from safetensors.torch import save_file

    from mtpq.convert.checkpoint import HFCheckpoint

    gen = torch.Generator().manual_seed(1)
    rows, cols = 200, 300  # 2 x 3 tiles of 128, ragged
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        for nan in (False, True):
            q = torch.randint(0, 256, (2, rows, cols), generator=gen, dtype=torch.uint8)
            q[:, :2, :128] = torch.arange(256, dtype=torch.uint8).view(2, 128)  # every byte in a tile
            if not nan:  # the rows without a byte that is not finite take the bit decoding
                q[(q & 0x7F) >= (0x7F if fp8 == torch.float8_e4m3fn else 0x7C)] = 0x30
            s = torch.exp(torch.randn(2, 2, 3, generator=gen) * 4)
            s[0, 0, 1], s[0, 1, 2], s[1, 1, 0] = 1e-41, 3e36, 1e-30  # subnormal products; s * 2**120 overflows
            folder = tmp_path / f"{fp8}-{nan}"
            folder.mkdir()
            (folder / "config.json").write_text("{}")
            save_file(
                {"w": q[0].clone().view(fp8), "w_scale_inv": s[0].clone(), "e": q.view(fp8), "e_scale_inv": s},
                str(folder / "model.safetensors"),
            )
            ck = HFCheckpoint(folder)
            want = q.view(fp8).to(torch.float32)
            want *= s.repeat_interleave(128, 1)[:, :rows].repeat_interleave(128, 2)[:, :, :cols]
            for got, exp in (
                (ck.load_rows("w", 0, rows), want[0]),
                (ck.load_rows("w", 128, rows), want[0, 128:]),
                (ck.load("e"), want),
                (ck.load_rows("e", 1, 2), want[1:]),
            ):
                assert torch.equal(got.view(torch.int32), exp.view(torch.int32)) or (
                    torch.equal(got.isnan(), exp.isnan()) and torch.equal(got.nan_to_num(), exp.nan_to_num())
                ), (fp8, nan)
            assert bool(want.isnan().any()) == nan


def test_tensors_encoded_ahead_are_written_as_encoded(tmp_path, monkeypatch):
    """The writer writes a tensor's finished rows while the rest are converted (gguf_io._Ahead): the file holds
    the bytes the encoder returns, also when they are not the buffer whose rows were reported (rewritten
    whole), and an encoder's error mid-tensor still fails the write and leaves no file."""
    import time

    import numpy as np
    import torch
    from gguf import GGMLQuantizationType as T

    import mtpq.gguf_io as gio
    from mtpq.convert import stream
    from mtpq.errors import InputError
    from mtpq.tensors import Plan, Role, TensorSpec

    monkeypatch.setattr(stream, "FLOAT_WORKERS", 1)  # slabs in order, one at a time: the writer sees each
    rows, cols = 64, 256
    values = [torch.randn(rows, cols, generator=torch.Generator().manual_seed(i)) for i in range(4)]

    def slabs(v: torch.Tensor, fail: bool = False):
        def load(r0: int) -> torch.Tensor:
            time.sleep(0.01)  # the writer gets the finished rows before the tensor is done
            if fail and r0 >= rows // 2:
                raise InputError("src", "broken slab")
            return v[r0 : r0 + 8]

        return [(r0, r0 + 8, (lambda r0: lambda: load(r0))(r0)) for r0 in range(0, rows, 8)]

    def encoded(i: int, how: str):
        def run():
            out = stream.encode_slabs(f"t{i}", "src", (rows, cols), T.BF16, slabs(values[i], how == "fail"))
            if how == "copy":  # the same bytes, elsewhere
                return out.copy()
            if how == "other":  # other bytes than the rows reported
                return np.ascontiguousarray(out[::-1])
            return out

        return run

    def plan(hows: list[str]) -> Plan:
        specs = [
            TensorSpec(f"t{i}", (rows, cols), Role.OTHER, T.BF16, lambda: None, "src", T.BF16, encoded(i, how))
            for i, how in enumerate(hows)
        ]
        return Plan("llama", {}, specs)

    hows = ["same", "same", "copy", "other"]
    gio.write_plan(plan(hows), tmp_path / "ok.gguf")
    got = {
        t.name: np.array(t.data).view(np.uint16).reshape(rows, cols) for t in GGUFReader(tmp_path / "ok.gguf").tensors
    }
    for i, how in enumerate(hows):
        want = values[i].to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        assert np.array_equal(got[f"t{i}"], want[::-1] if how == "other" else want), how
    with pytest.raises(InputError, match="broken slab"):
        gio.write_plan(plan(["same", "fail"]), tmp_path / "bad.gguf")
    assert not (tmp_path / "bad.gguf").exists()


def test_fp8_channel_scaled_values_are_torchs_products(tmp_path):
    """Compressed-tensors FP8 (a per-channel [out, 1] or per-tensor ``_scale``) decoded by the bit moves of the
    block-scaled tensors: torch's ``.to(torch.float32)`` times the scale, one rounding, for every byte of
    e4m3fn and e5m2 (NaN and Inf kept), 1-D to 3-D tensors, scales with subnormal or past-range products."""
    import torch
    from safetensors.torch import save_file

    from mtpq.convert.checkpoint import HFCheckpoint

    gen = torch.Generator().manual_seed(3)
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        for shape in ((300, 130), (64,), (5, 7, 9)):
            q = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
            q.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)[: q.numel()]
            for kind in ("channel", "tensor"):
                if kind == "channel":
                    s = torch.exp(torch.randn(shape[0], 1, generator=gen) * 6)
                    s[0, 0], s[1, 0] = 1e-41, 3e36
                else:
                    s = torch.tensor(3e-3)
                folder = tmp_path / f"{fp8}-{len(shape)}-{kind}"
                folder.mkdir()
                (folder / "config.json").write_text("{}")
                save_file({"w": q.view(fp8), "w_scale": s}, str(folder / "model.safetensors"))
                ck = HFCheckpoint(folder)
                want = q.view(fp8).to(torch.float32) * (
                    s.reshape(-1, *[1] * (len(shape) - 1)) if kind == "channel" else s
                )
                for got, exp in ((ck.load("w"), want), (ck.load_rows("w", 2, 4), want[2:4])):
                    assert got.shape == exp.shape and torch.equal(got.isnan(), exp.isnan()), (fp8, shape, kind)
                    assert torch.equal(got.nan_to_num().view(torch.int32), exp.nan_to_num().view(torch.int32)), (
                        fp8,
                        shape,
                        kind,
                    )


CHILD_BUDGET = r"""
import gc, json, sys
from pathlib import Path
import mtpq.gguf_io as gio
from mtpq.convert import OUTTYPES, plan_checkpoint

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

src, out, budget, outtype = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
gio.buffers.PREFETCH_BUDGET = budget
from mtpq.ggml import engine
engine.warm([OUTTYPES[outtype]])  # numba and the kernels loaded before the measurement
plan = plan_checkpoint(src, outtype=OUTTYPES[outtype])
gc.collect()
base = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
gio.write_plan(plan, out)
print(json.dumps(status("VmHWM") - base))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's resettable VmHWM")
def test_a_stack_encoded_ahead_is_not_held_past_its_write(tmp_path):
    """The look-ahead budget fits a small tensor plus one experts stack but not two stacks: the first stack is
    encoded ahead (while the small tensor before it is written), the second is not, and the first one's buffer
    must be gone before the second's is filled. The writer's loop once kept it (a local that outlived the
    write): two stacks in memory, over the 1 GB + largest tensor bound at scale (a 671 MB stack: 1.04x).
    Measured with q8_0, whose stacks are encoded into a buffer of their own; a float stack (bf16) is encoded
    as it is written (stream.SlabWrites) and never held whole."""
    n_exp = 3 * N_EXP  # 96 experts: 101 MB stacks in bf16, 53 MB in q8_0
    folder = fp8_moe_checkpoint(tmp_path / "fp8", n_exp)
    for outtype, stack in (("q8_0", n_exp * FF * H // 32 * 34), ("bf16", n_exp * FF * H * 2)):
        res = subprocess.run(
            [sys.executable, "-c", CHILD_BUDGET, str(folder), str(tmp_path / "out.gguf"), str(stack * 3 // 2), outtype],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=300,
        )
        assert res.returncode == 0, res.stderr[-2000:]
        peak = json.loads(res.stdout.strip().splitlines()[-1])
        msg = f"{outtype}: writing added {peak / 1e6:.0f} MB for {stack / 1e6:.0f} MB stacks"
        if outtype == "q8_0":  # one stack and the slabs' work space; two stacks are twice the stack and more
            assert stack <= peak < 2 * stack, msg
        else:  # the slabs' buffers only (~45 MB): not even one stack
            assert peak < stack, msg


def test_float_tensors_encoded_as_written_are_the_buffered_bytes(fp8_experts, tmp_path, monkeypatch):
    """Float tensors encoded as they are written (stream.SlabWrites: each slab written at its place in the
    file by the worker that converted it) give the bytes of encoding them into a buffer first, for bf16, f16
    and f32 from block-scaled FP8, whatever the slabs' order of completion; as an array too; and a NaN byte
    is still refused, with the tensor named and no file left."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType as T
    from safetensors.torch import load_file, save_file

    import mtpq.gguf_io as gio
    from mtpq.convert import stream
    from mtpq.convert.checkpoint import HFCheckpoint
    from mtpq.errors import InputError

    def write(src: Path, outtype: str, streamed: bool) -> bytes:
        monkeypatch.setattr(stream, "WRITE_SLABS_BYTES", 0 if streamed else 1 << 62)
        monkeypatch.setattr(stream, "FLOAT_SLAB_ELEMENTS", 1 << 16)  # many slabs per tensor, finishing out of order
        out = tmp_path / f"{src.name}-{outtype}-{streamed}.gguf"
        gio.write_plan(plan_checkpoint(src, outtype=OUTTYPES[outtype]), out)
        return out.read_bytes()

    from mtpq.convert import OUTTYPES, plan_checkpoint

    for outtype in ("bf16", "f16", "f32"):
        assert write(fp8_experts, outtype, True) == write(fp8_experts, outtype, False), outtype

    ck = HFCheckpoint(fp8_experts)
    name = next(n for n in ck.names() if ck.is_fp8(n) and len(ck.shape(n)) == 2 and ck.shape(n)[0] > 128)
    monkeypatch.setattr(stream, "WRITE_SLABS_BYTES", 0)
    lazy = stream.encode_tensor(ck, name, "t", "src", T.BF16)
    assert isinstance(lazy, stream.SlabWrites)
    want = ck.load(name).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(np.asarray(lazy), want)
    assert np.array_equal(np.asarray(lazy.reshape(-1, 2, want.shape[1])), want.reshape(-1, 2, want.shape[1]))

    bad = tmp_path / "nan"
    shutil.copytree(fp8_experts, bad)
    shard = next(f for f in sorted(bad.glob("*.safetensors")) if name in load_file(str(f)))
    tensors = load_file(str(shard))
    q = tensors[name].view(torch.uint8).clone()
    q[q.shape[0] - 1, 5] = 0x7F  # a NaN byte in the last slab
    tensors[name] = q.view(torch.float8_e4m3fn)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(InputError, match="contains NaN/Inf values"):
        write(bad, "bf16", True)
    assert not (tmp_path / "nan-bf16-True.gguf").exists()
