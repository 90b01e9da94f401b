"""A pipelined host (engine/contract.py `PipelinedHost`): with `pipeline_depth` P and a scheduler
whose plans in flight are disjoint, the engine starts each plan without waiting for the ones in
flight, up to P at once, releases at once, and every request gets its tokens; a host without
the capability still runs one plan at a time. The host here runs plans on the deterministic
token model of the plans-in-flight tests (tests/support/token_model.py), in the order started,
when their answers are asked for."""
from __future__ import annotations

from collections import deque

import pytest

from token_model import VOCAB, alone_tokens, run_rows

from skippy_scheduler import Scheduler, SchedulerConfig, TwinScheduler
from skippy_scheduler.engine import Engine, Request
from skippy_scheduler.engine.contract import attach


class _Handle:
    def __init__(self, host: "OrderedHost", plan) -> None:
        self.host, self.plan, self.done = host, plan, False

    def result(self) -> None:
        while not self.done:
            self.host.run_oldest()


class OrderedHost:
    """Runs started plans in order, each when its answer (or a later one's) is asked for."""

    def __init__(self, depth: int | None) -> None:
        if depth is not None:
            self.pipeline_depth = depth
        self.kv: dict[str, list[int]] = {}
        self.started: deque[_Handle] = deque()
        self.most = 0
        self.releases_while_running = 0

    def execute_async(self, plan) -> _Handle:
        handle = _Handle(self, plan)
        self.started.append(handle)
        self.most = max(self.most, len(self.started))
        return handle

    def execute(self, plan) -> None:
        self.execute_async(plan).result()

    def run_oldest(self) -> None:
        handle = self.started.popleft()
        run_rows(self.kv, handle.plan)
        handle.done = True

    def release(self, sequence_id: str, reason=None) -> None:
        if self.started:
            self.releases_while_running += 1
        self.kv.pop(sequence_id, None)


def test_attach_reads_the_pipeline_depth_only_with_execute_async():
    assert attach(OrderedHost(3)).pipeline_depth == 3
    assert attach(OrderedHost(None)).pipeline_depth == 1

    class SyncOnly:
        pipeline_depth = 4

        def execute(self, plan) -> None: ...
        def release(self, sequence_id, reason=None) -> None: ...

    assert attach(SyncOnly()).pipeline_depth == 1
    with pytest.raises(ValueError, match="pipeline_depth"):
        attach(OrderedHost(0))


@pytest.mark.parametrize("impl", [Scheduler, TwinScheduler], ids=["native", "twin"])
@pytest.mark.parametrize("depth", [2, 3])
def test_plans_start_without_waiting_and_every_request_gets_its_tokens(impl, depth):
    prompts = {f"r{i}": [(7 * i + j) % VOCAB for j in range(3 + i)] for i in range(7)}
    limits = {sid: 4 + i % 5 for i, sid in enumerate(prompts)}
    results = {}
    for pipelined in (True, False):
        host = OrderedHost(depth if pipelined else None)
        scheduler = impl(SchedulerConfig(max_active_sequences=7, max_tokens_per_iteration=64,
                                         max_inflight_plans=depth,
                                         disjoint_inflight_plans=True))
        engine = Engine(scheduler, host, clock=None, max_iterations=5000)
        report = engine.run([Request(sid, p, limits[sid]) for sid, p in prompts.items()])
        for rec in report.records:
            want = alone_tokens(prompts[rec.id], limits[rec.id])
            assert rec.tokens == want, (pipelined, rec.id)
        results[pipelined] = host
    assert results[True].most == depth  # as many plans running at once as the pipeline holds
    assert results[True].releases_while_running > 0  # releases did not wait for an idle host
    assert results[False].most == 1  # a host without the capability: one plan at a time
    assert results[False].releases_while_running == 0
