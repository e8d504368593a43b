"""Reading GGUF files into plans and streaming plans into GGUF files.

Both directions use gguf-py (GGUFReader, GGUFWriter); nothing here serializes
GGUF by hand. The writer streams: header, metadata and tensor infos first, then
each tensor's bytes as soon as it is produced, so peak memory stays near the
largest single tensor. Output goes to a temporary file beside the target and is
renamed only when complete.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, Keys
from gguf.gguf_writer import GGUFValue

from .errors import InputError
from .tensors import Plan, TensorSpec, classify

FLOAT_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}


# ----------------------------------------------------------------------------- reading


def open_gguf(path: Path) -> GGUFReader:
    """Open a GGUF file (memory-mapped) or raise an InputError naming it."""
    path = Path(path)
    if not path.is_file():
        raise InputError(path, "no such file")
    try:
        return GGUFReader(path)
    except Exception as exc:  # gguf-py raises ValueError/struct errors on bad files
        raise InputError(path, f"not a readable GGUF file ({exc})") from None


def reader_kv(reader: GGUFReader) -> dict[str, GGUFValue]:
    """The metadata of a GGUF as GGUFWriter values, without the header fields and the arch."""
    kv: dict[str, GGUFValue] = {}
    for name, fld in reader.fields.items():
        if name.startswith("GGUF.") or name == Keys.General.ARCHITECTURE:
            continue
        vtype = GGUFValueType(fld.types[0])
        sub = GGUFValueType(fld.types[-1]) if vtype == GGUFValueType.ARRAY else None
        kv[name] = GGUFValue(fld.contents(), vtype, sub)
    return kv


def reader_arch(reader: GGUFReader, path: Path) -> str:
    fld = reader.fields.get(Keys.General.ARCHITECTURE)
    if fld is None:
        raise InputError(path, "GGUF has no general.architecture")
    return fld.contents()


def _raw_loader(t) -> Callable[[], np.ndarray]:
    return lambda: np.asarray(t.data)


def _float_loader(t, shape: tuple[int, ...]) -> Callable[[], torch.Tensor]:
    def load() -> torch.Tensor:
        qtype = GGMLQuantizationType(t.tensor_type)
        data = np.asarray(t.data)
        if qtype == GGMLQuantizationType.BF16:
            return torch.from_numpy(data.view(np.uint16).astype(np.int32) << 16).view(torch.float32).reshape(shape)
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            return torch.from_numpy(data.astype(np.float32)).reshape(shape)
        from .quantize.kernels import dequantize

        return dequantize(data, qtype, shape)

    return load


def plan_from_gguf(path: Path) -> Plan:
    """A plan that rewrites ``path`` unchanged: every tensor keeps its type and bytes."""
    path = Path(path)
    reader = open_gguf(path)
    arch = reader_arch(reader, path)
    kv = reader_kv(reader)
    n_blocks = int(kv[f"{arch}.block_count"].value) if f"{arch}.block_count" in kv else 0
    n_mtp = int(kv[f"{arch}.nextn_predict_layers"].value) if f"{arch}.nextn_predict_layers" in kv else 0
    n_trunk = n_blocks - n_mtp
    specs = []
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF ne order -> torch order
        qtype = GGMLQuantizationType(t.tensor_type)
        specs.append(
            TensorSpec(
                name=t.name,
                shape=shape,
                role=classify(t.name, shape, n_trunk),
                ggml_type=qtype,
                load=_float_loader(t, shape),
                source=f"{path.name}:{t.name}",
                source_type=qtype,
                load_raw=_raw_loader(t),
                reason="kept as stored",
            )
        )
    return Plan(arch=arch, kv=kv, tensors=specs, inputs=[path], n_trunk_layers=n_trunk, n_mtp_layers=n_mtp)


def size_label(specs: list[TensorSpec]) -> str:
    """general.size_label ("4x2.4M", "8B") as llama.cpp's converter computes it from the tensors written."""
    from gguf import size_label as label

    w = GGUFWriter(None, "none")  # tensor infos only: gguf-py counts shared and expert parameters
    for spec in specs:
        w.add_tensor_info(spec.name, spec.shape, np.dtype(np.float32), 0, raw_dtype=spec.ggml_type)
    return label(*w.get_total_parameter_count())


def refresh_size_label(plan: Plan) -> None:
    """After a plan gains or loses tensors (graft, extract), its size label follows, if it has one."""
    if "general.size_label" in plan.kv:
        plan.set_kv("general.size_label", size_label(plan.tensors), GGUFValueType.STRING)


# ----------------------------------------------------------------------------- writing


def tensor_nbytes(shape: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    from gguf import GGML_QUANT_SIZES

    block, type_size = GGML_QUANT_SIZES[qtype]
    n = 1
    for d in shape:
        n *= d
    return n // block * type_size


def encode_tensor(spec: TensorSpec) -> np.ndarray:
    """The bytes (as the numpy array GGUFWriter wants) of one tensor in ``spec.ggml_type``."""
    if spec.load_raw is not None and spec.source_type == spec.ggml_type:
        return spec.load_raw()
    from .quantize.kernels import quantize

    try:
        return quantize(spec.load(), spec.ggml_type, name=spec.name, importance=spec.importance)
    except ValueError as exc:  # NaN/Inf, bad row length: the source is at fault, say which tensor
        raise InputError(spec.source, str(exc)) from None


def check_not_an_input(out: Path, inputs: list[Path]) -> None:
    out = Path(out)
    for src in inputs:
        src = Path(src)
        same = out.resolve() == src.resolve() or (out.exists() and src.exists() and os.path.samefile(out, src))
        if same:
            raise InputError(out, f"output path is an input ({src}); choose another output name")


@contextlib.contextmanager
def atomic_output(out: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``out``; rename it to ``out`` only if the body succeeds."""
    out = Path(out)
    if out.is_dir():
        raise InputError(out, "output path is a directory")
    if not out.parent.exists():
        raise InputError(out, f"output folder {out.parent} does not exist")
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_plan(
    plan: Plan,
    out: Path,
    *,
    on_tensor: Callable[[TensorSpec, int], None] | None = None,
) -> None:
    """Stream ``plan`` to ``out`` atomically. ``on_tensor(spec, nbytes)`` reports progress."""
    check_not_an_input(out, plan.inputs)
    with atomic_output(out) as tmp:
        writer = GGUFWriter(tmp, plan.arch)
        for key, val in plan.kv.items():
            writer.add_key_value(key, val.value, val.type, sub_type=val.sub_type)
        for spec in plan.tensors:
            writer.add_tensor_info(
                spec.name,
                spec.shape,
                np.dtype(np.float32),  # ignored: raw_dtype decides, shape is the logical shape
                tensor_nbytes(spec.shape, spec.ggml_type),
                raw_dtype=spec.ggml_type,
            )
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        try:
            for spec, data in _encoded(plan.tensors):
                writer.write_tensor_data(data)
                if on_tensor is not None:
                    on_tensor(spec, data.nbytes)
                del data
        finally:
            writer.close()


PREFETCH_BUDGET = 1 << 30  # bytes of two neighbouring tensors above which they are not held at once


def _encoded(specs: list[TensorSpec]) -> Iterator[tuple[TensorSpec, np.ndarray]]:
    """Each spec with its bytes, in order. The next tensor is read and encoded in a worker thread while
    the current one is written (file I/O and torch release the GIL), unless the two together exceed
    PREFETCH_BUDGET: memory stays near the largest tensor."""
    from concurrent.futures import ThreadPoolExecutor

    def checked(spec: TensorSpec) -> np.ndarray:
        data = encode_tensor(spec)
        expected = tensor_nbytes(spec.shape, spec.ggml_type)
        if data.nbytes != expected:
            raise InputError(spec.source, f"produced {data.nbytes} bytes, expected {expected} for {spec.ggml_type.name}")
        return data

    size = [tensor_nbytes(s.shape, s.ggml_type) for s in specs]
    with ThreadPoolExecutor(max_workers=1) as pool:
        ahead = None
        for i, spec in enumerate(specs):
            data = ahead.result() if ahead is not None else checked(spec)
            ahead = None
            if i + 1 < len(specs) and size[i] + size[i + 1] <= PREFETCH_BUDGET:
                ahead = pool.submit(checked, specs[i + 1])
            yield spec, data
