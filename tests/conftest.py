from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.builders import tiny


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Tiny models: a second intra-op thread only adds spin-waiting (badly so on a shared 2-core machine).
    The quant kernels (mtpq.ggml, not torch) keep their own threads; their bytes never depend on the count
    (tests/ggml/test_goldens.py checks three)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session", autouse=True)
def ggml_kernels_warm():
    """Every ggml kernel compiled (or loaded from numba's cache) once, before the tests: a cold cache costs
    ~70 s of CPU once (the CI machine's first run), a warm one ~1 s; no test then pays a compilation."""
    from mtpq.ggml import engine

    engine.warm()


@pytest.fixture(scope="session")
def glm_ckpt(tmp_path_factory) -> Path:
    """A tiny GLM-4.5 checkpoint in f32 (exact comparisons), with one MTP layer, 2 shards."""
    return tiny.glm4moe(tmp_path_factory.mktemp("glm") / "ckpt", dtype=__import__("torch").float32)


def _folder_from_env(var: str, holds: str, what: str) -> Path:
    """The folder environment variable ``var`` names; the test is skipped unless it holds ``holds``."""
    d = os.environ.get(var)
    if not d or not (Path(d) / holds).exists():
        pytest.skip(f"set {var} to {what}")
    return Path(d)


@pytest.fixture(scope="session")
def llama_cpp_bin() -> Path:
    """Folder with llama.cpp binaries (llama-cli, llama-quantize, llama-speculative-simple)."""
    return _folder_from_env("MTPQ_LLAMA_CPP_BIN", "llama-quantize", "a folder with llama.cpp binaries")


@pytest.fixture(scope="session")
def llama_cpp_src() -> Path:
    """The llama.cpp source tree (its convert_hf_to_gguf.py and gguf-py) for cross-checks."""
    return _folder_from_env("MTPQ_LLAMA_CPP_SRC", "convert_hf_to_gguf.py", "a llama.cpp source tree")
