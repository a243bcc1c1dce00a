"""Every invariance test of this folder that takes `kernel_set` runs on each contract kernel set."""

from __future__ import annotations

import pytest
from support.kernel_utils import CONTRACT_SETS


@pytest.fixture(params=CONTRACT_SETS)
def kernel_set(request: pytest.FixtureRequest) -> str:
    return request.param
