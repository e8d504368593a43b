"""Acceptance where it matters (issue 36): on a *trained* small model of each architecture the transformers-based
demo trainer cannot build, greedy k=1 acceptance in ``mtpq accept`` is within 1 point of llama.cpp's
``llama-speculative-simple`` with the MTP drafter, on the demo's held-out prompts.

Each model is its release-shaped checkpoint (tests/releases), converted to f32 by mtpq and trained through the
runtime by ``scripts/train_family.py`` (the demo's corpus and losses; a few hundred steps of CPU), so its head
drafts real text as a trained head does: about half its drafts are accepted, where the untrained fixture's are
near 0. Both engines read the same file.

``mtpq accept --rounds llama-speculative-simple`` places its rounds as that example does (the prompt's last token
starts the first round); its default, llama-server's rounds, start drafting one token later, and on a good head
a run of accepted drafts keeps that phase until a miss, so the two placements differ by a point or so (the
table prints both). With the example's rounds, every prompt's counts must equal llama.cpp's counters
(:func:`speculative_simple_counts`, the same loop), and so must the totals (Qwen3-Next: see ``LIVE_LOOP_OFF``).

llama.cpp runs with f32 KV caches (``F32_CACHES``): with its default f16 cache, the rounding of keys now and then
flips a near-tie (DSA's indexer top-k, a router), after which the greedy continuation, and so the drafts counted,
follow another text; that is the cache's storage precision, not drafting (docs/notes/runtime.md gives both
figures).

Run: ``python -m pytest -m llama_cpp tests/runtime/test_trained_acceptance.py -s`` (prints the table).
"""

from __future__ import annotations

import importlib.util
import json
from importlib import resources
from pathlib import Path

import pytest

from tests import releases
from tests.helpers.llama_server import F32_CACHES
from tests.helpers.llamacpp_ref import greedy_drafting, speculative_simple, speculative_simple_counts
from tests.helpers.runcli import run_cli
from tests.helpers.runtime import convert

pytestmark = [pytest.mark.llama_cpp, pytest.mark.slow]

# the ten llama.cpp drafts with that the demo trainer cannot build: GGUF architecture -> (release manifest, form)
TRAINED = releases.BY_ARCH
# DeepSeek-V4's head lives in a file of its own (llama.cpp's -md), and its converted files keep Q8_0 / MXFP4
# weights whatever the outtype: both are rewritten all-F32 so that every weight trains
HEAD_FILE = releases.HEAD_FILE
STEPS, BATCH, SEQ = 200, 8, 96
N_PROMPTS, N_NEW = 12, 96
MAX_GAP = 0.01  # issue 36: within 1 point
# Qwen3-Next: llama-speculative-simple's live loop accepts drafts that llama.cpp's own MTP context, teacher-forced,
# rejects (its head logits and ours agree to 1e-5 over the same text: tests/helpers/llamacpp_logits.py), up to all
# of them (588/588 in one run, one prompt off in another); open, on llama.cpp's side (docs/notes/runtime.md). The
# mark is strict: the day the counts agree, this fails and the mark goes.
LIVE_LOOP_OFF = {"qwen3next"}
MIN_RATE = 0.25  # a trained head: the untrained fixtures accept under 5 %


def trainer():
    """scripts/train_family.py as a module (scripts/ is not a package)."""
    path = Path(__file__).resolve().parents[2] / "scripts" / "train_family.py"
    spec = importlib.util.spec_from_file_location("train_family", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    """The demo's first N_PROMPTS held-out prompts (Python standard-library files the trainer never saw)."""
    src = resources.files("mtpq").joinpath("data/prompts/demo_heldout.jsonl").read_text().splitlines()
    out = tmp_path_factory.mktemp("trained-prompts") / "heldout.jsonl"
    out.write_text("\n".join(src[:N_PROMPTS]) + "\n")
    return out


# CI trains two (DSA's sparse attention, Mamba-2's recurrent state; ~3 min each on two cores); the rest are ``heavy``
IN_CI = {"glm-dsa", "nemotron_h_moe"}


def marks(arch: str) -> list:
    out = [] if arch in IN_CI else [pytest.mark.heavy]
    if arch in LIVE_LOOP_OFF:
        out.append(pytest.mark.xfail(strict=True, reason="llama-speculative-simple's live loop (see LIVE_LOOP_OFF)"))
    return out


@pytest.mark.parametrize("arch", [pytest.param(a, marks=marks(a)) for a in sorted(TRAINED)])
def test_k1_acceptance_within_a_point_of_llama_cpp(arch, prompts, llama_cpp_bin, tmp_path):
    from mtpq.runtime.speculative import load_model

    name, form = TRAINED[arch]
    ckpt = releases.build(releases.manifests()[name], tmp_path / "ckpt", form)
    path, head, head_args = tmp_path / "trained.gguf", None, ()
    if arch in HEAD_FILE:
        from tests.runtime.test_llama_cpp_parity import sharpened

        untrained = sharpened(
            convert(ckpt, tmp_path / "t.gguf", "f32", "--no-mtp"), tmp_path / "f32.gguf", 1.0, f32=True
        )
        untrained_head = sharpened(
            convert(ckpt, tmp_path / "h.gguf", "f32", "--mtp-only"), tmp_path / "f32-h.gguf", 1.0, f32=True
        )
        head = tmp_path / "trained-head.gguf"
        head_args = ("--head", head)
        trained_files = dict(head=untrained_head, head_out=head)
    else:
        untrained, trained_files = convert(ckpt, tmp_path / "f32.gguf"), {}
    record = trainer().train(
        untrained, ckpt / "tokenizer.json", path, steps=STEPS, batch=BATCH, seq=SEQ, **trained_files
    )

    def accept(*rounds) -> dict:
        report = tmp_path / "accept.json"
        args = ("-k", "1", "--prompts", prompts, "-n", N_NEW, "--device", "cpu", "--json", report, *rounds)
        res = run_cli("accept", path, *head_args, *args)
        assert res.exit_code == 0, res.output
        return json.loads(report.read_text())

    ours, server_rounds = accept("--rounds", "llama-speculative-simple"), accept()

    model, tok = load_model(path, device="cpu", head=head)
    theirs = {"n_drafted": 0, "n_accept": 0}
    for i, line in enumerate(prompts.read_text().splitlines()):
        text = json.loads(line)["prompt"]
        prompt_file = tmp_path / f"p{i}.txt"
        prompt_file.write_text(text)
        flags = (*greedy_drafting(1), "-t", "1", *F32_CACHES)
        draft = ("-md", head) if head is not None else ()
        _, stats = speculative_simple(
            llama_cpp_bin, "-m", path, *draft, "-f", prompt_file, "--no-escape", "-n", N_NEW, *flags
        )
        like_theirs = speculative_simple_counts(model, tok.encode(text), N_NEW, 1, {tok.eos_token_id})
        assert like_theirs == {k: stats[k] for k in like_theirs}, (i, like_theirs, stats)
        theirs = {k: theirs[k] + stats[k] for k in theirs}
    rate, ref = ours["acceptance_rate"], theirs["n_accept"] / theirs["n_drafted"]
    print(
        f"\n| {arch} | {name} | {record['loss_head'][0]:.2f} -> {record['loss_head'][1]:.2f} | "
        f"{ours['accepted']}/{ours['drafted']} = {100 * rate:.1f} % | "
        f"{theirs['n_accept']}/{theirs['n_drafted']} = {100 * ref:.1f} % | {100 * (rate - ref):+.1f} | "
        f"{server_rounds['accepted']}/{server_rounds['drafted']} = {100 * server_rounds['acceptance_rate']:.1f} % |"
    )
    assert rate >= MIN_RATE, rate
    assert (ours["accepted"], ours["drafted"]) == (theirs["n_accept"], theirs["n_drafted"])
    assert abs(rate - ref) <= MAX_GAP, (rate, ref)
    assert server_rounds["greedy_outputs_identical"] and ours["greedy_outputs_identical"]
