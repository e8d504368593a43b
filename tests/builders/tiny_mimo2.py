"""A tiny MiMo-V2-Flash checkpoint (``MiMoV2FlashForCausalLM``) with its MTP layers under ``model.mtp.layers.{i}``.

Names and config keys follow the release (XiaomiMiMo/MiMo-V2-Flash's config.json as
stored) as llama.cpp's converter (conversion/mimo.py) and gguf-py's tensor map read
them: ``hybrid_layer_pattern`` (1 = sliding window), ``swa_*`` head settings,
q/k ``head_dim`` != ``v_head_dim``, attention sinks on sliding layers, a dense first
layer then MoE layers with per-expert tensors, and 3 MTP layers (sliding attention,
dense MLP) with ``eh_proj``/``enorm``/``hnorm``, ``pre_mlp_layernorm`` (the MTP block's FFN norm, as the
releases name it; the trunk's is ``post_attention_layernorm``) and ``final_layernorm``.
Weights are random (fixed seed).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.builders.tiny import (
    finish_checkpoint,
    rand_attention,
    rand_block_norms,
    rand_ends,
    rand_mlp,
    rand_moe,
    rand_nextn,
    release_config,
    start_checkpoint,
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
N_MTP = 3  # MTP layers under model.mtp.layers.{i} (config.json does not count them)


def config(vocab: int, **over) -> dict:
    return release_config("mimo2", vocab_size=vocab, **over)


def block_tensors(
    p: str, swa: bool, moe: bool, gen: torch.Generator, cfg: dict | None = None
) -> dict[str, torch.Tensor]:
    """One block's tensors, shaped by ``cfg``'s head counts and widths (the module's defaults without one)."""
    cfg = cfg or config(0)
    n_head, d, dv = cfg["num_attention_heads"], cfg["head_dim"], cfg["v_head_dim"]
    n_kv = cfg["swa_num_key_value_heads" if swa else "num_key_value_heads"]
    h, ff, moe_ff, n_exp = (
        cfg["hidden_size"],
        cfg["intermediate_size"],
        cfg["moe_intermediate_size"],
        cfg["n_routed_experts"],
    )
    t = rand_block_norms(p, h, gen) | rand_attention(p + "self_attn.", h, n_head, n_kv, d, gen, dv=dv)
    if swa:
        t[p + "self_attn.attention_sink_bias"] = 0.5 * torch.randn(n_head, generator=gen)
    if moe:
        t.update(rand_moe(p + "mlp.", n_exp, moe_ff, h, gen, bias="gate.e_score_correction_bias"))
    else:
        t.update(rand_mlp(p + "mlp.", ff, h, gen))
    return t


def mimo2(
    folder: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32, n_shards: int = 2, n_mtp: int = N_MTP, **over
) -> Path:
    folder, _, cfg, gen = start_checkpoint(folder, config, SPECIALS, seed, **over)
    sd = rand_ends(cfg, gen)
    for bid in range(cfg["num_hidden_layers"]):  # hybrid_layer_pattern 1: sliding window; moe_layer_freq 1: MoE
        swa, moe = cfg["hybrid_layer_pattern"][bid] == 1, cfg["moe_layer_freq"][bid] == 1
        sd.update(block_tensors(f"model.layers.{bid}.", swa, moe, gen, cfg))
    for i in range(n_mtp):
        p = f"model.mtp.layers.{i}."
        block = block_tensors(p, True, False, gen, cfg)  # as released: the MTP block's FFN norm is pre_mlp_layernorm
        block[p + "pre_mlp_layernorm.weight"] = block.pop(p + "post_attention_layernorm.weight")
        sd.update(block)
        sd.update(rand_nextn(p, cfg["hidden_size"], gen, "final_layernorm"))
    return finish_checkpoint(folder, cfg, sd, dtype, n_shards)


def _pop_dequantized(tensors: dict, index: dict, name: str) -> torch.Tensor:
    """Take FP8 weight ``name`` and its 128x128 weight_scale_inv out of a shard's tensors (and the scale out of the
    index) -> its float32 values."""
    from tests.helpers.familycheck import dequant_block_scaled

    pair = {name: tensors.pop(name), name + "_scale_inv": tensors.pop(name + "_scale_inv")}
    del index["weight_map"][name + "_scale_inv"]
    return dequant_block_scaled(pair)[name]


def v25_heads(tp: int) -> dict:
    """Config overrides giving MiMo-V2.5's head layout at tiny size: the fused qkv_proj is sharded over
    ``num_key_value_heads`` ranks (V2.5: 4 full-attention KV heads, 8 sliding; V2.5-Pro: 8 and 8). With 16 heads
    of 48 (rope 16, even for llama.cpp's CPU rope) and values of 32, the per-rank scale tiles of 4 and 8 ranks
    differ in count, as in the releases, so llama.cpp's converter (which tries 8 ranks, then 4) reads them too."""
    return dict(
        num_attention_heads=16,
        swa_num_attention_heads=16,
        head_dim=48,
        swa_head_dim=48,
        num_key_value_heads=tp,
        swa_num_key_value_heads=8,
    )


def fp8_rank_tiles(ranks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 of the rows of ``ranks`` stacked, each rank quantized in its own 128x128 tiles (its last tile row short,
    so the scale has sum(ceil(rows_r / 128)) rows); one rank is the usual block-scaled FP8."""
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    q, s = [], []
    for rows in ranks:
        rows = rows.float()
        for a in range(0, rows.shape[0], 128):
            tile_rows = rows[a : a + 128]
            scales = torch.stack([c.abs().max().clamp(min=1e-12) / fp8_max for c in tile_rows.split(128, 1)])
            s.append(scales)
            q.append(tile_rows / scales.repeat_interleave(128)[: rows.shape[1]])
    return torch.cat(q).to(torch.float8_e4m3fn), torch.stack(s)


def as_v25_fused_fp8(folder: Path, tp: int | None = None) -> Path:
    """Rewrite a mimo2() checkpoint in place into MiMo-V2.5's release layout (``MiMoV2ForCausalLM``): every
    2-D weight FP8 with 128x128 ``weight_scale_inv`` tiles, and q/k/v of each block fused into one
    ``self_attn.qkv_proj`` whose rows are sharded over ``tp`` tensor-parallel ranks (default: config.json's
    num_key_value_heads, as the releases are) -- rank r holds [Q_r | K_r | V_r], quantized in its own 128-row
    tiles (so the scale has tp x ceil(rows/tp/128) rows), as llama.cpp's conversion/mimo.py reads the release.
    Plus a vision and an audio tower beside the text tensors (llama.cpp's mmproj file takes those)."""
    import json

    from safetensors.torch import load_file, save_file

    from tests.builders.tiny import to_fp8_block_scaled

    cfg = json.loads((folder / "config.json").read_text())
    tp = tp or cfg["num_key_value_heads"]
    to_fp8_block_scaled(folder)
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for shard in sorted(set(index["weight_map"].values())):
        t = load_file(str(folder / shard))
        for name in [n for n in t if n.endswith("self_attn.q_proj.weight")]:
            p = name[: -len("q_proj.weight")]
            q, k, v = (_pop_dequantized(t, index, p + x + "_proj.weight") for x in "qkv")
            for x in "qkv":
                del index["weight_map"][p + x + "_proj.weight"]
            ranks = [torch.cat([m.chunk(tp)[r] for m in (q, k, v)]) for r in range(tp)]
            t[p + "qkv_proj.weight"], t[p + "qkv_proj.weight_scale_inv"] = fp8_rank_tiles(ranks)
            index["weight_map"][p + "qkv_proj.weight"] = index["weight_map"][p + "qkv_proj.weight_scale_inv"] = shard
        save_file(t, str(folder / shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index, indent=2))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["MiMoV2ForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    from tests.helpers.familycheck import add_tensors

    gen = torch.Generator().manual_seed(5)
    add_tensors(
        folder,
        {
            "visual.patch_embed.proj.weight": torch.randn(32, 48, generator=gen),
            "audio_encoder.projection.mlp.0.weight": torch.randn(32, 32, generator=gen),
            "speech_embeddings.0.weight": torch.randn(8, 32, generator=gen),
        },
    )
    return folder


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MXFP4 of w [rows, cols]: per group of 32 an E8M0 exponent byte (scale 2^(e-127), the group's
    maximum at most 6 after scaling) and E2M1 codes packed two per byte, element 2i in the low nibble
    -> (packed uint8 [rows, cols/2], scale uint8 [rows, cols/32])."""
    rows, cols = w.shape
    groups = w.float().reshape(rows, cols // 32, 32)
    amax = groups.abs().amax(-1).clamp(min=2.0**-100)
    e = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    q = groups / torch.exp2(e)[..., None]
    codes = (q[..., None] - E2M1).abs().argmin(-1).to(torch.uint8).reshape(rows, cols)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, (e + 127).to(torch.uint8)


def mxfp4_values(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The values an MXFP4 pair stands for (OCP's definition: E2M1 code x 2^(e-127)), float32."""
    codes = torch.stack((packed & 15, packed >> 4), dim=-1).reshape(packed.shape[0], -1).long()
    return (E2M1[codes].reshape(packed.shape[0], -1, 32) * torch.exp2(scale.float() - 127)[..., None]).reshape(
        packed.shape[0], -1
    )


def as_mxfp4_experts(folder: Path) -> Path:
    """Rewrite the routed experts of an as_v25_fused_fp8() checkpoint into MXFP4 (``weight`` packed uint8 plus a
    uint8 ``weight_scale``; the rest stays FP8), ``quantization_config.store_dtype: mxfp4``, as llama.cpp's
    conversion/mimo.py reads MiMo-V2.5's MXFP4 checkpoints."""
    import json
    import re

    from safetensors.torch import load_file, save_file

    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    expert = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
    for shard in sorted(set(index["weight_map"].values())):
        t = load_file(str(folder / shard))
        for name in [n for n in t if expert.match(n)]:
            t[name], t[name + "_scale"] = to_mxfp4(_pop_dequantized(t, index, name))
            index["weight_map"][name + "_scale"] = shard
        save_file(t, str(folder / shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index, indent=2))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {**cfg["quantization_config"], "store_dtype": "mxfp4", "mxfp4_block_size": 32}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder
