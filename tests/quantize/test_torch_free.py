"""``quantize``, ``inspect``, ``graft`` and ``extract-mtp`` never import torch (issue 37): each command is run
for real, in a fresh interpreter, on a tiny converted GGUF, and the modules it loaded are read at its exit.

torch costs ~0.7-1.5 s of start-up on the machines we measure (docs/performance.md); the quantize path is the
numba kernels of mtpq.ggml, numpy and gguf-py. The check reads ``sys.modules`` from an atexit hook in the
child, so a lazily imported torch (in a worker thread, behind an option) counts as well as one imported at the
top of a module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.builders import tiny
from tests.helpers.ggufcheck import f32_gguf

ROOT = Path(__file__).resolve().parents[2]

# the child runs the command as `python -m mtpq ...` does, then says which heavy modules it loaded
_CHILD = r"""
import atexit, json, runpy, sys
out, args = sys.argv[1], sys.argv[2:]
def said():
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "safetensors"))
    with open(out, "w") as f:
        json.dump(heavy, f)
atexit.register(said)
sys.argv = ["mtpq", *args]
runpy.run_module("mtpq", run_name="__main__", alter_sys=True)
"""


def run_fresh(tmp: Path, *args) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``mtpq ARGS`` in a new interpreter importing this checkout's mtpq: (the process, the torch-family modules
    it had loaded when it exited)."""
    report = tmp / f"modules-{len(list(tmp.glob('modules-*')))}.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run(
        [sys.executable, "-c", _CHILD, str(report), *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    return p, json.loads(report.read_text())


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """A tiny GLM-4.5 (one trunk layer + MTP block) in f32, its Q4_K_M without the head, and an imatrix."""
    from mtpq.gguf_io import plan_from_gguf
    from mtpq.quantize.imatrix import Entry, Imatrix, write_imatrix

    w = tmp_path_factory.mktemp("torch_free")
    ckpt = tiny.glm4moe(w / "ckpt", num_hidden_layers=1, dtype=torch.float32)
    f32 = f32_gguf(ckpt, w / "f32.gguf")
    rng = np.random.default_rng(0)
    entries = {}
    for s in plan_from_gguf(f32).tensors:
        if len(s.shape) >= 2:
            n_mat = s.shape[0] if len(s.shape) == 3 else 1
            entries[s.name] = Entry(
                np.exp(rng.normal(0, 1, (n_mat, s.shape[-1]))).astype(np.float32), np.ones(n_mat, np.float32)
            )
    write_imatrix(Imatrix(entries, datasets=["test"], chunk_count=1, chunk_size=1), w / "im.gguf")
    return {"dir": w, "f32": f32, "im": w / "im.gguf"}


def test_the_check_sees_torch(files):
    """The probe works: a command that does load torch (a checkpoint conversion) is reported as doing so."""
    _, heavy = run_fresh(
        files["dir"], "convert", files["dir"] / "ckpt", files["dir"] / "probe.gguf", "--outtype", "f32", "-q"
    )
    assert "torch" in heavy


def test_quantize_inspect_graft_extract_never_import_torch(files):
    w, f32, im = files["dir"], files["f32"], files["im"]
    commands = [
        ("quantize", f32, w / "q4km.gguf", "Q4_K_M", "-q"),
        ("quantize", f32, w / "q4km-im.gguf", "Q4_K_M", "--imatrix", im, "-q"),
        # an i-quant (its grids, an imatrix required) with the head at another i-quant
        ("quantize", f32, w / "iq4xs.gguf", "IQ4_XS", "--imatrix", im, "--mtp-type", "iq4_nl", "-q"),
        ("quantize", f32, w / "trunk.gguf", "Q6_K", "--dry-run"),
        ("inspect", f32),
        ("inspect", w / "q4km.gguf", "--json"),
        ("extract-mtp", w / "q4km-im.gguf", w / "head.gguf", "-q"),
        ("inspect", w / "head.gguf"),
        ("graft", w / "grafted.gguf", "--mtp-from", w / "head.gguf", "--into", w / "iq4xs.gguf", "--replace", "-q"),
        # requantized from the donor's f32 values
        (
            "graft",
            w / "grafted-q8.gguf",
            "--mtp-from",
            f32,
            "--into",
            w / "q4km.gguf",
            "--replace",
            "--mtp-type",
            "q8_0",
            "-q",
        ),
    ]
    loaded = {}
    for args in commands:
        _, heavy = run_fresh(w, *args)
        if heavy:
            loaded[" ".join(str(a) if not isinstance(a, Path) else a.name for a in args)] = heavy[:3]
    assert not loaded, f"commands that imported torch (or transformers/safetensors): {loaded}"
