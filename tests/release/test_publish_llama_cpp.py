"""The demo recipe's build as llama.cpp users get it: laid out as a Hugging Face cache snapshot (what
huggingface_hub stores for a download), ``llama-server -hf OWNER/NAME:TAG --spec-type draft-mtp --offline``
loads each quant's trunk and the head file the manifest pairs it with, and drafts; the pair drafts exactly as the
one file holding both (greedy k=1, equal counts); and the mirror of llama.cpp's file selection
(mtpq.release.layout) picks what the binary picks on names chosen to trip it."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import pytest

from mtpq.release import layout as naming
from tests.helpers.llamacpp_ref import speculative_simple
from tests.helpers.runcli import run_cli

pytestmark = pytest.mark.llama_cpp
ROOT = Path(__file__).resolve().parents[2]
REPO = "someone/mtpq-demo-MTP-GGUF"
REV = "0123456789abcdef0123456789abcdef01234567"
PROMPTS = [("code", "def add(a, b):"), ("prose", "import os\nimport sys\n")]


def snapshot(hf_home: Path, repo: str, files: dict[str, Path]) -> Path:
    """``files`` (name in the repository -> file) stored as huggingface_hub stores a download: blobs named by
    sha256, snapshots/REV/NAME symlinks to them, refs/main holding REV."""
    root = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(REV)
    snap = root / "snapshots" / REV
    snap.mkdir(parents=True, exist_ok=True)
    for name, src in files.items():
        blob = root / "blobs" / hashlib.sha256(src.read_bytes()).hexdigest()
        if not blob.exists():
            shutil.copyfile(src, blob)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    return snap


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """examples/recipe.toml built (its gate cut to two prompts), and the build laid out as a Hub download."""
    work = tmp_path_factory.mktemp("demo")
    text = (ROOT / "examples" / "recipe.toml").read_text()
    text = text.replace('source = "../mtpq/data/demo"', f'source = "{resources.files("mtpq").joinpath("data/demo")}"')
    text = text.replace('output = "../dist"', 'output = "dist"').replace("[gate]\n", "[gate]\nmax_prompts = 2\n")
    (work / "recipe.toml").write_text(text)
    res = run_cli("build", work / "recipe.toml")
    assert res.exit_code == 0, res.output
    dist = work / "dist"
    manifest = json.loads((dist / "manifest.json").read_text())
    hf_home = work / "hf-home"
    snapshot(hf_home, REPO, {f["file"]: dist / f["file"] for f in manifest["files"]})
    return dist, manifest, hf_home


def _trunks(manifest: dict) -> list[dict]:
    return [f for f in manifest["files"] if f.get("form") == "trunk"]


def test_demo_recipe_is_laid_out_for_llama_cpp(demo):
    _, manifest, _ = demo
    assert manifest["layout"] == "both"
    assert [t["tag"] for t in _trunks(manifest)] == ["F16", "Q3_K_M", "Q4_K_M", "Q8_0"]


@pytest.fixture
def hub_env(demo, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(demo[2]))
    for var in ("LLAMA_CACHE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):  # llama.cpp reads these before HF_HOME
        monkeypatch.delenv(var, raising=False)


def _loaded(log: str) -> list[str]:
    return [Path(p).name for p in re.findall(r"loaded meta data with .* from (\S+\.gguf)", log)]


def test_llama_server_hf_offline_loads_each_trunk_with_its_head_and_drafts(demo, hub_env, llama_cpp_bin):
    from mtpq.engines.llama_cpp import LlamaServer, ServerConfig, measure_with_llama_cpp

    @dataclass
    class HfServer(ServerConfig):
        """llama-server -hf REPO:TAG --offline instead of -m FILE (-v: the loader names each file it reads)."""

        hf: str = ""

        def args(self, model, draft, host):
            a = super().args(model, draft, host)
            i = a.index("-m")
            return a[:i] + ["-hf", self.hf, "--offline", "-v"] + a[i + 2 :]

    dist, manifest, hf_home = demo
    for trunk in _trunks(manifest):
        cfg = HfServer(
            llama_cpp_bin / "llama-server", threads=1, ctx_size=512, extra=["--no-repack"], hf=f"{REPO}:{trunk['tag']}"
        )
        with LlamaServer(cfg, dist / trunk["file"], draft=1) as srv:
            report = measure_with_llama_cpp(None, PROMPTS, draft=1, max_new_tokens=16, url=srv.url)
            log = srv._log_text()
        draft = re.search(r"loading draft model '([^']+)'", log)
        assert draft and Path(draft.group(1)).name == trunk["head"], log[-3000:]
        assert str(hf_home) in draft.group(1)  # from the snapshot, not anywhere else
        assert set(_loaded(log)) == {trunk["file"], trunk["head"]}, _loaded(log)
        assert report.overall.n_drafted > 0, trunk["tag"]


def test_pair_drafts_as_the_one_file(demo, llama_cpp_bin):
    """Greedy k=1 in llama.cpp: trunk -md head and the _MTP file holding both give equal counts; a head
    requantized to 2 bits gives other counts (the comparison can fail)."""
    from mtpq.engines.llama_cpp import ServerConfig, measure_with_llama_cpp, with_draft_model

    dist, manifest, _ = demo
    cfg = ServerConfig(llama_cpp_bin / "llama-server", threads=1, ctx_size=512, extra=["--no-repack"])

    def counts(model: Path, head: Path | None = None) -> tuple[int, int]:
        r = measure_with_llama_cpp(
            model, PROMPTS, draft=1, max_new_tokens=24, server=cfg if head is None else with_draft_model(cfg, head)
        )
        return r.overall.n_drafted, r.overall.n_accepted

    for trunk in _trunks(manifest):
        fused = naming.combined_file(manifest["model"], trunk["tag"], "both")
        pair = counts(dist / trunk["file"], dist / trunk["head"])
        assert pair[0] > 0 and pair == counts(dist / fused), trunk["tag"]
    q4, ref = (next(t for t in _trunks(manifest) if t["tag"] == tag) for tag in ("Q4_K_M", "F16"))
    low = dist.parent / "mtp-low.gguf"
    assert run_cli("quantize", dist / ref["head"], low, "Q2_K", "--mtp-type", "q2_k", "-q").exit_code == 0
    assert counts(dist / q4["file"], low) != counts(dist / q4["file"], dist / q4["head"])


# names chosen to trip a wrong reading of common/download.cpp: nearest bits, the -TAG. name, BF16's 16, the
# _MTP suffix, a head below the model's folder
@pytest.mark.parametrize(
    "names, tag",
    [
        ({"m-Q4_K_M.gguf": "trunk", "mtp-m-Q8_0.gguf": "head", "mtp-m-F16.gguf": "head"}, "Q4_K_M"),
        ({"m-Q8_0.gguf": "trunk", "mtp-m-Q8_0.gguf": "head", "mtp-m-F16.gguf": "head"}, "Q8_0"),
        ({"m-F16.gguf": "trunk", "mtp-m-Q8_0.gguf": "head", "mtp-m-BF16.gguf": "head"}, "F16"),
        ({"m-Q4_K_M.gguf": "trunk", "mtp-m-Q2_K.gguf": "head", "mtp-m-Q8_0.gguf": "head"}, "Q4_K_M"),
        ({"m-Q4_K_M.gguf": "trunk", "m-Q4_K_M_MTP.gguf": "fused", "mtp-m-Q8_0.gguf": "head"}, "Q4_K_M"),
        ({"m-Q4_K_M.gguf": "trunk", "m-Q4_K_M_MTP.gguf": "fused", "mtp-m-Q8_0.gguf": "head"}, "Q4_K_M_MTP"),
        ({"m-Q4_K_M.gguf": "fused", "MTP/mtp-m-Q8_0.gguf": "head"}, "Q4_K_M"),
    ],
)
def test_mirror_picks_what_llama_cpp_picks(demo, tmp_path, monkeypatch, llama_cpp_bin, names, tag):
    dist, manifest, _ = demo
    trunk = next(t for t in _trunks(manifest) if t["tag"] == "Q4_K_M")
    source = {
        "trunk": dist / trunk["file"],
        "head": dist / trunk["head"],
        "fused": dist / naming.combined_file(manifest["model"], "Q4_K_M", "both"),
    }
    hf_home = tmp_path / "hf"
    snap = snapshot(hf_home, "someone/m", {})
    for name, kind in names.items():
        (snap / name).parent.mkdir(parents=True, exist_ok=True)
        (snap / name).symlink_to(source[kind])
    monkeypatch.setenv("HF_HOME", str(hf_home))
    for var in ("LLAMA_CACHE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    (model,) = naming.models_for_tag(sorted(names), tag)
    heads = naming.heads_for(sorted(names), model, tag)
    assert len(heads) <= 1  # the cases have one winner: no listing order decides
    proc, stats = speculative_simple(
        llama_cpp_bin,
        "-hf",
        f"someone/m:{tag}",
        "--offline",
        "--spec-type",
        "draft-mtp",
        "-p",
        "def",
        "-n",
        "4",
        "--temp",
        "0",
        "-t",
        "1",
        "--no-repack",
        "-c",
        "256",
        "-v",
    )
    assert _loaded(proc.stderr)[0] == Path(model).name, proc.stderr[-2000:]
    draft = re.search(r"loading draft model '([^']+)'", proc.stderr)
    if heads:
        assert draft and Path(draft.group(1)).name == Path(heads[0]).name, proc.stderr[-2000:]
    else:  # no head file for it: llama.cpp drafts with the model's own head
        assert draft is None and stats["n_drafted"] > 0
