"""Lab tests run against both scheduler implementations (native and the pure-Python twin)."""
from __future__ import annotations

import pytest

BACKENDS = ["twin", "native"]


@pytest.fixture(params=BACKENDS, scope="session")
def backend(request) -> str:
    return request.param
