"""bench/host_cpu.py on the tiny model: `run` goes through, every step is timed on the
worker's clocks, and the decode call's share is inside the step's."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("llama_cpp")

import host_cpu  # noqa: E402


def test_host_cpu_times_the_steps_of_a_run(tmp_path, capsys):
    prompts, out = tmp_path / "prompts.json", tmp_path / "cpu.jsonl"
    assert host_cpu.main(["--write-prompts", str(prompts), "--count", "6"]) == 0
    assert len(json.loads(prompts.read_text())) == 6
    assert host_cpu.main(["--json", str(out), "--label", "tiny", "--", "--prompts",
                          str(prompts), "-n", "12", "-np", "6", "-t", "1",
                          "--inflight", "2"]) == 0
    result = json.loads(out.read_text())
    assert result["label"] == "tiny" and result["rows"] == 6
    assert result["steps"] >= 12 and result["decode_phase_steps"] >= 1
    assert 0 < result["decode_cpu_us"] <= result["execute_cpu_us"]
    assert result["outside_cpu_us"] > 0
    assert 0 < result["decode_wall_us"] <= result["execute_wall_us"]
    assert result["outside_wall_us"] > 0
    assert result["read_cpu_us"] == 0  # sampled on the host
    assert "6/6 completed" in capsys.readouterr().out


def test_host_cpu_times_the_device_reads_with_sampling_on_the_device(tmp_path):
    out = tmp_path / "cpu.jsonl"
    assert host_cpu.main(["--json", str(out), "--", "-n", "12", "-np", "6", "-t", "1",
                          "--inflight", "2", "-bs", "on"]) == 0
    result = json.loads(out.read_text())
    assert 0 < result["read_cpu_us"] <= result["outside_cpu_us"]
    assert 0 < result["read_wall_us"] <= result["outside_wall_us"]


@pytest.mark.parametrize("ahead", ["on", "off"])
def test_host_cpu_times_the_host_between_two_steps_staged_ahead_or_not(tmp_path, ahead):
    out = tmp_path / "cpu.jsonl"
    assert host_cpu.main(["--json", str(out), "--", "-n", "16", "-np", "6", "-t", "1",
                          "--inflight", "2", "--stage-ahead", ahead]) == 0
    result = json.loads(out.read_text())
    # Staged ahead, a step's decode is a launch and a wait, both counted as the decode's. A
    # plan is staged ahead only when the engine has queued it while the step before runs, which
    # on a busy machine it may not have: some steps, not necessarily all.
    if ahead == "on":
        assert 0 < result["staged_ahead_share"] <= 1
    else:
        assert result["staged_ahead_share"] == 0
    assert 0 < result["decode_cpu_us"] <= result["execute_cpu_us"]
    assert 0 < result["decode_wall_us"] <= result["execute_wall_us"]
    assert 0 < result["between_wall_us"] < result["execute_wall_us"]


def test_host_cpu_needs_the_run_arguments():
    with pytest.raises(SystemExit):
        host_cpu.main(["--json", "x.jsonl"])
