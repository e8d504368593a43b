"""GLM-4.5-Air (zai-org/GLM-4.5-Air, bf16; zai-org/GLM-4.5-Air-FP8) as released: Glm4MoeForCausalLM, 46 layers +
1 MTP layer stored as model.layers.46.

Shrunk: hidden 4096 -> 256, layers 46 -> 2 (+1 MTP), experts 128 -> 4, heads 96/8 -> 4/2 (head_dim 128 -> 64),
intermediate 10944 -> 512, moe_intermediate 1408 -> 256. Every other key as released.
"""

from . import fp8_block_scaled, variant
from ._glm4moe import tensors  # noqa: F401  (the manifest's tensors: GLM-4.5's layout)
from .glm45 import CONFIG as _GLM45

RELEASE = "zai-org/GLM-4.5-Air"
SOURCES = [
    "https://huggingface.co/zai-org/GLM-4.5-Air/blob/main/config.json (keys and values)",
    "https://huggingface.co/zai-org/GLM-4.5-Air/blob/main/model.safetensors.index.json (tensor names, layer 46)",
    "transformers src/transformers/models/glm4_moe/modeling_glm4_moe.py (per-layer names, attention_bias)",
    "vllm/model_executor/models/glm4_moe_mtp.py (the MTP layer's eh_proj/enorm/hnorm/shared_head names)",
]
# GLM-4.5's config.json (glm45.py) but for these two values; every size is shrunk to the same numbers
CONFIG = variant(_GLM45, {"routed_scaling_factor": 1.0, "use_qk_norm": False})
FORMS = {"bf16": None, "fp8": lambda folder: fp8_block_scaled(folder)}
DRAFTS = True

