"""Every release manifest (tests/releases/) through mtpq, and against llama.cpp's converter.

The fast part (CI's default run): each release-shaped checkpoint, in every form it ships, converts with
the MTP head kept, trunk-only and head-only, and the file says how many MTP blocks it holds.

The differential matrix (``llama_cpp``-marked, ``make test-extra``): manifest x form x {default, --no-mtp,
--mtp-only}: both converters accept, or both refuse; when both accept, every tensor name, shape, type and
f32 byte and every metadata key equal llama.cpp's converter's. Cells where mtpq knowingly differs are listed
in the manifest's ``DIFFERS`` with the reason (mtpq must still convert them).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import releases
from tests.helpers.familycheck import OUR_MODE, assert_same_gguf
from tests.helpers.ggufcheck import read_gguf
from tests.helpers.runcli import run_cli

MANIFESTS = releases.manifests()


@pytest.fixture(scope="module")
def release_ckpt(tmp_path_factory):
    """get(manifest, form): the tiny checkpoint, built once per module run."""
    cache = {}

    def get(name: str, form: str):
        if (name, form) not in cache:
            folder = tmp_path_factory.mktemp(f"{name}-{form}") / "ckpt"
            cache[name, form] = releases.build(MANIFESTS[name], folder, form)
        return cache[name, form]

    return get


def _ids(cell) -> str:
    name, form, mode = cell
    return f"{name}-{form}-{(mode or 'full').lstrip('-')}"


def test_every_manifest_cites_its_sources_and_names_its_mtp_layers():
    """A manifest without sources is our reading again; one without MTP tensors tests nothing of the head."""
    assert MANIFESTS
    for name, m in MANIFESTS.items():
        assert m.SOURCES and all(isinstance(s, str) and s for s in m.SOURCES), name
        assert m.RELEASE, name
        assert "bf16" in m.FORMS or "fp8" in m.FORMS or m.FORMS, name
        names = m.tensors(m.CONFIG)
        assert any(k in n for n in names for k in ("eh_proj", "e_proj", "mtp.fc", "nextn")), f"{name}: no MTP tensors"


@pytest.mark.parametrize("cell", releases.cells(), ids=_ids)
def test_release_converts(cell, release_ckpt, tmp_path):
    name, form, mode = cell
    ck = release_ckpt(name, form)
    out = tmp_path / "out.gguf"
    res = run_cli("convert", ck, out, "--quiet", "--outtype", "bf16", *OUR_MODE[mode])
    if (form, mode) in getattr(MANIFESTS[name], "REFUSES", {}):
        assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1, res.output
        return
    assert res.exit_code == 0, res.output
    kv, tensors = read_gguf(out)
    arch = kv["general.architecture"]
    n_mtp = kv.get(f"{arch}.nextn_predict_layers")
    blocks = {int(t.split(".")[1]) for t in tensors if t.startswith("blk.")}
    if mode == "--no-mtp":
        assert n_mtp is None and len(blocks) == kv[f"{arch}.block_count"]
    else:
        assert n_mtp and n_mtp >= 1, kv.keys()
        assert any(".nextn." in t for t in tensors)
        if mode == "--mtp":
            assert min(blocks) >= kv[f"{arch}.block_count"] - n_mtp


@pytest.mark.llama_cpp
@pytest.mark.parametrize("cell", releases.cells(), ids=_ids)
def test_release_same_as_llama_cpp(cell, release_ckpt, tmp_path, llama_cpp_src):
    """Both converters accept (and write the same file) or both refuse."""
    from tests.helpers.llamacpp_ref import llama_cpp_convert_result

    name, form, mode = cell
    m = MANIFESTS[name]
    ck = release_ckpt(name, form)
    out = tmp_path / "ours.gguf"
    ours = run_cli("convert", ck, out, "--quiet", "--outtype", "f32", *OUR_MODE[mode])
    differs = getattr(m, "DIFFERS", {}).get((form, mode))
    refuses = getattr(m, "REFUSES", {}).get((form, mode))
    pre = "gpt-2"
    if ours.exit_code == 0:
        pre = read_gguf(out)[0]["tokenizer.ggml.pre"]
    ref_path = tmp_path / "ref.gguf"
    their_mode = getattr(m, "LLAMA_CPP_MODE", {}).get(mode, mode)
    ok, log = llama_cpp_convert_result(llama_cpp_src, ck, ref_path, pre, *([their_mode] if their_mode else []),
                                       raw_config=getattr(m, "LLAMA_CPP_RAW_CONFIG", False))
    if differs is not None:
        assert ours.exit_code == 0, ours.output
        pytest.xfail(f"mtpq knowingly differs: {differs}")  # reported, never silently passed
    if refuses is not None:
        assert ours.exit_code == 2 and ok, (ours.output, log[-2000:])
        pytest.xfail(f"mtpq knowingly refuses: {refuses}")
    assert (ours.exit_code == 0) == ok, f"mtpq exit {ours.exit_code}: {ours.output[-800:]}\nllama.cpp: {log[-2000:]}"
    if ok:
        kv, tensors = read_gguf(out)
        keys = getattr(m, "DIFFERS_KEYS", {})
        ref_kv = read_gguf(ref_path)[0]
        for key, reason in keys.items():  # a stale entry would hide a real comparison
            assert kv.get(key) != ref_kv.get(key), f"{key} is equal, yet DIFFERS_KEYS says: {reason}"
        assert_same_gguf(out, kv, tensors, ref_path, ignore=tuple(keys))


@pytest.mark.parametrize("name", sorted(MANIFESTS))
def test_release_quantizes_with_the_head_at_q8_0_and_extracts(name, release_ckpt, tmp_path):
    """On each release-shaped file (its first form): Q4_K_M with every MTP tensor at q8_0 (those llama-quantize
    never quantizes, norms and routers, as converted),
    ``inspect`` reports the MTP blocks, ``extract-mtp`` writes the head-only file of exactly those blocks."""
    import json

    from gguf import GGMLQuantizationType as T
    from gguf import GGUFReader

    from mtpq.quantize.presets import llama_quantizes

    m = MANIFESTS[name]
    form = next(iter(m.FORMS))
    ck = release_ckpt(name, form)
    # a head that converts only into its own file is checked there
    head_only = ("--mtp-only",) if (form, None) in getattr(m, "REFUSES", {}) else ()
    f16 = tmp_path / "f16.gguf"
    assert run_cli("convert", ck, f16, "--quiet", "--outtype", "f16", *head_only).exit_code == 0
    _, before = read_gguf(f16)
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in GGUFReader(f16).tensors}  # torch order
    q = tmp_path / "q.gguf"
    # releases converted as llama.cpp does keep some tensors quantized (FP8 -> Q8_0, MXFP4 experts)
    res = run_cli("quantize", f16, q, "Q4_K_M", "--mtp-type", "q8_0", "--allow-requantize", "--quiet")
    assert res.exit_code == 0, res.output
    kv, tensors = read_gguf(q)
    arch = kv["general.architecture"]
    n_blocks, n_mtp = kv[f"{arch}.block_count"], kv[f"{arch}.nextn_predict_layers"]
    mtp = {t: qt for t, (qt, data) in tensors.items() if t.startswith("blk.") and int(t.split(".")[1]) >= n_blocks - n_mtp}
    assert mtp
    for t, qt in mtp.items():  # what llama-quantize would quantize at q8_0, the rest (norms, routers) as converted
        assert qt == (T.Q8_0 if llama_quantizes(t, shapes[t], arch) else before[t][0]), (t, qt)
    assert any(qt == T.Q4_K for qt, _ in tensors.values())  # the trunk went to 4 bits
    res = run_cli("inspect", q, "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["mtp_blocks"] == list(range(n_blocks - n_mtp, n_blocks)) and report["by_role"]["mtp"]["tensors"] == len(mtp)
    head = tmp_path / "head.gguf"
    res = run_cli("extract-mtp", q, head, "--quiet")
    assert res.exit_code == 0, res.output
    _, head_tensors = read_gguf(head)
    assert {t for t in head_tensors if t.startswith("blk.")} == set(mtp)
    for t in mtp:
        np.testing.assert_array_equal(head_tensors[t][1], tensors[t][1], err_msg=t)


@pytest.mark.llama_cpp
@pytest.mark.parametrize("name", sorted(n for n, m in MANIFESTS.items() if getattr(m, "DRAFTS", False)))
def test_release_drafts_in_llama_cpp(name, release_ckpt, tmp_path, llama_cpp_bin):
    """llama.cpp loads the release-shaped file (Q4_K_M, head at q8_0; and trunk + head-only file) and drafts."""
    from tests.helpers.familycheck import assert_drafts_in_llama_cpp

    m = MANIFESTS[name]
    form = next(iter(m.FORMS))
    assert_drafts_in_llama_cpp(release_ckpt(name, form), tmp_path, llama_cpp_bin,
                               one_file=(form, None) not in getattr(m, "REFUSES", {}))
