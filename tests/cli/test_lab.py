"""`skippy-scheduler lab`: table, selection, trace, JSON, cost model, replay."""
from __future__ import annotations

import json

import pytest

from skippy_scheduler.cli import main
from skippy_scheduler.lab.report import COLUMNS


def _run(capsys, *argv):
    code = main(["lab", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_default_table_prints_all_scenarios(capsys, backend):
    code, out, _ = _run(capsys, "--scheduler", backend, "--bench-reps", "1")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split("\t") == list(COLUMNS)
    assert len(lines) == 14
    assert lines[1].startswith("cold-burst-n1\t1\t14.262\t70.12\t0.000\t8.992\t8.992\t14.262\t"
                               "0.170\t1.00\t4.29\t16\t31\t0\t")
    assert float(lines[1].split("\t")[-1]) > 0  # our own wall time per run, µs


def test_scenario_selection_and_replay(capsys, backend):
    code, out, _ = _run(capsys, "--scheduler", backend, "--bench-reps", "0", "--scenario",
                        "radix-fcfs", "--scenario", "waiting-prefix-dfs", "--replay")
    assert code == 0
    table, replay = out.split("\n\n")
    assert [l.split("\t")[0] for l in table.splitlines()[1:]] == ["radix-fcfs",
                                                                  "waiting-prefix-dfs"]
    rows = [l.split("\t") for l in replay.splitlines()[1:]]
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [
        ("warm-affinity", "fcfs", "1", "1"), ("warm-affinity", "dfs", "1", "1"),
        ("agentic-eviction-pressure", "fcfs", "15", "15"),
        ("agentic-eviction-pressure", "dfs", "7", "7")]


def test_twin_scheduler(capsys):
    code, out, _ = _run(capsys, "--scheduler", "twin", "--bench-reps", "0", "--scenario",
                        "cold-burst-n1")
    assert code == 0 and out.splitlines()[1].startswith("cold-burst-n1\t1\t14.262")


def test_unknown_scenario_is_an_error(capsys):
    code, _, err = _run(capsys, "--scenario", "nope", "--bench-reps", "0")
    assert code == 2 and "unknown scenario 'nope'" in err


def test_trace_file(tmp_path, capsys, backend):
    path = tmp_path / "trace.txt"
    _run(capsys, "--scheduler", backend, "--bench-reps", "0", "--iteration-trace", str(path))
    text = path.read_text()
    assert text.count("### scenario ") == 13
    assert "### scenario staggered-prefill-mixed\nit=0 t=0 dur=114 admitted=1 tokens=32 | " \
           "decoder:Prefill:32@0*\n" in text


def _strip_wall(document):
    for scenario in document["scenarios"]:
        scenario.pop("bench_us_per_run")
    return document


def test_json_is_deterministic_except_wall_time(tmp_path, capsys, backend):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    _run(capsys, "--scheduler", backend, "--bench-reps", "2", "--json", str(a))
    _run(capsys, "--scheduler", backend, "--bench-reps", "2", "--json", str(b))
    da, db = json.loads(a.read_text()), json.loads(b.read_text())
    assert all(s["bench_us_per_run"] > 0 for s in da["scenarios"])
    # byte-identical once the wall-time fields are blanked
    blank = lambda text: "\n".join(l for l in text.splitlines() if '"bench_us_per_run"' not in l)
    assert blank(a.read_text()) == blank(b.read_text())
    assert _strip_wall(da) == _strip_wall(db)
    scenario = da["scenarios"][10]
    assert scenario["scenario"] == "radix-cache-aware"
    assert scenario["per_request"]["c-hot"]["ttft_us"] == 2_248
    assert scenario["table_row"]["p50_ttft_ms"] == "13.790"
    assert [r["switches"] for r in da["replay"]] == [1, 1, 15, 7]


def test_cost_model_override(capsys, tmp_path, backend):
    code, out, _ = _run(capsys, "--scheduler", backend, "--bench-reps", "0", "--scenario",
                        "cold-burst-n1", "--cost-model",
                        "iteration_overhead_us=50,prefill_token_us=2,decode_batch_us=100,"
                        "decode_sequence_us=20")
    assert out.splitlines()[1].startswith("cold-burst-n1\t1\t14.262\t")
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps({"iteration_overhead_us": 0, "prefill_token_us": 1}))
    code, out, _ = _run(capsys, "--scheduler", backend, "--bench-reps", "0", "--scenario",
                        "cold-burst-n1", "--cost-model", str(cost))
    # 16 prefill chunks of 256 tokens at 1 µs/token, then 31 decode iterations of 120 µs
    assert code == 0
    assert out.splitlines()[1].split("\t")[2] == f"{(16 * 256 + 31 * 120) / 1000:.3f}"


@pytest.mark.parametrize("spec, message", [("bogus=1", "unknown cost model field"),
                                           ("prefill_token_us", "not name=value"),
                                           ("prefill_token_us=x", "not a number"),
                                           ("prefill_token_us=-1", ">= 0")])
def test_cost_model_errors(capsys, spec, message):
    code, _, err = _run(capsys, "--bench-reps", "0", "--cost-model", spec)
    assert code == 2 and message in err


def test_list(capsys):
    code, out, _ = _run(capsys, "--list")
    assert code == 0 and len(out.split()) == 13


def test_help_says_which_runs_print_comment_lines(capsys):
    import re

    try:
        main(["lab", "--help"])
    except SystemExit:
        pass
    # argparse wraps the text, breaking "tab-separated" after its hyphen.
    text = " ".join(re.sub(r"-\n\s*", "-", capsys.readouterr().out).split())
    assert "Without --suite, --trace or --pipeline-stages, print the reference scenario " \
           "table: tab-separated, with no comment lines." in text
    assert "--suite and --pipeline-stages print tab-separated tables under '#' comment " \
           "lines" in text
    assert "All three runs" not in text


@pytest.mark.parametrize("flag", ["--priority-scenario", "--requests", "--seed"])
def test_suite_only_options_alone_name_the_suite(capsys, flag):
    argv = [flag] + ([] if flag == "--priority-scenario" else ["3"])
    code, _, err = _run(capsys, *argv)
    assert code == 2 and f"{flag} needs --suite\n" in err


def test_plot_lines_follow_the_tables(tmp_path):
    """`# wrote PATH` (stderr) comes after the last table row with --suite and with --trace."""
    import subprocess
    import sys

    pytest.importorskip("matplotlib")
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(f'{{"timestamp": {k * 50}, "input_length": 600, '
                             f'"output_length": 5, "hash_ids": [0, {100 + k}]}}\n'
                             for k in range(20)))
    for run in (["--suite", "--requests", "40", "--policy", "fcfs", "--mixed"],
                ["--trace", str(trace), "--policy", "fcfs"]):
        merged = subprocess.run(
            [sys.executable, "-m", "skippy_scheduler.cli", "lab", *run, "--plot",
             str(tmp_path / "plots")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, check=True, timeout=300,
            # (not from the checkout: `python -m` would import its uncompiled sources)
            cwd=tmp_path).stdout.splitlines()
        wrote = [k for k, line in enumerate(merged) if line.startswith("# wrote ")]
        row = max(k for k, line in enumerate(merged) if line.startswith("fcfs"))
        assert len(wrote) == 3 and min(wrote) > row, merged
