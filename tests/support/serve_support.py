"""Helpers of the server tests (imported by conftest.py and the test modules)."""
from __future__ import annotations

import re
import time

import httpx

from skippy_scheduler.serve import Server, ServeSettings

LANES = 4
LANE_CTX = 512


def start_server(model_path, **overrides) -> Server:
    settings = dict(model=str(model_path), max_active=LANES, ctx_size=LANES * LANE_CTX,
                    max_waiting=64, threads=1)
    settings.update(overrides)
    server = Server(ServeSettings(**settings))
    server.start_in_thread()
    return server


def alone(reference, prompt, max_tokens, sampling=None) -> list[int]:
    """What a request must produce: its alone tokens, without a final end-of-generation."""
    tokens = reference.generate_alone(prompt, max_tokens, sampling)
    return tokens[:-1] if reference.is_eog(tokens[-1]) else tokens


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def metrics(url: str) -> dict[str, float]:
    """Samples of /metrics by name (labels kept in the key)."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def wait_idle(server: Server, timeout_s: float = 10.0) -> dict:
    """The engine-side state once nothing is left open (returned as is after `timeout_s`)."""
    end = time.monotonic() + timeout_s
    while True:
        state = server.runner.state()
        if is_idle(state, server.host.n_seq_max) or time.monotonic() > end:
            return state
        time.sleep(0.02)


def is_idle(state: dict, lanes: int) -> bool:
    """No lane, KV cell, sampler, subscription or waiting entry is held anywhere."""
    return (not state["scheduler_active"] and not state["scheduler_waiting"]
            and not state["engine_open"] and state["engine_outstanding"] == 0
            and not state["host_active"] and state["host_free_lanes"] == lanes
            and not state["host_kv_positions"] and state["host_samplers"] == 0
            and state["subscriptions"] == 0 and state["undecided"] == 0)


def text_of(reference, tokens) -> str:
    """The text a client must receive for `tokens` (UTF-8, invalid bytes replaced)."""
    return b"".join(reference.token_bytes(t) for t in tokens).decode("utf-8", "replace")
