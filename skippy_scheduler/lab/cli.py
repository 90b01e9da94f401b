"""The `lab` subcommand: reference scenarios (§5.5-§5.8) and the workload suite."""
from __future__ import annotations

import argparse
import json
import sys

from ..cli import CommandError
from .backend import BACKENDS, BackendUnavailable, resolve_backend
from .model import RuntimeCostModel
from .progress import Progress
from .report import dump_json, format_replay, format_table, lab_document
from .scenarios import SCENARIO_NAMES, get_scenario, replay_all, run_scenario


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
    return value


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "lab", help="deterministic scheduler lab (reference scenarios, workload suite)",
        description="Drive the scheduler under a virtual cost model. Without --suite, print the "
                    "reference scenario table (tab-separated).")
    p.add_argument("--scenario", action="append", metavar="NAME",
                   help=f"run only this scenario (repeatable): {', '.join(SCENARIO_NAMES)}")
    p.add_argument("--list", action="store_true", help="list the scenario names and exit")
    p.add_argument("--trace", metavar="FILE", help="write the per-iteration trace to FILE")
    p.add_argument("--json", metavar="FILE", help="write every figure (and per-request metrics) "
                                                  "as JSON to FILE")
    p.add_argument("--cost-model", metavar="SPEC",
                   help="override cost constants: name=value,... or a JSON file path "
                        "(iteration_overhead_us, prefill_token_us, decode_batch_us, "
                        "decode_sequence_us)")
    p.add_argument("--bench-reps", type=_positive_int, default=200, metavar="N",
                   help="extra runs per scenario used only to time the simulator (default 200)")
    p.add_argument("--replay", action="store_true",
                   help="also print the fixture replay switch counts (§5.8)")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="scheduler implementation (auto = native when available)")
    p.add_argument("--twin", action="store_const", dest="backend", const="twin",
                   help="drive the pure-Python TwinScheduler (same as --backend twin)")
    s = p.add_argument_group("workload suite (--suite)")
    s.add_argument("--suite", action="store_true", help="run the seeded workload suite")
    s.add_argument("--requests", type=int, default=1_000, help="number of requests (100-100000)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--rate", type=float, default=None, help="Poisson arrival rate, requests/s")
    s.add_argument("--families", type=int, default=None, help="number of prompt families")
    s.add_argument("--family-share", type=float, default=None,
                   help="fraction of requests that belong to a family")
    s.add_argument("--priority-share", type=float, default=None,
                   help="fraction of requests with priority 1")
    s.add_argument("--max-active", type=int, default=None)
    s.add_argument("--max-tokens", type=int, default=None, help="max tokens per iteration")
    s.add_argument("--chunk", type=int, default=None, help="prefill chunk tokens")
    s.add_argument("--kv-capacity-tokens", type=int, default=None,
                   help="KV cells of the modelled memory component (0 = none); small values "
                        "force preemption")
    s.add_argument("--reserve-output-tokens", type=int, default=None,
                   help="output tokens reserved at admission when memory is modelled")
    s.add_argument("--policy", action="append", metavar="NAME",
                   help="admission policy (repeatable): fcfs, cache-aware-noaging, "
                        "cache-aware-aging, priority (default: all)")
    s.add_argument("--mode", action="append", metavar="MODE",
                   help="planning mode (repeatable): phase, mixed (default: both)")
    s.add_argument("--ttft-target-ms", type=float, default=None, help="goodput TTFT target")
    s.add_argument("--itl-target-ms", type=float, default=None,
                   help="goodput target for a request's mean inter-token gap")
    s.add_argument("--plot", metavar="DIR", help="write PNG plots of the suite into DIR")
    p.set_defaults(func=run)


def _cost(args) -> RuntimeCostModel:
    if not args.cost_model:
        return RuntimeCostModel()
    try:
        return RuntimeCostModel.parse(args.cost_model)
    except (ValueError, TypeError, OSError, json.JSONDecodeError) as exc:
        raise CommandError(f"--cost-model: {exc}") from exc


def _backend(args):
    try:
        return resolve_backend(args.backend)
    except BackendUnavailable as exc:
        raise CommandError(str(exc)) from exc


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)


def run(args) -> int:
    if args.list:
        print("\n".join(SCENARIO_NAMES))
        return 0
    if args.suite:
        from .suite_cli import run_suite_command

        return run_suite_command(args, _cost(args), _backend(args))
    cost = _cost(args)
    backend = _backend(args)
    try:
        scenarios = [get_scenario(name) for name in (args.scenario or SCENARIO_NAMES)]
    except ValueError as exc:
        raise CommandError(str(exc)) from exc
    results = []
    bar = Progress(len(scenarios), "lab")
    for scenario in scenarios:
        results.append(run_scenario(scenario, cost, backend=backend, bench_reps=args.bench_reps,
                                    trace=bool(args.trace)))
        bar.update(len(results))
    bar.close()
    sys.stdout.write(format_table(results))
    replay = replay_all(cost, backend=backend) if (args.replay or args.json) else []
    if args.replay:
        sys.stdout.write("\n" + format_replay(replay))
    if args.trace:
        _write(args.trace, "".join(line + "\n" for r in results for line in r.trace))
    if args.json:
        _write(args.json, dump_json(lab_document(results, replay, cost, backend.name)))
    return 0
