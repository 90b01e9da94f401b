"""The lab's tails (lab/tails.py, docs/lab.md "Tails and the slack rule"): stall counts per
request from a run's timeline, the `--tails` / `--slack` tables and JSON, and the output
without them unchanged in shape."""
from __future__ import annotations

import json

import numpy as np
import pytest

from skippy_scheduler.cli import main
from skippy_scheduler.engine.record import TokenTimeline
from skippy_scheduler.lab.tails import TAIL_COLUMNS, stalls_per_request, tail_figures

ROWS = [
    '{"timestamp": 0, "input_length": 1100, "output_length": 40, "hash_ids": [0, 1, 2]}',
    '{"timestamp": 0, "input_length": 1300, "output_length": 30, "hash_ids": [0, 1, 3]}',
    '{"timestamp": 0, "input_length": 1500, "output_length": 9, "hash_ids": [0, 4, 5]}',
    '{"timestamp": 1, "input_length": 1100, "output_length": 20, "hash_ids": [0, 1, 2]}',
]


def test_stalls_per_request_reads_gaps_request_by_request():
    # requests 0..3 with 3, 1, 0 and 2 tokens: gaps (2, 1), (), (), (1)
    timeline = TokenTimeline(np.zeros(4), np.zeros(4), np.array([3, 1, 0, 2]),
                             np.array([9.0, 0.0, 0.0, 7.0]), np.array([9.0, 2.0, 7.0]))
    assert stalls_per_request(timeline, 5.0).tolist() == [1, 0, 0, 1]
    assert stalls_per_request(timeline, 1.0).tolist() == [2, 0, 0, 1]
    f = tail_figures(timeline, 0.005, ["a", "b", "a", "b"], "tenant")
    assert (f["stalls"], f["max_stalls_per_request"], f["max_itl_ms"]) == (2, 1, 0.009)
    assert f["stalls_by_group"] == {"a": 1, "b": 1}
    assert f["stalled_requests_pct"] == 50.0
    with pytest.raises(RuntimeError):  # gaps that do not match the token counts
        stalls_per_request(TokenTimeline(np.zeros(1), np.zeros(1), np.array([3]),
                                         np.zeros(1), np.zeros(1)), 1.0)


def _lab(capsys, *argv):
    code = main(["lab", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_suite_slack_prints_the_tails(tmp_path, capsys, backend):
    path = tmp_path / "suite.json"
    code, out, _ = _lab(capsys, "--suite", "--requests", "120", "--seed", "3", "--policy",
                        "fcfs", "--scheduler", backend, "--slack", "--json", str(path))
    assert code == 0
    head, tails = out.split("# tails: ")
    rows = [line.split("\t") for line in tails.splitlines()[1:]]
    assert tails.splitlines()[1].split("\t") == list(TAIL_COLUMNS)
    assert [r[1] for r in rows[1:]] == ["phase", "mixed", "slack"]
    doc = json.loads(path.read_text())
    assert [t["mode"] for t in doc["tails"]] == ["phase", "mixed", "slack"]
    slack = doc["tails"][2]
    # the slack rule keeps every gap within the target (1.5 ms) on the lab's exact cost model
    assert slack["stalls"] == 0 and slack["max_itl_ms"] <= 1.5
    assert doc["tails"][0]["stalls"] > 0  # the phase rule stalls decoders here
    assert "\tslack\t" in head


def test_without_the_flags_there_are_no_tails(tmp_path, capsys, backend):
    path = tmp_path / "suite.json"
    code, out, _ = _lab(capsys, "--suite", "--requests", "40", "--seed", "3", "--policy",
                        "fcfs", "--scheduler", backend, "--json", str(path))
    assert code == 0 and "# tails" not in out and "\tslack\t" not in out
    assert "tails" not in json.loads(path.read_text())


def test_trace_slack_replays_the_slack_mode(tmp_path, capsys, backend):
    trace = tmp_path / "small.jsonl"
    trace.write_text("\n".join(ROWS) + "\n")
    code, out, _ = _lab(capsys, "--trace", str(trace), "--scheduler", backend, "--policy",
                        "fcfs", "--slack", "--tenants", "2", "--itl-target-ms", "2")
    assert code == 0
    assert "mode=slack" in out
    row = out.split("# tails: ")[1].splitlines()[2].split("\t")
    assert row[1] == "slack"
    groups = dict(item.split(":") for item in row[-1].split(","))
    assert groups and set(groups) <= {"t0", "t1"}
    assert sum(int(v) for v in groups.values()) == int(row[TAIL_COLUMNS.index("stalls")])


def test_goodput_fraction_shows_a_miss():
    """A run that missed a few requests prints e.g. 0.9975, not a rounded 1.00."""
    from types import SimpleNamespace

    from skippy_scheduler.lab.tails import format_tails

    timeline = TokenTimeline(np.zeros(2), np.zeros(2), np.array([2, 2]),
                             np.array([1.0, 1.0]), np.array([1.0, 1.0]))
    run = SimpleNamespace(policy="fcfs", mode="slack",
                          figures={"p50_itl_ms": 0.001, "p99_itl_ms": 0.001,
                                   "p99_max_itl_ms": 0.001, "p50_ttft_ms": 1.0,
                                   "p99_ttft_ms": 1.0, "goodput_fraction": 0.99751,
                                   "policy": "fcfs", "mode": "slack"},
                          tails=tail_figures(timeline, 1.0, ["priority0", "priority0"],
                                             "priority"))
    row = format_tails([run]).splitlines()[1].split("\t")
    assert row[TAIL_COLUMNS.index("goodput_fraction")] == "0.9975"
