"""bench/gpu_rounds.py's `--merge` on what a run cut short leaves (a missing or empty file, a
line cut short at the end of a file or before the next run's first), runs of one server merged
with runs of both, a server skipped after it failed to start twice, and a run stopped by SIGINT
(also where it started with SIGINT ignored) or SIGTERM writing the table of what it measured,
and a stop whose KeyboardInterrupt Python printed as ignored still stopping it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import gpu_rounds
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "gpu_rounds.py")
OURS, THEIRS = gpu_rounds.OURS, gpu_rounds.THEIRS
COMMANDS = {OURS: ["python", "-m", "skippy_scheduler.cli", "serve"],
            THEIRS: ["llama-server", "-m", "m.gguf"]}


def run_line(date: str, *argv: str, servers: tuple[str, ...] = (OURS, THEIRS)) -> str:
    return json.dumps({"label": "run", "date": date,
                       "argv": ["python", "bench/gpu_rounds.py", "--model", "m.gguf",
                                "--concurrency", "1", *argv],
                       "commands": {s: COMMANDS[s] for s in servers},
                       "gpu_name": "Fake GPU", "llama_server_version": "version: 1 (abc)"})


def load(label: str, rate: float) -> str:
    return json.dumps({"label": label, "load": "closed c=1", "concurrency": 1, "requests": 8,
                       "completed": 8, "output_tokens_per_s": rate, "round": 1})


def merged(capsys, *paths) -> tuple[dict, str]:
    assert gpu_rounds.main(["--merge", *map(str, paths)]) == 0
    out, err = capsys.readouterr()
    row = json.loads(next(ln for ln in out.splitlines() if ln.startswith("{")))
    return row, err


def test_a_cut_last_line_a_missing_and_an_empty_file_are_skipped(tmp_path, capsys):
    a, empty, missing = tmp_path / "a.jsonl", tmp_path / "e.jsonl", tmp_path / "gone.jsonl"
    a.write_text("\n".join([run_line("d1"), load(OURS, 100), load(THEIRS, 50),
                            '{"label": "llama-ser']))
    empty.write_text("\n")
    row, err = merged(capsys, a, empty, missing)
    assert row["output_tokens_per_s"] == {OURS: 100, THEIRS: 50, "ratio": 2.0}
    assert f"{a}:4 is cut short" in err
    assert f"{empty} is empty, skipped" in err and f"no file {missing}, skipped" in err
    # With no run line left, the merge still fails.
    with pytest.raises(SystemExit, match="no run line"):
        gpu_rounds.main(["--merge", str(empty), str(missing)])


def test_a_line_cut_before_the_next_runs_first_is_skipped_and_others_fail(tmp_path, capsys):
    one = tmp_path / "one.jsonl"  # two runs appending to one file, the first stopped mid-line
    one.write_text("\n".join([run_line("d1"), load(OURS, 100), '{"label": "llama-se',
                              run_line("d2", "--servers", "theirs", servers=(THEIRS,)),
                              load(THEIRS, 40), load(THEIRS, 60)]) + "\n")
    row, err = merged(capsys, one)
    assert f"{one}:3 is cut short" in err
    # Runs of one server merge with runs of both: each server's medians over its own runs.
    assert row["merged"] == ["d1", "d2"]
    assert row["output_tokens_per_s"] == {OURS: 100, THEIRS: 50, "ratio": 2.0}
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([run_line("d1"), "not json", load(OURS, 100)]))
    with pytest.raises(SystemExit, match="bad.jsonl:2 is not JSON"):
        gpu_rounds.main(["--merge", str(bad)])


def test_a_server_that_does_not_start_twice_is_skipped(tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    out.write_text(run_line("d0") + "\n" + '{"label": "skippy-sch')  # an earlier run, cut
    missing = tmp_path / "no-such.gguf"
    rc = gpu_rounds.main(["--model", str(missing), "--servers", "ours", "--concurrency",
                          "1,2,3", "--rounds", "2", "--start-timeout", "60", "--json", str(out),
                          "--markdown", str(tmp_path / "t.md"), "--logs", str(tmp_path)])
    assert rc == 0
    err = capsys.readouterr().err
    assert f"# {OURS} did not start 2 times: skipped for the rest of the run" in err
    assert err.count("# round ") == 2  # not at c=3, nor in round 2
    lines = out.read_text().splitlines()
    assert lines[1] == '{"label": "skippy-sch'  # the cut line stays a line of its own
    loads = [json.loads(ln) for ln in lines[2:] if '"start_failed"' in ln
             and json.loads(ln)["label"] == OURS]
    assert len(loads) == 2 and all(r["start_failed"] for r in loads)
    assert "skipped for the rest of the run" in (tmp_path / "t.md").read_text()


@pytest.mark.parametrize("sig", ["SIGINT ignored at start", "SIGTERM"])
def test_a_stopped_run_writes_the_table_of_what_it_measured(tmp_path, model_path, sig):
    md = tmp_path / "t.md"
    ignore = sig.startswith("SIGINT")
    proc = subprocess.Popen(
        [sys.executable, SCRIPT, "--model", str(model_path), "--servers", "ours",
         "--concurrency", "1,2", "--rounds", "50", "--requests", "3", "--prompt-tokens", "24",
         "--shared-prefix", "16", "--max-tokens", "4", "--lanes", "2", "--ctx-size", "1024",
         "--start-timeout", "120", "--markdown", str(md), "--logs", str(tmp_path / "logs")],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=str(tmp_path),
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore else None)
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:  # stop it once a load has ended
        seen.append(line)
        if line.startswith("#   ") and "done" in line:
            break
    proc.send_signal(signal.SIGINT if ignore else signal.SIGTERM)
    rest = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, "".join(seen) + rest
    assert "# interrupted" in rest
    assert "interrupted: the rounds stopped" in md.read_text()


SWALLOWED = """
import os, signal, subprocess, sys
sys.path.insert(0, {bench!r})
import gpu_rounds
gpu_rounds.stoppable()
sent = []
def hook():  # a SIGINT that lands in a fork hook, where Python prints it as ignored
    if not sent:
        sent.append(1)
        os.kill(os.getpid(), signal.SIGINT)
os.register_at_fork(after_in_parent=hook)
subprocess.run([sys.executable, "-c", "pass"], preexec_fn=lambda: None)
print("went on", flush=True)
try:
    gpu_rounds.raise_if_stopped()
except KeyboardInterrupt:
    print("stopped", flush=True)
"""


def test_a_stop_python_printed_as_ignored_still_stops_the_rounds(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(SWALLOWED.format(bench=os.path.join(ROOT, "bench")))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60, cwd=str(tmp_path))
    assert "KeyboardInterrupt" in done.stderr and "ignored" in done.stderr, done.stderr
    assert done.stdout.splitlines() == ["went on", "stopped"], done.stdout + done.stderr
