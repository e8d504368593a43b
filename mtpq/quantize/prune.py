"""``--prune-layers L0,L1,...``: llama-quantize's block pruning, with the metadata kept consistent.

llama-quantize (``remap_layer`` in src/llama-quant.cpp) drops every tensor of
the listed blocks, numbers the blocks left 0, 1, 2, ... in their order and sets
``block_count`` to how many are left. Nothing else changes, and that breaks a
file in ways llama.cpp then loads silently or refuses:

- pruning an MTP block leaves ``nextn_predict_layers`` as it was: llama.cpp
  then takes the last trunk block for the head and runs a trunk one block short;
- per-layer arrays (``attention.recurrent_layers``, ``feed_forward_length``,
  ``attention.head_count_kv``, sliding-window patterns ...) keep the old length:
  llama.cpp refuses the file ("wrong array length");
- ``leading_dense_block_count`` keeps counting pruned dense blocks: the first
  MoE block left is loaded as a dense one (missing tensors).

Here the same blocks go and the same renumbering happens (so the trunk's
tensors and choices are llama-quantize's), and the metadata follows:
``nextn_predict_layers`` counts the MTP blocks kept (the key goes with the last
one), per-layer arrays lose the pruned blocks' entries, the dense-block count
counts the dense blocks kept. A pruning that would move a block of a
``full_attention_interval`` pattern onto a position of the other kind (with no
per-layer array to say so) is refused, and so are blocks the model does not
have and a pruning that leaves no trunk.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Sequence

from gguf import GGUFValueType

from ..errors import InputError
from ..tensors import Plan, block_index

OPTION = "--prune-layers"
# arrays of a fixed size that are not per-layer, yet may happen to have block_count entries
_NOT_PER_LAYER = ("rope.dimension_sections",)
_BLOCK = re.compile(r"^blk\.(\d+)\.")


def parse_prune_layers(text: str | Sequence[int] | None) -> tuple[int, ...]:
    """``"0,3,5"`` -> (0, 3, 5): sorted, without repeats, as llama-quantize takes them."""
    if text is None or text == "":
        return ()
    if not isinstance(text, str):
        return tuple(sorted(set(int(i) for i in text)))
    out = set()
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit():
            raise InputError(OPTION, f"{part!r} is not a block number (e.g. --prune-layers 3,4,5)")
        out.add(int(part))
    return tuple(sorted(out))


def prune_blocks(plan: Plan, layers: Sequence[int]) -> Plan:
    """``plan`` without the blocks ``layers``, the others renumbered (each keeps its old name as
    ``input_name``)."""
    if not layers:
        return plan
    arch = plan.arch
    n_blocks, n_trunk = plan.n_trunk_layers + plan.n_mtp_layers, plan.n_trunk_layers
    missing = [b for b in layers if b >= n_blocks]
    if missing:
        raise InputError(
            OPTION,
            f"block {missing[0]} does not exist: the model has blocks 0-{n_blocks - 1} "
            f"({n_trunk} trunk" + (f", {plan.n_mtp_layers} MTP)" if plan.n_mtp_layers else ")"),
        )
    pruned = set(layers)
    kept = [b for b in range(n_blocks) if b not in pruned]
    new_index = {old: new for new, old in enumerate(kept)}
    kept_trunk = [b for b in kept if b < n_trunk]
    if not kept_trunk:
        raise InputError(OPTION, f"prunes every trunk block (0-{n_trunk - 1}): nothing would be left to run")
    _check_interval(plan, kept_trunk, new_index)

    specs = []
    for spec in plan.tensors:
        b = block_index(spec.name)
        if b is None:
            specs.append(spec)
        elif b not in pruned:
            name = _BLOCK.sub(f"blk.{new_index[b]}.", spec.name, count=1)
            specs.append(replace(spec, name=name, input_name=spec.input_name or spec.name))
    n_mtp = len(kept) - len(kept_trunk)
    out = Plan(arch, dict(plan.kv), specs, inputs=list(plan.inputs), n_trunk_layers=len(kept_trunk), n_mtp_layers=n_mtp)
    out.set_kv(f"{arch}.block_count", len(kept), GGUFValueType.UINT32)  # as llama-quantize writes it
    nextn = f"{arch}.nextn_predict_layers"
    if nextn in plan.kv:
        if n_mtp:
            out.set_kv(nextn, n_mtp, plan.kv[nextn].type)
        else:
            out.drop_kv(nextn)  # as a file converted without its head
    dense = f"{arch}.leading_dense_block_count"
    if dense in plan.kv:
        k = int(plan.kv[dense].value)
        out.set_kv(dense, sum(1 for b in kept if b < k), plan.kv[dense].type)
    for key, val in plan.kv.items():
        if val.type != GGUFValueType.ARRAY or not key.startswith(f"{arch}.") or key.endswith(_NOT_PER_LAYER):
            continue
        if len(val.value) == n_blocks:
            out.set_kv(key, [val.value[b] for b in kept], val.type, val.sub_type)
        elif len(val.value) == n_trunk:
            out.set_kv(key, [val.value[b] for b in kept_trunk], val.type, val.sub_type)
    return out


def _check_interval(plan: Plan, kept_trunk: list[int], new_index: dict[int, int]) -> None:
    """Blocks whose kind follows ``full_attention_interval`` (every k-th one full attention) must land on a
    position of the same kind, unless a per-layer ``attention.recurrent_layers`` array says the kinds."""
    arch = plan.arch
    k = plan.kv_value(f"{arch}.full_attention_interval")
    if not k or f"{arch}.attention.recurrent_layers" in plan.kv:
        return
    k = int(k)
    for old in kept_trunk:
        new = new_index[old]
        if ((old + 1) % k == 0) != ((new + 1) % k == 0):
            what = "full-attention" if (old + 1) % k == 0 else "linear-attention"
            raise InputError(
                OPTION,
                f"block {old} ({what}) would become block {new}, where {arch}'s "
                f"full_attention_interval {k} expects the other kind: prune whole runs of {k} "
                "blocks",
            )
