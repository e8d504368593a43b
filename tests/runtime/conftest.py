from __future__ import annotations

import pytest

from tests.helpers.runtime import Builds


@pytest.fixture(scope="session")
def rt(tmp_path_factory) -> Builds:
    """Every runtime family's tiny checkpoints and GGUFs, built once for the contract and family tests."""
    return Builds(tmp_path_factory.mktemp("runtime"))
