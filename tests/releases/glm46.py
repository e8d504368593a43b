"""GLM-4.6 (zai-org/GLM-4.6, bf16; zai-org/GLM-4.6-FP8) as released: GLM-4.5's layout and keys (see glm45.py) with a
202752-token context, and an MTP layer (model.layers.92) WITHOUT its own ``embed_tokens`` and
``shared_head.head``: the head shares the trunk's embedding and lm_head (llama.cpp falls back to token_embd /
output), so converters must not demand them.

Forms: ``bf16``, ``fp8`` (compressed-tensors, per-channel scales, as GLM-4.6-FP8), ``tf5`` (saved by transformers 5).
Shrunk as glm45.py.
"""

from functools import partial

from . import fp8_per_channel, transformers_saved
from ._glm4moe import tensors as _tensors
from .glm45 import CONFIG as _GLM45

RELEASE = "zai-org/GLM-4.6"
SOURCES = [
    "https://huggingface.co/zai-org/GLM-4.6/blob/main/config.json (keys and values: GLM-4.5's, max_position_embeddings"
    " 202752)",
    "https://huggingface.co/zai-org/GLM-4.6/blob/main/model.safetensors.index.json (layer 92 without embed_tokens /"
    " shared_head.head)",
    "https://huggingface.co/zai-org/GLM-4.6-FP8/blob/main/config.json (compressed-tensors quantization_config)",
    "vllm/model_executor/models/glm4_moe_mtp.py (no shared_head.head / embed_tokens of the MTP layer: the "
    "trunk's serve)",
    "llama.cpp conversion/glm.py Glm4MoeModel (keeps the MTP layer; nextn.embed_tokens/shared_head_head optional)",
]
CONFIG = {**_GLM45, "max_position_embeddings": 202752}
FORMS = {"bf16": None, "fp8": fp8_per_channel, "tf5": transformers_saved}
DRAFTS = True
tensors = partial(_tensors, own_head=False)
