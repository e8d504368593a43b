"""The file(s) of a GGUF model: one file, or every shard of a split set, opened and checked.

A model llama.cpp's tools split (``llama-gguf-split``, ``convert_hf_to_gguf.py --split-max-size``,
``llama-quantize --keep-split``) is a set of files ``PREFIX-00001-of-0000N.gguf`` .. ``-0000N-of-0000N.gguf``:
shard 1 holds the metadata, every shard holds ``split.no`` (0-based), ``split.count`` and
``split.tensors.count``, and each tensor lives in exactly one shard. Given any shard, :func:`open_model` opens
and checks them all, as llama.cpp's model loader does, so every command sees the whole model -- the same plan
and the same bytes as from the merged file -- or stops with one line naming the shard at fault before anything
is written. The ``split.*`` keys describe files, not the model: they are not part of what a reader returns
(a merged file's ``split.count = 0`` included); the writer adds them to the shards it writes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, Keys
from gguf.gguf_reader import ReaderTensor

from ..errors import InputError
from ..gguf_fields import FastFieldsReader

INT_TYPES = {
    GGUFValueType.UINT8,
    GGUFValueType.INT8,
    GGUFValueType.UINT16,
    GGUFValueType.INT16,
    GGUFValueType.UINT32,
    GGUFValueType.INT32,
    GGUFValueType.UINT64,
    GGUFValueType.INT64,
}

SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = (
    Keys.Split.LLM_KV_SPLIT_NO,
    Keys.Split.LLM_KV_SPLIT_COUNT,
    Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT,
)
SPLIT_KEYS = (SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS)
_SHARD_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def shard_name(prefix: str, no: int, count: int) -> str:
    """llama.cpp's ``llama_split_path``: shard ``no`` (1-based) of ``count`` is ``PREFIX-%05d-of-%05d.gguf``."""
    return f"{prefix}-{no:05d}-of-{count:05d}.gguf"


def split_prefix(name: str) -> str | None:
    """``model-00002-of-00005.gguf`` -> ``model``; a name that is not a shard's -> None."""
    m = _SHARD_NAME.match(name)
    return m.group("prefix") if m else None


class _CheckedReader(FastFieldsReader):
    """GGUFReader that checks every tensor's byte range before gguf-py maps it, so a truncated or
    corrupt file is refused with what is wrong with it instead of numpy's reshape message."""

    def __init__(self, path: Path):
        self._path = path
        super().__init__(path)

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        size = len(self.data)
        ranges = []
        for field in fields:
            _name_len, name_data, _n_dims, dims, raw_dtype, offset_tensor = field.parts
            name = bytes(name_data).decode("utf-8", "replace")
            try:
                qtype = GGMLQuantizationType(int(raw_dtype[0]))
                block, type_size = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise InputError(self._path, f"tensor {name} has unknown ggml type {int(raw_dtype[0])}") from None
            dims = [int(d) for d in dims]
            if 0 in dims:  # gguf-py and llama.cpp's reader take it; no model has one, and no tensor code expects it
                raise InputError(
                    self._path,
                    f"tensor {name} has a zero-length dimension (shape {dims} in GGUF's order): it holds no values",
                )
            if dims and dims[0] % block:
                raise InputError(
                    self._path,
                    f"tensor {name}: row length {dims[0]} is not a multiple of {qtype.name}'s block size {block}",
                )
            n_elems = 1
            for d in dims:
                n_elems *= d
            start = int(start_offs) + int(offset_tensor[0])
            end = start + n_elems // block * type_size
            if end > size:
                raise InputError(self._path, f"truncated: tensor {name} ends at byte {end}, the file has {size}")
            ranges.append((start, end, name))
        ranges.sort()
        for (_, end_a, a), (start_b, _, b) in zip(ranges, ranges[1:]):
            if start_b < end_a:
                raise InputError(self._path, f"corrupt: the data of tensors {a} and {b} overlap")
        super()._build_tensors(start_offs, fields)


def open_gguf(path: Path) -> GGUFReader:
    """Open a GGUF file (memory-mapped) or raise an InputError naming it."""
    path = Path(path)
    if path.is_dir():
        raise InputError(path, "is a folder, not a GGUF file")
    if not path.is_file():
        raise InputError(path, "no such file")
    try:
        return _CheckedReader(path)
    except InputError:
        raise
    except IndexError:  # gguf-py read past the end while parsing metadata or tensor infos
        raise InputError(path, f"truncated or corrupt GGUF header (the file has {path.stat().st_size} bytes)") from None
    except Exception as exc:  # gguf-py raises ValueError/struct errors on bad files
        raise InputError(path, f"not a readable GGUF file ({exc})") from None


def _split_value(reader: GGUFReader, key: str, path: Path) -> int | None:
    """A ``split.*`` value of one file (None when absent); one that is not an integer is an InputError."""
    fld = reader.fields.get(key)
    if fld is None:
        return None
    value = fld.contents()
    if GGUFValueType(fld.types[0]) not in INT_TYPES or isinstance(value, (list, str)):
        raise InputError(path, f"metadata {key} must be an integer, got {value!r}")
    return int(value)


@dataclass
class ModelFiles:
    """The file(s) of one model, opened and checked: ``paths[0]`` holds the metadata (shard 1, what llama.cpp
    is given as ``-m``); ``tensors`` lists every tensor with the index of the file holding it, in file order."""

    paths: list[Path]
    readers: list[GGUFReader]
    tensors: list[tuple[ReaderTensor, int]]

    @property
    def first(self) -> Path:
        return self.paths[0]

    @property
    def is_split(self) -> bool:
        return len(self.paths) > 1

    @property
    def nbytes(self) -> int:
        return sum(p.stat().st_size for p in self.paths)


def open_model(path: Path) -> ModelFiles:
    """Open the GGUF at ``path`` and, if it is a shard of a split set, every other shard of that set (any shard
    may be given): one line naming the shard at fault if one is missing, belongs to another set (another
    ``split.count``, ``split.no`` or ``split.tensors.count``) or the shards' tensors are duplicated or missing."""
    path = Path(path)
    reader = open_gguf(path)
    count = _split_value(reader, SPLIT_COUNT, path) or 0
    if count <= 1:  # one file (a merged one says split.count = 0)
        return ModelFiles([path], [reader], [(t, 0) for t in reader.tensors])
    no = _split_value(reader, SPLIT_NO, path)
    if no is None:
        raise InputError(path, f"has {SPLIT_COUNT} = {count} but no {SPLIT_NO}: not a readable shard")
    if not 0 <= no < count:
        raise InputError(path, f"{SPLIT_NO} = {no} is outside {SPLIT_COUNT} = {count}")
    suffix = f"-{no + 1:05d}-of-{count:05d}.gguf"
    if not path.name.endswith(suffix) or len(path.name) == len(suffix):
        raise InputError(
            path,
            f"shard {no + 1} of {count} ({SPLIT_NO} = {no}) must be named PREFIX{suffix} for its "
            "other shards to be found (llama.cpp's naming)",
        )
    prefix = path.name[: -len(suffix)]
    paths = [path.with_name(shard_name(prefix, i + 1, count)) for i in range(count)]
    readers = []
    for i, p in enumerate(paths):
        if i == no:
            readers.append(reader)
            continue
        if not p.is_file():
            raise InputError(p, f"missing: shard {i + 1} of {count} of the split set {path.name} is in")
        r = open_gguf(p)
        theirs = _split_value(r, SPLIT_COUNT, p)
        if theirs != count:
            raise InputError(p, f"{SPLIT_COUNT} is {theirs}, but {path.name} says {count}: a shard of another split")
        theirs = _split_value(r, SPLIT_NO, p)
        if theirs != i:
            raise InputError(
                p,
                f"{SPLIT_NO} is {theirs}, but this is shard {i + 1} of {count} by its name "
                f"({SPLIT_NO} {i}): a shard of another set",
            )
        readers.append(r)
    expected = [_split_value(r, SPLIT_TENSORS, p) for p, r in zip(paths, readers)]
    for p, n in zip(paths, expected):
        if n != expected[0]:
            raise InputError(
                p, f"{SPLIT_TENSORS} is {n}, but {paths[0].name} says {expected[0]}: a shard of another model"
            )
    arch = reader_arch(readers[0], paths[0])
    for p, r in zip(paths[1:], readers[1:]):
        fld = r.fields.get(Keys.General.ARCHITECTURE)  # shards 2.. carry only the split keys; one that says more
        if fld is not None and fld.contents() != arch:  # must not say another architecture
            raise InputError(
                p,
                f"general.architecture is {fld.contents()!r}, but {paths[0].name} says {arch!r}: "
                "a shard of another model",
            )
    tensors, where = [], {}
    for i, (p, r) in enumerate(zip(paths, readers)):
        for t in r.tensors:
            if t.name in where:
                raise InputError(
                    p, f"tensor {t.name} is also in {paths[where[t.name]].name}: a tensor duplicated across shards"
                )
            where[t.name] = i
            tensors.append((t, i))
    if expected[0] is not None and len(tensors) != expected[0]:
        raise InputError(
            paths[0],
            f"{SPLIT_TENSORS} is {expected[0]}, but the {count} shards hold {len(tensors)} "
            "tensors: a shard is incomplete or of another model",
        )
    return ModelFiles(paths, readers, tensors)


def shard_paths(path: Path) -> list[Path]:
    """Every file of the model at ``path`` (itself alone unless it is a shard), checked as :func:`open_model`."""
    return open_model(path).paths


def first_shard(path: Path) -> Path:
    """The file llama.cpp must be given (``-m``) for the model at ``path``: shard 1 of a split set, else
    ``path``; the set is checked first, so a missing shard is our one line, not llama.cpp's."""
    return open_model(path).first


def reader_arch(reader: GGUFReader, path: Path) -> str:
    fld = reader.fields.get(Keys.General.ARCHITECTURE)
    if fld is None:
        raise InputError(path, "GGUF has no general.architecture")
    return fld.contents()
