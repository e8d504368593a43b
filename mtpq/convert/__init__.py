"""HF checkpoint -> plan (GGUF names, roles, metadata), one module per family."""

from __future__ import annotations

from pathlib import Path

from gguf import GGMLQuantizationType

from ..tensors import Plan
from .base import OUTTYPES, BlockSelection
from .checkpoint import HFCheckpoint
from .families import CONVERT_FAMILIES, convert_family_for

__all__ = ["CONVERT_FAMILIES", "OUTTYPES", "BlockSelection", "plan_checkpoint"]


def plan_checkpoint(
    src: Path,
    mtp: BlockSelection = BlockSelection.KEEP,
    outtype: GGMLQuantizationType | None = GGMLQuantizationType.F16,
) -> Plan:
    """Validate ``src`` and return the conversion plan; nothing heavy is read yet.

    ``outtype=None`` is llama.cpp's ``auto``: bf16 when the checkpoint stores bf16 weights
    (the bits pass through untouched), f16 otherwise.
    """
    from .hfconfig import tell_unread

    ckpt = HFCheckpoint(Path(src))
    if outtype is None:
        outtype = auto_outtype(ckpt)
    plan = convert_family_for(ckpt).plan(mtp=mtp, outtype=outtype)
    tell_unread(ckpt.folder)  # the checkpoint passed: now say that its config.json was read as written
    return plan


def auto_outtype(ckpt: HFCheckpoint) -> GGMLQuantizationType:
    dtypes = {ckpt.source_dtype(n) for n in ckpt.names() if len(ckpt.shape(n)) >= 2}
    return GGMLQuantizationType.BF16 if "BF16" in dtypes else GGMLQuantizationType.F16
