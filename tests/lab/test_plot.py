"""--plot: PNGs are valid images with the expected number of series (needs matplotlib)."""
from __future__ import annotations

import pytest

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
    expected = {"ttft_cdf.png": "3", "batch_occupancy.png": "3,3", "queue_depth.png": "3"}
    for path in paths:
        with open(path, "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
        with Image.open(path) as image:
            image.verify()
        with Image.open(path) as image:
            assert image.size[0] > 300 and image.size[1] > 200
            assert image.text[SERIES_KEY] == expected[path.rsplit("/", 1)[1]]


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
