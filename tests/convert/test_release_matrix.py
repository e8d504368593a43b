"""Every release manifest (tests/releases/) through mtpq, and against llama.cpp's converter.

The fast part (CI's default run): each manifest cites located sources for fields it has, each form builds what
its name says, and each release-shaped checkpoint, in every form it ships, converts with the MTP head kept,
trunk-only and head-only, and the file says how many MTP blocks it holds. Quantized, the head's tensors are held
at q8_0 where llama-quantize quantizes such a tensor (its recorded tables, tests/data/llama_quantize_choices).

The differential matrix (``llama_cpp``-marked, ``make test-extra``): manifest x form x {default, --no-mtp,
--mtp-only}: both converters accept, or both refuse; when both accept, every tensor name, shape, type and
f32 byte and every metadata key equal llama.cpp's converter's. Cells where mtpq knowingly differs are listed
in the manifest's ``DIFFERS`` / ``REFUSES`` with what llama.cpp does there, which is asserted (then reported as
an expected failure): a cell where llama.cpp now does something else -- writes mtpq's file, refuses with
another message, differs in other tensors -- fails.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests import releases
from tests.helpers.familycheck import OUR_MODE, assert_same_gguf, strip_general
from tests.helpers.ggufcheck import read_gguf
from tests.helpers.runcli import run_cli
from tests.releases import LlamaCppDiffersIn, LlamaCppRefuses, LlamaCppWritesOurs

MANIFESTS = releases.manifests()
MANIFESTS = releases.manifests()
RECORDS = (LlamaCppRefuses, LlamaCppWritesOurs, LlamaCppDiffersIn)


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


# ----------------------------------------------------------------------------- what each manifest claims


def test_every_manifest_names_its_mtp_layers_and_records_only_cells_it_has():
    """A manifest without MTP tensors tests nothing of the head; a DIFFERS / REFUSES / LLAMA_CPP_MODE entry for a
    form or mode the manifest does not have would never be looked at."""
    assert MANIFESTS
    for name, m in MANIFESTS.items():
        assert m.RELEASE and re.match(r"[\w-]+/[\w.-]+", m.RELEASE), name
        names = m.tensors(m.CONFIG)
        assert any(k in n for n in names for k in ("eh_proj", "e_proj", "mtp.fc", "nextn")), f"{name}: no MTP tensors"
        for table in ("DIFFERS", "REFUSES"):
            for (form, mode), record in getattr(m, table, {}).items():
                assert form in m.FORMS and mode in releases.MODES, (name, table, form, mode)
                assert isinstance(record, RECORDS) and record.reason, (name, table, form, mode)
        assert set(getattr(m, "LLAMA_CPP_MODE", {})) <= set(releases.MODES), name
        assert all(re.fullmatch(r"[a-z0-9_]+(\.[a-z0-9_]+)+", k) for k in getattr(m, "DIFFERS_KEYS", {})), name


def test_every_manifest_cites_located_sources_for_fields_it_has(release_ckpt):
    """Each source names where it is (a URL, a repository path, a pull request), and every config key or
    tensor-name part its account names is one the manifest builds (tests/releases/_citations.py)."""
    from tests.releases._citations import citation_problems, has

    fields = {name: set().union(*(has(release_ckpt(name, form)) for form in m.FORMS)) for name, m in MANIFESTS.items()}
    every = set().union(*fields.values())
    problems = {name: citation_problems(m, fields[name], every) for name, m in MANIFESTS.items()}
    assert not {n: p for n, p in problems.items() if p}


@pytest.mark.parametrize("cell", releases.cells(with_modes=False), ids=_ids)
def test_every_form_is_what_its_name_says_and_cited(cell, release_ckpt):
    """A form is one the builders know and its checkpoint holds what the name says (tests/releases/_forms.py);
    the manifest's docstring describes it, and a quantized form is cited: by a source that names it, or by the
    release's own config.json (its CONFIG declares the quantization_config)."""
    from tests.releases._forms import form_problems

    name, form, _ = cell
    m = MANIFESTS[name]
    assert not form_problems(m, form, release_ckpt(name, form))
    assert re.search(rf"\b{re.escape(form)}\b", m.__doc__ or "", re.I), f"{name}'s docstring does not name {form}"
    declared = m.CONFIG.get("quantization_config") or (m.CONFIG.get("text_config") or {}).get("quantization_config")
    for encoding in ("fp8", "mxfp4"):
        if encoding in form.split("_") and not declared:
            assert any(re.search(encoding, s, re.I) for s in m.SOURCES), f"{name}: no source for its {encoding}"


# ----------------------------------------------------------------------------- conversion


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


def _assert_llama_cpp_as_recorded(record, ok: bool, log: str, ck, ours, ref, keys: dict):
    """llama.cpp's converter did what the manifest records for the cell (ours, ref: the two converters' files;
    ours absent where mtpq refuses)."""
    if isinstance(record, LlamaCppRefuses):
        assert not ok and re.search(record.log, log), f"recorded: refuses ({record.log}); llama.cpp: {log[-1500:]}"
        return
    assert ok, f"recorded: llama.cpp writes a file; it refused: {log[-1500:]}"
    if isinstance(record, LlamaCppWritesOurs):
        out = ours.with_name("ours-as-recorded.gguf")
        res = run_cli("convert", ck, out, "--quiet", "--outtype", "f32", *OUR_MODE[record.mode])
        assert res.exit_code == 0, res.output
        kv, tensors = read_gguf(out)
        assert_same_gguf(out, kv, tensors, ref, ignore=tuple(keys))
        if ours.exists():  # and the cell's own file is not that one
            assert set(read_gguf(ours)[1]) != set(tensors)
        return
    from gguf import GGUFReader

    def widths(path):
        return {t.name: int(t.shape[0]) for t in GGUFReader(path).tensors}

    (kv, tensors), (ref_kv, ref_tensors) = read_gguf(ours), read_gguf(ref)
    differing = {n for n in tensors if re.search(record.tensors, n)}
    assert differing and set(tensors) == set(ref_tensors)
    our_width, their_width = widths(ours), widths(ref)
    for n in differing:  # as recorded: ours in one type, theirs in another at a fraction of the row
        assert tensors[n][0].name == record.ours and ref_tensors[n][0].name == record.theirs, n
        assert their_width[n] == our_width[n] * record.their_width, (n, our_width[n], their_width[n])
    ignored = set(keys) | set(record.keys)
    kept = lambda table: {k: v for k, v in strip_general(table).items() if k not in ignored}  # noqa: E731
    assert kept(kv) == kept(ref_kv)
    for n in set(tensors) - differing:
        assert tensors[n][0] == ref_tensors[n][0], n
        np.testing.assert_array_equal(tensors[n][1], ref_tensors[n][1], err_msg=n)


@pytest.mark.llama_cpp
@pytest.mark.parametrize(
    "cell",
    [c if c in releases.ci_cells() else pytest.param(c, marks=pytest.mark.heavy) for c in releases.cells()],
    ids=_ids,
)
def test_release_same_as_llama_cpp(cell, release_ckpt, tmp_path, llama_cpp_src):
    """Both converters accept (and write the same file) or both refuse; where the manifest records that mtpq
    knowingly differs or refuses, llama.cpp does what the record says (asserted, then reported as xfail)."""
    from tests.helpers.llamacpp_ref import llama_cpp_convert_result

    name, form, mode = cell
    m = MANIFESTS[name]
    ck = release_ckpt(name, form)
    out = tmp_path / "ours.gguf"
    ours = run_cli("convert", ck, out, "--quiet", "--outtype", "f32", *OUR_MODE[mode])
    differs = getattr(m, "DIFFERS", {}).get((form, mode))
    refuses = getattr(m, "REFUSES", {}).get((form, mode))
    keys = getattr(m, "DIFFERS_KEYS", {})
    pre = "gpt-2"
    if ours.exit_code == 0:
        pre = read_gguf(out)[0]["tokenizer.ggml.pre"]
    ref_path = tmp_path / "ref.gguf"
    their_mode = getattr(m, "LLAMA_CPP_MODE", {}).get(mode, mode)
    ok, log = llama_cpp_convert_result(
        llama_cpp_src,
        ck,
        ref_path,
        pre,
        *([their_mode] if their_mode else []),
        raw_config=getattr(m, "LLAMA_CPP_RAW_CONFIG", False),
    )
    if refuses is not None:
        assert ours.exit_code == 2 and len(ours.stderr.strip().splitlines()) == 1, ours.output
        _assert_llama_cpp_as_recorded(refuses, ok, log, ck, out, ref_path, keys)
        pytest.xfail(f"mtpq knowingly refuses (llama.cpp's side asserted): {refuses.reason}")
    if differs is not None:
        assert ours.exit_code == 0, ours.output
        _assert_llama_cpp_as_recorded(differs, ok, log, ck, out, ref_path, keys)
        pytest.xfail(f"mtpq knowingly differs (llama.cpp's side asserted): {differs.reason}")
    assert (ours.exit_code == 0) == ok, f"mtpq exit {ours.exit_code}: {ours.output[-800:]}\nllama.cpp: {log[-2000:]}"
    if ok:
        kv, tensors = read_gguf(out)
        ref_kv = read_gguf(ref_path)[0]
        for key, reason in keys.items():  # a stale entry would hide a real comparison
            assert kv.get(key) != ref_kv.get(key), f"{key} is equal, yet DIFFERS_KEYS says: {reason}"
        assert_same_gguf(out, kv, tensors, ref_path, ignore=tuple(keys))


# ----------------------------------------------------------------------------- quantization and the head


@pytest.fixture(scope="module")
def release_q4(release_ckpt, tmp_path_factory):
    """get(manifest): (f16 conversion of its first form, that file quantized Q4_K_M with the head at q8_0, and
    the f16 file's MTP block names); the head in its own file where the manifest refuses it beside the trunk."""
    cache = {}

    def get(name: str):
        if name not in cache:
            m = MANIFESTS[name]
            form = next(iter(m.FORMS))
            head_only = ("--mtp-only",) if (form, None) in getattr(m, "REFUSES", {}) else ()
            d = tmp_path_factory.mktemp(f"{name}-q4")
            res = run_cli(
                "convert", release_ckpt(name, form), d / "f16.gguf", "--quiet", "--outtype", "f16", *head_only
            )
            assert res.exit_code == 0, res.output
            # releases converted as llama.cpp does keep some tensors quantized (FP8 -> Q8_0, MXFP4 experts)
            res = run_cli(
                "quantize",
                d / "f16.gguf",
                d / "q.gguf",
                "Q4_K_M",
                "--mtp-type",
                "q8_0",
                "--allow-requantize",
                "--quiet",
            )
            assert res.exit_code == 0, res.output
            kv, tensors = read_gguf(d / "q.gguf")
            arch = kv["general.architecture"]
            n_blocks, n_mtp = kv[f"{arch}.block_count"], kv[f"{arch}.nextn_predict_layers"]
            mtp = {t for t in tensors if t.startswith("blk.") and int(t.split(".")[1]) >= n_blocks - n_mtp}
            cache[name] = d / "f16.gguf", d / "q.gguf", mtp
        return cache[name]

    return get


def _n_dims(path) -> dict[str, int]:
    """ggml's dimension count of every tensor (trailing 1s not counted)."""
    from gguf import GGUFReader

    out = {}
    for t in GGUFReader(path).tensors:
        ne = [int(d) for d in t.shape]
        while len(ne) > 1 and ne[-1] == 1:
            ne.pop()
        out[t.name] = len(ne)
    return out


@pytest.mark.parametrize("name", sorted(MANIFESTS))
def test_release_quantizes_with_the_head_at_q8_0_and_extracts(name, release_q4, tmp_path):
    """On each release-shaped file (its first form): Q4_K_M with every MTP tensor at q8_0 where llama-quantize
    quantizes that kind of tensor (its recorded tables; a 1-D tensor it never quantizes), the rest as converted;
    kinds the tables do not hold are checked against llama-quantize itself (the llama_cpp test below).
    ``inspect`` reports the MTP blocks, ``extract-mtp`` writes the head-only file of exactly those blocks."""
    import json

    from gguf import GGMLQuantizationType as T

    from tests.helpers.quantize_tables import kind, quantized_kinds

    f16, q, mtp = release_q4(name)
    _, before = read_gguf(f16)
    kv, tensors = read_gguf(q)
    dims, recorded = _n_dims(f16), quantized_kinds()
    assert mtp
    checked = 0
    for t in mtp:
        if kind(t) in recorded or dims[t] < 2:
            want = T.Q8_0 if kind(t) in recorded and recorded[kind(t)] else before[t][0]
            assert tensors[t][0] == want, (t, tensors[t][0], want)
            checked += 1
    # the tables hold most of every head's kinds; the others are checked by the llama_cpp test below
    assert checked >= len(mtp) // 2, f"{name}: only {checked} of {len(mtp)} head tensors have a recorded kind"
    assert any(qt == T.Q4_K for qt, _ in tensors.values())  # the trunk went to 4 bits
    arch = kv["general.architecture"]
    n_blocks, n_mtp = kv[f"{arch}.block_count"], kv[f"{arch}.nextn_predict_layers"]
    res = run_cli("inspect", q, "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["mtp_blocks"] == list(range(n_blocks - n_mtp, n_blocks))
    assert report["by_role"]["mtp"]["tensors"] == len(mtp)
    head = tmp_path / "head.gguf"
    res = run_cli("extract-mtp", q, head, "--quiet")
    assert res.exit_code == 0, res.output
    _, head_tensors = read_gguf(head)
    assert {t for t in head_tensors if t.startswith("blk.")} == mtp
    for t in mtp:
        np.testing.assert_array_equal(head_tensors[t][1], tensors[t][1], err_msg=t)


@pytest.mark.llama_cpp
@pytest.mark.parametrize("name", sorted(MANIFESTS))
def test_release_head_at_q8_0_where_llama_quantize_quantizes(name, release_q4, tmp_path, llama_cpp_bin):
    """Every MTP tensor of the Q4_K_M file has the type llama-quantize's Q8_0 gives it: q8_0 where it quantizes
    the tensor (f16 where a row is not a multiple of 32, as it falls back), the converted type where it does not."""
    from tests.helpers.familycheck import run

    f16, q, mtp = release_q4(name)
    ref = tmp_path / "q8_0.gguf"
    run([llama_cpp_bin / "llama-quantize", "--allow-requantize", f16, ref, "Q8_0", "1"])
    (_, ours), (_, theirs) = read_gguf(q), read_gguf(ref)
    assert {t: ours[t][0].name for t in mtp} == {t: theirs[t][0].name for t in mtp}


@pytest.mark.llama_cpp
@pytest.mark.parametrize("name", sorted(n for n, m in MANIFESTS.items() if getattr(m, "DRAFTS", False)))
def test_release_drafts_in_llama_cpp(name, release_ckpt, tmp_path, llama_cpp_bin):
    """llama.cpp loads the release-shaped file (Q4_K_M, head at q8_0; and trunk + head-only file) and drafts."""
    from tests.helpers.familycheck import assert_drafts_in_llama_cpp

    m = MANIFESTS[name]
    form = next(iter(m.FORMS))
    assert_drafts_in_llama_cpp(
        release_ckpt(name, form), tmp_path, llama_cpp_bin, one_file=(form, None) not in getattr(m, "REFUSES", {})
    )
