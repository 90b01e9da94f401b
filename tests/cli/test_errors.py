"""User errors: exit status 2, the subcommand's usage line, one line naming the problem.

Output paths are checked before any work starts, so a long run cannot end by losing its results.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import skippy_scheduler
from skippy_scheduler.cli import main


def _user_error(capsys, argv, fragment, sub=None):
    """Run `main(argv)`, expect a user error of subcommand `sub` naming `fragment`."""
    sub = argv[0] if sub is None else sub
    prog = f"skippy-scheduler {sub}" if sub else "skippy-scheduler"
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 2, err
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 2, err
    assert lines[0].startswith(f"usage: {prog} "), err
    assert lines[1].startswith(f"{prog}: error: "), err
    assert fragment in lines[1], err
    assert "Traceback" not in err
    return lines[1]


@pytest.fixture
def files(tmp_path):
    """Paths of every kind a user might get wrong."""
    not_json = tmp_path / "broken.json"
    not_json.write_text("{not json")
    fake_gguf = tmp_path / "fake.gguf"
    fake_gguf.write_bytes(b"GGUF" + bytes(60))  # right magic: passes the up-front check
    text = tmp_path / "notes.txt"
    text.write_text("not a model\n")
    return {"dir": str(tmp_path), "missing": str(tmp_path / "missing" / "out.json"),
            "under_file": str(text / "out.json"), "not_json": str(not_json),
            "gguf": str(fake_gguf), "text": str(text)}


ERRORS = [
    # argparse: unknown flags and bad values, reported by the subcommand
    (["lab", "--bogus"], "unrecognized arguments: --bogus"),
    (["lab", "--bench-reps", "x"], "argument --bench-reps: expected an integer, got 'x'"),
    (["lab", "--bench-reps", "-1"], "expected an integer >= 0"),
    (["lab", "--scheduler", "nope"], "invalid choice: 'nope'"),
    (["lab", "--json"], "expected one argument"),
    (["lab", "--suite", "--rate", "fast"], "argument --rate: expected a number, got 'fast'"),
    (["lab", "--suite", "--rate", "0"], "argument --rate: expected a finite number > 0"),
    (["lab", "--suite", "--family-share", "2"],
     "argument --family-share: expected a number in [0, 1], got 2"),
    (["lab", "--suite", "--seed", "-1"], "argument --seed: expected an integer >= 0"),
    (["lab", "--suite", "-np", "99999999999999999999"],
     "argument -np/--max-active: expected at most 4294967295, got 99999999999999999999"),
    (["lab", "--list", "--suite"], "--list prints the scenario names and runs nothing"),
    (["run", "--itl-target-ms", "1e308"], "argument --itl-target-ms: expected at most 1e+09 ms"),
    (["stage", "-m", "s.gguf", "--listen", "tcp://127.0.0.1:99999"],
     "argument --listen: expected tcp://HOST:PORT (a port 1-65535, or *)"),
    (["run", "--max-active", "0"], "expected an integer >= 1"),
    (["run", "--arrival-interval-ms", "inf"], "expected a finite number of ms >= 0"),
    (["run", "--threads", "two"], "expected an integer, got 'two'"),
    (["run", "--stage-devices", "CPU,CPU"], "--stage-devices needs --stages"),
    (["calibrate", "--clock", "sundial"], "invalid choice: 'sundial'"),
    (["calibrate", "--repeats", "0"], "expected an integer >= 1"),
    (["bench", "--bogus"], "unrecognized arguments: --bogus"),
    (["config", "--cflags", "extra"], "unrecognized arguments: extra"),
    # lab values
    (["lab", "--scenario", "nope"], "unknown scenario 'nope'"),
    (["lab", "--cost-model", "missing.json"], "--cost-model: file not found: missing.json"),
    (["lab", "--cost-model", "{not_json}"], "is not valid JSON"),
    (["lab", "--cost-model", "{dir}"], "is a directory"),
    (["lab", "--cost-model", "bogus=1"], "unknown cost model field"),
    (["lab", "--cost-model", "prefill_token_us=-1"], ">= 0"),
    (["lab", "--suite", "--policy", "lifo"], "unknown policy 'lifo'"),
    (["lab", "--suite", "--requests", "0"], "expected an integer in [1, 200000], got 0"),
    (["lab", "--suite", "--max-active", "0"],
     "argument -np/--max-active: expected an integer >= 1"),
    (["lab", "--suite", "--max-tokens", "16"], "--max-tokens is the tokens generated per request"),
    (["lab", "--suite", "--policy", "cache"], "unknown policy 'cache'"),
    (["lab", "--mixed"], "--mixed/--no-mixed needs --suite or --trace"),
    (["calibrate", "--model", "{gguf}", "-c", "1024", "--repeats", "500"],
     "--ctx-size 1024 gives each of the 8 lanes 128 cells; --repeats 500"),
    (["run", "--model", "{gguf}", "-c", "4", "-np", "8"], "--ctx-size (4) must be at least"),
    (["lab", "--suite", "--iteration-trace", "t.txt"],
     "--iteration-trace applies to the reference scenarios"),
    (["lab", "--suite", "--trace", "t.txt"], "--trace and --suite are two different runs"),
    (["lab", "--plot", "plots"], "--plot needs --suite"),
    # output paths
    (["lab", "--json", "{dir}"], "--json: {dir} is a directory"),
    (["lab", "--iteration-trace", "{missing}"], "does not exist"),
    (["lab", "--json", "{under_file}"], "is not a directory"),
    (["lab", "--suite", "--json", "{missing}"], "--json: cannot write"),
    (["lab", "--suite", "--plot", "{text}"], "--plot: {text} is not a directory"),
    (["lab", "--suite", "--plot", "{under_file}"], "is not a directory"),
    (["run", "--model", "{gguf}", "--json", "{missing}"], "--json: cannot write"),
    (["calibrate", "--model", "{gguf}", "--json", "{dir}"], "is a directory"),
    # model files and inputs
    (["run", "--model", "{dir}/none.gguf"], "model file not found"),
    (["run", "--model", "{text}"], "is not a GGUF model file"),
    (["run", "--model", "{dir}"], "is a directory, not a GGUF model file"),
    (["calibrate", "--model", "{text}"], "is not a GGUF model file"),
    (["run", "--model", "{gguf}", "--max-active", "300"], "must be <= 256 (llama.cpp's sequence ids)"),
    (["run", "--model", "{gguf}", "--prompts", "{dir}/none.json"], "--prompts: file not found"),
    (["run", "--model", "{gguf}", "--prompts", "{not_json}"], "is not valid JSON"),
    # config
    (["config"], "nothing to print"),
]


@pytest.mark.parametrize("argv, fragment", ERRORS, ids=[" ".join(a) for a, _ in ERRORS])
def test_user_error(capsys, files, argv, fragment):
    _user_error(capsys, [a.format(**files) for a in argv], fragment.format(**files))


def test_prompts_must_be_a_list_of_prompts(capsys, files, tmp_path):
    prompts = tmp_path / "prompts.json"
    for content, fragment in (("{}", "non-empty JSON list"), ("[]", "non-empty JSON list"),
                              ('[[1, 2], {"x": 1}]', "prompt 1 must be a string")):
        prompts.write_text(content)
        _user_error(capsys, ["run", "--model", files["gguf"], "--prompts", str(prompts)],
                    fragment)


def test_unwritable_paths(capsys, monkeypatch, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    read_only = tmp_path / "read-only.json"
    read_only.write_text("{}")
    denied = {str(locked), str(read_only)}
    real_access = os.access

    # Permission bits do not bind root, so the denial is simulated where the check asks.
    def access(path, mode, *args, **kwargs):
        if mode & os.W_OK and os.path.abspath(path) in denied:
            return False
        return real_access(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", access)
    _user_error(capsys, ["lab", "--json", str(locked / "lab.json")],
                f"directory {locked} is not writable")
    _user_error(capsys, ["lab", "--iteration-trace", str(read_only)], "permission denied")
    _user_error(capsys, ["lab", "--suite", "--plot", str(locked)], "is not writable")
    _user_error(capsys, ["lab", "--suite", "--plot", str(locked / "a" / "b")],
                f"cannot create {locked / 'a' / 'b'}: directory {locked} is not writable")


def test_top_level_errors(capsys):
    _user_error(capsys, [], "the following arguments are required: COMMAND", sub="")
    _user_error(capsys, ["nosuch"], "invalid choice: 'nosuch'", sub="")


def test_bad_output_path_fails_before_the_run(capsys, monkeypatch, files):
    from skippy_scheduler.cli import lab

    def no_run(*args, **kwargs):
        raise AssertionError("the run started before the output path was checked")

    monkeypatch.setattr(lab, "run_scenario", no_run)
    from skippy_scheduler.cli import lab_runs

    monkeypatch.setattr(lab_runs, "generate", no_run)
    monkeypatch.setattr(lab_runs, "run_suite", no_run)
    monkeypatch.setattr(lab_runs, "run_replays", no_run)
    # The default --bench-reps would make a full run take seconds: the check comes first.
    _user_error(capsys, ["lab", "--json", files["missing"]], "does not exist")
    _user_error(capsys, ["lab", "--iteration-trace", files["dir"]], "is a directory")
    _user_error(capsys, ["lab", "--suite", "--requests", "100000", "--json", files["missing"]],
                "does not exist")


def test_model_and_output_are_checked_before_llama_is_loaded(capsys, monkeypatch, files):
    from skippy_scheduler.cli import calibrate, run

    def no_host():
        raise AssertionError("the host was loaded before the arguments were checked")

    monkeypatch.setattr(run, "import_llama_host", no_host)
    monkeypatch.setattr(calibrate, "import_llama_host", no_host)
    _user_error(capsys, ["run", "--model", files["text"]], "not a GGUF")
    _user_error(capsys, ["run", "--model", files["gguf"], "--json", files["dir"]], "directory")
    _user_error(capsys, ["calibrate", "--model", files["gguf"], "--json", files["missing"]],
                "does not exist")


def test_an_output_that_is_an_input_is_refused_and_left_whole(capsys, monkeypatch, files,
                                                                tmp_path):
    """`--json` naming the model, the prompts or the trace would overwrite it."""
    from skippy_scheduler.cli import calibrate, run

    def no_host():
        raise AssertionError("the host was loaded before the arguments were checked")

    monkeypatch.setattr(run, "import_llama_host", no_host)
    monkeypatch.setattr(calibrate, "import_llama_host", no_host)
    model = files["gguf"]
    with open(model, "rb") as f:
        before = f.read()
    prompts = tmp_path / "prompts.json"
    prompts.write_text("[[1, 2, 3]]")
    _user_error(capsys, ["run", "--model", model, "--json", model],
                "is the --model file; writing it would destroy it")
    _user_error(capsys, ["calibrate", "--model", model, "--json", model], "is the --model file")
    _user_error(capsys, ["run", "--model", model, "--prompts", str(prompts), "--json",
                         os.path.join(os.path.dirname(str(prompts)), ".", "prompts.json")],
                "is the --prompts file")
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2}\n')
    _user_error(capsys, ["lab", "--trace", str(trace), "--json", str(trace)],
                "is the --trace file")
    with open(model, "rb") as f:
        assert f.read() == before
    assert prompts.read_text() == "[[1, 2, 3]]"


@pytest.mark.parametrize("sub", ["run", "calibrate"])
def test_a_negative_seed_of_the_tiny_model_is_a_usage_error(capsys, sub):
    _user_error(capsys, [sub, "--seed", "-5"], "--seed")


@pytest.mark.parametrize("sub", ["run", "serve"])
@pytest.mark.parametrize("value,fragment", [
    ("bogus", "'bogus' is not a stage worker's address"),
    ("tcp://127.0.0.1", "expected tcp://HOST:PORT"),
    ("tcp://127.0.0.1:0", "expected tcp://HOST:PORT"),
    ("http://127.0.0.1:5600", "is not a stage worker's address"),
    (" , ", "expected pyzmq addresses"),
])
def test_stage_addresses_are_checked_before_anything_starts(capsys, files, sub, value,
                                                            fragment):
    _user_error(capsys, [sub, "--model", files["gguf"], "--stage-addresses", value], fragment)


@pytest.mark.parametrize("sub", ["run", "serve"])
@pytest.mark.parametrize("flag", ["--stages", "--stage-addresses"])
def test_an_empty_stage_flag_is_refused_not_ignored(capsys, sub, flag):
    _user_error(capsys, [sub, flag, ""], flag)


def test_internal_errors_are_not_swallowed(monkeypatch):
    from skippy_scheduler.cli import lab

    def broken(*args, **kwargs):
        raise RuntimeError("a bug, not a user error")

    monkeypatch.setattr(lab, "run_scenario", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["lab", "--bench-reps", "0", "--scenario", "cold-burst-n1"])


def test_help_exits_zero(capsys):
    assert main(["lab", "--help"]) == 0
    assert "--cost-model" in capsys.readouterr().out


# -- the installed console script -----------------------------------------------------------


def test_version(command, tmp_path):
    result = subprocess.run([*command, "--version"], capture_output=True, text=True,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"skippy-scheduler {skippy_scheduler.__version__}\n"


def test_version_through_python_m(tmp_path):
    result = subprocess.run([sys.executable, "-m", "skippy_scheduler.cli", "--version"],
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"skippy-scheduler {skippy_scheduler.__version__}\n"


@pytest.mark.parametrize("argv, fragment", [
    (["lab", "--bogus"], "unrecognized arguments: --bogus"),
    (["lab", "--json", "missing-dir/lab.json"], "missing-dir does not exist"),
    (["run", "--model", "nothing.gguf"], "model file not found: nothing.gguf"),
])
def test_console_script_user_error(command, tmp_path, argv, fragment):
    result = subprocess.run([*command, *argv], capture_output=True, text=True, cwd=tmp_path,
                            timeout=60)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 2 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith(f"usage: skippy-scheduler {argv[0]} ")
    assert lines[1].startswith(f"skippy-scheduler {argv[0]}: error: ") and fragment in lines[1]
