"""Non-finite logits or hidden states stop a measurement, named where they first appear.

:func:`check` runs on every output of :meth:`MtpModel.trunk` and :meth:`MtpModel.draft`: one reduction over the
logits and one over the hidden states (a sum in float32 is non-finite exactly when a value is, or when finite values
overflow it, which a second, exact look tells apart). Only once a non-finite value is seen is it localised:

1. the pass is run again (uncached, as it was: a pass from position 0) with a hook on each block that stops at the
   first block whose input or output holds a non-finite value, and names the position;
2. the weights of that stage (the token embeddings, block i, or the final norm and output matrix) are dequantized
   and checked. A weight holding NaN or inf is a broken file: :class:`~mtpq.errors.InputError` naming the tensor
   (exit 2). Finite weights whose activations are not finite are a failed measurement:
   :class:`~mtpq.errors.MeasurementError` naming the layer and position (exit 1 where the command gates).

A decoding step after cached tokens cannot be run again alone: there every weight of the part (trunk or head) is
checked, in the order the pass reads them, and the output's first non-finite position is named.
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import accumulate
from typing import Callable

import torch

from ..errors import InputError, MeasurementError

_locating = {"on": False}  # a re-run in progress: its own outputs are not checked again


def all_finite(t: torch.Tensor) -> bool:
    """Every value of ``t`` is finite (one reduction; the exact test only when the sum is not finite)."""
    if bool(torch.isfinite(t.sum(dtype=torch.float32))):
        return True
    return bool(torch.isfinite(t).all())


def check(
    model,
    part: str,
    logits: torch.Tensor,
    hidden: torch.Tensor,
    rerun: Callable[[], object] | None,
    start: int = 0,
    packing=None,
) -> None:
    """Raise if ``logits`` or ``hidden`` (an output of ``model``'s ``part``: "trunk" or "head") holds a non-finite
    value. ``rerun`` repeats the pass uncached from position 0 (None for a step after cached tokens).

    Off the CPU, inside :func:`deferred`, the test stays on the device (reading it back would wait for the GPU)
    and :func:`settle` reads every one at once."""
    if _locating["on"]:
        return
    pending = getattr(model, "finite_pending", None)
    if pending is not None and _defers(logits.device):
        ok = torch.isfinite(hidden.sum(dtype=torch.float32)) & torch.isfinite(logits.sum(dtype=torch.float32))
        pending.append((ok, (model, part, logits, hidden, None, start, packing)))
        return
    if all_finite(hidden) and all_finite(logits):
        return
    what = "hidden states" if not all_finite(hidden) else "logits"
    stages = _trunk_stages(model) if part == "trunk" else _head_stages(model)
    found = _locate(stages, rerun, packing) if rerun is not None else None
    if found is None:  # not reproduced by a pass of its own: every stage's weights, in order
        for _, _, names in stages:
            _check_weights(model, names)
        x = hidden if what == "hidden states" else logits if logits.shape[:2] == hidden.shape[:2] else None
        where = f"at {_position(x, packing, start)}" if x is not None else "in its logits"
        raise MeasurementError(
            model.path,
            f"non-finite {what} from the {_PART[part]} {where}; every weight of it is "
            f"finite (computed in {_dtype(model)})",
        )
    label, names, x = found
    _check_weights(model, names)
    raise MeasurementError(
        model.path,
        f"non-finite {what} from the {_PART[part]}: first in {label} at "
        f"{_position(x, packing, start)}; its weights are finite (computed in "
        f"{_dtype(model)})",
    )


_PART = {"trunk": "trunk", "head": "MTP head"}


def _defers(device: torch.device) -> bool:
    """Whether a finite test on ``device`` waits for a read-back of its own (not on the CPU)."""
    return device.type != "cpu"


class deferred:
    """``with deferred(model) as tests:`` the outputs' finite tests of the passes inside stay on the device;
    ``tests.all_ok()`` is one device bool to read back with the caller's own read-back, and ``tests.settle()``
    raises as :func:`check` would for the first pass that was not finite (on the CPU every pass is checked at
    once, and both are no-ops)."""

    def __init__(self, model):
        self.model, self.pending = model, []

    def __enter__(self):
        self.model.finite_pending = self.pending
        return self

    def __exit__(self, *exc):
        self.model.finite_pending = None

    def all_ok(self, device: torch.device) -> torch.Tensor:
        if not self.pending:
            return torch.ones((), dtype=torch.bool, device=device)
        return torch.stack([ok for ok, _ in self.pending]).all()

    def settle(self) -> None:
        self.model.finite_pending = None
        for _, args in self.pending:
            check(*args)


def _dtype(model) -> str:
    return str(model.dtype).replace("torch.", "")


# ----------------------------------------------------------------------------- stages

# a stage: (what it is called, the module whose input (pre) or output is checked, the GGUF tensors it reads)
Stage = tuple[str, tuple[torch.nn.Module, str] | None, list[str]]


def _names(model, *prefixes: str, exclude: str | None = None) -> list[str]:
    return [n for n in model.family.file.tensors if n.startswith(prefixes) and not (exclude and exclude in n)]


def _trunk_stages(model) -> list[Stage]:
    """The token embeddings (checked as block 0's input), each block (its output), then norm and output matrix."""
    blocks = list(model.blocks)
    out = ["output_norm.weight", "output.weight" if "output.weight" in model.family.file else "token_embd.weight"]
    return [
        ("the token embeddings (token_embd)", (blocks[0], "pre"), ["token_embd.weight"]),
        *((f"layer {i} (blk.{i})", (b, "post"), _names(model, f"blk.{i}.")) for i, b in enumerate(blocks)),
        ("the output norm and output matrix", None, out),
    ]


def _head_stages(model) -> list[Stage]:
    """The head's input (embedding, enorm/hnorm, eh_proj: the block's input), its block, its norm and head."""
    n, head = len(model.blocks), model.mtp
    top = [] if not head.tied_embed else ["token_embd.weight"]
    tail = (
        [] if not head.tied_head else ["output.weight" if "output.weight" in model.family.file else "token_embd.weight"]
    )
    nextn = f"blk.{n}.nextn."
    return [
        (
            f"the MTP head's input projection ({nextn}eh_proj)",
            (head.block, "pre"),
            top + [f"{nextn}{k}.weight" for k in ("embed_tokens", "enorm", "hnorm", "eh_proj")],
        ),
        (f"the MTP block (blk.{n})", (head.block, "post"), _names(model, f"blk.{n}.", exclude=".nextn.")),
        (
            "the MTP head's norm and output matrix",
            None,
            [f"{nextn}shared_head_norm.weight", f"{nextn}shared_head_head.weight", "output_norm.weight"] + tail,
        ),
    ]


class _Found(Exception):
    def __init__(self, index: int, x: torch.Tensor):
        self.index, self.x = index, x


def _locate(stages: list[Stage], rerun: Callable[[], object], packing) -> tuple[str, list[str], torch.Tensor] | None:
    """(stage label, its tensors, the first non-finite activation) of a re-run with a hook per stage; None when
    the re-run's outputs are finite again, or no stage but the last saw a non-finite value."""
    hooks = []

    def watch(i: int, x) -> None:
        if isinstance(x, torch.Tensor) and not all_finite(x):
            raise _Found(i, x)

    for i, (_, at, _) in enumerate(stages):
        if at is None:
            continue
        module, when = at
        if when == "pre":
            hooks.append(module.register_forward_pre_hook(lambda m, args, i=i: watch(i, args[0])))
        else:
            hooks.append(module.register_forward_hook(lambda m, args, out, i=i: watch(i, out)))
    _locating["on"] = True
    try:
        out = rerun()
    except _Found as f:
        label, _, names = stages[f.index]
        return label, names, f.x
    finally:
        _locating["on"] = False
        for h in hooks:
            h.remove()
    logits, hidden = out.logits, out.hidden
    if all_finite(logits) and all_finite(hidden):
        return None
    label, _, names = stages[-1]
    return label, names, logits if all_finite(hidden) else hidden


def _check_weights(model, names: list[str]) -> None:
    """InputError naming the first of ``names`` (those in the file) holding NaN or inf, with its shard's path."""
    from .weights import QWeight

    g = model.family.file
    shard_of = {t.name: g.files.paths[s] for t, s in g.files.tensors}
    for name in names:
        if name not in g:
            continue
        w = QWeight.from_reader(g.tensors[name], g.shape(name), "cpu", torch.float32)
        mats = [w.dequant()] if len(w.shape) < 3 else (w.dequant(e) for e in range(w.shape[0]))
        bad = nan = total = 0
        for m in mats:
            bad += int((~torch.isfinite(m)).sum())
            nan += int(torch.isnan(m).sum())
            total += m.numel()
        if bad:
            kinds = " and ".join(k for k, c in (("NaN", nan), ("inf", bad - nan)) if c)
            raise InputError(
                shard_of[name],
                f"tensor {name} holds {kinds} ({bad:,} of {total:,} values are not finite): the file is broken",
            )


def _position(x: torch.Tensor, packing, start: int) -> str:
    """Where the first non-finite row of ``x`` [B, T, ...] sits: its token position (and sequence, in a batch or
    a packed pass); rows that are neither a pass's nor its kept ones (some logits only) by their index."""
    bad = ~torch.isfinite(x.reshape(x.shape[0], x.shape[1], -1)).all(dim=-1)
    b, t = (int(i) for i in bad.nonzero()[0])
    if packing is None:
        return f"position {start + t}" + (f" of sequence {b}" if x.shape[0] > 1 else "")
    if x.shape[1] == packing.positions.shape[1]:
        lengths, positions = packing.lengths, packing.positions
    elif packing.kept is not None and x.shape[1] == packing.kept.numel():  # the kept rows of each sequence
        lengths, positions = [n - f for n, f in zip(packing.lengths, packing.firsts)], packing.out_positions
    else:
        return f"row {t} of its logits"
    return f"position {int(positions[0, t])} of packed sequence {bisect_right(list(accumulate(lengths)), t)}"
