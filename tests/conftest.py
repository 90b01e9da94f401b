"""Shared fixtures: every scheduler test runs against each implementation."""
import os
import sys

import pytest

for _helpers in ("scheduler", "native"):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), _helpers))

from skippy_scheduler import Scheduler, TwinScheduler  # noqa: E402

IMPLEMENTATIONS = [pytest.param(TwinScheduler, id="twin"), pytest.param(Scheduler, id="native")]


def pytest_configure(config):
    # Hypothesis' failure report imports a typing shim that warns; with warnings as errors
    # that would turn every falsifying example into an internal error instead of a report.
    config.addinivalue_line("filterwarnings", "ignore:mypy_extensions.TypedDict is deprecated:DeprecationWarning")


@pytest.fixture(params=IMPLEMENTATIONS)
def impl(request):
    """A scheduler class: the pure-Python twin and the native one."""
    return request.param


# Hypothesis budgets: tests keep their CI example counts under the default profile;
# `pytest --hypothesis-profile=long` (or `sanitize`) runs them with these settings instead.
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "long", max_examples=20_000, stateful_step_count=60, deadline=None, suppress_health_check=list(HealthCheck)
)
settings.register_profile(
    "sanitize", max_examples=150, stateful_step_count=25, deadline=None, suppress_health_check=list(HealthCheck)
)
