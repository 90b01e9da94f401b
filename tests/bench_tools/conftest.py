"""Fixtures of the measurement-tool tests: bench/ importable (the scripts and their library,
`skippy_bench`, as when a script runs from bench/), and a real server on the tiny model
(started by the server tests' helper), whose llama.cpp host also tokenizes for the tests, as
the server's routes do.

Most of these tests need the server's stack (llama.cpp, fastapi, uvicorn, prometheus_client);
without it the modules not in STACK_FREE are skipped whole, before they are imported."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for path in (os.path.join(ROOT, "bench"), os.path.join(ROOT, "tests", "serve")):
    if path not in sys.path:
        sys.path.insert(0, path)

STACK = ("llama_cpp", "fastapi", "uvicorn", "prometheus_client")
STACK_FREE = {"test_fleet.py", "test_library.py", "test_rank_scheduler.py", "test_servers.py"}
MISSING = [name for name in STACK if importlib.util.find_spec(name) is None]


class _NeedsTheStack(pytest.File):
    def collect(self):
        pytest.skip(f"needs {', '.join(MISSING)}")


def pytest_pycollect_makemodule(module_path, parent):
    if MISSING and module_path.name not in STACK_FREE:
        return _NeedsTheStack.from_parent(parent, path=module_path)
    return None


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from skippy_scheduler.hosts.tiny_model import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("m") / "tiny.gguf", seed=7)


@pytest.fixture(scope="module")
def server(model_path):
    from serve_support import start_server

    srv = start_server(model_path)
    yield srv
    srv.shutdown()
