"""Running llama.cpp's own converter on a tiny checkpoint, for parity tests (``@pytest.mark.llama_cpp``).

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
import subprocess
import sys
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


def llama_cpp_convert(src: Path, folder: Path, out: Path, pre: str, *args: str, outtype: str = "f32",
                      raw_config: bool = False) -> Path:
    """``convert_hf_to_gguf.py folder --outfile out --outtype outtype *args``; asserts success."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", _HARNESS, str(src), pre, "raw" if raw_config else "auto",
                           str(folder), "--outfile", str(out),
                           "--outtype", outtype, *args], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out
