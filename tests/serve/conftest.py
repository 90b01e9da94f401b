"""A real server (uvicorn on a loopback port, engine thread, llama.cpp) on the tiny model."""
from __future__ import annotations

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
pytest.importorskip("prometheus_client")

import openai  # noqa: E402
from serve_support import LANE_CTX, start_server  # noqa: E402  (tests/support)

from skippy_scheduler.hosts.llama import LlamaHost  # noqa: E402
from skippy_scheduler.hosts.tiny_model import write_tiny_llama  # noqa: E402


@pytest.fixture(scope="session")
def model_path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("serve-model") / "tiny-f32.gguf", seed=7)


@pytest.fixture(scope="module")
def server(model_path):
    srv = start_server(model_path)
    yield srv
    srv.shutdown()


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def reference(model_path):
    """The same model in a host of its own: each prompt run alone."""
    with LlamaHost(model_path, n_ctx=LANE_CTX, n_seq_max=1, n_threads=1) as host:
        yield host
