"""``--mtp-type auto``: the head's type chosen by measuring, not guessed.

The trunk is quantized once (the head kept as the input has it) into a temporary file beside OUT; every
candidate head type is quantized alone from the input and drafts from that trunk's hidden states
(:mod:`mtpq.workflows.headsweep`); the narrowest type within ``--max-drop`` of the f16 head's acceptance is
grafted in, the trunk's bytes copied, to OUT. The choice and its figures are printed and recorded in OUT
(``mtpq.mtp_type_auto``, a JSON string).

A head file (``mtp-*.gguf``: the MTP block without the trunk, DeepSeek-V4's form) is measured on the trunk file it
drafts for (``quantize HEAD OUT PRESET --mtp-type auto --trunk TRUNK``): that trunk is quantized with PRESET into the
temporary file, and OUT is the head file with the chosen type (the head file's other tensors by PRESET).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Callable, ContextManager

from gguf import GGUFValueType

from ..gguf_io import partial_folder, plan_from_gguf, write_plan

# progress(description, total bytes) -> a context yielding advance(nbytes, label)
Progress = Callable[[str, int], ContextManager[Callable[[int, str], None]]]


def _no_progress(description: str, total: int) -> ContextManager[Callable[[int, str], None]]:
    return contextlib.nullcontext(lambda n, label="": None)


def quantize_with_auto_head(
    src: Path,
    dst: Path,
    before,
    trunk_plan,
    options,
    max_drop: float,
    prompts: str,
    split=None,
    progress: Progress = _no_progress,
    say: Callable[[str], None] | None = None,
    head_file: bool = False,
):
    """Write ``dst`` (split by ``split``, a SplitRule) with the measured head type; returns the plan and the files
    written. ``trunk_plan`` is the trunk quantized by ``options`` (the job's QuantOptions) with the head kept; each
    candidate head is quantized by the same options at its own type. ``progress`` (a byte bar) and ``say`` (a line)
    report to a person; by default nothing is shown. ``head_file``: ``src`` is a head file and ``trunk_plan`` the
    quantized trunk it drafts for (see above)."""
    from ..acceptance.prompts import load_prompts
    from ..quantize.pipeline import plan_quantize
    from ..quantize.surgery import plan_graft
    from ..runtime.accept import use_threads
    from .headsweep import AUTO_CANDIDATES, AUTO_KEY, AutoChoice, choose_head_type, head_plan, head_rates

    if before.n_mtp_layers == 0:
        from ..errors import InputError

        raise InputError(src, "has no MTP head to choose a type for")
    pairs = load_prompts(prompts)
    use_threads(src if src.is_file() else next(iter(before.inputs), src), None)
    with partial_folder(dst) as tmp:  # the trunk and the candidate heads; removed whatever happens
        trunk_file = tmp / "trunk.gguf"
        with progress(f"quantize trunk -> {dst.name}", _nbytes(trunk_plan)) as advance:
            write_plan(trunk_plan, trunk_file, on_tensor=lambda spec, n: advance(n, spec.name))
        if say:
            say(
                f"measuring {len(AUTO_CANDIDATES)} head types on the {options.preset.name} trunk ({len(pairs)} prompts)"
            )
        rates = head_rates(
            trunk_file,
            before,
            options,
            list(AUTO_CANDIDATES),
            [p for _, p in pairs],
            workdir=tmp,
            head=src if head_file else None,
        )
        choice = AutoChoice(choose_head_type(rates, max_drop), max_drop, rates)
        if head_file:  # the whole head file, its MTP block at the chosen type
            final = plan_quantize(before, options.with_mtp_type(choice.head_type))
        else:
            head = head_plan(before, options, choice.head_type)
            final = plan_graft(head, plan_from_gguf(trunk_file), replace=True)  # the trunk's bytes copied
        final.set_kv(AUTO_KEY, json.dumps(choice.to_dict(), sort_keys=True), GGUFValueType.STRING)
        final.inputs = [src, *before.inputs, trunk_file]
        shard = {s.name: s.shard for s in before.tensors}  # --keep-split: the input's layout, not the trunk file's
        final.tensors = [dataclasses.replace(s, shard=shard.get(s.name, 0)) for s in final.tensors]
        written = write_plan(final, dst, split=split)
    line = ", ".join(f"{t} {100 * r.rate:.1f} %" for t, r in rates.items())
    if say:
        say(
            f"--mtp-type auto: {choice.head_type} (within {100 * max_drop:.1f} points of f16's "
            f"{100 * choice.baseline:.1f} %; {line})"
        )
    return final, written


def _nbytes(plan) -> int:
    from ..gguf_io import tensor_nbytes

    return sum(tensor_nbytes(s.shape, s.ggml_type) for s in plan.tensors)
