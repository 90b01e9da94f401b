"""A JSON file nested as deep as the parser goes is one line of error and nothing else on
stderr: its parse runs near Python's recursion limit, where a finalizer the cyclic collector
happened to run (any object's) failed in turn and printed "Exception ignored" above the line.
The collector is held off while such files are parsed (prompts, cost models, traces)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import gc, sys
    from skippy_scheduler._validate import json_loads

    class Finalized:  # garbage in a cycle, whose finalizer needs a little stack
        def __del__(self):
            def down(n):
                return 0 if n == 0 else down(n - 1) + 1
            down(30)

    text = '["a",\\n"[[",\\n' + "[" * 100_000
    for threshold in range(850, 1000, 5):  # the collector's first pass lands deep in the parse
        gc.collect()
        gc.set_threshold(threshold, 10, 10)
        a, b = Finalized(), Finalized()
        a.other, b.other = b, a
        del a, b
        try:
            json_loads(text)
        except RecursionError:
            pass
    print("parsed")
""")


def test_a_deep_document_runs_no_finalizer_at_the_parsers_depth(tmp_path):
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=120, cwd=str(tmp_path),
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "parsed"
    assert "Exception ignored" not in done.stderr, done.stderr[-2000:]
