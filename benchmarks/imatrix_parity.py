"""How far ``mtpq imatrix``'s statistics are from llama-imatrix's, and what decides it.

    python benchmarks/imatrix_parity.py --llama-cpp DIR

On the demo model (GLM-4.5 MoE, f32) and the text tests/runtime/test_runtime_imatrix.py uses (json.decoder and
json.encoder's source), for four chunkings of the same 512 tokens (-c 64/128/256/512): the largest relative
difference of any in_sum2 value between our statistics and llama-imatrix's
- with llama-imatrix's defaults (K/V cached in f16, flash attention),
- with llama-imatrix computing in f32 throughout (-ctk f32 -ctv f32 -fa off),
and how much of it float32 summation alone makes (llama-imatrix adds x*x into a float32 sum token by token; ours
sums in float64): our own activations summed llama-imatrix's way against our sums, next to the worst-case bound
(n - 1) u of a sequential float32 sum of n positive terms (u = 2^-24, n = the most rows of any tensor).
"""

from __future__ import annotations

import argparse
import inspect
import json
import json.decoder
import json.encoder
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

import gguf
import numpy as np
import torch

from mtpq.runtime import imatrix as im
from mtpq.runtime.speculative import load_model
from tests.helpers.runcli import run_cli

CHUNKINGS = ((64, 8), (128, 4), (256, 2), (512, 1))
SETTINGS = {"defaults": (), "f32 (-ctk f32 -ctv f32 -fa off)": ("-ctk", "f32", "-ctv", "f32", "-fa", "off")}


def llama_imatrix(binary: Path, model: Path, calib: Path, out: Path, n_ctx: int, n_chunks: int, extra) -> dict:
    proc = subprocess.run(
        [
            str(binary),
            "-m",
            str(model),
            "-f",
            str(calib),
            "-o",
            str(out),
            "-c",
            str(n_ctx),
            "-b",
            str(n_ctx),
            "--chunks",
            str(n_chunks),
            "--no-ppl",
            "-t",
            "1",
            "--no-repack",
            "--no-escape",
            *extra,
        ],
        capture_output=True,
        text=True,
        errors="replace",
        stdin=subprocess.DEVNULL,
    )
    if proc.returncode:
        raise SystemExit(proc.stderr[-2000:])
    return {t.name: np.array(t.data) for t in gguf.GGUFReader(out).tensors}


class Float32Sums(im._Collector):
    """Our collector, also summing each row's squares llama-imatrix's way: float32, token after token."""

    def __init__(self, n_experts, stats):
        super().__init__(n_experts, stats)
        self.f32: dict[str, np.ndarray] = {}

    def __call__(self, name, expert, x):
        super().__call__(name, expert, x)
        rows = x.reshape(-1, x.shape[-1]).float().numpy()
        if not name.startswith("blk.") or (expert is None and rows.shape[0] < im.MIN_DENSE_ROWS):
            return
        acc = self.f32.setdefault(name, np.zeros((self.n_experts.get(name, 1), rows.shape[1]), dtype=np.float32))
        for r in rows:
            acc[0 if expert is None else expert] += r * r


def largest_relative(ours: dict, theirs: dict) -> tuple[float, str]:
    return max(
        (float(np.max(np.abs(theirs[k].reshape(st.sums.shape) - st.sums) / st.sums)), k)
        for k, st in ours.items()
        if k in theirs
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's build/bin (llama-imatrix)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    text = inspect.getsource(json.decoder) + inspect.getsource(json.encoder)
    with tempfile.TemporaryDirectory(prefix="mtpq-imatrix-parity-") as tmp:
        d = Path(tmp)
        model_path, calib = d / "demo-f32.gguf", d / "calib.txt"
        calib.write_text(text)
        src = Path(str(resources.files("mtpq").joinpath("data/demo")))
        assert run_cli("convert", src, model_path, "--outtype", "f32", "-q").exit_code == 0
        model, tok = load_model(model_path, device="cpu")
        bos = tok.bos_token_id if getattr(tok, "add_bos_token", False) else None
        for n_ctx, n_chunks in CHUNKINGS:
            made = []
            real = im._Collector
            im._Collector = lambda *a: made.append(Float32Sums(*a)) or made[-1]  # collect() builds ours
            try:
                ours = im.collect(model, im.chunk_tokens(tok.encode(text), n_ctx, n_chunks, bos), head=False).tensors
            finally:
                im._Collector = real
            watch = made[0]
            cells = []
            for label, extra in SETTINGS.items():
                theirs = llama_imatrix(
                    args.llama_cpp / "llama-imatrix", model_path, calib, d / "theirs.gguf", n_ctx, n_chunks, extra
                )
                sums = {k[: -len(".in_sum2")]: v for k, v in theirs.items() if k.endswith(".in_sum2")}
                rel, name = largest_relative(ours, sums)
                cells.append(f"{label}: {rel:.2e} ({name})")
            summed = max(float(np.max(np.abs(watch.f32[k] - st.sums) / st.sums)) for k, st in ours.items())
            n = max(int(st.counts.max()) for st in ours.values())
            print(
                f"-c {n_ctx} x {n_chunks}: "
                + "; ".join(cells)
                + f"; float32 summation alone {summed:.2e} (worst case (n-1)u = {(n - 1) * 2.0**-24:.2e}, n = {n})"
            )


if __name__ == "__main__":
    main()
