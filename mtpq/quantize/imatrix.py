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
(:func:`write_imatrix`): the GGUF key/value pairs verbatim, each tensor's
dimension count, the alignment; the legacy trailer as found.
:meth:`Imatrix.importance` gives the weights ``llama-quantize`` hands to
ggml for a tensor: ``in_sum2 / float(lround(count))`` per matrix (1 where a
matrix saw no token), or ``value / ncall`` for the legacy format.

Every problem with a file is an :class:`~mtpq.errors.InputError` naming it.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import InputError

GGUF_MAGIC = b"GGUF"
_ALIGN_KEY = "general.alignment"
KV_DATASETS, KV_CHUNK_COUNT, KV_CHUNK_SIZE = "imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size"

# GGUF value types: id -> struct format (scalars); 8 = string, 9 = array
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STR, _ARR = 8, 9
_GGML_F32 = 0


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
    kv: list[tuple[str, int, object]] = field(default_factory=list)  # GGUF key/values in file order
    alignment: int = 32
    version: int = 3
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
            raise InputError(self.where(), f"entry {name} has {size} values, the tensor needs {n_per_row * n_mat} "
                                           f"({shape}): an imatrix made for another model?")
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
    def __init__(self, data: bytes, where: str):
        self.data, self.pos, self.where = data, 0, where

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise InputError(self.where, f"truncated imatrix file (ends inside {what})")
        b = self.data[self.pos:self.pos + n]
        self.pos += n
        return b

    def unpack(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.unpack("<Q", what)
        raw = self.take(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise InputError(self.where, f"{what} is not valid UTF-8") from None

    def value(self, vtype: int, what: str):
        if vtype in _SCALAR:
            return self.unpack(_SCALAR[vtype], what)
        if vtype == _STR:
            return self.string(what)
        if vtype == _ARR:
            etype = self.unpack("<I", what)
            n = self.unpack("<Q", what)
            if etype == _ARR or (etype not in _SCALAR and etype != _STR):
                raise InputError(self.where, f"{what}: unsupported array element type {etype}")
            if n > len(self.data):
                raise InputError(self.where, f"truncated imatrix file (ends inside {what})")
            return (etype, [self.value(etype, what) for _ in range(n)])
        raise InputError(self.where, f"{what}: unknown GGUF value type {vtype}")


def read_imatrix(path: str | Path) -> Imatrix:
    """Read a GGUF or legacy ``.dat`` imatrix file (the format is told by its first bytes)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise InputError(path, f"cannot read imatrix file: {e.strerror or e}") from None
    im = _read_gguf(data, str(path)) if data[:4] == GGUF_MAGIC else _read_legacy(data, str(path))
    im.path = path
    for name, e in im.entries.items():
        if not (np.isfinite(e.sums).all() and np.isfinite(e.counts).all()):
            raise InputError(path, f"entry {name} holds non-finite values")
    return im


def _read_gguf(data: bytes, where: str) -> Imatrix:
    c = _Cursor(data, where)
    c.take(4, "the header")
    version = c.unpack("<I", "the header")
    if version not in (2, 3):
        raise InputError(where, f"unsupported GGUF version {version}")
    n_tensors = c.unpack("<Q", "the header")
    n_kv = c.unpack("<Q", "the header")
    kv: list[tuple[str, int, object]] = []
    for i in range(n_kv):
        key = c.string(f"key/value #{i}")
        vtype = c.unpack("<I", f"key {key}")
        kv.append((key, vtype, c.value(vtype, f"key {key}")))
    meta = {k: v for k, _, v in kv}
    if meta.get("general.type", "imatrix") != "imatrix" or KV_CHUNK_COUNT not in meta:
        what = meta.get("general.architecture") or meta.get("general.type") or "unknown"
        raise InputError(where, f"a GGUF without imatrix metadata ({what!r}), not an imatrix file")
    alignment = int(meta.get(_ALIGN_KEY, 32))
    infos = []
    for i in range(n_tensors):
        name = c.string(f"tensor info #{i}")
        n_dims = c.unpack("<I", f"tensor info {name}")
        if not 1 <= n_dims <= 4:
            raise InputError(where, f"tensor {name} has {n_dims} dimensions")
        ne = [c.unpack("<Q", f"tensor info {name}") for _ in range(n_dims)]
        ttype = c.unpack("<I", f"tensor info {name}")
        offset = c.unpack("<Q", f"tensor info {name}")
        infos.append((name, ne, ttype, offset))
    start = -(-c.pos // alignment) * alignment
    # ggml reads the data section whole, the last tensor's padding included
    end = max((start + off + -(-4 * int(np.prod(ne)) // alignment) * alignment for _, ne, _, off in infos),
              default=start)
    if len(data) < end:
        raise InputError(where, f"truncated imatrix file ({len(data)} bytes, the tensors need {end})")
    tensors: dict[str, tuple[np.ndarray, list[int]]] = {}
    order = []
    for name, ne, ttype, offset in infos:
        if ttype != _GGML_F32:
            raise InputError(where, f"tensor {name} is not F32 (llama.cpp's imatrix tensors are)")
        n = int(np.prod(ne))
        lo = start + offset
        if lo + 4 * n > len(data):
            raise InputError(where, f"truncated imatrix file (tensor {name} ends past the end of the file)")
        tensors[name] = (np.frombuffer(data, dtype="<f4", count=n, offset=lo).astype(np.float32), ne)
        base, _, kind = name.rpartition(".")
        if kind not in ("in_sum2", "counts") or not base:
            raise InputError(where, f"tensor {name} is neither <name>.in_sum2 nor <name>.counts")
        order.append((base, kind))
    entries: dict[str, Entry] = {}
    for base in dict.fromkeys(b for b, _ in order):
        s, k = tensors.get(base + ".in_sum2"), tensors.get(base + ".counts")
        if s is None or k is None:
            raise InputError(where, f"entry {base} has {'no counts' if k is None else 'no in_sum2'} tensor")
        (sums, sne), (counts, cne) = s, k
        n_mat = counts.size
        if n_mat == 0 or sums.size % n_mat or (len(sne) > 1 and int(np.prod(sne[1:])) != n_mat):
            raise InputError(where, f"entry {base}: {sums.size} sums do not fit {n_mat} counts")
        entries[base] = Entry(sums.reshape(n_mat, -1), counts)
    if not entries:
        raise InputError(where, "no data in imatrix file")
    datasets = meta.get(KV_DATASETS, (_STR, []))
    return Imatrix(entries, list(datasets[1]) if isinstance(datasets, tuple) else [],
                   int(meta.get(KV_CHUNK_COUNT, 0)), int(meta.get(KV_CHUNK_SIZE, 0)), legacy=False, kv=kv,
                   alignment=alignment, version=version, tensor_order=order)


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


def _pack_value(vtype: int, value) -> bytes:
    if vtype in _SCALAR:
        return struct.pack(_SCALAR[vtype], value)
    if vtype == _STR:
        b = value.encode("utf-8")
        return struct.pack("<Q", len(b)) + b
    etype, items = value
    return struct.pack("<IQ", etype, len(items)) + b"".join(_pack_value(etype, v) for v in items)


def _default_kv(im: Imatrix) -> list[tuple[str, int, object]]:
    """The metadata llama-imatrix writes, in its order."""
    return [("general.type", _STR, "imatrix"), (KV_DATASETS, _ARR, (_STR, list(im.datasets))),
            (KV_CHUNK_COUNT, 4, int(im.chunk_count)), (KV_CHUNK_SIZE, 4, int(im.chunk_size))]


def imatrix_bytes(im: Imatrix) -> bytes:
    """The file's bytes: GGUF laid out as ggml's gguf writer does, or the legacy format."""
    return _legacy_bytes(im) if im.legacy else _gguf_bytes(im)


def write_imatrix(im: Imatrix, path: str | Path) -> None:
    """Write ``im`` (to a temporary name, renamed when complete)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(imatrix_bytes(im))
    tmp.replace(path)


def _gguf_bytes(im: Imatrix) -> bytes:
    kv = im.kv or _default_kv(im)
    if im.kv:  # keep the file's metadata, updated to the current values
        cur = {k: v for k, _, v in _default_kv(im)}
        kv = [(k, t, cur[k] if k in cur and k != "general.type" else v) for k, t, v in kv]
    align = im.alignment
    order = [p for p in im.tensor_order if p[0] in im.entries]
    known = {b for b, _ in order}
    for name in sorted(n for n in im.entries if n not in known):
        order += [(name, "in_sum2"), (name, "counts")]
    infos, blobs, offset = [], [], 0
    for base, kind in order:
        e = im.entries[base]
        n_mat = e.counts.size
        arr = e.sums if kind == "in_sum2" else e.counts
        ne = [arr.size // n_mat, n_mat] if kind == "in_sum2" else [1, n_mat]
        if n_mat == 1:  # ggml writes ggml_n_dims: trailing 1s dropped
            ne = ne[:1]
        name = f"{base}.{kind}".encode("utf-8")
        infos.append(struct.pack("<Q", len(name)) + name + struct.pack("<I", len(ne))
                     + b"".join(struct.pack("<Q", d) for d in ne) + struct.pack("<IQ", _GGML_F32, offset))
        raw = np.ascontiguousarray(arr, dtype="<f4").tobytes()
        pad = -len(raw) % align
        blobs.append(raw + b"\0" * pad)
        offset += len(raw) + pad
    head = GGUF_MAGIC + struct.pack("<IQQ", im.version, len(infos), len(kv))
    head += b"".join(_pack_value(_STR, k) + struct.pack("<I", t) + _pack_value(t, v) for k, t, v in kv)
    head += b"".join(infos)
    head += b"\0" * (-len(head) % align)
    return head + b"".join(blobs)


def _legacy_bytes(im: Imatrix) -> bytes:
    out = [struct.pack("<i", len(im.entries))]
    for name, e in im.entries.items():
        b = name.encode("utf-8")
        vals = np.ascontiguousarray(e.sums, dtype="<f4").reshape(-1)
        out.append(struct.pack("<i", len(b)) + b + struct.pack("<ii", int(e.counts[0]), vals.size) + vals.tobytes())
    if im.legacy_trailer:
        ds = im.datasets[-1].encode("utf-8") if im.datasets else b""
        out.append(struct.pack("<ii", int(im.chunk_count), len(ds)) + ds)
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
    return Imatrix(kept, im.datasets, im.chunk_count, im.chunk_size, im.legacy, im.path, im.kv, im.alignment,
                   im.version, im.tensor_order, im.legacy_trailer)
