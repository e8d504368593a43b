"""Step-3.7-Flash (stepfun-ai/Step-3.7-Flash, bf16; stepfun-ai/Step-3.7-Flash-FP8) as released:
Step3p7ForConditionalGeneration (model_type step3p7, remote code), Step-3.5-Flash's text model (its config under
``text_config``, model_type step3p5, the same tensor names at the top level: model.embed_tokens, model.layers.*,
model.norm, lm_head; 3 MTP layers past the trunk) beside a perception-encoder vision tower stored as
``vision_model.*`` (conv1, positional_embedding, ln_pre, transformer.resblocks.N.{ln_1, ln_2, attn.in_proj_weight,
attn.in_proj_bias, attn.out_proj, ls_1.gamma, ls_2.gamma, mlp.c_fc, mlp.c_proj}, vit_downsampler1/2) and the
``vit_large_projector``, which llama.cpp writes to its mmproj file, not to the text GGUF.

FP8 release: the routed experts only (block-scaled, weight_scale_inv), the tower bf16 (_step.py).
Shrunk as _step.py says; the tower: width 1536 -> 64, 47 -> 1 layer, 16 -> 4 heads, image 728 -> 28 (patch 14).
llama.cpp reads config.json as stored (LLAMA_CPP_RAW_CONFIG): transformers 5 knows step3p7 and rewrites the text
config into keys its Step35Model does not read (step35_flash.py says how).

Also read, from ATOM's tests (a Step3.7 config fixture; its location was not recorded, so not in SOURCES):
bos_token_id 0, eos_token_id [1, 2, 128007], quantization_config at the top level of the FP8 release.
"""

from . import _step

RELEASE = "stepfun-ai/Step-3.7-Flash"
SOURCES = [
    "llama.cpp conversion/step3.py (Step3p7ForConditionalGeneration registered for both Step35Model, the text "
    "GGUF, and Step3VLVisionModel, the mmproj: vision_model.vit_downsampler{1,2}, vit_large_projector, "
    "positional_embedding, ls_*.gamma, attn.in_proj_weight; understand_projector_stride, vision_config "
    "image_size / width / layers)",
    "transformers 5.24 models/step3p7/modeling_step3p7.py and conversion_mapping.py 'step3p7' / 'step3p5_vision' "
    "(the hub names: vision_model.conv1 (no bias), positional_embedding, ln_pre, transformer.resblocks.N.ln_1 / "
    "ln_2 / attn.in_proj_{weight,bias} / attn.out_proj / ls_1.gamma / ls_2.gamma / mlp.c_fc / mlp.c_proj, "
    "vit_downsampler1 / 2 (hidden -> 2x -> 4x, 3x3), vit_large_projector (4x width -> hidden, projector_bias); "
    "model.{embed_tokens,layers,norm} at the top; moe.down_proj.weight_scale_inv of the FP8 release)",
    "NVIDIA-NeMo/Megatron-Bridge tests (test_step37_config_load_and_roundtrip_preserve_step35_text_fields: the "
    "release's top-level keys architectures, auto_map, model_type step3p7, image_token_id 128001, "
    "understand_projector_stride 2, projector_bias false, vision_config {model_type perception_encoder, "
    "image_size 728, patch_size 14, width 1536, layers 47, heads 16}, text_config {architectures "
    "[Step3p5ForCausalLM], model_type step3p5, max_seq_len, llama3 rope_scaling, yarn_only_types})",
    *_step.SOURCES,
]
_VISION = {"model_type": "perception_encoder", "image_size": 28, "patch_size": 14, "width": 64, "layers": 1, "heads": 4}
CONFIG = {
    "architectures": ["Step3p7ForConditionalGeneration"],
    "auto_map": {
        "AutoConfig": "configuration_step3p7.Step3p7Config",
        "AutoProcessor": "processing_step3.Step3VLProcessor",
        "AutoModelForCausalLM": "modeling_step3p7.Step3p7ForConditionalGeneration",
    },
    "model_type": "step3p7",
    "image_token_id": 128001,
    "understand_projector_stride": 2,
    "projector_bias": False,
    "bos_token_id": 0,
    "eos_token_id": [1, 2, 128007],
    "torch_dtype": "bfloat16",
    "vision_config": _VISION,
    # Step-3.7's clamps: the last two MoE layers, routed (7.0) and shared (16.0) experts alike
    "text_config": _step.text_config(
        swiglu_limits_shared=[0.0] * (_step.N_TRUNK - 2) + [16.0, 16.0] + [0.0] * _step.N_MTP
    ),
}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
FORMS = {"bf16": None, "fp8": _step.fp8_routed_experts}
LLAMA_CPP_RAW_CONFIG = True
DRAFTS = True


def tensors(cfg: dict) -> dict[str, tuple[int, ...]]:
    text = cfg["text_config"]
    w, n = cfg["vision_config"]["width"], cfg["vision_config"]["layers"]
    patch, size = cfg["vision_config"]["patch_size"], cfg["vision_config"]["image_size"]
    mlp = int(round(w * 8960 / 1536))  # the tower's mlp_ratio
    out = _step.text_tensors(text)
    v = "vision_model."
    out |= {
        v + "conv1.weight": (w, 3, patch, patch),
        v + "positional_embedding": ((size // patch) ** 2, w),
        v + "ln_pre.weight": (w,),
        v + "ln_pre.bias": (w,),
        v + "vit_downsampler1.weight": (2 * w, w, 3, 3),
        v + "vit_downsampler1.bias": (2 * w,),
        v + "vit_downsampler2.weight": (4 * w, 2 * w, 3, 3),
        v + "vit_downsampler2.bias": (4 * w,),
        "vit_large_projector.weight": (text["hidden_size"], 4 * w),
    }
    for i in range(n):
        p = f"{v}transformer.resblocks.{i}."
        out |= {
            p + "ln_1.weight": (w,),
            p + "ln_1.bias": (w,),
            p + "ln_2.weight": (w,),
            p + "ln_2.bias": (w,),
            p + "attn.in_proj_weight": (3 * w, w),
            p + "attn.in_proj_bias": (3 * w,),
            p + "attn.out_proj.weight": (w, w),
            p + "attn.out_proj.bias": (w,),
            p + "ls_1.gamma": (w,),
            p + "ls_2.gamma": (w,),
            p + "mlp.c_fc.weight": (mlp, w),
            p + "mlp.c_fc.bias": (mlp,),
            p + "mlp.c_proj.weight": (w, mlp),
            p + "mlp.c_proj.bias": (w,),
        }
    return out
