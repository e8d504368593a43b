"""Qwen3-Next (``Qwen3NextForCausalLM``, Qwen3-Next-80B-A3B) -> GGUF arch ``qwen3next``.

The direct ancestor of Qwen3.5-MoE (:mod:`.qwen35moe`): the same hybrid of Gated
DeltaNet layers and a gated full-attention layer every ``full_attention_interval``,
an MoE block (softmax router, routed experts, shared expert with a sigmoid gate)
in every layer, zero-centred RMSNorms, and the MTP head stored the same way under
``mtp.`` (``mtp.fc``/``pre_fc_norm_*``/``norm`` and ``mtp.layers.0.*``, a
full-attention MoE block). The differences, as llama.cpp's converter
(conversion/qwen.py, ``Qwen3NextModel``) handles them:

- the linear attention projects q, k, v and the output gate z with ONE matrix,
  ``linear_attn.in_proj_qkvz`` [n_k * (2 d_k + 2 r d_v), hidden], interleaved per
  key head ([q_k, k_k, v_k (r value heads), z_k (r)] for k = 0..n_k-1, r = n_v / n_k);
  it is regrouped into ``attn_qkv`` (all q, all k, all v) and ``attn_gate`` (all z);
- beta and alpha come fused too: ``linear_attn.in_proj_ba`` -> ``ssm_ba``, as stored;
- value heads stay in grouped order (llama.cpp's qwen3next graph expects them so;
  only Qwen3.5 reorders them to tiled order);
- no MRoPE: ``rope.dimension_sections`` only when the config gives ``mrope_section``;
- the release config.json has no ``layer_types`` and no ``mtp_num_hidden_layers``:
  layer kinds are the ``layer_types`` transformers derives from ``full_attention_interval``
  (the config view, :mod:`.hfconfig`) and the MTP layers are counted from the
  ``mtp.layers.*`` tensors.

llama.cpp's qwen3next loader needs experts in every layer, so a config with dense
layers (``mlp_only_layers``, ``decoder_sparse_step`` > 1) is refused.
Releases ship bf16 and FP8 (128x128 block-scaled ``weight_scale_inv``, dequantized
per tensor by the checkpoint reader).
"""

from __future__ import annotations

from typing import Iterator

import torch

from ...errors import InputError
from ..base import Emit, Transform
from ..checkpoint import HFCheckpoint
from .qwen35 import identity
from .qwen35moe import Qwen35Moe

_QKVZ = "linear_attn.in_proj_qkvz.weight"


class Qwen3Next(Qwen35Moe):
    hf_architectures = ("Qwen3NextForCausalLM",)
    arch = "qwen3next"

    def __init__(self, ckpt: HFCheckpoint):
        super().__init__(ckpt)
        hp = self.hparams
        if hp.get("mlp_only_layers") or hp.get("decoder_sparse_step") not in (None, 1):
            raise InputError(
                ckpt.folder / "config.json",
                "mlp_only_layers / decoder_sparse_step give dense layers; llama.cpp's qwen3next "
                "needs an MoE block in every layer",
            )

    def rope_sections(self) -> list[int] | None:
        return self.rope_parameters.get("mrope_section")  # plain partial RoPE, unless a config says otherwise

    # -- the linear attention's fused projections ----------------------------------------

    def linear_attn_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = super().linear_attn_shapes()
        hp = self.hparams
        h, n_k, n_v = hp["hidden_size"], hp["linear_num_key_heads"], hp["linear_num_value_heads"]
        d_k, d_v = hp["linear_key_head_dim"], hp["linear_value_head_dim"]
        for split in ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b"):
            del shapes[f"linear_attn.{split}.weight"]
        shapes[_QKVZ] = (2 * n_k * d_k + 2 * n_v * d_v, h)
        shapes["linear_attn.in_proj_ba.weight"] = (2 * n_v, h)
        return shapes

    def v_head_tiling(self, kind: str) -> Transform:
        return identity  # grouped value heads, as stored

    def block_tensors(self, bid: int, names: dict[str, str]) -> Iterator[Emit]:
        yield from super().block_tensors(bid, {k: v for k, v in names.items() if k != _QKVZ})
        if (hf := names.get(_QKVZ)) is not None:
            yield from self._split_qkvz(bid, hf)

    def _split_qkvz(self, bid: int, hf: str) -> Iterator[Emit]:
        """in_proj_qkvz (per key head: q, k, r value heads, r gate heads) -> attn_qkv [q; k; v] and attn_gate [z]."""
        self._check_linear_attn(_QKVZ, hf)
        self.used.append(hf)
        hp = self.hparams
        h, n_k, n_v = hp["hidden_size"], hp["linear_num_key_heads"], hp["linear_num_value_heads"]
        d_k, v_per_k = hp["linear_key_head_dim"], n_v // n_k * hp["linear_value_head_dim"]

        def part(start: int, size: int) -> Transform:
            def take(w: torch.Tensor) -> torch.Tensor:
                return w.reshape(n_k, 2 * d_k + 2 * v_per_k, h)[:, start : start + size].reshape(-1, h)

            return take

        q, k, v, z = part(0, d_k), part(d_k, d_k), part(2 * d_k, v_per_k), part(2 * d_k + v_per_k, v_per_k)
        qkv = lambda w: torch.cat([q(w), k(w), v(w)]).contiguous()  # noqa: E731
        yield self.emit(f"blk.{bid}.attn_qkv.weight", hf, qkv, shape=(n_k * (2 * d_k + v_per_k), h))
        yield self.emit(f"blk.{bid}.attn_gate.weight", hf, lambda w: z(w).contiguous(), shape=(n_k * v_per_k, h))
