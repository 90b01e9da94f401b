"""Lab tests run against both scheduler implementations (native and the pure-Python twin)."""
from __future__ import annotations

import pytest

BACKENDS = ["twin", "native"]


@pytest.fixture(params=BACKENDS, scope="session")
def backend(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def scenario_results():
    """Reference scenario results per backend, computed once per session."""
    from skippy_scheduler.lab.scenarios import SCENARIOS, run_scenario

    cache: dict[str, dict] = {}

    def get(backend: str) -> dict:
        if backend not in cache:
            cache[backend] = {s.name: run_scenario(s, backend=backend, trace=True)
                              for s in SCENARIOS}
        return cache[backend]

    return get
