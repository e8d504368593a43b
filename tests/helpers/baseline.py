"""The baseline a streaming command is timed against (tests/end_to_end/test_scale.py, benchmarks/convert_bench.py)."""

from __future__ import annotations

from pathlib import Path


def scaled_copy(inputs: list[Path], out_bytes: int, target: Path) -> None:
    """Reads ``inputs`` into memory and writes ``out_bytes`` of them to ``target`` (a plain copy when the sizes
    match; FP8 -> bf16 writes twice what it reads), as any converter must; the caller times it and removes target."""
    in_bytes = sum(p.stat().st_size for p in inputs)
    buf = bytearray(64 << 20)
    with open(target, "wb") as dst:
        for p in inputs:
            with open(p, "rb") as src:
                while n := src.readinto(buf):
                    todo = round(n * out_bytes / in_bytes)
                    while todo > 0:
                        dst.write(memoryview(buf)[: min(n, todo)])
                        todo -= min(n, todo)
