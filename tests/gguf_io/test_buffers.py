"""The writer encodes the next tensor while it writes the one before (mtpq.gguf_io.buffers.encoded), each
tensor's chunks shared by the kernels' threads: an input error in any tensor names that tensor, the run exits 2,
and nothing is left behind, whatever the thread count."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader

from tests.helpers.runcli import run_cli


@pytest.fixture(scope="module")
def full(glm_ckpt, tmp_path_factory):
    path = tmp_path_factory.mktemp("pipeline") / "full.gguf"
    assert run_cli("convert", glm_ckpt, path, "--outtype", "f32", "--quiet").exit_code == 0
    return path


def _with_nan(full, tmp_path, pick) -> tuple:
    """A copy of ``full`` with a NaN in the matrix ``pick`` chooses from the float matrices in file order."""
    matrices = [t for t in GGUFReader(full).tensors if t.tensor_type == T.F32 and len(t.shape) == 2]
    victim = pick(matrices)
    data = bytearray(full.read_bytes())
    at = int(victim.data_offset) + 4 * 37
    data[at : at + 4] = np.float32("nan").tobytes()
    bad = tmp_path / "nan.gguf"
    bad.write_bytes(bytes(data))
    return bad, victim.name


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q6_K"])
def test_a_nan_names_its_tensor(full, tmp_path, where, qtype):
    pick = {"first": lambda m: m[0], "middle": lambda m: m[len(m) // 2], "last": lambda m: m[-1]}[where]
    bad, name = _with_nan(full, tmp_path, pick)
    out = tmp_path / "out.gguf"
    shared = run_cli("quantize", bad, out, qtype, "--pure", "--mtp-type", "same", "--threads", "2", "-q")
    assert shared.exit_code == 2, shared.output
    assert f"error: {bad.name}:{name}: contains NaN/Inf values\n" == shared.output  # one line, the name once
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nan.gguf"]  # no output, no temporary
    alone = run_cli("quantize", bad, out, qtype, "--pure", "--mtp-type", "same", "--threads", "1", "-q")
    assert alone.exit_code == 2 and alone.output == shared.output


def test_the_heap_is_frozen_only_while_tensors_are_written(full, tmp_path):
    """write_plan keeps the objects alive before it out of the cyclic collector while it writes (a full collection
    of a tokenizer's 200k objects, set off by the writing's own allocations, stalled an FP8 -> bf16 conversion by a
    fifth at random), and gives them back after, on success and on an error alike."""
    import gc

    from mtpq.gguf_io import plan_from_gguf, write_plan

    before, seen = gc.get_freeze_count(), []
    write_plan(plan_from_gguf(full), tmp_path / "a.gguf", on_tensor=lambda spec, n: seen.append(gc.get_freeze_count()))
    assert seen and min(seen) > before and gc.get_freeze_count() == before

    def fail(spec, n):
        raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"):
        write_plan(plan_from_gguf(full), tmp_path / "b.gguf", on_tensor=fail)
    assert gc.get_freeze_count() == before and not (tmp_path / "b.gguf").exists()
