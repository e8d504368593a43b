import numpy as np
import pytest

from tests.helpers.golden_quants import load_golden


@pytest.fixture(scope="module")
def inputs() -> dict[str, np.ndarray]:
    """The golden inputs, by case: what every kernel test quantizes."""
    return load_golden("inputs.npz")
