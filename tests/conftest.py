"""Shared fixtures: every scheduler test runs against each implementation.

Helper modules shared by several test folders (factories, scripted runs, the token model, the
C harness builder, the server fixture support, the lab's trace files) live in `tests/support`,
which pytest puts on the import path (`pythonpath` in pyproject.toml).
"""
import pytest
from hypothesis import HealthCheck, settings

from skippy_scheduler import Scheduler, TwinScheduler

IMPLEMENTATIONS = [pytest.param(TwinScheduler, id="twin"), pytest.param(Scheduler, id="native")]


def pytest_configure(config):
    # Hypothesis' failure report imports a typing shim that warns; with warnings as errors
    # that would turn every falsifying example into an internal error instead of a report.
    config.addinivalue_line("filterwarnings", "ignore:mypy_extensions.TypedDict is deprecated:DeprecationWarning")


@pytest.fixture(params=IMPLEMENTATIONS)
def impl(request):
    """A scheduler class: the pure-Python twin and the native one."""
    return request.param


@pytest.fixture(scope="session")
def scenario_results():
    """The lab's reference scenario results per backend ("twin", "native"), computed once per
    session (tests/lab checks each backend's figures, tests/differential compares them)."""
    from skippy_scheduler.lab.scenarios import SCENARIOS, run_scenario

    cache: dict[str, dict] = {}

    def get(backend: str) -> dict:
        if backend not in cache:
            cache[backend] = {s.name: run_scenario(s, backend=backend, trace=True)
                              for s in SCENARIOS}
        return cache[backend]

    return get


# Hypothesis budgets: tests keep their CI example counts under the default profile;
# `pytest --hypothesis-profile=long` (or `sanitize`) runs them with these settings instead.
settings.register_profile(
    "long", max_examples=20_000, stateful_step_count=60, deadline=None, suppress_health_check=list(HealthCheck)
)
settings.register_profile(
    "sanitize", max_examples=150, stateful_step_count=25, deadline=None, suppress_health_check=list(HealthCheck)
)
