"""Formatting of lab results: the §5.6 table, the replay lines and the JSON document."""
from __future__ import annotations

import json
from typing import Any, Iterable

from .driver import LabRun
from .model import StepCost
from .scenarios import ReplayResult, ScenarioResult

COLUMNS = ("scenario", "requests", "makespan_ms", "request_s", "p95_queue_ms", "p50_ttft_ms",
           "p95_ttft_ms", "p95_latency_ms", "p95_max_itl_ms", "mean_batch",
           "mean_token_occupancy_pct", "prefill_iterations", "decode_iterations",
           "mixed_iterations", "bench_us_per_run")


def _ms(us: float) -> str:
    return f"{us / 1000:.3f}"


def format_row(result: ScenarioResult) -> list[str]:
    s = result.report.summary()
    bench = "-" if result.bench_us_per_run is None else f"{result.bench_us_per_run:.2f}"
    return [result.scenario.name, str(s["requests"]), _ms(s["makespan_us"]),
            f"{s['request_s']:.2f}", _ms(s["p95_queue_us"]), _ms(s["p50_ttft_us"]),
            _ms(s["p95_ttft_us"]), _ms(s["p95_latency_us"]), _ms(s["p95_max_itl_us"]),
            f"{s['mean_batch']:.2f}", f"{s['mean_token_occupancy'] * 100:.2f}",
            str(s["prefill_iterations"]), str(s["decode_iterations"]),
            str(s["mixed_iterations"]), bench]


def format_table(results: Iterable[ScenarioResult]) -> str:
    lines = ["\t".join(COLUMNS)]
    lines += ["\t".join(format_row(r)) for r in results]
    return "\n".join(lines) + "\n"


def format_replay(results: Iterable[ReplayResult]) -> str:
    lines = ["replay_profile\tmode\tswitches\texpected\tfamily_order"]
    for r in results:
        order = ",".join(str(family) for _, family, _ in r.service_order)
        lines.append(f"{r.profile}\t{r.mode}\t{r.switches}\t{r.expected}\t{order}")
    return "\n".join(lines) + "\n"


def lab_document(results: list[ScenarioResult], replay: list[ReplayResult],
                 cost: StepCost, backend: str) -> dict[str, Any]:
    """Everything the lab computed. Wall-clock figures live only under `bench_us_per_run`."""
    return {
        "backend": backend,
        "cost_model": cost.lab_dict(),
        "scenarios": [{
            "scenario": r.scenario.name,
            "config_overrides": dict(r.scenario.overrides),
            **r.report.as_dict(),
            "mean_token_occupancy_pct": r.report.mean_token_occupancy * 100,
            "table_row": dict(zip(COLUMNS[:-1], format_row(r)[:-1])),
            "bench_us_per_run": r.bench_us_per_run,
        } for r in results],
        "replay": [{
            "profile": r.profile, "mode": r.mode, "switches": r.switches,
            "expected": r.expected,
            "service_order": [{"first_scheduled_us": t, "family": f, "id": i}
                              for t, f, i in r.service_order],
        } for r in replay],
    }


def dump_json(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=2, sort_keys=False) + "\n"


# -- trace replay (`lab --trace FILE`) ---------------------------------------------------------

# (figure, header, width, format): one row per policy, aligned so that rows printed as each run
# finishes line up under the header.
TRACE_COLUMNS = (
    ("policy", "policy", 19, "s"),
    ("p50_queue_ms", "queue p50", 9, ".1f"),
    ("p90_queue_ms", "p90", 8, ".1f"),
    ("p99_queue_ms", "p99", 8, ".1f"),
    ("p50_ttft_ms", "TTFT p50", 9, ".1f"),
    ("p90_ttft_ms", "p90", 8, ".1f"),
    ("p99_ttft_ms", "p99", 8, ".1f"),
    ("p50_itl_ms", "gap p50", 8, ".2f"),
    ("p99_itl_ms", "p99", 7, ".2f"),
    ("output_tokens_per_s", "out tok/s", 9, ".0f"),
    ("goodput_rps", "goodput/s", 9, ".2f"),
    ("hit_rate", "hit rate", 8, ".1%"),  # a percent, as docs/lab.md and the plot give it
    ("evictions", "evictions", 9, "d"),
    ("stale_refreshes", "stale", 6, "d"),
    ("preemptions", "preempt", 7, "d"),
    ("utilisation", "util", 5, ".2f"),
    ("jain_index", "Jain", 5, ".3f"),
    ("wall_s", "wall s", 6, ".1f"),
)
TRACE_UNITS = ("queue wait, TTFT and inter-token gap in ms of virtual time (nearest-rank "
               "percentiles); out tok/s and goodput/s per second of virtual time; hit rate = "
               "prompt tokens restored from the prefix cache at first admission / prompt "
               "tokens, in percent (--json hit_rate: the fraction); stale = stale "
               "affinity refreshes; util = busy virtual time / makespan; Jain = fairness of "
               "per-tenant service while the trace arrives (- with one tenant); wall s = "
               "real seconds the replay took")


def _cell(value: Any, width: int, fmt: str) -> str:
    if value is None:
        text = "-"
    elif fmt == "s":
        return f"{value:<{width}}"
    else:
        text = format(value, fmt)
    return f"{text:>{width}}"


def format_trace_header() -> str:
    return "  ".join(f"{head:<{w}}" if fmt == "s" else f"{head:>{w}}"
                     for _, head, w, fmt in TRACE_COLUMNS)


def format_trace_row(figures: dict[str, Any]) -> str:
    return "  ".join(_cell(figures.get(name), w, fmt) for name, _, w, fmt in TRACE_COLUMNS)


def format_tenant_table(runs: Iterable[LabRun]) -> str:
    """Per-tenant service (tokens computed per second while the trace arrives), one row per
    policy; empty with a single tenant."""
    runs = [r for r in runs if r.figures.get("tenant_service_tokens_per_s")]
    if not runs:
        return ""
    names = list(runs[0].figures["tenant_service_tokens_per_s"])
    lines = [_tenant_title(runs)]
    if len(names) > 16:
        lines.append(f"{'policy':<19}  {'tenants':>7}  {'min':>9}  {'median':>9}  {'max':>9}"
                     f"  {'Jain':>5}")
        for run in runs:
            rates = sorted(run.figures["tenant_service_tokens_per_s"].values())
            jain = run.figures["jain_index"]
            lines.append(f"{run.policy:<19}  {len(rates):>7}  {rates[0]:>9.1f}  "
                         f"{rates[len(rates) // 2]:>9.1f}  {rates[-1]:>9.1f}  "
                         f"{'-' if jain is None else format(jain, '.3f'):>5}")
        return "\n".join(lines) + "\n"
    width = max(9, max(len(str(n)) for n in names))
    lines.append(f"{'policy':<19}  " + "  ".join(f"{str(n):>{width}}" for n in names)
                 + f"  {'Jain':>5}")
    for run in runs:
        rates = run.figures["tenant_service_tokens_per_s"]
        jain = run.figures["jain_index"]
        lines.append(f"{run.policy:<19}  " + "  ".join(f"{rates.get(n, 0.0):>{width}.1f}"
                                                       for n in names)
                     + f"  {'-' if jain is None else format(jain, '.3f'):>5}")
    return "\n".join(lines) + "\n"


def _tenant_title(runs: list[LabRun]) -> str:
    """The tenant table's title: what its rates are over (lab/tenants.py): the arrivals, or
    the whole run for a run whose trace arrived within about one iteration."""
    whole = [r.policy for r in runs if r.figures.get("tenant_service_window") == "run"]
    burst = "the trace arrived within about one iteration"
    if not whole:
        return "# per-tenant service, tokens/s while the trace arrives"
    if len(whole) == len(runs):
        return f"# per-tenant service, tokens/s over the whole run ({burst})"
    return (f"# per-tenant service, tokens/s while the trace arrives; over the whole run for "
            f"{', '.join(whole)} ({burst} there)")


def trace_document(trace_info: dict[str, Any], runs: Iterable[LabRun]) -> dict[str, Any]:
    """`{"trace": {...}, "policies": {name: figures}}` (docs/lab.md lists the fields)."""
    return {"trace": trace_info, "policies": {run.policy: dict(run.figures) for run in runs}}
