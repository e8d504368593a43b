"""A local Hugging Face checkpoint folder, read lazily.

Validates everything cheap up front (config, index, every shard's header) so a
bad folder fails before any output is written, then hands out loaders that read
one tensor at a time from memory-mapped safetensors. FP8 weights are dequantized
on the fly, per tensor:

- block-scaled e4m3 with ``<name>_scale_inv`` (128x128 tiles, w = q * s per tile;
  DeepSeek-V3, Qwen3.5/3.6-FP8)
- compressed-tensors per-channel ``<name>_scale`` of shape [out, 1] (GLM-4.5-FP8)
"""

from __future__ import annotations

import contextlib
import functools
import json
import mmap
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..errors import InputError
from .hfconfig import check_config

ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,  # power-of-two scales (DeepSeek-V4's UE8M0 .scale companions)
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_ST_ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
_FP8 = {"F8_E4M3", "F8_E5M2"}
# activation-side companions (input and FP8 KV-cache scales: ModelOpt's k_proj.k_scale / v_proj.v_scale) are
# unused by a converter, as llama.cpp's drops them
_ACTIVATION_SCALES = (".input_scale", ".k_scale", ".v_scale", ".weight_zero_point")
_SCALE_SUFFIXES = ("_scale_inv", "_scale", *_ACTIVATION_SCALES)


@dataclass(frozen=True)
class StoredTensor:
    name: str
    file: Path
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


class _DuplicateKey(ValueError):
    pass


def _no_duplicate_keys(pairs: list) -> dict:
    out = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def read_safetensors_header(path: Path) -> dict[str, StoredTensor]:
    """Parse and check one shard's header; any inconsistency is an InputError naming the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise InputError(path, "truncated safetensors file (no header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100 * 1024 * 1024:
            raise InputError(path, f"corrupt safetensors header (header length {n} exceeds file size {size})")
        raw = f.read(n)
    try:
        header = json.loads(raw, object_pairs_hook=_no_duplicate_keys)
    except _DuplicateKey as exc:
        raise InputError(path, f"corrupt safetensors header: tensor {exc} is listed twice") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(path, f"corrupt safetensors header ({exc.__class__.__name__})") from None
    if not isinstance(header, dict):
        raise InputError(path, "corrupt safetensors header (not a JSON object)")
    data_size = size - 8 - n
    out: dict[str, StoredTensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, start, end = _header_entry(path, name, info)
        numel = 1
        for d in shape:
            numel *= d
        if end - start != numel * _ST_ITEMSIZE[dtype]:
            raise InputError(path, f"corrupt safetensors header: {name} byte range does not match its shape")
        if end > data_size:
            raise InputError(
                path, f"truncated safetensors file: {name} ends at byte {8 + n + end}, the file has {size}"
            )
        out[name] = StoredTensor(name, path, dtype, shape, 8 + n + start, end - start)
    _check_byte_ranges(path, out, 8 + n, data_size)
    return out


def _header_entry(path: Path, name: str, info) -> tuple[str, tuple[int, ...], int, int]:
    """dtype, shape, start, end of one header entry, each of the JSON type the format prescribes."""

    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise InputError(path, f"corrupt safetensors header entry for {name} (needs dtype, shape, data_offsets)")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _ST_ITEMSIZE:
        raise InputError(path, f"tensor {name} has unsupported dtype {dtype}")
    if not isinstance(shape, list) or not all(is_int(d) for d in shape):
        raise InputError(path, f"corrupt safetensors header: {name} shape {shape!r} is not a list of integers")
    if any(d < 0 for d in shape):
        raise InputError(path, f"corrupt safetensors header: {name} has a negative dimension {shape}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_int(o) for o in offsets)):
        raise InputError(path, f"corrupt safetensors header: {name} data_offsets {offsets!r} is not [start, end]")
    start, end = offsets
    if start < 0 or end < start:
        raise InputError(path, f"corrupt safetensors header: {name} data_offsets {offsets} is not a byte range")
    return dtype, tuple(shape), start, end


def _check_byte_ranges(path: Path, tensors: dict[str, StoredTensor], data_start: int, data_size: int) -> None:
    """What the safetensors format requires: the tensors' byte ranges tile the data area exactly,
    with no overlap (one tensor would read another's bytes) and no hole or trailing bytes."""
    at = data_start
    prev = None
    for st in sorted(tensors.values(), key=lambda t: (t.offset, t.nbytes)):
        if st.offset < at:
            raise InputError(
                path,
                f"corrupt safetensors header: tensors {prev} and {st.name} overlap "
                f"(bytes {st.offset - data_start}..{at - data_start} of the data area)",
            )
        if st.offset > at:
            raise InputError(
                path,
                f"corrupt safetensors header: bytes {at - data_start}..{st.offset - data_start} "
                f"of the data area belong to no tensor",
            )
        at, prev = st.offset + st.nbytes, st.name
    if at != data_start + data_size:
        raise InputError(
            path,
            f"corrupt safetensors file: {data_start + data_size - at} bytes after the last "
            f"tensor's data (the data area ends at byte {at - data_start}, the file has "
            f"{data_size} data bytes)",
        )


class HFCheckpoint:
    """config.json + safetensors shards (+ tokenizer files) of one model folder."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            what = "a file" if self.folder.exists() else "no such directory"
            raise InputError(self.folder, f"not a checkpoint folder ({what})")
        cfg_path = self.folder / "config.json"
        if cfg_path.is_dir():
            raise InputError(cfg_path, "is a folder, not a file")
        if not cfg_path.is_file():
            raise InputError(cfg_path, "missing config.json")
        try:
            self.config: dict = json.loads(cfg_path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise InputError(cfg_path, f"not UTF-8 text (byte {exc.start})") from None
        except json.JSONDecodeError as exc:
            raise InputError(cfg_path, f"invalid JSON ({exc})") from None
        check_config(self.config, cfg_path)
        self._hparams: dict | None = None
        self.shards = self._find_shards()
        # the last few block-scaled tensors' float32 tile scales: each slab of a tensor needs them, and reading
        # them again (a file open, a read, a conversion) is a large part of a small slab's time
        self._scales: dict[str, np.ndarray] = {}
        self._scales_lock = threading.Lock()
        self.stored: dict[str, StoredTensor] = {}
        for shard in self.shards:
            for name, st in read_safetensors_header(shard).items():
                if name in self.stored:
                    raise InputError(shard, f"tensor {name} is also stored in {self.stored[name].file.name}")
                self.stored[name] = st
        self._check_index()

    # -- layout -------------------------------------------------------------------------

    def _find_shards(self) -> list[Path]:
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_bytes().decode("utf-8"))["weight_map"]
            except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
                raise InputError(index, "invalid index (expected a JSON object with weight_map)") from None
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise InputError(index, "invalid index (weight_map must map tensor names to shard file names)")
            self.weight_map: dict[str, str] | None = weight_map
            shards = sorted({self.folder / f for f in weight_map.values()})
            for s in shards:
                if not s.is_file():
                    raise InputError(index, f"lists shard {s.name}, which does not exist")
            return shards
        self.weight_map = None
        shards = sorted(self.folder.glob("*.safetensors"))
        if not shards:
            raise InputError(self.folder, "no *.safetensors files and no model.safetensors.index.json")
        return shards

    def _check_index(self) -> None:
        if self.weight_map is None:
            return
        index = self.folder / "model.safetensors.index.json"
        for name, fname in self.weight_map.items():
            st = self.stored.get(name)
            if st is None or st.file.name != Path(fname).name:
                raise InputError(index, f"maps {name} to {fname}, but that shard does not contain it")

    @property
    def hparams(self) -> dict:
        """config.json as llama.cpp's converter reads it: the stored keys plus those transformers derives
        (:mod:`.hfconfig`); ``config`` stays the file as stored."""
        if self._hparams is None:
            from .hfconfig import hparams_view

            self._hparams = hparams_view(self.folder, self.config)
        return self._hparams

    @property
    def files(self) -> list[Path]:
        return [self.folder / "config.json", *self.shards]

    # -- tensors ------------------------------------------------------------------------

    def names(self) -> list[str]:
        """Logical tensor names: FP8 scale companions are folded into their weights."""
        return [n for n in self.stored if not self.is_scale(n)]

    def is_scale(self, name: str) -> bool:
        if not name.endswith(_SCALE_SUFFIXES):
            return False
        base = name
        for suf in ("_scale_inv", "_scale"):
            if name.endswith(suf):
                base = name[: -len(suf)]
        return base in self.stored or name.endswith(_ACTIVATION_SCALES)

    def __contains__(self, name: str) -> bool:
        return name in self.stored and not self.is_scale(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.stored[name].shape

    def source_dtype(self, name: str) -> str:
        return self.stored[name].dtype

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Read a stored (non-FP8) tensor's bytes straight into ``out`` (same dtype and size): no extra copy."""
        st = self.stored[name]
        if ST_DTYPES[st.dtype] != out.dtype or out.numel() * out.element_size() != st.nbytes:
            raise ValueError(f"{name}: read_into needs a {st.dtype} buffer of {st.nbytes} bytes")
        view = memoryview(out.view(torch.uint8).numpy()).cast("B") if st.nbytes else memoryview(b"")
        with open(st.file, "rb") as f:
            f.seek(st.offset)
            if f.readinto(view) != st.nbytes:
                raise InputError(st.file, f"truncated safetensors file: {name} is incomplete")

    def map_bits(self, name: str) -> np.ndarray:
        """A stored float tensor's bits (uint16 for 2-byte types, uint32 for F32), read-only, mapped from the
        file: no copy into fresh memory (whose page faults cost as much as the copy). The mapping, and the
        file pages it holds in this process's RSS, goes when the array does; the writer drops each tensor
        once written."""
        return self._map(name, {2: np.uint16, 4: np.uint32}[_ST_ITEMSIZE[self.stored[name].dtype]])

    def _map(self, name: str, dtype, r0: int = 0, r1: int | None = None) -> np.ndarray:
        """Rows ``r0:r1`` (dim 0) of a stored tensor as a read-only array of ``dtype`` mapped from the file."""
        st = self.stored[name]
        shape, offset, nbytes = _rows_extent(st, r0, r1)
        if nbytes == 0:
            return np.empty(shape, dtype=dtype)
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        try:
            with open(st.file, "rb") as f:
                if os.fstat(f.fileno()).st_size < st.offset + st.nbytes:  # shrunk since the header was read
                    raise InputError(st.file, f"truncated safetensors file: {name} is incomplete")
                mm = mmap.mmap(
                    f.fileno(),
                    offset + nbytes - start,
                    offset=start,
                    prot=mmap.PROT_READ,
                    flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                )  # mapped in one go
        except OSError as exc:
            raise InputError(st.file, f"cannot read tensor {name} ({exc.strerror or exc})") from None
        n = nbytes // np.dtype(dtype).itemsize
        return np.frombuffer(mm, dtype=dtype, count=n, offset=offset - start).reshape(shape)

    def _scratch_rows(self, name: str, r0: int, r1: int) -> np.ndarray:
        """The bytes of rows ``r0:r1`` (dim 0) of a stored tensor as uint8 [rows, row bytes], read into this
        thread's scratch buffer (valid until the thread's next call): no fresh memory, and half the time of
        mapping a slab (whose page-table set-up and tear-down cost more than the copy), which it leaves
        in the cache for what reads it next."""
        st = self.stored[name]
        shape, offset, nbytes = _rows_extent(st, r0, r1)
        buf = getattr(_scratch, "buf", None)
        if buf is None or buf.nbytes < nbytes:
            buf = _scratch.buf = np.empty(nbytes, dtype=np.uint8)
        view = buf[:nbytes]
        _read_into(st, offset, view)
        return view.reshape(shape[0], -1) if shape else view

    def is_fp8(self, name: str) -> bool:
        return self.stored[name].dtype in _FP8

    def raw(self, name: str, r0: int = 0, r1: int | None = None) -> torch.Tensor:
        """Read one tensor (or its rows ``r0:r1`` along dim 0) with plain file I/O (positions come from the
        validated header).

        Not a memory map: pages of a mapped checkpoint stay resident in the process
        (they count in its RSS) until the mapping closes; a read into a fresh buffer
        costs the same copy and leaves only this tensor in memory.
        """
        st = self.stored[name]
        shape, offset, nbytes = _rows_extent(st, r0, r1)
        buf = bytearray(nbytes)
        _read_into(st, offset, buf)
        if nbytes == 0:
            return torch.empty(shape, dtype=ST_DTYPES[st.dtype])
        return torch.frombuffer(buf, dtype=ST_DTYPES[st.dtype]).reshape(shape)

    def loader(self, name: str) -> Callable[[], torch.Tensor]:
        """A callable returning the tensor's values (FP8 dequantized to float32)."""
        if name not in self.stored:
            raise KeyError(name)
        return lambda: self.load(name)

    def load(self, name: str) -> torch.Tensor:
        t = self.raw(name)
        return self._dequantize(name, t, 0) if self.stored[name].dtype in _FP8 else t

    def load_rows(self, name: str, r0: int, r1: int) -> torch.Tensor:
        """Rows ``r0:r1`` (dim 0) of a tensor, reading only their bytes (FP8 dequantized to float32). For a
        2-D block-scaled FP8 tensor ``r0`` must start a tile (:meth:`row_step`)."""
        t = self.raw(name, r0, r1)
        return self._dequantize(name, t, r0) if self.stored[name].dtype in _FP8 else t

    def row_step(self, name: str) -> int:
        """The granularity of :meth:`load_rows`: a 2-D block-scaled tensor's tile height, else 1."""
        return _block_size(self.config)[0] if self._tile_scaled(name) else 1

    def _tile_scaled(self, name: str) -> bool:
        st = self.stored[name]
        return st.dtype in _FP8 and len(st.shape) == 2 and name + "_scale_inv" in self.stored

    def rows_as(self, name: str, r0: int, r1: int, out: torch.Tensor) -> bool:
        """Rows ``r0:r1`` of a 2-D block-scaled FP8 tensor written into ``out`` (bfloat16, float16 or float32,
        their shape) with no float32 copy of the whole rows, in the bytes of rounding :meth:`load_rows`: the
        same float32 products w * s (:func:`fp8_scaled`), rounded to ``out``'s type by torch, as the rows are.
        False, ``out`` left unspecified, for any other tensor, or when the rows may hold a value that is not
        finite in ``out``'s type (a NaN byte, a product past its range): the caller then rounds
        :meth:`load_rows`, whose checks say which."""
        if not self._tile_scaled(name):
            return False
        q = self._scratch_rows(name, r0, r1)
        s, bh, bw = self._tile_scales(name, r0, r1)
        fp8 = ST_DTYPES[self.stored[name].dtype]
        if not _codes_below(q, _first_not_finite(fp8, float(np.abs(s).max()), out.dtype)):
            return False
        # float32 work space: ``out`` itself, or a slab's worth (small: malloc reuses it, no page faults)
        x = out if out.dtype == torch.float32 else torch.empty(out.shape, dtype=torch.float32)
        fp8_scaled(q, fp8, s, bh, bw, x, finite=True)
        if x is not out:
            out.copy_(x)  # torch's rounding, as of load_rows' values
        return True

    def _tile_scales(self, name: str, r0: int, r1: int) -> tuple[np.ndarray, int, int]:
        """The float32 ``_scale_inv`` of the tiles of rows ``r0:r1`` (dim 0; of a stack [E, rows, cols], of its
        experts r0:r1), tile height and width."""
        st = self.stored[name]
        bh, bw = _block_size(self.config)
        with self._scales_lock:
            s = self._scales.get(name)
        if s is None:
            s = self.raw(name + "_scale_inv").to(torch.float32).numpy()
            rows, cols = st.shape[-2], st.shape[-1]
            want = (-(-rows // bh), -(-cols // bw))
            if tuple(s.shape[-2:]) != want:
                raise InputError(
                    st.file, f"{name}_scale_inv has shape {tuple(s.shape)}, expected {list(want)} for {bh}x{bw} tiles"
                )
            with self._scales_lock:
                self._scales[name] = s
                while len(self._scales) > 8:
                    del self._scales[next(iter(self._scales))]
        if len(st.shape) == 2:  # rows r0:r1 are tile rows r0/bh..
            if r0 % bh:
                raise ValueError(f"{name}: rows from {r0} do not start a {bh}-row tile")
            s = s[r0 // bh : -(-r1 // bh)]
        elif s.ndim == len(st.shape):  # stacked [E, rows, cols]: dim 0 indexes the experts of both
            s = s[r0:r1]
        return s, bh, bw

    def _dequantize(self, name: str, t: torch.Tensor, r0: int) -> torch.Tensor:
        """float32 values of FP8 rows ``r0:r0+len(t)``."""
        st = self.stored[name]
        r1 = r0 + (t.shape[0] if t.dim() else 1)
        if name + "_scale_inv" in self.stored:  # block-scaled, 128x128 tiles by default
            s, bh, bw = self._tile_scales(name, r0, r1)
            w = torch.from_numpy(np.empty(t.shape, dtype=np.float32))  # numpy's: huge pages (see stream._float_slabs)
            q = t.view(torch.uint8).numpy()
            rows, cols = q.shape[-2:]
            q, x = q.reshape(-1, rows, cols), w.view(-1, rows, cols)
            with one_torch_thread():
                for e in range(len(q)):  # the experts of a stack [E, rows, cols], with their own tiles or shared ones
                    fp8_scaled(q[e], t.dtype, s[e] if s.ndim == 3 else s, bh, bw, x[e])
            return w
        if name + "_scale" in self.stored:  # compressed-tensors: per-channel [out, 1] or per-tensor scalar
            s = self.raw(name + "_scale").to(torch.float32)
            q = t.view(torch.uint8).numpy()
            q = q.reshape(len(q) if q.ndim else 1, -1)  # rows (dim 0) by the rest
            rows, cols = q.shape
            if s.numel() == 1:  # one tile: the whole rows
                s, bh = s.reshape(1, 1).numpy(), max(rows, 1)
            elif s.shape[0] != st.shape[0] or s.numel() != st.shape[0]:
                raise InputError(st.file, f"{name}_scale has shape {tuple(s.shape)}, expected [{st.shape[0]}, 1]")
            else:  # tiles of one row
                s, bh = s.reshape(-1, 1)[r0:r1].numpy(), 1
            w = torch.from_numpy(np.empty(q.shape, dtype=np.float32))
            if w.numel():
                with one_torch_thread():
                    fp8_scaled(q, t.dtype, s, bh, cols, w)
            return w.view(t.shape)
        raise InputError(st.file, f"FP8 tensor {name} has no weight_scale_inv or weight_scale companion")


_scratch = threading.local()  # HFCheckpoint._scratch_rows' buffer, one per thread


@contextlib.contextmanager
def one_torch_thread():
    """One torch thread for memory-bound element-wise work: more only add waits when the cores are busy
    (a bf16 conversion 18x slower with 2 threads on a loaded 2-core machine). Per calling thread (OpenMP)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _read_into(st, offset: int, buf) -> None:
    """Fill ``buf`` (a writable buffer) from byte ``offset`` of the stored tensor ``st``'s shard; a read error
    or a short read is the shard's fault, named in one line."""
    view, got = memoryview(buf).cast("B"), 0
    try:
        fd = os.open(st.file, os.O_RDONLY)
        try:
            while got < len(view):  # one read returns at most ~2 GB on Linux
                n = os.preadv(fd, [view[got:]], offset + got)
                if n == 0:
                    break
                got += n
        finally:
            os.close(fd)
    except OSError as exc:
        raise InputError(st.file, f"cannot read tensor {st.name} ({exc.strerror or exc})") from None
    if got != len(view):
        raise InputError(st.file, f"truncated safetensors file: {st.name} is incomplete")


def _rows_extent(st, r0: int, r1: int | None) -> tuple[tuple[int, ...], int, int]:
    """Shape, file offset and byte count of rows ``r0:r1`` (dim 0) of a stored tensor: a slab of leading
    rows is contiguous in the file."""
    if r1 is None and not r0:
        return st.shape, st.offset, st.nbytes
    r1 = st.shape[0] if r1 is None else r1
    row = st.nbytes // st.shape[0] if st.shape[0] else 0
    return (r1 - r0, *st.shape[1:]), st.offset + r0 * row, (r1 - r0) * row


@functools.cache
def _fp8_values(dtype: torch.dtype) -> np.ndarray:
    """The 256 values of an FP8 format as float32, converted by torch once."""
    return torch.arange(256, dtype=torch.uint8).view(dtype).to(torch.float32).numpy()


# mantissa bits, exponent bias, and the first magnitude (the low 7 bits of a byte) that is not finite:
# e4m3fn's NaN, e5m2's Inf
_FP8_LAYOUT = {torch.float8_e4m3fn: (3, 7, 0x7F), torch.float8_e5m2: (2, 15, 0x7C)}
_F32_MAX = float(np.finfo(np.float32).max)


def _codes_below(q: np.ndarray, bad: int) -> bool:
    """No byte of ``q`` (uint8) has a magnitude (its low 7 bits) of ``bad`` or more: two reductions."""
    return bad >= 128 or not (q.max() >= 128 + bad or q.view(np.int8).max() >= bad)


def _first_not_finite(fp8: torch.dtype, smax: float, dtype: torch.dtype) -> int:
    """The first magnitude (0..127) of an FP8 byte whose value times a scale up to ``smax`` may not be finite
    in ``dtype`` once rounded (magnitudes grow with the low 7 bits, rounding is monotonic: no smaller scale
    makes a larger product); 128 if none."""
    bad = _FP8_LAYOUT[fp8][2]
    if smax * float(_fp8_values(fp8)[bad - 1]) <= torch.finfo(dtype).max:  # exact in float64: 24 + 24 bits
        return bad  # every finite byte's product is at most the type's largest value: the common case, quick
    table = torch.from_numpy(smax * _fp8_values(fp8)).to(dtype)
    return int(torch.where(torch.isfinite(table), 128, torch.arange(256) & 0x7F).min())


def fp8_scaled(
    q: np.ndarray, fp8: torch.dtype, s: np.ndarray, bh: int, bw: int, x: torch.Tensor, finite: bool = False
) -> None:
    """float32 ``x`` [rows, cols] = the FP8 bytes ``q`` (uint8, same shape) times the float32 scale of their
    bh x bw tile ``s`` [rows/bh, cols/bw]: the products of :meth:`HFCheckpoint.load_rows`, bit for bit, without
    a gather (2.3x quicker). The byte's exponent and mantissa bits moved into a float32's low exponent and
    high mantissa bits, its sign into the sign bit, make a float32 that is exactly the FP8 value times
    2**(bias - 127), subnormals included (exponent field e, mantissa m: 2**(e - 127) * (1 + m) against
    2**(e - bias) * (1 + m)); times s * 2**(127 - bias), itself exact, that is one rounding of w * s, as
    ``f32(fp8) * s``. NaN and Inf bytes would come out finite: unless the caller has ruled them out
    (``finite``), rows that hold one are converted by torch instead (NaN and Inf kept), then scaled."""
    man, bias, bad = _FP8_LAYOUT[fp8]
    if finite or _codes_below(q, bad):
        bits = x.view(torch.int32)
        # sign-extended (the sign reaches bit 31 after the shift); torch widens, quicker than numpy on a slab in
        # cache
        bits.copy_(torch.from_numpy(q).view(torch.int8))
        bits.bitwise_left_shift_(23 - man).bitwise_and_(-(1 << 31) | 0x7F << (23 - man))
        up = np.float32(2.0 ** (127 - bias))
    else:
        x.copy_(torch.from_numpy(q).view(fp8))
        up = np.float32(1.0)
    st = torch.from_numpy(np.ascontiguousarray(s))
    if up != 1:
        if not float(np.abs(s).max()) * float(up) > _F32_MAX:  # NaN too: s * 2**(127 - bias) is exact
            st = st * float(up)
        else:  # a scale so large that s * 2**(127 - bias) overflows: the power of two applied on its own, exactly
            x.mul_(float(up))
    rows, cols = x.shape
    rf, cf = rows // bh, cols // bw  # whole tiles; the ragged last row and column of tiles apart
    if rf and cf:
        x[: rf * bh, : cf * bw].unflatten(1, (cf, bw)).unflatten(0, (rf, bh)).mul_(st[:rf, None, :cf, None])
    if cf * bw < cols and rf:
        x[: rf * bh, cf * bw :].unflatten(0, (rf, bh)).mul_(st[:rf, -1, None, None])
    if rf * bh < rows:
        if cf:
            x[rf * bh :, : cf * bw].unflatten(1, (cf, bw)).mul_(st[-1, :cf, None])
        if cf * bw < cols:
            x[rf * bh :, cf * bw :].mul_(st[-1, -1])


def _block_size(config: dict) -> tuple[int, int]:
    qcfg = config.get("quantization_config") or {}
    bh, bw = qcfg.get("weight_block_size") or [128, 128]
    return int(bh), int(bw)
