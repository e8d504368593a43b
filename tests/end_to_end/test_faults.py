"""Interrupted and failing runs leave nothing behind, and a rerun gives the clean run's bytes.

- SIGTERM mid-write (what ``kill``, ``timeout`` and CI cancellation send) is handled like
  Ctrl-C: exit 143, one line, the temporary file removed.
- SIGKILL cannot be caught: the ``.NAME.partial-PID`` it leaves is removed by the next
  run of the same command, whose output is byte-identical to a clean run's.
- A full disk (a 1 MiB tmpfs, where the test may mount one) is one line naming the
  output and how far the write got, with the temporary file removed.
- An unexpected exception is one line, exit 3; its traceback only with ``--debug``.
- A split output (``--split-max-size``) is written into ``.NAME.partial-PID.shards/`` and its shards renamed into
  place only when all are complete: the same holds for it, and a renaming that is interrupted (or killed: the
  folder lists the shards it was renaming) leaves no shard behind.

The interrupted runs are real processes (``python -m mtpq.cli``); a small wrapper makes
each tensor take 50 ms to encode, so the signal lands while the file is being written.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mtpq.convert import plan_checkpoint
from mtpq.gguf_io import atomic_outputs, output_paths, remove_stale_partials, write_plan
from tests.helpers.runcli import run_cli

ROOT = Path(__file__).resolve().parents[2]

SLOW_CLI = """
import sys, time
import mtpq.gguf_io.buffers as g
encode = g.encode_tensor
def slow(spec):
    time.sleep(0.05)  # a slow disk: the signal arrives mid-write
    return encode(spec)
g.encode_tensor = slow
from mtpq.cli import main
sys.argv = ["mtpq", *sys.argv[1:]]
main()
"""


@pytest.fixture(scope="module")
def full_gguf(tmp_path_factory, glm_ckpt) -> Path:
    out = tmp_path_factory.mktemp("faults") / "full.gguf"
    write_plan(plan_checkpoint(glm_ckpt), out)
    return out


def _start(*args) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(
        [sys.executable, "-c", SLOW_CLI, *map(str, args)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _size(p: Path) -> int:
    try:
        return sum(f.stat().st_size for f in p.iterdir()) if p.is_dir() else p.stat().st_size
    except FileNotFoundError:
        return 0


def _wait_for_partial(proc: subprocess.Popen, out: Path, timeout: float = 120.0, split: bool = False) -> Path:
    """The process's temporary file (a split output's folder), once it holds tensor data."""
    partial = out.with_name(f".{out.name}.partial-{proc.pid}" + (".shards" if split else ""))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if partial.exists() and _size(partial) > 100_000:
            return partial
        if proc.poll() is not None:
            pytest.fail(f"exited before the signal: {proc.returncode} {proc.stderr.read()}")
        time.sleep(0.02)
    proc.kill()
    pytest.fail("no partial file appeared")


def _commands(glm_ckpt: Path, full_gguf: Path, out: Path) -> dict[str, list]:
    return {
        "convert": ["convert", glm_ckpt, out, "--quiet"],
        "quantize": ["quantize", full_gguf, out, "Q8_0", "--quiet"],
        "convert-split": ["convert", glm_ckpt, out, "--quiet", "--split-max-size", "1M"],
    }


def _outputs(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _interrupted_run(command: str, glm_ckpt: Path, full_gguf: Path, tmp_path: Path):
    """``command`` run to the end into tmp_path/clean, then started again into tmp_path/out: (the output path, the
    process, its partial file once one appeared)."""
    (tmp_path / "clean").mkdir()
    assert run_cli(*_commands(glm_ckpt, full_gguf, tmp_path / "clean" / "o.gguf")[command]).exit_code == 0
    out = tmp_path / "out" / "o.gguf"
    out.parent.mkdir()
    proc = _start(*_commands(glm_ckpt, full_gguf, out)[command])
    return out, proc, _wait_for_partial(proc, out, split=command.endswith("split"))


@pytest.mark.parametrize("command", ["convert", "convert-split", pytest.param("quantize", marks=pytest.mark.slow)])
def test_sigterm_mid_write_cleans_up(command, glm_ckpt, full_gguf, tmp_path):
    out, proc, _ = _interrupted_run(command, glm_ckpt, full_gguf, tmp_path)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert err.strip().splitlines() == ["terminated; no partial output was left behind"], err
    assert list(out.parent.iterdir()) == []  # neither the output (nor a shard) nor its temporary file
    assert run_cli(*_commands(glm_ckpt, full_gguf, out)[command]).exit_code == 0
    assert _outputs(out.parent) == _outputs(tmp_path / "clean")


@pytest.mark.parametrize(
    "command", ["convert-split", *(pytest.param(c, marks=pytest.mark.slow) for c in ("convert", "quantize"))]
)
def test_rerun_after_sigkill_removes_the_stale_partial(command, glm_ckpt, full_gguf, tmp_path):
    out, proc, partial = _interrupted_run(command, glm_ckpt, full_gguf, tmp_path)
    proc.kill()
    proc.communicate(timeout=60)
    assert [p.name for p in out.parent.iterdir()] == [partial.name]  # what SIGKILL leaves: it cannot be caught
    res = run_cli(*_commands(glm_ckpt, full_gguf, out)[command])
    assert res.exit_code == 0, res.output
    assert _outputs(out.parent) == _outputs(tmp_path / "clean")


def test_an_interrupted_publish_leaves_no_shard(tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM) while the finished shards are renamed into place: the ones already renamed go too."""
    finals = output_paths(tmp_path / "o.gguf", 3)
    real, calls = os.replace, []

    def interrupted(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with atomic_outputs(tmp_path / "o.gguf", finals) as tmps:
            for t in tmps:
                t.write_bytes(b"shard")
    assert calls == [finals[2], finals[1]]  # shard 1, the one readers are given, would have been last
    assert list(tmp_path.iterdir()) == []


def test_a_publish_killed_halfway_is_removed_by_the_next_run(tmp_path):
    """SIGKILL between two renames: the shards already in place are listed in the run's partial folder; the next
    run for the same output removes them with it. A live run's list is left alone."""
    out = tmp_path / "o.gguf"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        finals = output_paths(out, 3)
        for pid in (dead.pid, live.pid):
            folder = tmp_path / f".o.gguf.partial-{pid}.shards"
            folder.mkdir()
            (folder / "publishing").write_text("\n".join(f.name for f in finals))
        finals[2].write_bytes(b"renamed before the kill")
        (tmp_path / f".o.gguf.partial-{dead.pid}.shards" / finals[0].name).write_bytes(b"not yet renamed")
        removed = remove_stale_partials(out)
        assert set(removed) == {finals[2], tmp_path / f".o.gguf.partial-{dead.pid}.shards"}
        assert sorted(p.name for p in tmp_path.iterdir()) == [f".o.gguf.partial-{live.pid}.shards"]
    finally:
        live.kill()
        live.wait()


def test_a_live_process_partial_is_left_alone(tmp_path):
    out = tmp_path / "o.gguf"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        mine = out.with_name(f".o.gguf.partial-{live.pid}")
        stale = out.with_name(f".o.gguf.partial-{dead.pid}")
        other = out.with_name(f".other.gguf.partial-{dead.pid}")  # another output's: not ours to judge
        for p in (mine, stale, other):
            p.write_bytes(b"x")
        assert remove_stale_partials(out) == [stale]
        assert mine.exists() and other.exists() and not stale.exists()
    finally:
        live.kill()
        live.wait()


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs, or a skip where this process may not mount one."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({res.stderr.decode().strip() or res.returncode})")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


@pytest.mark.parametrize("command", ["convert", "quantize", "convert-split"])
def test_full_disk_is_one_line_and_leaves_nothing(command, glm_ckpt, full_gguf, tiny_disk):
    out = tiny_disk / "o.gguf"
    res = run_cli(*_commands(glm_ckpt, full_gguf, out)[command])
    assert res.exit_code == 2, res.output
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in res.output, res.stderr
    where = re.escape(f"{out}")
    if command.endswith("split"):  # named by shard 1, what a user gives llama.cpp
        where = re.escape(f"{tiny_disk}/o-00001-of-") + r"(\d{5})\.gguf \(shard 1 of (\d+)\)"
    m = re.match(f"error: {where}: no space left on device \\(wrote ", lines[0])
    assert m and (not m.groups() or int(m.group(1)) == int(m.group(2)) > 1), lines[0]
    wrote, total = [int(w) for w in lines[0].split("(wrote ")[1].rstrip(" bytes)").split(" of ")]
    assert 0 < wrote < total and total > 1 << 20, lines[0]
    assert list(tiny_disk.iterdir()) == []


def test_unexpected_exception_is_one_line_and_traceback_only_with_debug(full_gguf, monkeypatch):
    import mtpq.cli.inspect as inspect_cli

    def boom(path):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(inspect_cli, "summarize_gguf", boom)
    res = run_cli("inspect", full_gguf)
    assert res.exit_code == 3
    assert res.stderr.splitlines() == [
        "error: internal error in inspect: RuntimeError: boom second line; please report it"
    ]
    assert "Traceback" not in res.output
    from mtpq.cli.common import DEBUG

    try:
        res = run_cli("inspect", full_gguf, "--debug")
        assert res.exit_code == 3
        assert "Traceback" in res.stderr and "boom" in res.stderr
        assert res.stderr.strip().splitlines()[-1].startswith("error: internal error in inspect: RuntimeError: boom")
    finally:
        DEBUG["on"] = False


def test_bad_json_path_fails_before_measuring(full_gguf, tmp_path, monkeypatch):
    """--json into a missing folder is refused before the model is even loaded."""
    import mtpq.runtime.accept as runtime_accept

    def never(*a, **k):
        raise AssertionError("measured although the report could not be written")

    monkeypatch.setattr(runtime_accept, "measure_file", never)
    res = run_cli("accept", full_gguf, "--json", tmp_path / "missing" / "r.json")
    assert res.exit_code == 2 and res.stderr.splitlines() == [
        f"error: --json: {tmp_path / 'missing' / 'r.json'}: folder {tmp_path / 'missing'} does not exist"
    ]
