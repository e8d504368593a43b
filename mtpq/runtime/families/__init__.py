"""The runtime's families: one module per architecture, each a :class:`~mtpq.runtime.model.RuntimeFamily`, listed
in :data:`RUNTIME_FAMILIES`; :func:`runtime_family_for` picks the family of a GGUF and :func:`load` its model.

To add one: write ``families/<arch>.py`` with a RuntimeFamily subclass (config from GGUF metadata,
the decoder block at each index), list it in ``RUNTIME_FAMILIES`` below and its archs in ``..archs``
(the convert families register the same way, in :mod:`mtpq.convert.families`). ``common.py`` reads the
metadata every family reads alike (GQA shapes, DeepSeek-style routing).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...errors import InputError
from ..model import MtpModel, RuntimeFamily
from ..weights import GGUFFile
from .bailingmoe3 import BailingMoe3
from .cohere2moe import Cohere2Moe
from .deepseek2 import Deepseek2
from .deepseek4 import Deepseek4
from .deepseek32 import Deepseek32
from .glm4moe import Glm4Moe
from .glm_dsa import GlmDsa
from .hy_v3 import HyV3
from .mimo2 import Mimo2
from .nemotron_h_moe import NemotronHMoe
from .qwen3next import Qwen3Next
from .qwen35 import Qwen35
from .step35 import Step35

# GGUF arch -> family
RUNTIME_FAMILIES: dict[str, type[RuntimeFamily]] = {
    arch: fam
    for fam in (
        Glm4Moe,
        Qwen35,
        Deepseek2,
        Deepseek32,
        GlmDsa,
        HyV3,
        Cohere2Moe,
        BailingMoe3,
        Qwen3Next,
        NemotronHMoe,
        Step35,
        Mimo2,
        Deepseek4,
    )
    for arch in fam.archs
}


def runtime_family_for(g: GGUFFile) -> type[RuntimeFamily]:
    """The family that runs ``g`` (by its GGUF arch), or an InputError naming those the runtime runs."""
    fam = RUNTIME_FAMILIES.get(g.arch)
    if fam is None:
        raise InputError(
            g.path,
            f"architecture {g.arch!r} has no runtime yet; the runtime runs {', '.join(sorted(RUNTIME_FAMILIES))}",
        )
    return fam


def load(
    path: Path | str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    hidden: str = "auto",
    g: GGUFFile | None = None,
    llama_cpp_numerics: bool = False,
) -> MtpModel:
    """The model in a GGUF, for any architecture the runtime has (:data:`RUNTIME_FAMILIES`)."""
    from ...ggml.malloc import keep_freed_buffers

    # long passes (prefill, teacher forcing, imatrix) allocate and free many 0.1-2 MB temporaries: under
    # glibc's default policy they are returned and faulted in again
    keep_freed_buffers()
    if torch.device(device).type == "cuda":
        # cuDNN's attention builds a plan for every new key length, costly while decoding, where the flash and
        # memory-efficient kernels launch at once
        torch.backends.cuda.enable_cudnn_sdp(False)
    g = g or GGUFFile(Path(path))
    from ...gguf_io.check import is_head_file

    if is_head_file(g) and not any(n.startswith("blk.0.") for n in g.tensors):
        raise InputError(
            g.path, "is a head file (the MTP block without the trunk): give the trunk file, and this one with --head"
        )
    return MtpModel(
        g, runtime_family_for(g)(g), device=device, dtype=dtype, hidden=hidden, llama_cpp_numerics=llama_cpp_numerics
    ).eval()
