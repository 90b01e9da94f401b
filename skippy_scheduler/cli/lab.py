"""`skippy-scheduler lab`: the reference scenarios (docs/behaviour.md §5.5-§5.8), with --suite
the workload suite, with --trace FILE the replay of a production request trace, and with
--pipeline-stages the staged pipeline (`lab_stages.py`).

This module holds the parser, the checks that pick one of the four runs, and the reference
scenarios; `lab_runs.py` runs the suite and the trace replay. Every output is checked before
the run starts; an interrupted run prints and writes what finished (`interrupt.py`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, TextIO

from .._validate import json_loads
from ..cost_model import LAB_NAMES, check_clock_cost
from ..lab.backend import BACKENDS, Backend, resolve_backend
from ..lab.model import LAB_COST, StepCost
from ..lab.progress import Progress
from ..lab.replay import DEFAULT_PREFIX_CACHE_TOKENS, ReplayOptions
from ..lab.report import dump_json, format_replay, format_table, lab_document
from ..lab.scenarios import SCENARIO_NAMES, get_scenario, replay_all, run_scenario
from ..lab.simulate import SimulationError
from ..lab.suite import SuiteOptions
from ..lab.traces import FORMATS
from ..lab.workload import MAX_FAMILIES, MAX_REQUESTS, WorkloadSpec
from ..selection import DEFAULT_IMPLEMENTATION
from ._common import (CommandError, check_distinct_outputs, check_output_file, fraction,
                      int_in, non_negative_int, non_negative_ms, positive_float, positive_int)
from .interrupt import Interrupted, saving
from .lab_runs import Saved, finish, interrupted, run_suite_command, run_trace_command
from .lab_stages import STAGED_ONLY, add_arguments as add_staged_arguments, run_staged_command
from .vocabulary import add_flag, add_old

# Options that only some runs read: given to another, they are a mistake.
_SCENARIO_ONLY = {"scenario": "--scenario", "iteration_trace": "--iteration-trace",
                  "replay": "--replay", "bench_reps": "--bench-reps"}
_SUITE_OR_TRACE = {"policy": "--policy", "plot": "--plot", "requests_out": "--requests-out",
                   "max_active": "--max-active", "max_num_batched_tokens":
                   "--max-num-batched-tokens", "prefill_chunk": "--prefill-chunk",
                   "kv_capacity_tokens": "--kv-capacity-tokens",
                   "reserve_output_tokens": "--reserve-output-tokens",
                   "ttft_target_ms": "--ttft-target-ms", "itl_target_ms": "--itl-target-ms",
                   "slack": "--slack", "tails": "--tails"}
_WORKLOAD_ONLY = {"requests": "--requests", "seed": "--seed", "rate": "--rate",
                  "families": "--families", "family_share": "--family-share",
                  "priority_share": "--priority-share", "priority_scenario": "--priority-scenario"}
_TRACE_ONLY = {"format": "--format", "time_scale": "--time-scale", "limit": "--limit",
               "slo": "--slo",
               "prefix_cache_tokens": "--prefix-cache-tokens", "tenants": "--tenants"}
_LAB_SIZE = "the lab models a larger accelerator than run and serve drive"
DEFAULT_BENCH_REPS = 200
# The largest cost model term the lab takes, µs (1 000 s a step, a token or a decode row): far
# above any runtime's (a calibrated model's terms are µs to tens of ms), and what keeps a run's
# sums of virtual time finite numbers (1e300 would not).
MAX_TERM_US = 1e9


class _MaxTokensInLab(argparse.Action):
    """`--max-tokens` is tokens per request everywhere; the lab's requests carry their own."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        parser.error("--max-tokens is the tokens generated per request, which the lab's "
                     "requests take from the workload or the trace; the step's token budget "
                     "(lab --max-tokens before this release) is -b/--max-num-batched-tokens")


def register(subparsers: Any) -> None:
    d, r, w = SuiteOptions(), ReplayOptions(), WorkloadSpec()
    p = subparsers.add_parser(
        "lab", help="deterministic scheduler lab (reference scenarios, workload suite, traces)",
        usage="%(prog)s [--list | --scenario NAME ... | --suite [SUITE OPTIONS] | "
              "--trace FILE [TRACE OPTIONS]] [OPTIONS]",
        description="Drive the scheduler under a virtual cost model, with no model. Without "
                    "--suite, --trace or --pipeline-stages, print the reference scenario "
                    "table: tab-separated, with no comment lines. --suite and "
                    "--pipeline-stages print tab-separated tables under '#' comment lines; "
                    "--trace prints its table under '#' comment lines too, aligned in "
                    "columns for reading.")
    p.add_argument("--scenario", action="append", metavar="NAME",
                   help=f"run only this scenario (repeatable): {', '.join(SCENARIO_NAMES)} "
                        "(default: all)")
    p.add_argument("--list", action="store_true", help="list the scenario names and exit")
    p.add_argument("--iteration-trace", metavar="FILE",
                   help="write the per-iteration trace of the scenarios to FILE "
                        "(docs/behaviour.md §5.7)")
    add_flag(p, "json", note="after Ctrl-C or SIGTERM, the runs that finished, marked "
                             "\"interrupted\": the signal")
    p.add_argument("--cost-model", metavar="SPEC",
                   help=f"cost constants, µs, each at most {MAX_TERM_US:g}: name=value,... "
                        "(iteration_overhead_us, "
                        "prefill_token_us, decode_batch_us, decode_sequence_us, or StepCost's "
                        "names for them: base_us, per_prefill_token_us, decode_base_us, "
                        "per_decode_row_us), a JSON file holding an object of them, or the "
                        "--json file of `skippy-scheduler calibrate` (default: 50,2,100,20 µs)")
    p.add_argument("--bench-reps", type=non_negative_int, default=None, metavar="N",
                   help="extra runs per scenario used only to time the simulator (default: "
                        f"{DEFAULT_BENCH_REPS})")
    p.add_argument("--replay", action="store_true",
                   help="also print the fixture replay switch counts (docs/behaviour.md §5.8)")
    # One group: given under two spellings, one choice would silently replace the other.
    which = p.add_mutually_exclusive_group()
    add_flag(which, "scheduler", default=DEFAULT_IMPLEMENTATION)
    add_old(which, "--backend", "--scheduler", "scheduler", choices=BACKENDS)
    add_old(which, "--twin", "--scheduler twin", "scheduler", const="twin", flag=True)
    p.add_argument("--max-tokens", nargs="?", action=_MaxTokensInLab, help=argparse.SUPPRESS)

    s = p.add_argument_group("workload suite (--suite)")
    s.add_argument("--suite", action="store_true", help="run the seeded workload suite")
    s.add_argument("--priority-scenario", action="store_true",
                   help="with --suite: the priority scenario instead (a saturating "
                        "background and a trickle of priority-1 requests, with a prefix store) "
                        "under admission order, preemption with recompute and preemption with "
                        "restore; --requests, --seed, --rate, --priority-share and the first "
                        "--policy apply (docs/lab.md)")
    s.add_argument("--requests", type=int_in(1, MAX_REQUESTS), default=None, metavar="N",
                   help=f"number of requests, 1-{MAX_REQUESTS} (default: {w.requests})")
    add_flag(s, "seed", type=non_negative_int, note="it draws the workload",
             default_text=str(w.seed))
    for flag, kind, metavar, text in (
            ("--rate", positive_float, "R",
             f"Poisson arrival rate, requests/s (default: {w.rate:g})"),
            ("--families", int_in(0, MAX_FAMILIES), "N",
             f"number of prompt families, 0-{MAX_FAMILIES} (default: {w.families})"),
            ("--family-share", fraction, "F", "fraction of requests that belong to a "
                                              f"family, 0-1 (default: {w.family_share:g})"),
            ("--priority-share", fraction, "F", "fraction of requests with priority 1, 0-1 "
                                                f"(default: {w.priority_share:g})")):
        s.add_argument(flag, type=kind, default=None, metavar=metavar, help=text)

    o = p.add_argument_group("scheduler and runtime model (--suite and --trace)")
    add_flag(o, "max-active", type=positive_int, note=_LAB_SIZE,
             default_text=str(d.max_active))
    add_flag(o, "batch-tokens", type=positive_int,
             note=_LAB_SIZE, default_text=str(d.max_tokens))
    add_flag(o, "prefill-chunk", type=positive_int,
             note=_LAB_SIZE, default_text=str(d.chunk))
    add_flag(o, "mixed", note="the suite runs both unless one is given, to compare them",
             default_text="on with --trace; both with --suite")
    add_old(o, "--mode", "--mixed/--no-mixed", "mode", repeat=True)
    add_flag(o, "policy", action="append",
             note="repeatable; fair-share needs tenants (--trace with --tenants or a tenant "
                  "field) to differ from cache-aware-aging",
             default_text="all but fair-share with --suite, all with --trace")
    both = "with --suite, {} with --trace)"
    for flag, number, metavar, text in (
            ("--kv-capacity-tokens", non_negative_int, "N",
             "KV cells of the modelled memory component, 0 for none; small values force "
             f"preemption (default: {d.kv_capacity_tokens})"),
            ("--reserve-output-tokens", non_negative_int, "N", "output tokens reserved at "
             f"admission when memory is modelled (default: {d.reserve_output_tokens})"),
            ("--ttft-target-ms", non_negative_ms, "MS", "goodput target for the time to "
             f"first token (default: {d.ttft_target_ms:g} "
             + both.format(f"{r.ttft_target_ms:g}")),
            ("--itl-target-ms", non_negative_ms, "MS", "inter-token target in ms; the goodput "
             f"bound on a request's mean inter-token gap (default: {d.itl_target_ms:g} "
             + both.format(f"{r.itl_target_ms:g}"))):
        o.add_argument(flag, type=number, default=None, metavar=metavar, help=text)
    o.add_argument("--slack", action="store_true", default=None,
                   help="run the slack-sized planning rule (docs/behaviour.md §2.13; its "
                        "inter-token target is --itl-target-ms): with --suite as a third mode "
                        "beside phase and mixed, with --trace instead of the mixed rule; "
                        "implies --tails")
    o.add_argument("--tails", action="store_true", default=None,
                   help="after the table, print the tails: max inter-token gap and stalls "
                        "(gaps above --itl-target-ms) per request and per tenant (--trace) or "
                        "priority class (--suite); --json then holds them too")
    o.add_argument("--plot", metavar="DIR",
                   help="write PNG plots of the suite or replay into DIR (needs matplotlib)")
    o.add_argument("--requests-out", metavar="FILE",
                   help="write one JSON line per request and run (policy, mode): its index "
                        "and id, and its times in µs of virtual time (arrival, first "
                        "scheduled, first token, completed), tokens generated and restored")

    t = p.add_argument_group("trace replay (--trace FILE)")
    t.add_argument("--trace", metavar="FILE",
                   help="replay a request trace (Mooncake JSONL, Azure CSV or BurstGPT CSV): a "
                        "regular file, as it is read more than once")
    t.add_argument("--format", choices=("auto",) + FORMATS, default=None,
                   help="trace format (default: auto, from the first line)")
    t.add_argument("--time-scale", type=positive_float, default=None, metavar="F",
                   help="multiply every arrival time by F (0.25 = four times the rate; "
                        "default: 1)")
    t.add_argument("--limit", type=positive_int, default=None, metavar="N",
                   help="replay only the first N requests (default: all)")
    add_flag(t, "prefix-cache-tokens", type=_cache_tokens,
             note="here the size of the modelled prefix cache, 'unlimited' for no bound",
             default_text=str(DEFAULT_PREFIX_CACHE_TOKENS))
    t.add_argument("--slo", action="store_true", default=None,
                   help="tell the scheduler the goodput targets as every request's SLO: a "
                        "first-token deadline --ttft-target-ms after its arrival and an "
                        "inter-token target of --itl-target-ms (needs --slack, which plans to "
                        "it and orders prefill by the deadlines); the share within the SLO "
                        "is printed per policy")
    t.add_argument("--tenants", type=positive_int, default=None, metavar="K",
                   help="spread requests over K tenants by a stable hash of their id, "
                        "replacing a tenant field of the trace (default: the trace's own)")
    add_staged_arguments(p)
    p.set_defaults(func=run, run_flags=_run_flags(p))


def _run_flags(p: argparse.ArgumentParser) -> dict[str, tuple[str, Any]]:
    """Every option of `p` but --list and --help, by destination: (its flag, its default). An
    old spelling (default SUPPRESS: set only when given) stands for its destination only where
    no current flag has it (--mode)."""
    flags: dict[str, tuple[str, Any]] = {}
    for action in p._actions:
        if not action.option_strings or action.dest in ("help", "list"):
            continue
        flag = "/".join(s for s in action.option_strings if s.startswith("--"))
        if action.default is argparse.SUPPRESS:
            flags.setdefault(action.dest, (flag, action.default))
        else:
            flags[action.dest] = (flag, action.default)
    return flags


def _cache_tokens(text: str) -> int | str:
    if text.strip().lower() in ("unlimited", "inf", "none"):
        return "unlimited"
    return non_negative_int(text)


# The terms a --cost-model names: the lab's names, or StepCost's for the same four terms.
_TERMS = (f"{', '.join(LAB_NAMES)} (or StepCost's names for them: "
          f"{', '.join(LAB_NAMES.values())})")


def _terms(spec: str) -> str:
    """`spec` if it names a term, each once; an empty spec would quietly mean the default
    model, which --cost-model not given already means: it is a mistake (a wrong file, a lost
    edit), and so is a term given twice, of which only the last would count."""
    names = [part.partition("=")[0].strip() for part in spec.split(",") if part.strip()]
    if not names:
        raise ValueError(f"{spec!r} names no cost model term; expected name=value,... "
                         f"with one or more of {_TERMS}")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"{spec!r} gives {', '.join(repeated)} more than once; give each "
                         "term once")
    return spec


def _cost_object(empty: str, data: dict[str, Any]) -> StepCost:
    """`data`'s terms over the lab's model; `empty` says where the object is, if it is empty."""
    if not data:
        raise ValueError(f"{empty}, which names no cost model term; expected one or more of "
                         f"{_TERMS}")
    return StepCost.from_mapping(data, LAB_COST, max_us=MAX_TERM_US)


def _cost_document(spec: str) -> StepCost:
    """A JSON file: an object of cost model terms, or `calibrate --json`'s document."""
    with open(spec, encoding="utf-8") as fh:
        data = json_loads(fh.read())
    if isinstance(data, dict) and "cost_model" in data and "shapes" in data:
        model = data["cost_model"]  # calibrate's document: the fitted model, as --cost-model
        problems = data.get("problems")
        if problems:
            if not isinstance(problems, list):  # one problem, not a list of them
                problems = [problems]
            print(f"skippy-scheduler lab: warning: {spec}: the calibration reported problems "
                  f"({'; '.join(map(str, problems))})", file=sys.stderr)
        if isinstance(model, str):
            return StepCost.parse(_terms(model), LAB_COST, max_us=MAX_TERM_US)
        if isinstance(model, dict):
            return _cost_object(f"{spec}: cost_model is an empty object", model)
        raise ValueError(f"{spec}: cost_model must be name=value,... or an object")
    if not isinstance(data, dict):
        raise ValueError(f"{spec}: the cost model file must hold a JSON object")
    return _cost_object(f"{spec} holds an empty JSON object", data)


def cost_model(spec: str | None) -> StepCost:
    """The lab's cost model: `LAB_COST` with the terms `spec` names (see --cost-model)."""
    if spec is None:
        return LAB_COST
    looks_like_path = "=" not in spec and (os.sep in spec or spec.endswith(".json"))
    if looks_like_path and not os.path.exists(spec):
        raise CommandError(f"--cost-model: file not found: {spec}")
    if os.path.isdir(spec):
        raise CommandError(f"--cost-model: {spec} is a directory")
    try:
        cost = (_cost_document(spec) if os.path.exists(spec)
                else StepCost.parse(_terms(spec), LAB_COST, max_us=MAX_TERM_US))
        return check_clock_cost("the cost model", cost)
    except json.JSONDecodeError as exc:
        raise CommandError(f"--cost-model: {spec} is not valid JSON ({exc})") from None
    except RecursionError:
        raise CommandError(f"--cost-model: {spec} is not valid JSON (nested too deeply)") \
            from None
    except UnicodeDecodeError:
        raise CommandError(f"--cost-model: {spec} is not a text file") from None
    except OSError as exc:
        raise CommandError(f"--cost-model: cannot read {spec}: {exc.strerror}") from None
    except (ValueError, TypeError) as exc:
        raise CommandError(f"--cost-model: {exc}") from None


def _given(args: argparse.Namespace, options: dict[str, str], why: str) -> None:
    """Refuse any of `options` that was given (unset means None or False: 0 is a value)."""
    for dest, flag in options.items():
        value = getattr(args, dest, None)
        if value is not None and value is not False:
            raise CommandError(f"{flag} {why}")


def _refuse_modes(args: argparse.Namespace, why: str) -> None:
    """Refuse --mixed, --no-mixed (and the old --mode) in a run that has no planning mode."""
    if getattr(args, "mode", None) is not None or args.mixed is not None:
        raise CommandError(f"--mixed/--no-mixed {why}")


def _refuse_with_list(args: argparse.Namespace) -> None:
    """--list runs nothing: any other flag whose value is not its default would be ignored."""
    given = [flag for dest, (flag, default) in getattr(args, "run_flags", {}).items()
             if (hasattr(args, dest) if default is argparse.SUPPRESS
                 else getattr(args, dest, default) != default)]
    if given:
        raise CommandError(f"--list prints the scenario names and runs nothing: "
                           f"{', '.join(given)} does not apply")


def _modes(args: argparse.Namespace) -> list[str] | None:
    """The planning modes asked for: --mode (old) or --mixed/--no-mixed; None if neither."""
    old = getattr(args, "mode", None)
    if old is not None and args.mixed is not None:
        raise CommandError("--mode is the old spelling of --mixed/--no-mixed: give one")
    if old is not None:
        return list(dict.fromkeys(old))  # each once, as --policy: a repeat is not a second run
    slack = bool(getattr(args, "slack", None))
    if args.mixed is None:
        return ["slack"] if slack and args.trace else None
    return ["mixed" if args.mixed else "phase"] + (["slack"] if slack else [])


def run(args: argparse.Namespace) -> int:
    if args.list:
        _refuse_with_list(args)
        print("\n".join(SCENARIO_NAMES))
        return 0
    backend = resolve_backend(args.scheduler)
    if args.pipeline_stages is not None:
        if args.trace or args.suite:
            raise CommandError("--pipeline-stages is a run of its own: give it without "
                               "--suite or --trace")
        _given(args, {**_SCENARIO_ONLY, **_SUITE_OR_TRACE, **_WORKLOAD_ONLY, **_TRACE_ONLY},
               "does not apply to the staged pipeline (--pipeline-stages)")
        _refuse_modes(args, "does not apply to the staged pipeline (--pipeline-stages)")
        return run_staged_command(args, cost_model(args.cost_model), backend)
    _given(args, STAGED_ONLY, "needs --pipeline-stages")
    if args.trace is not None:
        if not args.trace:  # not the reference scenarios: what an empty output path is
            raise CommandError("--trace: empty path")
        if args.suite:
            raise CommandError("--trace and --suite are two different runs: give one")
        _given(args, _SCENARIO_ONLY, "applies to the reference scenarios, not to --trace")
        _given(args, _WORKLOAD_ONLY, "applies to the synthetic suite (--suite), not to --trace")
        return run_trace_command(args, _modes(args), cost_model(args.cost_model), backend)
    _given(args, _TRACE_ONLY, "needs --trace")
    if args.suite:
        _given(args, _SCENARIO_ONLY, "applies to the reference scenarios, not to --suite")
        return run_suite_command(args, _modes(args), cost_model(args.cost_model), backend)
    _refuse_modes(args, "needs --suite or --trace")
    _given(args, _SUITE_OR_TRACE, "needs --suite or --trace")
    _given(args, _WORKLOAD_ONLY, "needs --suite")
    return _run_scenarios(args, cost_model(args.cost_model), backend)


def _run_scenarios(args: argparse.Namespace, cost: StepCost, backend: Backend) -> int:
    try:
        # each once, as --policy: a scenario named twice is not two rows
        scenarios = [get_scenario(name)
                     for name in dict.fromkeys(args.scenario or SCENARIO_NAMES)]
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    inputs = [("--cost-model", getattr(args, "cost_model", None))]
    check_output_file("--iteration-trace", args.iteration_trace, inputs)
    check_output_file("--json", args.json, inputs)
    check_distinct_outputs(("--json", args.json), ("--iteration-trace", args.iteration_trace))
    reps = DEFAULT_BENCH_REPS if args.bench_reps is None else args.bench_reps
    results: list[Any] = []
    replay: list[Any] = []
    bar = Progress(len(scenarios), "lab")
    try:
        for scenario in scenarios:
            results.append(run_scenario(scenario, cost, backend=backend,
                                        bench_reps=reps,
                                        trace=bool(args.iteration_trace)))
            bar.update(len(results))
        bar.close()
        replay = replay_all(cost, backend=backend) if (args.replay or args.json) else []
    except SimulationError as exc:  # a run the cost model could not finish: one line
        bar.close()
        raise CommandError(f"the reference scenarios could not run: {exc}") from None
    except Interrupted as stop:
        bar.close()
        # With nothing finished too, as --suite and --trace do: the header, and a --json
        # document marked "interrupted" (a script waiting for the file gets one).
        with saving():
            saved = _save_scenarios(args, results, [], cost, backend, stop)
        raise stop.keeping(f"{len(results)} of {len(scenarios)} scenarios printed"
                           + saved.wrote() + " (no fixture replay)"
                           + "".join(f"; {failure}" for failure in saved.failed)) from None
    with saving():  # all ran: a signal now cannot cut the table or a file short
        saved = _save_scenarios(args, results, replay, cost, backend)
    return finish(saved, None, "")


def _save_scenarios(args: argparse.Namespace, results: list[Any], replay: list[Any],
                    cost: StepCost, backend: Backend, stop: Interrupted | None = None) -> Saved:
    """Print the table (and the replay) and write the outputs; `stop`: the interruption that
    ended the run early, which the --json document then names."""
    sys.stdout.write(format_table(results))
    if args.replay and replay:
        sys.stdout.write("\n" + format_replay(replay))
    sys.stdout.flush()
    saved = Saved()

    def trace(fh: TextIO) -> None:
        fh.writelines(line + "\n" for r in results for line in r.trace)

    saved.write("--iteration-trace", args.iteration_trace, trace)
    if args.json:
        document = lab_document(results, replay, cost, backend.name)
        text = dump_json(document if stop is None else interrupted(document, stop))

        def write(fh: TextIO) -> None:
            fh.write(text)

        saved.write("--json", args.json, write)
    return saved
