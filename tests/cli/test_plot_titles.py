"""`lab --plot`: every figure's title names the run (trace and time scale, or the workload), and
every legend sits beside its panel, where it cannot cover a peak."""
from __future__ import annotations

import pytest

from lab_support import capture_figures

from skippy_scheduler.cli import main


def test_trace_plots_name_the_trace_and_time_scale(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    seen = capture_figures(monkeypatch)
    trace = tmp_path / "small.jsonl"
    trace.write_text("".join(f'{{"timestamp": {k * 50}, "input_length": 600, '
                             f'"output_length": 5, "hash_ids": [{k % 3}, {100 + k}]}}\n'
                             for k in range(30)))
    assert main(["lab", "--trace", str(trace), "--time-scale", "0.5", "--policy", "fcfs",
                 "--policy", "priority", "--plot", str(tmp_path / "plots")]) == 0
    capsys.readouterr()
    assert set(seen) == {"trace_ttft_cdf.png", "trace_hit_rate.png", "trace_queue_depth.png"}
    for name, figure in seen.items():
        titles, legends = figure["titles"], figure["legend_x0"]
        assert "trace small.jsonl, time scale 0.5" in titles, (name, titles)
        assert legends and all(x0 > 1.0 for x0 in legends), (name, legends)


def test_suite_plots_name_the_workload(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    seen = capture_figures(monkeypatch)
    assert main(["lab", "--suite", "--requests", "80", "--seed", "3", "--policy", "fcfs",
                 "--plot", str(tmp_path / "plots")]) == 0
    capsys.readouterr()
    assert set(seen) == {"ttft_cdf.png", "batch_occupancy.png", "queue_depth.png"}
    for name, figure in seen.items():
        titles, legends = figure["titles"], figure["legend_x0"]
        assert "suite: 80 requests at 360/s, seed 3" in titles, (name, titles)
        assert legends and all(x0 > 1.0 for x0 in legends), (name, legends)
