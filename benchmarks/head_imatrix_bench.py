"""Does importance data for the MTP head help a 2-bit head? Acceptance of a bundled demo model
quantized Q4_K_M with the head at IQ2_XXS, importance from ``mtpq imatrix --mtp`` (the head run as
it drafts) vs the static fallback (uniform importance for the head: what is left when a tool has
no statistics for it), next to the head at q8_0 and the f32 reference, all in one run.

    python benchmarks/head_imatrix_bench.py [--model glm4moe|qwen35] [--chunks 64] [-n 128]

IQ2_XXS cannot be made without importance weights (ggml aborts, llama-quantize refuses); with
uniform weights ggml's own weighting reduces to sqrt(sigma^2 + x^2), its nearest "static" form.
The calibration text is Python standard-library source outside the demo's held-out files;
acceptance is the teacher-forced depth-1 greedy rate (equal to the k=1 loop's) on the demo's
held-out prompts. Prints one line per file and the difference in points, with a 95 % interval
from the per-prompt spread (the demo is small: read differences of a point or two as noise).
"""

from __future__ import annotations

import argparse
import inspect
import math
import subprocess
import sys
import tempfile
from importlib import resources
from pathlib import Path

import numpy as np
import torch

DEMOS = {"glm4moe": ("data/demo", "demo_heldout"), "qwen35": ("data/demo_qwen35", "demo_qwen35_heldout")}
CALIBRATION_MODULES = ("json.decoder", "json.encoder", "argparse", "textwrap", "csv", "difflib", "inspect",
                       "configparser")  # none of them is a held-out file of the demos


def mtpq(*args) -> None:
    subprocess.run([sys.executable, "-m", "mtpq.cli", *map(str, args)], check=True)


def per_prompt_rates(path: Path, prompts: list[str], n_new: int) -> list[tuple[int, int]]:
    from mtpq.runtime.speculative import load_model, run_plain, teacher_forced_acceptance

    model, tok = load_model(path, device="cpu")
    out = []
    for text in prompts:
        ids = tok.encode(text)
        tf = teacher_forced_acceptance(model, ids + run_plain(model, ids, n_new).tokens, prompt_len=len(ids))
        out.append((tf.loop_accepted, tf.loop_drafts))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(DEMOS), default="glm4moe")
    ap.add_argument("--chunks", type=int, default=64, help="imatrix chunks of 128 tokens")
    ap.add_argument("-n", "--new-tokens", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(1)
    import importlib

    from mtpq.quantize.imatrix import read_imatrix, write_imatrix
    from mtpq.runtime.accept import load_prompts

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
        for label, imf, mtp_type in (("head q8_0", im, "q8_0"), ("head IQ2_XXS, head imatrix", im, "iq2_xxs"),
                                     ("head IQ2_XXS, static (uniform)", static_path, "iq2_xxs")):
            out = d / (label.replace(" ", "_").replace(",", "") + ".gguf")
            mtpq("quantize", ref, out, "Q4_K_M", "--mtp-type", mtp_type, "--imatrix", imf, "-q")
            files[label] = out
        print(f"{args.model} demo, {len(prompts)} held-out prompts x {args.new_tokens} tokens, imatrix "
              f"{args.chunks} x 128 tokens ({len(head)} head entries); trunk Q4_K_M with the same imatrix")
        rates = {}
        for label, path in files.items():
            pp = per_prompt_rates(path, prompts, args.new_tokens)
            rates[label] = pp
            acc, n = sum(a for a, _ in pp), sum(b for _, b in pp)
            print(f"  {label:<32} {100 * acc / n:5.1f} %  ({acc}/{n})  {path.stat().st_size / 2**20:5.1f} MiB")
        a, b = rates["head IQ2_XXS, head imatrix"], rates["head IQ2_XXS, static (uniform)"]
        diffs = [x[0] / x[1] - y[0] / y[1] for x, y in zip(a, b) if x[1] and y[1]]
        mean = sum(diffs) / len(diffs)
        sd = math.sqrt(sum((x - mean) ** 2 for x in diffs) / (len(diffs) - 1))
        rate = lambda pp: sum(x for x, _ in pp) / sum(y for _, y in pp)  # noqa: E731
        print(f"head imatrix - static: {100 * (rate(a) - rate(b)):+.1f} points (per-prompt mean {100 * mean:+.1f}, "
              f"95 % interval {100 * (mean - 1.96 * sd / math.sqrt(len(diffs))):+.1f} .. "
              f"{100 * (mean + 1.96 * sd / math.sqrt(len(diffs))):+.1f})")


if __name__ == "__main__":
    main()
