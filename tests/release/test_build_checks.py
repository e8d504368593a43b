"""mtpq build's promises about what it writes: nothing on --dry-run, nothing for a bad source,
and a ``graft_into`` variant that is exactly ``mtpq graft`` of the reference's head."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from mtpq.convert import BlockSelection, plan_checkpoint
from mtpq.gguf_io import write_plan
from tests.helpers.runcli import run_cli


def _recipe(path: Path, source: Path, output: Path, variant: str = 'name = "Q8_0"\npreset = "Q8_0"') -> Path:
    path.write_text(
        f'[model]\nname = "tiny"\nsource = "{source}"\noutput = "{output}"\nreference_type = "f16"\n\n'
        f"[[variant]]\n{variant}\n"
    )
    return path


def _tree(folder: Path) -> dict[str, str]:
    return (
        {
            str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*"))
            if p.is_file()
        }
        if folder.exists()
        else {}
    )


def test_dry_run_writes_nothing(glm_ckpt, tmp_path):
    out = tmp_path / "dist"
    recipe = _recipe(tmp_path / "r.toml", glm_ckpt, out)
    res = run_cli("build", recipe, "--dry-run")
    assert res.exit_code == 0 and "build" in res.stderr, res.output
    assert not out.exists()
    # after a build, a dry run leaves every file (source-hashes.json too) as it was
    assert run_cli("build", recipe).exit_code == 0
    before = _tree(out)
    (out / "build-parts" / "source-hashes.json").touch()
    stamp = (out / "build-parts" / "source-hashes.json").stat().st_mtime_ns
    res = run_cli("build", recipe, "--dry-run")
    assert res.exit_code == 0 and "reuse" in res.stderr, res.output
    assert _tree(out) == before
    assert (out / "build-parts" / "source-hashes.json").stat().st_mtime_ns == stamp


def test_bad_source_leaves_no_cache(glm_ckpt, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(glm_ckpt, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["hidden_size"] = "wide"
    (src / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "dist"
    res = run_cli("build", _recipe(tmp_path / "r.toml", src, out))
    assert res.exit_code == 2 and res.stderr.splitlines() == [
        f"error: {src / 'config.json'}: hidden_size must be an integer, got 'wide'"
    ], res.output
    assert not out.exists()


def test_graft_into_variant_is_mtpq_graft(glm_ckpt, tmp_path):
    trunk = tmp_path / "published-Q8_0.gguf"
    write_plan(plan_checkpoint(glm_ckpt, mtp=BlockSelection.DROP), trunk)
    out = tmp_path / "dist"
    recipe = _recipe(
        tmp_path / "r.toml",
        glm_ckpt,
        out,
        f'name = "G"\npreset = "Q8_0"\ngraft_into = "{trunk.name}"\nmtp_type = "q8_0"',
    )
    res = run_cli("build", recipe)
    assert res.exit_code == 0, res.output
    expected = tmp_path / "expected.gguf"
    res = run_cli("graft", expected, "--mtp-from", out / "tiny-F16.gguf", "--into", trunk, "--mtp-type", "q8_0", "-q")
    assert res.exit_code == 0, res.output
    assert (out / "tiny-G.gguf").read_bytes() == expected.read_bytes()
