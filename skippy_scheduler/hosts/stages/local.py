"""Stage workers on this machine: one process per stage file, on ipc sockets.

`LocalStages(DIR)` starts `skippy-scheduler stage` for every `DIR/stage-K.gguf` (its stderr
goes to a log file beside the sockets, never to a pipe nobody reads), `host()` makes a
`StageHost` on them, and `close()` stops them and removes the temporary directory. A worker
also exits by itself when this process goes away without closing it (`--parent-pid`).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from typing import Any, Optional, Sequence

from .host import StageHost
from .split import file_identity, stage_paths


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's or `taskset`'s
    limit, not the machine's count), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity on this platform
        return max(1, os.cpu_count() or 1)


class StageProcess(subprocess.Popen[bytes]):
    """A local stage worker's process, with the file its stderr goes to (`log_path`): what a
    `StageFailure` for a worker that exited quotes."""

    log_path: Optional[str] = None


class LocalStages:
    """Worker processes for every `stage-K.gguf` of a directory, on ipc sockets."""

    def __init__(self, directory: str, *, n_threads: Optional[int] = None,
                 start_timeout_s: float = 60.0, source_model: Optional[str] = None,
                 stage_args: Sequence[Sequence[str]] = (), n_batch: int = 0) -> None:
        """`n_threads`: each worker's compute threads (None: the cores this process may run
        on, its CPU affinity, divided among the stages, at least one). `stage_args`: further
        `stage` flags per stage (the offload flags, a device each: `stage_device_args`).
        `n_batch`: the batch the driver will ask, when more than a worker takes by default
        (`stage --max-batch-tokens`)."""
        from .wire import DEFAULT_MAX_BATCH_TOKENS

        self.paths = stage_paths(directory)
        if n_threads is None:
            n_threads = max(1, usable_cores() // len(self.paths))
        self.n_threads = n_threads
        self.source_id = file_identity(source_model) if source_model else None
        self._dir = tempfile.mkdtemp(prefix="skippy-stages-")
        self.addresses = [f"ipc://{self._dir}/stage-{k}" for k in range(len(self.paths))]
        self.start_timeout_s = start_timeout_s
        self.procs: list[StageProcess] = []
        self.logs = [os.path.join(self._dir, f"stage-{k}.log") for k in range(len(self.paths))]
        extra = list(stage_args) + [[]] * (len(self.paths) - len(stage_args))
        batch = (["--max-batch-tokens", str(n_batch)] if n_batch > DEFAULT_MAX_BATCH_TOKENS
                 else [])
        for path, addr, log, more in zip(self.paths, self.addresses, self.logs, extra):
            with open(log, "wb") as err:  # a file, not a pipe nobody reads
                # NOTE: run from the socket directory, not the caller's: `python -m` puts the
                # working directory first on sys.path, and in a source checkout that would
                # import its uncompiled sources instead of the installed package.
                proc = StageProcess(
                    [sys.executable, "-m", "skippy_scheduler.cli", "stage", "--model",
                     os.path.abspath(path), "--listen", addr, "--threads", str(n_threads),
                     "--parent-pid", str(os.getpid()), *batch, *more],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                    cwd=self._dir)
                proc.log_path = log
                self.procs.append(proc)

    def host(self, **kwargs: Any) -> StageHost:
        """A `StageHost` on these workers (StageHost's keywords)."""
        kwargs.setdefault("source_id", self.source_id)
        return StageHost(self.addresses, procs=self.procs, **kwargs)

    def kill(self, k: int) -> None:
        """Kill stage `k`'s process (SIGKILL): what a crashed machine looks like."""
        self.procs[k].kill()
        self.procs[k].wait()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the workers: SIGTERM, then SIGKILL for one still running `timeout_s` later
        (a worker stopped or hung does not act on SIGTERM)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                if hasattr(signal, "SIGCONT"):  # a stopped worker acts on it once resumed
                    proc.send_signal(signal.SIGCONT)
        for proc in self.procs:
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for entry in os.listdir(self._dir):
            os.unlink(os.path.join(self._dir, entry))
        os.rmdir(self._dir)

    def __enter__(self) -> "LocalStages":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
