"""``mtpq convert``'s job: an HF checkpoint planned as a GGUF and, with ``--quant``, quantized in the same pass
from the checkpoint's own values (no intermediate full-precision file); ``--mtp-type auto`` then measures the head
on the written trunk (:mod:`.auto_head`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

    from ..convert import BlockSelection
    from ..quantize.kv_override import KvOverride
    from ..quantize.pipeline import QuantOptions
    from ..tensors import Plan


def converted_plan(
    src: Path,
    blocks: "BlockSelection",
    outtype: "GGMLQuantizationType | None",
    options: "QuantOptions | None" = None,
    kv_overrides: Sequence["KvOverride"] = (),
) -> tuple["Plan", "Plan"]:
    """(the checkpoint's plan, the plan to write): quantized by ``options`` when given (``--outtype`` still decides
    what the preset leaves unquantized, as if converted first and quantized after), else with ``kv_overrides``
    written. ``outtype`` None is llama.cpp's ``auto``."""
    from ..convert import plan_checkpoint
    from ..quantize.kv_override import apply_kv_overrides
    from ..quantize.pipeline import plan_quantize

    source = plan_checkpoint(src, mtp=blocks, outtype=outtype)
    if options is not None:
        return source, plan_quantize(source, options)
    if kv_overrides:
        apply_kv_overrides(source, list(kv_overrides))
    return source, source
