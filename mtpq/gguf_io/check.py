"""Is this GGUF a sound MTP model? What ``mtpq inspect --check`` reports, for any publisher's file or shard.

The broken files people report: ``nextn_predict_layers`` missing or not matching the blocks that hold the head,
a ``block_count`` that does not count the head, head tensors missing, a head quantized to 2-3 bits (it drafts
almost nothing), and a head file (``mtp-*.gguf``, the ``-md`` of llama.cpp) whose trunk is another model.
Each problem is one line; nothing here needs torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..tensors import block_index, tensor_kind
from .read import GGUFFile

NEXTN_REQUIRED = ("nextn.eh_proj", "nextn.enorm", "nextn.hnorm")  # every family's head (DESIGN.md: MTP math)
HEAD_FILE_REQUIRED = ("token_embd.weight", "output_norm.weight")  # what llama.cpp's loader requires of a head file
LOW_BITS = 4.0
LOW_BITS_RISK = (
    "heads below 4 bits draft badly (measured on one large model: an int4 head accepted 0-4 % of "
    "drafts, an int8 head 39-59 %); requantize it: mtpq graft --replace --mtp-type q8_0"
)


@dataclass(frozen=True)
class Problem:
    file: str
    text: str
    warning: bool = False

    def line(self) -> str:
        return f"{self.file}: {'warning: ' if self.warning else ''}{self.text}"


def bits_per_weight(qtype: GGMLQuantizationType) -> float:
    block, size = GGML_QUANT_SIZES[qtype]
    return 8 * size / block


def _blocks(g: GGUFFile) -> dict[int, set[str]]:
    """Tensor kinds (``attn_q``, ``nextn.eh_proj``, ...) of every block the file holds tensors of."""
    out: dict[int, set[str]] = {}
    for name in g.tensors:
        if (b := block_index(name)) is not None:
            out.setdefault(b, set()).add(tensor_kind(name))
    return out


def _nextn_blocks(blocks: dict[int, set[str]]) -> list[int]:
    return sorted(b for b, kinds in blocks.items() if any(k.startswith("nextn.") for k in kinds))


def is_head_file(g: GGUFFile) -> bool:
    """A head-only file (llama.cpp: no ``blk.0.attn_norm.weight``; here: no trunk block at all) with a head."""
    blocks = _blocks(g)
    return bool(_nextn_blocks(blocks)) and min(blocks) >= _nextn_blocks(blocks)[0]


def _fmt(blocks: list[int]) -> str:
    return ", ".join(f"blk.{b}" for b in blocks) or "none"


def check_model(g: GGUFFile) -> list[Problem]:
    """The problems of one model (a file or a whole split set)."""
    name, arch = str(g.path), g.arch
    problems: list[Problem] = []

    def add(text: str, warning: bool = False) -> None:
        problems.append(Problem(name, text, warning))

    blocks = _blocks(g)
    nextn_at = _nextn_blocks(blocks)
    n_blocks, n_mtp = g.value("block_count"), g.value("nextn_predict_layers")
    if n_blocks is None:
        add(f"{arch}.block_count is missing")
        return problems
    n_blocks = int(n_blocks)
    if blocks and max(blocks) >= n_blocks:
        add(
            f"{arch}.block_count is {n_blocks}, but tensors reach blk.{max(blocks)}: block_count must count the "
            "trunk and the MTP blocks"
        )
        return problems
    if n_mtp is None:
        if nextn_at:
            add(
                f"{arch}.nextn_predict_layers is missing, but {_fmt(nextn_at)} hold MTP tensors (nextn.*): "
                "llama.cpp will not load the head"
            )
        return problems
    n_mtp = int(n_mtp)
    if n_mtp >= n_blocks:
        add(f"{arch}.nextn_predict_layers is {n_mtp}, block_count {n_blocks}: no trunk block is left")
        return problems
    expected = list(range(n_blocks - n_mtp, n_blocks))
    if n_mtp and not nextn_at:
        add(
            f"{arch}.nextn_predict_layers is {n_mtp}, but {_fmt(expected)} hold no MTP tensors: the file declares "
            "a head it lacks (a trunk-only file drops the key, as llama.cpp's converter does with --no-mtp)"
        )
        return problems
    if not n_mtp and nextn_at:
        add(
            f"{arch}.nextn_predict_layers is 0, but {_fmt(nextn_at)} hold MTP tensors (nextn.*): llama.cpp will "
            "not load the head"
        )
        return problems
    if nextn_at != expected:
        add(
            f"{arch}.nextn_predict_layers is {n_mtp} with block_count {n_blocks}, so the head should be "
            f"{_fmt(expected)}, but MTP tensors (nextn.*) are in {_fmt(nextn_at)}"
        )
        return problems
    for text, warning in _head_tensors(g, blocks, expected):
        add(text, warning)
    return problems


def _head_tensors(g: GGUFFile, blocks: dict[int, set[str]], head_blocks: list[int]) -> list[tuple[str, bool]]:
    """(line, is a warning) for missing head tensors (the nextn ones every family has, and what the trunk block
    most like the head block has), a head file's required top tensors, and head weights below 4 bits."""
    found: list[tuple[str, bool]] = []
    trunk = {b: k for b, k in blocks.items() if b < head_blocks[0]}
    for b in head_blocks:
        kinds = blocks.get(b, set())
        missing = [f"blk.{b}.{k}.weight" for k in NEXTN_REQUIRED if k not in kinds]
        if trunk:  # the head block is a decoder block like the trunk block it resembles most
            body = {k for k in kinds if not k.startswith("nextn.")}
            like = max(trunk.values(), key=lambda k: (len(k & body), -len(k - body)))
            missing += [f"blk.{b}.{k}" + ("" if "." in k else ".weight") for k in sorted(like - body)]
        if missing:
            found.append((f"head tensors missing: {', '.join(missing)}", False))
    if not trunk:
        absent = [t for t in HEAD_FILE_REQUIRED if t not in g]
        if absent:
            found.append((f"head file without {', '.join(absent)}: llama.cpp's loader requires it", False))
    low: dict[str, list[str]] = {}
    for tname in g.tensors:
        b = block_index(tname)
        if b is None or b < head_blocks[0] or len(g.shape(tname)) < 2 or ".ffn_gate_inp" in tname:
            continue
        qtype = g.qtype(tname)
        if bits_per_weight(qtype) < LOW_BITS:
            low.setdefault(qtype.name, []).append(tname)
    for qname, tensors in sorted(low.items()):
        bits = bits_per_weight(GGMLQuantizationType[qname])
        found.append(
            (
                f"{len(tensors)} head weights are {qname} ({bits:.2f} bits/weight, e.g. {tensors[0]}): {LOW_BITS_RISK}",
                True,
            )
        )
    return found


def model_mismatches(trunk: GGUFFile, head: GGUFFile) -> list[str]:
    """Why ``head``'s MTP blocks cannot run on ``trunk``'s hidden states: architecture, hidden size, vocabulary,
    trunk layers (what mtpq graft and llama.cpp's -md need to agree)."""
    out = []
    if trunk.arch != head.arch:
        return [f"architecture {head.arch} does not match {trunk.path.name}'s {trunk.arch}"]
    hid_a, hid_b = trunk.value("embedding_length"), head.value("embedding_length")
    if hid_a != hid_b:
        out.append(f"hidden size {hid_b} does not match {trunk.path.name}'s {hid_a}")
    tok_a, tok_b = trunk.kv.get("tokenizer.ggml.tokens"), head.kv.get("tokenizer.ggml.tokens")
    if tok_a is not None and tok_b is not None and list(tok_a) != list(tok_b):
        if len(tok_a) != len(tok_b):
            out.append(f"vocabulary has {len(tok_b)} tokens, {trunk.path.name} {len(tok_a)}")
        else:
            first = next(i for i, (x, y) in enumerate(zip(tok_a, tok_b)) if x != y)
            out.append(
                f"vocabulary differs from {trunk.path.name}'s (token {first}: {tok_b[first]!r} vs {tok_a[first]!r})"
            )
    if trunk.n_trunk != head.n_trunk:
        out.append(
            f"made for {head.n_trunk} trunk layers (block_count minus nextn_predict_layers), but "
            f"{trunk.path.name} has {trunk.n_trunk}"
        )
    return out


def check_pair(trunk: GGUFFile, head: GGUFFile) -> list[Problem]:
    """A trunk and the head file meant for it (``-m trunk -md head``)."""
    return [Problem(str(head.path), m) for m in model_mismatches(trunk, head)]


def check_files(paths: list[Path]) -> tuple[list[Problem], list[GGUFFile]]:
    """Every model given (any shard stands for its split set, counted once), each head file against every trunk
    given with it -> (problems, the models read)."""
    models: list[GGUFFile] = []
    seen = set()
    for p in paths:
        g = GGUFFile(Path(p))
        first = g.files.first.resolve()
        if first not in seen:
            seen.add(first)
            models.append(g)
    problems = [p for g in models for p in check_model(g)]
    heads = [g for g in models if is_head_file(g)]
    trunks = [g for g in models if g not in heads and not _nextn_blocks(_blocks(g))]
    for head in heads:
        for trunk in trunks:
            problems += check_pair(trunk, head)
    return problems, models
