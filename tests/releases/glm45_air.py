"""GLM-4.5-Air (zai-org/GLM-4.5-Air, bf16; zai-org/GLM-4.5-Air-FP8) as released: Glm4MoeForCausalLM, 46 layers +
1 MTP layer stored as model.layers.46.

Forms: ``bf16``; ``fp8`` as GLM-4.5-Air-FP8 ships it: compressed-tensors (llm-compressor's float-quantized
scheme), every Linear e4m3 with a per-output-channel ``weight_scale`` [out, 1], activations dynamic per token --
the form of its GLM-4.5/4.6/4.7-FP8 siblings, not DeepSeek's 128x128 block tiles. The release's config.json could
not be read here; the form is the one a loader's fixture of zai-org/GLM-4.5-Air-FP8 and the GLM-4.5 FP8 loaders
cited below describe. Its ``ignore`` list is not established (written as the siblings': ``["lm_head"]``);
neither converter reads it: both find the FP8 weights by their ``weight_scale`` companions.

Shrunk: hidden 4096 -> 256, layers 46 -> 2 (+1 MTP), experts 128 -> 4, heads 96/8 -> 4/2 (head_dim 128 -> 64),
intermediate 10944 -> 512, moe_intermediate 1408 -> 256. Every other key as released.
"""

from . import fp8_per_channel, variant
from ._glm4moe import tensors  # noqa: F401  (the manifest's tensors: GLM-4.5's layout)
from .glm45 import CONFIG as _GLM45

RELEASE = "zai-org/GLM-4.5-Air"
SOURCES = [
    "https://huggingface.co/zai-org/GLM-4.5-Air/blob/main/config.json (keys and values)",
    "https://huggingface.co/zai-org/GLM-4.5-Air/blob/main/model.safetensors.index.json (tensor names, layer 46)",
    "transformers src/transformers/models/glm4_moe/modeling_glm4_moe.py (per-layer names, attention_bias)",
    "vllm/model_executor/models/glm4_moe_mtp.py (the MTP layer's eh_proj/enorm/hnorm/shared_head names)",
    "LoomaFloat/freetoken tests/models/test_glm4_moe_fp8.py (its fixture of zai-org/GLM-4.5-Air-FP8: "
    "compressed-tensors quantization_config, format float-quantized, one config group targeting Linear, weights "
    "e4m3 with strategy channel and a weight_scale [out, 1], input activations dynamic per token)",
    "HabanaAI/vllm-hpu-extension pull 350 (GLM-4.5 MoE FP8 checkpoints load through vLLM's compressed-tensors path)",
    "vllm-project/vllm pull 32101 (GLM-4.5/4.6/4.7 FP8 checkpoints: weight_scale companions, the MTP layer's included)",
]
# GLM-4.5's config.json (glm45.py) but for these two values; every size is shrunk to the same numbers
CONFIG = variant(_GLM45, {"routed_scaling_factor": 1.0, "use_qk_norm": False})
FORMS = {"bf16": None, "fp8": fp8_per_channel}
DRAFTS = True
