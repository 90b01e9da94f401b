"""`lab --plot`: every figure's title names the run (trace and time scale, or the workload), and
every legend sits beside its panel, where it cannot cover a peak."""
from __future__ import annotations

import pytest

from skippy_scheduler.cli import main


def _figures(monkeypatch):
    """Record each figure's texts and legend placements as the plots are saved."""
    from skippy_scheduler.lab import plot

    seen = {}
    real_save = plot._save

    def save(fig, path, series):
        fig.canvas.draw()
        titles = [t.get_text() for t in fig.texts]
        titles += [ax.get_title() for ax in fig.axes]
        legends = []
        for ax in fig.axes:
            legend = ax.get_legend()
            if legend is not None:
                box = legend.get_window_extent().transformed(ax.transAxes.inverted())
                legends.append(box.x0)
        seen[path.rsplit("/", 1)[1]] = (" | ".join(titles), legends)
        return real_save(fig, path, series)

    monkeypatch.setattr(plot, "_save", save)
    return seen


def test_trace_plots_name_the_trace_and_time_scale(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    seen = _figures(monkeypatch)
    trace = tmp_path / "small.jsonl"
    trace.write_text("".join(f'{{"timestamp": {k * 50}, "input_length": 600, '
                             f'"output_length": 5, "hash_ids": [{k % 3}, {100 + k}]}}\n'
                             for k in range(30)))
    assert main(["lab", "--trace", str(trace), "--time-scale", "0.5", "--policy", "fcfs",
                 "--policy", "priority", "--plot", str(tmp_path / "plots")]) == 0
    capsys.readouterr()
    assert set(seen) == {"trace_ttft_cdf.png", "trace_hit_rate.png", "trace_queue_depth.png"}
    for name, (titles, legends) in seen.items():
        assert "trace small.jsonl, time scale 0.5" in titles, (name, titles)
        assert legends and all(x0 > 1.0 for x0 in legends), (name, legends)


def test_suite_plots_name_the_workload(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    seen = _figures(monkeypatch)
    assert main(["lab", "--suite", "--requests", "80", "--seed", "3", "--policy", "fcfs",
                 "--plot", str(tmp_path / "plots")]) == 0
    capsys.readouterr()
    assert set(seen) == {"ttft_cdf.png", "batch_occupancy.png", "queue_depth.png"}
    for name, (titles, legends) in seen.items():
        assert "suite: 80 requests at 360/s, seed 3" in titles, (name, titles)
        assert legends and all(x0 > 1.0 for x0 in legends), (name, legends)
