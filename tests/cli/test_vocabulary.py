"""One name and one meaning per concept across every subcommand.

The table below is this test's own (not the CLI's): each concept's option strings as they must
appear in every subcommand that takes it, a phrase its help must carry, and the spellings of
earlier releases that must not show in any help. The walk goes over every registered
subcommand's `--help`, so a new subcommand is checked as soon as it is registered.
"""
from __future__ import annotations

import argparse
import ast
import pathlib
import re

import pytest

from skippy_scheduler import selection
from skippy_scheduler.cli import build_parser, main
from skippy_scheduler.cli.vocabulary import LLAMA_SERVER_FLAGS

# concept -> (option strings, phrase of its meaning)
CONCEPTS = {
    "model file": (("-m", "--model"), "GGUF model file"),
    "compute threads": (("-t", "--threads"), "llama.cpp compute threads"),
    "context size": (("-c", "--ctx-size"), "KV cells in total"),
    "sequences at once": (("-np", "--max-active"), "sequences running at once"),
    "tokens per request": (("-n", "--max-tokens"), "tokens generated per request"),
    "step token budget": (("-b", "--max-num-batched-tokens"), "token budget of one step"),
    "prefill chunk": (("--prefill-chunk",), "prompt tokens of one sequence per step"),
    "mixed planning": (("--mixed", "--no-mixed"), "mixed planning"),
    "prefill streak": (("--max-consecutive-prefill",), "prefill-only steps in a row"),
    "admission policy": (("--policy",), "admission order of waiting requests"),
    "implementation": (("--scheduler",), "scheduler implementation"),
    "served model name": (("-a", "--served-model-name", "--alias"), "/v1/models"),
    "results file": (("--json",), "write the results as JSON"),
    "prefix reuse": (("--prefix-cache-tokens",), "reusable prefixes"),
    "plans in flight": (("--inflight",), "plans in flight"),
    "planning rule": (("--planning-rule",), "how a step is filled"),
    "inter-token target": (("--itl-target-ms",), "inter-token target in ms"),
    "prefill age bound": (("--prefill-age-max-ms",), "prefilled shortest first"),
    "random seed": (("--seed",), "random seed"),
}
# Spellings of the same concepts in earlier releases: hidden now, never in a help.
OLD_SPELLINGS = ("--model-name", "--batch-size", "--max-tokens-per-iteration", "--chunk",
                 "--backend", "--twin", "--no-twin", "--admission", "--mode")
# Subcommands whose purpose needs another default, and the reason their help must give.
DEFAULT_REASONS = {
    ("lab", "--max-active"): "larger accelerator",
    ("lab", "--max-num-batched-tokens"): "larger accelerator",
    ("lab", "--prefill-chunk"): "larger accelerator",
    ("lab", "--mixed"): "to compare them",
    ("lab", "--policy"): "all but fair-share",
    ("calibrate", "--threads"): "swing by tens of ms",
    ("bench", "--scheduler"): "always timed",
    ("run", "--prefix-cache-tokens"): "unlike serve",
    ("run", "--prefix-holders"): "unlike serve",
}


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    return dict(build_parser().commands)


def _visible(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions
            if a.option_strings and a.help is not argparse.SUPPRESS
            and not isinstance(a, argparse._HelpAction)]


def _meaning(action: argparse.Action) -> str:
    """The help's first part: what the flag is, before a subcommand's note and the default."""
    return re.split(r"; | \(default", action.help or "")[0]


@pytest.fixture(scope="module")
def helps() -> dict[str, str]:
    """Every subcommand's --help text, as a user sees it."""
    texts = {}
    for name in _subparsers():
        texts[name] = _help_text(name)
    return texts


def _help_text(name: str) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([name, "--help"]) == 0
    return out.getvalue()


def test_every_subcommand_is_walked():
    assert {"lab", "run", "serve", "calibrate", "bench", "config"} <= set(_subparsers())


def test_no_old_spelling_in_any_help(helps):
    for name, text in helps.items():
        for old in OLD_SPELLINGS:
            assert not re.search(rf"(?<![\w-]){re.escape(old)}(?![\w-])", text), (name, old)


def test_each_concept_has_one_spelling_and_one_meaning(helps):
    seen: dict[str, set[str]] = {}
    for name, parser in _subparsers().items():
        for action in _visible(parser):
            for concept, (strings, phrase) in CONCEPTS.items():
                if set(action.option_strings) & set(strings):
                    # Spelled in full wherever it appears (-m goes with --model) ...
                    assert tuple(action.option_strings) == strings, (name, concept)
                    # ... and meaning the same thing.
                    assert phrase in (action.help or ""), (name, concept, action.help)
                    seen.setdefault(concept, set()).add(name)
            # The help text shows every spelling where the flag is listed.
            assert all(s in helps[name] for s in action.option_strings), (name, action)
    # The table is not vacuous: the shared concepts are shared.
    assert {"lab", "run", "serve"} <= seen["sequences at once"]
    assert {"run", "serve", "calibrate"} <= seen["model file"] & seen["compute threads"]
    assert {"lab", "run", "serve", "bench"} <= seen["implementation"]
    assert {"lab", "run", "serve"} <= seen["admission policy"]
    assert {"lab", "run", "serve"} <= seen["step token budget"] & seen["prefill chunk"]


def test_a_flag_means_the_same_in_every_subcommand():
    meanings: dict[str, dict[str, str]] = {}
    for name, parser in _subparsers().items():
        for action in _visible(parser):
            for option in action.option_strings:
                meanings.setdefault(option, {})[name] = _meaning(action)
    for option, by_command in meanings.items():
        assert len(set(by_command.values())) == 1, (option, by_command)


def test_choices_are_one_vocabulary():
    parsers = _subparsers()
    for name in ("lab", "run", "serve"):
        action = next(a for a in parsers[name]._actions if "--policy" in a.option_strings)
        for policy in selection.POLICIES:
            assert action.type(policy) == policy
    for name in ("lab", "run", "serve", "bench"):
        action = next(a for a in parsers[name]._actions if "--scheduler" in a.option_strings)
        assert tuple(action.choices) == selection.IMPLEMENTATIONS


def test_every_flag_has_help_and_a_stated_default():
    for name, parser in _subparsers().items():
        for action in _visible(parser):
            assert action.help, (name, action.option_strings)
            # A value-taking flag with a default says what it is, "(default: x)" or "(x)"
            # at the end; one whose default is None does nothing unless it is given.
            if action.nargs != 0 and action.default is not None:
                assert "default" in action.help or action.help.rstrip().endswith(")"), \
                    (name, action.option_strings, action.help)


def _default(parser: argparse.ArgumentParser, option: str):
    return next(a for a in parser._actions if option in a.option_strings).default


def test_same_defaults_unless_the_help_says_why():
    parsers = _subparsers()
    shared = ("--max-active", "--max-num-batched-tokens", "--prefill-chunk", "--mixed",
              "--max-consecutive-prefill", "--threads", "--policy", "--planning-rule",
              "--itl-target-ms", "--prefill-age-max-ms", "--inflight", "--kv-type", "--seed",
              "--scheduler")
    for option in shared:
        assert _default(parsers["run"], option) == _default(parsers["serve"], option), option
    for (name, option), reason in DEFAULT_REASONS.items():
        action = next(a for a in parsers[name]._actions if option in a.option_strings)
        assert reason in action.help, (name, option, action.help)


OLD = [
    ("lab", ["--suite", "--chunk", "64"], ["--suite", "--prefill-chunk", "64"], "prefill_chunk"),
    ("lab", ["--backend", "twin"], ["--scheduler", "twin"], "scheduler"),
    ("lab", ["--twin"], ["--scheduler", "twin"], "scheduler"),
    ("run", ["--admission", "fcfs"], ["--policy", "fcfs"], "policy"),
    ("run", ["--policy", "cache-aware"], ["--policy", "cache-aware-aging"], "policy"),
    ("run", ["--max-tokens-per-iteration", "64"], ["-b", "64"], "max_num_batched_tokens"),
    ("serve", ["--batch-size", "64"], ["--max-num-batched-tokens", "64"],
     "max_num_batched_tokens"),
    ("serve", ["--model-name", "x"], ["--alias", "x"], "served_model_name"),
    ("bench", ["--no-twin"], ["--scheduler", "native"], "scheduler"),
]


@pytest.mark.parametrize("sub, old, new, dest", OLD, ids=[" ".join([o[0], *o[1]]) for o in OLD])
def test_old_spellings_still_parse_and_say_they_are_deprecated(capsys, sub, old, new, dest):
    parser = build_parser()
    then = parser.parse_args([sub, *old])
    err = capsys.readouterr().err
    assert "deprecated" in err and "next release" in err and len(err.splitlines()) == 1
    now = parser.parse_args([sub, *new])
    assert capsys.readouterr().err == ""
    assert getattr(then, dest) == getattr(now, dest)


def test_old_lab_mode_spelling_runs_the_same_modes(capsys):
    old = main(["lab", "--suite", "--requests", "60", "--mode", "phase", "--policy", "fcfs"])
    old_out, old_err = capsys.readouterr()
    new = main(["lab", "--suite", "--requests", "60", "--no-mixed", "--policy", "fcfs"])
    new_out, new_err = capsys.readouterr()
    assert old == new == 0 and "--mode is deprecated" in old_err and new_err == ""
    strip = lambda text: [line.rsplit("\t", 1)[0] for line in text.splitlines()]  # wall_s
    assert strip(old_out) == strip(new_out) and "fcfs\tphase\t" in new_out


def test_every_policy_name_runs_natively_and_in_the_twin():
    from skippy_scheduler import Sequence, SchedulerConfig

    for implementation in selection.IMPLEMENTATIONS:
        for policy in selection.POLICIES:
            scheduler = selection.make_scheduler(SchedulerConfig(), policy=policy,
                                                 implementation=implementation)
            scheduler.submit(Sequence("a", [1, 2, 3], max_tokens=1))
            assert scheduler.plan_iteration().sequence_ids == ["a"], (implementation, policy)
    with pytest.raises(ValueError, match="unknown policy 'lifo'"):
        selection.make_admission("lifo")
    with pytest.raises(ValueError, match="unknown scheduler implementation"):
        selection.scheduler_class("gpu")


def test_a_trace_replays_one_planning_mode(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 8, "output_length": 2, '
                     '"hash_ids": [0]}\n')
    assert main(["lab", "--trace", str(trace), "--mode", "phase", "--mode", "mixed"]) == 2
    err = capsys.readouterr().err
    assert "--mode is deprecated" in err and "one planning mode at a time" in err
    assert main(["lab", "--trace", str(trace), "--mode", "phase", "--mixed"]) == 2
    assert "--mode is the old spelling of --mixed/--no-mixed: give one" in \
        capsys.readouterr().err


# -- an option is read as typed in full; llama-server's flags mean the same here or say why -----


def test_every_parser_reads_options_only_in_full():
    parser = build_parser()
    assert parser.allow_abbrev is False
    for name, sub in parser.commands.items():
        assert sub.allow_abbrev is False, name


def test_bench_scripts_read_options_only_in_full():
    bench = pathlib.Path(__file__).resolve().parents[2] / "bench"
    parsers = 0
    for path in sorted(bench.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            called = node.func.attr if isinstance(node.func, ast.Attribute) else \
                getattr(node.func, "id", None)
            if called in ("ArgumentParser", "add_parser"):  # a subparser does not inherit it
                parsers += 1
                given = {k.arg: k.value for k in node.keywords}
                flag = given.get("allow_abbrev")
                assert isinstance(flag, ast.Constant) and flag.value is False, \
                    f"{path.name}:{node.lineno}: {called} without allow_abbrev=False"
    assert parsers > 20


# (arguments, what the error must say): each was once read as another flag by its prefix.
GUESSES = [
    (["serve", "--max-tokens", "5"], "--max-tokens is the tokens generated per request"),
    (["serve", "-n", "64"], "-n is llama-server's tokens to generate"),
    (["lab", "-n", "64"], "-n is llama-server's tokens to generate"),
    (["lab", "--suite", "--req", "5"], "unrecognized arguments: --req 5"),
    (["run", "--max-tok", "5"], "unrecognized arguments: --max-tok 5"),
    (["serve", "-ctk", "f16"], "-ctk is llama-server's K cache type"),
    (["run", "-c4096"], "unrecognized arguments: -c4096"),
    (["calibrate", "-nocb"], "continuous batching, which is always on here"),
]


@pytest.mark.parametrize("argv, message", GUESSES, ids=[" ".join(g[0]) for g in GUESSES])
def test_no_option_is_guessed_from_a_prefix(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "deprecated" not in err, err
    assert len(err.splitlines()) == 2  # the usage line and the reason


def test_run_reads_n_as_llama_server_does():
    parser = build_parser()
    assert parser.parse_args(["run", "-n", "5"]).max_tokens == 5
    assert parser.parse_args(["run", "-kvu"]).kv_unified is True
    assert parser.parse_args(["serve", "-a", "x,y"]).served_model_name == ("x", "y")


def _takes_no_required_argument(parser: argparse.ArgumentParser) -> bool:
    return not any(a.required for a in parser._actions)


def test_llama_server_flags_are_taken_or_refused_with_the_reason(capsys):
    walked = set()
    for name, parser in _subparsers().items():
        if not _takes_no_required_argument(parser):
            continue  # argparse names the missing arguments first
        walked.add(name)
        for flag, reason in LLAMA_SERVER_FLAGS.items():
            if flag in parser._option_string_actions:
                continue  # an option here: CONCEPTS checks that it means what it means there
            assert main([name, flag, "1"]) == 2, (name, flag)
            err = capsys.readouterr().err
            assert f"error: {flag} {reason}" in err, (name, flag, err)
    assert {"lab", "run", "serve", "calibrate"} <= walked


def test_docs_list_every_refused_llama_server_flag():
    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    section = text.split("**llama-server's flags.**", 1)[1]
    for flag in LLAMA_SERVER_FLAGS:
        assert f"`{flag}`" in section, flag


def test_help_lines_break_at_spaces_only(monkeypatch):
    """A flag's name or a path in a help text is never split at a hyphen across lines."""
    monkeypatch.setenv("COLUMNS", "80")
    for name in _subparsers():
        text = _help_text(name)
        broken = re.findall(r"\S*[A-Za-z0-9]-\n\s*\S+", text)
        assert not broken, (name, broken[:3])
