"""llama.cpp's importance-matrix files: read, write, and turn into quantization weights.

Two formats exist (llama.cpp ``tools/imatrix/imatrix.cpp``, ``common/imatrix-loader.cpp``):

* GGUF (what current ``llama-imatrix`` writes): per weight tensor ``<name>``
  two F32 tensors, ``<name>.in_sum2`` (ne = [n_per_row, n_mat]: the raw sums
  of squared activations, one row per expert for MoE tensors) and
  ``<name>.counts`` (ne = [1, n_mat]: tokens seen per matrix), sorted by name;
  metadata ``general.type = "imatrix"``, ``imatrix.datasets`` (strings),
  ``imatrix.chunk_count`` and ``imatrix.chunk_size`` (u32).
* legacy ``.dat``: int32 n_entries, then per entry int32 name length, name,
  int32 ncall, int32 nval, nval float32 (already ``sum/count*ncall``); then
  optionally int32 chunk count, int32 length and the dataset name.

:func:`read_imatrix` keeps everything needed to write the same bytes back
(:func:`write_imatrix`): the GGUF key/value pairs verbatim and in order, the
tensor order, the alignment; the legacy trailer as found. GGUF files are read
and written with gguf-py (``GGUFReader`` through :func:`mtpq.gguf_io.open_gguf`,
``GGUFWriter``); only the legacy ``.dat`` layout is done by hand.
:meth:`Imatrix.importance` gives the weights ``llama-quantize`` hands to
ggml for a tensor: ``in_sum2 / float(lround(count))`` per matrix (1 where a
matrix saw no token), or ``value / ncall`` for the legacy format.

Every problem with a file is an :class:`~mtpq.errors.InputError` naming it.
"""

from __future__ import annotations

import hashlib
import os
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter, Keys
from gguf.gguf_writer import GGUFValue

from ..errors import InputError

GGUF_MAGIC = b"GGUF"
KV_DATASETS, KV_CHUNK_COUNT, KV_CHUNK_SIZE = "imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size"

_LEGACY_TRAILER_FMT = "<ii"  # chunk count, dataset name length


@dataclass
class Entry:
    """One weight tensor's statistics: ``sums`` (n_mat, n_per_row) and ``counts`` (n_mat,), float32.

    For the legacy format ``sums`` is one flat row of the stored values (the
    file does not say how many experts share it) and ``counts`` is ``[ncall]``.
    """

    sums: np.ndarray
    counts: np.ndarray


@dataclass
class Imatrix:
    entries: dict[str, Entry]
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0
    legacy: bool = False
    path: Path | None = None
    # what a byte-identical rewrite needs
    kv: dict[str, GGUFValue] = field(default_factory=dict)  # GGUF key/values in file order
    alignment: int = 32
    tensor_order: list[tuple[str, str]] = field(default_factory=list)  # (entry, "in_sum2"/"counts") in file order
    legacy_trailer: bool = True

    def where(self) -> str:
        return str(self.path) if self.path else "imatrix"

    def importance(self, name: str, n_per_row: int, n_mat: int = 1) -> np.ndarray | None:
        """llama-quantize's weights for tensor ``name``: float32 (n_mat, n_per_row), or None if absent.

        Refuses (InputError) data whose size is not ``n_per_row * n_mat``, as
        llama-quantize does ("imatrix size ... is different from tensor size").
        """
        e = self.entries.get(name)
        if e is None:
            return None
        size = e.sums.size
        if size != n_per_row * n_mat:
            shape = f"{n_per_row}" + (f" x {n_mat} experts" if n_mat > 1 else "")
            raise InputError(
                self.where(),
                f"entry {name} has {size} values, the tensor needs {n_per_row * n_mat} "
                f"({shape}): an imatrix made for another model?",
            )
        with np.errstate(all="ignore"):
            if self.legacy:
                ncall = int(e.counts[0]) if e.counts.size else 0
                w = e.sums.reshape(-1) / np.float32(ncall) if ncall > 0 else e.sums.reshape(-1).copy()
                return w.astype(np.float32).reshape(n_mat, n_per_row)
            sums = e.sums.reshape(-1, size // e.counts.size)
            count = np.array([float(_lround(c)) for c in e.counts], dtype=np.float32)
            w = np.ones_like(sums, dtype=np.float32)
            seen = count > 0
            w[seen] = sums[seen] / count[seen][:, None]
            return w.reshape(n_mat, n_per_row)


def _lround(v: float) -> int:
    """C ``lround``: halves away from zero."""
    return int(np.floor(abs(v) + 0.5)) * (1 if v >= 0 else -1)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ----------------------------------------------------------------------------- reading


class _Cursor:
    """Reads the legacy ``.dat`` layout."""

    def __init__(self, data: bytes, where: str):
        self.data, self.pos, self.where = data, 0, where

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise InputError(self.where, f"truncated imatrix file (ends inside {what})")
        b = self.data[self.pos : self.pos + n]
        self.pos += n
        return b

    def unpack(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]


def read_imatrix(path: str | Path) -> Imatrix:
    """Read a GGUF or legacy ``.dat`` imatrix file (the format is told by its first bytes)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
        im = _read_gguf(path) if magic == GGUF_MAGIC else _read_legacy(path.read_bytes(), str(path))
    except OSError as e:
        raise InputError(path, f"cannot read imatrix file: {e.strerror or e}") from None
    im.path = path
    for name, e in im.entries.items():
        if not (np.isfinite(e.sums).all() and np.isfinite(e.counts).all()):
            raise InputError(path, f"entry {name} holds non-finite values")
    return im


def _read_gguf(path: Path) -> Imatrix:
    from ..gguf_io import open_gguf, reader_kv

    where = str(path)
    try:
        reader = open_gguf(path)
    except InputError as e:  # gguf-py could not parse it, or a tensor lies past the end
        raise InputError(where, f"truncated imatrix file or corrupt GGUF ({e.problem})") from None
    kv = reader_kv(reader)
    meta = {k: v.value for k, v in kv.items()}
    if meta.get("general.type", "imatrix") != "imatrix" or KV_CHUNK_COUNT not in meta:
        arch = reader.fields.get(Keys.General.ARCHITECTURE)
        what = arch.contents() if arch is not None else meta.get("general.type") or "unknown"
        raise InputError(where, f"a GGUF without imatrix metadata ({what!r}), not an imatrix file")
    align = int(reader.alignment)
    # ggml reads the data section whole, the last tensor's padding included
    end = max((t.data_offset + -(-int(t.n_bytes) // align) * align for t in reader.tensors), default=0)
    size = path.stat().st_size
    if size < end:
        raise InputError(where, f"truncated imatrix file ({size} bytes, the tensors need {end})")
    tensors: dict[str, tuple[np.ndarray, list[int]]] = {}
    order = []
    for t in reader.tensors:
        if t.tensor_type != GGMLQuantizationType.F32:
            raise InputError(where, f"tensor {t.name} is not F32 (llama.cpp's imatrix tensors are)")
        tensors[t.name] = (np.array(t.data, dtype=np.float32).reshape(-1), [int(d) for d in t.shape])
        base, _, kind = t.name.rpartition(".")
        if kind not in ("in_sum2", "counts") or not base:
            raise InputError(where, f"tensor {t.name} is neither <name>.in_sum2 nor <name>.counts")
        order.append((base, kind))
    entries: dict[str, Entry] = {}
    for base in dict.fromkeys(b for b, _ in order):
        s, k = tensors.get(base + ".in_sum2"), tensors.get(base + ".counts")
        if s is None or k is None:
            raise InputError(where, f"entry {base} has {'no counts' if k is None else 'no in_sum2'} tensor")
        (sums, sne), (counts, _) = s, k
        n_mat = counts.size
        if n_mat == 0 or sums.size % n_mat or (len(sne) > 1 and int(np.prod(sne[1:])) != n_mat):
            raise InputError(where, f"entry {base}: {sums.size} sums do not fit {n_mat} counts")
        entries[base] = Entry(sums.reshape(n_mat, -1), counts)
    if not entries:
        raise InputError(where, "no data in imatrix file")
    datasets = meta.get(KV_DATASETS, [])
    return Imatrix(
        entries,
        list(datasets) if isinstance(datasets, list) else [str(datasets)],
        int(meta.get(KV_CHUNK_COUNT, 0)),
        int(meta.get(KV_CHUNK_SIZE, 0)),
        legacy=False,
        kv=kv,
        alignment=align,
        tensor_order=order,
    )


def _read_legacy(data: bytes, where: str) -> Imatrix:
    c = _Cursor(data, where)
    if len(data) < 4:
        raise InputError(where, "not an imatrix file (neither GGUF nor llama.cpp's legacy .dat)")
    n_entries = c.unpack("<i", "the entry count")
    if n_entries < 1 or n_entries > len(data) // 12:
        raise InputError(where, "not an imatrix file (neither GGUF nor llama.cpp's legacy .dat)")
    entries: dict[str, Entry] = {}
    for i in range(n_entries):
        n = c.unpack("<i", f"entry #{i + 1}")
        raw = c.take(n, f"the name of entry #{i + 1}")
        try:
            name = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise InputError(where, f"not an imatrix file (entry #{i + 1} has no readable name)") from None
        ncall = c.unpack("<i", f"entry {name}")
        nval = c.unpack("<i", f"entry {name}")
        if nval < 1:
            raise InputError(where, f"entry {name} has {nval} values")
        vals = np.frombuffer(c.take(4 * nval, f"the values of entry {name}"), dtype="<f4").astype(np.float32)
        entries[name] = Entry(vals.reshape(1, -1), np.array([ncall], dtype=np.float32))
    chunk_count, datasets, trailer = 0, [], c.pos < len(data)
    if trailer:
        chunk_count = c.unpack("<i", "the chunk count")
        n = c.unpack("<i", "the dataset name")
        if n > 0:
            datasets.append(c.take(n, "the dataset name").decode("utf-8", "replace"))
    if c.pos != len(data):
        raise InputError(where, f"{len(data) - c.pos} unexpected bytes after the imatrix data")
    return Imatrix(entries, datasets, chunk_count, 0, legacy=True, legacy_trailer=trailer)


# ----------------------------------------------------------------------------- writing


def _default_kv(im: Imatrix) -> dict[str, GGUFValue]:
    """The metadata llama-imatrix writes, in its order."""
    return {
        "general.type": GGUFValue("imatrix", GGUFValueType.STRING),
        KV_DATASETS: GGUFValue(list(im.datasets), GGUFValueType.ARRAY, GGUFValueType.STRING),
        KV_CHUNK_COUNT: GGUFValue(int(im.chunk_count), GGUFValueType.UINT32),
        KV_CHUNK_SIZE: GGUFValue(int(im.chunk_size), GGUFValueType.UINT32),
    }


def imatrix_bytes(im: Imatrix) -> bytes:
    """The file's bytes: GGUF as llama-imatrix lays it out (written by gguf-py), or the legacy format."""
    if im.legacy:
        return _legacy_bytes(im)
    fd, name = tempfile.mkstemp(prefix="mtpq-imatrix-", suffix=".gguf")
    os.close(fd)
    try:
        _write_gguf(im, Path(name))
        return Path(name).read_bytes()
    finally:
        os.unlink(name)


def write_imatrix(im: Imatrix, path: str | Path) -> None:
    """Write ``im`` (to a temporary name beside the target, renamed when complete)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        if im.legacy:
            tmp.write_bytes(_legacy_bytes(im))
        else:
            _write_gguf(im, tmp)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def _write_gguf(im: Imatrix, path: Path) -> None:
    kv = dict(im.kv) if im.kv else _default_kv(im)
    for k, v in _default_kv(im).items():  # the file's metadata, updated to the current values
        if k in kv and k != "general.type":
            kv[k] = v
    w = GGUFWriter(None, arch="")
    w.kv_data[0].clear()  # an imatrix has no general.architecture (the writer adds one for models)
    w.data_alignment = im.alignment
    for k, v in kv.items():
        if v.type == GGUFValueType.ARRAY and not v.value:
            continue  # gguf-py writes no empty array; llama.cpp's loaders treat the key as optional
        w.add_key_value(k, v.value, v.type, v.sub_type)
    order = [p for p in im.tensor_order if p[0] in im.entries]
    known = {b for b, _ in order}
    for name in sorted(n for n in im.entries if n not in known):
        order += [(name, "in_sum2"), (name, "counts")]
    for base, kind in order:
        e = im.entries[base]
        n_mat = e.counts.size
        arr = np.ascontiguousarray(e.sums if kind == "in_sum2" else e.counts, dtype=np.float32)
        # numpy shape = ggml's ne reversed; ggml drops trailing 1s (ggml_n_dims)
        shape = (
            ((n_mat, arr.size // n_mat) if kind == "in_sum2" else (n_mat, 1))
            if n_mat > 1
            else ((arr.size,) if kind == "in_sum2" else (1,))
        )
        w.add_tensor(f"{base}.{kind}", arr.reshape(shape))
    w.write_header_to_file(path=path)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()  # tensor infos, then the data
    w.close()


def _legacy_bytes(im: Imatrix) -> bytes:
    out = [struct.pack("<i", len(im.entries))]
    for name, e in im.entries.items():
        b = name.encode("utf-8")
        vals = np.ascontiguousarray(e.sums, dtype="<f4").reshape(-1)
        out.append(struct.pack("<i", len(b)) + b + struct.pack("<ii", int(e.counts[0]), vals.size) + vals.tobytes())
    if im.legacy_trailer:
        ds = im.datasets[-1].encode("utf-8") if im.datasets else b""
        out.append(struct.pack(_LEGACY_TRAILER_FMT, int(im.chunk_count), len(ds)) + ds)
    return b"".join(out)


# ----------------------------------------------------------------------------- selecting entries


def select_entries(im: Imatrix, include: list[str] | None, exclude: list[str] | None) -> Imatrix:
    """llama-quantize's ``--include-weights`` / ``--exclude-weights``: substring matches on entry names
    (exclusions first; with inclusions only the entries matching one are kept)."""
    names = list(im.entries)
    if exclude:
        names = [n for n in names if not any(x in n for x in exclude)]
    if include:
        names = [n for n in names if any(x in n for x in include)]
    kept = {n: im.entries[n] for n in names}
    return Imatrix(
        kept,
        im.datasets,
        im.chunk_count,
        im.chunk_size,
        im.legacy,
        im.path,
        im.kv,
        im.alignment,
        im.tensor_order,
        im.legacy_trailer,
    )
