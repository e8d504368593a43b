"""The options several commands share, declared once: a command lists each as a parameter whose default is the
declaration here (Typer reads a command's options from its signature, and the parameter's annotation gives the
type). The quantize options ``quantize`` and ``convert --quant`` share are in :mod:`.quant_options`."""

from __future__ import annotations

import typer

# writing GGUFs: convert, quantize, graft, extract-mtp
QUIET = typer.Option(False, "--quiet", "-q", help="No progress bar or summary.")
THREADS = typer.Option(
    None,
    "--threads",
    "-t",
    help="CPU threads for quantizing (default: every CPU this process may use). The bytes written do not depend on it.",
)
SPLIT_MAX_SIZE = typer.Option(
    None,
    "--split-max-size",
    help="Write shards of at most this much tensor data: bytes, or a number with K, M or G (powers of "
    "1000: 48G, under Hugging Face's 50 GB per file), named OUT-00001-of-0000N.gguf as llama.cpp's "
    "tools name them (a model that fits stays one file, OUT).",
)
SPLIT_MAX_TENSORS = typer.Option(
    None,
    "--split-max-tensors",
    help="Write shards of at most this many tensors (as llama-gguf-split --split-max-tensors).",
)
KEEP_SPLIT = typer.Option(
    False,
    "--keep-split",
    help="Write the shards the input has (each tensor into the shard it came from), as llama-quantize --keep-split.",
)

# measuring: accept, compare, sweep, demo, imatrix
RUNTIME_THREADS = typer.Option(
    None,
    "--threads",
    "-t",
    help="CPU threads for the runtime (default: 1 for a file under 1 GiB, whose ops are too small "
    "to split, else every core).",
)
DEVICE = typer.Option(None, "--device", help="cuda, cuda:1 or cpu (default: cuda when available).")
JSON_REPORT = typer.Option(None, "--json", help="Write the report as JSON here ('-' = stdout).")
MD_REPORT = typer.Option(None, "--md", help="Append the report as Markdown here (e.g. $GITHUB_STEP_SUMMARY).")
NGL = typer.Option(None, "--ngl", help="llama.cpp: layers to offload to the GPU(s) (999 = all).")
DRAFT = typer.Option(3, "--draft", "-k", help="Draft depth k (1..8): tokens the head proposes per round.")


def max_new_tokens(default: int):
    """``--max-new-tokens`` (accept 64; sweep and demo 48, what their tables were measured with)."""
    return typer.Option(default, "--max-new-tokens", "-n", help="Tokens generated per prompt.")


def max_prompts(default: int | None = None, help: str = "Use only the first N prompts."):
    """``--max-prompts`` (accept, sweep: all the prompts; demo: 12 of its 24 held-out ones)."""
    return typer.Option(default, "--max-prompts", help=help)


# measuring options whose flag and default are one and whose help each command words for itself (whose trunk the
# head drafts for, which llama.cpp tools the engine runs)
def head(help: str):
    """``--head`` (accept, compare, imatrix, sweep): a head file (mtp-*.gguf) that drafts for a trunk, as llama.cpp's
    -md."""
    return typer.Option(None, "--head", help=help)


def engine(help: str):
    """``--engine`` (accept, compare, sweep): torch, the bundled runtime (default), or llama.cpp's tools."""
    return typer.Option("torch", "--engine", help=help)


def llama_cpp(help: str):
    """``--llama-cpp`` (accept, compare, sweep): the folder with the llama.cpp tools the engine runs."""
    return typer.Option(None, "--llama-cpp", help=help)
