"""bench/gpu_rounds.py, smoked on the CPU: the tiny model at small sizes, this server alone
unless a llama-server is found, nvidia-smi replaced by a script that prints samples; the table
and the JSON lines come out well-formed. Its commands and the GPU model's size without
processes."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import stat
import sys
import time

import gpu_rounds
import pytest
from skippy_bench.loads import Result, chunks_within, decode_window

from skippy_scheduler.hosts.tiny_model import parameter_count, write_tiny_llama

FAKE_SMI = """#!/bin/sh
case "$1" in
  --query-gpu=name) echo "Fake GPU 141GB" ;;
  *) while true; do
       t=$(date +"%Y/%m/%d %H:%M:%S.%3N")
       echo "$t, 40, 1000"; echo "$t, 80, 3000"; echo "$t, [N/A], [N/A]"; sleep 0.1
     done ;;
esac
"""


def namespace(**kw) -> argparse.Namespace:
    args = gpu_rounds.build_parser().parse_args(["--model", "m.gguf", *kw.pop("argv", [])])
    args.ours_ngl, args.theirs_ngl = kw.pop("ours_ngl", None), kw.pop("theirs_ngl", "99")
    return args


def test_commands_carry_the_workload_flags():
    args = namespace()
    ours = gpu_rounds.ours_cmd(args)
    assert "-ngl" not in ours  # no value: not passed
    for flags in (["-np", "64"], ["-c", "65536"], ["--served-model-name", "bench"]):
        assert any(ours[i:i + len(flags)] == flags for i in range(len(ours)))
    assert gpu_rounds.ours_cmd(namespace(ours_ngl="all"))[-2:] == ["-ngl", "all"]
    theirs = gpu_rounds.theirs_cmd(namespace(argv=["--theirs-args", "-fa on"]), "llama-server")
    for flags in (["-ngl", "99"], ["-b", "2048"], ["-ub", "512"], ["-ctk", "f16"],
                  ["-ctv", "f16"], ["-a", "bench"], ["-cb"], ["--no-webui"]):
        assert any(theirs[i:i + len(flags)] == flags for i in range(len(theirs)))
    assert theirs[-2:] == ["-fa", "on"]  # after the default, so it wins
    assert [gpu_rounds.requests_at(args, c) for c in (1, 16, 64)] == [8, 64, 256]


def test_a_lane_must_hold_the_prompt_and_its_output(capsys):
    with pytest.raises(SystemExit) as exc:  # 65536 / 64 = 1024 < 512 + 600
        gpu_rounds.main(["--model", "m.gguf", "--servers", "ours", "--decode-tokens", "600"])
    assert exc.value.code == 2
    assert "a lane holds 1024 tokens" in capsys.readouterr().err


def test_a_missing_llama_server_is_named(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    with pytest.raises(SystemExit) as exc:
        gpu_rounds.main(["--model", "m.gguf"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--llama-server" in err and "$LLAMA_SERVER" in err


def test_gpu_samples_and_their_absence():
    assert gpu_rounds.parse_smi("10, 500\n30, 700\n[N/A], [N/A]\n5") == {
        "gpu_samples": 2, "gpu_util_mean_pct": 20.0, "gpu_util_max_pct": 30.0,
        "gpu_mem_max_mib": 700.0}
    none = gpu_rounds.GpuSampler(None).stop()
    assert none["gpu_samples"] == 0 and none["gpu_util_mean_pct"] is None


def test_samples_in_a_window_count_when_their_whole_period_is_in_it():
    offset = time.time() - time.perf_counter()
    now = datetime.datetime.now()

    def line(after_s: float, util: int) -> str:
        at = now + datetime.timedelta(seconds=after_s)
        return f"{at.strftime('%Y/%m/%d %H:%M:%S.%f')[:-3]}, {util}, 100"

    text = "\n".join([line(0.0, 10), line(0.5, 20), line(1.0, 90), line(1.5, 70),
                      line(2.0, 50), "garbage, 1, 2", "1, 2, 3"])
    t0 = now.timestamp() - offset  # the first sample's time on perf_counter's clock
    # Counted: the samples taken at least SMI_AVERAGED_S (1 s) into the window, up to its end.
    got = gpu_rounds.parse_smi(text, offset, window=(t0 + 0.45, t0 + 2.05))
    assert got["gpu_samples"] == 5 and got["gpu_util_max_pct"] == 90
    assert got["gpu_decode_samples"] == 2 and got["gpu_util_decode_pct"] == 60.0
    empty = gpu_rounds.parse_smi(text, offset, window=(t0 + 0.1, t0 + 1.0))
    assert empty["gpu_decode_samples"] == 0 and empty["gpu_util_decode_pct"] is None
    # Without timestamps (an older query) no sample is placed in a window.
    assert gpu_rounds.parse_smi("10, 1\n20, 2", window=(0, 1e12))["gpu_decode_samples"] == 0


def test_the_decode_window_of_one_wave():
    a = Result(ok=True, sent=0.0, first=1.0, end=4.0, gaps=[1.0, 1.0, 1.0])  # 1, 2, 3, 4
    b = Result(ok=True, sent=0.0, first=2.5, end=5.0, gaps=[1.0, 1.5])  # 2.5, 3.5, 5
    assert decode_window([a, b]) == (2.5, 4.0)
    assert chunks_within([a, b], 2.5, 4.0) == 3  # a at 3 and 4, b at 3.5
    assert decode_window([a, Result(ok=False)]) is None  # a failed request: no window
    late = Result(ok=True, sent=0.0, first=4.5, end=6.0)
    assert decode_window([a, late]) is None  # a finished before the other started
    # A stream whose last token came before the other's first is not decoding beside it, even
    # when its end (the stream's close) came later.
    short = Result(ok=True, sent=0.0, first=1.0, end=3.0, gaps=[0.5])  # tokens at 1, 1.5
    assert decode_window([short, Result(ok=True, first=2.0, end=4.0, gaps=[1.0])]) is None


def test_a_server_that_does_not_start_is_a_failed_load_and_the_rounds_go_on(tmp_path, capsys):
    md, out = tmp_path / "t.md", tmp_path / "r.jsonl"
    broken = [sys.executable, "-c", "import sys; print('no such model', file=sys.stderr); "
              "sys.exit(3)"]
    args = namespace(argv=["--start-timeout", "30", "--concurrency", "1,2"])
    results = [gpu_rounds.measure(args, broken, gpu_rounds.OURS, c, str(tmp_path),
                                  lambda: gpu_rounds.GpuSampler(None)) for c in (1, 2)]
    for c, r in zip((1, 2), results):
        assert r["load"] == f"closed c={c}" and r["completed"] == 0
        assert "did not start" in r["error"] and "no such model" in r["error"]
    runs = {"closed c=1": {gpu_rounds.OURS: [results[0]]},
            "closed c=2": {gpu_rounds.OURS: [results[1]]}}
    rows = gpu_rounds.summarize(runs, {}, {"date": "d"})
    assert [r["failed"] for r in rows] == [1, 1]
    assert rows[0]["output_tokens_per_s"][gpu_rounds.OURS] is None
    args.decode_tokens = 0
    text = gpu_rounds.markdown(rows, {"date": "d"}, args, [(gpu_rounds.OURS, broken)])
    assert "2 load(s) failed" in text and "| 1 | 8 | output tok/s | n/a |" in text


def _run_line(date: str, *argv: str) -> dict:
    return {"label": "run", "date": date, "argv": ["python", "bench/gpu_rounds.py",
                                                   "--model", "m.gguf", *argv],
            "commands": {gpu_rounds.OURS: ["python", "-m", "skippy_scheduler.cli", "serve"],
                         gpu_rounds.THEIRS: ["llama-server", "-m", "m.gguf"]},
            "gpu_name": "Fake GPU", "llama_server_version": "version: 1 (abc)"}


def _load(label: str, rate: float, rnd: int) -> dict:
    return {"label": label, "load": "closed c=1", "concurrency": 1, "requests": 8,
            "completed": 8, "output_tokens_per_s": rate, "round": rnd}


def test_merge_takes_the_medians_of_several_runs(tmp_path, capsys):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    ours, theirs = gpu_rounds.OURS, gpu_rounds.THEIRS
    a.write_text("\n".join(json.dumps(r) for r in [
        _run_line("d1", "--concurrency", "1"), _load(ours, 100, 1), _load(theirs, 50, 1),
        {"label": "equal", "load": "closed c=1", "round": 1, "equal": 8, "compared": 8},
        _load(ours, 120, 2), _load(theirs, 60, 2),
        {"label": "equal", "load": "closed c=1", "round": 2, "equal": 7, "compared": 8}]))
    b.write_text("\n".join(json.dumps(r) for r in [
        _run_line("d2", "--concurrency", "1", "--rounds", "1"), _load(ours, 200, 1),
        _load(theirs, 40, 1), {"label": "equal", "load": "closed c=1", "round": 1,
                               "equal": 8, "compared": 8}]) + "\n")
    md, out = tmp_path / "t.md", tmp_path / "m.jsonl"
    assert gpu_rounds.main(["--merge", str(a), str(b), "--markdown", str(md),
                            "--json", str(out)]) == 0
    (row,) = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert row["rounds"] == 3 and row["merged"] == ["d1", "d2"]
    assert row["output_tokens_per_s"] == {ours: 120, theirs: 50, "ratio": 2.4}
    assert (row["equal_outputs"], row["compared_outputs"]) == (23, 24)
    table = md.read_text()
    assert "d1, d2" in table and "medians of 3 alternating rounds" in table
    assert "| 1 | 8 | output tok/s | 120 | 50 | 2.4 |" in table
    assert "| 1 | 8 | equal greedy outputs | 23 of 24 | | |" in table
    # Another workload is refused, naming what differs.
    c = tmp_path / "c.jsonl"
    c.write_text(json.dumps(_run_line("d3", "--concurrency", "1", "--max-tokens", "32")))
    with pytest.raises(SystemExit, match="differs .* in --max-tokens"):
        gpu_rounds.main(["--merge", str(a), str(c)])
    loads_only = tmp_path / "d.jsonl"
    loads_only.write_text(json.dumps(_load(ours, 1, 1)))
    with pytest.raises(SystemExit, match="no run line"):
        gpu_rounds.main(["--merge", str(loads_only)])
    with pytest.raises(SystemExit, match="t.md:1 is not JSON"):
        gpu_rounds.main(["--merge", str(md)])


def test_a_load_without_a_value_does_not_spoil_the_median():
    nan = float("nan")
    rows = [{"x": 2.0}, {"x": nan}, {"x": None}, {}, {"x": 4.0}]
    assert gpu_rounds.median_of(rows, "x") == 3.0
    assert gpu_rounds.median_of([{"x": nan}], "x") is None


def test_the_gpu_model_has_085_b_parameters():
    assert round(parameter_count(gpu_rounds.gpu_model_shape()) / 1e9, 2) == 0.85


def test_smoke_run_writes_the_table_and_json_lines(tmp_path, monkeypatch, capsys):
    write_tiny_llama(tmp_path / "tiny.gguf", seed=5)
    monkeypatch.chdir(tmp_path)  # the model given relative, as the table shows it
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(FAKE_SMI)
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{smi.parent}{os.pathsep}{os.environ['PATH']}")
    both = gpu_rounds.find_llama_server(None) is not None
    md, out = tmp_path / "table.md", tmp_path / "rounds.jsonl"
    assert gpu_rounds.main([
        "--model", "tiny.gguf", "--servers", "both" if both else "ours", "--rounds", "2",
        "--concurrency", "1,2", "--requests", "3", "--prompt-tokens", "24",
        "--shared-prefix", "16", "--max-tokens", "4", "--lanes", "2", "--ctx-size", "1024",
        "--threads", "1", "--start-timeout", "120", "--load-timeout", "300",
        "--decode-tokens", "6", "--markdown", str(md), "--json", str(out)]) == 0
    servers = [gpu_rounds.OURS] + ([gpu_rounds.THEIRS] if both else [])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    run = rows[0]
    assert run["label"] == "run" and run["gpu_name"] == "Fake GPU 141GB"
    assert set(run["commands"]) == set(servers) and run["date"]
    # -ngl all where this serve has --n-gpu-layers, nothing where it has not
    assert ("-ngl" in run["commands"][gpu_rounds.OURS]) == gpu_rounds.serve_has_ngl()
    decodes = [r for r in rows if r["label"] in servers and r["load"] == "decode c=2"]
    loads = [r for r in rows if r["label"] in servers and r["load"].startswith("closed")]
    assert sorted((r["label"], r["concurrency"], r["round"]) for r in loads) == sorted(
        (s, c, n) for s in servers for c in (1, 2) for n in (1, 2))
    assert sorted((r["label"], r["round"]) for r in decodes) == sorted(
        (s, n) for s in servers for n in (1, 2))
    for r in decodes:  # one wave of 2 requests of 6 tokens
        assert r["completed"] == 2 and r["output_tokens"] == 12 and "error" not in r
        if r["decode_phase_s"] is not None:  # both decoding at once for a while
            assert r["decode_tokens_per_s"] > 0 and r["gpu_decode_samples"] >= 0
    for r in loads:
        assert r["completed"] == 3 and "outputs" not in r and r["output_tokens"] == 12
        assert r["gpu_samples"] >= 1 and r["gpu_util_max_pct"] == 80.0
        if r["label"] == gpu_rounds.OURS:  # its step histogram over the load
            assert r["steps"] >= 4 and r["step_wall_ms"] > 0 and r["step_execute_ms"] > 0
            assert r["step_engine_ms"] > 0 and r["step_wait_ms"] >= 0
            assert r["step_execute_ms"] + r["step_engine_ms"] <= r["step_wall_ms"] * 1.05
            assert 0 < r["host_busy_pct"] <= 100
            assert r["staged_ahead_pct"] == 0  # on the CPU `auto` stages nothing ahead
            # and so counts no plan as not staged ahead either
            assert r["not_staged_new_rows_pct"] == r["not_staged_not_queued_pct"] == 0
            assert r["step_gc_ms"] >= 0
        else:  # llama-server has none
            assert r["steps"] is None and r["host_busy_pct"] is None
            assert r["staged_ahead_pct"] is None and r["step_gc_ms"] is None
            assert r["not_staged_new_rows_pct"] is None
    medians = {r["concurrency"]: r for r in rows
               if r["label"] == "medians" and r["load"].startswith("closed")}
    assert set(medians) == {1, 2}
    assert [r["load"] for r in rows if r["label"] == "medians"][-1] == "decode c=2"
    for c, row in medians.items():
        assert row["rounds"] == 2 and row["requests"] == 3
        values = sorted(r["output_tokens_per_s"] for r in loads
                        if r["concurrency"] == c and r["label"] == gpu_rounds.OURS)
        assert row["output_tokens_per_s"][gpu_rounds.OURS] == sum(values) / 2
        assert row["gpu_util_max_pct"][gpu_rounds.OURS] == 80.0
        assert row["llama_server_version"] == run["llama_server_version"]
        if both:
            assert row["compared_outputs"] == 6 and 0 <= row["equal_outputs"] <= 6
        else:
            assert row["output_tokens_per_s"]["ratio"] is None and "equal_outputs" not in row
    table = md.read_text()
    assert table in capsys.readouterr().out
    lines = table.splitlines()
    assert "GPU: Fake GPU 141GB" in table and "serve -m tiny.gguf" in table
    assert str(tmp_path) not in table and os.sep + "python" not in table
    head = lines.index(next(ln for ln in lines if ln.startswith("| concurrency |")))
    body = [ln for ln in lines[head + 2:] if ln.startswith("|")]
    assert len(body) == 2 * (len(gpu_rounds.MEASURES) + both) + \
        len(gpu_rounds.DECODE_MEASURES) + both
    assert any(ln.startswith("| 2, decode | 2 | decode phase: GPU util mean % |") for ln in body)
    # The run's JSON lines make the same table again (--merge, as for several runs).
    again = tmp_path / "again.md"
    assert gpu_rounds.main(["--merge", str(out), "--markdown", str(again)]) == 0
    assert again.read_text() == table
    assert any(ln.startswith("| 1 | 3 | step ms in the model |") for ln in body)
    assert all(ln.count("|") == 7 for ln in lines[head:head + 2] + body)
    assert any(ln.startswith("| 2 | 3 | GPU util max % | 80 |") for ln in body)


def test_a_process_standing_in_for_the_gpu_reports_its_cpu_share():
    """--device-pid: a process that computes (an RPC server lending a CPU) is the GPU, its CPU
    time share the utilisation; one that waits is idle."""
    import subprocess
    import time

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        samplers = [gpu_rounds.ProcSampler(p.pid) for p in (busy, idle)]
        time.sleep(1.6)
        now = time.perf_counter()
        hot, cold = (s.stop((now - 1.5, now)) for s in samplers)
    finally:
        for p in (busy, idle):
            p.kill()
            p.wait()
    assert hot["gpu_samples"] >= 4 and cold["gpu_samples"] >= 4
    assert hot["gpu_util_mean_pct"] > 40 > cold["gpu_util_mean_pct"]
    assert hot["gpu_mem_max_mib"] > 1
    # The samples at least SMI_AVERAGED_S into the window count for the decode phase.
    assert hot["gpu_decode_samples"] >= 1
    # A process that is gone ends the sampling with what was taken.
    gone = gpu_rounds.ProcSampler(busy.pid)
    assert gone.stop()["gpu_samples"] == 0
