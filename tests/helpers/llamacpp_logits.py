"""llama.cpp's own logits, trunk and MTP heads, for parity tests (``@pytest.mark.llama_cpp``).

:func:`llama_cpp_logits` runs ``mtp_harness.cpp`` (beside this file) over a GGUF: one teacher-forced pass of the
trunk through libllama, then every MTP head in an MTP context fed the way llama.cpp's draft-mtp driver feeds it
(the entry at position p holds x_p and the trunk's NextN state h_{p-1}, zeros at p = 0). The harness is compiled
once per llama.cpp build into the build folder (``$MTPQ_LLAMA_CPP_BIN/../mtpq-harness``), outside the clone.

:func:`ours` computes the same figures with the torch runtime (``first_pair="zero_state"``, llama.cpp's way) and
:func:`agreement` the KLD and argmax agreement between the two.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

HARNESS = Path(__file__).with_name("mtp_harness.cpp")


@dataclass
class Logits:
    trunk: np.ndarray  # [n, vocab]: predictions of x_{p+1}
    hidden: np.ndarray  # [n, embd]: the trunk's NextN state h_p
    heads: list[tuple[np.ndarray, np.ndarray]]  # per head: logits [n, vocab] (row p: from (h_{p-1}, x_p)), output


def harness(bin_dir: Path, src: Path) -> Path:
    """The compiled harness for this llama.cpp build (compiled on first use; keyed by the harness source)."""
    key = hashlib.sha256(HARNESS.read_bytes()).hexdigest()[:12]
    out = bin_dir.parent / "mtpq-harness" / f"mtp_harness-{key}"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    cmd = [
        "g++",
        "-O2",
        "-std=c++17",
        f"-I{src}/include",
        f"-I{src}/src",
        f"-I{src}/ggml/include",
        str(HARNESS),
        "-o",
        str(tmp),
        f"-L{bin_dir}",
        "-lllama",
        "-lggml",
        "-lggml-base",
        f"-Wl,-rpath,{bin_dir}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    assert proc.returncode == 0, proc.stderr[-3000:]
    tmp.replace(out)
    return out


def llama_cpp_logits(
    bin_dir: Path,
    src: Path,
    gguf: Path,
    tokens: list[int],
    work: Path,
    threads: int = 1,
    f32_cache: bool = False,
    head: Path | None = None,
) -> Logits:
    """llama.cpp's logits for ``tokens`` through the whole GGUF ``gguf`` (trunk and every MTP head); ``f32_cache``:
    with f32 KV caches and without flash attention (see the harness); ``head``: a head file whose MTP blocks draft
    for the trunk ``gguf`` (DeepSeek-V4's), as llama.cpp's ``-md``."""
    tok = work / "tokens.i32"
    np.asarray(tokens, dtype=np.int32).tofile(tok)
    out = work / "llama_cpp_logits.bin"
    from mtpq.engines.llama_cpp import child_env

    proc = subprocess.run(
        [
            str(harness(bin_dir, src)),
            str(gguf),
            str(tok),
            str(out),
            str(threads),
            "f32" if f32_cache else "-",
            *([str(head)] if head is not None else []),
        ],
        capture_output=True,
        text=True,
        errors="replace",
        timeout=600,
        env=child_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    raw = out.read_bytes()
    assert raw[:4] == b"MTPH", "not a harness output"
    n, vocab, embd, n_heads = (int(v) for v in np.frombuffer(raw[4:20], dtype=np.int32))
    values = np.frombuffer(raw[20:], dtype=np.float32)
    assert values.size == n * (vocab + embd) * (1 + n_heads), "truncated harness output"
    at = 0

    def take(width: int) -> np.ndarray:
        nonlocal at
        a = values[at : at + n * width].reshape(n, width)
        at += n * width
        return a

    trunk, hidden = take(vocab), take(embd)
    return Logits(trunk, hidden, [(take(vocab), take(embd)) for _ in range(n_heads)])


def ours(model, tokens: list[int]) -> Logits:
    """The torch runtime's figures for ``tokens``, laid out as :func:`llama_cpp_logits` lays out llama.cpp's (with
    ``first_pair="none"`` the head has no row 0: a row of zeros stands in for it)."""
    ids = torch.tensor([tokens])
    trunk = model.trunk(ids, use_cache=False)
    first = -1 if model.first_pair == "zero_state" else 0
    head_ids, states, packing = model.head_rows(ids, trunk.hidden, [len(tokens)], out_from=[first])
    heads = []
    for i in range(model.n_heads):
        out = model.draft(head_ids, states, use_cache=False, packing=packing, head=i)
        logits, hidden = out.logits[0].numpy(), out.hidden[0].numpy()
        if first == 0:
            logits, hidden = (np.concatenate((np.zeros_like(a[:1]), a)) for a in (logits, hidden))
        heads.append((logits, hidden))
    return Logits(trunk.logits[0].numpy(), trunk.hidden[0].numpy(), heads)


def agreement(ours_logits: np.ndarray, ref_logits: np.ndarray) -> tuple[float, float, float]:
    """(mean KLD(ref || ours), max KLD, share of rows with the same argmax) over the rows of two [n, vocab]."""
    ref = torch.log_softmax(torch.from_numpy(np.array(ref_logits, dtype=np.float64)), dim=-1)
    mine = torch.log_softmax(torch.from_numpy(np.array(ours_logits, dtype=np.float64)), dim=-1)
    kld = (ref.exp() * (ref - mine)).sum(-1)
    same = (ref.argmax(-1) == mine.argmax(-1)).double().mean()
    return kld.mean().item(), kld.max().item(), same.item()
