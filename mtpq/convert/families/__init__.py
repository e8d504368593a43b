"""One module per GGUF architecture llama.cpp keeps an MTP head for; each registers its Family classes
(``@register``) with :data:`mtpq.convert.base.FAMILIES` when imported.  Module names follow the GGUF arch
(``glm_dsa`` for ``glm-dsa``); ``glm4moe_lite`` is GLM-4.7-Flash, written as llama.cpp writes it (``deepseek2``)."""

from __future__ import annotations

from . import (  # noqa: F401  (importing a family registers it)
    bailingmoe3,
    cohere2moe,
    deepseek2,
    deepseek32,
    deepseek4,
    glm4moe,
    glm4moe_lite,
    glm_dsa,
    hy_v3,
    mimo2,
    nemotron_h_moe,
    qwen35,
    qwen35moe,
    qwen3next,
    step35,
)
