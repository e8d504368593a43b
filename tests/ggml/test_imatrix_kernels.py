"""Quantization with importance weights is byte-identical to ggml's (``llama-quantize --imatrix``).

Golden vectors: ``tests/data/golden_quants/importance.npz`` holds, per case of
``inputs.npz`` (see tests/ggml/test_quant_kernels.py), a float32 weight vector of
length n_per_row made once with ``numpy.random.default_rng(20261123)``:
``exp(N(0, 1.5^2))`` (positive and heavy-tailed like llama-imatrix's mean
squared activations) with ~5% of the columns set to 0 (never activated).
``<TYPE>_imatrix.npz`` holds the bytes of
``ggml_quantize_chunk(type, src, dst, 0, rows, n_per_row, imatrix=weights)``
from the same build and C harness as the goldens without imatrix (the harness
takes the weights file as an optional sixth argument) -- the call
llama-quantize makes for a 2-D tensor with imatrix data; it dispatches to
``quantize_row_*_impl``.  Besides these, the kernels were fuzzed against the
harness (6 data distributions x 3 weight distributions, 2 seeds, every type)
with no difference.  ``test_llama_quantize_imatrix_agrees`` in
tests/quantize/test_imatrix.py compares whole files against llama-quantize itself.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from mtpq.ggml import kernels, vecops
from tests.helpers.golden_quants import CASES, load_golden as _load
from mtpq.ggml.kernels import IMPORTANCE_TYPES, quantize

@pytest.fixture(scope="module")
def importance():
    return _load("importance.npz")


def test_importance_types_are_ggmls():
    assert set(IMPORTANCE_TYPES) == {T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K,
                                     T.Q6_K, T.IQ4_NL, T.IQ4_XS}


@pytest.mark.parametrize("qtype", IMPORTANCE_TYPES, ids=lambda t: t.name)
def test_golden_bytes_with_importance(qtype, inputs, importance):
    ref = _load(f"{qtype.name}_imatrix.npz")
    plain = _load(f"{qtype.name}.npz")
    differs = 0
    for case in CASES:
        ours = quantize(torch.from_numpy(inputs[case]), qtype, case, check_scales=False, importance=importance[case])
        assert ours.shape == ref[case].shape
        if not np.array_equal(ours, ref[case]):
            bad = np.nonzero((ours != ref[case]).any(axis=1))[0]
            pytest.fail(f"{qtype.name}/{case}: rows {bad.tolist()} differ from ggml")
        differs += not np.array_equal(ref[case], plain[case])
    assert differs >= 3  # the importance path is really another search (the goldens differ)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q5_1, T.Q4_K, T.Q6_K, T.IQ4_XS], ids=lambda t: t.name)
def test_importance_in_small_chunks_and_workers(qtype, inputs, importance, monkeypatch):
    """Rows cut into chunks and spread over forked workers: same bytes (the legacy
    types weight by the whole row's mean square, computed before the cut)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("forked workers are Linux-only")
    q, d, _, _ = kernels._KERNELS[qtype]
    monkeypatch.setitem(kernels._KERNELS, qtype, (q, d, 256, 256))
    x = torch.from_numpy(np.concatenate([inputs["gauss_512"], inputs["outliers"]]))
    ref = np.concatenate([_load(f"{qtype.name}_imatrix.npz")[c] for c in ("gauss_512", "outliers")])
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        # both cases are 512 wide: one weight vector for all rows, so compare case by case
        for rows, case in ((slice(0, 4), "gauss_512"), (slice(4, 7), "outliers")):
            ours = quantize(x[rows], qtype, importance=importance[case])
            assert np.array_equal(ours, ref[rows]), case
    finally:
        torch.set_num_threads(saved)
    with pytest.raises(ChildProcessError):
        os.waitpid(-1, os.WNOHANG)


@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q4_K, T.Q6_K, T.IQ4_NL], ids=lambda t: t.name)
def test_importance_generic_torch_path(qtype, inputs, importance, monkeypatch):
    monkeypatch.setattr(vecops, "numpy_path", lambda X: False)
    ref = _load(f"{qtype.name}_imatrix.npz")
    for case in CASES:
        ours = quantize(torch.from_numpy(inputs[case]), qtype, case, check_scales=False, importance=importance[case])
        assert np.array_equal(ours, ref[case]), case


def test_per_expert_importance(inputs, importance):
    """A 3-D expert tensor takes one weight row per expert (llama-quantize's expert_offset)."""
    a, b = inputs["gauss_512"][:2], inputs["misc"][:2]
    wa, wb = importance["gauss_512"], importance["misc"]
    experts = torch.from_numpy(np.stack([a, b]))
    ours = quantize(experts, T.Q4_K, "ffn_up_exps", importance=np.stack([wa, wb]))
    ref = _load("Q4_K_imatrix.npz")
    assert np.array_equal(ours[0], ref["gauss_512"][:2])
    assert np.array_equal(ours[1], ref["misc"][:2])


def test_q8_0_and_floats_ignore_importance(inputs, importance):
    x = torch.from_numpy(inputs["gauss_512"])
    for qtype in (T.Q8_0, T.F16):
        assert np.array_equal(quantize(x, qtype, importance=importance["gauss_512"]), quantize(x, qtype))


def test_importance_of_wrong_size_is_refused(inputs):
    x = torch.from_numpy(inputs["gauss_512"])
    with pytest.raises(ValueError, match=r"blk.0.w: importance data of shape \(256,\) does not fit"):
        quantize(x, T.Q4_K, "blk.0.w", importance=np.ones(256, dtype=np.float32))


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.IQ4_NL], ids=lambda t: t.name)
def test_importance_on_a_single_row_and_block(qtype, inputs, importance):
    """One row (the legacy types' row mean square over a lone row) and one block per chunk:
    numpy sums a lone column pairwise, the kernels must not let it."""
    x = inputs["misc"][1:2]  # Student-t row of 512: pairwise and sequential sums differ there
    ref = _load(f"{qtype.name}_imatrix.npz")["misc"][1:2]
    assert np.array_equal(quantize(torch.from_numpy(x), qtype, importance=importance["misc"]), ref)
    bs = kernels.block_size(qtype)
    q, d, _, _ = kernels._KERNELS[qtype]
    saved = kernels._KERNELS[qtype]
    kernels._KERNELS[qtype] = (q, d, bs, bs)  # one block per chunk
    try:
        assert np.array_equal(quantize(torch.from_numpy(x), qtype, importance=importance["misc"]), ref)
    finally:
        kernels._KERNELS[qtype] = saved
