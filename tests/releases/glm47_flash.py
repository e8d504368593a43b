"""GLM-4.7-Flash as released (zai-org/GLM-4.7-Flash, bf16): Glm4MoeLiteForCausalLM, a DeepSeek-V3 layout (MLA,
sigmoid-routed experts with a correction bias, one shared expert) under GLM's vocab; 47 layers + the MTP
layer stored as model.layers.47 (its own embed_tokens and shared_head.head included).

Shrunk: hidden 2048 -> 256, layers 47 -> 2 (+1 MTP), experts 64 -> 4 (4 -> 2 per token), heads 20 -> 4,
q_lora 768 -> 256, kv_lora 512 -> 256, qk_nope/rope/v 192/64/256 -> 64/32/64, intermediate 10240 -> 512,
moe_intermediate 1536 -> 256. Every other key as released: no scoring_func, top-level rope_theta with
"rope_scaling": null and partial_rotary_factor 1.0, topk_method noaux_tc. The routers' correction bias is
stored F32, as GLM's and DeepSeek's releases store it.

llama.cpp's Glm4MoeLiteModel (conversion/glm.py) keeps the MTP layer, so every cell is compared; the one
knowing difference is the gating function key (see DIFFERS_KEYS and mtpq/convert/families/glm4moe_lite.py).
"""

from . import variant
from ._deepseek import SHARED_CONFIG, f32
from ._deepseek import tensors as _tensors

RELEASE = "zai-org/GLM-4.7-Flash"
SOURCES = [
    "https://huggingface.co/zai-org/GLM-4.7-Flash/blob/main/config.json (the key set: read from a fail-closed "
    "validator of that config on GitHub, ams integrations glm4_moe_lite.py, its required and reviewed-optional "
    "fields and fixed values; sizes from its 'official GLM-4.7-Flash dimensions' test)",
    "https://huggingface.co/zai-org/GLM-4.7-Flash/blob/main/model.safetensors.index.json (tensor names; the same "
    "validator's inventory: 26 MTP-layer tensors incl. embed_tokens, shared_head.head/norm, the router bias)",
    "transformers src/transformers/models/glm4_moe_lite/modeling_glm4_moe_lite.py (per-layer names)",
    "vllm/model_executor/models/glm4_moe_lite_mtp.py (the MTP layer)",
    "llama.cpp conversion/glm.py Glm4MoeLiteModel (keeps the MTP layer, --mtp / --no-mtp)",
]
# the release's keys beside the sizes every DeepSeek-V3-shaped manifest shrinks alike (_deepseek.SHARED_CONFIG)
CONFIG = variant(
    SHARED_CONFIG,
    {
        "architectures": ["Glm4MoeLiteForCausalLM"],
        "dtype": "bfloat16",
        "eos_token_id": [154820, 154827, 154829],
        "max_position_embeddings": 202752,
        "model_type": "glm4_moe_lite",
        "n_group": 1,
        "pad_token_id": 154820,
        "partial_rotary_factor": 1.0,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "routed_scaling_factor": 1.8,
        "topk_method": "noaux_tc",
        "transformers_version": "5.0.0.dev0",
        "vocab_size": 154880,
    },
)
FORMS = {"bf16": f32("mlp.gate.e_score_correction_bias")}
DIFFERS_KEYS = {
    "deepseek2.expert_gating_func": "config.json names no scoring_func: llama.cpp's converter writes "
    "no gating function and leaves it to its loader, which guesses sigmoid only for 47/48 layers "
    "with a 154880-token vocab (softmax otherwise); mtpq writes sigmoid, what the model routes with"
}
DRAFTS = True


def tensors(cfg: dict) -> dict[str, tuple[int, ...]]:
    return _tensors(cfg)
