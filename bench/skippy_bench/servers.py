"""Server processes on loopback: a free port, started and waited for until healthy, stopped;
where llama-server is; `skippy-scheduler run` in this Python."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Optional

import httpx

OURS, THEIRS = "skippy-scheduler", "llama-server"  # the two sides of a comparison


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# What a server's process runs before it becomes the server (Linux): SIGTERM once the process
# that started it dies (PR_SET_PDEATHSIG, kept across exec), so a bench script killed outright
# (`timeout -k`, a runner's time limit) leaves no server behind holding its port, its memory or
# a GPU for the next run; it exits at once where that process died before then. A launcher and
# not Popen's preexec_fn: with one, the script runs its own fork hooks, and a SIGINT landing in
# one of them (logging's, say) is printed as ignored and lost, so Ctrl-C does not stop a run.
# The signal follows the thread that started the server, not the process: every script here
# starts its servers on its main thread, whose end is the script's.
_LAUNCH = """
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)
os.execv(sys.argv[2], sys.argv[2:])
"""


def launched(cmd: list[str]) -> list[str]:
    """`cmd` to run so that it dies with this process (see _LAUNCH). FileNotFoundError where
    its program is not found, as Popen would raise for `cmd` itself; a relative path is taken
    from this process's working folder, not the server's."""
    program = shutil.which(cmd[0])
    if program is None:
        raise FileNotFoundError(f"no program {cmd[0]!r}")
    program = os.path.abspath(program)
    if not sys.platform.startswith("linux"):
        return [program, *cmd[1:]]
    return [sys.executable, "-I", "-S", "-c", _LAUNCH, str(os.getpid()), program, *cmd[1:]]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Return once `url` answers 200; RuntimeError when `proc` exits first or time runs out."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} (see its log)")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout_s} s")


def stop(proc: subprocess.Popen, timeout_s: float = 15,
         sig: signal.Signals = signal.SIGTERM) -> None:
    """`sig` (default SIGTERM) to a running `proc`, then SIGKILL after `timeout_s`."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(15)


def log_tail(path: str, n: int = 3000) -> str:
    """The last `n` bytes of the log at `path` ("" when it cannot be read)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - n))
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""


class Served:
    """A server process on a free loopback port (`cmd` + `--port N`), its stdout and stderr
    in `logs`/`name`.log, ready once `/health` answers; `close()` stops it."""

    def __init__(self, cmd: list[str], logs: str, name: str, timeout_s: float,
                 stop_timeout_s: float = 15) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(logs, f"{name}.log")
        self.stop_timeout_s = stop_timeout_s
        run = launched(cmd + ["--port", str(self.port)])
        self.log = open(self.log_path, "ab")
        # From the logs folder, not a checkout (`python -m` would import its sources).
        try:
            self.proc = subprocess.Popen(run, stdout=self.log, stderr=subprocess.STDOUT,
                                         cwd=logs)
        except BaseException:
            self.log.close()
            raise
        try:
            wait_ready(self.url + "/health", self.proc, timeout_s)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        stop(self.proc, self.stop_timeout_s)
        self.log.close()


def find_llama_server(given: Optional[str]) -> Optional[str]:
    """--llama-server PATH, else $LLAMA_SERVER, else llama-server on PATH (None: none found)."""
    if given:
        return given
    for candidate in (os.environ.get("LLAMA_SERVER"), "llama-server"):
        if candidate and (found := shutil.which(candidate)):
            return found
    return None


def run_summary(run_args: list[str], out: str) -> dict:
    """`skippy-scheduler run RUN_ARGS --json OUT` in this Python; the summary it wrote."""
    cmd = [sys.executable, "-m", "skippy_scheduler.cli", "run", *run_args, "--json", out]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    with open(out, encoding="utf-8") as fh:
        return json.load(fh)["summary"]
