"""HF checkpoint -> plan (GGUF names, roles, metadata), one module per family."""

from __future__ import annotations

from pathlib import Path

from gguf import GGMLQuantizationType

from ..tensors import Plan
from . import glm4moe  # noqa: F401  (families register themselves)
from . import qwen35, qwen35moe  # noqa: F401
from . import qwen3next  # noqa: F401
from . import deepseek2  # noqa: F401
from . import deepseek32  # noqa: F401
from . import step35, mimo2  # noqa: F401
from . import glm_dsa  # noqa: F401
from . import glm4moe_lite  # noqa: F401
from . import hyv3, cohere2moe, nemotronh, bailingmoe3  # noqa: F401
from . import deepseek4  # noqa: F401
from .base import FAMILIES, OUTTYPES, MtpMode, family_for
from .checkpoint import Checkpoint

__all__ = ["FAMILIES", "OUTTYPES", "MtpMode", "plan_checkpoint"]


def plan_checkpoint(src: Path, mtp: MtpMode = MtpMode.KEEP,
                    outtype: GGMLQuantizationType | None = GGMLQuantizationType.F16) -> Plan:
    """Validate ``src`` and return the conversion plan; nothing heavy is read yet.

    ``outtype=None`` is llama.cpp's ``auto``: bf16 when the checkpoint stores bf16 weights
    (the bits pass through untouched), f16 otherwise.
    """
    ckpt = Checkpoint(Path(src))
    if outtype is None:
        outtype = auto_outtype(ckpt)
    return family_for(ckpt).plan(mtp=mtp, outtype=outtype)


def auto_outtype(ckpt: Checkpoint) -> GGMLQuantizationType:
    dtypes = {ckpt.source_dtype(n) for n in ckpt.names() if len(ckpt.shape(n)) >= 2}
    return GGMLQuantizationType.BF16 if "BF16" in dtypes else GGMLQuantizationType.F16
