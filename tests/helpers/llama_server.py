"""llama-server as a reference for the speculative loop: greedy completions drafted with a GGUF's own MTP head
(k=1), and our loop counted the way llama-server counts its drafts. Shared by the runtime tests of the MLA
families (tests/runtime/test_runtime_deepseek2.py, test_runtime_dsa.py)."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers.llamacpp_ref import free_port

# llama.cpp's defaults (f16 KV caches, flash attention on CPU) move logits by ~2e-4: enough to flip the
# greedy ties of these tiny models (top-2 margins down to 5e-4). With f32 caches and no flash attention,
# its top-2 margins equal ours to 5 decimals.
F32_CACHES = ["-ctk", "f32", "-ctv", "f32", "-ctkd", "f32", "-ctvd", "f32", "-fa", "off"]


def llama_server_cmd(bin_dir: Path, model: Path, port: int, *flags: str) -> list[str]:
    """``llama-server -m model *flags --host 127.0.0.1 --port port``, the binary from bin_dir."""
    return [str(bin_dir / "llama-server"), "-m", str(model), *flags, "--host", "127.0.0.1", "--port", str(port)]


def llama_server_completions(bin_dir: Path, gguf_path: Path, prompts: list[list[int]], n: int) -> list[dict]:
    """Greedy completions of token prompts from llama-server drafting with the file's MTP head (k=1)."""
    port = free_port()
    flags = ["--spec-type", "draft-mtp", "--spec-draft-n-max", "1", "-c", "512", "-t", "1", "-np", "1", "--no-repack"]
    server = subprocess.Popen(
        llama_server_cmd(bin_dir, gguf_path, port, *flags, *F32_CACHES),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if server.poll() is not None:
                pytest.fail(f"llama-server exited: {server.stderr.read()[-2000:]}")
            try:
                if json.loads(urllib.request.urlopen(url + "/health", timeout=1).read()).get("status") == "ok":
                    break
            except OSError:
                pass
            time.sleep(0.1)
        out = []
        for ids in prompts:
            body = {
                "prompt": ids,
                "n_predict": n,
                "temperature": 0,
                "top_k": 1,
                "return_tokens": True,
                "cache_prompt": False,
            }
            req = urllib.request.Request(
                url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            out.append(json.loads(urllib.request.urlopen(req, timeout=120).read()))
        return out
    finally:
        server.terminate()
        server.wait(timeout=30)


def run_like_llama_cpp(model, ids: list[int], n: int, stop_ids: set[int]):
    """Our k=1 loop as llama-server counts it (no draft for the last token). The head's first pair is llama.cpp's
    (zeros, x_0) already (the model's first_pair="zero_state"). -> (drafts, accepted)"""
    from mtpq.runtime import speculative as sp

    dec = sp.SpeculativeDecoder(model, k=1)
    generated, drafts, accepted = [dec.prefill(ids)], 0, 0
    while len(generated) < n - 1 and not (stop_ids & set(generated)):  # llama-server: no draft for the last token
        emitted, _ = dec.step()
        generated += emitted
        drafts, accepted = drafts + 1, accepted + len(emitted) - 1
    return drafts, accepted
