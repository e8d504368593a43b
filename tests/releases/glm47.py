"""GLM-4.7 (zai-org/GLM-4.7, bf16; zai-org/GLM-4.7-FP8) as released: GLM-4.6's keys, saved by a transformers whose
config.json writes ``dtype`` instead of ``torch_dtype`` (still ``rope_scaling: null`` + ``rope_theta``), and an MTP
layer model.layers.92 with GLM-4.5's NextN tensors.

Forms: ``bf16``, ``fp8`` (compressed-tensors, per-channel scales, as GLM-4.7-FP8). Shrunk as glm45.py.
"""

from . import fp8_per_channel
from ._glm4moe import tensors  # noqa: F401  (the manifest's tensors)
from .glm46 import CONFIG as _GLM46

RELEASE = "zai-org/GLM-4.7"
SOURCES = [
    "https://huggingface.co/zai-org/GLM-4.7/blob/main/config.json (keys and values: GLM-4.6's, 'dtype' and"
    " no 'torch_dtype', transformers_version 4.57.1)",
    "https://huggingface.co/zai-org/GLM-4.7/blob/main/model.safetensors.index.json (tensor names, layer 92)",
    "https://huggingface.co/zai-org/GLM-4.7-FP8/blob/main/config.json (compressed-tensors quantization_config)",
    "vllm/model_executor/models/glm4_moe_mtp.py (the MTP layer's names)",
    "llama.cpp conversion/glm.py Glm4MoeModel",
]
CONFIG = {
    **{k: v for k, v in _GLM46.items() if k != "torch_dtype"},
    "dtype": "bfloat16",
    "transformers_version": "4.57.1",
}
FORMS = {"bf16": None, "fp8": fp8_per_channel}
DRAFTS = True
