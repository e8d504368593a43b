"""Throughput of mtpq's ggml-exact quantization kernels (mtpq.ggml, numba) against llama-quantize's.

    python benchmarks/quant_bench.py                          # 4096x4096, all types
    python benchmarks/quant_bench.py --rows 1024 --types Q4_K,Q6_K --threads 2
    python benchmarks/quant_bench.py --llama-quantize /path/to/llama-quantize
    python benchmarks/quant_bench.py --whole-file --llama-quantize /path/to/llama-quantize --threads 2

``--whole-file``: ``mtpq quantize`` and ``llama-quantize`` on the same whole GGUF, a GLM-4.5-shaped f32
file of ~420 MB built here (tests/builders/tiny.py's GLM-4.5 at hidden 1024: 8 query / 2 KV heads of 128, a dense
block of 2816, MoE blocks of 16 experts of 352 -- GLM-4.5-Air's 1408 / 4, so their ffn_down rows take
llama-quantize's fallback types as Air's do --, a shared expert, the MTP block, vocab 8192; kept with
``--keep DIR``; ``--expert-width 384`` gives experts of 384 (rows Q1_0 takes); ``--layers N`` builds one
with N trunk layers instead of 3, ~0.12 GB each: Q4_0 or Q8_0
take ~0.25 s for the 420 MB file, less than one process's start-up varies, so their ratios need the longer
file), each as a whole command (``mtpq quantize IN OUT TYPE --pure --mtp-type same --threads
N``, ``llama-quantize --pure IN OUT TYPE N``), run alternately, best of ``--repeat``. Each tool also
quantizes a GGUF with the same metadata and a single 256-row tensor (attn_q's row length, so the imatrix
fits): that time is its start-up (process, imports, reading the metadata, until its first tensor is
quantized); the marginal throughput is the difference in input MB over the difference between the two
files' best times, in wall time and in CPU time (the child's threads and workers included: what other jobs
on a shared machine disturb least), and end to end: the whole file's best times, start-up included. The
types that need an importance matrix get one (an entry of exp(N(0, 1.5^2)) per column for every weight, the
same file for both). Bytes are compared.

For every type it prints the time to quantize an f32 matrix of N(0, 0.02^2)
values and the input throughput (MB of f32 per second), and the time and
output throughput of ``dequantize``. The types
ggml refuses to write without importance data (IQ2_XXS, IQ2_XS, IQ1_S) get
the synthetic weights below, marked in the table.

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
the ratio of CPU time (user + system, both tools' threads included), which other
jobs on the machine disturb less.  The bytes of both are compared: a difference
ends the run with exit status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mtpq.ggml import engine  # noqa: E402
from mtpq.ggml.engine import dequantize, quantize  # noqa: E402
from mtpq.ggml.registry import TYPES  # noqa: E402
from mtpq.quantize.imatrix import Entry, Imatrix, write_imatrix  # noqa: E402
from mtpq.quantize.presets import IMATRIX_ONLY_TYPES  # noqa: E402

ALL = [t.name for t in TYPES if t not in (T.F32,)]
_differences: list[str] = []  # types whose bytes differ from llama-quantize's: exit status 1


def _best_of(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def _cpu_seconds() -> float:
    """CPU time (user + system) of this process (its threads included) and its reaped children (llama-quantize).
    Less sensitive than wall time to other jobs on a shared machine."""
    import resource

    return sum(
        r.ru_utime + r.ru_stime
        for r in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
    )


def _synthetic_importance(seed: int, cols: int) -> np.ndarray:
    """A weight per column like llama-imatrix's mean squared activations: exp(N(0, 1.5^2))."""
    return np.exp(np.random.default_rng(seed).normal(0.0, 1.5, cols)).astype(np.float32)


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
LLAMA_FTYPE = {"IQ2_S": "IQ2_M", "MXFP4": "MXFP4_MOE"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--types", default=",".join(ALL), help="comma-separated ggml type names")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="threads, ours and llama-quantize's")
    ap.add_argument("--repeat", type=int, default=1, help="best of N runs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--llama-quantize", type=Path, default=None, metavar="PATH")
    ap.add_argument("--imatrix", action="store_true", help="quantize with importance weights (both sides)")
    ap.add_argument(
        "--compare",
        default=None,
        help="types timed against llama-quantize (default: Q8_0,Q4_K,Q6_K; "
        "with --imatrix Q4_K,Q6_K,Q4_0,IQ4_XS,IQ2_XXS,IQ3_XXS)",
    )
    ap.add_argument("--no-table", action="store_true", help="skip the first table (ours alone, every --types)")
    ap.add_argument("--whole-file", action="store_true", help="quantize a whole GLM-shaped GGUF with both tools")
    ap.add_argument("--keep", type=Path, help="--whole-file: build (or reuse) the GGUFs in this folder")
    ap.add_argument(
        "--layers",
        type=int,
        default=GLM_SHAPE["num_hidden_layers"],
        help="--whole-file: the GLM file's trunk layers (more: a longer marginal time for the fast types)",
    )
    ap.add_argument(
        "--expert-width",
        type=int,
        default=GLM_SHAPE["moe_intermediate_size"],
        help="--whole-file: the experts' width (352: no Q1_0 fallback for their ffn_down rows; 384 takes Q1_0)",
    )
    args = ap.parse_args()
    if args.repeat < 1:  # no run: no best time, and every ratio would be inf or NaN
        ap.error("--repeat must be at least 1")
    if args.whole_file:
        if args.llama_quantize is None:
            raise SystemExit("--whole-file needs --llama-quantize PATH")
        whole_file(args)
        sys.exit(1 if _differences else 0)

    engine.set_workers(args.threads)
    x = (np.random.default_rng(args.seed).standard_normal((args.rows, args.cols)) * 0.02).astype(np.float32)
    mb = x.size * 4 / 1e6
    imp = None
    if args.imatrix:
        imp = _synthetic_importance(args.seed, args.cols)
    print(
        f"matrix {args.rows}x{args.cols} f32 = {mb:.1f} MB, {args.threads} threads"
        f"{', with importance weights' if args.imatrix else ''}"
    )
    print(f"{'type':8} {'quantize s':>10} {'in MB/s':>9} {'dequant s':>10} {'out MB/s':>9}")
    for name in [] if args.no_table else args.types.split(","):
        qt = T[name]
        # i-quants that ggml refuses to write without importance data get the synthetic weights
        need = imp if imp is not None or not TYPES[qt].requires_imatrix else _synthetic_importance(args.seed, args.cols)
        quantize(x[:1], qt, name, importance=need)  # compiled (or loaded from the cache) before the clock
        tq, raw = _best_of(lambda: quantize(x, qt, name, importance=need), args.repeat)
        dequantize(raw[:1], qt, (1, x.shape[1]))
        td, _ = _best_of(lambda: dequantize(raw, qt, x.shape), args.repeat)
        mark = " (with importance weights)" if need is not imp else ""
        print(f"{name:8} {tq:10.3f} {mb / tq:9.1f} {td:10.3f} {mb / td:9.1f}{mark}", flush=True)

    if args.llama_quantize is None:
        return
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "f32.gguf"
        _write_f32_gguf(src, x)
        extra, names = [], ["Q8_0", "Q4_K", "Q6_K"]
        if args.imatrix:
            im_file = Path(tmp) / "imatrix.gguf"
            write_imatrix(
                Imatrix(
                    {"blk.0.ffn_down.weight": Entry(imp[None], np.ones(1, dtype=np.float32))},
                    datasets=["bench"],
                    chunk_count=1,
                    chunk_size=1,
                ),
                im_file,
            )
            extra, names = ["--imatrix", str(im_file)], ["Q4_K", "Q6_K", "Q4_0", "IQ4_XS", "IQ2_XXS", "IQ3_XXS"]
        if args.compare:
            names = args.compare.split(",")
        print(
            f"\nllama-quantize --pure {' '.join(extra[:1])} ({args.llama_quantize}), {args.threads} threads, "
            "whole-process wall time"
        )
        print(
            f"{'type':8} {'theirs s':>9} {'in MB/s':>9} {'ours s':>9} {'ours/theirs':>12} {'same bytes':>11}"
            f" {'cpu ours/theirs':>15}"
        )
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
                    [
                        str(args.llama_quantize),
                        "--pure",
                        *extra,
                        str(src),
                        str(out),
                        LLAMA_FTYPE.get(name, name),
                        str(args.threads),
                    ],
                    check=True,
                    capture_output=True,
                )
                theirs_t, theirs_c = min(theirs_t, time.perf_counter() - t0), min(theirs_c, _cpu_seconds() - c0)
            import gguf

            written = gguf.GGUFReader(out).tensors[0]
            if written.tensor_type != qt:  # a wrong preset mapping would compare two different types
                raise SystemExit(f"llama-quantize wrote {written.tensor_type.name}, not {name}")
            same = np.asarray(written.data).tobytes() == raw.tobytes()
            if not same:
                _differences.append(name)
            print(
                f"{name:8} {theirs_t:9.3f} {mb / theirs_t:9.1f} {ours_t:9.3f} {ours_t / theirs_t:12.2f} {str(same):>11}"
                f" {ours_c / theirs_c:14.2f}",
                flush=True,
            )
            out.unlink()
    sys.exit(1 if _differences else 0)


# ----------------------------------------------------------------------------- --whole-file

WHOLE_TYPES = (
    "Q8_0,Q6_K,Q5_K,Q4_K,Q3_K,Q2_K,Q5_1,Q5_0,Q4_1,Q4_0,IQ4_NL,IQ4_XS,IQ3_S,IQ3_XXS,IQ2_S,IQ2_XS,IQ2_XXS,"
    "IQ1_M,IQ1_S,TQ2_0,TQ1_0,Q2_0,MXFP4"
)  # not Q1_0: the file's rows of 352 have no Q1_0 fallback (--expert-width 384 --types Q1_0)
# GLM-4.5-Air's proportions at hidden 1024 (Air: 4096, 96 x 128 query heads, 8 KV heads, experts of 1408):
# glm_shape.json beside this file
GLM_SHAPE = json.loads(Path(__file__).with_name("glm_shape.json").read_text())  # tiny.glm4moe's keywords


def build_glm_gguf(folder: Path, layers: int | None = None, width: int | None = None) -> tuple[Path, Path, Path]:
    """(the GLM-shaped f32 GGUF, the same metadata with one 256-row tensor, an imatrix for both), built once;
    ``layers``, ``width``: trunk layers and expert width other than glm_shape.json's (files named
    ``glm-L{layers}-E{width}-...``)."""
    import torch

    from mtpq.convert import plan_checkpoint
    from mtpq.gguf_io import plan_from_gguf, write_plan
    from mtpq.tensors import Plan
    from tests.builders import tiny

    glm = dict(GLM_SHAPE)
    stem = "glm"
    if layers is not None and layers != glm["num_hidden_layers"]:
        glm["num_hidden_layers"], stem = layers, f"glm-L{layers}"
    if width is not None and width != glm["moe_intermediate_size"]:
        glm["moe_intermediate_size"], stem = width, f"{stem}-E{width}"
    big, mini, im_file = folder / f"{stem}-f32.gguf", folder / f"{stem}-mini-f32.gguf", folder / f"{stem}.imatrix.gguf"
    if not big.exists():
        print(f"building {big} ...", file=sys.stderr, flush=True)
        ckpt = tiny.glm4moe(folder / "ckpt", dtype=torch.float32, n_shards=1, **glm)
        write_plan(plan_checkpoint(ckpt, outtype=T.F32), big)
        shutil.rmtree(ckpt)
    plan = plan_from_gguf(big)
    if not mini.exists():
        one = next(s for s in plan.tensors if s.name == "blk.0.attn_q.weight")
        # 256 rows of attn_q's own length: the imatrix's entry for it fits (the i-quants need one)
        shape = (256, one.shape[-1])
        small = type(one)(
            one.name,
            shape,
            one.role,
            T.F32,
            lambda: torch.zeros(*shape),
            "mini",
            source_type=T.F32,
            load_raw=lambda: np.full(shape, 0.01, dtype=np.float32),
        )
        write_plan(
            Plan(plan.arch, plan.kv, [small], n_trunk_layers=plan.n_trunk_layers, n_mtp_layers=plan.n_mtp_layers), mini
        )
    if not im_file.exists():
        rng = np.random.default_rng(0)
        entries = {}
        for s in plan.tensors:
            if len(s.shape) >= 2 and s.name.endswith("weight"):
                n_mat = s.shape[0] if len(s.shape) == 3 else 1
                entries[s.name] = Entry(
                    np.exp(rng.normal(0.0, 1.5, (n_mat, s.shape[-1]))).astype(np.float32),
                    np.ones(n_mat, dtype=np.float32),
                )
        write_imatrix(Imatrix(entries, datasets=["bench"], chunk_count=1, chunk_size=1), im_file)
    return big, mini, im_file


def _timed(cmd: list[str], env: dict | None = None) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the child and its threads / workers). Run in this checkout's folder:
    ``python -m mtpq`` imports the working folder's mtpq before PYTHONPATH's."""
    t0, c0 = time.perf_counter(), _cpu_seconds()
    subprocess.run(cmd, check=True, capture_output=True, env=env, cwd=Path(__file__).resolve().parents[1])
    return time.perf_counter() - t0, _cpu_seconds() - c0


def _same_tensors(a: Path, b: Path) -> bool:
    import gguf

    ta = {t.name: t for t in gguf.GGUFReader(a).tensors}
    tb = {t.name: t for t in gguf.GGUFReader(b).tensors}
    return set(ta) == set(tb) and all(
        ta[n].tensor_type == tb[n].tensor_type and np.asarray(ta[n].data).tobytes() == np.asarray(tb[n].data).tobytes()
        for n in ta
    )


def whole_file(args) -> None:
    work = args.keep.resolve() if args.keep else Path(tempfile.mkdtemp(prefix="mtpq-qbench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        big, mini, im_file = build_glm_gguf(work, args.layers, args.expert_width)
        mb_big, mb_mini = big.stat().st_size / 1e6, mini.stat().st_size / 1e6
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        llama_env = {**os.environ, "LD_LIBRARY_PATH": str(Path(args.llama_quantize).resolve().parent)}
        types = args.types if args.types != ",".join(ALL) else WHOLE_TYPES
        load = os.getloadavg()[0]
        print(
            f"{big.name}: {mb_big:.0f} MB f32, {args.threads} threads, best of {args.repeat}, load average "
            f"{load:.2f} at the start ({os.cpu_count()} CPUs)"
        )
        print(
            f"{'type':8} {'theirs MB/s':>11} {'ours MB/s':>9} {'ours/theirs':>11} {'cpu':>6} {'whole':>6} "
            f"{'start theirs':>12} {'start ours':>10} {'ours cpu':>8} {'same bytes':>10} {'load':>5}"
        )
        for name in types.split(","):
            qt = T[name]
            im = ["--imatrix", str(im_file)] if qt in IMATRIX_ONLY_TYPES or args.imatrix else []
            ours = lambda src, out: [
                sys.executable,
                "-m",
                "mtpq",
                "quantize",
                str(src),
                str(out),  # noqa: E731
                LLAMA_FTYPE.get(name, name),
                "--pure",
                "--mtp-type",
                "same",
                "--threads",
                str(args.threads),
                "--quiet",
                *im,
            ]
            theirs = lambda src, out: [
                str(args.llama_quantize),
                "--pure",
                *im,
                str(src),
                str(out),  # noqa: E731
                LLAMA_FTYPE.get(name, name),
                str(args.threads),
            ]
            # per tool: the best whole-file and one-tensor times (wall, CPU) over the rounds, the marginal being
            # their difference: a hiccup only adds time, so each best is the quietest run of its own (the best
            # per-round difference let one slow one-tensor run make the marginal tiny, even negative)
            best = {k: [float("inf")] * 4 for k in ("o", "t")}
            for _ in range(args.repeat):  # alternating: the machine's load changes from second to second
                for key, cmd, e in (("o", ours, env), ("t", theirs, llama_env)):
                    wall, cpu = _timed(cmd(big, work / f"{key}.gguf"), e)
                    start, start_cpu = _timed(cmd(mini, work / f"{key}-mini.gguf"), e)
                    best[key] = [min(b, t) for b, t in zip(best[key], (wall, cpu, start, start_cpu))]
            same = _same_tensors(work / "o.gguf", work / "t.gguf")
            if not same:
                _differences.append(name)
            (o_whole, o_whole_cpu, o_start, o_start_cpu) = best["o"]
            (t_whole, t_whole_cpu, t_start, t_start_cpu) = best["t"]
            o_wall, o_cpu, t_wall, t_cpu = (
                o_whole - o_start,
                o_whole_cpu - o_start_cpu,
                t_whole - t_start,
                t_whole_cpu - t_start_cpu,
            )
            mb = mb_big - mb_mini
            if min(o_wall, o_cpu, t_wall, t_cpu) <= 0:  # the whole file no slower than one tensor: noise won
                print(
                    f"{name:8} no marginal time left after start-up (whole file: ours {o_whole:.2f} s, theirs "
                    f"{t_whole:.2f} s; one tensor: {o_start:.2f} s, {t_start:.2f} s): rerun",
                    flush=True,
                )
                continue
            print(
                f"{name:8} {mb / t_wall:11.1f} {mb / o_wall:9.1f} {t_wall / o_wall:10.2f}x {t_cpu / o_cpu:5.2f}x "
                f"{t_whole / o_whole:5.2f}x "
                f"{t_start:11.2f}s {o_start:9.2f}s {o_start_cpu:7.2f}s {str(same):>10} {os.getloadavg()[0]:5.1f}",
                flush=True,
            )
        print(
            "ours/theirs: marginal throughput (input MB / (whole file - one-tensor file), wall), above 1: mtpq is "
            "faster; cpu: the same in CPU time (threads and workers included), theirs / ours; whole: end to end, the "
            "whole file's command, start-up included, theirs / ours (wall); start: the one-tensor "
            "file's wall time (ours cpu: its CPU time); load: the 1-minute load average after the row"
        )
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
