"""One kernel against ggml's, in one process: mtpq's quantizer (the registry's, no engine) and
``ggml_quantize_chunk`` of llama.cpp's libggml-base (ctypes) on the same rows, one thread.

    MTPQ_LLAMA_CPP_BIN=DIR python benchmarks/kernel_ab.py [--types IQ2_XXS,IQ3_S] [--rows 16] [--repeat 7]

The rows are N(0, 0.02^2), 4096 values each, quantized with an importance weight per column
(``exp(N(0, 1.5^2))``, as llama-imatrix's mean squared activations) for the types that take one (not with
``--no-imatrix``). The two run
alternately, ``--repeat`` times; the best thread CPU time of each is kept (what other jobs on a shared machine
disturb least) and the ratio printed is ours / C in throughput (above 1: mtpq is faster). The bytes are
compared: a difference ends the run with exit status 1.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

import numpy as np
from gguf import GGMLQuantizationType as T

from mtpq.ggml import registry

IQUANTS = "IQ2_XXS,IQ2_XS,IQ2_S,IQ3_XXS,IQ3_S,IQ1_S,IQ1_M,IQ4_NL,IQ4_XS"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", default=IQUANTS, help="comma-separated ggml type names (default: the i-quants)")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument(
        "--no-imatrix",
        action="store_true",
        help="the reference quantizers (what llama-quantize runs without --imatrix)",
    )
    a = p.parse_args()
    lib = ctypes.CDLL(os.path.join(os.environ["MTPQ_LLAMA_CPP_BIN"], "libggml-base.so"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ptr, ptr, i64, i64, i64, ptr]
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    n = 4096
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((a.rows, n)) * 0.02).astype(np.float32)
    qw = np.exp(rng.standard_normal(n) * 1.5).astype(np.float32)
    print(f"{'type':8s} {'ours ns/value':>14s} {'C ns/value':>11s} {'ours/C':>7s}")
    for name in a.types.split(","):
        t = T[name]
        rec = registry.record(t)
        weighted = rec.quantize_weighted is not None and not a.no_imatrix
        ours, cq = (rec.quantize_weighted, qw) if weighted else (rec.quantize, None)
        size = a.rows * registry.bytes_per_row(t, n)
        yo, yc = np.zeros(size, np.uint8), np.zeros(size, np.uint8)
        lib.ggml_quantize_init(int(t))
        args = (x.reshape(-1), yo, n) + ((qw,) if cq is not None else ())
        ours(*args)  # compiled, or loaded from numba's cache, before timing
        to, tc = [], []
        for _ in range(a.repeat):
            t0 = time.thread_time()
            ours(*args)
            t1 = time.thread_time()
            lib.ggml_quantize_chunk(
                int(t), x.ctypes.data, yc.ctypes.data, 0, a.rows, n, cq.ctypes.data if cq is not None else None
            )
            t2 = time.thread_time()
            to.append(t1 - t0)
            tc.append(t2 - t1)
        print(f"{name:8s} {min(to) * 1e9 / x.size:14.1f} {min(tc) * 1e9 / x.size:11.1f} {min(tc) / min(to):7.3f}")
        if not np.array_equal(yo, yc):
            print(f"{name}: bytes differ from ggml's", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
