"""GLM-5 / 5.1 / 5.2 (GGUF arch ``glm-dsa``), as llama.cpp's glm-dsa graph computes it.

DeepSeek-V3.2's layout (:mod:`.deepseek32`: MLA with DeepSeek Sparse Attention's lightning indexer, ``dsa.py``)
with llama.cpp's glm-dsa rules: the indexer's RoPE rotates adjacent pairs, like the main MLA; its keys'
LayerNorm has epsilon 0 (the loader never sets f_norm_eps); sigmoid routing when the file names no gating
function; ``rope.scaling.yarn_log_multiplier`` is not read. Which blocks run their own indexer
(``attention.indexer.types``; without it every block for GLM-5 / 5.1, GLM-5.2's pattern when the trained
context reaches 1M): the others ("shared") reuse the top-k of the last full block before them. The MTP block
runs dense MLA + MoE, as llama.cpp's MTP graph does.
"""

from __future__ import annotations

from gguf import ExpertGatingFuncType

from ...errors import InputError
from ..weights import GGUFFile
from .deepseek32 import Deepseek32

GLM_5_2_CONTEXT = 1048576  # from this trained context on, a file without indexer types is GLM-5.2


def glm52_indexer_types(n: int) -> tuple[bool, ...]:
    """GLM-5.2's released pattern (llama.cpp's GLM_5_2_DEFAULT_INDEXER_TYPES, 78 entries, shared past them):
    blocks 0, 1 and every fourth from 2 run their indexer."""
    return tuple(i < 2 or (i < 78 and (i - 2) % 4 == 0) for i in range(n))


class GlmDsa(Deepseek32):
    archs = ("glm-dsa",)
    default_gating = ExpertGatingFuncType.SIGMOID
    indexer_neox = False
    indexer_norm_eps = 0.0
    reads_yarn_log_mul = False

    @staticmethod
    def check_gating(g: GGUFFile) -> None:
        pass  # optional: sigmoid without it

    def indexer_layers(self, g: GGUFFile) -> tuple[bool, ...]:
        n = g.n_trunk
        types = g.value("attention.indexer.types")
        if types is None:
            full = (True,) * n if int(g.value("context_length", 0) or 0) < GLM_5_2_CONTEXT else glm52_indexer_types(n)
        elif isinstance(types, (list, tuple)):
            if len(types) != n:  # llama.cpp refuses the file
                raise InputError(
                    g.path, f"{g.arch}.attention.indexer.types has {len(types)} entries for {n} trunk blocks"
                )
            full = tuple(bool(t) for t in types)
        else:
            full = (bool(types),) * n
        if n and not full[0]:
            raise InputError(
                g.path,
                f"{g.arch}.attention.indexer.types: block 0 is shared, but a shared block "
                "reuses the top-k of a full block before it",
            )
        return full
