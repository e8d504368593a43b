"""Does importance data for the MTP head help a 2-bit head? Acceptance of a bundled demo model
quantized Q4_K_M with the head at IQ2_XXS, importance from ``mtpq imatrix --mtp`` (the head run as
it drafts) vs the static fallback (uniform importance for the head: what is left when a tool has
no statistics for it), next to the head at q8_0 and the f32 reference, all in one run.

    python benchmarks/head_imatrix_bench.py [--model glm4moe|qwen35] [--chunks 64] [-n 128] [--windows 400]

IQ2_XXS cannot be made without importance weights (ggml aborts, llama-quantize refuses); with
uniform weights ggml's own weighting reduces to sqrt(sigma^2 + x^2), its nearest "static" form.
The calibration text is Python standard-library source outside the demo's held-out files;
acceptance is the teacher-forced depth-1 greedy rate (equal to the k=1 loop's) on the demo's
held-out prompts. Prints one line per file and the difference in points, with a 95 % interval
from the per-prompt spread (the demo is small: read differences of a point or two as noise).

The demo prompts give only ~1,700 drafts; ``--windows N`` adds N windows of 256 tokens cut from
the demo's held-out source files (those its training never saw, less any used for calibration)
and counts, over every position, whether the head's draft equals the trunk's greedy choice
(teacher-forced on the real text: one forward per window, tens of thousands of positions), with
a 95 % interval of the paired difference from the per-window spread. With windows it also prints,
for every matrix of the head, the relative output error ||X (Wq - W)^T||^2 / ||X W^T||^2 of both
IQ2_XXS heads on the head's real inputs X over the first 60 windows: what importance weighting is
meant to lower, so a matrix where it does not shows up by name.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import subprocess
import sys
import sysconfig
import tempfile
from importlib import resources
from pathlib import Path

import numpy as np
import torch

DEMOS = {"glm4moe": ("data/demo", "demo_heldout"), "qwen35": ("data/demo_qwen35", "demo_qwen35_heldout")}
CALIBRATION_MODULES = (
    "json.decoder",
    "json.encoder",
    "argparse",
    "textwrap",
    "difflib",
    "inspect",
    "configparser",
    "tokenize",
)  # none of them is a held-out file of the demos
WINDOW = 256


def mtpq(*args) -> None:
    subprocess.run([sys.executable, "-m", "mtpq.cli", *map(str, args)], check=True)


def per_prompt_rates(path: Path, prompts: list[str], n_new: int) -> list[tuple[int, int]]:
    from mtpq.runtime.speculative import load_model, run_plain, teacher_forced_acceptances

    model, tok = load_model(path, device="cpu")
    seqs = [(ids + run_plain(model, ids, n_new).tokens, len(ids)) for ids in map(tok.encode, prompts)]
    return [(tf.loop_accepted, tf.loop_drafts) for tf in teacher_forced_acceptances(model, seqs)]


def heldout_windows(folder: str, n: int) -> list[str]:
    """``n`` texts of about WINDOW tokens from the demo's held-out stdlib files, spread over all files."""
    meta = json.loads(resources.files("mtpq").joinpath(folder, "demo_training.json").read_text())
    held = set(meta["heldout_files"])
    assert not held & {m + ".py" for m in CALIBRATION_MODULES}, "calibration text overlaps the held-out files"
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    lines = []
    for f in sorted(held):
        p = stdlib / f
        if p.is_file():
            lines += [(f, line) for line in p.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)]
    # cut into pieces of ~4 characters a token x WINDOW, at line ends, never across files
    pieces, cur, cur_f = [], "", None
    for f, line in lines:
        if cur and (f != cur_f or len(cur) + len(line) > 4 * WINDOW):
            pieces.append(cur)
            cur = ""
        cur, cur_f = cur + line, f
    if cur:
        pieces.append(cur)
    step = max(1, len(pieces) // n)
    return pieces[::step][:n]


def window_matches(path: Path, texts: list[str]) -> list[tuple[int, int]]:
    """Per text: positions where the head's draft of x_{t+2} equals the trunk's greedy choice, and positions."""
    from mtpq.runtime.speculative import load_model

    model, tok = load_model(path, device="cpu")
    out = []
    with torch.inference_mode():
        for text in texts:
            seq = torch.tensor([tok.encode(text)[:WINDOW]])
            trunk = model.trunk(seq, use_cache=False)
            target = trunk.logits[0].argmax(-1)
            draft = model.draft(seq[:, 1:], trunk.hidden[:, :-1], use_cache=False).logits[0].argmax(-1)
            ok = draft == target[1:]  # draft[t] from (h_t, x_{t+1}); target[t+1]: the trunk's x_{t+2}
            out.append((int(ok.sum()), ok.numel()))
    return out


def head_output_errors(ref: Path, quants: dict[str, Path], texts: list[str]) -> dict[str, dict[str, float]]:
    """Per head matrix and quantized file: ||X (Wq - W)^T||^2 / ||X W^T||^2 on the inputs X the head's
    matrices receive when it drafts (collected from the reference model as ``mtpq imatrix`` does)."""
    from mtpq.runtime import weights
    from mtpq.runtime.speculative import load_model

    def head_matrices(model) -> dict[str, torch.Tensor]:
        return {
            m.name: m.matrix().double()
            for m in model.modules()
            if isinstance(m, weights.QWeight) and m.name.startswith(f"blk.{len(model.blocks)}.")
        }

    model, tok = load_model(ref, device="cpu")
    inputs: dict[str, list[torch.Tensor]] = {}

    def observe(name: str, expert: int | None, x: torch.Tensor) -> None:
        if expert is None:
            inputs.setdefault(name, []).append(x.reshape(-1, x.shape[-1]).double())

    with torch.inference_mode():
        for text in texts:
            seq = torch.tensor([tok.encode(text)[:WINDOW]])
            hidden = model.trunk(seq, use_cache=False).hidden
            weights.observer = observe
            try:
                model.draft(seq[:, 1:], hidden[:, :-1], use_cache=False)
            finally:
                weights.observer = None
        ref_w = head_matrices(model)
        xs = {k: torch.cat(v) for k, v in inputs.items() if k in ref_w}
        out: dict[str, dict[str, float]] = {k: {} for k in sorted(xs)}
        for label, path in quants.items():
            q_w = head_matrices(load_model(path, device="cpu")[0])
            for k, x in xs.items():
                out[k][label] = float(((x @ (q_w[k] - ref_w[k]).T) ** 2).sum() / ((x @ ref_w[k].T) ** 2).sum())
    return out


def paired_interval(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> tuple[float, float, float]:
    """Mean per-item difference of rates a - b and its 95 % interval (normal approximation)."""
    diffs = [x[0] / x[1] - y[0] / y[1] for x, y in zip(a, b) if x[1] and y[1]]
    mean = sum(diffs) / len(diffs)
    sd = math.sqrt(sum((x - mean) ** 2 for x in diffs) / (len(diffs) - 1))
    half = 1.96 * sd / math.sqrt(len(diffs))
    return mean, mean - half, mean + half


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(DEMOS), default="glm4moe")
    ap.add_argument("--chunks", type=int, default=64, help="imatrix chunks of 128 tokens")
    ap.add_argument("-n", "--new-tokens", type=int, default=128)
    ap.add_argument("--windows", type=int, default=0, help="also measure on this many held-out text windows")
    args = ap.parse_args()
    torch.set_num_threads(1)
    import importlib

    from mtpq.acceptance.prompts import load_prompts
    from mtpq.quantize.imatrix import read_imatrix, write_imatrix

    folder, prompt_set = DEMOS[args.model]
    prompts = [p for _, p in load_prompts(prompt_set)]
    with tempfile.TemporaryDirectory(prefix="mtpq-head-imatrix-") as d:
        d = Path(d)
        ref = d / "ref-f32.gguf"
        mtpq("convert", Path(str(resources.files("mtpq").joinpath(folder))), ref, "--outtype", "f32", "-q")
        calib = d / "calib.txt"
        calib.write_text("".join(inspect.getsource(importlib.import_module(m)) for m in CALIBRATION_MODULES))
        im = d / "head.imatrix.gguf"
        mtpq("imatrix", ref, "-f", calib, "-o", im, "-c", 128, "--chunks", args.chunks)
        static = read_imatrix(im)
        n_trunk = int(max(int(k.split(".")[1]) for k in static.entries))  # the head's block is the last
        head = [k for k in static.entries if k.startswith(f"blk.{n_trunk}.")]
        for k in head:  # uniform importance: mean 1 per value, counts kept
            e = static.entries[k]
            per = e.sums.size // e.counts.size
            e.sums = np.repeat(e.counts.reshape(-1, 1), per, axis=1).reshape(e.sums.shape).astype(np.float32)
        static_path = d / "static.imatrix.gguf"
        write_imatrix(static, static_path)
        files = {"f32 reference": ref}
        for label, imf, mtp_type in (
            ("head q8_0", im, "q8_0"),
            ("head IQ2_XXS, head imatrix", im, "iq2_xxs"),
            ("head IQ2_XXS, static (uniform)", static_path, "iq2_xxs"),
        ):
            out = d / (label.replace(" ", "_").replace(",", "") + ".gguf")
            mtpq("quantize", ref, out, "Q4_K_M", "--mtp-type", mtp_type, "--imatrix", imf, "-q")
            files[label] = out
        print(
            f"{args.model} demo, {len(prompts)} held-out prompts x {args.new_tokens} tokens, imatrix "
            f"{args.chunks} x 128 tokens ({len(head)} head entries); trunk Q4_K_M with the same imatrix"
        )
        rates = {}
        for label, path in files.items():
            pp = per_prompt_rates(path, prompts, args.new_tokens)
            rates[label] = pp
            acc, n = sum(a for a, _ in pp), sum(b for _, b in pp)
            print(f"  {label:<32} {100 * acc / n:5.1f} %  ({acc}/{n})  {path.stat().st_size / 2**20:5.1f} MiB")
        a, b = rates["head IQ2_XXS, head imatrix"], rates["head IQ2_XXS, static (uniform)"]
        mean, lo, hi = paired_interval(a, b)
        rate = lambda pp: sum(x for x, _ in pp) / sum(y for _, y in pp)  # noqa: E731
        print(
            f"head imatrix - static: {100 * (rate(a) - rate(b)):+.1f} points (per-prompt mean {100 * mean:+.1f}, "
            f"95 % interval {100 * lo:+.1f} .. {100 * hi:+.1f})"
        )
        if args.windows:
            texts = heldout_windows(folder, args.windows)
            print(f"held-out text: {len(texts)} windows of <= {WINDOW} tokens, draft == trunk's greedy choice")
            wrates = {}
            for label, path in files.items():
                wrates[label] = pw = window_matches(path, texts)
                print(f"  {label:<32} {100 * rate(pw):5.1f} %  ({sum(x for x, _ in pw)}/{sum(y for _, y in pw)})")
            a, b = wrates["head IQ2_XXS, head imatrix"], wrates["head IQ2_XXS, static (uniform)"]
            mean, lo, hi = paired_interval(a, b)
            print(
                f"head imatrix - static on held-out text: {100 * (rate(a) - rate(b)):+.1f} points (per-window mean "
                f"{100 * mean:+.1f}, 95 % interval {100 * lo:+.1f} .. {100 * hi:+.1f})"
            )
            iq2 = {k: files[k] for k in ("head IQ2_XXS, head imatrix", "head IQ2_XXS, static (uniform)")}
            errors = head_output_errors(ref, iq2, texts[:60])
            print("relative output error of each head matrix on its drafting inputs (60 windows; lower is better)")
            print(f"  {'tensor':<40} {'head imatrix':>12} {'static':>8}")
            for name, e in errors.items():
                mine, static = e["head IQ2_XXS, head imatrix"], e["head IQ2_XXS, static (uniform)"]
                print(f"  {name:<40} {mine:12.4f} {static:8.4f}  {100 * (mine / static - 1):+5.1f} %")


if __name__ == "__main__":
    main()
