"""Decode speed with and without MTP drafting, and the teacher-forced estimator's speed, in one run.

    python benchmarks/accept_bench.py [MODEL.gguf | --demo glm|qwen35|deepseek] [--prompts demo_heldout] [-n 96]
    python benchmarks/accept_bench.py [MODEL.gguf | --demo ...] --vs-llama-cpp DIR [--report-prompts 20
    --report-tokens 128]

Without MODEL, converts a model to f16 first: ``--demo glm`` (the default) and ``--demo qwen35`` the
bundled demos, ``--demo deepseek`` the tests' tiny DeepSeek-V3 with a drafting "trunk copy" head (one MoE
layer of MLA + 8 experts, hidden 256, tests/builders/tiny_deepseek2.py: random weights, fixed seed, the same file
every time). Prints, for the same prompts: tokens/s of plain greedy decoding (the baseline), of
speculative decoding with k = 1..4 (and each one's ratio to the baseline and its acceptance), and the time
of the teacher-forced depth-1 estimator (the prompts and their greedy continuations packed into passes of
a few thousand tokens) as a ratio to the k=1 loop that it replaces: its first call (which also pays the
first touch of its working set's pages), then the best of 3 more. The machine is shared: quote the ratios.

``--vs-llama-cpp DIR`` adds the time to an acceptance report (``measure_file``: the
k=1 greedy loop over ``--report-prompts`` prompts x ``--report-tokens`` tokens, model
loading included) next to llama.cpp's ``llama-speculative-simple --spec-type draft-mtp
--spec-draft-n-max 1`` run once per prompt on the same GGUF (each run loads the model,
as a user scripting it would), and both engines' acceptance. ``--repeat N`` alternates
the two N times (ours, theirs, ours, ...) and prints the median ratios. Every time is
printed as wall-clock and as CPU seconds (``time.process_time`` / ``RUSAGE_CHILDREN``):
on a loaded machine the CPU ratio is the steadier one.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", type=Path)
    ap.add_argument("--demo", choices=sorted(DEMOS), default="glm", help="the model to convert when no MODEL is given")
    ap.add_argument("--prompts", default="demo_heldout")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=96)
    ap.add_argument("--max-prompts", type=int, default=8)
    ap.add_argument("--device", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--vs-llama-cpp", type=Path, default=None, help="folder with llama-speculative-simple")
    ap.add_argument("--report-prompts", type=int, default=20)
    ap.add_argument("--report-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=1, help="with --vs-llama-cpp: alternate ours and theirs N times")
    ap.add_argument("--report-only", action="store_true", help="with --vs-llama-cpp: skip the decoding speeds")
    ap.add_argument(
        "--busy",
        action="store_true",
        help="with --vs-llama-cpp: repeat the report comparison while "
        "one CPU-burning process per core competes, and print CPU seconds per generated token",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from mtpq.acceptance.metrics import metrics_from_rounds
    from mtpq.acceptance.prompts import load_prompts
    from mtpq.convert import plan_checkpoint
    from mtpq.gguf_io import write_plan
    from mtpq.runtime.speculative import load_model, run_plain, run_speculative, teacher_forced_acceptances

    tmp = None
    path = args.model
    if path is None:
        tmp = tempfile.TemporaryDirectory(prefix="mtpq-bench-")
        path = Path(tmp.name) / f"{args.demo}-f16.gguf"
        from gguf import GGMLQuantizationType as T

        write_plan(plan_checkpoint(DEMOS[args.demo](Path(tmp.name)), outtype=T.F16), path)
    if args.report_only and args.vs_llama_cpp is not None:
        report_vs_llama_cpp(path, args)
        if tmp is not None:
            tmp.cleanup()
        return
    model, tok = load_model(path, device=args.device)
    prompts = [tok.encode(p) for _, p in load_prompts(args.prompts, args.max_prompts)]
    n = args.max_new_tokens
    run_plain(model, prompts[0], 8)  # warm-up

    c0 = time.process_time()
    plain = [run_plain(model, ids, n) for ids in prompts]
    plain_cpu = time.process_time() - c0
    base_tps = sum(len(r.tokens) for r in plain) / sum(r.seconds for r in plain)
    print(
        f"model {path.name}, {len(prompts)} prompts x {n} tokens, device {model.device}, "
        f"{torch.get_num_threads()} torch threads"
    )
    print(f"{'plain greedy':<16} {base_tps:8.1f} tok/s   1.00x   (CPU {plain_cpu:.2f} s)")
    loop_k1_seconds = loop_k1_cpu = None
    for k in (1, 2, 3, 4):
        c0 = time.process_time()
        spec = [run_speculative(model, ids, n, k=k) for ids in prompts]
        cpu = time.process_time() - c0
        m = metrics_from_rounds(spec)
        same = all(s.tokens == p.tokens for s, p in zip(spec, plain))
        print(
            f"{'speculative k=' + str(k):<16} {m.tokens_per_s:8.1f} tok/s   {m.tokens_per_s / base_tps:.2f}x   "
            f"acceptance {100 * m.acceptance_rate:5.1f} %   mean acc. length {m.mean_acceptance_length:.2f}   "
            f"output == plain: {same}   (CPU {cpu:.2f} s, {plain_cpu / cpu:.2f}x)"
        )
        if k == 1:
            loop_k1_seconds, loop_k1_cpu = sum(s.seconds for s in spec), cpu
    seqs = [(ids + p.tokens, len(ids)) for ids, p in zip(prompts, plain)]
    t0, c0 = time.perf_counter(), time.process_time()
    tf = teacher_forced_acceptances(model, seqs)
    tf_seconds, tf_cpu = time.perf_counter() - t0, time.process_time() - c0
    warm = []  # the same call again: no first-touch page faults of its working set (the loop had its warm-up)
    for _ in range(3):
        c0 = time.process_time()
        teacher_forced_acceptances(model, seqs)
        warm.append(time.process_time() - c0)
    rate = sum(sum(t.matches) for t in tf) / sum(len(t.matches) for t in tf)
    loop_rate = sum(t.loop_accepted for t in tf) / sum(t.loop_drafts for t in tf)
    print(
        f"teacher-forced   {tf_seconds:.2f} s for depth-1 acceptance {100 * rate:.1f} % "
        f"(all positions; {100 * loop_rate:.1f} % at the loop's positions) vs the k=1 loop's "
        f"{loop_k1_seconds:.2f} s: {loop_k1_seconds / tf_seconds:.1f}x faster; "
        f"CPU {tf_cpu:.2f} s vs {loop_k1_cpu:.2f} s: {loop_k1_cpu / tf_cpu:.1f}x (first call; again, best of 3: "
        f"CPU {min(warm):.3f} s, {loop_k1_cpu / min(warm):.1f}x)"
    )
    if args.vs_llama_cpp is not None:
        report_vs_llama_cpp(path, args)
        if args.busy:
            import multiprocessing as mp

            burners = [mp.Process(target=_burn, daemon=True) for _ in range(os.cpu_count() or 1)]
            for b in burners:
                b.start()
            try:
                print("with a competing CPU load (one busy process per core):")
                report_vs_llama_cpp(path, args)
            finally:
                for b in burners:
                    b.terminate()
    if tmp is not None:
        tmp.cleanup()


def _bundled(name: str):
    return lambda work: Path(str(resources.files("mtpq").joinpath("data", name)))


def _tiny_deepseek(work: Path) -> Path:
    """The checkpoint of the deepseek2 "copy" checkpoint of tests/helpers/runtime.py (float32, converted to f16
    here)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's test builders
    from tests.builders import tiny_deepseek2

    folder = tiny_deepseek2.deepseek_v3(
        work / "deepseek", dtype=torch.float32, mtp_head_tensors=False, num_hidden_layers=1, first_k_dense_replace=0
    )
    return tiny_deepseek2.trunk_copy_head(folder)


DEMOS = {"glm": _bundled("demo"), "qwen35": _bundled("demo_qwen35"), "deepseek": _tiny_deepseek}


def _burn() -> None:
    while True:
        pass


def _cpu(who) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def report_vs_llama_cpp(path: Path, args) -> None:
    import statistics

    from mtpq.acceptance.prompts import load_prompts

    texts = load_prompts(args.prompts, args.report_prompts)
    walls, cpus = [], []
    for i in range(max(1, args.repeat)):
        ours, ours_cpu, ours_tokens, ours_rate = _ours(path, texts, args)
        theirs, theirs_cpu, theirs_tokens, theirs_rate = _theirs(path, texts, args)
        walls.append(ours / theirs)
        cpus.append(ours_cpu / theirs_cpu)
        print(
            f"  CPU s per generated token: mtpq {1e3 * ours_cpu / ours_tokens:.2f} ms, "
            f"llama-speculative-simple {1e3 * theirs_cpu / theirs_tokens:.2f} ms (model load included on both sides)"
        )
        print(
            f"acceptance report, {len(texts)} prompts x {args.report_tokens} tokens, k=1: mtpq {ours:.1f} s "
            f"(CPU {ours_cpu:.1f} s, {100 * ours_rate:.1f} %), llama-speculative-simple {theirs:.1f} s "
            f"(CPU {theirs_cpu:.1f} s, {100 * theirs_rate:.1f} %): ours/theirs {ours / theirs:.2f}x wall, "
            f"{ours_cpu / theirs_cpu:.2f}x CPU"
        )
    if len(walls) > 1:
        print(
            f"median of {len(walls)} alternating runs: ours/theirs {statistics.median(walls):.2f}x wall, "
            f"{statistics.median(cpus):.2f}x CPU"
        )


def _ours(path: Path, texts, args) -> tuple[float, float, int, float]:
    from mtpq.runtime.accept import measure_file

    t0, c0 = time.perf_counter(), _cpu(resource.RUSAGE_SELF)
    rep = measure_file(
        path,
        texts,
        draft=1,
        max_new_tokens=args.report_tokens,
        with_plain=False,
        device=args.device,
        threads=args.threads,
    )
    ours, ours_cpu = time.perf_counter() - t0, _cpu(resource.RUSAGE_SELF) - c0
    return ours, ours_cpu, sum(len(r.spec.tokens) for r in rep.runs), rep.overall.acceptance_rate


def _theirs(path: Path, texts, args) -> tuple[float, float, int, float]:
    import re
    import subprocess

    drafted = accepted = 0
    t0, c0 = time.perf_counter(), _cpu(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryDirectory(prefix="mtpq-bench-") as d:
        for i, (_, text) in enumerate(texts):
            f = Path(d) / f"p{i}.txt"
            f.write_text(text)
            proc = subprocess.run(
                [
                    str(args.vs_llama_cpp / "llama-speculative-simple"),
                    "-m",
                    str(path),
                    "-f",
                    str(f),
                    "--no-escape",
                    "-n",
                    str(args.report_tokens),
                    "--temp",
                    "0",
                    "--spec-type",
                    "draft-mtp",
                    "--spec-draft-n-max",
                    "1",
                    "--no-repack",
                    "-t",
                    str(args.threads or torch.get_num_threads()),
                ],
                capture_output=True,
                text=True,
                errors="replace",
                stdin=subprocess.DEVNULL,
            )
            dn = re.search(r"n_drafted\s*=\s*(\d+)", proc.stderr)
            an = re.search(r"n_accept\s*=\s*(\d+)", proc.stderr)
            # its logger may not drain before exit: the time still counts, the rate is over the prompts it printed
            if dn and an:
                drafted, accepted = drafted + int(dn[1]), accepted + int(an[1])
    theirs, theirs_cpu = time.perf_counter() - t0, _cpu(resource.RUSAGE_CHILDREN) - c0
    theirs_tokens = len(texts) * args.report_tokens  # llama-speculative-simple generates -n tokens (upper bound)
    return theirs, theirs_cpu, theirs_tokens, accepted / max(drafted, 1)


if __name__ == "__main__":
    main()
