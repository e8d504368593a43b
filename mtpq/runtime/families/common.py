"""GGUF metadata -> the shared layer configs, read the same way by every family that has them."""

from __future__ import annotations

from dataclasses import dataclass

from gguf import ExpertGatingFuncType

from ...errors import InputError
from ..layers import AttnConfig, MoEConfig, yarn_inv_freq
from ..mla import MLAConfig
from ..swa import SwaConfig
from ..weights import GGUFFile


def gqa_config(g: GGUFFile, eps: float, **kw) -> AttnConfig:
    """Grouped-query attention: head counts, and the head size (key_length, else embedding / heads)."""
    n_heads = int(g.require("attention.head_count"))
    head_dim = int(g.value("attention.key_length", int(g.require("embedding_length")) // n_heads))
    return AttnConfig(n_heads, int(g.value("attention.head_count_kv", n_heads)), head_dim, eps, **kw)


def routed_moe_config(g: GGUFFile, default_gating: ExpertGatingFuncType) -> MoEConfig:
    """DeepSeek-style routing as llama.cpp reads it: gating function (``default_gating`` when the file names
    none: llama.cpp's per-arch default), group-limited top-k, renormalisation, routed scaling factor."""
    gating = int(g.value("expert_gating_func", default_gating) or default_gating)
    names = {ExpertGatingFuncType.SOFTMAX: "softmax", ExpertGatingFuncType.SIGMOID: "sigmoid"}
    if gating not in names:
        raise InputError(
            g.path, f"{g.arch}.expert_gating_func {gating} is not supported by the runtime (1 softmax, 2 sigmoid)"
        )
    return MoEConfig(
        n_experts=int(g.value("expert_count", 0)),
        n_used=int(g.value("expert_used_count", 0)),
        gating=names[ExpertGatingFuncType(gating)],
        norm_topk=bool(g.value("expert_weights_norm", False)),
        scale=float(g.value("expert_weights_scale", 1.0) or 1.0),
        n_group=int(g.value("expert_group_count", 1) or 1),
        topk_group=int(g.value("expert_group_used_count", 1) or 1),
    )


def mla_config(g: GGUFFile, eps: float, softmax_mul: float | None = None) -> MLAConfig:
    """Multi-head latent attention as llama.cpp's deepseek2 graph reads it: ``attention.key_length_mla`` is nope +
    rope per head; softmax scale 1/sqrt(key_length_mla), times ``softmax_mul`` where given (YaRN's)."""
    rope_dim, key_mla = int(g.require("rope.dimension_count")), int(g.require("attention.key_length_mla"))
    return MLAConfig(
        n_heads=int(g.require("attention.head_count")),
        kv_lora_rank=int(g.require("attention.kv_lora_rank")),
        qk_nope_dim=key_mla - rope_dim,
        qk_rope_dim=rope_dim,
        v_dim=int(g.require("attention.value_length_mla")),
        eps=eps,
        kq_scale=key_mla**-0.5 if softmax_mul is None else softmax_mul / key_mla**0.5,
    )


def yarn_rope(g: GGUFFile, dim: int, base: float, read_ext_factor: bool = True):
    """YaRN's inverse frequencies from the ``rope.scaling.*`` keys -> (inverse frequencies, factor);
    ``read_ext_factor=False``: ext_factor 1 whatever the file says (deepseek4's compressor RoPE)."""
    factor = float(g.require("rope.scaling.factor"))
    ext_factor = float(g.value("rope.scaling.yarn_ext_factor", 1.0) or 1.0) if read_ext_factor else 1.0
    inv = yarn_inv_freq(
        dim,
        base,
        factor,
        int(g.require("rope.scaling.original_context_length")),
        beta_fast=float(g.value("rope.scaling.yarn_beta_fast", 32.0) or 32.0),
        beta_slow=float(g.value("rope.scaling.yarn_beta_slow", 1.0) or 1.0),
        ext_factor=ext_factor,
    )
    return inv, factor


def per_layer(g: GGUFFile, key: str, n: int, default=None) -> list:
    """A hyperparameter that is one value or one per block (llama.cpp's get_key_or_arr) as a list of ``n``."""
    value = g.value(key, default) if default is not None else g.require(key)
    if isinstance(value, (list, tuple)):
        if len(value) < n:
            raise InputError(g.path, f"{g.arch}.{key} has {len(value)} entries for {n} blocks")
        return list(value[:n])
    return [value] * n


def sliding_layers(g: GGUFFile, n: int) -> list[bool]:
    """Which of the first ``n`` blocks use sliding-window attention (``attention.sliding_window_pattern``)."""
    return [bool(f) for f in per_layer(g, "attention.sliding_window_pattern", n)]


@dataclass(frozen=True)
class WindowedModelConfig:
    """A family of :class:`~mtpq.runtime.swa.WindowedAttention` blocks (step35, mimo2)."""

    vocab_size: int
    attn: list[SwaConfig]  # per block, MTP blocks included
    sliding: list[bool]
    moe: MoEConfig


def windowed_configs(g: GGUFFile, eps: float, value_scale: float = 1.0) -> tuple[list[SwaConfig], list[bool]]:
    """Every block's attention (MTP blocks too), as llama.cpp's step35 / mimo2 read it: head and KV-head counts per
    block, keys ``attention.key_length`` wide and values ``attention.value_length``, ``attention.sliding_window``
    on the blocks ``attention.sliding_window_pattern`` marks -> (configs, which blocks slide)."""
    n = g.n_trunk + g.n_mtp
    heads = per_layer(g, "attention.head_count", n)
    kv = per_layer(g, "attention.head_count_kv", n, heads)
    sliding = sliding_layers(g, n)
    window = int(g.require("attention.sliding_window"))
    head_dim = int(g.require("attention.key_length"))
    v_dim = int(g.value("attention.value_length", head_dim))
    return [
        SwaConfig(int(h), int(k), head_dim, v_dim, eps, window if s else None, value_scale)
        for h, k, s in zip(heads, kv, sliding)
    ], sliding


def refuse_rope_scaling(g: GGUFFile, note: str = "") -> None:
    """The families whose releases need no ``rope.scaling.type`` refuse one rather than ignore it."""
    if g.value("rope.scaling.type", "none") not in ("none", None):
        raise InputError(
            g.path, f"rope scaling {g.value('rope.scaling.type')!r} is not supported by the {g.arch} runtime{note}"
        )
