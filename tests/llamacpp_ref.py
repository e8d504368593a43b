"""Running llama.cpp's own converter on a tiny checkpoint, for parity tests (``@pytest.mark.llama_cpp``).

The converter runs in a child process with the llama.cpp tree's own gguf-py. Two
patches make it accept tiny test checkpoints, and change nothing else: its
pre-tokenizer lookup (a fingerprint table of real tokenizers) returns the name mtpq
chose, and DeepSeek-V3.2's vocab setup (which asserts an attribute transformers 5
no longer exposes) uses the plain gpt2 path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

_HARNESS = """
import runpy, sys
src, pre = sys.argv[1], sys.argv[2]
sys.path[:0] = [src + "/gguf-py", src]
import conversion.base as base
import conversion.deepseek as deepseek
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
deepseek.DeepseekV32Model.set_vocab = lambda self: self._set_vocab_gpt2()
sys.argv = [src + "/convert_hf_to_gguf.py", *sys.argv[3:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def llama_cpp_convert(src: Path, folder: Path, out: Path, pre: str, *args: str, outtype: str = "f32") -> Path:
    """``convert_hf_to_gguf.py folder --outfile out --outtype outtype *args``; asserts success."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", _HARNESS, str(src), pre, str(folder), "--outfile", str(out),
                           "--outtype", outtype, *args], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out
