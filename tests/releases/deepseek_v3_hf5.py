"""DeepSeek-V3 saved by transformers 5.x (fine-tunes, merges, conversions written by ``save_pretrained``):
DeepseekV3ForCausalLM in bf16, its config.json as transformers 5.24's DeepseekV3Config writes it.

As in 4.x (deepseek_v3_hf4.py) the class has no ``topk_method`` nor ``scoring_func``, while its router always
holds ``e_score_correction_bias``; 5.x writes ``rope_parameters`` (rope_theta inside, no top-level
``rope_theta``), ``num_nextn_predict_layers`` from its own ``num_mtp_layers`` (default 1), ``pad_token_id``,
``output_router_logits``, and keeps the router in F32 (``_keep_in_fp32_modules_strict``: ``gate.weight`` and
``e_score_correction_bias`` are F32 in a model loaded in bf16, and saved so). The keys are what
``DeepseekV3Config(...).save_pretrained`` wrote under transformers 5.24.0, ``architectures`` and ``dtype`` as
a model's save adds them, and the F32 router tensors what ``from_pretrained(dtype=bfloat16).save_pretrained``
stored. Shrunk as deepseek_v3.py; the converters differ as for deepseek_v3_hf4.py.
"""

from . import variant
from ._deepseek import (
    SPECIALS,  # noqa: F401 (the manifest's tokenizer)
    drops_mtp_layer,
    f32,
)
from ._deepseek import tensors as _tensors
from .deepseek_v3 import CONFIG as _V3
from .deepseek_v3_hf4 import _DROPS, DIFFERS_KEYS, LLAMA_CPP_MODE  # noqa: F401 (the same knowing differences)
from .deepseek_v3_hf4 import CONFIG as _HF4

RELEASE = "deepseek-ai/DeepSeek-V3 (saved by transformers 5.x)"
SOURCES = [
    "transformers 5.24.0 src/transformers/models/deepseek_v3/configuration_deepseek_v3.py (the keys it writes: "
    "DeepseekV3Config(...).save_pretrained run under 5.24.0; num_mtp_layers -> num_nextn_predict_layers)",
    "transformers 5.24.0 src/transformers/models/deepseek_v3/modeling_deepseek_v3.py (DeepseekV3TopkRouter's "
    "e_score_correction_bias buffer; _keep_in_fp32_modules_strict = [e_score_correction_bias, gate.weight])",
    "https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json (the values)",
    "vllm/model_executor/models/deepseek_mtp.py (the MTP layer's tensor names)",
]
# 4.x's keys (deepseek_v3_hf4.py) but rope_parameters for rope_scaling / rope_theta, and 5.x's output_router_logits,
# pad_token_id
CONFIG = variant(
    _HF4,
    {
        "output_router_logits": False,
        "pad_token_id": None,
        # deepseek_v3.py's rope_scaling (its ints, not 4.x's floats), rope_theta and rope_type inside
        "rope_parameters": dict(sorted((_V3["rope_scaling"] | {"rope_theta": 10000, "rope_type": "yarn"}).items())),
        "transformers_version": "5.24.0",
    },
    drop=("rope_scaling", "rope_theta"),
)
FORMS = {"bf16": f32("mlp.gate.weight", "mlp.gate.e_score_correction_bias")}
DIFFERS = drops_mtp_layer(FORMS, _DROPS)
DRAFTS = True


def tensors(cfg: dict) -> dict[str, tuple[int, ...]]:
    return _tensors(cfg)
