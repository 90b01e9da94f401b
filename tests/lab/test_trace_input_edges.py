"""Trace files at the edges of their formats: blank lines before the first row, JSON nested
deeper or numbers longer than Python reads, and the ids a BurstGPT trace's skipped failures
leave (which `--requests-out` must name as the trace does)."""
from __future__ import annotations

import json
import signal

import pytest

from skippy_scheduler.cli import main
from skippy_scheduler.lab.traces import TraceFormatError, open_trace, tenant_of_id

ROW = '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [0]}\n'


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("name, text, fmt, lines", [
    ("m.jsonl", "\n  \n" + ROW, "mooncake", [3]),
    ("a.csv", "\r\n\r\nTIMESTAMP,ContextTokens,GeneratedTokens\r\n"
              "2023-11-16 18:17:03.97,12,3\r\n", "azure", [4]),
    ("b.csv", "\n\nTimestamp,Request tokens,Response tokens\n1,10,2\n\n2,5,0\n3,5,4\n",
     "burstgpt", [4, 7]),
])
def test_blank_lines_before_the_first_row_are_skipped(tmp_path, name, text, fmt, lines):
    path = write(tmp_path, name, text)
    trace = open_trace(path)  # auto-detected, not "an empty trace file"
    assert trace.format == fmt
    assert [r.line for r in trace] == lines


def test_a_malformed_row_after_a_blank_header_line_names_its_own_line(tmp_path):
    path = write(tmp_path, "b.csv", "\nTimestamp,Request tokens,Response tokens\n1,x,2\n")
    with pytest.raises(TraceFormatError) as info:
        list(open_trace(path))
    assert str(info.value).startswith(f"{path}:3: Request tokens: ")


@pytest.mark.parametrize("text, problem", [
    ("[" * 100_000 + "\n", "nested too deeply"),
    ('{"a": ' * 100_000 + "\n", "nested too deeply"),
    ('{"timestamp": 0, "input_length": ' + "1" * 5000 + ', "output_length": 2, '
     '"hash_ids": [0]}\n', "4300 digits"),
])
def test_json_the_reader_cannot_take_is_a_format_error_with_file_and_line(tmp_path, text,
                                                                        problem):
    path = write(tmp_path, "m.jsonl", ROW + text)
    with pytest.raises(TraceFormatError) as info:
        list(open_trace(path, format="mooncake"))
    assert str(info.value).startswith(f"{path}:2: json: not a JSON object")
    assert problem in str(info.value)


def test_a_timestamp_past_a_double_is_a_format_error(tmp_path):
    row = json.dumps({"timestamp": 10 ** 400, "input_length": 10, "output_length": 2,
                      "hash_ids": [0]})
    path = write(tmp_path, "m.jsonl", ROW + row + "\n")
    with pytest.raises(TraceFormatError, match=r":2: timestamp: expected a number"):
        list(open_trace(path, format="mooncake"))


def test_the_lab_reports_deep_json_as_one_line(tmp_path, capsys):
    path = write(tmp_path, "m.jsonl", ROW + '{"a": ' * 100_000 + "\n")
    assert main(["lab", "--trace", path]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (f"skippy-scheduler lab: error: {path}:2: json: not a JSON "
                                    "object (nested too deeply)")


BURST = ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
         "0,ChatGPT,10,0,10,Conversation log\n"  # r0: a failure, skipped
         "1,ChatGPT,700,5,705,Conversation log\n"
         "2,ChatGPT,20,7,27,API log\n"
         "3,ChatGPT,20,0,20,API log\n"  # r3: a failure, skipped
         "4,ChatGPT,30,3,33,API log\n")


def test_requests_out_names_each_request_as_the_trace_does(tmp_path, capsys):
    path = write(tmp_path, "b.csv", BURST)
    expected = [r.id for r in open_trace(path)]
    assert expected == ["r1", "r2", "r4"]
    lines = tmp_path / "requests.jsonl"
    assert main(["lab", "--trace", path, "--policy", "fcfs", "--tenants", "3",
                 "--requests-out", str(lines)]) == 0
    capsys.readouterr()
    rows = [json.loads(line) for line in lines.read_text().splitlines()]
    assert [r["id"] for r in rows] == expected
    # --tenants hashes the same ids: each row's tenant is its id's.
    assert [r["tenant"] for r in rows] == [tenant_of_id(i, 3) for i in expected]


def test_the_suite_clears_its_progress_bar_when_interrupted(monkeypatch, capsys):
    from skippy_scheduler.cli.interrupt import Interrupted
    from skippy_scheduler.lab import suite
    from skippy_scheduler.lab.progress import Progress
    from skippy_scheduler.lab.workload import WorkloadSpec, generate

    class Shown(Progress):  # on a terminal, and at once
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "enabled": True, "delay_s": 0.0})

    def stopped(*args, progress, **kwargs):
        progress(3)
        raise Interrupted(signal.SIGINT)

    monkeypatch.setattr(suite, "Progress", Shown)
    monkeypatch.setattr(suite, "drive", stopped)
    with pytest.raises(Interrupted):
        suite.run_policy(generate(WorkloadSpec(requests=10)), "fcfs", "mixed", progress=True)
    err = capsys.readouterr().err
    assert "fcfs/mixed [" in err  # it was shown ...
    assert err.endswith("\r") and err.rsplit("\r", 2)[1].strip() == ""  # ... and cleared
