"""GLM-5 / GLM-5.1 as released (zai-org/GLM-5, bf16; zai-org/GLM-5-FP8): GlmMoeDsaForCausalLM, DeepSeek-V3.2's
layout (MLA, DeepSeek Sparse Attention's indexer in every layer, sigmoid-routed experts with a correction bias,
one shared expert) under GLM's vocab; 78 layers + the MTP layer stored as model.layers.78, a full layer with
its indexer.

Shrunk: hidden 6144 -> 256, layers 78 -> 2 (+1 MTP), first_k_dense_replace 3 -> 1, experts 256 -> 4 (8 -> 2
per token), heads 64 -> 4, q_lora 2048 -> 256, kv_lora 512 -> 256, qk_nope/rope/v 192/64/256 -> 64/32/64
(head_dim = qk_rope_head_dim, qk_head_dim = nope + rope), index heads/dim/topk 32/128/2048 -> 4/64/64,
intermediate 12288 -> 512, moe_intermediate 2048 -> 256. Every other key as released: a transformers 5
config (rope_parameters, dtype), no indexer_types (GLM-5 / 5.1 run the indexer in every layer; 5.2 lists
them), indexer_rope_interleave.

The FP8 release as vLLM and SGLang load it through their DeepSeek-V2 path: 128x128 block-scaled e4m3
(weight_scale_inv), BF16 embeddings, norms, routers and indexer weights_proj, F32 correction bias.
llama.cpp's GlmMoeDsaModel (conversion/glm.py) keeps the MTP layer: every cell is compared.
"""

from . import variant
from ._deepseek import f32, fp8_release
from ._deepseek import tensors as _tensors
from .glm47_flash import CONFIG as _GLM47_FLASH

RELEASE = "zai-org/GLM-5"
SOURCES = [
    "https://huggingface.co/zai-org/GLM-5/blob/main/config.json (keys: read from engines' test fixtures shaped "
    "on the GLM-5.x configs -- indexer_rope_interleave, scoring_func, topk_method, rope_parameters, "
    "rope_interleave, qk_head_dim, eos/pad ids -- and the values NeMo AutoModel's and Megatron-Bridge's GLM-5 "
    "pages list: 78 layers, hidden 6144, 3 dense, 256 experts top-8, max_position_embeddings 202752)",
    "transformers src/transformers/models/glm_moe_dsa/configuration_glm_moe_dsa.py (indexer_types derived from "
    "index_topk_freq / index_skip_topk_offset: every layer 'full' for GLM-5)",
    "transformers src/transformers/models/glm_moe_dsa/modeling_glm_moe_dsa.py (per-layer and indexer names)",
    "sgl-project/sglang-jax pull 1111 (the FP8 form, as zai-org/GLM-5.1-FP8 ships it: block-wise 128x128 e4m3 "
    "loaded through the DeepSeek-V3 path; GLM-5-FP8's own config.json was not read)",
    "vllm/model_executor/models/deepseek_v2.py and deepseek_mtp.py (GlmMoeDsaForCausalLM; the MTP layer 78)",
    "llama.cpp conversion/glm.py GlmMoeDsaModel (keeps the MTP layer; indexer metadata)",
]
# GLM-4.7-Flash's keys (the same GLM vocab, ids and sizes: glm47_flash.py) but DeepSeek-V3.2's indexer keys, a
# transformers 5 rope_parameters for rope_scaling / rope_theta / partial_rotary_factor, and these values
CONFIG = variant(
    _GLM47_FLASH,
    {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "ep_size": 1,
        "head_dim": 32,
        "index_head_dim": 64,
        "index_n_heads": 4,
        "index_topk": 64,
        "indexer_rope_interleave": True,
        "initializer_range": 0.02,
        "model_type": "glm_moe_dsa",
        "moe_layer_freq": 1,
        "qk_head_dim": 96,
        "rope_interleave": True,
        "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "transformers_version": "5.0.2.dev0",
    },
    drop=("partial_rotary_factor", "rope_scaling", "rope_theta"),
)
FORMS = {
    "bf16": f32("mlp.gate.e_score_correction_bias"),
    "fp8": fp8_release(keep=("eh_proj.weight", "shared_head.head.weight", "indexer.weights_proj.weight")),
}
DRAFTS = True


def tensors(cfg: dict) -> dict[str, tuple[int, ...]]:
    return _tensors(cfg, indexed=lambda bid: True)
