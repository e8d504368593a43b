"""A trunk-only GGUF and a head file (``mtp-*.gguf``) seen as one model, the way llama.cpp runs
``-m trunk.gguf -md mtp-head.gguf --spec-type draft-mtp``.

llama.cpp loads the head file as a model of its own: the MTP block reads the trunk's hidden state, and where the
block has no ``nextn.embed_tokens`` / ``nextn.shared_head_head`` / ``nextn.shared_head_norm`` (tied checkpoints:
GLM-4.6, Qwen3.5) it falls back to the *head file's* ``token_embd`` / ``output`` (else ``token_embd``) /
``output_norm``, not the trunk's. The paired view gives the head block those tensors under its nextn names, so
a reader that falls back to the trunk's (the runtime's NextN head) computes what llama.cpp computes.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError
from ..tensors import block_index
from .check import model_mismatches
from .read import GGUFFile

# nextn name of the head block <- the head file's top-level tensors it falls back to, first present wins
TIED = {
    "nextn.embed_tokens.weight": ("token_embd.weight",),
    "nextn.shared_head_head.weight": ("output.weight", "token_embd.weight"),
    "nextn.shared_head_norm.weight": ("output_norm.weight",),
}
# the head file's top-level tensors that are the head's own where the trunk has its own of the same name
# (DeepSeek-V4's output hyper-connection): the paired view puts them under the head block's nextn.
OWN = ("output_hc_fn.weight", "output_hc_base.weight", "output_hc_scale.weight")


class PairedGGUF(GGUFFile):
    """``trunk``'s trunk blocks and top tensors, ``head``'s MTP blocks (a head the trunk carries itself is not
    used: llama.cpp drafts with the -md file's)."""

    def __init__(self, trunk: Path, head: Path):  # noqa: D107  (GGUFFile's fields, built from two files)
        t, h = GGUFFile(Path(trunk)), GGUFFile(Path(head))
        if h.n_mtp == 0 or not any((b := block_index(n)) is not None and b >= h.n_trunk for n in h.tensors):
            raise InputError(h.path, "holds no MTP blocks to draft with")
        problems = model_mismatches(t, h)
        if problems:
            raise InputError(h.path, f"{problems[0]}: not a head for this trunk")
        self.path, self.head_path, self.files, self.arch = t.path, h.path, t.files, t.arch
        self.n_trunk, self.n_mtp, self.n_blocks = t.n_trunk, h.n_mtp, h.n_blocks
        self.kv = dict(t.kv)
        for key, value in h.kv.items():  # block_count, nextn_predict_layers and per-block arrays cover the head
            if key.startswith(f"{self.arch}.") and (key not in self.kv or isinstance(value, list)):
                self.kv[key] = value
        self.kv[f"{self.arch}.block_count"] = h.n_blocks
        self.tensors = {n: r for n, r in t.tensors.items() if (b := block_index(n)) is None or b < self.n_trunk}
        for block in range(h.n_trunk, h.n_blocks):
            self.tensors.update({n: r for n, r in h.tensors.items() if block_index(n) == block})
            for nextn, fallbacks in TIED.items():
                name = f"blk.{block}.{nextn}"
                source = next((f for f in fallbacks if f in h.tensors), None)
                if name not in self.tensors and source is not None:
                    self.tensors[name] = h.tensors[source]._replace(name=name)
            for own in OWN:
                name = f"blk.{block}.nextn.{own}"
                if own in h.tensors and name not in self.tensors:
                    self.tensors[name] = h.tensors[own]._replace(name=name)
