"""Formatting of lab results: the §5.6 table, the replay lines and the JSON document."""
from __future__ import annotations

import json
from typing import Any, Iterable

from .model import RuntimeCostModel
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
                 cost: RuntimeCostModel, backend: str) -> dict[str, Any]:
    """Everything the lab computed. Wall-clock figures live only under `bench_us_per_run`."""
    return {
        "backend": backend,
        "cost_model": cost.as_dict(),
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
