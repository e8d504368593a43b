"""A trunk plus its first MTP head, for any family, behind one protocol.

What the speculative loop and the acceptance check use (and nothing else):

    model = load("m.gguf", device="cpu")
    out = model.trunk(ids)              # TrunkOut: logits, hidden (what the head is fed)
    d = model.draft(next_ids, hidden)   # MtpOut: the head's logits for x_{t+2} and its output
    ck = model.checkpoint()             # every layer cache (KV, latent, recurrent) and the head's
    model.rollback(ck, trunk_kept=a + 1, mtp_kept=0)   # back to the accepted prefix
    model.reset()

A family (``families/<arch>.py``) is a :class:`RuntimeFamily`: it reads its config from the
GGUF metadata and builds the decoder block at each index (trunk blocks 0..n_trunk-1,
the MTP block at n_trunk) from the tensors under ``blk.N.``. The trunk around them is
the same for all: token_embd -> blocks -> output_norm -> output.

The head's first pair: llama.cpp's draft-mtp driver starts the head's cache with the pair (zero state, x_0) at
position 0, so the pair (h_t, x_{t+1}) sits at position t + 1 (``first_pair="zero_state"``, the default: the
engine that runs these files). transformers and vLLM start with (h_0, x_1) at position 0 (``"none"``). The
speculative loop and the teacher-forced passes read the choice from the model (:meth:`MtpModel.head_rows`).

``hidden="post_norm"`` feeds the head the trunk's output after ``output_norm`` (llama.cpp for most families,
transformers, vLLM); ``"pre_norm"`` the last block's raw output instead (and, for drafts 2..k, the head's output
before its norm): what llama.cpp's step35 and mimo2 graphs feed (``RuntimeFamily.nextn_state``), elsewhere a diagnostic
that should draft worse. ``"auto"`` (the default) takes the family's own.

Several heads (Step-3.5, MiMo-V2.5: 3) draft as llama.cpp's ``chain_heads`` mode does (:attr:`MtpModel.chained`):
draft step i runs head i; every head's cache takes the same real pairs, and ``checkpoint`` / ``rollback`` cover
them all.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from ..errors import InputError
from . import finite
from .layers import Packing, rms_norm
from .mtp import NextNHead
from .weights import GGUFFile, QuantLinear, Scope, Weights, as_dtype

HIDDEN_CHOICES = ("post_norm", "pre_norm", "auto")
FIRST_PAIRS = ("zero_state", "none")


class RuntimeFamily:
    """One architecture's declaration. Subclasses set ``archs`` and implement ``block``."""

    archs: ClassVar[tuple[str, ...]] = ()
    hidden_first: ClassVar[bool] = False  # MTP concat order: MiMo puts the hidden state first
    nextn_state: ClassVar[str] = "post_norm"  # the state llama.cpp feeds the head (its graph's h_nextn)
    # the head's own final norm under blk.N. (else the trunk's output_norm)
    head_norm_name: ClassVar[str] = "nextn.shared_head_norm.weight"
    logit_scale: float = 1.0  # every logit, the trunk's and the heads', times this (Cohere's logit_scale)
    norm: ClassVar = staticmethod(rms_norm)  # (x, weight, eps): the final norms and the head's enorm / hnorm
    layer_norm_head: ClassVar[bool] = False  # the head's final norm a LayerNorm (Nemotron-H), not an RMSNorm
    head_eps: float | None = None  # that norm's epsilon, when not the family's

    def __init__(self, g: GGUFFile):
        self.file = g
        self.eps = float(g.require("attention.layer_norm_rms_epsilon"))

    def block(self, w: Scope, index: int) -> nn.Module:
        """The decoder block ``index`` (``index >= file.n_trunk``: an MTP block). It has
        ``forward(x, start, cache)`` and ``new_cache()``."""
        raise NotImplementedError

    def ends(self, top: Scope) -> nn.Module | None:
        """A module around the trunk's blocks, or None: ``enter(x, ids)`` turns the embedded tokens into the first
        block's input and ``leave(x)`` the last block's output into what ``output_norm`` reads (DeepSeek-V4's
        hyper-connection streams); the head is fed the blocks' own output (``nextn_state="pre_norm"``)."""
        return None

    def nextn_head(self, w: Weights, index: int, model: MtpModel) -> nn.Module | None:
        """The family's own MTP head at block ``index`` of ``w``, or None for the generic :class:`NextNHead`."""
        return None


@dataclass
class TrunkOut:
    logits: torch.Tensor  # [B, T, V] (or [B, 1, V] with last_only)
    hidden: torch.Tensor  # [B, T, H]: what the MTP head is fed (post- or pre-norm)


@dataclass
class MtpOut:
    logits: torch.Tensor  # [B, T, V]: predictions of x_{t+2}
    hidden: torch.Tensor  # [B, T, H]: the head's output, fed back for drafts 2..k


@dataclass
class RollbackPoint:
    """Where each layer cache stood (a KV length; a recurrent state), to roll back to; no KV tensor is copied."""

    trunk: list
    mtp: object
    later: list = field(default_factory=list)  # the later heads' caches (chained heads)


class MtpModel(nn.Module):
    def __init__(
        self,
        g: GGUFFile,
        family: RuntimeFamily,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        hidden: str = "auto",
        llama_cpp_numerics: bool = False,
        first_pair: str = "zero_state",
    ):
        super().__init__()
        if hidden not in HIDDEN_CHOICES:
            raise ValueError(f"hidden must be one of {HIDDEN_CHOICES}, got {hidden!r}")
        if first_pair not in FIRST_PAIRS:
            raise ValueError(f"first_pair must be one of {FIRST_PAIRS}, got {first_pair!r}")
        self.first_pair = first_pair
        if "token_embd.weight" not in g:
            raise InputError(g.path, "missing tensor token_embd.weight")
        self.path, self.arch, self.family = g.path, g.arch, family
        self.cfg = getattr(family, "cfg", None)
        self.device, self.dtype = torch.device(device), dtype
        self.hidden = family.nextn_state if hidden == "auto" else hidden
        self.eps, self.norm, self.logit_scale = family.eps, family.norm, family.logit_scale
        # llama_cpp_numerics: every weight's input rounded as llama.cpp's CPU backend rounds it (mtpq compare)
        w = Weights(g, device, dtype, round_inputs=llama_cpp_numerics)
        top = w.at()
        self.tok_embd = top.qweight("token_embd")
        self.vocab_size = self.tok_embd.shape[0]
        self.ends = family.ends(top)
        self.blocks = nn.ModuleList(family.block(w.at(f"blk.{i}."), i) for i in range(g.n_trunk))
        self.out_norm = top.tensor("output_norm")
        self.output = top.linear("output", bias=False) if top.has("output") else QuantLinear(self.tok_embd)
        # every MTP block with a NextN head: the first drafts; later ones (Step-3.5, MiMo-V2.5: 3) chain drafts
        heads = [
            self.head_at(w, i) for i in range(g.n_trunk, g.n_trunk + g.n_mtp) if f"blk.{i}.nextn.eh_proj.weight" in g
        ]
        self.mtp = heads[0] if heads else None
        self.later_heads = nn.ModuleList(heads[1:])
        self.reset()

    def head_at(self, w: Weights, index: int) -> NextNHead:
        """The NextN head of block ``index`` of ``w`` (this model's file, or a head-only file: ``mtpq sweep``'s
        candidates), on this model's trunk (its embedding, output and norm where the head has none)."""
        fam = self.family
        own = fam.nextn_head(w, index, self)
        if own is not None:
            return own
        return NextNHead(
            w.at(f"blk.{index}."),
            fam.block(w.at(f"blk.{index}."), index),
            self.eps,
            trunk_embd=self.tok_embd,
            trunk_output=self.output,
            trunk_norm=self.out_norm,
            hidden_first=fam.hidden_first,
            norm=fam.norm,
            logit_scale=fam.logit_scale,
            head_norm_name=fam.head_norm_name,
            layer_norm_head=fam.layer_norm_head,
            head_eps=fam.head_eps,
        )

    @property
    def n_heads(self) -> int:
        """MTP heads in the file (0 without a head)."""
        return (self.mtp is not None) + len(self.later_heads)

    @property
    def chained(self) -> bool:
        """Drafts chain the heads (llama.cpp's ``chain_heads``: more than one head): draft step i runs head i, so a
        round drafts at most :attr:`n_heads` tokens; with one head, every draft step reuses it."""
        return self.n_heads > 1

    # -- caches ---------------------------------------------------------------------------

    def reset(self) -> None:
        self.trunk_cache = [b.new_cache() for b in self.blocks]
        self.mtp_cache = self.mtp.new_cache() if self.mtp is not None else None
        self.later_caches = [h.new_cache() for h in self.later_heads]

    @property
    def trunk_length(self) -> int:
        return self.trunk_cache[0].length if self.trunk_cache else 0

    @property
    def mtp_length(self) -> int:
        return self.mtp_cache.length if self.mtp_cache is not None else 0

    def checkpoint(self) -> RollbackPoint:
        return RollbackPoint(
            [c.checkpoint() for c in self.trunk_cache],
            self.mtp_cache.checkpoint() if self.mtp_cache is not None else None,
            [c.checkpoint() for c in self.later_caches],
        )

    def rollback(self, ck: RollbackPoint, trunk_kept: int | None = None, mtp_kept: int | None = None) -> None:
        """Keep ``trunk_kept`` / ``mtp_kept`` of the tokens each part consumed since ``ck`` (None: leave it);
        ``mtp_kept`` applies to every head's cache."""
        if trunk_kept is not None:
            for c, point in zip(self.trunk_cache, ck.trunk):
                c.rollback(point, trunk_kept)
        if mtp_kept is not None and self.mtp_cache is not None:
            self.mtp_cache.rollback(ck.mtp, mtp_kept)
            for c, point in zip(self.later_caches, ck.later):
                c.rollback(point, mtp_kept)

    def head_cache(self, head: int):
        """Head ``head``'s cache."""
        return self.mtp_cache if head == 0 else self.later_caches[head - 1]

    # -- the head's pairs ----------------------------------------------------------------

    def head_rows(
        self, ids: torch.Tensor, hidden: torch.Tensor, lengths: list[int], out_from: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, Packing]:
        """The head's input rows for whole sequences, teacher-forced: ``ids`` [1, N] packs sequences of
        ``lengths`` and ``hidden`` [1, N, H] is the trunk's output for them. -> (next ids, states, packing) for
        :meth:`draft`, whose output row i of sequence b is the draft of x_{t+2} from the pair (h_t, x_{t+1}),
        t = out_from[b] + i (default 0). With ``first_pair="zero_state"`` each sequence's rows are (0, x_0),
        (h_0, x_1) .. at positions 0, 1 ..; with ``"none"`` they are (h_0, x_1) .. from position 0."""
        starts = [0, *itertools.accumulate(lengths)][:-1]
        out_from = out_from if out_from is not None else [0] * len(lengths)
        dev = hidden.device
        if self.first_pair == "none":
            pairs = torch.cat([torch.arange(a, a + T - 1) for a, T in zip(starts, lengths)])
            return (
                ids[:, pairs + 1],
                hidden[:, pairs.to(dev)],
                Packing([T - 1 for T in lengths], dev, out_from=list(out_from)),
            )
        # row p of a sequence: x_p beside h_{p-1}; the state row before each sequence's first is a zero row
        zero = hidden.new_zeros(1, 1, hidden.shape[-1])
        states = torch.cat((zero, hidden), dim=1)  # states[:, r + 1] is hidden[:, r]
        rows = torch.cat([torch.cat((torch.tensor([-1]), torch.arange(a, a + T - 1))) for a, T in zip(starts, lengths)])
        return ids, states[:, (rows + 1).to(dev)], Packing(list(lengths), dev, out_from=[f + 1 for f in out_from])

    def prompt_pairs(
        self, prompt_ids: list[int], first: int, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pairs the head consumes after a prefill of ``prompt_ids`` whose next token is ``first`` (hidden:
        the trunk's states for the prompt [1, n, H]) -> (ids [1, m], states [1, m, H])."""
        if self.first_pair == "none":
            return torch.tensor([list(prompt_ids[1:]) + [first]], device=self.device), hidden
        return (
            torch.tensor([list(prompt_ids) + [first]], device=self.device),
            torch.cat((hidden.new_zeros(1, 1, hidden.shape[-1]), hidden), dim=1),
        )

    # -- forward --------------------------------------------------------------------------

    @torch.inference_mode()
    def trunk(
        self,
        ids: torch.Tensor,
        use_cache: bool = True,
        last_only: bool = False,
        packing: Packing | None = None,
        logit_rows: torch.Tensor | None = None,
    ) -> TrunkOut:
        """Run the trunk on ids [B, T] (appended to the caches when ``use_cache``); logits for the last
        position only with ``last_only``, for positions ``logit_rows`` of ids only with those. ``packing``:
        ids [1, N] are the sequences it packs (uncached)."""
        ids = ids.to(self.device)
        start = self.trunk_length if use_cache else 0
        x = self.tok_embd.rows(ids)
        if self.ends is not None:
            x = self.ends.enter(x, ids)
        for block, cache in zip(self.blocks, self.trunk_cache):
            x = block(x, start, cache if use_cache else None, packing=packing)
        normed = self.norm(x if self.ends is None else self.ends.leave(x), self.out_norm, self.eps)
        logits = self.output(normed[:, -1:] if last_only else normed if logit_rows is None else normed[:, logit_rows])
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        out = TrunkOut(as_dtype(logits, torch.float32), normed if self.hidden == "post_norm" else x)
        again = lambda: self.trunk(
            ids,
            use_cache=False,
            last_only=last_only,
            packing=packing,  # noqa: E731
            logit_rows=logit_rows,
        )
        finite.check(self, "trunk", out.logits, out.hidden, again if start == 0 else None, start, packing)
        return out

    @torch.inference_mode()
    def draft(
        self,
        next_ids: torch.Tensor,
        hidden: torch.Tensor,
        use_cache: bool = True,
        packing: Packing | None = None,
        head: int = 0,
    ) -> MtpOut:
        """MTP head ``head`` on pairs (hidden[t], next_ids[t]) = (h_t, x_{t+1}); logits predict x_{t+2}. With
        ``packing`` (pairs [1, N] of the sequences it packs, uncached), logits and hidden cover its kept
        pairs only."""
        if self.mtp is None:
            raise InputError(self.path, "this GGUF has no MTP head (no blk.N.nextn.* tensors)")
        if not 0 <= head < self.n_heads:
            raise ValueError(f"head {head}: the file has {self.n_heads} MTP head(s)")
        module, cache = self.mtp if head == 0 else self.later_heads[head - 1], self.head_cache(head)
        start = cache.length if use_cache else 0
        logits, normed, raw = module(next_ids.to(self.device), hidden, start, cache if use_cache else None, packing)
        out = MtpOut(as_dtype(logits, torch.float32), normed if self.hidden == "post_norm" else raw)
        again = lambda: self.draft(next_ids, hidden, use_cache=False, packing=packing, head=head)  # noqa: E731
        finite.check(self, "head", out.logits, out.hidden, again if start == 0 else None, start, packing)
        return out
