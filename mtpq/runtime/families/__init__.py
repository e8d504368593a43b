"""The runtime's families: one module per architecture, each a :class:`~mtpq.runtime.model.Family`.

To add one: write ``families/<arch>.py`` with a Family subclass (config from GGUF metadata,
the decoder block at each index) and list it in ``FAMILIES`` below. ``common.py`` reads the
metadata every family reads alike (GQA shapes, DeepSeek-style routing).
"""

from __future__ import annotations

from ...errors import InputError
from ..model import Family
from ..weights import GGUFFile
from .deepseek2 import Deepseek2
from .glm4moe import Glm4Moe
from .qwen35 import Qwen35

FAMILIES: dict[str, type[Family]] = {arch: fam for fam in (Glm4Moe, Qwen35, Deepseek2) for arch in fam.archs}


def family_for(g: GGUFFile) -> type[Family]:
    fam = FAMILIES.get(g.arch)
    if fam is None:
        raise InputError(g.path, f"architecture {g.arch!r} has no runtime yet; the runtime runs "
                                 f"{', '.join(sorted(FAMILIES))}")
    return fam
