"""Fleet tests: KV events decoded with vLLM's schema, replicas behind vllm-router."""
from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")
pytest.importorskip("cbor2")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fleet_support import free_port  # noqa: E402


@pytest.fixture
def endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture(scope="session")
def model_path(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    from skippy_scheduler.hosts.tiny_model import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("fleet-model") / "tiny-f32.gguf", seed=7)


@pytest.fixture(scope="module")
def replica(model_path):
    """One server with prefix reuse, publishing KV events (in this process)."""
    from fleet_support import start_replica

    server, events = start_replica(model_path)
    yield server, events
    server.shutdown()


@pytest.fixture(scope="module")
def strict_server(model_path):
    from fleet_support import start_replica

    server, _ = start_replica(model_path, strict_request_fields=True, kv_events=False)
    yield server
    server.shutdown()
