"""``mtpq build``: every quant of a model from one recipe, checked and described."""

from __future__ import annotations

from pathlib import Path

import typer

from .app import app
from .common import EXIT_OK, console, fail, gating, guarded


@app.command(
    epilog=(
        "Examples:\n\n"
        "  mtpq build recipe.toml                       # everything, incremental\n\n"
        "  mtpq build recipe.toml --variant Q4_K_M      # one CI matrix job\n\n"
        "  mtpq build recipe.toml --merge               # combine the matrix jobs' parts\n\n"
        "  mtpq build recipe.toml --dry-run             # what would be (re)built\n\n"
        "  mtpq build recipe.toml --push                # then upload to [publish] repo (mtpq publish)\n\n"
        "See `examples/recipe.toml` and `examples/github-actions.yml`."
    )
)
@guarded
def build(
    recipe_path: Path = typer.Argument(..., metavar="RECIPE.toml", help="The build recipe (see examples/recipe.toml)."),
    variant: list[str] = typer.Option(
        None, "--variant", help="Build only this variant (repeatable); writes parts for --merge."
    ),
    jobs: int = typer.Option(1, "--jobs", "-j", min=1, help="Variants built in parallel processes."),
    force: bool = typer.Option(False, "--force", help="Rebuild even when inputs and options are unchanged."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show what would be built or reused; write nothing."),
    merge: bool = typer.Option(
        False, "--merge", help="Only combine the parts in the output folder into manifest.json, SHA256SUMS, README.md."
    ),
    push: bool = typer.Option(
        False,
        "--push",
        help="When every gate passed, upload the output folder to the "
        "recipe's [publish] repo (as mtpq publish: only what the repository lacks).",
    ),
) -> None:
    """Convert once, quantize every variant, gate each on MTP acceptance, write manifest + SHA256SUMS + model card.

    Exit codes: 0 every variant built and passed; 1 a gate failed (other variants
    still build; manifest.json says why), or a file's logits were not finite (the
    build stops there); 2 a bad recipe or input (the key is named), or a file whose
    weights hold NaN or inf (the tensor is named).
    """
    from ..release import load_recipe, run_build, write_outputs
    from ..release.plan import plan_jobs
    from ..release.runner import reusable

    recipe = load_recipe(recipe_path, check_inputs=not merge)
    if push:  # before hours of building: the repository and the token
        from ..release.publish import choose_repo, require_token

        if variant or dry_run:
            fail("--push", "uploads a whole build: not with --variant or --dry-run")
        choose_repo(None, {"publish": {"repo": recipe.publish.repo}})
        require_token()
    if merge:
        manifest = write_outputs(recipe)
        console.print(f"merged {len(manifest['files'])} files into {recipe.output / 'manifest.json'}")
        if push and manifest["passed"]:
            _push(recipe)
        raise typer.Exit(EXIT_OK if manifest["passed"] else 1)
    if dry_run:
        import json

        plan = plan_jobs(recipe, variant or None, force, dry_run=True)  # writes nothing
        for job in plan.jobs:
            part = Path(job["part"])
            old = json.loads(part.read_text()) if part.is_file() else None
            fresh = reusable(job, old)
            console.print(f"{'reuse' if fresh else 'build'}  {Path(job['out']).name}")
        return
    with gating():  # a file whose logits are not finite fails the build (exit 1) before anything is published
        code = run_build(
            recipe, only=variant or None, jobs=jobs, force=force, log=lambda m: console.print(m, highlight=False)
        )
    if push and code == EXIT_OK:
        _push(recipe)
    elif push:
        console.print("a gate failed: nothing was uploaded", highlight=False)
    raise typer.Exit(code)


def _push(recipe) -> None:
    from .publish import push

    push(recipe.output, recipe.publish.repo, private=recipe.publish.private or None)
