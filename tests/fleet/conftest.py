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
