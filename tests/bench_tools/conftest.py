"""Fixtures of the measurement-tool tests: the bench scripts importable, and a real server on the
tiny model (started by the server tests' helper), whose llama.cpp host also tokenizes for the
tests, as the server's routes do."""
from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# The bench scripts import their siblings by name, as they do when run from bench/.
for path in (os.path.join(ROOT, "bench"), os.path.join(ROOT, "tests", "serve")):
    if path not in sys.path:
        sys.path.insert(0, path)

from serve_support import start_server  # noqa: E402

from skippy_scheduler.hosts.tiny_model import write_tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(write_tiny_llama(tmp_path_factory.mktemp("m") / "tiny.gguf", seed=7))
    yield srv
    srv.shutdown()
