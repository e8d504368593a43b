"""The sidecar layout's names and the mirror of llama.cpp's ``-hf REPO:TAG`` selection (common/download.cpp).

The mirror is checked against the real binary in test_publish_llama_cpp.py; here its rules one by one, and that
a recipe whose names would resolve to the wrong head is refused before anything is built."""

from __future__ import annotations

import pytest

from mtpq.release import layout as L
from tests.helpers.runcli import run_cli


def test_quant_bits_as_llama_cpp_reads_them():
    assert [
        L.quant_bits(p)
        for p in (
            "m-Q4_K_M.gguf",
            "mtp-m-F16.gguf",
            "m-BF16-00001-of-00003.gguf",
            "mtp-m-Q8_0_EXPS_Q4_K.gguf",
            "m-IQ2_XXS.gguf",
            "m.gguf",
        )
    ] == [4, 16, 16, 8, 2, 0]


def test_models_for_a_tag():
    files = [
        "m-Q4_K_M.gguf",
        "m-Q4_K_M_MTP.gguf",
        "mtp-m-Q4_K_M.gguf",
        "m-Q8_0-00001-of-00002.gguf",
        "m-Q8_0-00002-of-00002.gguf",
        "m-F16.gguf",
        "m-F16-MTP-only.gguf",
        "imatrix-Q4_K_M.gguf",
    ]
    assert L.models_for_tag(files, "Q4_K_M") == ["m-Q4_K_M.gguf"]  # not the _MTP one, the head, the imatrix
    assert L.models_for_tag(files, "q4_k_m_mtp") == ["m-Q4_K_M_MTP.gguf"]  # case-insensitive
    assert L.models_for_tag(files, "Q8_0") == ["m-Q8_0-00001-of-00002.gguf"]  # shard 1 only
    assert L.models_for_tag(files, "F16") == ["m-F16.gguf", "m-F16-MTP-only.gguf"]  # ambiguous: listing order


@pytest.mark.parametrize(
    "files, model, tag, want",
    [
        (["mtp-m-Q8_0.gguf", "mtp-m-F16.gguf"], "m-Q4_K_M.gguf", "Q4_K_M", ["mtp-m-Q8_0.gguf"]),  # nearest bits
        (["mtp-m-Q8_0.gguf", "mtp-m-F16.gguf"], "m-BF16.gguf", "BF16", ["mtp-m-F16.gguf"]),
        (["mtp-m-Q8_0.gguf", "mtp-m-F16.gguf"], "m-Q8_0.gguf", "Q8_0", ["mtp-m-Q8_0.gguf"]),  # -TAG. exact
        (["mtp-m-Q4_K_M.gguf", "mtp-m-Q4_K_S.gguf"], "m-Q4_K_M.gguf", "Q4_K_M", ["mtp-m-Q4_K_M.gguf"]),
        (["mtp-m-Q6_K.gguf", "mtp-m-F16.gguf"], "m-Q8_0.gguf", "", ["mtp-m-Q6_K.gguf"]),  # no tag: the model's bits
        (["mtp-m-Q8_0.gguf", "x/mtp-m-F16.gguf"], "x/m-Q4_K_M.gguf", "Q4_K_M", ["x/mtp-m-F16.gguf"]),  # deeper folder
        (["MTP/mtp-m-Q8_0.gguf"], "m-Q4_K_M.gguf", "Q4_K_M", []),  # a folder below the model's is never searched
        (["mtp-m-Q6_K.gguf", "mtp-m-Q2_K.gguf"], "m-Q4_K_M.gguf", "Q4_K_M", ["mtp-m-Q6_K.gguf", "mtp-m-Q2_K.gguf"]),
    ],
)
def test_head_selection(files, model, tag, want):
    assert L.heads_for(files, model, tag) == want


def test_resolution_problems_name_the_tag():
    files = ["m-Q8_0.gguf", "m-Q4_K_M.gguf", "mtp-m-Q8_0.gguf", "mtp-m-F16.gguf"]
    ok = {"Q4_K_M": ("m-Q4_K_M.gguf", "mtp-m-Q8_0.gguf"), "Q8_0": ("m-Q8_0.gguf", "mtp-m-Q8_0.gguf")}
    assert L.resolution_problems(files, ok) == []
    bad = {"Q8_0": ("m-Q8_0.gguf", "mtp-m-F16.gguf")}  # the exact -Q8_0. name wins over the intended f16 head
    assert L.resolution_problems(files, bad) == [
        "-hf REPO:Q8_0 --spec-type draft-mtp would pair m-Q8_0.gguf with mtp-m-Q8_0.gguf, not mtp-m-F16.gguf"
    ]


SIDECAR = """
[model]
name = "tiny"
source = "{source}"
reference_type = "f16"
layout = "{layout}"

[[variant]]
name = "Q8_0"
preset = "Q8_0"
mtp_type = "{q8_head}"

[[variant]]
name = "Q4_K_M"
preset = "Q4_K_M"
{extra}
"""


def _recipe(tmp_path, glm_ckpt, layout="sidecar", q8_head="q8_0", extra=""):
    path = tmp_path / "r.toml"
    path.write_text(SIDECAR.format(source=glm_ckpt, layout=layout, q8_head=q8_head, extra=extra))
    return path


def test_head_labels_and_pairs(tmp_path, glm_ckpt):
    from mtpq.release import load_recipe

    r = load_recipe(_recipe(tmp_path, glm_ckpt, extra='mtp_type = "same"'))  # a head like its trunk: its own name
    assert [r.head_label(None), *(r.head_label(v) for v in r.variants)] == ["F16", "Q8_0", "Q4_K_M"]
    experts = 'mtp_experts_type = "q4_k"'
    r = load_recipe(_recipe(tmp_path, glm_ckpt, q8_head='q8_0"\n' + experts[:-1], extra=experts))
    assert [r.head_label(v) for v in r.variants] == ["Q8_0_EXPS_Q4_K", "Q8_0_EXPS_Q4_K"]


@pytest.mark.parametrize(
    "layout, q8_head, extra, key, says",
    [
        (
            "sidecar",
            "f16",
            "",
            "variant[0]",
            "would pair tiny-Q8_0.gguf with mtp-tiny-Q8_0.gguf, not mtp-tiny-F16.gguf",
        ),
        ("both", "q8_0", 'mtp_type = "auto"', "variant[1].mtp_type", '"auto" measures the head inside one quant'),
        ("sidecar", "q8_0", "\n[extras]\nmtp_only = true", "extras.mtp_only", "already publishes the reference's"),
        ("stacked", "q8_0", "", "model.layout", "is not one of combined, sidecar, both"),
        ("both", "q8_0", '\n[publish]\nrepo = "no-slash"', "publish.repo", "not a Hugging Face repository id"),
    ],
)
def test_layouts_llama_cpp_would_misread_are_refused(tmp_path, glm_ckpt, layout, q8_head, extra, key, says):
    res = run_cli("build", _recipe(tmp_path, glm_ckpt, layout, q8_head, extra), "--dry-run")
    assert res.exit_code == 2, res.output
    line = res.stderr.strip()
    assert "\n" not in line and f"r.toml: {key}" in line and says in line, line


def test_two_heads_of_one_name_are_refused(tmp_path, glm_ckpt):
    """A head like its trunk is named for its variant: a variant called Q8_0 with mtp_type "same" and another
    variant's q8_0 head would both be mtp-tiny-Q8_0.gguf."""
    res = run_cli("build", _recipe(tmp_path, glm_ckpt, q8_head="same"), "--dry-run")
    assert res.exit_code == 2, res.output
    assert res.stderr.strip().endswith(
        "r.toml: variant[1]: its head (mtp_type q8_0) and variant[0]'s (same as Q8_0) "
        "would both be mtp-tiny-Q8_0.gguf; rename the variant"
    ), res.stderr
