"""Ctrl-C and SIGTERM keep what finished; unwritable outputs are refused before any work.

The lab runs are the installed console script in a subprocess, signalled from outside once the
first result row is on its stdout; `run` is signalled (a real signal to this process) when its
first request finishes. Every wait is bounded.
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import threading

import pytest

from skippy_scheduler.cli import main
from skippy_scheduler.lab.report import format_trace_row

SIGNALS = [signal.SIGINT, signal.SIGTERM]
WAIT_S = 300  # a busy shared machine is slow; a hang still ends


def _mooncake_trace(path, requests: int) -> str:
    rows = []
    for k in range(requests):
        n_in = 1500 + (k * 37) % 2000
        ids = [(k % 20) * 100 + b for b in range(-(-n_in // 512))]
        rows.append(json.dumps({"timestamp": k * 40, "input_length": n_in,
                                "output_length": 40 + k % 60, "hash_ids": ids}))
    path.write_text("\n".join(rows) + "\n")
    return str(path)


def _signal_after_first_row(command, argv, sig, cwd, is_row):
    """Run, send `sig` once a line of stdout satisfies `is_row`; (status, stdout, stderr)."""
    proc = subprocess.Popen([*command, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=cwd)
    timer = threading.Timer(WAIT_S, proc.kill)
    timer.start()
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if is_row(line):
                proc.send_signal(sig)
                break
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        timer.cancel()
    return proc.returncode, "".join(lines) + out, err


def _one_line(err: str, sig) -> str:
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f"interrupted by {signal.Signals(sig).name}: " in lines[0], err
    return lines[0]


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_trace_replay_keeps_the_policies_that_finished(command, tmp_path, sig):
    trace = _mooncake_trace(tmp_path / "t.jsonl", 400)
    out_json = tmp_path / "replay.json"
    status, out, err = _signal_after_first_row(
        command, ["lab", "--trace", trace, "--policy", "fcfs", "--policy", "priority",
                  "--json", str(out_json)], sig, tmp_path, lambda l: l.startswith("fcfs "))
    assert status == 128 + sig, err
    line = _one_line(err, sig)
    assert line.endswith(f"1 of 2 policies printed, wrote --json {out_json}")
    doc = json.loads(out_json.read_text())
    assert list(doc["policies"]) == ["fcfs"]
    assert doc["interrupted"] == signal.Signals(sig).name  # a partial document says so
    # The saved figures are the row that was printed.
    assert format_trace_row(doc["policies"]["fcfs"]) + "\n" in out
    assert "priority " not in out


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_suite_keeps_the_runs_that_finished(command, tmp_path, sig):
    out_json, plots = tmp_path / "suite.json", tmp_path / "plots"
    plot = sig == signal.SIGTERM and _has_matplotlib()
    status, out, err = _signal_after_first_row(
        command, ["lab", "--suite", "--requests", "1500", "--policy", "fcfs", "--policy",
                  "priority", "--no-mixed", "--json", str(out_json),
                  *(["--plot", str(plots)] if plot else [])],
        sig, tmp_path, lambda l: l.startswith("fcfs\t"))
    assert status == 128 + sig, err
    if plot:  # the plots of the finished run, named on stderr before the one line
        written = [l for l in err.splitlines() if l.startswith("# wrote ")]
        assert len(written) == 3 and all(os.path.exists(l[8:]) for l in written)
        err = "".join(l + "\n" for l in err.splitlines() if not l.startswith("# wrote "))
    line = _one_line(err, sig)
    assert f"1 of 2 runs printed, wrote --json {out_json}" in line
    doc = json.loads(out_json.read_text())
    assert [(r["policy"], r["mode"]) for r in doc["runs"]] == [("fcfs", "phase")]
    assert doc["interrupted"] == signal.Signals(sig).name
    row = next(l for l in out.splitlines() if l.startswith("fcfs\t")).split("\t")
    assert row[2] == f"{doc['runs'][0]['p50_queue_ms']:.3f}"


def _signal_on_second_call(monkeypatch, module, name, sig):
    """`module.name` sends `sig` to this process as it is called a second time: the first
    call's result is kept, the second is cut short."""
    real = getattr(module, name)
    calls = []

    def signalled(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), sig)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, signalled)


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_scenarios_keep_the_ones_that_finished(tmp_path, capsys, monkeypatch, sig):
    from skippy_scheduler.cli import lab

    _signal_on_second_call(monkeypatch, lab, "run_scenario", sig)
    out_json = tmp_path / "lab.json"
    status = main(["lab", "--bench-reps", "0", "--json", str(out_json)])
    out, err = capsys.readouterr()
    assert status == 128 + sig, err
    line = _one_line(err, sig)
    assert line.endswith(f"1 of 13 scenarios printed, wrote --json {out_json} (no fixture "
                         "replay)")
    doc = json.loads(out_json.read_text())
    assert doc["interrupted"] == signal.Signals(sig).name
    assert [s["scenario"] for s in doc["scenarios"]] == ["cold-burst-n1"] and doc["replay"] == []
    assert out.splitlines()[1].startswith("cold-burst-n1\t")


def test_a_suite_stopped_before_any_run_finished_still_writes_its_json(tmp_path, capsys,
                                                                      monkeypatch):
    """A script waiting for --json gets the file, marked interrupted, with no runs."""
    from skippy_scheduler.cli import lab_runs

    real = lab_runs.run_suite

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(lab_runs, "run_suite", signalled)
    out_json = tmp_path / "suite.json"
    status = main(["lab", "--suite", "--requests", "50", "--json", str(out_json)])
    _, err = capsys.readouterr()
    assert status == 128 + signal.SIGTERM, err
    assert _one_line(err, signal.SIGTERM).endswith(f"0 of 8 runs printed, wrote --json "
                                                   f"{out_json}")
    doc = json.loads(out_json.read_text())
    assert doc["interrupted"] == "SIGTERM" and doc["runs"] == []


def test_a_whole_run_writes_no_interrupted_key(tmp_path, capsys):
    out_json = tmp_path / "lab.json"
    assert main(["lab", "--bench-reps", "0", "--scenario", "cold-burst-n1", "--json",
                 str(out_json)]) == 0
    assert "interrupted" not in json.loads(out_json.read_text())


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_the_priority_scenario_keeps_the_rules_that_finished(tmp_path, capsys, monkeypatch,
                                                             sig):
    from skippy_scheduler.lab import priority

    _signal_on_second_call(monkeypatch, priority, "run_rule", sig)
    out_json = tmp_path / "priority.json"
    status = main(["lab", "--suite", "--priority-scenario", "--requests", "200", "--json",
                   str(out_json)])
    out, err = capsys.readouterr()
    assert status == 128 + sig, err
    line = _one_line(err, sig)
    assert line.endswith(f"1 of 3 rules printed, wrote --json {out_json}")
    doc = json.loads(out_json.read_text())
    assert doc["interrupted"] == signal.Signals(sig).name
    assert [r["rule"] for r in doc["runs"]] == ["admission-order"]
    assert [l.split("\t")[0] for l in out.splitlines()[2:]] == ["admission-order"]


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_run_keeps_the_requests_that_finished(tmp_path, capsys, monkeypatch, sig):
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    import skippy_scheduler.engine as engine_module
    from skippy_scheduler.engine import FinishEvent

    real_engine = engine_module.Engine

    class SignalledEngine(real_engine):  # a real signal, sent when the first request ends
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            sent = []

            def listener(event):
                if isinstance(event, FinishEvent) and not sent:
                    sent.append(event.request_id)
                    os.kill(os.getpid(), sig)

            self.add_listener(listener)

    monkeypatch.setattr(engine_module, "Engine", SignalledEngine)
    out_json = tmp_path / "run.json"
    # One lane: the requests run one after another, so the first ends well before the last.
    status = main(["run", "-np", "1", "--max-tokens", "6", "-t", "1", "--json", str(out_json)])
    out, err = capsys.readouterr()
    assert status == 128 + sig, err
    doc = json.loads(out_json.read_text())
    finished = doc["requests"]
    assert doc["interrupted"] == signal.Signals(sig).name
    assert 1 <= len(finished) < 6 and all(r["finish"] in ("length", "stop") for r in finished)
    assert all(len(r["generated_tokens"]) >= 1 for r in finished)
    line = _one_line(err, sig)
    assert line.endswith(f"{len(finished)} of 6 requests had finished and are printed, "
                         f"wrote --json {out_json}")
    rows = [l for l in out.splitlines() if l[:1].isdigit()]
    assert [int(r.split("\t")[0]) for r in rows] == [r["index"] for r in finished]
    # The summary's percentiles are those of the rows printed, and it says so.
    assert f"; over the {len(finished)} finished requests: p50/p95 TTFT " in out
    ttft = sorted(r["ttft_us"] for r in finished)
    assert doc["summary"]["p50_ttft_us"] == ttft[math.ceil(len(ttft) / 2) - 1]


# -- unwritable outputs in an existing directory: refused before any work -------------------


UNWRITABLE = [
    (["lab", "--json", "/sys/x.json"], "--json: cannot write /sys/x.json"),
    (["lab", "--iteration-trace", "/proc/t"], "--iteration-trace: cannot write /proc/t"),
    (["lab", "--suite", "--plot", "/proc/x"], "--plot: cannot create /proc/x"),
    (["lab", "--suite", "--json", "/sys/x.json"], "--json: cannot write /sys/x.json"),
    (["lab", "--trace", "{trace}", "--json", "/proc/x.json"], "--json: cannot write"),
    (["run", "--json", "/proc/x.json"], "--json: cannot write /proc/x.json"),
    (["calibrate", "--json", "/sys/x.json"], "--json: cannot write /sys/x.json"),
]


@pytest.mark.skipif(not os.path.isdir("/proc/self") or not os.path.isdir("/sys/kernel"),
                    reason="needs Linux /proc and /sys")
@pytest.mark.parametrize("argv, fragment", UNWRITABLE, ids=[" ".join(a) for a, _ in UNWRITABLE])
def test_unwritable_output_is_refused_before_any_work(capsys, monkeypatch, tmp_path, argv,
                                                       fragment):
    from skippy_scheduler.cli import _common, lab, lab_runs

    def no_work(*args, **kwargs):
        raise AssertionError("work started before the output was checked")

    for module, name in ((lab, "run_scenario"), (lab_runs, "generate"),
                         (lab_runs, "run_replays"), (_common, "import_llama_host")):
        monkeypatch.setattr(module, name, no_work)
    from skippy_scheduler.cli import calibrate, run

    monkeypatch.setattr(run, "import_llama_host", no_work)
    monkeypatch.setattr(calibrate, "import_llama_host", no_work)
    trace = _mooncake_trace(tmp_path / "t.jsonl", 3)
    code = main([a.format(trace=trace) for a in argv])
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert code == 2 and out == "" and len(lines) == 2 and "Traceback" not in err, err
    assert fragment in lines[1], err
    assert not os.path.exists("/proc/x") and not os.path.exists(tmp_path / "x")


def test_a_probed_output_leaves_nothing_behind(tmp_path):
    from skippy_scheduler.cli._common import check_output_dir, check_output_file

    check_output_file("--json", str(tmp_path / "a.json"))
    check_output_dir("--plot", str(tmp_path / "deep" / "plots"))
    assert os.listdir(tmp_path) == []
