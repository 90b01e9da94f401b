"""`skippy-scheduler run`: one flag under two spellings, the summary after an interrupt, and the
progress bar on a terminal."""
from __future__ import annotations

import re
import sys
from types import SimpleNamespace

import pytest

from skippy_scheduler.cli import build_parser, main
from skippy_scheduler.cli import run as run_cli

PROG = "skippy-scheduler run"


@pytest.mark.parametrize("flags, message", [
    (["--chunk", "8", "--prefill-chunk", "256"],
     "argument --prefill-chunk: not allowed with argument --chunk"),
    (["--prefill-chunk", "256", "--chunk", "8"],
     "argument --chunk: not allowed with argument --prefill-chunk"),
    (["--chunk", "256", "--prefill-chunk", "16"],
     "argument --prefill-chunk: not allowed with argument --chunk"),
    (["--max-tokens-per-iteration", "64", "-b", "128"],
     "argument -b/--max-num-batched-tokens: not allowed with argument "
     "--max-tokens-per-iteration")])
def test_one_flag_under_two_spellings_is_refused_before_any_work(capsys, monkeypatch, flags,
                                                                  message):
    def no_work(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr(run_cli, "import_llama_host", no_work)
    code = main(["run", *flags])
    out, err = capsys.readouterr()
    lines = [l for l in err.splitlines() if "is deprecated" not in l]
    assert code == 2 and out == "" and len(lines) == 2, err
    assert lines[0].startswith(f"usage: {PROG} ") and lines[1] == f"{PROG}: error: {message}"


def test_one_spelling_alone_still_sets_the_chunk():
    parser = build_parser()
    assert parser.parse_args(["run"]).prefill_chunk == 256
    assert parser.parse_args(["run", "--prefill-chunk", "256"]).prefill_chunk == 256
    assert parser.parse_args(["run", "--chunk", "64"]).prefill_chunk == 64


def _record(finish, ttft, itl, queue=1.0, latency=None):
    return SimpleNamespace(finish_reason=finish, ttft_us=ttft, itl_us=itl, queue_wait_us=queue,
                           latency_us=latency)


def test_the_percentiles_after_an_interrupt_are_the_finished_requests():
    records = [_record("length", 100.0, [10.0, 30.0], latency=200.0),
               _record("stop", 300.0, [20.0], latency=400.0),
               # cut short: a first token and gaps, far larger, that no printed row shows
               _record(None, 9_000.0, [5_000.0, 7_000.0]),
               _record(None, None, [], queue=None)]
    figures = run_cli.finished_percentiles(records)
    assert (figures["p50_ttft_us"], figures["p95_ttft_us"]) == (100.0, 300.0)
    assert (figures["p50_itl_us"], figures["p99_itl_us"]) == (20.0, 30.0)
    assert (figures["p50_latency_us"], figures["p99_latency_us"]) == (200.0, 400.0)
    assert figures["p99_queue_wait_us"] == 1.0
    assert set(figures) == {f"p{p}_{n}_us" for p in (50, 95, 99)
                            for n in ("queue_wait", "ttft", "itl", "latency")}


def _document(interrupted: bool) -> dict:
    summary = {"completed": 1, "requests": 3, "generated_tokens": 7, "makespan_s": 0.01,
               "tokens_per_s": 700.0, "p50_ttft_us": 1000.0, "p95_ttft_us": 2000.0,
               "p50_itl_us": 100.0, "p95_itl_us": 200.0, "iterations": 9,
               "mean_batch_size": 1.5}
    doc = {"settings": {}, "summary": summary,
           "requests": [{"index": 0, "prompt_tokens": [1, 2], "generated_tokens": [3, 4],
                         "finish": "length", "queue_wait_us": 0.0, "ttft_us": 1000.0,
                         "itl_us": [100.0]}]}
    if interrupted:
        doc["interrupted"] = "SIGINT"
    return doc


def test_the_summary_line_says_whose_percentiles_it_prints(capsys):
    run_cli._print_run(_document(interrupted=False))
    whole = capsys.readouterr().out.splitlines()[-1]
    assert whole == ("# 1/3 completed, 7 tokens in 10.0 ms (700 tok/s); p50/p95 TTFT "
                     "1.000/2.000 ms, p50/p95 ITL 0.100/0.200 ms; 9 iterations, mean batch 1.50")
    run_cli._print_run(_document(interrupted=True))
    cut = capsys.readouterr().out.splitlines()[-1]
    assert cut == ("# 1/3 completed, 7 tokens in 10.0 ms (700 tok/s); over the 1 finished "
                   "requests: p50/p95 TTFT 1.000/2.000 ms, p50/p95 ITL 0.100/0.200 ms; "
                   "9 iterations, mean batch 1.50")


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "log"])
def test_a_progress_bar_on_a_terminal_only(capsys, monkeypatch, terminal):
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    monkeypatch.setattr(run_cli, "PROGRESS_DELAY_S", 0.0)  # the run is shorter than a second
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal, raising=False)
    assert main(["run", "-np", "1", "--max-tokens", "4", "-t", "1"]) == 0
    out, err = capsys.readouterr()
    if terminal:
        # (how many updates show depends on the machine's speed: at least the first does)
        assert re.search(r"\rrun \[[#.]{30}\] [0-6]/6 ", err), err
        assert err.endswith("\r")  # cleared before the results
    else:
        assert "\r" not in err
    assert out.splitlines()[0].startswith("index\t")


@pytest.mark.parametrize("argv", [
    ["serve", "-m", "M.gguf", "--prefill-chunk", "256", "--chunk", "8"],
    ["serve", "-m", "M.gguf", "--chunk", "8", "--prefill-chunk", "256"],
    ["serve", "-m", "M.gguf", "-b", "64", "--batch-size", "64"],
    ["serve", "-m", "M.gguf", "--policy", "fcfs", "--admission", "fcfs"],
    ["serve", "-m", "M.gguf", "-a", "x", "--model-name", "y"],
    ["lab", "--suite", "--chunk", "8", "--prefill-chunk", "256"],
    ["run", "--prefill-chunk", "256", "--chunk", "8"],
])
def test_every_command_refuses_a_flag_under_two_spellings(argv, capsys):
    from skippy_scheduler.cli import main

    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and "not allowed with argument" in err, err


def test_a_lane_context_smaller_than_the_asked_batch_runs(tmp_path, capsys):
    """One 256-cell lane: llama.cpp caps the batch at the context, and the run plans within
    that cap rather than being refused for the batch it asked."""
    pytest.importorskip("llama_cpp")
    prompts = tmp_path / "p.json"
    prompts.write_text("[[1, 2, 3]]")
    code = main(["run", "-np", "1", "--prefill-chunk", "512", "-t", "1", "--max-tokens", "2",
                 "--prompts", str(prompts)])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "# 1/1 completed" in out.out
