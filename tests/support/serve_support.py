"""Helpers of the server tests (imported by conftest.py and the test modules)."""
from __future__ import annotations

import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
from typing import Optional

import httpx

from skippy_scheduler.serve import Server, ServeSettings

LANES = 4
LANE_CTX = 512

# SKIPPY_SERVE_DEVICE=rpc: the in-process servers of the serve tests put their layers and KV on
# a device that is not the host's, a llama.cpp RPC server lending this machine's CPU (started
# once, `rpc_endpoint`). The GPU's defaults then apply (two plans in flight), with sampling on
# the device (a GPU's default, asked for: on an RPC device the host samples by default) and the
# exact KV settings (f32, flash attention off), so the tokens stay the CPU's.
# The servers of other processes (`Spawned`) stay on the CPU: an RPC server serves one process
# at a time, and this one is held by the test process.
ON_DEVICE = os.environ.get("SKIPPY_SERVE_DEVICE", "") == "rpc"
_rpc: list = []  # [process, endpoint] once started


def start_server(model_path, **overrides) -> Server:
    settings = dict(model=str(model_path), max_active=LANES, ctx_size=LANES * LANE_CTX,
                    max_waiting=64, threads=1)
    if ON_DEVICE:
        from skippy_scheduler.hosts.offload import OffloadSpec

        settings.update(offload=OffloadSpec(rpc=(rpc_endpoint(),)), kv_type="f32",
                        flash_attn=False, backend_sampling="on")
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
    return parse_metrics(httpx.get(url + "/metrics", timeout=10).text)


def parse_metrics(text: str) -> dict[str, float]:
    """Samples of a /metrics text by name (labels kept in the key)."""
    out = {}
    for line in text.splitlines():
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


# -- a server in a process of its own (signals, descriptor limits, resident memory) ----------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_rpc_server(log_path, timeout_s: float = 30.0) -> tuple[subprocess.Popen, str]:
    """A llama.cpp RPC server on a loopback port lending this machine's CPU (one thread), its
    output in `log_path`; (process, endpoint) once it accepts connections. It ends with the
    test process, however that ends (it would otherwise wait for clients for good)."""
    port = free_port()

    def die_with_parent() -> None:  # in the child, before exec: PR_SET_PDEATHSIG, SIGTERM
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)

    with open(log_path, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "skippy_scheduler.hosts.llama.rpc_server",
                                 "--port", str(port), "-t", "1"], stdout=out, stderr=out,
                                cwd=os.path.dirname(sys.executable), preexec_fn=die_with_parent)
    end = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise AssertionError("the RPC server exited: " + open(log_path).read())
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"127.0.0.1:{port}"
        except OSError:
            if time.monotonic() > end:
                proc.kill()
                raise AssertionError("the RPC server did not listen: " + open(log_path).read())
            time.sleep(0.1)


def rpc_endpoint() -> str:
    """The RPC server of `ON_DEVICE` (started on first use, stopped when the tests end)."""
    if not _rpc:
        import atexit
        import shutil
        import tempfile

        folder = tempfile.mkdtemp(prefix="skippy-rpc-")
        proc, endpoint = start_rpc_server(os.path.join(folder, "rpc.log"))

        def stop() -> None:
            proc.terminate()
            proc.wait(10)
            shutil.rmtree(folder, ignore_errors=True)

        atexit.register(stop)
        _rpc[:] = [proc, endpoint]
    return _rpc[1]


class Spawned:
    """`skippy-scheduler serve` in a subprocess on the tiny model, its temporary files under
    `tmp`, its stderr in `tmp / "serve.log"`."""

    def __init__(self, tmp, *args: str, nofile: Optional[int] = None,
                 timeout_s: float = 60.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tmp = tmp / "tmpdir"
        self.tmp.mkdir()
        self.log_path = tmp / "serve.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(self.tmp))

        def limit() -> None:  # in the child, before exec
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "skippy_scheduler.cli", "serve", "--port",
                 str(self.port), "--threads", "1", *args], stdout=subprocess.DEVNULL,
                stderr=log, env=env, cwd=os.path.dirname(sys.executable),
                preexec_fn=limit if nofile else None)
        end = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, self.log()
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < end, "the server did not start: " + self.log()
            time.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def stop(self, sig: Optional[int] = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        """Send `sig` (None: none); the exit status (the process is killed if it outlives
        `timeout_s`)."""
        if sig is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(f"the server did not exit within {timeout_s} s: " + self.log())


def raw_request(port: int, data: bytes, timeout_s: float = 10.0) -> tuple[bytes, bool]:
    """Send `data` on a fresh connection; what came back, and whether the server closed the
    connection within `timeout_s`."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(data)
        chunks = []
        end = time.monotonic() + timeout_s
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return b"".join(chunks), False
            sock.settimeout(left)
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                return b"".join(chunks), True
            except TimeoutError:
                return b"".join(chunks), False
            if not chunk:
                return b"".join(chunks), True
            chunks.append(chunk)
