"""The convert families: one module per GGUF architecture llama.cpp keeps an MTP head for, each a
:class:`~mtpq.convert.base.ConvertFamily`, listed in :data:`CONVERT_FAMILIES`, and :func:`convert_family_for`, which
picks a checkpoint's family. Module names follow the GGUF arch (``glm_dsa`` for ``glm-dsa``); ``glm4moe_lite`` is
GLM-4.7-Flash, written as llama.cpp writes it (``deepseek2``).

To add one: write ``families/<arch>.py`` with a ConvertFamily subclass and list it in the tuple below (the runtime's
families register the same way, in :mod:`mtpq.runtime.families`).
"""

from __future__ import annotations

from ...errors import InputError
from ..base import ConvertFamily
from ..checkpoint import HFCheckpoint
from .bailingmoe3 import BailingMoe3
from .cohere2moe import Cohere2Moe
from .deepseek2 import DeepseekV3
from .deepseek4 import DeepseekV4
from .deepseek32 import DeepseekV32
from .glm4moe import Glm4Moe
from .glm4moe_lite import Glm4MoeLite
from .glm_dsa import GlmMoeDsa
from .hy_v3 import HyV3
from .mimo2 import MiMoV2
from .nemotron_h_moe import NemotronHMoe
from .qwen3next import Qwen3Next
from .qwen35 import Qwen35
from .qwen35moe import Qwen35Moe
from .step35 import Step35

# HF architecture -> family
CONVERT_FAMILIES: dict[str, type[ConvertFamily]] = {
    arch: fam
    for fam in (
        BailingMoe3,
        Cohere2Moe,
        DeepseekV3,
        DeepseekV32,
        DeepseekV4,
        Glm4Moe,
        Glm4MoeLite,
        GlmMoeDsa,
        HyV3,
        MiMoV2,
        NemotronHMoe,
        Qwen35,
        Qwen35Moe,
        Qwen3Next,
        Step35,
    )
    for arch in fam.hf_architectures
}

# MTP checkpoints that llama.cpp neither converts nor runs: no GGUF arch holds their head, so a file keeping it
# would load nowhere (llama.cpp refuses tensors its graph does not use). Said plainly instead of "unknown".
NO_LLAMA_CPP_HEAD = {
    "MiMoForCausalLM": "MiMo-7B's MTP head (model.mtp_layers.*) has no GGUF architecture: llama.cpp's converter "
    "does not register MiMoForCausalLM and no llama.cpp graph runs that head, so a GGUF "
    "keeping it would load nowhere (MiMo-V2-Flash / MiMo-V2.5 convert as mimo2)",
}


def convert_family_for(ckpt: HFCheckpoint) -> ConvertFamily:
    """The family that converts ``ckpt`` (by config.json's architectures), or an InputError naming those mtpq
    converts."""
    archs = ckpt.config.get("architectures") or []
    for a in archs:
        if a in CONVERT_FAMILIES:
            return CONVERT_FAMILIES[a](ckpt)
    for a in archs:
        if a in NO_LLAMA_CPP_HEAD:
            raise InputError(ckpt.folder / "config.json", f"unsupported architecture {a}: {NO_LLAMA_CPP_HEAD[a]}")
    known = ", ".join(sorted(CONVERT_FAMILIES))
    raise InputError(
        ckpt.folder / "config.json", f"unsupported architecture {archs or '(none)'}; mtpq converts: {known}"
    )
