"""A tiny DeepSeek-V3 / R1 checkpoint (``DeepseekV3ForCausalLM``) with its MTP layer.

Weights come from transformers' own DeepseekV3ForCausalLM (random init, fixed
seed). The model is built with ``num_hidden_layers + 1`` layers and saved with
``num_hidden_layers`` in config.json: the extra (MoE) layer becomes the MTP
block ``model.layers.{n}.*``, so its MLA attention and MoE tensors carry exactly
the names and shapes transformers gives a real decoder layer. The MTP-only
tensors (``eh_proj``, ``enorm``, ``hnorm``, ``embed_tokens``,
``shared_head.{head,norm}``) are added under DeepSeek-V3's checkpoint names.

Sizes keep weight rows multiples of 256 where the architecture allows
(hidden 256, q_lora_rank 256, kv_lora_rank 256, 4 heads x v_head_dim 64,
FFN/expert widths 256/512); the split ``attn_k_b`` rows are qk_nope_head_dim
long (64 here, 128 in the real model), never a multiple of 256.
The config mirrors DeepSeek-V3's: sigmoid router with correction bias
(``noaux_tc``), expert groups, yarn RoPE with ``mscale_all_dim``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.builders.tiny import hf_checkpoint, mtp_last_layer, release_config

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
SPECIALS = [EOS, BOS, "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]  # make_tokenizer: first = eos


def deepseek_v3_config(**over) -> dict:
    """configs/deepseek_v3.json: DeepSeek-V3's config.json keys of an MLA + MoE model at tiny sizes. Transformers'
    config classes keep unknown keys (num_nextn_predict_layers, scoring_func, topk_method, ...) in the order given:
    the file keeps theirs."""
    return release_config("deepseek_v3", **over)


def deepseek_v3(folder: Path, **over) -> Path:
    """Write the tiny checkpoint to ``folder`` and return it.

    ``mtp_head_tensors=False`` leaves out the MTP layer's ``embed_tokens`` and
    ``shared_head.head`` (checkpoints that tie them to the trunk's). seed (0), dtype (bfloat16), n_shards (2):
    hf_checkpoint's; other keywords: deepseek_v3_config()'s.
    """
    return use_bos(hf_checkpoint(folder, SPECIALS, _state, **over))


def _state(seed: int, mtp_head_tensors: bool = True, **config_over) -> tuple[dict[str, torch.Tensor], dict]:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    params = deepseek_v3_config(**config_over)
    return mtp_last_layer(DeepseekV3ForCausalLM, DeepseekV3Config, params, seed, head=mtp_head_tensors)


def use_bos(folder: Path) -> Path:
    """BOS is added to every prompt, as DeepSeek-V3's tokenizer does (the folder's tokenizer rewritten; returns it).

    transformers bakes that into tokenizer.json's post-processor; gguf-py (and so
    llama.cpp's converter) reads ``add_bos_token`` from tokenizer_config.json.
    """
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"),
        bos_token=BOS,
        eos_token=EOS,
        add_bos_token=True,
        add_eos_token=False,
    )
    fast.chat_template = (folder / "chat_template.jinja").read_text()
    fast.save_pretrained(str(folder))
    path = folder / "tokenizer_config.json"
    tc = json.loads(path.read_text())
    tc.update(add_bos_token=True, add_eos_token=False)
    path.write_text(json.dumps(tc, indent=2, ensure_ascii=False))
    return folder


def trunk_copy_head(folder: Path, embed_rms: float = 0.02) -> Path:
    """Rewrite the MTP layer of a ONE-layer tiny DeepSeek checkpoint into a copy of the trunk, so that it drafts.

    The head's block gets layer 0's weights, ``eh_proj`` passes ``enorm(E[x_{t+1}])`` through and ignores
    h_t, and ``enorm`` scales embeddings to the rms random init gives them (0.02): the head then runs the
    trunk's only layer on x_1..x_{t+1} (without x_0, and with each embedding renormalised), so it
    predicts roughly what the trunk will predict after x_{t+1} -- right often (~60 % on the test
    prompts), wrong often enough, with runs of several accepted drafts. The head's own embedding and
    output are dropped (transformers' MTP ties them to the trunk's anyway).
    """
    from safetensors.torch import load_file, save_file

    cfg = json.loads((folder / "config.json").read_text())
    if cfg["num_hidden_layers"] != 1 or cfg["first_k_dense_replace"] != 0:
        raise ValueError("trunk_copy_head needs a one-layer MoE trunk (num_hidden_layers=1, first_k_dense_replace=0)")
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    trunk = {}
    for shard in shards:
        trunk.update({k: v for k, v in load_file(str(folder / shard)).items() if k.startswith("model.layers.0.")})
    p = "model.layers.1."
    for shard in shards:
        t = load_file(str(folder / shard))
        for name in list(t):
            if not name.startswith(p):
                continue
            rest = name[len(p) :]
            if rest in ("embed_tokens.weight", "shared_head.head.weight"):
                del t[name]
                del index["weight_map"][name]
            elif "model.layers.0." + rest in trunk:
                t[name] = trunk["model.layers.0." + rest].clone()
            elif rest == "eh_proj.weight":
                h = t[name].shape[0]
                t[name] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1).to(t[name].dtype)
            elif rest == "enorm.weight":
                t[name] = torch.full_like(t[name], embed_rms)
        save_file(t, str(folder / shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index, indent=2))
    return folder
