"""A preempted request's prompt blocks as vLLM KV events: announced at its first token,
withdrawn once preemption frees its lane (where no holder kept them), announced again at its
next first token, withdrawn when it ends (serve/kv_events.py `watch_running`). Without the
withdrawal a router would send the prefix to a replica that no longer holds it. A real llama
host and engine, preemption for priority, a real ZeroMQ PUB/SUB pair, vLLM's schema."""
from __future__ import annotations

import contextlib
import random
from types import SimpleNamespace
from typing import Iterator

import pytest
from vllm_schema import BlockRemoved, BlockStored, Subscriber, apply_events, vllm_hashes

pytest.importorskip("llama_cpp")

from skippy_scheduler import SchedulerConfig  # noqa: E402
from skippy_scheduler.cost_model import LAB_COST  # noqa: E402
from skippy_scheduler.engine import Engine, Request, TokenEvent, VirtualClock  # noqa: E402
from skippy_scheduler.hosts.llama import LlamaHost  # noqa: E402
from skippy_scheduler.serve import kv_events  # noqa: E402
from skippy_scheduler.serve.kv_events import KvEventPublisher, StoreEvents  # noqa: E402

B = 4
SETTLE_S = 1.0  # the publisher's wait for a subscriber before its first batch


_RNG = random.Random(11)
LOW = [1] + [_RNG.randrange(3, 384) for _ in range(39)]  # ten blocks
HIGH = [1] + [_RNG.randrange(3, 384) for _ in range(11)]


@contextlib.contextmanager
def _low_running(impl, model_path, endpoint, *, holder_tokens: int, holders: int,
                 depth: int = 1) -> Iterator[SimpleNamespace]:
    """One lane running "low" (priority 0) past its first token, its blocks announced, with
    preemption for priority on and the events watched: (engine, scheduler, sub, index)."""
    with LlamaHost(model_path, n_ctx=(1 + holders) * 256, n_seq_max=1, n_threads=1,
                   prefix_cache_tokens=holder_tokens, prefix_holders=holders) as host:
        scheduler = impl(SchedulerConfig(
            max_active_sequences=1, max_tokens_per_iteration=256, prefill_chunk_tokens=256,
            priority_preemption=True, max_inflight_plans=depth, **host.sequence_id_settings))
        engine = Engine(scheduler, host, clock=VirtualClock(LAB_COST), max_iterations=500)
        publisher = KvEventPublisher(endpoint, settle_s=SETTLE_S)
        sub = Subscriber(endpoint)
        firsts: list[str] = []
        engine.add_listener(lambda e: firsts.append(e.request_id)
                            if isinstance(e, TokenEvent) and e.token >= 0 else None)
        try:
            hook = StoreEvents.attach(host.prefix_store, publisher, block_size=B,
                                      watch=host.holders.watch)
            kv_events.watch_running(engine, host, hook)
            index: set = set()
            apply_events(index, [e for _, e in sub.events_until(lambda g: len(g) >= 1)])
            engine.submit(Request("low", LOW, 40, priority=0))
            for _ in range(50):
                if "low" in firsts:
                    break
                engine.step()
            apply_events(index, [e for _, e in sub.events_until(
                lambda g: any(isinstance(e, BlockStored) for _, e in g))])
            yield SimpleNamespace(engine=engine, scheduler=scheduler, sub=sub, index=index)
        finally:
            sub.close()
            publisher.close()


def _rest(sub: Subscriber) -> list:
    """The events still to come (until none for a second)."""
    got = []
    while (item := sub.receive(timeout_s=1.0)) is not None:
        got.extend(item[2].events)
    return got


def test_a_preempted_requests_blocks_are_withdrawn_and_announced_again(impl, model_path,
                                                                      endpoint):
    low_blocks = set(vllm_hashes(LOW, B))
    # A holder too small for either prompt: nothing is kept on release.
    with _low_running(impl, model_path, endpoint, holder_tokens=8, holders=1) as run:
        assert low_blocks <= run.index  # announced while it runs
        run.engine.submit(Request("high", HIGH, 3, priority=5))
        run.engine.step()  # its admission preempts "low", whose lane the holder cannot keep
        assert run.scheduler.metrics().preempted_priority == 1
        apply_events(run.index, [e for _, e in run.sub.events_until(
            lambda g: any(isinstance(e, BlockRemoved) for _, e in g), timeout_s=5)])
        assert not low_blocks & run.index  # withdrawn while it waits
        run.engine.run()
        got = _rest(run.sub)
        assert any(isinstance(e, BlockStored) and set(e.block_hashes) & low_blocks
                   for e in got)  # announced again when it ran again
        apply_events(run.index, got)
        assert run.index == set()  # nothing runs, nothing was kept


@pytest.mark.parametrize("depth", [1, 2])
def test_a_preempted_request_whose_holder_keeps_it_stays_announced(impl, model_path, endpoint,
                                                                   depth):
    """Where a holder keeps the preempted lane's prompt, its blocks stay announced: nothing is
    withdrawn and announced again, also with plans in flight, where the release waits on the
    host's worker (the withdrawal waits for it)."""
    low_blocks = set(vllm_hashes(LOW, B))
    with _low_running(impl, model_path, endpoint, holder_tokens=512, holders=2,
                      depth=depth) as run:
        assert low_blocks <= run.index  # announced at its first token
        run.engine.submit(Request("high", HIGH, 3, priority=5))
        run.engine.run()
        assert run.scheduler.metrics().preempted_priority == 1
        got = _rest(run.sub)
        assert not any(isinstance(e, BlockStored) and set(e.block_hashes) & low_blocks
                       for e in got), got  # not announced again
        assert not any(isinstance(e, BlockRemoved) and set(e.block_hashes) & low_blocks
                       for e in got), got
