"""--plot: PNGs are valid images with the expected panels and lines (needs matplotlib)."""
from __future__ import annotations

import numpy as np
import pytest

from lab_support import capture_figures

from skippy_scheduler.lab.suite import SuiteOptions, run_policy
from skippy_scheduler.lab.workload import WorkloadSpec, generate


def test_plots_are_valid_pngs_with_one_series_per_run(tmp_path, backend):
    pytest.importorskip("matplotlib")
    from PIL import Image

    from skippy_scheduler.lab.plot import SERIES_KEY, plot_suite

    w = generate(WorkloadSpec(requests=150, seed=2, rate=800.0, families=4))
    options = SuiteOptions(max_active=8, record_series=True)
    runs = [run_policy(w, p, "phase", options, backend=backend) for p in ("fcfs", "priority")]
    runs.append(run_policy(w, "fcfs", "mixed", options, backend=backend))
    paths = plot_suite(runs, str(tmp_path / "plots"))
    names = sorted(p.rsplit("/", 1)[1] for p in paths)
    assert names == ["batch_occupancy.png", "queue_depth.png", "ttft_cdf.png"]
    # TTFT and batching: one column per mode, its policies as lines; queue depth: one panel
    # per run.
    expected = {"ttft_cdf.png": "2,1", "batch_occupancy.png": "2,1,2,1",
                "queue_depth.png": "1,1,1"}
    for path in paths:
        with open(path, "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
        with Image.open(path) as image:
            image.verify()
        with Image.open(path) as image:
            assert image.size[0] > 300 and image.size[1] > 200
            assert image.text[SERIES_KEY] == expected[path.rsplit("/", 1)[1]]


def test_binned_queue_depth_is_whole_requests():
    from skippy_scheduler.lab.plot import bin_width, binned_max

    assert [bin_width(x) for x in (1.0, 100.0, 3_537.0, 0.0)] == [0.005, 0.5, 20.0, 1.0]
    t = np.array([0.1, 0.2, 0.9, 2.5])
    start, depth = binned_max(t, np.array([3, 1, 2, 7]), 1.0)
    assert start.tolist() == [0.0, 1.0, 2.0] and depth.tolist() == [3.0, 0.0, 7.0]


def test_trace_plots(tmp_path, backend):
    pytest.importorskip("matplotlib")
    from PIL import Image

    from skippy_scheduler.lab.plot import SERIES_KEY, plot_trace
    from skippy_scheduler.lab.replay import ReplayOptions, run_replay
    from skippy_scheduler.lab.traces import open_trace

    path = tmp_path / "t.jsonl"
    rows = []
    for k in range(60):
        ids = [0, 1 + k % 5] + [100 + k]
        rows.append(f'{{"timestamp": {k * 20}, "input_length": 1500, "output_length": '
                    f'{4 + k % 7}, "hash_ids": {ids}}}')
    path.write_text("\n".join(rows) + "\n")
    trace = open_trace(str(path), time_scale=0.05)
    options = ReplayOptions(max_active=4, prefix_cache_tokens=4_096, record_series=True)
    runs = [run_replay(trace, p, options=options, backend=backend, progress=False)
            for p in ("fcfs", "cache-aware-aging")]
    paths = plot_trace(runs, str(tmp_path / "plots"))
    expected = {"trace_ttft_cdf.png": "2", "trace_hit_rate.png": "2",
                "trace_queue_depth.png": "1,1"}
    assert sorted(p.rsplit("/", 1)[1] for p in paths) == sorted(expected)
    for p in paths:
        with Image.open(p) as image:
            assert image.text[SERIES_KEY] == expected[p.rsplit("/", 1)[1]]


def test_plot_option_without_matplotlib_explains_the_install(monkeypatch, capsys):
    import builtins

    from skippy_scheduler.cli import main

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert main(["lab", "--suite", "--requests", "100", "--plot", "out"]) == 2
    assert "pip install '.[plot]'" in capsys.readouterr().err


def test_progress_bar_only_on_a_terminal_after_the_delay():
    import io

    from skippy_scheduler.lab.progress import Progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    quiet = io.StringIO()
    p = Progress(10, "x", stream=quiet, delay_s=0.0)
    p.update(5)
    p.close()
    assert quiet.getvalue() == ""
    tty = Tty()
    p = Progress(10, "run", stream=tty, delay_s=0.0)
    p.update(5)
    assert "run [" in tty.getvalue() and "5/10" in tty.getvalue()
    p.close()
    late = Tty()
    p = Progress(10, "run", stream=late, delay_s=60.0)
    p.update(5)
    assert late.getvalue() == ""


def test_binned_ratio_breaks_the_line_at_empty_bins():
    from skippy_scheduler.lab.plot import binned_ratio

    t = np.array([0.1, 0.2, 2.5, 4.1])
    start, rate = binned_ratio(t, np.array([1, 1, 0, 5]), np.array([2, 2, 0, 10]), 1.0)
    assert start.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert rate[0] == 0.5 and rate[4] == 0.5 and np.isnan(rate[1:4]).all()


def test_sparse_series_get_bins_wide_enough_to_hold_them():
    from skippy_scheduler.lab.plot import bin_width, sparse_bin_width

    grid = np.arange(0.0, 60.0, 3.0)  # admissions on a 3 s grid, as Mooncake's arrivals
    assert bin_width(60.0, 120) == 0.5
    width = sparse_bin_width([grid], 60.0, 120)
    assert width == 5.0  # 1 and 2 s leave a third or more of the bins empty; 5 s none
    dense = np.arange(0.0, 60.0, 0.1)
    assert sparse_bin_width([dense, grid[:1]], 60.0, 120) == 0.5  # one sample: no empty bin


def test_suite_panels_share_axes_and_one_legend(tmp_path, monkeypatch, backend):
    pytest.importorskip("matplotlib")
    from skippy_scheduler.lab.plot import plot_suite

    seen = capture_figures(monkeypatch)
    w = generate(WorkloadSpec(requests=120, seed=2, rate=800.0, families=4))
    options = SuiteOptions(max_active=8, record_series=True)
    runs = [run_policy(w, p, m, options, backend=backend)
            for m in ("phase", "mixed") for p in ("fcfs", "priority")]
    plot_suite(runs, str(tmp_path / "plots"))
    ttft = seen["ttft_cdf.png"]
    left, right = ttft["axes"]
    assert left.get_shared_x_axes().joined(left, right)
    assert left.get_shared_y_axes().joined(left, right)
    assert ttft["legends"] == [right]
    assert [t.get_text() for t in right.get_legend().get_texts()] == ["fcfs", "priority"]
    batch = seen["batch_occupancy.png"]
    top_left, top_right, bottom_left, bottom_right = batch["axes"]
    assert top_left.get_shared_y_axes().joined(top_left, top_right)
    assert bottom_left.get_shared_y_axes().joined(bottom_left, bottom_right)
    assert batch["legends"] == [top_right]
    # Queue depth: the deepest queue stays below the top of the frame.
    queue = seen["queue_depth.png"]
    deepest = max(float(np.max(y)) for lines in queue["lines"] for y in lines if len(y))
    assert all(top > deepest for _, top in queue["ylim"])


def test_trace_plots_name_limit_and_tenants_and_leave_headroom(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    from skippy_scheduler.cli import main

    seen = capture_figures(monkeypatch)
    trace = tmp_path / "small.jsonl"
    trace.write_text("".join(f'{{"timestamp": {(k // 6) * 400}, "input_length": 1500, '
                             f'"output_length": 5, "hash_ids": [0, {k % 4}, {100 + k}]}}\n'
                             for k in range(48)))
    assert main(["lab", "--trace", str(trace), "--time-scale", "0.5", "--limit", "40",
                 "--tenants", "3", "--policy", "fcfs", "--policy", "priority",
                 "--max-active", "2", "--plot", str(tmp_path / "plots")]) == 0
    capsys.readouterr()
    for name, figure in seen.items():
        assert ("trace small.jsonl, time scale 0.5, first 40 requests, 3 hashed tenants"
                in figure["titles"]), (name, figure["titles"])
    queue = seen["trace_queue_depth.png"]
    deepest = max(float(np.max(y)) for lines in queue["lines"] for y in lines if len(y))
    assert deepest >= 2 and all(top > deepest for _, top in queue["ylim"])
    # Arrivals come in 7 bursts 0.2 s apart: the bins are no narrower than the admissions
    # allow, so most bins hold some (an empty one is a gap, NaN: test_binned_ratio_...).
    hit = seen["trace_hit_rate.png"]["lines"][0]
    for y in hit:
        rate = np.asarray(y, dtype=float)
        assert np.isnan(rate).sum() < len(rate) / 2, rate
        assert ((rate[~np.isnan(rate)] >= 0) & (rate[~np.isnan(rate)] <= 100)).all()
