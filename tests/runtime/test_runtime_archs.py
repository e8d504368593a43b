"""Commands that need the torch runtime say so before any work, on a file of an architecture it does not run; and the
torch-free list those checks read (mtpq/runtime/archs.py) is the set of families the runtime registers."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from tests.helpers.runcli import run_cli


def test_the_torch_free_list_is_the_runtimes_families():
    from mtpq.runtime.archs import RUNTIME_ARCHS
    from mtpq.runtime.families import RUNTIME_FAMILIES

    assert RUNTIME_ARCHS == frozenset(RUNTIME_FAMILIES)


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory):
    """A tiny GGUF of llama.cpp's ``llama`` architecture (no MTP head, no runtime in mtpq)."""
    path = tmp_path_factory.mktemp("llama") / "llama.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_head_count(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(64)])
    rng = np.random.default_rng(0)
    for name, shape in (
        ("token_embd.weight", (64, 32)),
        ("output_norm.weight", (32,)),
        ("blk.0.attn_q.weight", (32, 32)),
    ):
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    "command",
    [
        ("accept", "{f}"),
        ("compare", "{f}", "{f}", "-f", "{text}"),
        ("sweep", "{f}"),
        ("imatrix", "{f}", "-f", "{text}", "-o", "{out}"),
        ("quantize", "{f}", "{out}", "Q4_K_M", "--mtp-type", "auto"),
    ],
    ids=lambda c: c[0],
)
def test_a_command_that_needs_the_runtime_says_so_first(command, llama_file, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("hello " * 400)
    out = tmp_path / "out.gguf"
    args = [a.format(f=llama_file, text=text, out=out) for a in command]
    res = run_cli(*args)
    assert res.exit_code == 2, res.output
    assert "architecture 'llama' has no runtime in mtpq" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not out.exists() and not list(tmp_path.glob("*.tmp*"))
