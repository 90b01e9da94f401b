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


HOOKS = """
import os, sys
sys.path.insert(0, {bench!r})
from skippy_bench.servers import Served
ran = []
os.register_at_fork(after_in_parent=lambda: ran.append(1))
served = Served([{program!r}, {server!r}], {logs!r}, "s", 30)
served.close()
print(len(ran), flush=True)
"""


def test_a_server_starts_without_the_scripts_fork_hooks(tmp_path):
    """Nothing of the script runs while it forks a server: a SIGINT landing in one of its fork
    hooks would be printed as ignored and lost (Ctrl-C would not stop a bench run)."""
    server = tmp_path / "server.py"
    server.write_text(SERVER)
    script = tmp_path / "bench_script.py"
    script.write_text(HOOKS.format(bench=BENCH, program=sys.executable, server=str(server),
                                   logs=str(tmp_path)))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0"


def test_a_relative_program_is_the_scripts_and_a_missing_one_is_refused(tmp_path):
    """A server program given as a relative path is found from the script's working folder
    (not the logs folder the server runs in); a missing one raises FileNotFoundError."""
    sys.path.insert(0, BENCH)
    try:
        from skippy_bench.servers import Served
    finally:
        sys.path.remove(BENCH)
    (tmp_path / "bin").mkdir()
    program = tmp_path / "bin" / "server"
    program.write_text(f"#!{sys.executable}\n" + SERVER)
    program.chmod(0o755)
    logs = tmp_path / "logs"
    logs.mkdir()
    here = os.getcwd()
    os.chdir(tmp_path)
    try:
        served = Served(["./bin/server"], str(logs), "s", 30)
        served.close()
        with pytest.raises(FileNotFoundError):
            Served(["./bin/none"], str(logs), "t", 30)
    finally:
        os.chdir(here)
