"""DeepSeek-V4-Flash (deepseek-ai/DeepSeek-V4-Flash; DeepSeek-V4-Pro has the same layout) as released:
``DeepseekV4ForCausalLM``, 43 layers + 1 MTP layer stored under ``mtp.0.``, in DeepSeek's own tensor names
(``embed``, ``layers.N.attn.wq_a``, ``layers.N.ffn.experts.E.w1``, ...: not transformers' names).

The release ships one encoding only, mixed: the attention projections, the shared experts, the indexer's
``wq_b`` and the head's ``e_proj`` / ``h_proj`` in FP8 (e4m3 ``weight`` + ``scale`` in UE8M0 = ``F8_E8M0``,
one per 128x128 tile); the routed experts in FP4 (``weight`` I8 [out, in/2], two E2M1 codes per byte, low
nibble first, + ``scale`` F8_E8M0 [out, in/32]); the hyper-connection tensors (``hc_*``), ``attn_sink``,
the compressors' ``ape`` and the routers' ``bias`` in F32; the hash layers' ``tid2eid`` in I64; everything
else (embeddings, head, every norm, router weights, compressor ``wkv`` / ``wgate``, indexer ``weights_proj``)
in BF16.

Layer kinds: ``compress_ratios[i]`` (one per layer, the MTP layer's last) is 0 (sliding window only), 4
(a compressor with overlapping windows, twice as wide, plus the lightning indexer with its own compressor) or
128 (a compressor); the first ``num_hash_layers`` layers route by ``ffn.gate.tid2eid`` [vocab, top-k], the
others by score with ``ffn.gate.bias``. The MTP layer is a full layer plus ``e_proj``, ``h_proj``, ``enorm``,
``hnorm``, ``norm`` and its own output hyper-connection ``hc_head_{fn,base,scale}``; it shares the trunk's
``embed`` and ``head``.

Shrunk: hidden 4096 -> 256, layers 43 -> 4 (+1 MTP; compress_ratios [0, 0, 4, 128] + [0] for the MTP layer,
as the release's ends with 0), heads 64 -> 4, head_dim 512 -> 256 (kept apart from index_head_dim 128, as
released: llama.cpp's KV cache takes a head_dim equal to it for an indexer's and builds a Hadamard rotation that
crashes the MTP draft context), q_lora_rank 1024 -> 256, o_groups 8 -> 2, o_lora_rank 1024 -> 128,
index_n_heads 64 -> 4, experts 256 -> 4 (top-6 -> top-2), moe_intermediate 2048 -> 256. Every other key as
released (num_hash_layers 3, hc_mult 4, qk_rope_head_dim 64, index_head_dim 128).

Also read, from public DeepSeek-V4 loaders' dtype notes whose location was not recorded (so not in SOURCES):
tid2eid I64, attn_sink / hc_* / gate.bias F32, router gate BF16.
"""

import json
from pathlib import Path

import torch

from tests.builders.tiny_deepseek2 import SPECIALS  # noqa: F401  (the tokenizer's: DeepSeek's BOS/EOS, BOS added to every prompt)

from . import LlamaCppWritesOurs
from ._deepseek import FP8_UE8M0_CONFIG

RELEASE = "deepseek-ai/DeepSeek-V4-Flash"
SOURCES = [
    "https://huggingface.co/deepseek-ai/DeepSeek-V4-Flash/blob/main/config.json (keys and values; mirrored "
    "verbatim in public test fixtures, e.g. a Rust DSV4_FLASH_CONFIG: 43 layers, compress_ratios of 44 entries)",
    "https://huggingface.co/deepseek-ai/DeepSeek-V4-Flash/blob/main/inference/model.py (tensor names, shapes and "
    "stored dtypes: Attention, Compressor, Indexer, Gate, MoE, Block, MTPBlock with its own hc_head_fn/base/scale)",
    "https://huggingface.co/deepseek-ai/DeepSeek-V4-Flash/blob/main/model.safetensors.index.json (per-layer tensor "
    "counts 1565 / 1569 / 1576 for compress ratio 0 / 128 / 4, 1575 under mtp.0.; as counted by public loaders)",
    "vllm/model_executor/models/deepseek_v4_mtp.py (mtp.{i}. names: e_proj, h_proj, enorm, hnorm, norm, "
    "hc_head_fn/base/scale; an expert's .scale read as MXFP4 scales, the others' as FP8 block scales)",
    "llama.cpp conversion/deepseek.py DeepseekV4Model (the names it maps; I8 FP4 + F8_E8M0 scales it repacks)",
]
CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "expert_dtype": "fp4",
    "hc_eps": 1e-06,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 256,
    "index_head_dim": 128,
    "index_n_heads": 4,
    "index_topk": 512,
    "initializer_range": 0.02,
    "max_position_embeddings": 1048576,
    "model_type": "deepseek_v4",
    "moe_intermediate_size": 256,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 4,
    "num_hash_layers": 3,
    "num_key_value_heads": 1,
    "num_nextn_predict_layers": 1,
    "o_groups": 2,
    "o_lora_rank": 128,
    "q_lora_rank": 256,
    "qk_rope_head_dim": 64,
    "quantization_config": FP8_UE8M0_CONFIG,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "sliding_window": 128,
    "swiglu_limit": 10.0,
    "tie_word_embeddings": False,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.57.1",
    "use_cache": True,
    "vocab_size": 129280,
    "compress_rope_theta": 160000,
    "compress_ratios": [0, 0, 4, 128, 0],
}

# The release's stored dtypes, by name (everything not listed: BF16)
FP8 = (
    "attn.wq_a.weight",
    "attn.wq_b.weight",
    "attn.wkv.weight",
    "attn.wo_a.weight",
    "attn.wo_b.weight",
    "attn.indexer.wq_b.weight",
    "ffn.shared_experts.w1.weight",
    "ffn.shared_experts.w2.weight",
    "ffn.shared_experts.w3.weight",
    "e_proj.weight",
    "h_proj.weight",
)
F32 = (
    "hc_attn_fn",
    "hc_attn_base",
    "hc_attn_scale",
    "hc_ffn_fn",
    "hc_ffn_base",
    "hc_ffn_scale",
    "hc_head_fn",
    "hc_head_base",
    "hc_head_scale",
    "attn.attn_sink",
    "compressor.ape",
    "ffn.gate.bias",
)


def tensors(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, v, hc = cfg["hidden_size"], cfg["vocab_size"], cfg["hc_mult"]
    nh, d, ql = cfg["num_attention_heads"], cfg["head_dim"], cfg["q_lora_rank"]
    og, ol = cfg["o_groups"], cfg["o_lora_rank"]
    ne, ff, top = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["num_experts_per_tok"]
    ih, idd = cfg["index_n_heads"], cfg["index_head_dim"]
    n, mix = cfg["num_hidden_layers"], (2 + hc) * hc
    out = {
        "embed.weight": (v, h),
        "norm.weight": (h,),
        "head.weight": (v, h),
        "hc_head_fn": (hc, hc * h),
        "hc_head_base": (hc,),
        "hc_head_scale": (1,),
    }
    for L in range(n + cfg["num_nextn_predict_layers"]):
        p = f"layers.{L}." if L < n else f"mtp.{L - n}."
        ratio = cfg["compress_ratios"][L]
        out |= {
            p + "attn_norm.weight": (h,),
            p + "ffn_norm.weight": (h,),
            p + "hc_attn_fn": (mix, hc * h),
            p + "hc_attn_base": (mix,),
            p + "hc_attn_scale": (3,),
            p + "hc_ffn_fn": (mix, hc * h),
            p + "hc_ffn_base": (mix,),
            p + "hc_ffn_scale": (3,),
            p + "attn.attn_sink": (nh,),
            p + "attn.wq_a.weight": (ql, h),
            p + "attn.q_norm.weight": (ql,),
            p + "attn.wq_b.weight": (nh * d, ql),
            p + "attn.wkv.weight": (d, h),
            p + "attn.kv_norm.weight": (d,),
            p + "attn.wo_a.weight": (og * ol, nh * d // og),
            p + "attn.wo_b.weight": (h, og * ol),
        }
        if ratio:
            coff = 2 if ratio == 4 else 1  # ratio 4 compresses overlapping windows: twice as wide
            q = p + "attn.compressor."
            out |= {
                q + "ape": (ratio, coff * d),
                q + "wkv.weight": (coff * d, h),
                q + "wgate.weight": (coff * d, h),
                q + "norm.weight": (d,),
            }
        if ratio == 4:
            q = p + "attn.indexer."
            out |= {
                q + "wq_b.weight": (ih * idd, ql),
                q + "weights_proj.weight": (ih, h),
                q + "compressor.ape": (4, 2 * idd),
                q + "compressor.wkv.weight": (2 * idd, h),
                q + "compressor.wgate.weight": (2 * idd, h),
                q + "compressor.norm.weight": (idd,),
            }
        out[p + "ffn.gate.weight"] = (ne, h)
        if L < cfg["num_hash_layers"]:
            out[p + "ffn.gate.tid2eid"] = (v, top)
        else:
            out[p + "ffn.gate.bias"] = (ne,)
        for e in range(ne):
            q = f"{p}ffn.experts.{e}."
            out |= {q + "w1.weight": (ff, h), q + "w2.weight": (h, ff), q + "w3.weight": (ff, h)}
        sff = ff * cfg["n_shared_experts"]
        out |= {
            p + "ffn.shared_experts.w1.weight": (sff, h),
            p + "ffn.shared_experts.w2.weight": (h, sff),
            p + "ffn.shared_experts.w3.weight": (sff, h),
        }
        if L >= n:  # the MTP layer's own tensors
            out |= {
                p + "e_proj.weight": (h, h),
                p + "h_proj.weight": (h, h),
                p + "enorm.weight": (h,),
                p + "hnorm.weight": (h,),
                p + "norm.weight": (h,),
                p + "hc_head_fn": (hc, hc * h),
                p + "hc_head_base": (hc,),
                p + "hc_head_scale": (1,),
            }
    return out


def fp8_ue8m0(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes and one power-of-two scale per block x block tile (UE8M0, as the release's ``scale_fmt``)."""
    r, c = w.shape
    tr, tc = -(-r // block), -(-c // block)
    pad = torch.zeros(tr * block, tc * block)
    pad[:r, :c] = w.float()
    tiles = pad.reshape(tr, block, tc, block)
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=2.0**-100)
    e = torch.ceil(torch.log2(amax / torch.finfo(torch.float8_e4m3fn).max)).clamp(-127, 127)
    q = (tiles / torch.exp2(e)[:, None, :, None]).reshape(tr * block, tc * block)[:r, :c]
    return q.to(torch.float8_e4m3fn), (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def as_released(folder: Path) -> None:
    """The bf16 tiny checkpoint in the release's mixed encoding (see the module docstring)."""
    from safetensors.torch import load_file, save_file

    from tests.builders.tiny_deepseek2 import use_bos
    from tests.builders.tiny_mimo2 import to_mxfp4

    use_bos(folder)
    cfg = json.loads((folder / "config.json").read_text())
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    gen = torch.Generator().manual_seed(1)
    for shard in sorted(set(index["weight_map"].values())):
        t = load_file(str(folder / shard))
        for name in sorted(t):
            base = name.removesuffix(".weight")
            if name.endswith(FP8):
                t[name], t[base + ".scale"] = fp8_ue8m0(t[name])
            elif ".ffn.experts." in name:
                packed, scale = to_mxfp4(t[name])
                t[name], t[base + ".scale"] = packed.view(torch.int8), scale.view(torch.float8_e8m0fnu)
            elif name.endswith(F32):
                t[name] = t[name].float()
            elif name.endswith("tid2eid"):
                t[name] = torch.randint(0, cfg["n_routed_experts"], t[name].shape, generator=gen, dtype=torch.int64)
            if base + ".scale" in t:
                index["weight_map"][base + ".scale"] = shard
        save_file(t, str(folder / shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index, indent=2))


FORMS = {"fp8": as_released}  # the only form DeepSeek ships: FP8 + FP4 experts (no bf16 release)
REFUSES = {
    ("fp8", None): LlamaCppWritesOurs(
        "one GGUF cannot hold both the trunk's and the head's output hyper-connection (output_hc_*): llama.cpp's "
        "converter drops the head by default (its file equals mtpq's --no-mtp) and writes it only into its own --mtp "
        "file (equal to mtpq's --mtp-only); mtpq refuses to write the head beside the trunk's output_hc_* instead of "
        "its own",
        "--no-mtp",
    )
}
DRAFTS = True
