"""Throughput of mtpq's ggml-exact torch quantization kernels (and llama-quantize's, for scale).

    python benchmarks/quant_bench.py                          # 4096x4096, all types
    python benchmarks/quant_bench.py --rows 1024 --types Q4_K,Q6_K --threads 2
    python benchmarks/quant_bench.py --llama-quantize /path/to/llama-quantize

For every type it prints the time to quantize an f32 matrix of N(0, 0.02^2)
values and the input throughput (MB of f32 per second), and the time and
output throughput of ``dequantize`` (on CPU, or ``--device cuda``).

With ``--llama-quantize``, an F32 GGUF holding the same matrix (one tensor,
``blk.0.ffn_down.weight``) is written with gguf-py, and ``llama-quantize --pure
IN OUT TYPE THREADS`` is timed (wall clock of the whole process: it also reads
and writes the ~64 MB file) for Q8_0, Q4_K and Q6_K with the same thread count;
the ratio printed is ours / theirs in time (above 1: mtpq is slower).

With ``--imatrix`` both quantize with the same importance data: a weight per
column (``exp(N(0, 1.5^2))``, like llama-imatrix's mean squared activations),
given to ours as ``importance=`` and to llama-quantize as an imatrix GGUF
(written by mtpq's imatrix writer, count 1, so the weights reach ggml
unchanged) passed with ``--imatrix``; the types timed against llama-quantize
are then Q4_K, Q6_K, Q4_0, IQ4_XS, IQ2_XXS and IQ3_XXS (ggml's importance-weighted paths;
``--compare`` picks others).  The two
are run alternately and the best of ``--repeat`` runs of each is kept, since a
shared machine's load changes from one second to the next; the last column is
the ratio of CPU time (user + system, workers and llama-quantize's threads
included), which other jobs on the machine disturb less.  The bytes of both
are compared as well.  Figures only, no asserts.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mtpq.quantize.imatrix import Entry, Imatrix, write_imatrix  # noqa: E402
from mtpq.quantize.kernels import SUPPORTED_TYPES, dequantize, quantize  # noqa: E402

ALL = [t.name for t in SUPPORTED_TYPES if t not in (T.F32,)]


def _best_of(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best, out


def _cpu_seconds() -> float:
    """CPU time (user + system) of this process and its reaped children: forked workers, llama-quantize.
    Less sensitive than wall time to other jobs on a shared machine."""
    import resource

    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


def _write_f32_gguf(path: Path, x: np.ndarray) -> None:
    import gguf

    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_context_length(4096)
    w.add_embedding_length(x.shape[1])
    w.add_feed_forward_length(x.shape[0])
    w.add_head_count(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tensor("blk.0.ffn_down.weight", x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# the llama-quantize preset whose --pure output is the tensor type: its IQ2_S preset writes IQ2_XS
# (llama-quant.cpp's default type per ftype); the IQ2_S type comes from the IQ2_M preset
LLAMA_FTYPE = {"IQ2_S": "IQ2_M"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--types", default=",".join(ALL), help="comma-separated ggml type names")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU workers (ours) and threads (llama-quantize)")
    ap.add_argument("--repeat", type=int, default=1, help="best of N runs")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--llama-quantize", type=Path, default=None, metavar="PATH")
    ap.add_argument("--imatrix", action="store_true", help="quantize with importance weights (both sides)")
    ap.add_argument("--compare", default=None, help="types timed against llama-quantize (default: Q8_0,Q4_K,Q6_K; "
                    "with --imatrix Q4_K,Q6_K,Q4_0,IQ4_XS,IQ2_XXS,IQ3_XXS)")
    ap.add_argument("--no-table", action="store_true", help="skip the first table (ours alone, every --types)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(args.seed)
    x = (torch.randn(args.rows, args.cols, generator=g) * 0.02).to(args.device)
    mb = x.numel() * 4 / 1e6
    imp = None
    if args.imatrix:
        rng = np.random.default_rng(args.seed)
        imp = np.exp(rng.normal(0.0, 1.5, args.cols)).astype(np.float32)
    print(f"matrix {args.rows}x{args.cols} f32 = {mb:.1f} MB, device {args.device}, "
          f"{args.threads} threads (torch {torch.__version__}){', with importance weights' if args.imatrix else ''}")
    print(f"{'type':8} {'quantize s':>10} {'in MB/s':>9} {'dequant s':>10} {'out MB/s':>9}")
    for name in [] if args.no_table else args.types.split(","):
        qt = T[name]
        tq, raw = _best_of(lambda: quantize(x, qt, name, importance=imp), args.repeat)
        rawt = torch.from_numpy(np.ascontiguousarray(raw)).to(args.device)
        td, _ = _best_of(lambda: dequantize(rawt, qt, x.shape), args.repeat)
        print(f"{name:8} {tq:10.3f} {mb / tq:9.1f} {td:10.3f} {mb / td:9.1f}", flush=True)

    if args.llama_quantize is None:
        return
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "f32.gguf"
        xs = x.cpu().numpy()
        _write_f32_gguf(src, xs)
        extra, names = [], ["Q8_0", "Q4_K", "Q6_K"]
        if args.imatrix:
            im_file = Path(tmp) / "imatrix.gguf"
            write_imatrix(Imatrix({"blk.0.ffn_down.weight": Entry(imp[None], np.ones(1, dtype=np.float32))},
                                  datasets=["bench"], chunk_count=1, chunk_size=1), im_file)
            extra, names = ["--imatrix", str(im_file)], ["Q4_K", "Q6_K", "Q4_0", "IQ4_XS", "IQ2_XXS", "IQ3_XXS"]
        if args.compare:
            names = args.compare.split(",")
        print(f"\nllama-quantize --pure {' '.join(extra[:1])} ({args.llama_quantize}), {args.threads} threads, "
              "whole-process wall time")
        print(f"{'type':8} {'theirs s':>9} {'in MB/s':>9} {'ours s':>9} {'ours/theirs':>12} {'same bytes':>11}"
              f" {'cpu ours/theirs':>15}")
        for name in names:
            qt = T[name]
            out = Path(tmp) / f"{name}.gguf"
            # interleaved, best of --repeat each: the machine's load changes from second to second
            ours_t, theirs_t, ours_c, theirs_c, raw = float("inf"), float("inf"), float("inf"), float("inf"), None
            for _ in range(args.repeat):
                c0 = _cpu_seconds()
                t, raw = _best_of(lambda: quantize(x, qt, name, importance=imp), 1)
                ours_t, ours_c = min(ours_t, t), min(ours_c, _cpu_seconds() - c0)
                t0, c0 = time.perf_counter(), _cpu_seconds()
                subprocess.run(
                    [str(args.llama_quantize), "--pure", *extra, str(src), str(out), LLAMA_FTYPE.get(name, name),
                     str(args.threads)],
                    check=True, capture_output=True,
                )
                theirs_t, theirs_c = min(theirs_t, time.perf_counter() - t0), min(theirs_c, _cpu_seconds() - c0)
            import gguf

            written = gguf.GGUFReader(out).tensors[0]
            if written.tensor_type != qt:  # a wrong preset mapping would compare two different types
                raise SystemExit(f"llama-quantize wrote {written.tensor_type.name}, not {name}")
            same = np.asarray(written.data).tobytes() == raw.tobytes()
            print(f"{name:8} {theirs_t:9.3f} {mb / theirs_t:9.1f} {ours_t:9.3f} {ours_t / theirs_t:12.2f} {str(same):>11}"
                  f" {ours_c / theirs_c:14.2f}", flush=True)
            out.unlink()


if __name__ == "__main__":
    main()
