"""What the runtime tests of every family share: the tiny checkpoints and GGUFs of each family (built once a
session, see tests/runtime/conftest.py), transformers' model of each, independent MTP heads (oracles), the
loop models that draft something useful, and gguf-py's dequantization of a whole GGUF."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from safetensors.torch import load_file, save_file

from tests.builders import (
    tiny,
    tiny_bailingmoe3,
    tiny_cohere2moe,
    tiny_deepseek2,
    tiny_hy_v3,
    tiny_mimo2,
    tiny_qwen35,
    tiny_step35,
)
from tests.helpers.runcli import run_cli

PROMPTS = ["def add(a, b):\n", "The quick brown fox", "for i in range(10):", "class Point:"]
REL_TOL = 1e-4  # of the logit scale, for f32 agreement
F32 = torch.float32


def close(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |ours - ref|, max |ref|)."""
    return (ours.float() - ref.float()).abs().max().item(), ref.abs().max().item()


def convert(src: Path, out: Path, outtype: str = "f32", *args) -> Path:
    res = run_cli("convert", src, out, "--outtype", outtype, "-q", *args)
    assert res.exit_code == 0, res.output
    return out


def dequantized_copy(src: Path, out: Path) -> Path:
    """The GGUF ``src`` with every quantized tensor replaced by gguf-py's dequantization, as F32."""
    from mtpq.gguf_io import plan_from_gguf, write_plan

    plan = plan_from_gguf(src)
    specs = []
    for s in plan.tensors:
        if s.source_type in (
            T.F32,
            T.F16,
            T.BF16,
            T.I8,
            T.I16,
            T.I32,
            T.I64,
        ):  # (integer tables: DeepSeek-V4's tid2eid)
            specs.append(s)
            continue
        load = lambda s=s: torch.from_numpy(
            gguf.quants.dequantize(np.asarray(s.load_raw()), s.source_type).astype(np.float32)
        ).reshape(s.shape)
        specs.append(s.with_values(load).with_type(T.F32, "dequantized"))
    plan.tensors = specs
    write_plan(plan, out)
    return out


def requantized(src: Path, out: Path, qtype: T) -> Path:
    """``src`` with every matrix whose rows fit ``qtype``'s blocks (routers aside) in ``qtype``."""
    from mtpq.ggml.registry import TYPES
    from mtpq.gguf_io import plan_from_gguf, write_plan

    assert qtype in TYPES, f"no {qtype.name} kernel"  # a dropped kernel fails here, never skips
    plan = plan_from_gguf(src)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    plan.tensors = [
        s.with_type(qtype, "test")
        if len(s.shape) >= 2 and s.shape[-1] % block == 0 and "ffn_gate_inp" not in s.name
        else s
        for s in plan.tensors
    ]
    write_plan(plan, out)
    return out


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=gen).tolist() for _ in range(n)]


# ----------------------------------------------------------------------------- transformers' models


def hf_model(family: str, folder: Path, dtype: torch.dtype = F32):
    """transformers' causal LM of a family's checkpoint."""
    import transformers as tf

    cls = {
        "glm4moe": tf.Glm4MoeForCausalLM,
        "qwen35": tf.Qwen3_5ForCausalLM,
        "qwen35moe": tf.Qwen3_5MoeForCausalLM,
        "deepseek2": tf.DeepseekV3ForCausalLM,
        "hy_v3": tf.HYV3ForCausalLM,
        "cohere2moe": tf.Cohere2MoeForCausalLM,
        "qwen3next": tf.Qwen3NextForCausalLM,
        "nemotron_h_moe": tf.NemotronHForCausalLM,
    }[family]
    return cls.from_pretrained(str(folder), dtype=dtype).eval()


def expert_stack(sd: dict, prefix: str, n_experts: int) -> dict[str, torch.Tensor]:
    """Per-expert gate/up/down matrices as transformers' fused expert parameters."""
    return {
        "mlp.experts.gate_up_proj": torch.stack(
            [
                torch.cat([sd[f"{prefix}{e}.gate_proj.weight"], sd[f"{prefix}{e}.up_proj.weight"]])
                for e in range(n_experts)
            ]
        ),
        "mlp.experts.down_proj": torch.stack([sd[f"{prefix}{e}.down_proj.weight"] for e in range(n_experts)]),
    }


class MtpOracle:
    """The MTP math of DESIGN.md on transformers' own decoder layer and norms, in plain torch: the pairs
    (h_t, x_{t+1}) -> enorm(E x), hnorm(h) -> eh_proj -> one causal block at positions 0..T-1 -> norm -> head.
    Subclasses load a family's layer, norms, projection, embedding, head and rotary embedding."""

    hf: torch.nn.Module
    layer: torch.nn.Module
    enorm: torch.nn.Module
    hnorm: torch.nn.Module
    head_norm: torch.nn.Module
    eh_proj: torch.Tensor
    embed: torch.Tensor
    head: torch.Tensor
    rotary: torch.nn.Module

    @staticmethod
    def norm(cls, cfg, weight: torch.Tensor):
        m = cls(cfg.hidden_size, eps=cfg.rms_norm_eps)
        m.weight.data.copy_(weight)
        return m

    @torch.no_grad()
    def trunk_hidden(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(post-norm, pre-norm) last hidden states of transformers' trunk."""
        seen = {}
        hook = self.hf.model.norm.register_forward_pre_hook(lambda mod, args: seen.setdefault("pre", args[0]))
        try:
            post = self.hf.model(ids).last_hidden_state
        finally:
            hook.remove()
        return post, seen["pre"]

    @torch.no_grad()
    def __call__(self, next_ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and post-norm output for the pairs (hidden[t], next_ids[t]), positions 0..T-1, causal."""
        T_ = next_ids.shape[1]
        u = F.linear(
            torch.cat([self.enorm(F.embedding(next_ids, self.embed)), self.hnorm(hidden)], dim=-1), self.eh_proj
        )
        pos = torch.arange(T_)[None]
        mask = torch.full((T_, T_), float("-inf")).triu(1)[None, None]
        g = self.layer(u, attention_mask=mask, position_ids=pos, position_embeddings=self.rotary(u, pos))
        normed = self.head_norm(g)
        return F.linear(normed, self.head), normed


class GlmMtpOracle(MtpOracle):
    """GLM-4.5's head: transformers' Glm4MoeDecoderLayer on model.layers.{n}.*."""

    def __init__(self, folder: Path):
        from transformers import Glm4MoeConfig
        from transformers.models.glm4_moe.modeling_glm4_moe import (
            Glm4MoeDecoderLayer,
            Glm4MoeRMSNorm,
            Glm4MoeRotaryEmbedding,
        )

        self.hf = hf_model("glm4moe", folder)
        cfg = Glm4MoeConfig.from_pretrained(str(folder))
        cfg.first_k_dense_replace = 0  # the MTP block is a MoE block
        cfg._attn_implementation = "eager"
        p = f"model.layers.{cfg.num_hidden_layers}."
        sd = {}
        for f in sorted(folder.glob("*.safetensors")):
            sd.update({k[len(p) :]: v.float() for k, v in load_file(str(f)).items() if k.startswith(p)})
        self.layer = Glm4MoeDecoderLayer(cfg, layer_idx=0).eval()
        layer_sd = {
            k: v
            for k, v in sd.items()
            if k.startswith(
                ("self_attn.", "input_layernorm.", "post_attention_layernorm.", "mlp.gate.", "mlp.shared_experts.")
            )
        }
        layer_sd.update(expert_stack(sd, "mlp.experts.", cfg.n_routed_experts))
        self.layer.load_state_dict(layer_sd, strict=True)
        self.enorm, self.hnorm = (self.norm(Glm4MoeRMSNorm, cfg, sd[k]) for k in ("enorm.weight", "hnorm.weight"))
        self.head_norm = self.norm(Glm4MoeRMSNorm, cfg, sd["shared_head.norm.weight"])
        self.eh_proj = sd["eh_proj.weight"]
        # GLM-4.6 heads leave out embed_tokens / shared_head.head: the trunk's are used
        self.embed = sd.get("embed_tokens.weight", self.hf.model.embed_tokens.weight.detach())
        self.head = sd.get("shared_head.head.weight", self.hf.lm_head.weight.detach())
        self.rotary = Glm4MoeRotaryEmbedding(cfg)


class Qwen35MtpOracle(MtpOracle):
    """Qwen3.5's head (llama.cpp's qwen35 MTP graph; transformers does not run it) on transformers' own
    full-attention decoder layer, zero-centred RMSNorm and rotary embedding, on the mtp.* tensors."""

    def __init__(self, folder: Path, moe: bool):
        import transformers.models.qwen3_5.modeling_qwen3_5 as dense
        import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as sparse

        mod, prefix = (sparse, "Qwen3_5Moe") if moe else (dense, "Qwen3_5")
        self.hf = hf_model("qwen35moe" if moe else "qwen35", folder)
        cfg = copy.deepcopy(self.hf.config)
        cfg.layer_types = ["full_attention"]
        cfg._attn_implementation = "eager"
        sd = {}
        for f in sorted(folder.glob("*.safetensors")):
            sd.update({k: v.float() for k, v in load_file(str(f)).items() if k.startswith("mtp.")})
        layer_sd = {
            k[len("mtp.layers.0.") :]: v
            for k, v in sd.items()
            if k.startswith("mtp.layers.0.") and ".mlp.experts." not in k
        }
        if moe:
            layer_sd.update(expert_stack(sd, "mtp.layers.0.mlp.experts.", cfg.num_experts))
        self.layer = getattr(mod, f"{prefix}DecoderLayer")(cfg, 0).eval()
        self.layer.load_state_dict(layer_sd, strict=True)
        rms = getattr(mod, f"{prefix}RMSNorm")
        self.enorm, self.hnorm, self.head_norm = (
            self.norm(rms, cfg, sd[f"mtp.{k}.weight"]) for k in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")
        )
        self.eh_proj = sd["mtp.fc.weight"]
        self.embed = self.hf.model.embed_tokens.weight.detach()
        self.head = self.hf.lm_head.weight.detach()
        self.rotary = getattr(mod, f"{prefix}TextRotaryEmbedding")(cfg)


class DeepseekMtpOracle(MtpOracle):
    """DeepSeek-V3's head: transformers' own MtpModel (the layer ``generate(use_mtp=True)`` drafts with)."""

    def __init__(self, folder: Path, head_layer: int):
        from transformers.modeling_layers import MtpModel

        self.hf = hf_model("deepseek2", folder)
        # transformers looks for the head at the real model's layer (61)
        self.hf._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{head_layer}\..*"]
        self.mtp = MtpModel.from_pretrained(self.hf).eval()

    @torch.no_grad()
    def __call__(self, next_ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(1, next_ids.shape[1] + 1)[None]
        out = self.mtp.forward_layer(0, hidden, pos, None, input_ids=next_ids)
        return self.mtp._project_to_logits(out), out


def oracle(family: str, folder: Path) -> MtpOracle:
    if family == "glm4moe":
        return GlmMtpOracle(folder)
    if family in ("qwen35", "qwen35moe"):
        return Qwen35MtpOracle(folder, family == "qwen35moe")
    return DeepseekMtpOracle(folder, json.loads((folder / "config.json").read_text())["num_hidden_layers"])


# ----------------------------------------------------------------------------- checkpoints of each family


# each mixer's and FFN's output (Ling 3.0's MLA: attention.dense)
OUT_PROJS = ("out_proj.weight", "o_proj.weight", "down_proj.weight", ".down_proj", "attention.dense.weight")


@dataclass(frozen=True)
class HeadNames:
    """Where a checkpoint keeps what :func:`bigram_model` rewrites: the head's projection of [embedding ;
    hidden], its embedding norm (and the value that makes it a plain norm; None: left as it is), its final norm,
    the trunk's, and the prefix of the head's tensors."""

    fc: str
    enorm: str | None
    enorm_plain: float
    head_norm: str
    trunk_norm: str
    prefix: str = "mtp."


QWEN_HEAD = HeadNames(
    "mtp.fc.weight",
    "mtp.pre_fc_norm_embedding.weight",
    0.0,  # zero-centred norms
    "mtp.norm.weight",
    "model.norm.weight",
)
NEMOTRON_HEAD = HeadNames(
    "mtp.layers.0.eh_proj.weight",
    "mtp.layers.0.enorm.weight",
    1.0,
    "mtp.layers.1.final_layernorm.weight",
    "backbone.norm_f.weight",
)


def bigram_model(
    folder: Path,
    trunk_scale: float = 0.4,
    head_mix: float = 0.1,
    head_shrink: float = 0.1,
    names: HeadNames = QWEN_HEAD,
) -> Path:
    """Rewrite a tiny checkpoint whose head lives under ``mtp.`` (Qwen3.5, Qwen3-Next, Nemotron-H: ``names``)
    in place into a "bigram" model: the trunk's mixing and FFN outputs are scaled down (the current token's
    embedding weighs much in its prediction, the rest of the context still decides most of the time), and the
    head passes enorm(E[x_{t+1}]) through an identity eh_proj and a near-identity block into the trunk's own
    output norm and head: it drafts the trunk's "bigram" guess, right about a fifth of the time."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    out_norm = None
    for shard in shards:
        out_norm = load_file(str(folder / shard)).get(names.trunk_norm, out_norm)
    for shard in shards:
        t = load_file(str(folder / shard))
        for name in list(t):
            if name == names.fc:  # [enorm(e) ; hnorm(h)] -> e + a little of h
                h = t[name].shape[0]
                t[name] = torch.cat([torch.eye(h, dtype=t[name].dtype), head_mix * t[name][:, h:]], dim=1)
            elif name == names.head_norm:
                t[name] = out_norm.clone()
            elif names.enorm is not None and name == names.enorm:
                t[name] = torch.full_like(t[name], names.enorm_plain)
            elif name.endswith(OUT_PROJS):
                t[name] = (head_shrink if name.startswith(names.prefix) else trunk_scale) * t[name]
        save_file(t, str(folder / shard), metadata={"format": "pt"})
    return folder


def bigram_nextn_model(folder: Path, head_norm: str, **kw) -> Path:
    """:func:`bigram_model` for a head stored as layer ``model.layers.{num_hidden_layers}`` (``eh_proj``, ``enorm``,
    ``hnorm``, its final norm ``head_norm``) that ties its embedding and output to the trunk's."""
    n = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    head = f"model.layers.{n}."
    return bigram_model(
        folder,
        names=HeadNames(
            head + "eh_proj.weight", None, 0.0, f"{head}{head_norm}.weight", "model.norm.weight", prefix=head
        ),
        **kw,
    )


# these trunks need more of the current token than Qwen3.5's for the bigram drafts to be right often (~40 %)
BIGRAM_NEXTN = dict(trunk_scale=0.1, head_mix=0.0)
RELEASE_BIGRAM = dict(trunk_scale=0.05, head_mix=0.05, head_shrink=0.05)


def bigram_gguf(
    src: Path, out: Path, trunk_scale: float = 0.1, head_mix: float = 0.5, head_shrink: float = 0.5
) -> Path:
    """:func:`bigram_model` on a converted f32 GGUF, for any family with ``nextn.*`` heads (every head of a file):
    the trunk's attention and FFN outputs scaled by ``trunk_scale``; each head's eh_proj passes enorm(E[x]) through
    an identity (plus ``head_mix`` of the hidden state), its block's outputs scaled by ``head_shrink``, its
    embedding, norm and output the trunk's. Each head then drafts mostly the trunk's "bigram" guess of its input
    token, so chained heads accept a few drafts in a row now and then, while its context still counts (a head
    that attends over the wrong pairs drafts otherwise now and then)."""
    from mtpq.gguf_io import plan_from_gguf, write_plan

    plan = plan_from_gguf(src)
    n_trunk = plan.n_trunk_layers
    top = {s.name: s for s in plan.tensors if not s.name.startswith("blk.")}
    outputs = (
        "attn_output.weight",
        "attn_output_b.weight",
        "ffn_down.weight",
        "ffn_down_exps.weight",
        "ffn_down_shexp.weight",
    )

    def edit(s):
        head = s.name.startswith("blk.") and int(s.name.split(".")[1]) >= n_trunk
        field = s.name.split(".", 2)[-1]
        if field.endswith(outputs):
            return lambda: (head_shrink if head else trunk_scale) * s.load()
        if not head:
            return None
        if field == "nextn.eh_proj.weight":  # [enorm(e) ; hnorm(h)] -> e + a little of h
            return lambda: torch.cat(
                [torch.eye(s.shape[0]), head_mix * torch.as_tensor(s.load())[:, s.shape[0] :]], dim=1
            )
        if field == "nextn.enorm.weight":
            return lambda: torch.ones(s.shape)
        twin = {
            "nextn.shared_head_norm.weight": "output_norm.weight",
            "layer_output_norm.weight": "output_norm.weight",
            "nextn.shared_head_head.weight": "output.weight",
            "nextn.embed_tokens.weight": "token_embd.weight",
        }
        return top[twin[field]].load if field in twin else None

    plan.tensors = [s if (f := edit(s)) is None else s.with_values(f) for s in plan.tensors]
    write_plan(plan, out)
    return out


def paired_file(trunk: Path, head: Path, out: Path) -> Path:
    """A trunk file and its head file (DeepSeek-V4's: ``convert --no-mtp`` / ``--mtp-only``) written as the one model
    the runtime sees through :class:`~mtpq.gguf_io.pair.PairedGGUF`: the trunk's tensors, the head's blocks, the head
    file's own top-level tensors (``output_hc_*``) under the head block's ``nextn.``, the head file's per-block
    metadata. A test fixture only: llama.cpp reads such a head from its own file, and mtpq writes no such file."""
    import dataclasses

    from mtpq.gguf_io import plan_from_gguf, write_plan
    from mtpq.gguf_io.pair import OWN

    tp, hp = plan_from_gguf(trunk), plan_from_gguf(head)
    n = tp.n_trunk_layers
    blocks = range(n, n + hp.n_mtp_layers)
    top = {s.name: s for s in hp.tensors}
    tensors = list(tp.tensors) + [s for s in hp.tensors if s.name.startswith("blk.") and int(s.name.split(".")[1]) >= n]
    tensors += [dataclasses.replace(top[own], name=f"blk.{b}.nextn.{own}") for b in blocks for own in OWN if own in top]
    for key, value in hp.kv.items():
        if key.startswith(f"{tp.arch}.") and (key not in tp.kv or isinstance(value.value, list)):
            tp.kv[key] = value
    tp.kv[f"{tp.arch}.block_count"] = hp.kv[f"{hp.arch}.block_count"]
    write_plan(dataclasses.replace(tp, tensors=tensors, n_mtp_layers=hp.n_mtp_layers, inputs=[trunk, head]), out)
    return out


SPLIT_HEAD = {"deepseek4"}  # families whose head lives in a file of its own (fixtures: paired_file)


V2_LITE_YARN = {
    "rope_type": "yarn",
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
    "rope_theta": 10000.0,
}
# YaRN without mscale_all_dim: transformers scales only cos/sin by get_mscale(f), llama.cpp also the softmax
# (mla.yarn_mla_scales); greedy outputs of the two differ on every test prompt, ours follow llama.cpp's
BARE_YARN = {
    "rope_type": "yarn",
    "factor": 8.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "rope_theta": 10000.0,
}


def release_checkpoint(name: str, folder: Path, form: str, drop: tuple[str, ...] = (), **config) -> Path:
    """Release manifest ``name``'s tiny checkpoint (tests/releases) in ``form`` with config.json keys changed (a
    test's sizes, a top-k its contexts exceed) and the tensors whose names start with ``drop`` left out."""
    from types import SimpleNamespace

    from tests import releases

    m = releases.manifests()[name]
    shim = SimpleNamespace(
        **{k: getattr(m, k) for k in ("SPECIALS", "DTYPE") if hasattr(m, k)},
        CONFIG={**m.CONFIG, **config},
        FORMS=m.FORMS,
        tensors=lambda cfg: {n: s for n, s in m.tensors(cfg).items() if not n.startswith(drop)},
    )
    return releases.build(shim, folder, form)


# DeepSeek sparse attention: the releases' shrunk top-k (64) lowered so that the tests' contexts drop keys
DSA_TOP_K = 8
# GLM-5.2's pattern: a shared block (no indexer: it reuses block 0's top-k) between two full ones
GLM52_SHARED = dict(
    num_hidden_layers=3,
    indexer_types=["full", "shared", "full"],
    index_topk=DSA_TOP_K,
    drop=("model.layers.1.self_attn.indexer.",),
)


def dsa_copy(name: str, form: str):
    """A one-block DeepSeek sparse-attention model whose head drafts (tiny_deepseek2.trunk_copy_head)."""
    return lambda f: tiny_deepseek2.trunk_copy_head(
        release_checkpoint(name, f, form, num_hidden_layers=1, first_k_dense_replace=0, index_topk=16)
    )


CHECKPOINTS = {  # family -> variant -> f(folder) writing the checkpoint there (f32: exact comparisons)
    "glm4moe": {
        "default": lambda f: tiny.glm4moe(f, dtype=F32),
        # other code paths: group-limited routing, no renormalisation, no q/k norm or bias, MoE from layer 0
        "alt": lambda f: tiny.glm4moe(
            f,
            dtype=F32,
            seed=3,
            glm46=True,
            n_group=2,
            topk_group=1,
            norm_topk_prob=False,
            use_qk_norm=False,
            attention_bias=False,
            first_k_dense_replace=0,
            num_hidden_layers=3,
        ),
        # GLM-4.6's head: no embed_tokens / shared_head.head, the trunk's are used
        "glm46": lambda f: tiny.glm4moe(f, dtype=F32, glm46=True, seed=4),
        "copy": lambda f: tiny.copy_head(tiny.glm4moe(f, dtype=F32)),
        "copy46": lambda f: tiny.copy_head(tiny.glm4moe(f, dtype=F32, glm46=True)),
    },
    "qwen35": {
        "dense": lambda f: tiny_qwen35.qwen35(f, dtype=F32),
        "dense_tied": lambda f: tiny_qwen35.qwen35(f, dtype=F32, tie_word_embeddings=True),  # no output.weight
        "bigram": lambda f: bigram_model(tiny_qwen35.qwen35(f, dtype=F32)),
    },
    "qwen35moe": {
        "moe": lambda f: tiny_qwen35.qwen35(f, dtype=F32, moe=True),
        "bigram": lambda f: bigram_model(tiny_qwen35.qwen35(f, dtype=F32, moe=True)),
    },
    "deepseek2": {
        # DeepSeek-V3's layout: low-rank q, YaRN (mscale = mscale_all_dim = 1), one dense lead layer, 2 groups
        "v3": lambda f: tiny_deepseek2.deepseek_v3(f, dtype=F32),
        # "lite" attention (plain q_proj), no RoPE scaling, MoE from layer 0, one group, no renormalisation
        "plain_q": lambda f: tiny_deepseek2.deepseek_v3(
            f,
            dtype=F32,
            q_lora_rank=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            first_k_dense_replace=0,
            n_group=1,
            topk_group=1,
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
        ),
        # V2-Lite's YaRN: mscale = mscale_all_dim = 0.707, factor 40 (the softmax scale moves, cos/sin do not)
        "v2_lite_yarn": lambda f: tiny_deepseek2.deepseek_v3(
            f, dtype=F32, rope_parameters=V2_LITE_YARN, max_position_embeddings=163840, seed=2
        ),
        "bare_yarn": lambda f: tiny_deepseek2.deepseek_v3(
            f, dtype=F32, rope_parameters=BARE_YARN, max_position_embeddings=32768, seed=5
        ),
        # a random head without its own embed_tokens / shared_head.head (tied to the trunk's)
        "tied": lambda f: tiny_deepseek2.deepseek_v3(f, dtype=F32, mtp_head_tensors=False, seed=4),
        # a one-layer trunk whose head is a copy of that layer fed the next token's embedding (~60 % right)
        "copy": lambda f: tiny_deepseek2.trunk_copy_head(
            tiny_deepseek2.deepseek_v3(
                f, dtype=F32, mtp_head_tensors=False, num_hidden_layers=1, first_k_dense_replace=0
            )
        ),
    },
    "hy_v3": {
        "default": lambda f: tiny_hy_v3.hy_v3(f, dtype=F32),
        "bigram": lambda f: bigram_nextn_model(tiny_hy_v3.hy_v3(f, dtype=F32), "final_layernorm", **BIGRAM_NEXTN),
    },
    "cohere2moe": {
        # LayerNorm (rms_norm_eps null), logit_scale 1/16, window 16, a shared expert averaged in
        "default": lambda f: tiny_cohere2moe.cohere2moe(f, dtype=F32),
        # as released: RMSNorm, no shared expert, logit_scale 1; five layers (the fifth full, without RoPE)
        "rms": lambda f: tiny_cohere2moe.cohere2moe(
            f, dtype=F32, seed=2, rms_norm_eps=1e-6, num_shared_experts=0, logit_scale=1.0, num_hidden_layers=5
        ),
        # untied: with tied embeddings the trunk's greedy output settles on one repeated token
        "bigram": lambda f: bigram_nextn_model(
            tiny_cohere2moe.cohere2moe(f, dtype=F32, tie_word_embeddings=False), "shared_head.norm", **BIGRAM_NEXTN
        ),
    },
    "bailingmoe3": {
        # KDA, MLA, KDA, MLA; a dense first layer
        "default": lambda f: tiny_bailingmoe3.bailingmoe3(f, dtype=F32),
        # low-rank q, two expert groups, SwiGLU clamps that bind on the random weights
        "alt": lambda f: tiny_bailingmoe3.bailingmoe3(
            f,
            dtype=F32,
            seed=3,
            q_lora_rank=128,
            n_group=2,
            topk_group=1,
            expert_swiglu_limit_list=[0, 0.3, 0.3, 0.3],
            share_expert_swiglu_limit_list=[0.3, 0.3, 0, 0.3],
        ),
        "bigram": lambda f: bigram_nextn_model(
            tiny_bailingmoe3.bailingmoe3(f, dtype=F32), "final_layernorm", **BIGRAM_NEXTN
        ),
    },
    # the release-shaped checkpoints of tests/releases (bf16 values; the GGUFs are f32); their bigram models
    # scale harder (an MoE in every block, Nemotron's routed scale 5: at 0.4 almost no draft is right)
    "qwen3next": {
        "release": lambda f: release_checkpoint("qwen3next", f, "bf16"),
        "bigram": lambda f: bigram_model(release_checkpoint("qwen3next", f, "bf16"), **RELEASE_BIGRAM),  # ~55 % right
    },
    "nemotron_h_moe": {
        "release": lambda f: release_checkpoint("nemotron3_super", f, "bf16"),
        "bigram": lambda f: bigram_model(
            release_checkpoint("nemotron3_super", f, "bf16"),  # ~35 % right
            names=NEMOTRON_HEAD,
            **RELEASE_BIGRAM,
        ),
    },
}
CHECKPOINTS |= {  # the families transformers does not run as llama.cpp does: their release manifests
    "glm-dsa": {
        "glm5": lambda f: release_checkpoint("glm5", f, "bf16", index_topk=DSA_TOP_K),
        "glm52": lambda f: release_checkpoint("glm5", f, "bf16", **GLM52_SHARED),
        "copy": dsa_copy("glm5", "bf16"),
    },
    "deepseek32": {
        "v32": lambda f: release_checkpoint("deepseek_v32", f, "fp8", index_topk=DSA_TOP_K),
        "copy": dsa_copy("deepseek_v32", "fp8"),
    },
    "step35": {
        # sliding window 16 (short sequences cross it), full and sliding blocks alternating, 2 chained heads
        "tiny": lambda f: tiny_step35.step35(f),
    },
    "mimo2": {
        # MiMo-V2.5's layout: fused FP8 qkv, 16 heads of 48 (values 32), sinks, window 16, 3 chained heads
        "tiny": lambda f: tiny_mimo2.as_v25_fused_fp8(tiny_mimo2.mimo2(f, **tiny_mimo2.v25_heads(4))),
        "flash": lambda f: tiny_mimo2.mimo2(f),  # MiMo-V2-Flash's: attn_q / attn_k / attn_v
    },
    "deepseek4": {
        # the release's layout (hash layers, CSA with the indexer, HCA, hyper-connections) with a window of 16 and
        # an indexer top-k of 2, so that short contexts drop raw and compressed keys
        "release": lambda f: release_checkpoint("deepseek_v4_flash", f, "fp8", sliding_window=16, index_topk=2),
    },
}
# variants made from another's f32 GGUF: (family, variant) -> (base variant, f(base GGUF, out))
GGUF_EDITS = {
    ("step35", "bigram"): ("tiny", bigram_gguf),
    ("mimo2", "bigram"): ("tiny", bigram_gguf),
    ("deepseek4", "bigram"): ("release", bigram_gguf),
}
# the loop models: random heads draft nothing useful, these draft a mix of right and wrong tokens
LOOP_VARIANT = {
    "glm4moe": "copy",
    "qwen35": "bigram",
    "qwen35moe": "bigram",
    "deepseek2": "copy",
    "glm-dsa": "copy",
    "deepseek32": "copy",
    "hy_v3": "bigram",
    "cohere2moe": "bigram",
    "bailingmoe3": "bigram",
    "qwen3next": "bigram",
    "nemotron_h_moe": "bigram",
    "step35": "bigram",
    "mimo2": "bigram",
    "deepseek4": "bigram",
}


class Builds:
    """Each family's checkpoints and f32 GGUFs, built on first use and kept for the session."""

    def __init__(self, root: Path):
        self.root = root
        self._models: dict[tuple[str, str], tuple[object, object]] = {}

    def ckpt(self, family: str, variant: str) -> Path:
        folder = self.root / f"{family}-{variant}"
        if not (folder / "config.json").exists():
            CHECKPOINTS[family][variant](folder)
        return folder

    def gguf(self, family: str, variant: str) -> Path:
        path = self.root / f"{family}-{variant}-f32.gguf"
        if path.exists():
            return path
        if (family, variant) in GGUF_EDITS:
            base, edit = GGUF_EDITS[family, variant]
            return edit(self.gguf(family, base), path)
        if family in SPLIT_HEAD:
            ckpt = self.ckpt(family, variant)
            pair = [
                convert(ckpt, self.root / f"{family}-{variant}-{what}.gguf", "f32", f"--{what}")
                for what in ("no-mtp", "mtp-only")
            ]
            return paired_file(*pair, path)
        return convert(self.ckpt(family, variant), path)

    def loop_gguf(self, family: str) -> Path:
        return self.gguf(family, LOOP_VARIANT[family])

    def loop_model(self, family: str):
        """(model, tokenizer) of the family's loop model, shared: callers reset or prefill its caches."""
        from mtpq.runtime.speculative import load_model

        key = (family, LOOP_VARIANT[family])
        if key not in self._models:
            self._models[key] = load_model(self.loop_gguf(family), device="cpu")
        return self._models[key]
