"""``mtpq publish``: a built folder to a Hugging Face model repository, sending only what the repository lacks.

The plan compares each file the manifest lists with what the repository holds: a GGUF whose sha256 (the
manifest's) equals the repository file's LFS sha256 is not sent, nor a small file (manifest.json, SHA256SUMS,
README.md) whose git blob id is the repository's. The rest goes through huggingface_hub's ``upload_folder``
(Xet chunking, several commits for a big folder, and an interrupted upload resumes when run again); the model
files first, then the manifest, sums and card, so the card never describes files that are not there yet.
Files on the Hub that the build does not list are kept unless ``prune``. The README is the card rendered for the
repository it goes to (its ``-hf`` lines name it). The token is huggingface_hub's (``HF_TOKEN``, or the one
``hf auth login`` stored), handed to it and never printed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import InputError
from .bookkeeping import files_of, write_text
from .card import model_card
from .manifest import MANIFEST
from .recipe import REPO_ID

TEXT_FILES = (MANIFEST, "SHA256SUMS", "README.md")  # small: compared by git blob id
KEEP_ON_HUB = (".gitattributes",)


@dataclass(frozen=True)
class Item:
    path: str
    bytes: int
    send: bool
    why: str


@dataclass
class UploadPlan:
    folder: Path
    repo: str
    exists: bool
    private: bool
    card: str
    items: list[Item] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)
    prune: bool = False

    @property
    def sending(self) -> list[Item]:
        return [i for i in self.items if i.send]

    def lines(self) -> list[str]:
        """The plan as a person reads it: one line per file (send / skip / delete / keep, and why), then totals."""
        out = [f"{'create' if not self.exists else 'update'} {self.repo}"]
        for i in self.items:
            out.append(f"{'send' if i.send else 'skip'}  {i.path}  {i.bytes / 2**20:,.1f} MiB  {i.why}")
        for p in self.stale:
            out.append(
                f"{'delete' if self.prune else 'keep'}  {p}  on the Hub, not in this build"
                + ("" if self.prune else " (--prune deletes it)")
            )
        total = sum(i.bytes for i in self.sending)
        out.append(
            f"{len(self.sending)} to send ({total / 2**20:,.1f} MiB), "
            f"{len(self.items) - len(self.sending)} already on the Hub"
            + (f", {len(self.stale)} to delete" if self.prune and self.stale else "")
        )
        return out


def git_blob_id(data: bytes) -> str:
    """The id git gives a file's bytes (what the Hub lists as a regular file's oid)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def read_manifest(folder: Path) -> dict:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise InputError(folder, f"no {MANIFEST}: not a folder mtpq build wrote (run mtpq build first)")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(path, f"not valid JSON ({exc})") from None


def choose_repo(repo: str | None, manifest: dict) -> str:
    repo = repo or (manifest.get("publish") or {}).get("repo")
    if not repo:
        raise InputError("--repo", "no repository: pass --repo OWNER/NAME or set [publish] repo in the recipe")
    if not REPO_ID.match(repo):
        raise InputError("--repo", f"{repo!r} is not a Hugging Face repository id (OWNER/NAME)")
    return repo


def hub_call(what: str, fn: Callable, *args, **kwargs):
    """A huggingface_hub call whose failure (an HTTP status, an unreachable Hub) is one line naming ``what``."""
    from huggingface_hub.errors import HfHubHTTPError

    try:
        return fn(*args, **kwargs)
    except HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        raise InputError(what, f"the Hub answered {status or 'an error'}: {first}") from None
    except Exception as exc:  # httpx's transport errors: no network, DNS, TLS
        if not type(exc).__module__.startswith(("httpx", "httpcore", "requests", "urllib3")):
            raise
        raise InputError(what, f"cannot reach the Hub ({exc.__class__.__name__}: {exc})") from None


def hub_api():
    """huggingface_hub's client; it finds the token itself (HF_TOKEN, then the stored login)."""
    from huggingface_hub import HfApi

    return HfApi()


def hub_token() -> str | None:
    from huggingface_hub import get_token

    return get_token()


def require_token() -> None:
    """One line, exit 2, before anything is sent (or built) without a token; the token itself is never shown."""
    if not hub_token():
        raise InputError(
            "Hugging Face token",
            "none found: set HF_TOKEN or run `hf auth login` (a token that can write to the repository)",
        )


def remote_files(api, repo: str) -> tuple[bool, dict]:
    """(whether the repository exists, its files by path: RepoFile with blob_id and lfs.sha256)."""
    from huggingface_hub.errors import RepositoryNotFoundError

    def listing():
        try:
            return True, list(api.list_repo_tree(repo, recursive=True, repo_type="model"))
        except RepositoryNotFoundError:
            return False, []

    exists, tree = hub_call(repo, listing)
    return exists, {f.path: f for f in tree if hasattr(f, "blob_id")}


def plan_upload(folder: Path, repo: str | None, api, prune: bool = False, private: bool | None = None) -> UploadPlan:
    folder = Path(folder)
    manifest = read_manifest(folder)
    repo = choose_repo(repo, manifest)
    card = model_card(manifest, repo)
    local: list[tuple[str, int, str | None]] = []  # (path, bytes, sha256 from the manifest)
    for e in manifest["files"]:
        for f in files_of(e):
            p = folder / f["file"]
            if not p.is_file():
                raise InputError(p, f"listed by {MANIFEST} but missing")
            if p.stat().st_size != f["bytes"]:
                raise InputError(p, f"size differs from {MANIFEST} (rebuild, or run mtpq build --merge)")
            local.append((f["file"], f["bytes"], f["sha256"]))
    texts = {name: (folder / name).read_bytes() for name in TEXT_FILES[:2]}
    texts["README.md"] = card.encode()
    for name in TEXT_FILES[:2]:
        if not (folder / name).is_file():
            raise InputError(folder / name, "missing (run mtpq build --merge)")
    exists, remote = remote_files(api, repo)
    plan = UploadPlan(
        folder,
        repo,
        exists,
        bool((manifest.get("publish") or {}).get("private")) if private is None else private,
        card,
        prune=prune,
    )
    for path, size, sha in local:
        have = remote.get(path)
        if have is None:
            plan.items.append(Item(path, size, True, "new"))
        elif have.lfs is not None:
            same = have.lfs.sha256 == sha
            plan.items.append(Item(path, size, not same, f"sha256 {'matches' if same else 'differs from'} the Hub's"))
        else:  # stored as a regular git file (a small one): compared by its git blob id
            same = have.blob_id == git_blob_id((folder / path).read_bytes())
            plan.items.append(Item(path, size, not same, f"git blob {'matches' if same else 'differs from'} the Hub's"))
    for name, data in texts.items():
        have = remote.get(name)
        same = have is not None and have.blob_id == git_blob_id(data)
        why = "new" if have is None else f"git blob {'matches' if same else 'differs from'} the Hub's"
        plan.items.append(
            Item(name, len(data), not same, why + (" (card for this repository)" if name == "README.md" else ""))
        )
    listed = {i.path for i in plan.items}
    plan.stale = sorted(p for p in remote if p not in listed and p not in KEEP_ON_HUB)
    return plan


def run_upload(plan: UploadPlan, api, message: str, say: Callable[[str], None] = print) -> None:
    """Create the repository when needed, then send the plan's files: the model files, then the text files."""
    require_token()
    hub_call("Hugging Face token", api.whoami)  # a rejected token: one line before anything is created
    if not plan.exists:
        hub_call(plan.repo, api.create_repo, plan.repo, repo_type="model", private=plan.private, exist_ok=True)
        say(f"created {plan.repo}" + (" (private)" if plan.private else ""))
    readme = plan.folder / "README.md"
    if not readme.is_file() or readme.read_text() != plan.card:
        write_text(readme, plan.card)  # the card as it goes to this repository
    models = [i.path for i in plan.sending if i.path not in TEXT_FILES]
    texts = [i.path for i in plan.sending if i.path in TEXT_FILES]
    deletions = plan.stale if plan.prune else []
    for batch, delete in ((models, []), (texts, deletions)):
        if not batch and not delete:
            continue
        hub_call(
            plan.repo,
            api.upload_folder,
            repo_id=plan.repo,
            folder_path=str(plan.folder),
            repo_type="model",
            allow_patterns=batch or [],
            delete_patterns=delete or None,
            commit_message=message,
        )
        say(f"sent {len(batch)} files" + (f", deleted {len(delete)}" if delete else "") + f" to {plan.repo}")
