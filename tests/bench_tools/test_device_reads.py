"""bench/device_reads.py on the tiny model: both measures run and report, and the decode step
reads the same tokens every time (the bench stops on a change)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("llama_cpp")

import device_reads  # noqa: E402


@pytest.mark.parametrize("what", ["read", "step"])
def test_device_reads_reports_each_busy_mode(tmp_path, capsys, what):
    out = tmp_path / "reads.jsonl"
    assert device_reads.main(["--what", what, "--rows", "4", "--reads", "5", "--gap-ms", "0",
                              "--busy", "none,cpu", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["what"] == what and result["rows"] == 4
    for mode in ("none", "cpu"):
        assert 0 < result[mode]["p50_us"] <= result[mode]["p99_us"]
    assert capsys.readouterr().out.count(f"{what} of 4 rows") == 2


def test_seeded_times_the_reads_only():
    with pytest.raises(SystemExit):
        device_reads.main(["--what", "step", "--seeded"])
