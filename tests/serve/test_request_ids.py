"""Request ids (serve/app.py `_RequestIds`): 32 hex digits, unique in a process, and a forked
child draws a prefix of its own (two replicas forked from one parent must not share ids)."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytest.importorskip("fastapi")

from skippy_scheduler.serve.app import _request_id  # noqa: E402


def test_ids_are_32_hex_digits_and_unique():
    ids = [_request_id() for _ in range(10_000)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    assert len(set(ids)) == len(ids)


_FORK = """
import os, sys
from skippy_scheduler.serve.app import _request_id
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(w, _request_id().encode())
    os._exit(0)
os.waitpid(pid, 0)
print(os.read(r, 64).decode(), _request_id())
"""


def test_a_forked_child_draws_its_own_prefix(tmp_path):
    # In a fresh interpreter (a fork from this threaded test process would warn), run outside
    # the checkout so that it imports the installed package.
    out = subprocess.run([sys.executable, "-c", _FORK], capture_output=True, text=True,
                         timeout=60, check=True, cwd=tmp_path).stdout.split()
    child, parent = out
    assert re.fullmatch(r"[0-9a-f]{32}", child) and re.fullmatch(r"[0-9a-f]{32}", parent)
    assert child[:16] != parent[:16]
