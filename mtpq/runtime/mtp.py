"""The NextN (MTP) head, once for every family.

For the pair (h_t, x_{t+1}) (DESIGN.md):

    u = eh_proj([enorm(E[x_{t+1}]) ; hnorm(h_t)])      (MiMo: [hnorm(h_t) ; enorm(E[x_{t+1}])])
    g = Block(u)                                        one decoder block of the family's own kind
    logits = head(shared_head_norm(g))

E and head are the block's ``nextn.embed_tokens`` / ``nextn.shared_head_head`` or, when a
checkpoint ties them (GLM-4.6, Qwen3.5), the trunk's ``token_embd`` / ``output``;
``shared_head_norm`` (the family's ``head_norm_name``: ``layer_output_norm`` for MiMo-V2 and Ling 3.0) falls back
to the trunk's ``output_norm``; Nemotron-H's head ends in a LayerNorm without bias instead (``layer_norm_head``,
with its own epsilon). The block keeps its own
cache. Drafts 2..k feed the head its own normed output (see :class:`~mtpq.runtime.model.MtpModel`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layers import Packing, rms_norm
from .weights import QuantLinear, QWeight, Scope, as_dtype


class NextNHead(nn.Module):
    def __init__(
        self,
        w: Scope,
        block: nn.Module,
        eps: float,
        *,
        trunk_embd: QWeight,
        trunk_output: QuantLinear,
        trunk_norm: torch.Tensor,
        hidden_first: bool = False,
        norm=rms_norm,
        logit_scale: float = 1.0,
        head_norm_name: str = "nextn.shared_head_norm.weight",
        layer_norm_head: bool = False,
        head_eps: float | None = None,
    ):
        """``norm`` (x, weight, eps): the family's norm for enorm, hnorm and the head's final norm;
        ``head_norm_name``: that final norm's tensor under the block's prefix (Ling 3.0: layer_output_norm);
        ``layer_norm_head``: that final norm a LayerNorm of epsilon ``head_eps`` (Nemotron-H) instead."""
        super().__init__()
        n = w.at("nextn.")
        self.eps, self.hidden_first, self.block = eps, hidden_first, block
        self.norm, self.logit_scale = norm, logit_scale
        self.layer_norm_head, self.head_eps = layer_norm_head, eps if head_eps is None else head_eps
        self.eh_proj = n.linear("eh_proj", bias=False)
        self.enorm, self.hnorm = n.tensor("enorm"), n.tensor("hnorm")
        self.head_norm = w.tensor(head_norm_name) if w.has(head_norm_name) else trunk_norm
        self.tied_embed, self.tied_head = not n.has("embed_tokens"), not n.has("shared_head_head")
        self.embed = trunk_embd if self.tied_embed else n.qweight("embed_tokens")
        self.head = trunk_output if self.tied_head else n.linear("shared_head_head", bias=False)

    def new_cache(self):
        return self.block.new_cache()

    def forward(self, next_ids: torch.Tensor, hidden: torch.Tensor, start: int, cache, packing: Packing | None = None):
        """-> (logits [B, T, V] of x_{t+2}, the normed output, the raw block output); with ``packing``, for
        its kept pairs only (the others still feed the block's attention)."""
        e = self.norm(self.embed.rows(next_ids), self.enorm, self.eps)
        h = self.norm(as_dtype(hidden, e.dtype), self.hnorm, self.eps)
        u = self.eh_proj(torch.cat((h, e) if self.hidden_first else (e, h), dim=-1))
        g = self.block(u, start, cache, packing=packing)
        if self.layer_norm_head:
            normed = F.layer_norm(g, (g.shape[-1],), as_dtype(self.head_norm, g.dtype), None, self.head_eps)
        else:
            normed = self.norm(g, self.head_norm, self.eps)
        logits = self.head(normed)
        return (logits * self.logit_scale if self.logit_scale != 1.0 else logits), normed, g
