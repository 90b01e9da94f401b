"""Stage workers on this machine: one process per stage file, on ipc sockets.

`LocalStages(DIR)` starts `skippy-scheduler stage` for every `DIR/stage-K.gguf` (its stderr
goes to a log file beside the sockets, never to a pipe nobody reads), `host()` makes a
`StageHost` on them, and `close()` stops them and removes the temporary directory. A worker
also exits by itself when this process goes away without closing it (`--parent-pid`).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from typing import Any, Optional

from .host import StageHost
from .split import file_identity, stage_paths


class LocalStages:
    """Worker processes for every `stage-K.gguf` of a directory, on ipc sockets."""

    def __init__(self, directory: str, *, n_threads: int = 1, start_timeout_s: float = 60.0,
                 source_model: Optional[str] = None) -> None:
        self.paths = stage_paths(directory)
        self.source_id = file_identity(source_model) if source_model else None
        self._dir = tempfile.mkdtemp(prefix="skippy-stages-")
        self.addresses = [f"ipc://{self._dir}/stage-{k}" for k in range(len(self.paths))]
        self.start_timeout_s = start_timeout_s
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs = [os.path.join(self._dir, f"stage-{k}.log") for k in range(len(self.paths))]
        for path, addr, log in zip(self.paths, self.addresses, self.logs):
            with open(log, "wb") as err:  # a file, not a pipe nobody reads
                # NOTE: run from the socket directory, not the caller's: `python -m` puts the
                # working directory first on sys.path, and in a source checkout that would
                # import its uncompiled sources instead of the installed package.
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "skippy_scheduler.cli", "stage", "--model",
                     os.path.abspath(path), "--listen", addr, "--threads", str(n_threads),
                     "--parent-pid", str(os.getpid())],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                    cwd=self._dir))

    def host(self, **kwargs: Any) -> StageHost:
        """A `StageHost` on these workers (StageHost's keywords)."""
        kwargs.setdefault("source_id", self.source_id)
        return StageHost(self.addresses, procs=self.procs, **kwargs)

    def kill(self, k: int) -> None:
        """Kill stage `k`'s process (SIGKILL): what a crashed machine looks like."""
        self.procs[k].kill()
        self.procs[k].wait()

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:  # pragma: no cover
                proc.kill()
                proc.wait()
        for entry in os.listdir(self._dir):
            os.unlink(os.path.join(self._dir, entry))
        os.rmdir(self._dir)

    def __enter__(self) -> "LocalStages":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
