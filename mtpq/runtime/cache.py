"""One cache protocol for the speculative loop, whatever a layer keeps between calls.

Every layer cache has ``length`` (tokens it has seen), ``checkpoint()`` and
``rollback(checkpoint, n_kept)``: after tokens were appended past a checkpoint,
``rollback`` returns to the state of having consumed exactly the first ``n_kept``
of them (``n_kept=0``: the checkpoint itself). That is all the speculative loop
needs: checkpoint before drafting/verifying, roll back to the accepted prefix.

- :class:`KVCache`: keys/values of an attention layer (also MLA's latent cache: any
  tensors that grow along the sequence). Rolling back is a trim.
- :class:`LengthCache`: nothing but the count (a layer that keeps no state, e.g. a position-wise FFN in a
  mixer's place).
- :class:`RecurrentCache`: a fixed-size state (DeltaNet's matrix state plus its
  short-conv window). It cannot be trimmed, so while a checkpoint is open every
  update records the state after each token; rolling back picks one of them.
  State tensors are replaced, never written in place, so a checkpoint holds plain
  references and costs no copy.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class LayerCache(Protocol):
    length: int

    def checkpoint(self) -> Any: ...

    def rollback(self, checkpoint: Any, n_kept: int) -> None: ...


class LengthCache:
    """The tokens a stateless layer has seen: rolling back only moves the count."""

    def __init__(self) -> None:
        self.length = 0

    def advance(self, n_tokens: int) -> None:
        self.length += n_tokens

    def checkpoint(self) -> int:
        return self.length

    def rollback(self, checkpoint: int, n_kept: int) -> None:
        if checkpoint + n_kept > self.length:
            raise ValueError(f"cannot keep {n_kept} tokens past {checkpoint}: only {self.length} cached")
        self.length = checkpoint + n_kept


class KVCache(LengthCache):
    """Tensors [B, H, T, D] (any number of them) appended along T; grows by doubling."""

    def __init__(self) -> None:
        super().__init__()
        self.buffers: list[torch.Tensor] | None = None

    def update(self, *new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Append each tensor [B, H, T, D] at ``length``; return everything cached so far."""
        need = self.length + new[0].shape[2]
        if self.buffers is None or need > self.buffers[0].shape[2]:
            cap = max(need, 2 * (self.buffers[0].shape[2] if self.buffers is not None else 0), 64)
            grown = [t.new_zeros(t.shape[0], t.shape[1], cap, t.shape[3]) for t in new]
            if self.buffers is not None:
                for g, old in zip(grown, self.buffers):
                    g[:, :, : self.length] = old[:, :, : self.length]
            self.buffers = grown
        for buf, t in zip(self.buffers, new):
            buf[:, :, self.length : need] = t
        self.length = need
        return tuple(buf[:, :, :need] for buf in self.buffers)


class RecurrentCache:
    """A recurrent layer's state: a dict of tensors (e.g. ``{"ssm": ..., "conv": ...}``) after ``length`` tokens."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] | None = None  # None: nothing seen yet (zeros)
        self.length = 0
        self._trail: list[dict[str, torch.Tensor]] | None = None  # states after each token since the checkpoint

    @property
    def recording(self) -> bool:
        """True while a checkpoint is open: the layer must report every intermediate state."""
        return self._trail is not None

    def push(
        self, n_tokens: int, final: dict[str, torch.Tensor], per_token: list[dict[str, torch.Tensor]] | None = None
    ) -> None:
        """``n_tokens`` consumed; ``final`` is the state after them. While recording, ``per_token`` must hold
        the state after each of them (``per_token[-1]`` is ``final``)."""
        if self._trail is not None:
            if per_token is None or len(per_token) != n_tokens:
                raise ValueError("a recurrent layer under a checkpoint must report the state after every token")
            self._trail.extend(per_token)
        self.state = final
        self.length += n_tokens

    def checkpoint(self) -> tuple[int, dict[str, torch.Tensor] | None]:
        self._trail = []
        return self.length, self.state

    def rollback(self, checkpoint: tuple[int, dict[str, torch.Tensor] | None], n_kept: int) -> None:
        length, state = checkpoint
        trail = self._trail or []
        if n_kept and (n_kept > len(trail) or length + len(trail) != self.length):
            raise ValueError(f"cannot keep {n_kept} tokens: {len(trail)} recorded since the checkpoint")
        self.state = trail[n_kept - 1] if n_kept else state  # n_kept=0: back to the checkpoint itself
        self.length = length + n_kept
        self._trail = None
