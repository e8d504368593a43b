"""tokenizer.ggml.add_bos_token / add_eos_token: llama.cpp's converter trusts tokenizer.json's post-processor.

PyPI gguf 0.19 (our dependency) let tokenizer_config.json override it, so a
DeepSeek-V3-style tokenizer (ByteLevel post-processor, ``add_bos_token: true`` in the
config) came out with add_bos_token true where llama.cpp writes false, and
GLM/Qwen-style tokenizers (ByteLevel, no flags) without the two keys where llama.cpp
writes both false. Expectations are written by hand from llama.cpp's in-tree
gguf-py; the llama_cpp-marked test runs that SpecialVocab on the same folders.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mtpq.convert.vocab import add_special_flags

BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
BOS_TEMPLATE = {
    "type": "TemplateProcessing",
    "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
    "pair": [
        {"SpecialToken": {"id": "<s>", "type_id": 0}},
        {"Sequence": {"id": "A", "type_id": 0}},
        {"SpecialToken": {"id": "<s>", "type_id": 1}},
        {"Sequence": {"id": "B", "type_id": 1}},
    ],
    "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
}
CASES = {
    # name: (post_processor, tokenizer_config flags and tokens, expected flags)
    "deepseek_v3_like": (
        BYTE_LEVEL,
        {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>"},
        {"bos": False, "eos": False},
    ),
    "glm_qwen_like": (BYTE_LEVEL, {"eos_token": "</s>"}, {"bos": False, "eos": False}),
    "template_bos": (
        {"type": "Sequence", "processors": [BYTE_LEVEL, BOS_TEMPLATE]},
        {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>"},
        {"bos": True, "eos": False, "sep": False},
    ),  # a pair template without sep/eos between A and B
    "template_unnamed_bos": (BOS_TEMPLATE, {"eos_token": "</s>"}, {"bos": True, "sep": False}),
    "no_post_processor": (
        None,
        {"add_bos_token": True, "add_eos_token": True, "bos_token": "<s>"},
        {"bos": True, "eos": True},
    ),
}


def write_case(folder: Path, post, config: dict) -> Path:
    folder.mkdir(parents=True)
    added = [
        {
            "id": i,
            "content": t,
            "special": True,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
        }
        for i, t in enumerate(["</s>", "<s>"])
    ]
    tok = {
        "version": "1.0",
        "added_tokens": added,
        "post_processor": post,
        "model": {"type": "BPE", "vocab": {"</s>": 0, "<s>": 1, "a": 2}, "merges": []},
    }
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("case", sorted(CASES))
def test_flags_as_llama_cpp_decides_them(tmp_path, case):
    post, config, want = CASES[case]
    assert add_special_flags(write_case(tmp_path / case, post, config)) == want


def test_converted_files_carry_the_flags(glm_ckpt, tmp_path):
    """A tokenizer whose post-processor adds nothing: both keys written false (llama.cpp's GLM files have them)."""
    from tests.helpers.ggufcheck import convert

    kv, _ = convert(glm_ckpt, tmp_path / "m.gguf", "--outtype", "f32", "--no-mtp")
    post = json.loads((glm_ckpt / "tokenizer.json").read_text()).get("post_processor")
    want = add_special_flags(glm_ckpt)
    for typ in ("bos", "eos"):
        if typ in want:
            assert kv[f"tokenizer.ggml.add_{typ}_token"] == want[typ], (typ, post)
        else:
            assert f"tokenizer.ggml.add_{typ}_token" not in kv


_PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1] + "/gguf-py")
import gguf
print(json.dumps(gguf.SpecialVocab(sys.argv[2], load_merges=False).add_special_token))
"""


@pytest.mark.llama_cpp
@pytest.mark.parametrize("case", sorted(CASES))
def test_same_flags_as_llama_cpp_gguf_py(tmp_path, llama_cpp_src, case):
    post, config, _ = CASES[case]
    folder = write_case(tmp_path / case, post, config)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, str(llama_cpp_src), str(folder)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert add_special_flags(folder) == json.loads(proc.stdout.strip().splitlines()[-1])
