"""The end of a command that writes results: a signal after the work is done, an output that
cannot be written after all, an output a plot would overwrite, and inputs or flags that used to
end in a traceback or a crash.

Signals are real ones, sent to this process (`os.kill`) from a wrapper around a step of the
command's end; outputs that fail are /dev/full or a writer made to fail half-way.
"""
from __future__ import annotations

import errno
import json
import os
import signal

import pytest

from skippy_scheduler.cli import main

SIGNALS = [signal.SIGINT, signal.SIGTERM]
FULL = "/dev/full"
needs_full = pytest.mark.skipif(not os.path.exists(FULL), reason="needs /dev/full")
MOONCAKE = "".join(
    json.dumps({"timestamp": 5 * k, "input_length": 600 + 40 * k, "output_length": 3 + k % 4,
                "hash_ids": [k % 3, 10 + k]}) + "\n" for k in range(6))


@pytest.fixture
def trace(tmp_path) -> str:
    path = tmp_path / "t.jsonl"
    path.write_text(MOONCAKE)
    return str(path)


def _signalled(monkeypatch, module, name, sig, *, after=False):
    """`module.name` sends `sig` to this process as it is called (`after`: once it returned,
    its result in hand)."""
    real = getattr(module, name)

    def signalled(*args, **kwargs):
        if not after:
            os.kill(os.getpid(), sig)
        result = real(*args, **kwargs)
        if after:
            os.kill(os.getpid(), sig)
        return result

    monkeypatch.setattr(module, name, signalled)


def _interrupt_line(err: str, sig) -> str:
    lines = err.splitlines()
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(f"skippy-scheduler lab: interrupted by {signal.Signals(sig).name}: ")
    return lines[0]


def _error_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert lines[-2].startswith("usage: "), err
    return lines[-1]


# -- a signal once the last run finished: the outputs are whole -------------------------------


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_a_signal_while_the_suite_prints_and_writes_is_ignored(tmp_path, capsys, monkeypatch,
                                                               sig):
    from skippy_scheduler.cli import lab_runs

    _signalled(monkeypatch, lab_runs, "format_tails", sig)
    out_json, lines = tmp_path / "suite.json", tmp_path / "requests.jsonl"
    status = main(["lab", "--suite", "--requests", "40", "--policy", "fcfs", "--tails",
                   "--json", str(out_json), "--requests-out", str(lines)])
    out, err = capsys.readouterr()
    assert status == 0 and err == ""
    doc = json.loads(out_json.read_text())
    assert "interrupted" not in doc and len(doc["runs"]) == 2 and len(doc["tails"]) == 2
    assert len(lines.read_text().splitlines()) == 2 * 40
    assert "# tails: " in out


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_a_signal_just_after_the_last_run_writes_everything(tmp_path, capsys, monkeypatch,
                                                            sig):
    from skippy_scheduler.cli import lab_runs

    _signalled(monkeypatch, lab_runs, "run_suite", sig, after=True)
    out_json = tmp_path / "suite.json"
    status = main(["lab", "--suite", "--requests", "40", "--policy", "fcfs", "--json",
                   str(out_json)])
    out, err = capsys.readouterr()
    assert status == 128 + sig
    assert _interrupt_line(err, sig).endswith(f": all 2 runs printed, wrote --json {out_json}")
    doc = json.loads(out_json.read_text())
    assert "interrupted" not in doc and [r["mode"] for r in doc["runs"]] == ["phase", "mixed"]


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_a_signal_once_the_trace_replays_ended(tmp_path, capsys, monkeypatch, trace, sig):
    from skippy_scheduler.cli import lab_runs

    out_json = tmp_path / "replay.json"
    argv = ["lab", "--trace", trace, "--policy", "fcfs", "--policy", "fair-share", "--tenants",
            "2", "--json", str(out_json)]
    with monkeypatch.context() as m:  # while the tenant table is printed: ignored
        _signalled(m, lab_runs, "format_tenant_table", sig)
        assert main(argv) == 0
        out, err = capsys.readouterr()
        assert err == "" and "# per-tenant service" in out
        doc = json.loads(out_json.read_text())
        assert list(doc["policies"]) == ["fcfs", "fair-share"] and "interrupted" not in doc
    out_json.unlink()
    _signalled(monkeypatch, lab_runs, "run_replays", sig, after=True)  # before: all written
    assert main(argv) == 128 + sig
    out, err = capsys.readouterr()
    assert _interrupt_line(err, sig).endswith(f": all 2 policies printed, wrote --json "
                                              f"{out_json}")
    assert "# per-tenant service" in out
    assert list(json.loads(out_json.read_text())["policies"]) == ["fcfs", "fair-share"]


def test_a_signal_after_the_priority_scenario_ran_writes_its_json(tmp_path, capsys,
                                                                   monkeypatch):
    from skippy_scheduler.cli import lab_priority

    _signalled(monkeypatch, lab_priority, "run_priority_scenario", signal.SIGTERM, after=True)
    out_json = tmp_path / "priority.json"
    status = main(["lab", "--suite", "--priority-scenario", "--requests", "60", "--json",
                   str(out_json)])
    _, err = capsys.readouterr()
    assert status == 128 + signal.SIGTERM
    assert _interrupt_line(err, signal.SIGTERM).endswith(
        f": all 3 rules printed, wrote --json {out_json}")
    doc = json.loads(out_json.read_text())
    assert len(doc["runs"]) == 3 and "interrupted" not in doc


def test_a_signal_while_the_scenarios_print_is_ignored(tmp_path, capsys, monkeypatch):
    from skippy_scheduler.cli import lab

    _signalled(monkeypatch, lab, "format_table", signal.SIGINT)
    out_json = tmp_path / "lab.json"
    status = main(["lab", "--scenario", "cold-burst-n1", "--bench-reps", "0", "--json",
                   str(out_json)])
    out, err = capsys.readouterr()
    assert status == 0 and err == "" and out.startswith("scenario\t")
    assert "interrupted" not in json.loads(out_json.read_text())


# -- outputs that cannot be written after all -------------------------------------------------


@needs_full
@pytest.mark.parametrize("argv, option", [
    (["lab", "--suite", "--requests", "30", "--policy", "fcfs", "--no-mixed"], "--json"),
    (["lab", "--suite", "--requests", "30", "--policy", "fcfs", "--no-mixed"],
     "--requests-out"),
    (["lab", "--trace", "{trace}", "--policy", "fcfs"], "--requests-out"),
    (["lab", "--scenario", "cold-burst-n1", "--bench-reps", "0"], "--json"),
    (["lab", "--scenario", "cold-burst-n1", "--bench-reps", "0"], "--iteration-trace"),
    (["lab", "--suite", "--priority-scenario", "--requests", "60"], "--json"),
    (["lab", "--pipeline-stages", "2"], "--json"),
], ids=lambda v: v if isinstance(v, str) else " ".join(v[:2]))
def test_an_output_that_fails_is_one_line_after_the_results(capsys, trace, argv, option):
    argv = [trace if a == "{trace}" else a for a in argv]
    assert main([*argv, option, FULL]) == 2
    out, err = capsys.readouterr()
    assert _error_line(err) == (f"skippy-scheduler lab: error: {option}: cannot write {FULL}: "
                                f"{os.strerror(errno.ENOSPC)} (the results are printed)")
    assert out  # the table came first


@needs_full
def test_the_other_outputs_are_still_written(tmp_path, capsys, trace):
    out_json = tmp_path / "replay.json"
    assert main(["lab", "--trace", trace, "--policy", "fcfs", "--requests-out", FULL,
                 "--json", str(out_json)]) == 2
    err = capsys.readouterr().err
    assert _error_line(err).endswith(f"(the results are printed, wrote --json {out_json})")
    assert list(json.loads(out_json.read_text())["policies"]) == ["fcfs"]


def test_a_write_that_fails_half_way_leaves_the_old_file(tmp_path, capsys, monkeypatch):
    from skippy_scheduler.cli import lab_runs

    def failing(document):
        def write(fh):
            fh.write('{"runs": [')
            fh.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        return write

    monkeypatch.setattr(lab_runs, "json_writer", failing)
    out_json = tmp_path / "suite.json"
    out_json.write_text("old\n")
    assert main(["lab", "--suite", "--requests", "30", "--policy", "fcfs", "--no-mixed",
                 "--json", str(out_json)]) == 2
    assert "--json: cannot write" in capsys.readouterr().err
    assert out_json.read_text() == "old\n"  # not half a document
    assert sorted(os.listdir(tmp_path)) == ["suite.json"]  # no temporary file left


def test_write_output_replaces_a_file_whole_and_keeps_links_and_modes(tmp_path):
    from skippy_scheduler.cli.lab_runs import write_output

    target = tmp_path / "data.json"
    target.write_text("old")
    os.chmod(target, 0o640)
    link = tmp_path / "link.json"
    link.symlink_to(target)
    write_output("--json", str(link), lambda fh: fh.write("new"))
    assert link.is_symlink() and target.read_text() == "new"
    assert os.stat(target).st_mode & 0o777 == 0o640
    fifo = tmp_path / "pipe"  # not a regular file: written in place, as /dev/stdout is
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        write_output("--json", str(fifo), lambda fh: fh.write("through"))
        assert os.read(reader, 100) == b"through"
    finally:
        os.close(reader)
    assert sorted(os.listdir(tmp_path)) == ["data.json", "link.json", "pipe"]


# -- outputs that a plot would overwrite ------------------------------------------------------


@pytest.mark.parametrize("run, plot", [("--trace", "trace_ttft_cdf.png"),
                                       ("--trace", "trace_queue_depth.png"),
                                       ("--suite", "ttft_cdf.png"),
                                       ("--suite", "batch_occupancy.png")])
@pytest.mark.parametrize("option", ["--json", "--requests-out"])
def test_an_output_that_is_one_of_the_plots_is_refused_before_the_run(tmp_path, capsys, trace,
                                                                      monkeypatch, run, plot,
                                                                      option):
    from skippy_scheduler.cli import lab_runs

    def no_work(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr(lab_runs, "run_suite", no_work)
    monkeypatch.setattr(lab_runs, "run_replays", no_work)
    plots = tmp_path / "plots"
    plots.mkdir()
    path = f"{plots}/../plots/{plot}"
    argv = ["--trace", trace] if run == "--trace" else ["--suite", "--requests", "10"]
    assert main(["lab", *argv, "--plot", str(plots), option, path]) == 2
    assert _error_line(capsys.readouterr().err) == (
        f"skippy-scheduler lab: error: {option}: {path} is the plot {plot} that --plot {plots} "
        "writes (give another path)")


def test_the_plot_names_checked_are_the_ones_written(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from skippy_scheduler.cli.lab_runs import SUITE_PLOTS

    plots = tmp_path / "plots"
    assert main(["lab", "--suite", "--requests", "20", "--policy", "fcfs", "--no-mixed",
                 "--plot", str(plots)]) == 0
    capsys.readouterr()
    assert sorted(os.listdir(plots)) == sorted(SUITE_PLOTS)


def test_the_trace_plot_names_are_the_ones_written(tmp_path, capsys, trace):
    pytest.importorskip("matplotlib")
    from skippy_scheduler.cli.lab_runs import TRACE_PLOTS

    plots = tmp_path / "plots"
    assert main(["lab", "--trace", trace, "--policy", "fcfs", "--plot", str(plots)]) == 0
    capsys.readouterr()
    assert sorted(os.listdir(plots)) == sorted(TRACE_PLOTS)


# -- inputs and flags that ended in a traceback or a crash ------------------------------------


@pytest.mark.parametrize("text, fragment", [
    ('["a",\n"[[",\n' + "[" * 100_000, "(line 3: nested too deeply)"),
    ('[\n[1,\n' + "1" * 5000 + "]]", "(line 3: Exceeds the limit (4300 digits)"),
    # Digits in a string are text: the number named is the one on line 2.
    ('["' + "1" * 5000 + '",\n[' + "1" * 5000 + "]]", "(line 2: Exceeds the limit (4300 digits)"),
])
def test_prompts_python_cannot_read_are_one_line(tmp_path, capsys, monkeypatch, text,
                                                 fragment):
    pytest.importorskip("gguf")  # (the default tiny model is checked before the prompts)
    from skippy_scheduler.cli import run as run_cli

    def no_work(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr(run_cli, "import_llama_host", no_work)
    path = tmp_path / "prompts.json"
    path.write_text(text)
    assert main(["run", "--prompts", str(path)]) == 2
    line = _error_line(capsys.readouterr().err)
    assert line.startswith(f"skippy-scheduler run: error: --prompts: {path} is not valid JSON ")
    assert fragment in line


@pytest.mark.parametrize("sub", ["run", "calibrate", "serve", "stage"])
def test_threads_beyond_what_llama_cpp_runs_are_a_usage_error(capsys, monkeypatch, sub):
    from skippy_scheduler.cli._common import LLAMA_MAX_THREADS, thread_count

    assert LLAMA_MAX_THREADS == 512  # ggml's GGML_MAX_N_THREADS
    extra = ["-m", "x.gguf", "--listen", "tcp://127.0.0.1:1"] if sub == "stage" else []
    assert main([sub, "-t", "513", *extra]) == 2
    assert _error_line(capsys.readouterr().err) == (
        f"skippy-scheduler {sub}: error: argument -t/--threads: expected at most 512 "
        "(llama.cpp's GGML_MAX_N_THREADS), got 513")
    assert thread_count("512") == 512  # the most is taken


def test_a_cost_model_term_given_twice_is_refused(capsys):
    assert main(["lab", "--cost-model", "prefill_token_us=1,prefill_token_us=2"]) == 2
    assert _error_line(capsys.readouterr().err) == (
        "skippy-scheduler lab: error: --cost-model: 'prefill_token_us=1,prefill_token_us=2' "
        "gives prefill_token_us more than once; give each term once")


def test_a_cost_model_file_nested_too_deeply_is_one_line(tmp_path, capsys):
    path = tmp_path / "cost.json"
    path.write_text("[" * 100_000)
    assert main(["lab", "--cost-model", str(path)]) == 2
    assert _error_line(capsys.readouterr().err).endswith(
        f"--cost-model: {path} is not valid JSON (nested too deeply)")


def test_one_problem_of_a_calibration_is_named_whole(tmp_path, capsys):
    path = tmp_path / "fit.json"
    path.write_text(json.dumps({"cost_model": "prefill_token_us=3", "shapes": [],
                                "problems": "timings swing"}))
    assert main(["lab", "--cost-model", str(path), "--scenario", "cold-burst-n1",
                 "--bench-reps", "0"]) == 0
    err = capsys.readouterr().err
    assert "the calibration reported problems (timings swing)" in err


# -- run and calibrate (the tiny llama.cpp model) ---------------------------------------------


@pytest.fixture
def llama():
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")


def test_run_prints_then_writes_and_a_signal_then_is_ignored(tmp_path, capsys, monkeypatch,
                                                             llama):
    from skippy_scheduler.cli import run as run_cli

    _signalled(monkeypatch, run_cli, "_print_run", signal.SIGINT)
    out_json = tmp_path / "run.json"
    assert main(["run", "-t", "1", "--max-tokens", "3", "--json", str(out_json)]) == 0
    out, err = capsys.readouterr()
    assert "interrupted" not in err and "# 6/6 completed" in out
    assert len(json.loads(out_json.read_text())["requests"]) == 6


@needs_full
def test_run_and_calibrate_print_their_results_before_a_write_fails(capsys, llama):
    assert main(["run", "-t", "1", "--max-tokens", "3", "--json", FULL]) == 2
    out, err = capsys.readouterr()
    assert "# 6/6 completed" in out
    assert _error_line(err) == (f"skippy-scheduler run: error: --json: cannot write {FULL}: "
                                f"{os.strerror(errno.ENOSPC)} (the results are printed)")
    assert main(["calibrate", "--repeats", "2", "--warmup", "0", "--json", FULL]) == 2
    out, err = capsys.readouterr()
    assert out.startswith("iteration_overhead_us=")  # the fitted model, printed
    assert _error_line(err).startswith("skippy-scheduler calibrate: error: --json: cannot "
                                       f"write {FULL}")


def test_a_signal_once_calibrate_has_fitted_is_ignored(tmp_path, capsys, monkeypatch, llama):
    from skippy_scheduler.hosts import calibrate as fitting

    _signalled(monkeypatch, fitting.Calibration, "problems", signal.SIGTERM)
    out_json = tmp_path / "fit.json"
    status = main(["calibrate", "--repeats", "2", "--warmup", "0", "--json", str(out_json)])
    out, err = capsys.readouterr()
    assert status in (0, 1) and "interrupted" not in err  # 1: an untrustworthy fit, printed
    assert out.startswith("iteration_overhead_us=")
    assert json.loads(out_json.read_text())["cost_model"]


def test_calibrate_says_what_sizes_its_context(capsys, llama):
    assert main(["calibrate", "--repeats", "4294967295"]) == 2
    line = _error_line(capsys.readouterr().err)
    assert line.endswith("; lower --repeats (now 4294967295) or --warmup (now 3), which size "
                         "the context when -c/--ctx-size is not given")
    assert "-np" not in line


@pytest.mark.parametrize("sub", ["run", "serve"])
def test_more_plans_in_flight_than_a_scheduler_keeps_are_a_usage_error(capsys, sub):
    assert main([sub, "--inflight", "256"]) == 2
    assert _error_line(capsys.readouterr().err) == (
        f"skippy-scheduler {sub}: error: argument --inflight: expected at most 255 (the plans "
        "a scheduler keeps live at once), got 256")
