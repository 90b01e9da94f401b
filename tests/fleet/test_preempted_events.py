"""A preempted request's prompt blocks as vLLM KV events: announced at its first token,
withdrawn once preemption frees its lane (where no holder kept them), announced again at its
next first token, withdrawn when it ends (serve/kv_events.py `watch_running`). Without the
withdrawal a router would send the prefix to a replica that no longer holds it. A real llama
host and engine, preemption for priority, a real ZeroMQ PUB/SUB pair, vLLM's schema."""
from __future__ import annotations

import random

import pytest
from vllm_schema import AllBlocksCleared, BlockRemoved, BlockStored, Subscriber, vllm_hashes

pytest.importorskip("llama_cpp")

from skippy_scheduler import SchedulerConfig  # noqa: E402
from skippy_scheduler.cost_model import LAB_COST  # noqa: E402
from skippy_scheduler.engine import Engine, Request, TokenEvent, VirtualClock  # noqa: E402
from skippy_scheduler.hosts.llama import LlamaHost  # noqa: E402
from skippy_scheduler.serve import kv_events  # noqa: E402
from skippy_scheduler.serve.kv_events import KvEventPublisher, StoreEvents  # noqa: E402

B = 4
SETTLE_S = 1.0  # the publisher's wait for a subscriber before its first batch


def _apply(index: set, events) -> None:
    for e in events:
        if isinstance(e, AllBlocksCleared):
            index.clear()
        elif isinstance(e, BlockStored):
            index.update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            index.difference_update(e.block_hashes)


def test_a_preempted_requests_blocks_are_withdrawn_and_announced_again(impl, model_path,
                                                                      endpoint):
    rng = random.Random(11)
    low = [1] + [rng.randrange(3, 384) for _ in range(39)]  # ten blocks
    high = [1] + [rng.randrange(3, 384) for _ in range(11)]
    # One lane, and a holder too small for either prompt: nothing is kept on release.
    with LlamaHost(model_path, n_ctx=2 * 256, n_seq_max=1, n_threads=1,
                   prefix_cache_tokens=8, prefix_holders=1) as host:
        scheduler = impl(SchedulerConfig(
            max_active_sequences=1, max_tokens_per_iteration=256, prefill_chunk_tokens=256,
            priority_preemption=True, **host.sequence_id_settings))
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
            _apply(index, [e for _, e in sub.events_until(lambda g: len(g) >= 1)])
            low_blocks = set(vllm_hashes(low, B))
            engine.submit(Request("low", low, 40, priority=0))
            for _ in range(50):
                if "low" in firsts:
                    break
                engine.step()
            _apply(index, [e for _, e in sub.events_until(
                lambda g: any(isinstance(e, BlockStored) for _, e in g))])
            assert low_blocks <= index  # announced while it runs
            engine.submit(Request("high", high, 3, priority=5))
            engine.step()  # its admission preempts "low", whose lane the holder cannot keep
            assert scheduler.metrics().preempted_priority == 1
            _apply(index, [e for _, e in sub.events_until(
                lambda g: any(isinstance(e, BlockRemoved) for _, e in g), timeout_s=5)])
            assert not low_blocks & index  # withdrawn while it waits
            engine.run()
            got = []
            while (item := sub.receive(timeout_s=1.0)) is not None:
                got.extend(item[2].events)
            assert any(isinstance(e, BlockStored) and set(e.block_hashes) & low_blocks
                       for e in got)  # announced again when it ran again
            _apply(index, got)
            assert index == set()  # nothing runs, nothing was kept
        finally:
            sub.close()
            publisher.close()


@pytest.mark.parametrize("depth", [1, 2])
def test_a_preempted_request_whose_holder_keeps_it_stays_announced(impl, model_path, endpoint,
                                                                   depth):
    """Where a holder keeps the preempted lane's prompt, its blocks stay announced: nothing is
    withdrawn and announced again, also with plans in flight, where the release waits on the
    host's worker (the withdrawal waits for it)."""
    rng = random.Random(11)
    low = [1] + [rng.randrange(3, 384) for _ in range(39)]
    high = [1] + [rng.randrange(3, 384) for _ in range(11)]
    with LlamaHost(model_path, n_ctx=3 * 256, n_seq_max=1, n_threads=1,
                   prefix_cache_tokens=512, prefix_holders=2) as host:
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
            sub.events_until(lambda g: len(g) >= 1)
            engine.submit(Request("low", low, 40, priority=0))
            for _ in range(50):
                if "low" in firsts:
                    break
                engine.step()
            engine.submit(Request("high", high, 3, priority=5))
            engine.run()
            assert scheduler.metrics().preempted_priority == 1
            got = []
            while (item := sub.receive(timeout_s=1.0)) is not None:
                got.extend(item[2].events)
            low_blocks = set(vllm_hashes(low, B))
            stored = [e for e in got if isinstance(e, BlockStored)
                      and set(e.block_hashes) & low_blocks]
            assert len(stored) == 1, got  # announced once, at its first token
            assert not any(isinstance(e, BlockRemoved) and set(e.block_hashes) & low_blocks
                           for e in got), got
        finally:
            sub.close()
            publisher.close()
