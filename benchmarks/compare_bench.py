"""``mtpq compare`` next to llama-perplexity, and ``mtpq sweep`` next to the per-pair sweep it replaced, in one run.

    python benchmarks/compare_bench.py --llama-cpp DIR [-c 128] [--threads 2] [--repeat 3]

On the bundled GLM demo model (converted to f16 and quantized to Q4_K_M here), text = Python's own source
files (what the demo model was trained on; the same bytes for both engines):

1. ``mtpq compare f16 q4km -f text -c C`` (the trunk's KLD table AND the head's acceptance column; model
   loading included) next to llama-perplexity's trunk statistics alone: ``--kl-divergence-base`` on f16 then
   ``--kl-divergence`` on Q4_K_M, the two runs a user needs for the same table; both with ``--threads``.
2. ``mtpq sweep`` (5 head types x 3 trunk presets: the trunk quantized 3 times, one trunk pass per preset)
   next to the per-pair version it replaced (15 full quantizations, each file measured alone with the k=1
   estimator), same prompts.

Each pair alternates ``--repeat`` times; the medians and their ratio are printed (wall-clock and CPU seconds,
children included: on a loaded machine the CPU ratio is the steadier one).
"""

from __future__ import annotations

import argparse
import inspect
import json
import json.decoder
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

HEADS, TRUNKS = ["f16", "q8_0", "q6_k", "q4_k", "q2_k"], ["Q8_0", "Q4_K_M", "Q2_K"]


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process and its children) of fn()."""
    r0, c0, t0 = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
        time.perf_counter(),
    )
    fn()
    t1, r1, c1 = (
        time.perf_counter(),
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    cpu = sum(getattr(b, f) - getattr(a, f) for a, b in ((r0, r1), (c0, c1)) for f in ("ru_utime", "ru_stime"))
    return t1 - t0, cpu


def mtpq(*args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "mtpq", *map(str, args)],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--llama-cpp",
        type=Path,
        default=os.environ.get("MTPQ_LLAMA_CPP_BIN"),
        help="folder with llama-perplexity (default: $MTPQ_LLAMA_CPP_BIN)",
    )
    ap.add_argument("-c", "--ctx-size", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--skip-sweep", action="store_true")
    a = ap.parse_args()
    if a.llama_cpp is None or not (Path(a.llama_cpp) / "llama-perplexity").is_file():
        sys.exit("pass --llama-cpp DIR (llama.cpp's build/bin with llama-perplexity)")
    ppl = Path(a.llama_cpp) / "llama-perplexity"
    with tempfile.TemporaryDirectory(prefix="mtpq-compare-bench-") as d:
        d = Path(d)
        src = Path(str(resources.files("mtpq").joinpath("data/demo")))
        f16, q4 = d / "f16.gguf", d / "q4km.gguf"
        mtpq("convert", src, f16, "--outtype", "f16", "-q")
        mtpq("quantize", f16, q4, "Q4_K_M", "-q")
        text = d / "text.txt"
        text.write_text(inspect.getsource(json.decoder) * 2 + inspect.getsource(inspect)[:40000])
        report = d / "r.json"

        def ours():
            mtpq("compare", f16, q4, "-f", text, "-c", a.ctx_size, "--threads", a.threads, "--json", report)

        def theirs():
            base = d / "base.kld"
            common = ["-f", str(text), "-c", str(a.ctx_size), "-t", str(a.threads)]
            subprocess.run([ppl, "-m", f16, *common, "--kl-divergence-base", base], check=True, capture_output=True)
            subprocess.run(
                [ppl, "-m", q4, *common, "--kl-divergence-base", base, "--kl-divergence"],
                check=True,
                capture_output=True,
            )

        rows = {"mtpq compare (trunk + head)": [], "llama-perplexity base + kld": []}
        for _ in range(a.repeat):
            rows["mtpq compare (trunk + head)"].append(timed(ours))
            rows["llama-perplexity base + kld"].append(timed(theirs))
        figures = json.loads(report.read_text())
        print(
            f"compare, demo GLM f16 vs Q4_K_M, -c {a.ctx_size}, {figures['chunks']} chunks, {a.threads} threads, "
            f"median of {a.repeat}:"
        )
        _print(rows)
        if a.skip_sweep:
            return
        from mtpq.acceptance.prompts import load_prompts  # noqa: F401  (fails early if mtpq is not importable)

        prompts = ["--prompts", "demo_heldout", "--max-prompts", "8", "-n", "32"]

        def new_sweep():
            mtpq("sweep", f16, "--mtp", ",".join(HEADS), "--trunk", ",".join(TRUNKS), *prompts, "--threads", a.threads)

        def per_pair():  # what sweep did before: every pair quantized in full and measured alone
            for t in TRUNKS:
                for m in HEADS:
                    q = d / f"{t}-{m}.gguf"
                    mtpq("quantize", f16, q, t, "--mtp-type", m, "-q")
                    mtpq("accept", q, "--draft", "1", *prompts, "--threads", a.threads, "--json", d / "a.json")
                    q.unlink()

        rows = {"mtpq sweep (5 heads x 3 presets)": [], "per-pair quantize + accept": []}
        for _ in range(a.repeat):
            rows["mtpq sweep (5 heads x 3 presets)"].append(timed(new_sweep))
            rows["per-pair quantize + accept"].append(timed(per_pair))
        print(f"sweep, demo GLM, 8 prompts x 32 tokens, median of {a.repeat}:")
        _print(rows)


def _print(rows: dict[str, list[tuple[float, float]]]) -> None:
    (na, a), (nb, b) = rows.items()
    wa, ca = statistics.median(w for w, _ in a), statistics.median(c for _, c in a)
    wb, cb = statistics.median(w for w, _ in b), statistics.median(c for _, c in b)
    print(f"  {na:36s} {wa:7.2f} s wall {ca:7.2f} s CPU")
    print(f"  {nb:36s} {wb:7.2f} s wall {cb:7.2f} s CPU")
    print(f"  ratio (first / second): {wa / wb:.2f}x wall, {ca / cb:.2f}x CPU")


if __name__ == "__main__":
    main()
