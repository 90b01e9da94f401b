"""The engine's types say what it returns (mypy --strict on a snippet, reading this checkout's
sources and stubs): `run` gives an `EngineReport` when the engine records and None when it does
not, a prompt may be an integer array, and the scheduler's sequence snapshots hold tuples."""
from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("mypy")

ROOT = pathlib.Path(__file__).resolve().parents[2]

SNIPPET = """\
    import numpy as np
    from typing import Optional
    from typing_extensions import assert_type

    from skippy_scheduler import Scheduler, Sequence
    from skippy_scheduler.engine import CostModelHost, Engine, EngineReport, Request

    recording = Engine(Scheduler(), CostModelHost(), clock=None)
    assert_type(recording.run([Request("a", np.arange(3), 2)]), EngineReport)
    quiet = Engine(Scheduler(), CostModelHost(), clock=None, record=False)
    assert_type(quiet.run(), None)
    either = Engine(Scheduler(), CostModelHost(), record=bool(len("x")))
    assert_type(either.run(), Optional[EngineReport])

    def runs(engine: Engine) -> Optional[EngineReport]:
        return engine.run()

    runs(recording)
    runs(quiet)

    scheduler = Scheduler()
    scheduler.submit(Sequence("a", [1, 2, 3], 2))
    snapshot = scheduler.sequence("a")
    assert snapshot is not None
    assert_type(snapshot.prompt_tokens, tuple[int, ...])
    for ended in scheduler.retired():
        assert_type(ended.generated_tokens, tuple[int, ...])
    as_sequence: Sequence = snapshot
"""


def test_the_engine_types_match_what_it_returns(tmp_path):
    (tmp_path / "mypy.ini").write_text("[mypy]\n")
    snippet = tmp_path / "engine_types.py"
    snippet.write_text(textwrap.dedent(SNIPPET))
    cmd = [sys.executable, "-m", "mypy", "--strict", "--config-file", str(tmp_path / "mypy.ini"),
           "--cache-dir", str(tmp_path / "cache"), "--ignore-missing-imports", str(snippet)]
    # From the checkout's root, so that mypy reads its sources and stubs.
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
