"""The file ``llama-perplexity --kl-divergence-base FILE`` writes: a reference model's log-probabilities over the
whole vocabulary at every scored position, kept so that quants can be measured against it later without the
reference model (``mtpq compare --kld-base FILE``, ``llama-perplexity --kl-divergence``). No torch here.

Layout (tools/perplexity/perplexity.cpp, little-endian):

    "_logits_"                      8 bytes
    n_ctx                           uint32
    n_vocab, n_chunk                int32, int32
    tokens                          int32 [n_chunk * n_ctx]   (as tokenized: a chunk's first is replaced by BOS
                                                               at evaluation when the vocabulary adds one)
    per chunk, per scored position  uint16 [nv], nv = 2 * ((n_vocab + 1) // 2) + 4
                                    (positions n_ctx // 2 .. n_ctx - 2, each predicting the next token)

A position's row starts with two float32, scale and min_log_prob; then one uint16 q per token, the
log-probability being ``scale * q + min_log_prob`` (float32), over a range of 16 nats below the maximum.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import InputError

MAGIC = b"_logits_"
HEADER = 8 + 4 + 4 + 4


class KldBase:
    """A ``--kl-divergence-base`` file, memory-mapped; chunks are read one at a time."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        if not self.path.is_file():
            raise InputError(self.path, "no such file" if not self.path.exists() else "not a file")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(HEADER)
        if len(head) < HEADER or head[:8] != MAGIC:
            raise InputError(self.path, "not a llama-perplexity --kl-divergence-base file (no '_logits_' header)")
        self.n_ctx = int(np.frombuffer(head, np.uint32, 1, 8)[0])
        self.n_vocab, self.n_chunk = (int(v) for v in np.frombuffer(head, np.int32, 2, 12))
        if self.n_ctx < 4 or self.n_vocab < 1 or self.n_chunk < 1:
            raise InputError(
                self.path,
                f"header says n_ctx {self.n_ctx}, n_vocab {self.n_vocab}, n_chunk "
                f"{self.n_chunk}: not a usable base file",
            )
        self.first = self.n_ctx // 2
        self.rows = self.n_ctx - 1 - self.first  # scored positions per chunk
        self.nv = 2 * ((self.n_vocab + 1) // 2) + 4
        self._tokens_at = HEADER
        self._probs_at = HEADER + 4 * self.n_ctx * self.n_chunk
        expected = self._probs_at + 2 * self.rows * self.nv * self.n_chunk
        if size != expected:
            whole = max(0, (size - self._probs_at) // (2 * self.rows * self.nv))
            raise InputError(
                self.path,
                f"{size} bytes where {self.n_chunk} chunks of {self.n_ctx} tokens over "
                f"{self.n_vocab} tokens need {expected}: "
                + (f"truncated after {whole} whole chunks" if size < expected else "trailing bytes"),
            )
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")

    def tokens(self, chunk: int) -> list[int]:
        """The chunk's ``n_ctx`` tokens as stored (before any BOS replacement)."""
        a = self._tokens_at + 4 * self.n_ctx * chunk
        return np.frombuffer(self._map[a : a + 4 * self.n_ctx], dtype=np.int32).tolist()

    def log_probs(self, chunk: int) -> np.ndarray:
        """float32 [rows, n_vocab]: the reference's log-probabilities at positions first..n_ctx-2 of the chunk."""
        row_bytes = 2 * self.nv
        a = self._probs_at + row_bytes * self.rows * chunk
        raw = self._map[a : a + row_bytes * self.rows].reshape(self.rows, row_bytes)
        head = raw[:, :8].copy().view(np.float32)  # scale, min_log_prob per row
        q = raw[:, 8 : 8 + 2 * self.n_vocab].copy().view(np.uint16).astype(np.float32)
        out = head[:, :1] * q + head[:, 1:2]  # float32 throughout, as llama-perplexity computes it
        if not np.isfinite(head).all():
            raise InputError(
                self.path,
                f"chunk {chunk + 1} holds non-finite scales: the reference's logits were "
                "NaN or infinite when the file was written",
            )
        return out
