"""``mtpq publish``: upload a built folder to a Hugging Face model repository, sending only what it lacks."""

from __future__ import annotations

from pathlib import Path

import typer

from .app import app
from .common import console, guarded


@app.command(
    epilog=(
        "Examples:\n\n"
        "  mtpq publish dist --repo me/GLM-4.5-Air-MTP-GGUF --dry-run   # what would be sent, skipped, and why\n\n"
        "  mtpq publish dist --repo me/GLM-4.5-Air-MTP-GGUF             # creates the repository if needed\n\n"
        "  mtpq publish dist                                   # the recipe's [publish] repo\n\n"
        "  mtpq build recipe.toml --push                       # build, gate, then publish\n\n"
        "The token is huggingface_hub's: HF_TOKEN, or `hf auth login`."
    )
)
@guarded
def publish(
    folder: Path = typer.Argument(..., metavar="DIR", help="A folder mtpq build wrote (manifest.json, the GGUFs)."),
    repo: str = typer.Option(
        None,
        "--repo",
        help="OWNER/NAME of the model repository (default: the recipe's [publish] repo, recorded in manifest.json).",
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Print the plan (send / skip / delete, and why); send nothing."
    ),
    prune: bool = typer.Option(
        False,
        "--prune",
        help="Delete files on the Hub that this build does not list (an old layout's, a variant taken out).",
    ),
    private: bool = typer.Option(
        None,
        "--private/--public",
        help="Visibility of a repository this creates (default: the recipe's [publish] private).",
    ),
) -> None:
    """Upload a built folder through huggingface_hub: only files whose sha256 the repository lacks.

    GGUFs are compared by the manifest's sha256 with the repository's LFS sha256,
    manifest.json, SHA256SUMS and the model card by git blob id. The model files
    go first, the card last; an interrupted upload resumes when run again. Exit
    codes: 0 sent (or nothing to send), 2 no token, no repository, or a folder
    that is not a build.
    """
    push(folder, repo, dry_run=dry_run, prune=prune, private=private)


def push(
    folder: Path,
    repo: str | None,
    dry_run: bool = False,
    prune: bool = False,
    private: bool | None = None,
    message: str | None = None,
) -> None:
    """Plan and (unless dry_run) send; the plan's lines go to stdout on a dry run, to stderr otherwise."""
    from ..release import publish as hub
    from .common import out

    if not dry_run:
        hub.require_token()
    api = hub.hub_api()
    plan = hub.plan_upload(folder, repo, api, prune=prune, private=private)
    show = (
        (lambda line: out.print(line, highlight=False, markup=False, soft_wrap=True))
        if dry_run
        else (lambda line: console.print(line, highlight=False, markup=False, soft_wrap=True))
    )
    for line in plan.lines():
        show(line)
    if dry_run:
        return
    manifest = hub.read_manifest(folder)
    message = message or f"mtpq: {manifest['model']} (recipe {manifest['recipe_sha256'][:12]})"
    hub.run_upload(plan, api, message, say=lambda m: console.print(m, highlight=False, markup=False))
