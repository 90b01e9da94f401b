"""Helpers of the fleet tests; the process helpers are the benchmarks' (bench/skippy_bench)."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import sys

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

from skippy_bench.servers import free_port, stop, wait_ready  # noqa: E402


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


# -- processes: replicas (`skippy-scheduler serve`) and vllm-router, on loopback --------------

import httpx  # noqa: E402

MODEL_NAME = "tiny"


def router_binary():
    """The vllm-router launcher next to this Python, or on PATH (None: not installed)."""
    here = os.path.join(os.path.dirname(sys.executable), "vllm-router")
    return here if os.path.exists(here) else shutil.which("vllm-router")


def spawn(args, log, health_url: str, timeout_s: float = 60.0):
    """Start a process writing to `log`; return it once `health_url` answers 200 (stopped
    again, and the error raised, when it does not)."""
    # Not from the checkout: `python -m` would import its uncompiled sources.
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir())
    try:
        wait_ready(health_url, proc, timeout_s)
    except BaseException:
        stop(proc)
        raise
    return proc


class Replica:
    """A `skippy-scheduler serve` subprocess with prefix reuse and a KV events endpoint."""

    def __init__(self, model_path, log_dir, name: str, block: int = BLOCK,
                 extra: tuple = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.events = f"tcp://127.0.0.1:{free_port()}"
        self.replay = f"tcp://127.0.0.1:{free_port()}"
        self.args = [sys.executable, "-m", "skippy_scheduler.cli", "serve",
                     "--model", str(model_path), "--served-model-name", MODEL_NAME,
                     "--host", "127.0.0.1", "--port", str(self.port), "--threads", "1",
                     "--max-active", str(LANES), "--ctx-size", str(LANES * LANE_CTX),
                     "--prefix-cache-tokens", str(4 * LANE_CTX), "--prefix-holders", "4",
                     "--kv-events-endpoint", self.events,
                     "--kv-events-replay-endpoint", self.replay, "--kv-block-size", str(block),
                     *extra]
        self.log = open(os.path.join(log_dir, f"{name}.log"), "ab")
        self.proc = None
        self.start()

    def start(self) -> None:
        try:
            self.proc = spawn(self.args, self.log, self.url + "/health")
        except BaseException:
            self.log.close()
            raise

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        self.stop()
        self.log.close()

    def metric(self, prefix: str) -> float:
        """The first sample of /metrics whose line starts with `prefix` (0 when absent)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(prefix):
                return float(line.split()[-1])
        return 0.0

    def served(self) -> float:
        """Requests this replica has finished (its e2e latency histogram's count)."""
        return self.metric("skippy:e2e_request_latency_seconds_count")

    def restored(self) -> float:
        """Prompt tokens this replica admitted as prefix restores."""
        return self.metric("vllm:prefix_cache_hits_total")


class Router:
    """`vllm-router` in front of replicas, with a policy (kv_aware: their events)."""

    def __init__(self, replicas, policy: str, log_dir, block: int = BLOCK,
                 extra: tuple = ()) -> None:
        binary = router_binary()
        assert binary is not None
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [binary, "--host", "127.0.0.1", "--port", str(self.port),
                "--policy", policy, "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(free_port()), "--worker-urls",
                *[r.url for r in replicas]]
        if policy == "kv_aware":
            for r in replicas:
                args += ["--kv-event-source", f"{r.url}={r.events}",
                         "--kv-event-replay-source", f"{r.url}={r.replay}"]
            args += ["--kv-event-block-size", str(block), "--kv-event-model", MODEL_NAME]
        args += ["--log-level", "debug", *extra]
        self.log = open(os.path.join(log_dir, f"router-{policy}.log"), "ab")
        try:
            self.proc = spawn(args, self.log, self.url + "/health")
        except BaseException:
            self.log.close()
            raise

    def close(self) -> None:
        stop(self.proc)
        self.log.close()
