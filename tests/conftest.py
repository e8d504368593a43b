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


# CI sets this (.ci/run): a llama.cpp check that cannot find llama.cpp fails instead of skipping, and a run in
# which no llama_cpp-marked test passed fails as a whole
REQUIRE_LLAMA_CPP = os.environ.get("MTPQ_REQUIRE_LLAMA_CPP") == "1"


def _folder_from_env(var: str, holds: str, what: str) -> Path:
    """The folder environment variable ``var`` names; the test is skipped unless it holds ``holds`` (fails
    under MTPQ_REQUIRE_LLAMA_CPP=1)."""
    d = os.environ.get(var)
    if not d or not (Path(d) / holds).exists():
        (pytest.fail if REQUIRE_LLAMA_CPP else pytest.skip)(f"set {var} to {what}")
    return Path(d)


_llama_cpp_outcomes: dict[str, int] = {}


def pytest_runtest_logreport(report):
    """Count the outcomes of llama_cpp-marked tests (their call phase, or a skip or error in set-up)."""
    if "llama_cpp" in report.keywords and (report.when == "call" or report.outcome != "passed"):
        # pytest reports an xfail as "skipped": name it, so the log's skip count means tests that did not run
        outcome = "xfailed" if hasattr(report, "wasxfail") else report.outcome
        _llama_cpp_outcomes[outcome] = _llama_cpp_outcomes.get(outcome, 0) + 1


def pytest_terminal_summary(terminalreporter):
    if _llama_cpp_outcomes:
        counts = ", ".join(f"{n} {k}" for k, n in sorted(_llama_cpp_outcomes.items()))
        terminalreporter.write_line(f"llama_cpp-marked tests: {counts}")


def pytest_sessionfinish(session, exitstatus):
    """Under MTPQ_REQUIRE_LLAMA_CPP=1 a run that selected llama_cpp-marked tests must have passed some."""
    selected = any("llama_cpp" in item.keywords for item in getattr(session, "items", []))
    if REQUIRE_LLAMA_CPP and selected and not _llama_cpp_outcomes.get("passed"):
        session.exitstatus = 1


@pytest.fixture(scope="session")
def llama_cpp_bin() -> Path:
    """Folder with llama.cpp binaries (llama-cli, llama-quantize, llama-speculative-simple)."""
    return _folder_from_env("MTPQ_LLAMA_CPP_BIN", "llama-quantize", "a folder with llama.cpp binaries")


@pytest.fixture(scope="session")
def llama_cpp_src() -> Path:
    """The llama.cpp source tree (its convert_hf_to_gguf.py and gguf-py) for cross-checks."""
    return _folder_from_env("MTPQ_LLAMA_CPP_SRC", "convert_hf_to_gguf.py", "a llama.cpp source tree")
