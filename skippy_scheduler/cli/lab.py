"""`skippy-scheduler lab`: reference scenarios (§5.5-§5.8) and, with --suite, the workload suite."""
from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

from ..lab.backend import BACKENDS, BackendUnavailable, resolve_backend
from ..lab.model import RuntimeCostModel
from ..lab.progress import Progress
from ..lab.report import dump_json, format_replay, format_table, lab_document
from ..lab.scenarios import SCENARIO_NAMES, get_scenario, replay_all, run_scenario
from ..lab.suite import MODES, POLICIES, SuiteOptions, format_suite, run_suite
from ..lab.workload import WorkloadSpec, generate
from ._common import CommandError, check_output_dir, check_output_file, non_negative_int

# Suite options: argparse destination -> WorkloadSpec field / SuiteOptions field.
_SPEC_OPTIONS = {"requests": "requests", "seed": "seed", "rate": "rate", "families": "families",
                 "family_share": "family_share", "priority_share": "priority_share"}
_RUN_OPTIONS = {"max_active": "max_active", "max_tokens": "max_tokens", "chunk": "chunk",
                "kv_capacity_tokens": "kv_capacity_tokens",
                "reserve_output_tokens": "reserve_output_tokens",
                "ttft_target_ms": "ttft_target_ms", "itl_target_ms": "itl_target_ms"}
# Options that only one of the two modes reads: given to the other, they are a mistake.
_SCENARIO_ONLY = {"scenario": "--scenario", "trace": "--trace", "replay": "--replay"}
_SUITE_ONLY = {"policy": "--policy", "mode": "--mode", "plot": "--plot"}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "lab", help="deterministic scheduler lab (reference scenarios, workload suite)",
        usage="%(prog)s [--list | --scenario NAME ... | --suite [SUITE OPTIONS]] [OPTIONS]",
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
    p.add_argument("--bench-reps", type=non_negative_int, default=200, metavar="N",
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


def _cost(spec: str | None) -> RuntimeCostModel:
    if spec is None:
        return RuntimeCostModel()
    # `RuntimeCostModel.parse` reads an existing path as a file and anything else as overrides;
    # a path that is not there would otherwise be reported as a malformed override.
    looks_like_path = "=" not in spec and (os.sep in spec or spec.endswith(".json"))
    if looks_like_path and not os.path.exists(spec):
        raise CommandError(f"--cost-model: file not found: {spec}")
    if os.path.isdir(spec):
        raise CommandError(f"--cost-model: {spec} is a directory")
    try:
        return RuntimeCostModel.parse(spec)
    except json.JSONDecodeError as exc:
        raise CommandError(f"--cost-model: {spec} is not valid JSON ({exc})") from None
    except OSError as exc:
        raise CommandError(f"--cost-model: cannot read {spec}: {exc.strerror}") from None
    except (ValueError, TypeError) as exc:
        raise CommandError(f"--cost-model: {exc}") from None


def _backend(name: str):
    try:
        return resolve_backend(name)
    except BackendUnavailable as exc:
        raise CommandError(str(exc)) from None


def _refuse(args, options: dict, why: str) -> None:
    for dest, flag in options.items():
        if getattr(args, dest):
            raise CommandError(f"{flag} {why}")


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)


def run(args) -> int:
    if args.list:
        print("\n".join(SCENARIO_NAMES))
        return 0
    if args.suite:
        _refuse(args, _SCENARIO_ONLY, "applies to the reference scenarios, not to --suite")
        return _run_suite(args, _cost(args.cost_model), _backend(args.backend))
    _refuse(args, _SUITE_ONLY, "needs --suite")
    cost = _cost(args.cost_model)
    backend = _backend(args.backend)
    try:
        scenarios = [get_scenario(name) for name in (args.scenario or SCENARIO_NAMES)]
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    check_output_file("--trace", args.trace)
    check_output_file("--json", args.json)
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


def _overrides(args, names: dict) -> dict:
    return {field: getattr(args, arg) for arg, field in names.items()
            if getattr(args, arg) is not None}


def _run_suite(args, cost: RuntimeCostModel, backend) -> int:
    policies = args.policy or list(POLICIES)
    modes = args.mode or list(MODES)
    for name in policies:
        if name not in POLICIES:
            raise CommandError(f"unknown policy {name!r} (choose from {', '.join(POLICIES)})")
    for name in modes:
        if name not in MODES:
            raise CommandError(f"unknown mode {name!r} (choose from {', '.join(MODES)})")
    check_output_file("--json", args.json)
    check_output_dir("--plot", args.plot)
    if args.plot:
        from ..lab.plot import PlotUnavailable, _pyplot

        try:
            _pyplot()
        except PlotUnavailable as exc:
            raise CommandError(str(exc)) from None
    try:
        spec = replace(WorkloadSpec(), **_overrides(args, _SPEC_OPTIONS)).validate()
        options = replace(SuiteOptions(), record_series=bool(args.plot),
                          **_overrides(args, _RUN_OPTIONS))
        for name in ("max_active", "max_tokens", "chunk"):
            if getattr(options, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if options.kv_capacity_tokens < 0 or options.reserve_output_tokens < 0:
            raise ValueError("memory options must be >= 0")
    except (ValueError, TypeError) as exc:
        raise CommandError(str(exc)) from None
    workload = generate(spec)
    out = sys.stdout
    out.write(f"# backend={backend.name} seed={spec.seed} rate={spec.rate}/s "
              f"max_active={options.max_active} max_tokens={options.max_tokens} "
              f"chunk={options.chunk} kv_capacity_tokens={options.kv_capacity_tokens}\n")
    out.write("# workload " + " ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"
                                       for k, v in workload.summary().items()) + "\n")
    out.write("\t".join(format_suite([]).splitlines()[0].split("\t")) + "\n")
    out.flush()

    def emit(run) -> None:
        out.write(format_suite([run]).splitlines()[1] + "\n")
        out.flush()

    runs = run_suite(workload, policies, modes, options, cost, backend=backend, on_run=emit)
    if args.json:
        document = {"backend": backend.name, "cost_model": cost.as_dict(),
                    "workload": {**spec.as_dict(), **workload.summary()},
                    "options": {k: v for k, v in options.__dict__.items()},
                    "runs": [run.figures for run in runs]}
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(document, fh, indent=2)
            fh.write("\n")
    if args.plot:
        from ..lab.plot import plot_suite

        for path in plot_suite(runs, args.plot):
            print(f"# wrote {path}", file=sys.stderr)
    return 0
