"""Running llama.cpp on tiny checkpoints, for parity tests (``@pytest.mark.llama_cpp``): its own converter,
and ``llama-speculative-simple``'s draft counters.

The converter runs in a child process with the llama.cpp tree's own gguf-py. Two
patches make it accept tiny test checkpoints, and change nothing else: its
pre-tokenizer lookup (a fingerprint table of real tokenizers) returns the name mtpq
chose, and DeepSeek-V3.2's vocab setup (which asserts an attribute transformers 5
no longer exposes) uses the plain gpt2 path. With ``raw_config=True`` a third makes
it read config.json as stored, as it does when transformers does not know the
model type: transformers 5.23 rewrites Step3.5's config (``num_attention_groups``
becomes ``num_key_value_heads``, per-layer ``rope_theta`` moves into
``rope_parameters``, ...) into keys llama.cpp's Step3.5 converter does not read
(it stops with KeyError 'num_attention_groups').
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

_HARNESS = """
import runpy, sys
src, pre, raw = sys.argv[1], sys.argv[2], sys.argv[3] == "raw"
sys.path[:0] = [src + "/gguf-py", src]
import conversion.base as base
import conversion.deepseek as deepseek
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
deepseek.DeepseekV32Model.set_vocab = lambda self: self._set_vocab_gpt2()
if raw:
    class _NoAutoConfig:
        @staticmethod
        def from_pretrained(*a, **k):
            raise ValueError("config.json as stored")
    base.AutoConfig = _NoAutoConfig
sys.argv = [src + "/convert_hf_to_gguf.py", *sys.argv[4:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def llama_cpp_convert(
    src: Path, folder: Path, out: Path, pre: str, *args: str, outtype: str = "f32", raw_config: bool = False
) -> Path:
    """``convert_hf_to_gguf.py folder --outfile out --outtype outtype *args``; asserts success."""
    ok, log = llama_cpp_convert_result(src, folder, out, pre, *args, outtype=outtype, raw_config=raw_config)
    assert ok, log[-3000:]
    return out


def llama_cpp_convert_result(
    src: Path, folder: Path, out: Path, pre: str, *args: str, outtype: str = "f32", raw_config: bool = False
) -> tuple[bool, str]:
    """(whether llama.cpp's converter wrote ``out``, its stderr): for matrices where refusing is an answer."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _HARNESS,
            str(src),
            pre,
            "raw" if raw_config else "auto",
            str(folder),
            "--outfile",
            str(out),
            "--outtype",
            outtype,
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    return proc.returncode == 0 and out.exists(), proc.stderr


def speculative_simple(
    bin_dir: Path, *args, tries: int = 5, timeout: int = 300
) -> tuple[subprocess.CompletedProcess, dict]:
    """One ``llama-speculative-simple`` run and its counters ``{"n_predict", "n_drafted", "n_accept"}``.

    llama.cpp logs from a worker thread that the process does not wait for at exit, so the closing
    counters can go missing: mostly under the OMP_WAIT_POLICY=PASSIVE that ``mtpq.cli`` sets for torch
    (left out here, as for every llama.cpp child of mtpq), rarely otherwise. Greedy runs are
    deterministic, so a run without them is repeated; never getting them fails the test.
    """
    from mtpq.engines.llama_cpp import child_env

    cmd = [str(bin_dir / "llama-speculative-simple"), *map(str, args)]
    for _ in range(tries):
        with (
            tempfile.TemporaryFile("w+", errors="replace") as out,
            tempfile.TemporaryFile("w+", errors="replace") as err,
        ):
            code = subprocess.run(
                cmd, stdout=out, stderr=err, timeout=timeout, stdin=subprocess.DEVNULL, env=child_env()
            ).returncode
            out.seek(0), err.seek(0)
            proc = subprocess.CompletedProcess(cmd, code, out.read(), err.read())
        assert proc.returncode == 0, proc.stderr[-2000:]
        stats = {k: int(v) for k, v in re.findall(r"\b(n_predict|n_drafted|n_accept)\s*=\s*(\d+)", proc.stderr)}
        if {"n_drafted", "n_accept"} <= set(stats):
            return proc, stats
    raise AssertionError(f"no draft counters in {tries} runs of llama-speculative-simple: {proc.stderr[-2000:]}")


def llama_imatrix(bin_dir: Path, model: Path, calib: Path, out: Path, n_ctx: int, n_chunks: int, *extra) -> Path:
    """``llama-imatrix`` of model over n_chunks chunks of n_ctx tokens of calib (one batch a chunk, the text as
    written, no perplexity, one thread, no AMX repacking; ``extra``: more flags) into out; asserts exit 0."""
    cmd = [bin_dir / "llama-imatrix", "-m", model, "-f", calib, "-o", out, "-c", n_ctx, "-b", n_ctx]
    cmd += ["--chunks", n_chunks, "--no-escape", "--no-ppl", "-t", 1, "--no-repack", *extra]
    proc = subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, errors="replace", timeout=600, stdin=subprocess.DEVNULL
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def greedy_drafting(k) -> tuple:
    """llama-speculative-simple's flags for greedy decoding with the MTP head drafting at most k tokens a round,
    without AMX repacking (which cannot run every model's 3-D products)."""
    return ("--temp", "0", "--spec-type", "draft-mtp", "--spec-draft-n-max", k, "--no-repack")


def free_port() -> int:
    """A TCP port free now on 127.0.0.1, for the tests' own llama.cpp servers (rpc-server, a llama-server
    started by hand): mtpq's engine itself listens on a private unix socket instead."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LOOP_PROMPTS = [
    "def add(a, b):",
    "The quick brown fox",
    "for i in range(10):",
    "class Point:",
    "import os",
    "Hello, world",
    "x = [1, 2, 3]",
    "while True:",
]


def assert_k1_acceptance_agrees(
    bin_dir: Path, path: Path, work: Path, max_gap: float, n_new: int = 64, prompts: list[str] = LOOP_PROMPTS
) -> None:
    """llama.cpp's MTP drafting one token at a time (``llama-speculative-simple --spec-type draft-mtp``) and our
    k=1 loop on the same GGUF and prompts accept within one draft of each other on each prompt, and within
    ``max_gap`` overall, over at least half the prompts (some of which each drafts right).

    llama-speculative-simple stops once it has more than -n tokens (our loop is run to n + 1, so both decode
    the same stretch), or early at any end-of-generation token it recognises (<|im_end|>, ...): such prompts
    are left out of the comparison."""
    from mtpq.runtime.speculative import load_model, run_speculative

    model, tok = load_model(path, device="cpu")
    ours, theirs, compared = [0, 0], [0, 0], 0
    for i, text in enumerate(prompts):
        prompt_file = work / f"p{i}.txt"
        prompt_file.write_text(text)  # no trailing newline: llama.cpp's -f would drop it
        _, stats = speculative_simple(
            bin_dir, "-m", path, "-f", prompt_file, "--no-escape", "-n", n_new, *greedy_drafting(1), "-t", "1"
        )
        if stats.get("n_predict", 0) <= n_new:  # stopped early at an end-of-generation token
            continue
        r = run_speculative(model, tok.encode(text), n_new + 1, k=1)
        ours = [ours[0] + r.n_accepted, ours[1] + r.n_drafts]
        theirs = [theirs[0] + stats["n_accept"], theirs[1] + stats["n_drafted"]]
        assert abs(stats["n_accept"] - r.n_accepted) <= 1, (text, r.n_accepted, stats["n_accept"])
        compared += 1
    assert compared >= len(prompts) // 2 and ours[0] > 0, compared
    rate, ref = ours[0] / ours[1], theirs[0] / theirs[1]
    print(
        f"\nk=1 acceptance over {compared} prompts: ours {ours[0]}/{ours[1]} = {rate:.3f}, "
        f"llama.cpp {theirs[0]}/{theirs[1]} = {ref:.3f}"
    )
    assert abs(rate - ref) <= max_gap, (rate, ref)


def speculative_simple_counts(model, prompt_ids: list[int], n_predict: int, k: int, eog: set[int]) -> dict:
    """The torch runtime's greedy loop with ``llama-speculative-simple``'s rounds (``run_speculative(...,
    rounds="llama-speculative-simple")``, what ``mtpq accept --rounds llama-speculative-simple`` runs) -> the
    counters that example prints (``n_predict``, ``n_drafted``, ``n_accept``): every round's tokens count, the
    surplus past ``n_predict`` too, and a round that emitted an end-of-generation token (``eog``) is the last."""
    from mtpq.runtime.speculative import run_speculative

    r = run_speculative(model, list(prompt_ids), n_predict, k, stop_ids=eog, rounds="llama-speculative-simple")
    return {
        "n_predict": sum(r.accepted) + len(r.accepted),
        "n_drafted": sum(r.drafted),
        "n_accept": sum(r.accepted),
    }
