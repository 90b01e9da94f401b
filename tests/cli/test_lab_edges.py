"""`skippy-scheduler lab` at its edges: a burst past the default waiting limit, checks that
come before anything is printed, stdout going away, repeated names, an interruption before
the first reference scenario, flags a run would ignore, a trace that is not a regular file,
figures that are undefined, and per-tenant service of a burst."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from skippy_scheduler.cli import main
from skippy_scheduler.cli.interrupt import Interrupted
from skippy_scheduler.lab.simulate import SimulationError

TIMEOUT_S = 300  # every subprocess here ends in seconds; this only bounds a hang


def _run(capsys, *argv):
    code = main(["lab", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _mooncake(path, rows):
    """A Mooncake JSONL trace: rows of (timestamp ms, input tokens, output tokens, tenant)."""
    block = 0
    with open(path, "w", encoding="utf-8") as fh:
        for ts, n_in, n_out, tenant in rows:
            blocks = -(-n_in // 512)
            row = {"timestamp": ts, "input_length": n_in, "output_length": n_out,
                   "hash_ids": list(range(block, block + blocks))}
            block += blocks
            if tenant is not None:
                row["tenant"] = tenant
            fh.write(json.dumps(row) + "\n")
    return str(path)


# -- 1. the staged pipeline: every accepted --pipeline-requests runs -------------------------

def test_pipeline_burst_past_the_default_waiting_limit(tmp_path, capsys):
    doc = tmp_path / "staged.json"
    code, out, err = _run(capsys, "--pipeline-stages", "1", "--pipeline-requests", "257",
                          "--json", str(doc))
    assert code == 0, err
    rows = [line for line in out.splitlines() if not line.startswith("#")]
    assert rows[0].startswith("stages\t") and rows[1].startswith("1\t1\t")
    assert json.loads(doc.read_text())["requests"] == 257


def test_pipeline_simulation_error_is_one_line(capsys, monkeypatch):
    import skippy_scheduler.cli.lab_stages as lab_stages

    def fail(*args, **kwargs):
        raise SimulationError("submit of request-7 failed: refused")

    monkeypatch.setattr(lab_stages, "staged_table", fail)
    code, out, err = _run(capsys, "--pipeline-stages", "2")
    assert code == 2 and out == ""
    assert err.splitlines()[-1] == ("skippy-scheduler lab: error: the staged pipeline could not "
                                    "run: submit of request-7 failed: refused")


# -- 2. the priority scenario checks its mode before printing --------------------------------

@pytest.mark.parametrize("mode, message", [
    ("bogus", "unknown mode 'bogus' (choose from phase, mixed)"),
    ("slack", "--priority-scenario runs mixed or phase planning"),
])
def test_priority_scenario_refuses_a_mode_before_printing(tmp_path, capsys, mode, message):
    doc = tmp_path / "pb.json"
    code, out, err = _run(capsys, "--suite", "--priority-scenario", "--requests", "30",
                          "--mode", mode, "--json", str(doc))
    assert code == 2 and out == "" and not doc.exists()
    assert message in err.splitlines()[-1]


def test_priority_scenario_takes_a_repeated_mode_once(capsys):
    code, out, err = _run(capsys, "--suite", "--priority-scenario", "--requests", "30",
                          "--mode", "phase", "--mode", "phase")
    assert code == 0, err
    assert " mode=phase " in out.splitlines()[0]
    assert len(out.splitlines()) == 2 + 3  # the header lines, one row per rule


# -- 3. stdout going away does not lose the files --------------------------------------------

def _closed_stdout(tmp_path, *argv):
    """Run the lab with a stdout whose reader has gone: every write to it fails (EPIPE)."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "skippy_scheduler.cli", "lab", *argv],
                              cwd=tmp_path, stdout=write, stderr=subprocess.PIPE, text=True,
                              timeout=TIMEOUT_S)
    finally:
        os.close(write)
    return proc


@pytest.mark.parametrize("argv, key, count", [
    (("--suite", "--requests", "40", "--policy", "fcfs"), "runs", 2),
    (("--scenario", "cold-burst-n1", "--bench-reps", "0"), "scenarios", 1),
    (("--suite", "--priority-scenario", "--requests", "30"), "runs", 3),
    (("--pipeline-stages", "1,2"), "rows", 3),
])
def test_files_are_written_when_stdout_goes_away(tmp_path, argv, key, count):
    proc = _closed_stdout(tmp_path, *argv, "--json", "out.json")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr
    assert len(json.loads((tmp_path / "out.json").read_text())[key]) == count


def test_suite_writes_its_requests_when_stdout_goes_away(tmp_path):
    proc = _closed_stdout(tmp_path, "--suite", "--requests", "40", "--policy", "fcfs",
                          "--mixed", "--requests-out", "req.jsonl")
    assert proc.returncode == 0, proc.stderr
    assert len((tmp_path / "req.jsonl").read_text().splitlines()) == 40


def test_without_files_stdout_going_away_ends_the_command_quietly(tmp_path):
    proc = _closed_stdout(tmp_path, "--scenario", "cold-burst-n1", "--bench-reps", "0")
    assert proc.returncode == 0 and proc.stderr == ""


# -- 4. an empty --trace ---------------------------------------------------------------------

def test_empty_trace_path_is_refused(capsys):
    code, out, err = _run(capsys, "--trace", "", "--bench-reps", "0")
    assert code == 2 and out == ""
    assert err.splitlines()[-1] == "skippy-scheduler lab: error: --trace: empty path"


# -- 5. a name given twice is one row --------------------------------------------------------

def test_repeated_scenario_is_one_row(capsys):
    code, out, _ = _run(capsys, "--scenario", "cold-burst-n1", "--scenario", "cold-burst-n1",
                        "--bench-reps", "0")
    assert code == 0
    assert [line.split("\t")[0] for line in out.splitlines()[1:]] == ["cold-burst-n1"]


def test_repeated_mode_is_one_run(tmp_path, capsys):
    lines = tmp_path / "req.jsonl"
    code, out, err = _run(capsys, "--suite", "--requests", "20", "--policy", "fcfs",
                          "--mode", "phase", "--mode", "phase", "--requests-out", str(lines))
    assert code == 0, err
    rows = [line for line in out.splitlines() if not line.startswith("#")][1:]
    assert [row.split("\t")[:2] for row in rows] == [["fcfs", "phase"]]
    assert len(lines.read_text().splitlines()) == 20


def test_repeated_stage_count_is_one_row(capsys):
    code, out, _ = _run(capsys, "--pipeline-stages", "2,1,2")
    assert code == 0
    rows = [line.split("\t")[:2] for line in out.splitlines() if not line.startswith("#")][1:]
    assert rows == [["2", "1"], ["2", "2"], ["1", "1"]]


# -- 6. interrupted before the first reference scenario finished -----------------------------

def test_reference_interrupted_before_the_first_scenario_writes_json(tmp_path, capsys,
                                                                     monkeypatch):
    import skippy_scheduler.cli.lab as lab

    def stop(*args, **kwargs):
        raise Interrupted(signal.SIGINT)

    monkeypatch.setattr(lab, "run_scenario", stop)
    doc = tmp_path / "ref0.json"
    code, out, err = _run(capsys, "--bench-reps", "0", "--json", str(doc))
    assert code == 130
    assert out.splitlines() == [out.splitlines()[0]] and out.startswith("scenario\t")
    data = json.loads(doc.read_text())
    assert data["interrupted"] == "SIGINT" and data["scenarios"] == []
    assert err.splitlines()[-1] == (f"skippy-scheduler lab: interrupted by SIGINT: 0 of 13 "
                                    f"scenarios printed, wrote --json {doc} (no fixture replay)")


# -- 8. flags the run would ignore -----------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (("--suite", "--reserve-output-tokens", "5"), "--reserve-output-tokens sizes"),
    (("--suite", "--kv-capacity-tokens", "0", "--reserve-output-tokens", "5"),
     "--reserve-output-tokens sizes"),
    (("--suite", "--families", "0", "--family-share", "0.9"),
     "--family-share 0.9 does not apply with --families 0"),
    (("--suite", "--families", "8", "--family-share", "0"),
     "--families 8 does not apply with --family-share 0"),
])
def test_ignored_suite_flags_are_refused(capsys, argv, message):
    code, out, err = _run(capsys, *argv, "--requests", "10")
    assert code == 2 and out == ""
    assert message in err.splitlines()[-1]


def test_ignored_trace_flag_is_refused(tmp_path, capsys):
    trace = _mooncake(tmp_path / "t.jsonl", [(0, 100, 4, None)])
    code, out, err = _run(capsys, "--trace", trace, "--reserve-output-tokens", "5")
    assert code == 2 and out == ""
    assert "--reserve-output-tokens sizes" in err.splitlines()[-1]


def test_reserve_with_the_memory_model_runs(capsys):
    code, _, err = _run(capsys, "--suite", "--requests", "10", "--policy", "fcfs", "--mixed",
                        "--kv-capacity-tokens", "100000", "--reserve-output-tokens", "5")
    assert code == 0, err


# -- 9. a trace that is not a regular file ---------------------------------------------------

def test_trace_from_a_pipe_is_refused(tmp_path):
    with open(_mooncake(tmp_path / "t.jsonl", [(0, 100, 4, None)] * 3)) as fh:
        text = fh.read()
    proc = subprocess.run([sys.executable, "-m", "skippy_scheduler.cli", "lab", "--trace",
                           "/dev/stdin"], cwd=tmp_path, input=text, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines()[-1] == (
        "skippy-scheduler lab: error: --trace: /dev/stdin is not a regular file (a pipe or a "
        "device); --trace must be a regular file, as it is read more than once")


# -- 10. undefined figures are `-` and null --------------------------------------------------

def test_no_preemption_prints_no_readmit_rate(tmp_path, capsys):
    doc = tmp_path / "s.json"
    code, out, err = _run(capsys, "--suite", "--requests", "20", "--policy", "fcfs", "--mixed",
                          "--json", str(doc))
    assert code == 0, err
    lines = [line for line in out.splitlines() if not line.startswith("#")]
    row = dict(zip(lines[0].split("\t"), lines[1].split("\t")))
    assert row["preemptions"] == "0" and row["prefix_hit_rate_readmit"] == "-"
    run = json.loads(doc.read_text())["runs"][0]
    assert run["preemptions"] == 0 and run["prefix_hit_rate_readmit"] is None


def test_no_gap_prints_no_gap_percentiles(tmp_path, capsys):
    trace = _mooncake(tmp_path / "one.jsonl", [(i, 100, 1, None) for i in range(5)])
    doc = tmp_path / "r.json"
    code, out, err = _run(capsys, "--trace", trace, "--policy", "fcfs", "--tails",
                          "--json", str(doc))
    assert code == 0, err
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("policy "))
    cells = lines[header + 1].split()
    assert cells[0] == "fcfs" and cells[7:9] == ["-", "-"]  # gap p50, p99
    tails = next(i for i, line in enumerate(lines) if line.startswith("policy\t"))
    row = dict(zip(lines[tails].split("\t"), lines[tails + 1].split("\t")))
    assert [row[k] for k in ("p50_itl_ms", "p99_itl_ms", "max_itl_ms", "p99_max_itl_ms")] \
        == ["-"] * 4
    data = json.loads(doc.read_text())
    figures = data["policies"]["fcfs"]
    assert all(figures[f"p{p}_itl_ms"] is None for p in (50, 90, 99))
    assert figures["p99_max_itl_ms"] is None
    assert data["tails"][0]["max_itl_ms"] is None
    assert data["tails"][0]["max_itl_ms_by_group"] == {"all": None}


# -- 11. per-tenant service of a burst -------------------------------------------------------

def test_burst_tenant_service_is_over_the_whole_run(tmp_path, capsys):
    trace = _mooncake(tmp_path / "burst.jsonl",
                      [(0, 256, 16, f"t{i % 4}") for i in range(64)])
    doc = tmp_path / "r.json"
    code, out, err = _run(capsys, "--trace", trace, "--policy", "fcfs", "--json", str(doc))
    assert code == 0, err
    figures = json.loads(doc.read_text())["policies"]["fcfs"]
    rates = figures["tenant_service_tokens_per_s"]
    assert sorted(rates) == ["t0", "t1", "t2", "t3"]
    # every tenant sent the same work and all of it was served: equal rates over the run
    assert min(rates.values()) > 0
    assert min(rates.values()) == pytest.approx(max(rates.values()))
    assert figures["jain_index"] == pytest.approx(1.0)
    assert figures["tenant_service_window"] == "run"
    assert "# per-tenant service, tokens/s over the whole run (the trace arrived within " \
           "about one iteration)" in out
