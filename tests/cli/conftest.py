"""CLI tests: the installed `skippy-scheduler` command, and every lab backend that is installed."""
from __future__ import annotations

import os
import shutil
import sys

import pytest

from skippy_scheduler.lab.backend import BackendUnavailable, resolve_backend


def _available() -> list[str]:
    names = []
    for name in ("twin", "native"):
        try:
            resolve_backend(name)
        except (BackendUnavailable, ImportError):
            continue
        names.append(name)
    return names


@pytest.fixture(params=_available(), scope="session")
def backend(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def command() -> list[str]:
    """argv prefix that runs the installed console script (as a user would)."""
    script = os.path.join(os.path.dirname(sys.executable), "skippy-scheduler")
    if os.path.exists(script):
        return [script]
    found = shutil.which("skippy-scheduler")
    if found is None:
        pytest.skip("the skippy-scheduler console script is not installed")
    return [found]
