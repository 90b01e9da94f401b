"""`skippy-scheduler lab`: bad input is a user error (exit status 2, the usage line, one line
naming the problem) before any work starts, never a traceback."""
from __future__ import annotations

import json
import subprocess

import pytest

from skippy_scheduler.cli import main
from skippy_scheduler.lab.options import RunOptions

PROG = "skippy-scheduler lab"
SUITE = ["lab", "--suite", "--requests", "10"]
# The workload of SUITE (seed 0): its largest request, r000007, has a 1432-token prompt and 54
# output tokens, so it needs 1432 + max(min(54, 32), 54 - 2) = 1484 KV cells.
SUITE_NEED = 1484


def _user_error(capsys, argv, *fragments):
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 2, err
    assert out == ""  # refused before the run printed anything
    lines = err.splitlines()
    assert len(lines) == 2, err
    assert lines[0].startswith(f"usage: {PROG} "), err
    assert lines[1].startswith(f"{PROG}: error: "), err
    for fragment in fragments:
        assert fragment in lines[1], err
    return lines[1]


@pytest.fixture
def one_request(tmp_path):
    """A trace of one request: 100 prompt tokens, 6 output tokens (it needs 106 cells)."""
    path = tmp_path / "one.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 100, "output_length": 6, '
                    '"hash_ids": [0]}\n')
    return str(path)


# -- 1. a KV capacity that a request cannot run in ---------------------------------------------


@pytest.mark.parametrize("capacity", ["1", "1000", str(SUITE_NEED - 1)])
def test_suite_capacity_too_small_for_a_request(capsys, capacity):
    _user_error(capsys, [*SUITE, "--kv-capacity-tokens", capacity],
                f"--kv-capacity-tokens {capacity} is too small: request r000007 (prompt 1432, "
                f"output 54 tokens) needs {SUITE_NEED} KV cells",
                f"give --kv-capacity-tokens >= {SUITE_NEED}, or 0 for no memory model")


def test_suite_capacity_that_fits_the_largest_request_runs(capsys, backend):
    code = main([*SUITE, "--kv-capacity-tokens", str(SUITE_NEED), "--scheduler", backend])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"kv_capacity_tokens={SUITE_NEED}" in out


def test_suite_capacity_counts_the_reserved_output_tokens(capsys):
    # With a reservation of the whole output, admission needs 1432 + 54 cells.
    _user_error(capsys, [*SUITE, "--kv-capacity-tokens", str(SUITE_NEED),
                         "--reserve-output-tokens", "1000"],
                "needs 1486 KV cells", "--reserve-output-tokens 1000")


def test_trace_capacity_too_small(capsys, one_request):
    _user_error(capsys, ["lab", "--trace", one_request, "--kv-capacity-tokens", "100"],
                f"--kv-capacity-tokens 100 is too small: request r0 (line 1 of {one_request}: "
                "prompt 100, output 6 tokens) needs 106 KV cells",
                "give --kv-capacity-tokens >= 106")


def test_trace_capacity_bound_is_exact(capsys, one_request, backend):
    _user_error(capsys, ["lab", "--trace", one_request, "--kv-capacity-tokens", "105",
                         "--scheduler", backend], "needs 106 KV cells")
    code = main(["lab", "--trace", one_request, "--kv-capacity-tokens", "106", "--scheduler",
                 backend])
    _, err = capsys.readouterr()
    assert code == 0, err


def test_a_stall_the_check_misses_is_still_a_user_error(capsys, monkeypatch):
    monkeypatch.setattr(RunOptions, "kv_cells_needed", lambda self, n, o: 0)
    code = main([*SUITE, "--kv-capacity-tokens", "100", "--policy", "fcfs"])
    _, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in err
    assert err.splitlines()[-1].startswith(f"{PROG}: error: --kv-capacity-tokens 100: "
                                           "scheduler stalled (fcfs/phase)")


def test_console_script_prints_no_traceback(command):
    done = subprocess.run([*command, *SUITE, "--kv-capacity-tokens", "1000"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1].startswith(f"{PROG}: error: --kv-capacity-tokens 1000")


# -- 2, 3. goodput targets ---------------------------------------------------------------------


@pytest.mark.parametrize("run", ["suite", "trace"])
@pytest.mark.parametrize("flag, value", [("--itl-target-ms", "-5"), ("--ttft-target-ms", "-1"),
                                         ("--ttft-target-ms", "nan"),
                                         ("--itl-target-ms", "nan"),
                                         ("--itl-target-ms", "inf")])
def test_goodput_targets_must_be_finite_and_not_negative(capsys, one_request, run, flag, value):
    where = SUITE if run == "suite" else ["lab", "--trace", one_request]
    _user_error(capsys, [*where, "--slack", flag, value],
                f"argument {flag}: expected a finite number of ms >= 0, got {value}")


@pytest.mark.parametrize("run", ["suite", "trace"])
def test_slack_needs_an_inter_token_target_above_zero(capsys, one_request, run):
    where = SUITE if run == "suite" else ["lab", "--trace", one_request]
    _user_error(capsys, [*where, "--slack", "--itl-target-ms", "0"],
                "--itl-target-ms 0: the slack rule (--slack) plans each step to this "
                "inter-token target; give a target > 0")


def test_zero_targets_without_slack_are_goodput_bounds(capsys):
    code = main([*SUITE, "--policy", "fcfs", "--no-mixed", "--ttft-target-ms", "0",
                 "--itl-target-ms", "0"])
    _, err = capsys.readouterr()
    assert code == 0, err


# -- 4. a cost model that names no term --------------------------------------------------------


TERMS = ("iteration_overhead_us, prefill_token_us, decode_batch_us, decode_sequence_us (or "
         "StepCost's names for them: base_us, per_prefill_token_us, decode_base_us, "
         "per_decode_row_us)")


def test_empty_cost_model_file(capsys, tmp_path):
    path = tmp_path / "cost.json"
    path.write_text("{}\n")
    _user_error(capsys, ["lab", "--bench-reps", "0", "--cost-model", str(path)],
                f"--cost-model: {path} holds an empty JSON object, which names no cost model "
                f"term; expected one or more of {TERMS}")


def test_empty_cost_model_in_a_calibration_document(capsys, tmp_path):
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"cost_model": {}, "shapes": []}))
    _user_error(capsys, ["lab", "--bench-reps", "0", "--cost-model", str(path)],
                f"{path}: cost_model is an empty object", TERMS)


@pytest.mark.parametrize("spec", ["", ","])
def test_empty_cost_model_spec(capsys, spec):
    _user_error(capsys, ["lab", "--bench-reps", "0", "--cost-model", spec],
                f"--cost-model: {spec!r} names no cost model term", TERMS)


def test_a_cost_model_file_naming_one_term_still_works(capsys, tmp_path):
    path = tmp_path / "cost.json"
    path.write_text('{"prefill_token_us": 1}\n')
    code = main(["lab", "--bench-reps", "0", "--scenario", "cold-burst-n1", "--cost-model",
                 str(path)])
    _, err = capsys.readouterr()
    assert code == 0, err


# -- 6. outputs that would replace an input or each other ---------------------------------------


def test_outputs_may_not_replace_the_cost_model_or_each_other(capsys, tmp_path, one_request):
    cost = tmp_path / "cost.json"
    cost.write_text('{"iteration_overhead_us": 60}\n')
    for argv in (["lab", "--scenario", "cold-burst-n1", "--cost-model", str(cost)],
                 ["lab", "--suite", "--priority-scenario", "--cost-model", str(cost)],
                 ["lab", "--trace", one_request, "--cost-model", str(cost)]):
        _user_error(capsys, [*argv, "--json", str(cost)],
                    f"--json: {cost} is the --cost-model file")
    assert cost.read_text() == '{"iteration_overhead_us": 60}\n'
    same = str(tmp_path / "same")
    _user_error(capsys, ["lab", "--scenario", "cold-burst-n1", "--json", same,
                         "--iteration-trace", same],
                f"--iteration-trace: {same} is also the --json output")
    _user_error(capsys, ["lab", "--trace", one_request, "--json", same, "--plot", same],
                f"--plot: {same} is also the --json output")


# -- 7. numbers the lab's clock cannot hold, and flags a mode would ignore ---------------------


def test_a_rate_or_time_scale_beyond_the_clock_is_refused(capsys, tmp_path):
    _user_error(capsys, [*SUITE, "--rate", "1e-12"], "rate 1e-12/s spreads 10 requests",
                "give a larger rate")
    trace = tmp_path / "two.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [0]}\n'
                     '{"timestamp": 5, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n')
    _user_error(capsys, ["lab", "--trace", str(trace), "--time-scale", "1e300"],
                f"{trace}:2: timestamp: 5e+297 s after the first row at time scale 1e+300")


def test_block_ids_too_large_for_distinct_tokens_are_refused(capsys, tmp_path):
    """A raw 64-bit hash would wrap onto another block's tokens (a false prefix hit) or
    overflow; the line is named and the fix given."""
    trace = tmp_path / "hashes.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, '
                     '"hash_ids": [36028797018963968]}\n')
    _user_error(capsys, ["lab", "--trace", str(trace)],
                f"{trace}:1: hash_ids: block id 36028797018963968 is above 4194302",
                "number the blocks 0, 1, 2")


@pytest.mark.parametrize("flag", [["--tails"], ["--slack"], ["--ttft-target-ms", "10"],
                                  ["--itl-target-ms", "2"], ["--requests-out", "r.jsonl"]])
def test_the_priority_scenario_refuses_flags_it_would_ignore(capsys, flag):
    _user_error(capsys, ["lab", "--suite", "--priority-scenario", *flag],
                f"{flag[0]} does not apply to --priority-scenario")


def test_a_bad_cost_model_value_is_named_as_it_was_given(capsys):
    _user_error(capsys, ["lab", "--cost-model", "iteration_overhead_us=-5"],
                "--cost-model: iteration_overhead_us must be a finite number >= 0, got -5")
    _user_error(capsys, ["lab", "--cost-model", "base_us=-5"],
                "--cost-model: base_us must be a finite number >= 0")


# -- 8. token counts beyond the lab's bound, cost model terms beyond its clock --------------


@pytest.mark.parametrize("name, text, where", [
    ("huge.jsonl", '{"timestamp": 0, "input_length": 10, "output_length": 4294967296, '
                   '"hash_ids": [0]}\n', "1: output_length"),
    ("long.jsonl", '{"timestamp": 0, "input_length": 10, "output_length": 400000000, '
                   '"hash_ids": [0]}\n', "1: output_length"),
    ("huge.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:17:03.9799600,4294967296,5\n", "2: ContextTokens")])
def test_token_counts_beyond_the_bound_are_refused_before_any_replay(capsys, monkeypatch,
                                                                     tmp_path, name, text,
                                                                     where):
    from skippy_scheduler.cli import lab_runs

    def no_replay(*args, **kwargs):
        raise AssertionError("a replay started before the trace was checked")

    monkeypatch.setattr(lab_runs, "run_replays", no_replay)
    trace = tmp_path / name
    trace.write_text(text)
    _user_error(capsys, ["lab", "--trace", str(trace)],
                f"{trace}:{where}: must be <= 16777216 (2^24 tokens, more than any served "
                "context holds)")


@pytest.mark.parametrize("spec, name, value", [
    ("prefill_token_us=1e300", "prefill_token_us", "1e+300"),
    ("base_us=1000000001", "base_us", "1000000001"),
    ("decode_sequence_us=inf", "decode_sequence_us", None)])
def test_cost_model_terms_are_bounded(capsys, spec, name, value):
    line = _user_error(capsys, ["lab", "--bench-reps", "0", "--cost-model", spec])
    if value is None:  # not finite: refused as before
        assert f"--cost-model: {name} must be a finite number >= 0" in line
    else:
        assert line.endswith(f"--cost-model: {name} must be at most 1e+09 µs, got {value}")


def test_cost_model_files_are_bounded_too(capsys, tmp_path):
    plain = tmp_path / "cost.json"
    plain.write_text('{"decode_batch_us": 1e10}\n')
    _user_error(capsys, ["lab", "--bench-reps", "0", "--cost-model", str(plain)],
                "--cost-model: decode_batch_us must be at most 1e+09 µs, got 10000000000.0")
    fitted = tmp_path / "calibration.json"
    fitted.write_text(json.dumps({"cost_model": "iteration_overhead_us=2e9", "shapes": []}))
    _user_error(capsys, ["lab", "--bench-reps", "0", "--cost-model", str(fitted)],
                "--cost-model: iteration_overhead_us must be at most 1e+09 µs, got 2000000000.0")


def test_a_cost_model_term_at_the_bound_runs(capsys):
    code = main(["lab", "--bench-reps", "0", "--scenario", "cold-burst-n1", "--cost-model",
                 "iteration_overhead_us=1e9"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.splitlines()[1].startswith("cold-burst-n1\t1\t")


# -- 9. flags the run asked for would ignore, and one flag under two spellings ---------------


LIST_WITH = [["--cost-model", "base_us=5"], ["--scheduler", "twin"], ["--twin"], ["--replay"],
             ["--bench-reps", "3"], ["--iteration-trace", "t.txt"], ["--json", "x.json"],
             ["--suite"], ["--requests", "5"], ["--no-mixed"], ["--chunk", "8"],
             ["--hop-us", "5"], ["--scenario", "cold-burst-n1"], ["--pipeline-stages", "2"]]


@pytest.mark.parametrize("flags", LIST_WITH, ids=[" ".join(f) for f in LIST_WITH])
def test_list_refuses_every_other_flag(capsys, flags):
    flag = {"--twin": "--scheduler", "--chunk": "--prefill-chunk",
            "--no-mixed": "--mixed/--no-mixed"}.get(flags[0], flags[0])
    line = _user_error_after_warnings(capsys, ["lab", "--list", *flags])
    assert line.endswith(f"--list prints the scenario names and runs nothing: {flag} does not "
                         "apply"), line


def test_list_takes_a_flag_at_its_default(capsys):
    assert main(["lab", "--list", "--scheduler", "native"]) == 0
    assert len(capsys.readouterr().out.split()) == 13


def _user_error_after_warnings(capsys, argv):
    """`_user_error` for argv that also prints deprecation lines (old spellings) first."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    lines = [l for l in err.splitlines() if "is deprecated" not in l]
    assert code == 2 and out == "" and len(lines) == 2, err
    assert lines[0].startswith(f"usage: {PROG} ") and lines[1].startswith(f"{PROG}: error: ")
    return lines[1]


@pytest.mark.parametrize("run, why", [
    (["--suite"], "applies to the reference scenarios, not to --suite"),
    (["--trace", "{trace}"], "applies to the reference scenarios, not to --trace"),
    (["--pipeline-stages", "1,2"], "does not apply to the staged pipeline (--pipeline-stages)")])
@pytest.mark.parametrize("reps", ["0", "200"])  # 200, the default, given is given all the same
def test_bench_reps_is_refused_where_it_is_ignored(capsys, one_request, run, why, reps):
    argv = ["lab", *[a.format(trace=one_request) for a in run], "--bench-reps", reps]
    _user_error(capsys, argv, f"--bench-reps {why}")


@pytest.mark.parametrize("mode", [["--mixed"], ["--no-mixed"], ["--mode", "phase"]])
def test_pipeline_stages_refuses_a_planning_mode(capsys, mode):
    line = _user_error_after_warnings(capsys, ["lab", "--pipeline-stages", "1,2", *mode])
    assert line.endswith("--mixed/--no-mixed does not apply to the staged pipeline "
                         "(--pipeline-stages)")


@pytest.mark.parametrize("flags, message", [
    (["--chunk", "8", "--prefill-chunk", "16"], "argument --prefill-chunk: not allowed with "
                                                "argument --chunk"),
    (["--prefill-chunk", "16", "--chunk", "8"], "argument --chunk: not allowed with argument "
                                                "--prefill-chunk"),
    (["--batch-size", "64", "-b", "128"], "argument -b/--max-num-batched-tokens: not allowed "
                                          "with argument --batch-size"),
    (["--max-tokens-per-iteration", "64", "--batch-size", "128"],
     "argument --batch-size: not allowed with argument --max-tokens-per-iteration"),
    # "native" is the default's own text: given, it is given all the same.
    (["--scheduler", "native", "--twin"], "argument --twin: not allowed with argument "
                                          "--scheduler"),
    (["--backend", "twin", "--scheduler", "native"], "argument --scheduler: not allowed with "
                                                     "argument --backend")])
def test_one_flag_under_two_spellings_is_refused(capsys, flags, message):
    line = _user_error_after_warnings(capsys, [*SUITE, *flags])
    assert line == f"{PROG}: error: {message}"


def test_bench_refuses_no_twin_beside_scheduler(capsys):
    assert main(["bench", "--quick", "--scheduler", "twin", "--no-twin"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines()[-1] == ("skippy-scheduler bench: error: argument "
                                                  "--no-twin: not allowed with argument "
                                                  "--scheduler")


def test_prefix_cache_help_reads_as_one_sentence(capsys):
    assert main(["lab", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert ("--prefix-cache-tokens N tokens of finished requests' KV kept as reusable prefixes "
            "(0: no reuse); here the size of the modelled prefix cache, 'unlimited' for no "
            "bound (default: 8388608)") in text
