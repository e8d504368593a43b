"""A GGUF model (see :mod:`.files`: a file or a whole split set) as a plan that rewrites it, or as
:class:`GGUFFile` (metadata and tensors by name) for the runtime and ``inspect``. Plans read tensor bytes with
pread; the runtime reads through gguf-py's mapping."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Callable

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, Keys
from gguf.gguf_reader import ReaderTensor
from gguf.gguf_writer import GGUFValue

from ..errors import InputError
from ..tensors import Plan, TensorSpec, block_index, classify
from .files import INT_TYPES, SPLIT_KEYS, open_model, reader_arch


def _count_key(reader: GGUFReader, kv: dict[str, GGUFValue], key: str, path: Path) -> int:
    """An integer metadata value (0 when absent); any other type is an InputError."""
    if key not in kv:
        return 0
    val = kv[key]
    if val.type not in INT_TYPES or isinstance(val.value, (list, str)):
        raise InputError(path, f"metadata {key} must be an integer, got {val.value!r}")
    return int(val.value)


def reader_kv(reader: GGUFReader) -> dict[str, GGUFValue]:
    """The metadata of a GGUF as GGUFWriter values, without the header fields, the arch and the split keys."""
    kv: dict[str, GGUFValue] = {}
    for name, fld in reader.fields.items():
        if name.startswith("GGUF.") or name == Keys.General.ARCHITECTURE or name in SPLIT_KEYS:
            continue
        vtype = GGUFValueType(fld.types[0])
        sub = GGUFValueType(fld.types[-1]) if vtype == GGUFValueType.ARRAY else None
        kv[name] = GGUFValue(fld.contents(), vtype, sub)
    return kv


class GGUFFile:
    """One GGUF model opened for reading (a single file or a whole split set, see :func:`open_model`): metadata
    as plain Python values, tensors by name, and the trunk/MTP split. The one reader of the package: plans
    (:func:`plan_from_gguf`), ``inspect`` and the runtime all see a model through it."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.files = open_model(self.path)
        reader = self.files.readers[0]
        self.arch = reader_arch(reader, self.files.first)
        self.kv: dict[str, Any] = {
            n: f.contents() for n, f in reader.fields.items() if not n.startswith("GGUF.") and n not in SPLIT_KEYS
        }
        self.tensors = {t.name: t for t, _ in self.files.tensors}
        self.n_blocks = int(self.value("block_count", 0) or 0)
        self.n_mtp = int(self.value("nextn_predict_layers", 0) or 0)
        self.n_trunk = self.n_blocks - self.n_mtp  # MTP blocks are numbered n_trunk .. n_blocks-1

    def value(self, key: str, default: Any = None) -> Any:
        """Metadata value; a ``key`` without a ``general.``/``tokenizer.`` prefix is taken as ``{arch}.key``."""
        full = key if key.startswith(("general.", "tokenizer.")) else f"{self.arch}.{key}"
        return self.kv.get(full, default)

    def require(self, key: str) -> Any:
        v = self.value(key)
        if v is None:
            raise InputError(self.path, f"missing metadata {self.arch}.{key}")
        return v

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        """Torch order (rows..., row length); GGUF stores ne[0] = row length first."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape.tolist()))

    def qtype(self, name: str) -> GGMLQuantizationType:
        return GGMLQuantizationType(self.tensors[name].tensor_type)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (every shard's)."""
        return sum(int(t.n_bytes) for t in self.tensors.values())

    @property
    def n_elements(self) -> int:
        return sum(int(t.n_elements) for t in self.tensors.values())


# Plans read tensor bytes with pread, not through gguf-py's mapping of the whole file: every page read through
# a mapping stays in the process's RSS while the file is open, so quantizing a 300 GB model would end with
# 300 GB resident. Read, a tensor's bytes go when the tensor is written.


def _read_at(path: Path, offset: int, out: np.ndarray) -> np.ndarray:
    """Fill ``out`` (C-contiguous) with ``path``'s bytes from ``offset``; returns ``out``."""
    view = memoryview(out).cast("B")
    with open(path, "rb") as f:
        got = 0
        while got < len(view):
            n = os.preadv(f.fileno(), [view[got:]], offset + got)
            if n == 0:
                raise InputError(path, f"truncated: ends within a tensor's data at byte {offset + got}")
            got += n
    return out


_scratch = threading.local()  # each thread's buffer for the rows it reads (reused: no fresh pages per slab)


def _raw_loader(t: ReaderTensor, path: Path) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        from .buffers import output_buffer  # the writer's buffers: reused from tensor to tensor

        buf = _read_at(path, int(t.data_offset), output_buffer(int(t.n_bytes)))
        return buf.view(t.data.dtype).reshape(t.data.shape)

    return load


def _as_float(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """Stored values (as gguf-py shapes them) as a new float32 array of ``shape`` (never a view of ``data``)."""
    from ..ggml.engine import dequantize

    out = dequantize(data, qtype, shape)
    return out.copy() if np.shares_memory(out, data) else out


def _float_loader(t: ReaderTensor, path: Path, shape: tuple[int, ...]) -> Callable:
    qtype = GGMLQuantizationType(t.tensor_type)

    def load():
        data = _read_at(path, int(t.data_offset), np.empty(int(t.n_bytes), dtype=np.uint8))
        return _as_float(data.view(t.data.dtype).reshape(t.data.shape), qtype, shape)

    return load


def _rows_loader(t: ReaderTensor, path: Path, shape: tuple[int, ...]) -> Callable | None:
    """Rows ``r0:r1`` along dim 0 as float32 (for slab-wise encoding); None for a 1-D tensor."""
    if len(shape) < 2:
        return None
    qtype = GGMLQuantizationType(t.tensor_type)
    row_bytes = int(t.n_bytes) // shape[0]

    def rows(r0: int, r1: int):
        nbytes = (r1 - r0) * row_bytes
        buf = getattr(_scratch, "buf", None)
        if buf is None or buf.nbytes < nbytes:
            buf = _scratch.buf = np.empty(nbytes, dtype=np.uint8)
        data = _read_at(path, int(t.data_offset) + r0 * row_bytes, buf[:nbytes])
        return _as_float(data.view(t.data.dtype).reshape(r1 - r0, *t.data.shape[1:]), qtype, (r1 - r0, *shape[1:]))

    return rows


def plan_from_gguf(path: Path) -> Plan:
    """A plan that rewrites the model at ``path`` (a file or a whole split set) unchanged: every tensor keeps its
    type and bytes, and remembers the shard it came from (``TensorSpec.shard``, for ``--keep-split``)."""
    path = Path(path)
    files = open_model(path)
    reader = files.readers[0]
    arch = reader_arch(reader, files.first)
    kv = reader_kv(reader)
    n_blocks = _count_key(reader, kv, f"{arch}.block_count", files.first)
    n_mtp = _count_key(reader, kv, f"{arch}.nextn_predict_layers", files.first)
    if n_mtp and n_mtp >= n_blocks:
        raise InputError(
            files.first,
            f"metadata contradicts itself: {arch}.nextn_predict_layers is {n_mtp}, but "
            f"{arch}.block_count is {n_blocks} (trunk + MTP blocks; no trunk would be left)",
        )
    n_trunk = n_blocks - n_mtp
    specs = []
    for t, shard in files.tensors:
        where = files.paths[shard]
        bid = block_index(t.name)
        if bid is not None and bid >= n_blocks and f"{arch}.block_count" in kv:
            raise InputError(where, f"tensor {t.name} is in block {bid}, but {arch}.block_count is {n_blocks}")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF ne order -> torch order
        qtype = GGMLQuantizationType(t.tensor_type)
        specs.append(
            TensorSpec(
                name=t.name,
                shape=shape,
                role=classify(t.name, shape, n_trunk),
                ggml_type=qtype,
                load=_float_loader(t, where, shape),
                source=f"{where.name}:{t.name}",
                source_type=qtype,
                load_raw=_raw_loader(t, where),
                reason="kept as stored",
                shard=shard,
                load_rows=_rows_loader(t, where, shape),
                stored_at=(where, int(t.data_offset)),
            )
        )
    return Plan(arch=arch, kv=kv, tensors=specs, inputs=list(files.paths), n_trunk_layers=n_trunk, n_mtp_layers=n_mtp)
