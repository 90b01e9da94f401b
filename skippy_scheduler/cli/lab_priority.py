"""`skippy-scheduler lab --suite --priority-scenario`: the priority scenario's three rules
(skippy_scheduler/lab/priority.py, docs/lab.md), one table row per rule as it finishes; an
interrupted run writes its --json for the rules that finished."""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Any, Optional

from ..lab.backend import Backend
from ..lab.model import StepCost
from ..lab.priority import (PriorityScenario, RULES, format_priority_table,
                            run_priority_scenario)
from ..lab.suite import MODES, SuiteOptions
from ._common import CommandError, check_output_file
from .interrupt import Interrupted, saving
from .lab_runs import Saved, _overrides, finish, interrupted, json_writer

_SCENARIO = {"requests": "requests", "seed": "seed", "rate": "rate",
             "priority_share": "urgent_share"}
_OPTIONS = {"max_active": "max_active", "max_num_batched_tokens": "max_tokens",
            "prefill_chunk": "chunk"}


def run_priority_command(args: argparse.Namespace, modes: Optional[list[str]],
                         cost: StepCost, backend: Backend) -> int:
    if modes is not None and len(modes) > 1:
        raise CommandError("--priority-scenario runs one planning mode (--mixed or --no-mixed)")
    for mode in modes or ():
        # Checked before anything is printed. The slack rule is not one of them: --slack is
        # refused here, and so is the inter-token target it plans to (--itl-target-ms).
        if mode not in MODES:
            raise CommandError(f"--priority-scenario runs mixed or phase planning (--mixed or "
                               f"--no-mixed): mode {mode!r} does not apply to it"
                               if mode == "slack" else
                               f"unknown mode {mode!r} (choose from {', '.join(MODES)})")
    for flag, dest in (("--families", "families"), ("--family-share", "family_share"),
                       ("--kv-capacity-tokens", "kv_capacity_tokens"), ("--plot", "plot"),
                       ("--reserve-output-tokens", "reserve_output_tokens"),
                       ("--tails", "tails"), ("--slack", "slack"),
                       ("--requests-out", "requests_out"),
                       ("--ttft-target-ms", "ttft_target_ms"),
                       ("--itl-target-ms", "itl_target_ms")):
        if getattr(args, dest, None) is not None:
            raise CommandError(f"{flag} does not apply to --priority-scenario")
    check_output_file("--json", args.json,
                      [("--cost-model", getattr(args, "cost_model", None))])
    fields = _overrides(args, _SCENARIO)
    if modes:
        fields["mode"] = modes[0]
    if args.policy:
        fields["policy"] = args.policy[0]
    try:
        scenario = replace(PriorityScenario(), **fields)
        scenario.spec()  # validated before anything runs
        options = replace(SuiteOptions(), **_overrides(args, _OPTIONS)).validate()
    except (ValueError, TypeError) as exc:
        raise CommandError(str(exc)) from None
    out = sys.stdout
    out.write(f"# priority scenario backend={backend.name} "
              + " ".join(f"{k}={v}" for k, v in scenario.as_dict().items())
              + f" max_active={options.max_active}\n")
    out.write(format_priority_table([]))
    out.flush()

    finished: list[Any] = []

    def emit(run: Any) -> None:
        finished.append(run)
        out.write(format_priority_table([run], header=False))
        out.flush()

    def document(runs: list[Any]) -> dict[str, Any]:
        return {"backend": backend.name, "cost_model": cost.lab_dict(),
                "scenario": scenario.as_dict(), "runs": [r.figures for r in runs]}

    stopped: Optional[Interrupted] = None
    saved = Saved()
    try:
        run_priority_scenario(scenario, RULES, options, cost, backend=backend, on_run=emit)
    except Interrupted as stop:
        if len(finished) < len(RULES):
            with saving():  # with nothing finished too: a script waiting for the file gets one
                saved.write("--json", args.json,
                            json_writer(interrupted(document(finished), stop)))
            raise stop.keeping(f"{len(finished)} of {len(RULES)} rules printed"
                               + saved.kept()) from None
        stopped = stop  # after the last rule: the file is whole all the same
    with saving():  # every rule ran: a signal now cannot cut the file short
        saved.write("--json", args.json, json_writer(document(finished)))
    return finish(saved, stopped, f"all {len(RULES)} rules printed")
