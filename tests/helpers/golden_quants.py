"""ggml's quantization goldens (tests/data/golden_quants/, made by tests/golden/make_golden_quants.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

GOLDEN = Path(__file__).parents[1] / "data" / "golden_quants"
# the input cases every golden file holds one array for
CASES = ["gauss_512", "gauss_256", "zeros", "const", "outliers", "tiny", "signs", "misc", "large"]


def load_golden(name: str) -> dict[str, np.ndarray]:
    """The arrays of golden file ``name`` (``inputs.npz``, ``Q4_K.npz`` ...), by case."""
    with np.load(GOLDEN / name) as z:
        return {k: z[k] for k in z.files}
