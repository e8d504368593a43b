"""DeepSeek-V3 saved by transformers 4.x (fine-tunes, merges, conversions written by ``save_pretrained``):
DeepseekV3ForCausalLM in bf16, its config.json as transformers 4.57's DeepseekV3Config writes it.

That class has no ``topk_method`` nor ``scoring_func`` (DeepSeek's remote config had both), so a config built
from its own parameters -- the release's values, ``num_nextn_predict_layers`` kept as an extra key, which
4.x's PretrainedConfig stores and writes -- is saved without them, while its router
(DeepseekV3TopkRouter) always registers ``e_score_correction_bias`` as a persistent buffer, saved in the
model's dtype. The keys below are what ``DeepseekV3Config(...).save_pretrained`` wrote under transformers
4.57.1 (``rope_scaling`` with "rope_type" beside "type", floats for factor/beta_*, ``head_dim`` =
qk_rope_head_dim, ``qk_head_dim``, ``rope_interleave``), with ``architectures`` and ``dtype`` as a model's
save adds them. Shrunk as deepseek_v3.py.

Where the two converters differ: llama.cpp's deepseek2 converter drops the MTP layer (see deepseek_v3.py),
and with no ``scoring_func`` it writes no ``expert_gating_func``, so its loader routes these models with
softmax; transformers' DeepseekV3 always routes with sigmoid, which mtpq writes.
"""

from . import variant
from ._deepseek import (
    DROPS_MTP,
    SPECIALS,  # noqa: F401 (the manifest's tokenizer)
    drops_mtp_layer,
)
from ._deepseek import tensors as _tensors
from .deepseek_v3 import CONFIG as _V3

RELEASE = "deepseek-ai/DeepSeek-V3 (saved by transformers 4.x)"
SOURCES = [
    "transformers 4.57.1 src/transformers/models/deepseek_v3/configuration_deepseek_v3.py (the keys it writes: "
    "DeepseekV3Config(...).save_pretrained run under 4.57.1; no topk_method / scoring_func attributes)",
    "transformers 4.57.1 src/transformers/models/deepseek_v3/modeling_deepseek_v3.py (DeepseekV3TopkRouter "
    "register_buffer('e_score_correction_bias'); _keys_to_ignore_on_load_unexpected model.layers.61.*)",
    "https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json (the values)",
    "vllm/model_executor/models/deepseek_mtp.py (the MTP layer's tensor names)",
]
# DeepSeek-V3's values (deepseek_v3.py); what DeepseekV3Config adds (dtype, head_dim, qk_head_dim, rope_interleave,
# rope_scaling's rope_type and floats) and the remote config's keys it has no attribute for, dropped
CONFIG = variant(
    _V3,
    {
        "dtype": "bfloat16",
        "head_dim": 32,
        "qk_head_dim": 96,
        "rope_interleave": True,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 40.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "type": "yarn",
        },
        "transformers_version": "4.57.1",
    },
    drop=(
        "auto_map",
        "aux_loss_alpha",
        "ep_size",
        "moe_layer_freq",
        "quantization_config",
        "scoring_func",
        "seq_aux",
        "topk_method",
        "torch_dtype",
    ),
)
FORMS = {"bf16": None}
LLAMA_CPP_MODE = {"--no-mtp": None}  # as deepseek_v3.py
DIFFERS_KEYS = {
    "deepseek2.expert_gating_func": "config.json names no scoring_func: llama.cpp's converter writes "
    "no gating function and its loader then routes deepseek2 with softmax; transformers' "
    "DeepseekV3 routes with sigmoid, which mtpq writes"
}
_DROPS = DROPS_MTP + "; and expert_gating_func, as DIFFERS_KEYS says"
DIFFERS = drops_mtp_layer(FORMS, _DROPS)
DRAFTS = True


def tensors(cfg: dict) -> dict[str, tuple[int, ...]]:
    return _tensors(cfg)
