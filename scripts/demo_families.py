"""The two demo families of ``scripts/train_demo.py``: what differs between a tiny GLM-4.5 and a
tiny Qwen3.5 with one MTP layer. The corpus, tokenizer training, training loop, acceptance and
saving are the driver's; a family gives its special tokens, config, model (trunk + MTP layer),
the MTP layer's checkpoint tensors and an independent reload check.

Both heads compute (DESIGN.md), on the trunk's hidden state AFTER its final norm:
    u = proj([norm_e(Emb[x_{t+1}]); norm_h(h_t)]),  g = Block(u),  logits = head(norm_out(g))
GLM names them enorm / hnorm / eh_proj / shared_head.norm under ``model.layers.{n}``; Qwen3.5 names
them pre_fc_norm_embedding / pre_fc_norm_hidden / fc / norm under ``mtp.`` (the block: ``mtp.layers.0``,
one gated full-attention layer, whatever the trunk's layer pattern).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn

# llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEFAULT regexes (src/llama-vocab.cpp), applied in order, each isolating its matches
LLAMA_DEFAULT_PRE = [
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
]


class DemoModel(nn.Module):
    """A transformers causal LM (``self.lm``) plus an MTP layer (``self.mtp``) and the shared helpers."""

    lm: nn.Module
    mtp: nn.Module

    def trunk(self, ids: torch.Tensor, want_pre: bool = False):
        """(post-norm hidden, pre-norm hidden or None) for ``ids`` [B, S]."""
        seen: list[torch.Tensor] = []
        hook = self.lm.model.norm.register_forward_hook(lambda m, i, o: seen.append(i[0])) if want_pre else None
        try:
            post = self.lm.model(input_ids=ids).last_hidden_state
        finally:
            if hook is not None:
                hook.remove()
        return post, (seen[0] if want_pre else None)

    def head_logits(self, h: torch.Tensor, next_ids: torch.Tensor, first_pos: int = 1) -> torch.Tensor:
        """Head logits for entries (h_t, x_{t+1}); entry j sits at position first_pos + j (that of x_{t+1})."""
        pos = torch.arange(first_pos, first_pos + next_ids.shape[1]).unsqueeze(0)
        rope = self.lm.model.rotary_emb(h, pos)
        return self.lm.lm_head(self.mtp(h, self.lm.model.embed_tokens(next_ids), rope))


def _config(config_cls, family: str, vocab: int, eos: list[int]):
    """``config_cls`` of ``demo_configs/{family}.json`` (the trunk sizes the two demo families share: hidden 256
    (FFN 768), 4 layers of 4 query / 2 KV heads of 64, an untied head; then the family's own keys), stopping on
    ``eos``, run with sdpa."""
    keys = json.loads((Path(__file__).parent / "demo_configs" / f"{family}.json").read_text())
    cfg = config_cls(vocab_size=vocab, **keys, eos_token_id=eos, pad_token_id=eos[0])
    cfg._attn_implementation = "sdpa"
    return cfg


def _shell(lm: nn.Module) -> DemoModel:
    """A DemoModel around a reloaded trunk, so the driver's greedy()/trunk() run on it."""
    shell = DemoModel()
    shell.lm = lm
    return shell


# --------------------------------------------------------------------------- GLM-4.5


def _with_head(lm: nn.Module, mtp: nn.Module, norm_weight: torch.Tensor) -> DemoModel:
    """A fresh model to train: ``lm`` and its MTP head ``mtp`` (initialised as the trunk's layers), the trunk's
    final norm weight set to ``norm_weight``."""
    model = DemoModel()
    model.lm, model.mtp = lm, mtp
    model.mtp.apply(lm._init_weights)
    with torch.no_grad():
        lm.model.norm.weight.copy_(norm_weight)
    return model


class Glm4Moe:
    name = "glm4moe"
    architecture = "Glm4MoeForCausalLM"
    specials = [
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
    stop_tokens = ("<|endoftext|>", "<|user|>", "<|observation|>")
    chat_template = (
        "[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    # f32 in the checkpoint, as GLM ships its correction biases
    f32_suffixes = ("e_score_correction_bias",)

    def make_config(self, vocab: int, eos: list[int]):
        from transformers import Glm4MoeConfig

        # 4 routed experts (2 per token) of 256 and one shared, layer 0 dense; q/k norms and qkv biases, half-rotary
        return _config(Glm4MoeConfig, self.name, vocab, eos)

    def build(self, config, norm_spread: float, gen: torch.Generator) -> DemoModel:
        from transformers import Glm4MoeForCausalLM

        # a final norm far from uniform: pre- and post-norm states differ in direction
        return _with_head(
            Glm4MoeForCausalLM(config),
            GlmMtpLayer(config),
            torch.exp(norm_spread * torch.randn(config.hidden_size, generator=gen)),
        )

    def routers(self, model: DemoModel) -> list[nn.Module]:
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

        return [m for m in model.modules() if isinstance(m, Glm4MoeTopkRouter)]

    def mtp_prefix(self, config) -> str:
        return f"model.layers.{config.num_hidden_layers}."

    def mtp_tensors(self, model: DemoModel) -> dict[str, torch.Tensor]:
        """The MTP layer under GLM's checkpoint names (``model.layers.{n}.*``)."""
        cfg = model.lm.config
        p = self.mtp_prefix(cfg)
        m = model.mtp
        sd = {
            p + "eh_proj.weight": m.eh_proj.weight,
            p + "enorm.weight": m.enorm.weight,
            p + "hnorm.weight": m.hnorm.weight,
            p + "shared_head.norm.weight": m.shared_head_norm.weight,
            # shared with the trunk: saved as copies, as llama.cpp reads them under the head's names
            p + "embed_tokens.weight": model.lm.model.embed_tokens.weight,
            p + "shared_head.head.weight": model.lm.lm_head.weight,
        }
        blk = m.block
        for name, t in blk.named_parameters():
            if ".experts." not in name:
                sd[p + name] = t
        sd[p + "mlp.gate.e_score_correction_bias"] = blk.mlp.gate.e_score_correction_bias
        ex, ff = blk.mlp.experts, cfg.moe_intermediate_size
        for e in range(cfg.n_routed_experts):  # fused [E, 2I, H] gate|up -> per-expert checkpoint tensors
            sd[p + f"mlp.experts.{e}.gate_proj.weight"] = ex.gate_up_proj[e, :ff]
            sd[p + f"mlp.experts.{e}.up_proj.weight"] = ex.gate_up_proj[e, ff:]
            sd[p + f"mlp.experts.{e}.down_proj.weight"] = ex.down_proj[e]
        return sd

    def extra_config(self, cfg: dict) -> None:
        pass

    @torch.no_grad()
    def reload(self, folder: Path):
        """(trunk, head_fn) read back with transformers alone: the trunk from
        ``Glm4MoeForCausalLM.from_pretrained``, the head from transformers' own ``MtpModel`` loader
        (whose GLM pattern names layers 46/92, so it is pointed at our layer number)."""
        from transformers import Glm4MoeForCausalLM
        from transformers.modeling_layers import MtpModel

        lm = Glm4MoeForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        n = lm.config.num_hidden_layers
        lm._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{n}.*"]
        mtp = MtpModel.from_pretrained(lm, device_map={"": "cpu"}).float().eval()

        def head_fn(seq: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(1, seq.shape[1]).unsqueeze(0)
            g = mtp.forward_layer(0, h[:, :-1], pos, None, input_ids=seq[:, 1:])
            return mtp._project_to_logits(g)

        return _shell(lm), head_fn


class GlmMtpLayer(nn.Module):
    """GLM-4.5's NextN layer ``model.layers.{num_hidden_layers}``; embedding and LM head are the trunk's."""

    def __init__(self, config) -> None:
        super().__init__()
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer, Glm4MoeRMSNorm

        h, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = Glm4MoeRMSNorm(h, eps)
        self.hnorm = Glm4MoeRMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = Glm4MoeDecoderLayer(config, layer_idx=config.num_hidden_layers)  # MoE: idx >= first_k_dense
        self.shared_head_norm = Glm4MoeRMSNorm(h, eps)

    def forward(
        self, h_t: torch.Tensor, emb_next: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        u = self.eh_proj(torch.cat([self.enorm(emb_next), self.hnorm(h_t)], dim=-1))
        return self.shared_head_norm(self.block(u, attention_mask=None, position_embeddings=rope))


# --------------------------------------------------------------------------- Qwen3.5


class Qwen35:
    name = "qwen35"
    architecture = "Qwen3_5ForCausalLM"
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    stop_tokens = ("<|endoftext|>", "<|im_end|>")
    chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    f32_suffixes: tuple[str, ...] = ()

    def make_config(self, vocab: int, eos: list[int]):
        from transformers import Qwen3_5TextConfig

        # 3 gated-DeltaNet layers + 1 gated full-attention layer (full_attention_interval 4), dense SwiGLU;
        # 2 key / 4 value heads so llama.cpp's value-head reordering is exercised, as in the real releases
        return _config(Qwen3_5TextConfig, self.name, vocab, eos)

    def build(self, config, norm_spread: float, gen: torch.Generator) -> DemoModel:
        from transformers import Qwen3_5ForCausalLM

        # zero-centred norm (scale 1 + w): a wide log-normal scale, as for GLM
        scale = torch.exp(norm_spread * torch.randn(config.hidden_size, generator=gen))
        return _with_head(Qwen3_5ForCausalLM(config), QwenMtpLayer(config), scale - 1)

    def routers(self, model: DemoModel) -> list[nn.Module]:
        return []  # dense

    def mtp_prefix(self, config) -> str:
        return "mtp."

    def mtp_tensors(self, model: DemoModel) -> dict[str, torch.Tensor]:
        """The MTP layer under Qwen3.5's checkpoint names (``mtp.*``); embedding and head are the trunk's
        (``mtp_use_dedicated_embeddings`` false, as the releases ship it)."""
        m = model.mtp
        sd = {
            "mtp.fc.weight": m.fc.weight,
            "mtp.pre_fc_norm_embedding.weight": m.pre_fc_norm_embedding.weight,
            "mtp.pre_fc_norm_hidden.weight": m.pre_fc_norm_hidden.weight,
            "mtp.norm.weight": m.norm.weight,
        }
        sd.update({"mtp.layers.0." + k: v for k, v in m.layer.named_parameters()})
        return sd

    def extra_config(self, cfg: dict) -> None:
        # as the real config.json files declare it (transformers' config class drops unknown keys)
        cfg.update(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)

    @torch.no_grad()
    def reload(self, folder: Path):
        """(trunk, head_fn) read back from the files: the trunk with ``Qwen3_5ForCausalLM.from_pretrained``,
        the head rebuilt from the ``mtp.*`` tensors with transformers' own decoder layer, zero-centred
        RMSNorm and rotary embedding (transformers does not run Qwen3.5's head itself)."""
        from safetensors.torch import load_file
        from transformers import Qwen3_5ForCausalLM

        lm = Qwen3_5ForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        sd: dict[str, torch.Tensor] = {}
        for f in sorted(folder.glob("*.safetensors")):
            sd.update({k: v.float() for k, v in load_file(str(f)).items() if k.startswith("mtp.")})
        head = QwenMtpLayer(lm.config).eval()
        head.load_state_dict(
            {k.removeprefix("mtp.").replace("layers.0.", "layer.", 1): v for k, v in sd.items()}, strict=True
        )
        shell = _shell(lm)
        shell.mtp = head

        def head_fn(seq: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
            return shell.head_logits(h[:, :-1], seq[:, 1:])

        return shell, head_fn


class QwenMtpLayer(nn.Module):
    """Qwen3.5's MTP layer (``mtp.*``): one gated full-attention decoder layer; embedding and LM head are the
    trunk's."""

    def __init__(self, config) -> None:
        super().__init__()
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

        h, eps = config.hidden_size, config.rms_norm_eps
        block_cfg = copy.deepcopy(config)
        block_cfg.layer_types = ["full_attention"]
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layer = Qwen3_5DecoderLayer(block_cfg, 0)
        self.norm = Qwen3_5RMSNorm(h, eps)

    def forward(
        self, h_t: torch.Tensor, emb_next: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        u = self.fc(torch.cat([self.pre_fc_norm_embedding(emb_next), self.pre_fc_norm_hidden(h_t)], dim=-1))
        return self.norm(self.layer(u, position_embeddings=rope, attention_mask=None))


FAMILIES = {f.name: f for f in (Glm4Moe(), Qwen35())}
