"""Helpers of the fleet tests."""
from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


LANES = 2
LANE_CTX = 512
BLOCK = 16


def start_replica(model_path, kv_events: bool = True, **overrides):
    """A server in this process on a loopback port: (server, its KV events endpoint)."""
    from skippy_scheduler.serve import Server, ServeSettings

    events = f"tcp://127.0.0.1:{free_port()}" if kv_events else None
    settings = dict(model=str(model_path), max_active=LANES, ctx_size=LANES * LANE_CTX,
                    max_waiting=64, threads=1, prefix_cache_tokens=4 * LANE_CTX,
                    prefix_holders=4, kv_events_endpoint=events, kv_block_size=BLOCK)
    settings.update(overrides)
    server = Server(ServeSettings(**settings))
    server.start_in_thread()
    return server, events
