"""``mtpq imatrix``: importance data from our runtime, for the trunk and for the MTP head llama-imatrix never runs."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.progress import Progress

from . import options
from .app import app
from .common import check_device, check_runtime, console, fail, guarded, out


@app.command(
    epilog=(
        "Examples:\n\n"
        "  mtpq imatrix air-bf16.gguf --text calib.txt -o air.imatrix.gguf            # trunk + head\n\n"
        "  mtpq imatrix air-bf16.gguf --text calib.txt --mtp --merge-into llama.imatrix.gguf -o merged.gguf\n\n"
        "  mtpq quantize air-bf16.gguf air-iq2.gguf IQ2_XXS --imatrix merged.gguf --mtp-type iq3_xxs\n\n"
        "The text is read as is (llama-imatrix turns '\\n' in the text into a newline unless given --no-escape); "
        "chunks follow llama-imatrix: whole --chunk-token windows, BOS first when the vocabulary adds one."
    )
)
@guarded
def imatrix(
    model: Path = typer.Argument(..., help="GGUF to collect statistics with (f16/bf16/f32 or a good quant)."),
    text: Path = typer.Option(..., "--text", "-f", help="Calibration text file."),
    output: Path = typer.Option(..., "--output", "-o", help="imatrix file to write (GGUF format, as llama-imatrix's)."),
    chunk: int = typer.Option(512, "--chunk", "-c", help="Tokens per chunk (llama-imatrix's -c)."),
    chunks: int = typer.Option(None, "--chunks", help="Use at most this many chunks (default: all)."),
    mtp: bool = typer.Option(False, "--mtp", help="Only the MTP head (to add to a llama-imatrix file)."),
    head: Path = options.head(
        "A head file (mtp-*.gguf) that drafts for MODEL's trunk, as llama.cpp's -md (DeepSeek-V4's head lives "
        "in its own file)."
    ),
    merge_into: Path = typer.Option(
        None,
        "--merge-into",
        help="An existing imatrix (e.g. llama-imatrix's): keep its entries and add ours "
        "for tensors it lacks (the head); written to --output.",
    ),
    device: str = options.DEVICE,
    threads: int = typer.Option(None, "--threads", help="CPU threads for the runtime (default: 1 for small models)."),
) -> None:
    """Collect importance statistics (llama-imatrix's sums of squared activations) with the bundled runtime.

    Unlike llama-imatrix, the MTP head is run too -- the way it drafts, on the trunk's
    post-norm hidden states and the next tokens -- so `mtpq quantize --imatrix` and
    `llama-quantize --imatrix` can give the head importance-weighted low-bit types.
    """
    import numpy as np
    import torch

    from ..gguf_io import check_not_an_input, shard_paths
    from ..quantize.imatrix import Entry, Imatrix, read_imatrix, write_imatrix
    from ..runtime.importance import chunk_tokens, collect
    from ..runtime.speculative import load_model

    if chunk < 2:
        fail("--chunk", f"must be at least 2 tokens, got {chunk}")
    if chunks is not None and chunks < 1:
        fail("--chunks", f"must be at least 1, got {chunks}")
    device = check_device(device)
    for p in (model, text, merge_into, head):
        if p is not None and not p.is_file():
            fail(str(p), "no such file")
    check_not_an_input(output, [*shard_paths(model), *(p for p in (text, merge_into) if p is not None)])
    check_runtime(
        [model] + ([head] if head is not None else []), "imatrix", "llama-imatrix collects the trunk's statistics"
    )
    base = read_imatrix(merge_into) if merge_into is not None else None
    try:
        calib = text.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        fail(str(text), "not UTF-8 text")
    torch.set_num_threads(threads or 1)  # tiny models: a second spinning thread only costs (see DESIGN.md)

    net, tok = load_model(model, device=device, head=head)
    if mtp and net.mtp is None:
        fail(str(model), "has no MTP head (--mtp collects only the head's statistics)")
    bos = tok.bos_token_id if getattr(tok, "add_bos_token", False) else None
    windows = chunk_tokens(tok.encode(calib), chunk, chunks, bos)
    if not windows:
        fail(str(text), f"tokenizes to fewer than --chunk {chunk} tokens: nothing to collect")
    with Progress(console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task(f"imatrix: {model.name}", total=len(windows))
        stats = collect(
            net, windows, trunk=not mtp, head=True, on_chunk=lambda i, n: progress.update(task, completed=i)
        )

    entries = {
        name: Entry(st.sums.astype(np.float32), st.counts.astype(np.float32)) for name, st in stats.tensors.items()
    }
    if base is not None:
        if base.legacy:
            fail(str(merge_into), "is a legacy .dat imatrix; merge into a GGUF imatrix (llama-imatrix's default)")
        added = {k: v for k, v in entries.items() if k not in base.entries}
        base.entries.update(added)
        base.tensor_order = []  # a new tensor set: written in llama-imatrix's sorted order
        result, what = base, f"{len(added)} entries added to {merge_into.name}'s {len(base.entries) - len(added)}"
    else:
        result = Imatrix(entries, datasets=[text.name], chunk_count=stats.chunks, chunk_size=chunk)
        what = f"{len(entries)} entries"
    write_imatrix(result, output)
    n_head = sum(1 for k in entries if net.mtp is not None and k.startswith(f"blk.{len(net.blocks)}."))
    out.print(f"{output}: {what} ({n_head} for the MTP head), {stats.chunks} chunks of {chunk} tokens")
