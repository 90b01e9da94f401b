"""The bench scripts' server processes (`skippy_bench.servers.Served`) die with the script
that started them, even one killed outright: none is left holding its port or memory (or a
GPU) for the next run."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the parent-death signal is Linux's")

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "bench")

SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[-1])), H).serve_forever()
"""

SCRIPT = """
import sys, time
sys.path.insert(0, {bench!r})
from skippy_bench.servers import Served
served = Served([sys.executable, {server!r}], {logs!r}, "s", 30)
print(served.proc.pid, flush=True)
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    """Exited (a zombie waiting for a reaper counts: it holds nothing)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in fh)
    except FileNotFoundError:
        return True


def test_a_server_dies_with_the_script_that_started_it(tmp_path):
    server = tmp_path / "server.py"
    server.write_text(SERVER)
    script = tmp_path / "bench_script.py"
    script.write_text(SCRIPT.format(bench=BENCH, server=str(server), logs=str(tmp_path)))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    pid = None
    try:
        pid = int(proc.stdout.readline())
        assert not _gone(pid)
        proc.send_signal(signal.SIGKILL)  # no finally, no stop(): only the kernel is left
        proc.wait(30)
        end = time.monotonic() + 10
        while not _gone(pid) and time.monotonic() < end:
            time.sleep(0.1)
        assert _gone(pid), "the server outlived the script that started it"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        proc.stdout.close()
        if pid is not None and not _gone(pid):
            os.kill(pid, signal.SIGKILL)
