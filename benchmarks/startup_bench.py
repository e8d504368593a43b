"""Start-up of ``mtpq quantize``: the wall time of the whole command on a GGUF holding one small tensor, the
numba cache warm (issue 37's target: under 0.6 s for every type, an imatrix included).

    python benchmarks/startup_bench.py                                  # Q4_K_M, Q6_K, Q8_0, IQ4_XS, --imatrix
    python benchmarks/startup_bench.py --types Q4_K_M --repeat 11 --no-imatrix
    python benchmarks/startup_bench.py --checkout /path/to/other/mtpq --checkout .   # two checkouts, interleaved

The GGUF is quant_bench's one-tensor file (the GLM-4.5-shaped model's metadata and vocabulary, one 256-row
tensor of attn_q's row length, so its imatrix entry fits), built once into ``--keep`` (with the 420 MB file
quant_bench --whole-file uses). Each type runs once untimed (compiling its kernels if the cache is cold), then
``--repeat`` times, alternating between the types (and the checkouts) so that the machine's load changes hit
them alike -- on a shared machine only numbers from the same run compare; the table
gives the minimum, median and maximum wall time of ``python -m mtpq quantize IN OUT TYPE -q [--imatrix IM]``
as a user's shell would see it (interpreter start and exit included), and the median CPU time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_bench import _cpu_seconds, build_glm_gguf  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="Q4_K_M,Q6_K,Q8_0,IQ4_XS", help="llama-quantize presets")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--no-imatrix", action="store_true", help="without --imatrix (IQ4_XS then needs none here)")
    ap.add_argument(
        "--keep",
        type=Path,
        default=Path(os.environ.get("TMPDIR", "/tmp")) / "mtpq-qbench",
        help="folder of quant_bench's GGUFs (built there if missing)",
    )
    ap.add_argument(
        "--checkout",
        type=Path,
        action="append",
        help="an mtpq checkout to time (its folder as PYTHONPATH), repeatable; default: this one",
    )
    args = ap.parse_args()
    if args.repeat < 1:  # no run: no best time, and every ratio would be inf or NaN
        ap.error("--repeat must be at least 1")
    args.keep = args.keep.resolve()  # the commands run in each checkout's folder
    args.keep.mkdir(parents=True, exist_ok=True)
    _, mini, im = build_glm_gguf(args.keep)
    checkouts = [c.resolve() for c in args.checkout or [Path(__file__).resolve().parents[1]]]
    out = args.keep / "startup-out.gguf"
    runs = [(c, t) for c in checkouts for t in args.types.split(",")]

    # numba keys a kernel's cache entry by its source file's path and time: checkouts sharing a cache folder would
    # evict each other's kernels, so with several each gets its own
    caches = {
        c: {"NUMBA_CACHE_DIR": str(args.keep / "numba" / f"checkout-{i}")} if len(checkouts) > 1 else {}
        for i, c in enumerate(checkouts)
    }

    # as installed: Python's bytecode cache written at the first run and read after (PYTHONDONTWRITEBYTECODE
    # would have every run compile mtpq's sources, ~40 ms)
    base_env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}

    def run(c: Path, t: str) -> None:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "mtpq",
                "quantize",
                str(mini),
                str(out),
                t,
                "-q",
                *([] if args.no_imatrix else ["--imatrix", str(im)]),
            ],
            check=True,
            env={**base_env, "PYTHONPATH": str(c), **caches[c]},
            capture_output=True,
            cwd=c,
        )  # `python -m` puts the working folder first on sys.path, before PYTHONPATH

    for r in runs:
        run(*r)  # warm: compiled once, or loaded from numba's cache
    walls: dict = {r: [] for r in runs}
    cpus: dict = {r: [] for r in runs}
    for _ in range(args.repeat):
        for r in runs:
            c0, t0 = _cpu_seconds(), time.perf_counter()
            run(*r)
            walls[r].append(time.perf_counter() - t0)
            cpus[r].append(_cpu_seconds() - c0)
    print(
        f"mtpq quantize {mini.name} ({mini.stat().st_size / 1e6:.1f} MB) TYPE "
        f"-q{'' if args.no_imatrix else ' --imatrix'}"
        f", {args.repeat} runs each, load average {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)"
    )
    print(f"{'checkout':30} {'type':8} {'min s':>6} {'median s':>8} {'max s':>6} {'cpu s':>6}")
    for c, t in runs:
        w = walls[c, t]
        print(
            f"{str(c)[-30:]:30} {t:8} {min(w):6.3f} {statistics.median(w):8.3f} {max(w):6.3f} "
            f"{statistics.median(cpus[c, t]):6.3f}"
        )


if __name__ == "__main__":
    main()
