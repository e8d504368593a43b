"""mtpq publish / build --push against a Hub in memory (huggingface_hub's HfApi replaced; no network): the plan
sends only what the repository lacks (sha256 against the LFS sha256, git blob ids for the small files), a second
publish of an unchanged folder sends nothing, a changed variant sends only its files, --dry-run sends nothing,
and no token or no repository is one line and exit 2, the token never printed."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import shutil
from pathlib import Path

import pytest

from mtpq.release import publish as hub
from tests.helpers.runcli import run_cli

TOKEN = "hf_secret_token_value"


class FakeHub:
    """The HfApi calls mtpq makes, over repositories held in memory: GGUFs stored as LFS files (sha256), text
    files as regular git files (blob id), as the Hub stores them."""

    def __init__(self):
        self.repos: dict[str, dict[str, tuple[int, str, str | None]]] = {}  # path -> (size, blob id, lfs sha256)
        self.calls: list[tuple] = []

    def list_repo_tree(self, repo, recursive, repo_type):
        from huggingface_hub.hf_api import RepoFile

        self.calls.append(("list", repo))
        if repo not in self.repos:
            import httpx2
            from huggingface_hub.errors import RepositoryNotFoundError

            response = httpx2.Response(404, request=httpx2.Request("GET", f"https://huggingface.co/api/models/{repo}"))
            raise RepositoryNotFoundError(f"404 Client Error: repository {repo} not found", response=response)
        return [
            RepoFile(
                path=p, size=size, oid=blob, **({"lfs": {"size": size, "oid": sha, "pointerSize": 134}} if sha else {})
            )
            for p, (size, blob, sha) in self.repos[repo].items()
        ]

    def whoami(self):
        self.calls.append(("whoami",))
        return {"name": "someone"}

    def create_repo(self, repo, repo_type, private, exist_ok):
        self.calls.append(("create", repo, private))
        self.repos.setdefault(repo, {".gitattributes": (10, "0" * 40, None)})

    def upload_folder(self, repo_id, folder_path, repo_type, allow_patterns, delete_patterns, commit_message):
        files = self.repos[repo_id]
        sent = []
        for p in sorted(Path(folder_path).rglob("*")):
            rel = p.relative_to(folder_path).as_posix()
            if p.is_file() and any(fnmatch.fnmatchcase(rel, pat) for pat in allow_patterns):
                data = p.read_bytes()
                lfs = hashlib.sha256(data).hexdigest() if rel.endswith(".gguf") else None
                files[rel] = (len(data), hub.git_blob_id(data), lfs)
                sent.append(rel)
        for pat in delete_patterns or []:
            for rel in [r for r in files if fnmatch.fnmatchcase(r, pat) and r != ".gitattributes"]:
                del files[rel]
        self.calls.append(("upload", tuple(sent), tuple(delete_patterns or ()), commit_message))


@pytest.fixture
def fake(monkeypatch, tmp_path):
    h = FakeHub()
    monkeypatch.setattr(hub, "hub_api", lambda: h)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no stored token
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    return h


PUBLISH = """
[publish]
repo = "someone/tiny-MTP-GGUF"
base_model = "someone/tiny"
"""


def recipe_text(source: Path, q4: str = "") -> str:
    """test_build's two-variant recipe in layout "sidecar" (no [extras]: the sidecar layouts have none)."""
    from tests.release.test_build import RECIPE

    text = RECIPE.format(source=source, output="dist", mtp="q8_0", gate="").split("[extras]")[0]
    return text.replace('reference_type = "f16"', 'reference_type = "f16"\nlayout = "sidecar"') + q4 + PUBLISH


@pytest.fixture(scope="module")
def built(glm_ckpt, tmp_path_factory):
    work = tmp_path_factory.mktemp("publish")
    (work / "r.toml").write_text(recipe_text(glm_ckpt))
    res = run_cli("build", work / "r.toml")
    assert res.exit_code == 0, res.output
    return work


def sent(h: FakeHub) -> list[str]:
    return [p for c in h.calls if c[0] == "upload" for p in c[1]]


def test_first_publish_sends_everything_models_first_and_creates_the_repo(fake, built, tmp_path):
    dist = tmp_path / "dist"
    shutil.copytree(built / "dist", dist)
    res = run_cli("publish", dist)
    assert res.exit_code == 0, res.output
    manifest = json.loads((dist / "manifest.json").read_text())
    ggufs = sorted(f["file"] for f in manifest["files"])
    uploads = [c for c in fake.calls if c[0] == "upload"]
    assert ("create", "someone/tiny-MTP-GGUF", False) in fake.calls
    assert [sorted(u[1]) for u in uploads] == [ggufs, ["README.md", "SHA256SUMS", "manifest.json"]]
    repo = fake.repos["someone/tiny-MTP-GGUF"]
    for f in manifest["files"]:  # what the Hub holds is what the manifest says
        assert repo[f["file"]][2] == f["sha256"]
    assert TOKEN not in res.output

    fake.calls.clear()  # a second publish of the unchanged folder sends nothing
    res = run_cli("publish", dist)
    assert res.exit_code == 0, res.output
    assert sent(fake) == [] and not [c for c in fake.calls if c[0] == "create"]
    assert f"0 to send (0.0 MiB), {len(ggufs) + 3} already on the Hub" in res.stderr


def test_a_changed_variant_sends_only_its_files(fake, built, glm_ckpt, tmp_path):
    work = tmp_path / "w"
    shutil.copytree(built, work)
    assert run_cli("publish", work / "dist").exit_code == 0
    (work / "r.toml").write_text(recipe_text(glm_ckpt, q4='tensor_types = ["ffn_down=q6_k"]\n'))
    res = run_cli("build", work / "r.toml")
    assert res.exit_code == 0 and res.stderr.count("built") == 1, res.output
    fake.calls.clear()
    res = run_cli("publish", work / "dist", "--dry-run")
    assert res.exit_code == 0 and sent(fake) == [], res.output
    plan = res.stdout.splitlines()
    assert [line.split()[1] for line in plan if line.startswith("send")] == [
        "tiny-Q4_K_M.gguf",
        "manifest.json",
        "SHA256SUMS",
        "README.md",
    ]
    assert "skip  mtp-tiny-Q8_0.gguf" in res.stdout and "sha256 matches the Hub's" in res.stdout
    res = run_cli("publish", work / "dist")
    assert res.exit_code == 0, res.output
    assert sent(fake) == ["tiny-Q4_K_M.gguf", "README.md", "SHA256SUMS", "manifest.json"]


def test_dry_run_sends_nothing_and_creates_nothing(fake, built):
    res = run_cli("publish", built / "dist", "--repo", "someone/other", "--dry-run")
    assert res.exit_code == 0, res.output
    assert [c[0] for c in fake.calls] == ["list"] and "create someone/other" in res.stdout
    assert all(
        line.startswith(("send", "create", "4 to send", "7 to send", "8 to send", "9 to send"))
        for line in res.stdout.splitlines()
    ), res.stdout


def test_prune_deletes_what_the_build_does_not_list(fake, built):
    fake.repos["someone/tiny-MTP-GGUF"] = {"tiny-F16-MTP-only.gguf": (5, "1" * 40, "2" * 64)}
    res = run_cli("publish", built / "dist", "--dry-run")
    assert "keep  tiny-F16-MTP-only.gguf  on the Hub, not in this build (--prune deletes it)" in res.stdout
    res = run_cli("publish", built / "dist", "--prune")
    assert res.exit_code == 0, res.output
    assert "tiny-F16-MTP-only.gguf" not in fake.repos["someone/tiny-MTP-GGUF"]
    assert [c[2] for c in fake.calls if c[0] == "upload"] == [(), ("tiny-F16-MTP-only.gguf",)]


def test_card_names_the_repository_it_goes_to(fake, built, tmp_path):
    dist = tmp_path / "dist"
    shutil.copytree(built / "dist", dist)
    assert run_cli("publish", dist, "--repo", "me/elsewhere").exit_code == 0
    assert "llama-server -hf me/elsewhere:Q4_K_M --spec-type draft-mtp" in (dist / "README.md").read_text()


@pytest.mark.parametrize(
    "case, where, says",
    [
        (
            "no token",
            "Hugging Face token",
            "none found: set HF_TOKEN or run `hf auth login` (a token that can write to the repository)",
        ),
        ("no repo", "--repo", "no repository: pass --repo OWNER/NAME or set [publish] repo in the recipe"),
        ("bad repo", "--repo", "'not a repo' is not a Hugging Face repository id (OWNER/NAME)"),
        ("no build", "DIR", "no manifest.json: not a folder mtpq build wrote (run mtpq build first)"),
    ],
)
def test_missing_token_or_repository_is_one_line_exit_2(fake, built, tmp_path, monkeypatch, case, where, says):
    dist = tmp_path / "dist"
    shutil.copytree(built / "dist", dist)
    args = [dist]
    if case == "no token":
        monkeypatch.delenv("HF_TOKEN")
    elif case == "no repo":
        m = json.loads((dist / "manifest.json").read_text())
        m["publish"] = {}
        (dist / "manifest.json").write_text(json.dumps(m))
    elif case == "bad repo":
        args += ["--repo", "not a repo"]
    else:
        (dist / "manifest.json").unlink()
    res = run_cli("publish", *args)
    assert res.exit_code == 2, res.output
    where = str(dist) if where == "DIR" else where
    assert res.stderr.strip() == f"error: {where}: {says}", res.stderr
    assert sent(fake) == [] and not [c for c in fake.calls if c[0] == "create"]


def test_build_push_checks_before_building_and_uploads_after(fake, glm_ckpt, tmp_path, monkeypatch):
    recipe = tmp_path / "r.toml"
    recipe.write_text(recipe_text(glm_ckpt).replace('repo = "someone/tiny-MTP-GGUF"\n', ""))
    res = run_cli("build", recipe, "--push")
    assert res.exit_code == 2 and "no repository" in res.stderr and not (tmp_path / "dist").exists(), res.output
    recipe.write_text(recipe_text(glm_ckpt))
    monkeypatch.delenv("HF_TOKEN")
    res = run_cli("build", recipe, "--push")
    assert res.exit_code == 2 and "Hugging Face token" in res.stderr and not (tmp_path / "dist").exists()
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    res = run_cli("build", recipe, "--push")
    assert res.exit_code == 0, res.output
    assert "tiny-Q8_0.gguf" in fake.repos["someone/tiny-MTP-GGUF"] and TOKEN not in res.output
