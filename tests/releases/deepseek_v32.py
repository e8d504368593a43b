"""DeepSeek-V3.2 as released (deepseek-ai/DeepSeek-V3.2-Exp, -V3.2, -V3.2-Speciale): DeepseekV32ForCausalLM in
FP8, DeepSeek-V3's layout plus DeepSeek Sparse Attention's lightning indexer in every layer, the MTP layer
(model.layers.61) included: ``self_attn.indexer.{wq_b, wk, k_norm.{weight,bias}, weights_proj}``.

Shrunk as deepseek_v3.py, and index_n_heads 64 -> 4, index_head_dim 128 -> 64, index_topk 2048 -> 64. Every
other key as released: the V3.1 key set (no auto_map: the release ships no modeling code; quantization_config
with "scale_fmt": "ue8m0") plus model_type deepseek_v32 and the three index_* keys.

Encoding: as DeepSeek-V3's (deepseek_v3.py), and the indexer's wq_b / wk e4m3 with their scales while
weights_proj and k_norm stay BF16. llama.cpp's DeepseekV32Model keeps the MTP layer: every cell is compared.
"""

from . import variant
from ._deepseek import FP8_UE8M0_CONFIG, SPECIALS, fp8_release  # noqa: F401 (SPECIALS: the manifest's tokenizer)
from ._deepseek import tensors as _tensors
from .deepseek_v3 import CONFIG as _V3

RELEASE = "deepseek-ai/DeepSeek-V3.2-Exp"
SOURCES = [
    "https://huggingface.co/deepseek-ai/DeepSeek-V3.2-Exp/blob/main/config.json (the index_* keys and values, "
    "model_type; read from a checkpoint loader's module documentation that quotes it)",
    "https://huggingface.co/deepseek-ai/DeepSeek-V3.1-Base/blob/main/config.json (the rest of the key set, "
    "quantization_config with scale_fmt ue8m0; read from a verbatim copy in a fine-tuning guide)",
    "https://huggingface.co/deepseek-ai/DeepSeek-V3.2-Exp/blob/main/model.safetensors.index.json (indexer names; "
    "every .weight but weights_proj and k_norm has a weight_scale_inv sibling, per the same loader's notes)",
    "transformers src/transformers/models/deepseek_v32/modeling_deepseek_v32.py (DeepseekV32Indexer names)",
    "vllm/model_executor/models/deepseek_mtp.py (the MTP layer: a full decoder layer with its indexer)",
    "llama.cpp conversion/deepseek.py DeepseekV32Model (keeps the MTP layer; indexer metadata)",
]
# V3's keys and values but the V3.1 key set (no auto_map, aux_loss_alpha, pretraining_tp, seq_aux), the indexer's
# index_* keys, its model type, quantization_config with scale_fmt ue8m0, transformers_version
CONFIG = variant(
    _V3,
    {
        "architectures": ["DeepseekV32ForCausalLM"],
        "index_head_dim": 64,
        "index_n_heads": 4,
        "index_topk": 64,
        "model_type": "deepseek_v32",
        "quantization_config": FP8_UE8M0_CONFIG,
        "transformers_version": "4.44.2",
    },
    drop=("auto_map", "aux_loss_alpha", "pretraining_tp", "seq_aux"),
)
FORMS = {"fp8": fp8_release(keep=("eh_proj.weight", "shared_head.head.weight", "indexer.weights_proj.weight"))}
DRAFTS = True


def tensors(cfg: dict) -> dict[str, tuple[int, ...]]:
    return _tensors(cfg, indexed=lambda bid: True)
