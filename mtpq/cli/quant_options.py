"""The quantize options ``mtpq quantize`` and ``mtpq convert --quant`` share, declared once, and
:func:`quant_options`, which parses them once into the job's :class:`~mtpq.quantize.pipeline.QuantOptions`.

A command lists each option as a parameter whose default is the declaration here (Typer reads a command's options
from its signature); what they mean and how they are checked lives in :func:`mtpq.quantize.pipeline.parse_options`.
In ``convert`` every one of them needs ``--quant``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import typer

TYPES_HELP = "q8_0, q6_k, q5_k, q4_k, q3_k, q2_k, q5_0, q5_1, q4_0, q4_1, iq4_nl, iq4_xs, f16, bf16 or f32"

MTP_TYPE = typer.Option(
    None,
    "--mtp-type",
    help="Type of every MTP-block tensor: q8_0 (default), f16, bf16, q6_k, ...; 'keep' (the type "
    "it has in the input) or 'same' (treat like the trunk, as llama-quantize does); 'auto': "
    "the narrowest of f16, q8_0, q6_k, q5_k, q4_k, q3_k, q2_k whose greedy acceptance on "
    "the quantized trunk stays within --max-drop of the f16 head's. "
    "Float presets default to same.",
)
MAX_DROP = typer.Option(
    0.02, "--max-drop", help="With --mtp-type auto: the acceptance a head may lose against the f16 head (a fraction)."
)
PROMPTS = typer.Option(
    "builtin", "--prompts", help="With --mtp-type auto: the prompts to measure on ('builtin' or a JSONL file)."
)
MTP_EXPERTS_TYPE = typer.Option(
    None, "--mtp-experts-type", help="Type of the MTP block's routed experts (*_exps); default: --mtp-type."
)
TENSOR_TYPE = typer.Option(
    None, "--tensor-type", help="REGEX=TYPE, repeatable, first match wins; beats the preset and the MTP rule."
)
TENSOR_TYPE_FILE = typer.Option(
    None,
    "--tensor-type-file",
    help="A file of REGEX=TYPE entries separated by spaces or newlines (as "
    "llama-quantize reads it), after the --tensor-type ones; repeatable.",
)
OUTPUT_TENSOR_TYPE = typer.Option(None, "--output-tensor-type", help=f"Type of output.weight: {TYPES_HELP}.")
TOKEN_EMBEDDING_TYPE = typer.Option(None, "--token-embedding-type", help="Type of token_embd.weight.")
LEAVE_OUTPUT_TENSOR = typer.Option(
    False,
    "--leave-output-tensor",
    help="Leave output.weight as it is in the input (beats --output-tensor-type; a "
    "tied token_embd is still quantized), as llama-quantize.",
)
OVERRIDE_KV = typer.Option(
    None,
    "--override-kv",
    help="KEY=TYPE:VALUE (TYPE int, float, bool or str), repeatable: metadata written "
    "to the output and read for the choices, as llama-quantize.",
)
PRUNE_LAYERS = typer.Option(
    None,
    "--prune-layers",
    help="L0,L1,...: drop these blocks and renumber the rest, as llama-quantize; "
    "nextn_predict_layers, per-layer arrays and the dense-block count follow.",
)
IMATRIX = typer.Option(
    None,
    "--imatrix",
    help="Importance matrix (llama-imatrix's GGUF or legacy .dat): the same bytes as llama-quantize --imatrix.",
)
INCLUDE_WEIGHTS = typer.Option(
    None, "--include-weights", help="Use the imatrix only for tensors whose name contains this (repeatable)."
)
EXCLUDE_WEIGHTS = typer.Option(
    None, "--exclude-weights", help="Do not use the imatrix for tensors whose name contains this (repeatable)."
)
PURE = typer.Option(False, "--pure", help="No llama-quantize mix: the preset's base type everywhere.")
ALLOW_REQUANTIZE = typer.Option(
    False,
    "--allow-requantize",
    help="Allow requantizing already-quantized tensors (a checkpoint's stored MXFP4 "
    "experts included), as llama-quantize's flag.",
)


def quant_options(
    preset: str,
    *,
    preset_option: str = "PRESET",
    mtp_type: Optional[str] = None,
    mtp_experts_type: Optional[str] = None,
    tensor_type: Optional[Sequence[str]] = None,
    tensor_type_file: Optional[Sequence[Path]] = None,
    output_tensor_type: Optional[str] = None,
    token_embedding_type: Optional[str] = None,
    leave_output_tensor: bool = False,
    override_kv: Optional[Sequence[str]] = None,
    prune_layers: Optional[str] = None,
    pure: bool = False,
    allow_requantize: bool = False,
    include_weights: Optional[Sequence[str]] = None,
    exclude_weights: Optional[Sequence[str]] = None,
):
    """The job's options from the command line, parsed once (a bad one fails before any file is read); the imatrix
    is read later (``dataclasses.replace(options, imatrix=...)``), after the cheap checks."""
    from ..quantize.pipeline import parse_options

    return parse_options(
        preset,
        mtp_type,
        mtp_experts_type,
        tensor_types=tensor_type or [],
        output_tensor_type=output_tensor_type,
        token_embedding_type=token_embedding_type,
        preset_option=preset_option,
        tensor_type_files=tensor_type_file or [],
        leave_output_tensor=leave_output_tensor,
        kv_overrides=override_kv or [],
        prune_layers=prune_layers,
        pure=pure,
        allow_requantize=allow_requantize,
        include_weights=include_weights or [],
        exclude_weights=exclude_weights or [],
    )
