"""The runtime's tokenizer, rebuilt from GGUF metadata, gives the ids llama.cpp gives for the same file.

The demo model's tokenizer has no fingerprint llama.cpp knows, so its GGUF says
``tokenizer.ggml.pre=default``: llama.cpp then splits with its own default list
(punctuation runs, GPT-2's regex, digit runs, digit triples). Acceptance, importance
statistics and engine comparisons all need the runtime to see exactly those tokens.
"""

from __future__ import annotations

import inspect
import json
import subprocess
from importlib import resources
from pathlib import Path

import pytest

from tests.helpers.runcli import run_cli


@pytest.mark.llama_cpp
def test_default_pre_tokenizer_equals_llama_tokenize(llama_cpp_bin, tmp_path):
    import gguf

    from mtpq.runtime.speculative import load_model

    tool = llama_cpp_bin / "llama-tokenize"
    if not tool.exists():
        pytest.skip("llama-tokenize was not built")
    src = Path(str(resources.files("mtpq").joinpath("data/demo")))
    path = tmp_path / "demo.gguf"
    assert run_cli("convert", src, path, "-q").exit_code == 0
    assert gguf.GGUFReader(path).fields["tokenizer.ggml.pre"].contents() == "default"
    _, tok = load_model(path, device="cpu")
    texts = [
        inspect.getsource(json.decoder),
        inspect.getsource(inspect.getmodule(subprocess)).split("\n\n\n")[3],
        "x  =  [1,2,3]  # 12345678 3.14159 !!?? <<>> a|b ^~ $$\n\n\n\tend   \n",
        "ünïcödé 🚀 ok",
    ]
    for i, text in enumerate(texts):
        f = tmp_path / f"t{i}.txt"
        f.write_text(text)
        proc = subprocess.run(
            [str(tool), "-m", str(path), "-f", str(f), "--ids", "--log-disable", "--no-escape"],
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        theirs = json.loads(proc.stdout.strip().splitlines()[-1])
        assert tok.encode(text) == theirs, text[:80]
