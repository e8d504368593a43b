"""Tiny checkpoints that tests build for themselves (no network, fixed seeds).

Each builder writes an HF folder the way real checkpoints look on disk:
config.json, sharded safetensors with model.safetensors.index.json, a byte-level
BPE tokenizer, and the MTP tensors under the real checkpoint names. Weights come
from transformers' own model classes (random init, fixed seed) so that the
trunk is what transformers would load.

Sizes follow DESIGN.md's note: hidden 256, FFN/expert widths multiples of 256,
so K-quants apply to every weight row. Each family's config.json keys at those sizes
are data: ``configs/<family>.json`` beside the builders (release_config reads them;
``"vocab_size": null`` where the builder sets it from its tokenizer).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

CONFIGS = Path(__file__).parent / "configs"
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endfor %}<|assistant|>\n"
GLM_SPECIALS = [
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
]
_CORPUS = (
    "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"
    "The quick brown fox jumps over the lazy dog. 3 + 4 = 7, 12 * 12 = 144.\n"
    "for i in range(10):\n    print(i, i * i)\n# comment: import os, sys, json\n"
) * 20


def make_tokenizer(folder: Path, n_tokens: int = 300, specials: list[str] | None = None) -> int:
    """Train a byte-level BPE on a small corpus and save it as an HF fast tokenizer. Returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = specials if specials is not None else GLM_SPECIALS
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=n_tokens,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=specials[0] if specials else None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    return tok.get_vocab_size()


def save_checkpoint(folder: Path, config: dict, tensors: dict[str, torch.Tensor], n_shards: int = 2) -> None:
    """Write tensors as ``n_shards`` safetensors shards plus model.safetensors.index.json."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    names = sorted(tensors)
    per = math.ceil(len(names) / n_shards)
    weight_map = {}
    for i in range(n_shards):
        part = names[i * per : (i + 1) * per]
        fname = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
        "weight_map": weight_map,
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def release_config(family: str, **over) -> dict:
    """``configs/{family}.json`` (a release's config.json keys at tiny sizes, in its order) with ``over`` on top
    (new keys last)."""
    cfg = json.loads((CONFIGS / f"{family}.json").read_text())
    cfg.update(over)
    return cfg


def start_folder(folder: Path, specials: list[str] | None = None) -> tuple[Path, int]:
    """(the folder, created, now holding make_tokenizer's tokenizer of ``specials`` (default GLM's), its size)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return folder, make_tokenizer(folder, specials=specials)


def start_checkpoint(folder: Path, config, specials: list[str], seed: int, **over):
    """A hand-built family checkpoint's start: (folder, now holding its tokenizer; vocab = the tokenizer's
    size + 4 padding ids, as releases have; ``config(vocab, **over)``; the seeded generator for every tensor)."""
    folder, n_tokens = start_folder(folder, specials)
    vocab = n_tokens + 4
    return folder, vocab, config(vocab, **over), torch.Generator().manual_seed(seed)


def n_blocks(cfg: dict, with_mtp: bool) -> int:
    """The trunk layers, and with_mtp the MTP layers stored after them (model.layers.{N}...)."""
    return cfg["num_hidden_layers"] + (cfg["num_nextn_predict_layers"] if with_mtp else 0)


def finish_checkpoint(
    folder: Path, config: dict, tensors: dict[str, torch.Tensor], dtype: torch.dtype, n_shards: int
) -> Path:
    """save_checkpoint with every tensor cast to dtype; returns the folder."""
    save_checkpoint(folder, config, {k: v.to(dtype) for k, v in tensors.items()}, n_shards=n_shards)
    return folder


def block_checkpoint(
    folder: Path,
    config,
    specials: list[str],
    block_tensors,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    n_shards: int = 2,
    with_mtp: bool = True,
    embed: str = "model.embed_tokens.weight",
    norm=None,
    **over,
) -> Path:
    """A hand-built family checkpoint (start_checkpoint's tokenizer and ``config(vocab, **over)``): the embeddings
    ``embed``, the final norm (drawn by ``norm``, default rand_norm), lm_head unless the config ties it, then
    ``block_tensors(bid, cfg, gen)`` for every block (n_blocks: with_mtp, the MTP blocks too), in that order;
    saved by finish_checkpoint as ``dtype`` in ``n_shards`` shards. The families' builders are this with their
    own config, specials and block_tensors."""
    folder, vocab, cfg, gen = start_checkpoint(folder, config, specials, seed, **over)
    sd = rand_ends(cfg, gen, embed=embed, norm=norm)
    for bid in range(n_blocks(cfg, with_mtp)):
        sd.update(block_tensors(bid, cfg, gen))
    return finish_checkpoint(folder, cfg, sd, dtype, n_shards)


def rand_ends(
    cfg: dict,
    gen: torch.Generator,
    *,
    embed: str = "model.embed_tokens.weight",
    final_norm: str = "model.norm.weight",
    norm=None,
) -> dict[str, torch.Tensor]:
    """A hand-built trunk's ends, drawn in this order: the embeddings ``embed``, the final norm ``final_norm``
    (drawn by ``norm``, default rand_norm), then lm_head unless the config ties it; ``hidden_size`` wide."""
    vocab, h = cfg["vocab_size"], cfg["hidden_size"]
    sd = {embed: rand_weight(vocab, h, gen=gen), final_norm: (norm or rand_norm)(h, gen)}
    if not cfg.get("tie_word_embeddings"):
        sd["lm_head.weight"] = rand_weight(vocab, h, gen=gen)
    return sd


def hf_checkpoint(
    folder: Path,
    specials: list[str] | None,
    build,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    n_shards: int = 2,
    **over,
) -> Path:
    """A checkpoint of transformers' own classes: the folder with start_folder's tokenizer of ``specials``
    (None: GLM's), then ``build(seed, **over)`` -> (state dict, config.json dict), saved by finish_checkpoint
    as ``dtype`` in ``n_shards`` shards. The transformers-based builders are this with their own build."""
    folder, _ = start_folder(folder, specials)
    sd, config = build(seed, **over)
    return finish_checkpoint(folder, config, sd, dtype, n_shards)


def seeded_model(model_cls, cfg, seed: int):
    """(a transformers model of ``cfg`` in eval mode, random init under torch seed ``seed``, the generator
    (seed + 1) for every further tensor)."""
    torch.manual_seed(seed)
    return model_cls(cfg).eval(), torch.Generator().manual_seed(seed + 1)


def _has_norm(name: str) -> bool:
    return "norm" in name


def random_hf_state_dict(model_cls, cfg, seed: int, is_norm=_has_norm):
    """(state dict as save_pretrained writes it, generator for further tensors) of a seeded random
    transformers model whose 1-D parameters are made informative (random init leaves norms at 1, biases 0)."""
    model, gen = seeded_model(model_cls, cfg, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(rand_norm(p.numel(), gen) if is_norm(name) else 0.05 * torch.randn(p.numel(), generator=gen))
    return hf_state_dict(model), gen


def mtp_last_layer(model_cls, config_cls, params: dict, seed: int, *, head: bool = True, is_norm=_has_norm, **build):
    """(state dict, config.json dict) of a checkpoint whose MTP block is a real decoder layer of transformers'
    ``model_cls``: the model is built (random_hf_state_dict, with ``is_norm``) from ``config_cls(**params, **build)``
    with one layer more than ``params``' n trunk layers, so layer n carries exactly the names and shapes
    transformers gives a decoder layer; nextn_tensors adds its MTP-only tensors (``head``: its own embed_tokens
    and shared_head.head too). config.json says n layers, architectures ``model_cls``'s name."""
    n = params["num_hidden_layers"]
    cfg = config_cls(**{**params, "num_hidden_layers": n + 1, **build})
    sd, gen = random_hf_state_dict(model_cls, cfg, seed, is_norm)
    sd.update(nextn_tensors(cfg, n, gen, head=head))
    config = cfg.to_dict()
    config.update(num_hidden_layers=n, architectures=[model_cls.__name__])
    return sd, config


def nextn_tensors(cfg, n: int, gen: torch.Generator, head: bool = True) -> dict[str, torch.Tensor]:
    """The DeepSeek-style MTP layer's own tensors, stored as layer n; with head, its embed_tokens and
    shared_head.head too (checkpoints that tie them to the trunk's leave them out)."""
    h, p = cfg.hidden_size, f"model.layers.{n}."
    t = {
        p + "eh_proj.weight": rand_weight(h, 2 * h, gen=gen),
        p + "enorm.weight": rand_norm(h, gen),
        p + "hnorm.weight": rand_norm(h, gen),
        p + "shared_head.norm.weight": rand_norm(h, gen),
    }
    if head:
        t[p + "embed_tokens.weight"] = rand_weight(cfg.vocab_size, h, gen=gen)
        t[p + "shared_head.head.weight"] = rand_weight(cfg.vocab_size, h, gen=gen)
    return t


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    """The state dict as save_pretrained writes it (per-expert tensors, original names)."""
    import tempfile

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        out: dict[str, torch.Tensor] = {}
        for f in sorted(Path(d).glob("*.safetensors")):
            out.update(load_file(str(f)))
    return out


def rand_weight(*shape: int, gen: torch.Generator, scale: float = 0.02) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * scale


def rand_norm(n: int, gen: torch.Generator) -> torch.Tensor:
    return 1.0 + 0.1 * torch.randn(n, generator=gen)


def rand_mlp(p: str, ff: int, h: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A SwiGLU MLP's projections under ``p``, drawn in the order gate, up, down (what every builder draws)."""
    return {
        p + "gate_proj.weight": rand_weight(ff, h, gen=gen),
        p + "up_proj.weight": rand_weight(ff, h, gen=gen),
        p + "down_proj.weight": rand_weight(h, ff, gen=gen),
    }


def rand_experts(p: str, n_exp: int, ff: int, h: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """``n_exp`` routed experts one by one (``p + "{e}.gate_proj.weight"``, ...), expert by expert."""
    t = {}
    for e in range(n_exp):
        t.update(rand_mlp(f"{p}{e}.", ff, h, gen))
    return t


def rand_router(
    weight: str, n_exp: int, h: int, gen: torch.Generator, bias: str | None = None, scale: float = 0.05
) -> dict[str, torch.Tensor]:
    """A MoE router: its ``weight`` [n_exp, h], then (with ``bias``, a full name) its per-expert selection bias,
    ``scale`` N(0, 1)."""
    t = {weight: rand_weight(n_exp, h, gen=gen)}
    if bias:
        t[bias] = scale * torch.randn(n_exp, generator=gen)
    return t


def rand_moe(
    p: str,
    n_exp: int,
    ff: int,
    h: int,
    gen: torch.Generator,
    *,
    gate: str = "gate.weight",
    bias: str | None = None,
    shared: str | None = None,
    shared_ff: int = 0,
) -> dict[str, torch.Tensor]:
    """A routed MoE block under ``p``, drawn in the order router (``p + gate``, ``p + bias``: rand_router),
    experts (``p + "experts.{e}."``), then, with ``shared``, a ``shared_ff`` wide shared expert ``p + shared``."""
    t = rand_router(p + gate, n_exp, h, gen, bias=bias and p + bias)
    t.update(rand_experts(p + "experts.", n_exp, ff, h, gen))
    if shared:
        t.update(rand_mlp(p + shared, shared_ff, h, gen))
    return t


def rand_block_norms(p: str, h: int, gen: torch.Generator, norm=rand_norm) -> dict[str, torch.Tensor]:
    """A pre-norm decoder block's two norms under ``p``: input_layernorm, then post_attention_layernorm."""
    return {p + "input_layernorm.weight": norm(h, gen), p + "post_attention_layernorm.weight": norm(h, gen)}


def rand_qk_norms(p: str, hd: int, gen: torch.Generator, norm=rand_norm) -> dict[str, torch.Tensor]:
    """Per-head q and k norms under ``p`` (``p + "q_norm.weight"``, then k_norm), ``hd`` wide."""
    return {p + "q_norm.weight": norm(hd, gen), p + "k_norm.weight": norm(hd, gen)}


def rand_attention(
    p: str, h: int, nh: int, nkv: int, hd: int, gen: torch.Generator, dv: int | None = None
) -> dict[str, torch.Tensor]:
    """q/k/v/o projections under ``p`` (v and o ``dv`` wide per head, default ``hd``), drawn in that order."""
    dv = dv or hd
    return {
        p + "q_proj.weight": rand_weight(nh * hd, h, gen=gen),
        p + "k_proj.weight": rand_weight(nkv * hd, h, gen=gen),
        p + "v_proj.weight": rand_weight(nkv * dv, h, gen=gen),
        p + "o_proj.weight": rand_weight(h, nh * dv, gen=gen),
    }


def rand_nextn(p: str, h: int, gen: torch.Generator, *norms: str, norm=rand_norm) -> dict[str, torch.Tensor]:
    """An MTP layer's NextN tensors under ``p``: eh_proj, enorm, hnorm, then ``norms``, drawn in that order."""
    return {
        p + "eh_proj.weight": rand_weight(h, 2 * h, gen=gen),
        **{p + n + ".weight": norm(h, gen) for n in ("enorm", "hnorm", *norms)},
    }


def glm4moe_config(**over) -> dict:
    return release_config("glm4moe", **over)


def glm4moe(folder: Path, **over) -> Path:
    """A tiny GLM-4.5 checkpoint with one MTP layer (``model.layers.{n_layers}.*``).

    ``glm46=True`` omits the head's embed_tokens and shared_head.head, as GLM-4.6 does. seed (0), dtype
    (bfloat16), n_shards (2): hf_checkpoint's; other keywords: glm4moe_config()'s.
    """
    return hf_checkpoint(folder, None, _glm4moe_state, **over)


def _glm4moe_state(seed: int, glm46: bool = False, **config_over) -> tuple[dict[str, torch.Tensor], dict]:
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    cfg = Glm4MoeConfig(**glm4moe_config(**config_over))
    sd, gen = random_hf_state_dict(Glm4MoeForCausalLM, cfg, seed)
    sd.update(glm4moe_mtp_tensors(cfg, gen, glm46=glm46))
    config = cfg.to_dict()
    config["architectures"] = ["Glm4MoeForCausalLM"]
    return sd, config


def glm4moe_mtp_tensors(cfg, gen: torch.Generator, glm46: bool = False) -> dict[str, torch.Tensor]:
    """The MTP layer under GLM's checkpoint names: nextn tensors + a full MoE decoder block."""
    h, n = cfg.hidden_size, cfg.num_hidden_layers
    p = f"model.layers.{n}."
    hd, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    t = {
        **rand_nextn(p, h, gen, "shared_head.norm"),
        **rand_block_norms(p, h, gen),
        **rand_attention(p + "self_attn.", h, nh, nkv, hd, gen),
        **rand_router(
            p + "mlp.gate.weight", cfg.n_routed_experts, h, gen, p + "mlp.gate.e_score_correction_bias", 0.01
        ),
    }
    if cfg.attention_bias:
        for x, d in (("q", nh * hd), ("k", nkv * hd), ("v", nkv * hd)):
            t[p + f"self_attn.{x}_proj.bias"] = 0.05 * torch.randn(d, generator=gen)
    if cfg.use_qk_norm:
        t.update(rand_qk_norms(p + "self_attn.", hd, gen))
    ff = cfg.moe_intermediate_size
    t.update(rand_experts(p + "mlp.experts.", cfg.n_routed_experts, ff, h, gen))
    t.update(rand_mlp(p + "mlp.shared_experts.", ff * cfg.n_shared_experts, h, gen))
    if not glm46:
        t[p + "embed_tokens.weight"] = rand_weight(cfg.vocab_size, h, gen=gen)
        t[p + "shared_head.head.weight"] = rand_weight(cfg.vocab_size, h, gen=gen)
    return t


def to_fp8_block_scaled(folder: Path, block: int = 128, keep=None) -> None:
    """Rewrite every 2-D weight of a checkpoint as e4m3 with 128x128 ``weight_scale_inv`` tiles (DeepSeek style);
    ``keep(name)`` true: that weight stays as it is (a release's ``modules_to_not_convert``)."""
    _rewrite_fp8(folder, per_channel=False, block=block, keep=keep)


def to_fp8_per_channel(folder: Path, keep=None) -> None:
    """Rewrite every 2-D weight as e4m3 with a per-channel ``weight_scale`` [out, 1] (compressed-tensors style)."""
    _rewrite_fp8(folder, per_channel=True, block=0, keep=keep)


def _rewrite_fp8(folder: Path, per_channel: bool, block: int, keep=None) -> None:
    from safetensors.torch import load_file

    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(folder / shard))
        out = {}
        for name, w in tensors.items():
            quantizable = (
                w.dim() == 2
                and name.endswith(".weight")
                and "norm" not in name
                and "embed_tokens" not in name
                and "lm_head" not in name
                and ".mlp.gate." not in name
                and not (keep and keep(name))
            )
            if not quantizable:
                out[name] = w
                continue
            w = w.float()
            if per_channel:
                s = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / fp8_max
                out[name] = (w / s).to(torch.float8_e4m3fn)
                out[name + "_scale"] = s.to(torch.bfloat16)
            else:
                r, c = w.shape
                tr, tc = -(-r // block), -(-c // block)
                s = torch.zeros(tr, tc)
                q = torch.empty_like(w)
                for i in range(tr):
                    for j in range(tc):
                        tile = w[i * block : (i + 1) * block, j * block : (j + 1) * block]
                        s[i, j] = tile.abs().max().clamp(min=1e-12) / fp8_max
                        q[i * block : (i + 1) * block, j * block : (j + 1) * block] = tile / s[i, j]
                out[name] = q.to(torch.float8_e4m3fn)
                out[name + "_scale_inv"] = s
            index["weight_map"][name + ("_scale" if per_channel else "_scale_inv")] = shard
        save_file(out, str(folder / shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index, indent=2))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = (
        {"quant_method": "compressed-tensors", "format": "float-quantized"}
        if per_channel
        else {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [block, block]}
    )
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))


def copy_head(folder: Path, n_layers: int = 2) -> Path:
    """Rewrite the MTP layer of a tiny GLM checkpoint into a "copy head" that drafts something useful.

    Its eh_proj passes hnorm(h_t) through, its block is shrunk towards identity and its
    output head is the token embedding, so it predicts x_t again: right whenever greedy
    decoding of the random trunk falls into a 2-cycle, wrong elsewhere -- a mix of
    accepted and rejected drafts, including runs of several accepted ones.
    """
    from safetensors.torch import load_file

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    embed = None
    for shard in shards:
        embed = load_file(str(folder / shard)).get("model.embed_tokens.weight", embed)
    p = f"model.layers.{n_layers}."
    for shard in shards:
        t = load_file(str(folder / shard))
        for name in list(t):
            if name == p + "eh_proj.weight":
                h = t[name].shape[0]
                t[name] = torch.cat([0.3 * t[name][:, :h], torch.eye(h)], dim=1)
            elif name.startswith(p) and (name.endswith("o_proj.weight") or "down_proj" in name):
                t[name] = 0.1 * t[name]
            elif name == p + "shared_head.head.weight":
                t[name] = embed.clone()
        save_file(t, str(folder / shard), metadata={"format": "pt"})
    return folder
