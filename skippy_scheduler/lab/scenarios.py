"""The reference lab scenarios (§5.5), the radix fixture and the fixture replay (§5.8).

Each scenario is a config override set plus a request builder; builders return fresh
`SimRequest` lists because requests are mutable (the radix probe rewrites them).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ..cache_policy import CacheAffinity
from ..types import SchedulerConfig
from .backend import Backend, resolve_backend
from .model import (LAB_COST, SimRequest, StepCost, apply_resident_radix_affinity,
                    burst_requests, staggered_prefill_requests)
from .simulate import SimulationReport, simulate

if TYPE_CHECKING:  # pragma: no cover
    from ..radix import UnifiedRadixCache

RADIX_NAMESPACE = "stage-0"
RADIX_PREFIX_TOKENS = 3_072


def make_config(**overrides: Any) -> SchedulerConfig:
    """SchedulerConfig defaults plus `overrides` (None = unbounded for the two optional caps)."""
    return SchedulerConfig(**overrides)


def radix_fixture(prefix_tokens: int = RADIX_PREFIX_TOKENS) -> UnifiedRadixCache:
    """A fresh UnifiedRadixCache holding tokens 0..prefix_tokens-1 resident in "stage-0"."""
    from ..radix import UnifiedRadixCache

    cache = UnifiedRadixCache()
    cache.insert_resident(RADIX_NAMESPACE, list(range(prefix_tokens)), prefix_tokens,
                          "shared-prefix")
    return cache


def _affinity_cost(cost: StepCost) -> int:
    return max(0, round(cost.per_prefill_token_us))


def radix_requests(cost: StepCost, *, cache_aware: bool) -> list[SimRequest]:
    """a-cold, b-cold (disjoint prompts) and c-hot (hits the fixture), 4 096/16 each, probed
    against the radix fixture; FCFS keeps the prefix restore but drops the affinity."""
    requests = [SimRequest("a-cold", 0, 4_096, 16, token_offset=10_000),
                SimRequest("b-cold", 0, 4_096, 16, token_offset=20_000),
                SimRequest("c-hot", 0, 4_096, 16, token_offset=0)]
    requests = apply_resident_radix_affinity(radix_fixture(), RADIX_NAMESPACE, 0,
                                             _affinity_cost(cost), requests)
    if not cache_aware:
        for request in requests:
            request.cache_affinity = CacheAffinity()
    return requests


def waiting_prefix_requests() -> list[SimRequest]:
    return [SimRequest("a-unique", 0, 4_096, 16, token_offset=10_000),
            SimRequest("b-shared", 0, 4_096, 16, token_offset=0),
            SimRequest("c-shared", 0, 4_096, 16, token_offset=0)]


@dataclass(frozen=True)
class Scenario:
    name: str
    build: Callable[[StepCost], list[SimRequest]]
    overrides: dict[str, Any] = field(default_factory=dict)

    def config(self) -> SchedulerConfig:
        return make_config(**self.overrides)


_SERIAL = {"max_consecutive_prefill_iterations": 1, "max_active_sequences": 1}

SCENARIOS: tuple[Scenario, ...] = (
    Scenario("cold-burst-n1", lambda c: burst_requests(1, 4_096, 32, 0)),
    Scenario("warm-divergent-n1", lambda c: burst_requests(1, 4_096, 32, 4_080)),
    Scenario("cold-burst-n2", lambda c: burst_requests(2, 4_096, 32, 0)),
    Scenario("warm-divergent-n2", lambda c: burst_requests(2, 4_096, 32, 4_080)),
    Scenario("cold-burst-n4", lambda c: burst_requests(4, 4_096, 32, 0)),
    Scenario("warm-divergent-n4", lambda c: burst_requests(4, 4_096, 32, 4_080)),
    Scenario("staggered-prefill", lambda c: staggered_prefill_requests()),
    Scenario("staggered-prefill-bounded", lambda c: staggered_prefill_requests(),
             {"max_consecutive_prefill_iterations": 1}),
    Scenario("staggered-prefill-mixed", lambda c: staggered_prefill_requests(),
             {"max_consecutive_prefill_iterations": 1, "mixed_prefill_decode": True}),
    Scenario("radix-fcfs", lambda c: radix_requests(c, cache_aware=False), dict(_SERIAL)),
    Scenario("radix-cache-aware", lambda c: radix_requests(c, cache_aware=True), dict(_SERIAL)),
    Scenario("waiting-prefix-fcfs", lambda c: waiting_prefix_requests(),
             {**_SERIAL, "group_waiting_prefixes": False}),
    Scenario("waiting-prefix-dfs", lambda c: waiting_prefix_requests(), dict(_SERIAL)),
)
SCENARIO_NAMES = tuple(s.name for s in SCENARIOS)


def get_scenario(name: str) -> Scenario:
    for scenario in SCENARIOS:
        if scenario.name == name:
            return scenario
    raise ValueError(f"unknown scenario {name!r} (known: {', '.join(SCENARIO_NAMES)})")


@dataclass
class ScenarioResult:
    scenario: Scenario
    report: SimulationReport
    bench_us_per_run: float | None = None  # wall time per extra repetition, µs
    trace: list[str] | None = None


def run_scenario(scenario: Scenario | str, cost: StepCost | None = None, *,
                 backend: str | Backend | None = "auto", bench_reps: int = 0,
                 trace: bool = False) -> ScenarioResult:
    """Simulate one scenario, then `bench_reps` more times only to time the simulator."""
    if isinstance(scenario, str):
        scenario = get_scenario(scenario)
    cost = cost or LAB_COST
    backend = resolve_backend(backend)
    config = scenario.config()
    lines: list[str] | None = [f"### scenario {scenario.name}"] if trace else None
    report = simulate(config, cost, scenario.build(cost), backend=backend, trace=lines)
    bench = None
    if bench_reps > 0:
        inputs = [scenario.build(cost) for _ in range(bench_reps)]
        start = time.perf_counter()
        for requests in inputs:
            simulate(config, cost, requests, backend=backend)
        bench = (time.perf_counter() - start) * 1e6 / bench_reps
    return ScenarioResult(scenario, report, bench, lines)


# Fixture replay (§5.8): two locality profiles with their expected family-switch counts.
REPLAY_PROFILES: dict[str, dict[str, Any]] = {
    "warm-affinity": {"family_order": [0, 0, 0, 1, 1, 1], "prompt_tokens": 128,
                      "expected": {"fcfs": 1, "dfs": 1}},
    "agentic-eviction-pressure": {"family_order": list(range(8)) * 2, "prompt_tokens": 128,
                                  "expected": {"fcfs": 15, "dfs": 7}},
}


@dataclass
class ReplayResult:
    profile: str
    mode: str  # "fcfs" (grouping off) or "dfs" (grouping on)
    service_order: list[tuple[float | None, int, str]]  # (first_scheduled_us, family, id)
    switches: int
    expected: int


def replay_requests(family_order: list[int], prompt_tokens: int) -> list[SimRequest]:
    return [SimRequest(f"request-{i:03d}-family-{family:02d}", 0, prompt_tokens, 1,
                       token_offset=(family + 1) * 10_000)
            for i, family in enumerate(family_order)]


def replay_profile(profile: str, mode: str, cost: StepCost | None = None, *,
                   backend: str | Backend | None = "auto") -> ReplayResult:
    if profile not in REPLAY_PROFILES:
        raise ValueError(f"unknown replay profile {profile!r}")
    if mode not in ("fcfs", "dfs"):
        raise ValueError(f"unknown replay mode {mode!r}")
    spec = REPLAY_PROFILES[profile]
    requests = replay_requests(spec["family_order"], spec["prompt_tokens"])
    family = {r.id: (r.token_offset // 10_000) - 1 for r in requests}
    config = make_config(max_active_sequences=1, group_waiting_prefixes=(mode == "dfs"))
    report = simulate(config, cost, requests, backend=backend)
    order = sorted((m.first_scheduled_us, family[rid], rid) for rid, m in report.requests.items())
    switches = sum(1 for a, b in zip(order, order[1:]) if a[1] != b[1])
    return ReplayResult(profile, mode, order, switches, spec["expected"][mode])


def replay_all(cost: StepCost | None = None, *,
               backend: str | Backend | None = "auto") -> list[ReplayResult]:
    return [replay_profile(p, m, cost, backend=backend)
            for p in REPLAY_PROFILES for m in ("fcfs", "dfs")]
