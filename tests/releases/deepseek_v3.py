"""DeepSeek-V3 / DeepSeek-R1 as released (deepseek-ai/DeepSeek-V3, -V3-0324, deepseek-ai/DeepSeek-R1, -R1-0528):
DeepseekV3ForCausalLM in FP8, 61 layers + the MTP layer stored as model.layers.61.

Shrunk: hidden 7168 -> 256, layers 61 -> 2 (+1 MTP), first_k_dense_replace 3 -> 1, experts 256 -> 4 (n_group
8 -> 2, topk_group 4 -> 1, 8 -> 2 per token), heads 128 -> 4, q_lora 1536 -> 256, kv_lora 512 -> 256,
qk_nope/rope/v 128/64/128 -> 64/32/64, intermediate 18432 -> 512, moe_intermediate 2048 -> 256. Every other
key as released (rope_scaling with "type": "yarn", auto_map to the remote code, quantization_config).

Encoding as in the released index: every projection F8_E4M3 with an F32 [ceil(out/128), ceil(in/128)]
weight_scale_inv; BF16 embeddings, norms, routers (gate.weight), lm_head and, in the MTP layer, eh_proj,
embed_tokens and shared_head.head; F32 e_score_correction_bias.

llama.cpp's deepseek2 converter drops the MTP layer (DeepseekV2Model.skip_mtp; conversion/deepseek.py) and
has no --no-mtp / --mtp for it, so its default file is the trunk mtpq writes with --no-mtp; mtpq keeps the
layer as blk.2.nextn.* plus its block, which llama.cpp's deepseek2 loader reads and drafts with.
"""

from . import variant
from ._deepseek import SHARED_CONFIG, SPECIALS, drops_mtp_layer, fp8_release  # noqa: F401 (SPECIALS: the manifest's tokenizer)
from ._deepseek import tensors as _tensors

RELEASE = "deepseek-ai/DeepSeek-V3"
SOURCES = [
    "https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json (every key; read from verbatim copies "
    "in a vLLM-Ascend issue thread and Megatron-Bridge's DeepSeekV3Bridge unit test fixture)",
    "https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/configuration_deepseek.py (topk_method default "
    "'noaux_tc'; MoEGate creates e_score_correction_bias for noaux_tc)",
    "https://huggingface.co/deepseek-ai/DeepSeek-R1/blob/main/model.safetensors.index.json (tensor names, "
    "layer 61, dtypes and shapes: read from a per-tensor listing of the R1 release in a model report on GitHub)",
    "vllm/model_executor/models/deepseek_mtp.py (the MTP layer: enorm, hnorm, eh_proj, shared_head.{head,norm}, "
    "embed_tokens, mtp_block = the decoder layer)",
    "transformers src/transformers/models/deepseek_v3/modeling_deepseek_v3.py (per-layer names)",
    "llama.cpp conversion/deepseek.py DeepseekV2Model (skip_mtp, no supports_mtp_export)",
]
# the release's keys beside the sizes every DeepSeek-V3-shaped manifest shrinks alike (_deepseek.SHARED_CONFIG)
CONFIG = variant(
    SHARED_CONFIG,
    {
        "architectures": ["DeepseekV3ForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_deepseek.DeepseekV3Config",
            "AutoModel": "modeling_deepseek.DeepseekV3Model",
            "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
        },
        "aux_loss_alpha": 0.001,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "ep_size": 1,
        "initializer_range": 0.02,
        "max_position_embeddings": 163840,
        "model_type": "deepseek_v3",
        "moe_layer_freq": 1,
        "n_group": 2,
        "pretraining_tp": 1,
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
        },
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "seq_aux": True,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.33.1",
        "vocab_size": 129280,
    },
)
FORMS = {"fp8": fp8_release(keep=("eh_proj.weight", "shared_head.head.weight"))}
# llama.cpp's deepseek2 converter drops the MTP layer: its default file is the trunk, mtpq's --no-mtp file
LLAMA_CPP_MODE = {"--no-mtp": None}
DIFFERS = drops_mtp_layer(FORMS)
DRAFTS = True


def tensors(cfg: dict) -> dict[str, tuple[int, ...]]:
    return _tensors(cfg)
