"""GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``) -> GGUF arch ``deepseek2``.

A DeepSeek-V3 layout under GLM's name: MLA attention (``q_a``/``q_b``,
``kv_a_proj_with_mqa``, ``kv_b_proj`` split into ``attn_k_b``/``attn_v_b``), one
dense first layer, sigmoid-routed experts with a correction bias and a shared
expert, the MTP block at ``model.layers.{num_hidden_layers}`` (47 in the release).
llama.cpp's ``conversion/glm.py: Glm4MoeLiteModel`` is its DeepseekV2Model with
GLM's vocab and, unlike for DeepSeek-V3, the MTP block kept; so here it is
:class:`~.deepseek2.DeepseekV3` with GLM-4.5's vocab.

One deliberate difference from llama.cpp's converter: the release's config.json
names no ``scoring_func``, so llama.cpp writes no ``expert_gating_func`` and its
loader guesses sigmoid only for 47/48-layer models with GLM's 154880-token vocab
(softmax otherwise). Like for DeepSeek-V3 we write sigmoid, which is what the
model routes with at any size.
"""

from __future__ import annotations

from .deepseek2 import DeepseekV3
from .glm4moe import Glm4Moe


class Glm4MoeLite(DeepseekV3):
    hf_architectures = ("Glm4MoeLiteForCausalLM",)
    arch = "deepseek2"

    write_vocab = Glm4Moe.write_vocab
