"""Holder replacement on the llama host: a finished request whose key shares most of a holder's
key supersedes that holder instead of taking another one (hosts/llama/holders.py).

Requests of one prefix group, run one after another, end with one holder; requests of two
groups with two; with replacement off, every request keeps a holder of its own. Every output
equals the prompt run alone (a restore from a holder that is then replaced only copied cells).
"""
from __future__ import annotations

import random

import pytest

pytest.importorskip("llama_cpp")

from skippy_scheduler import SchedulerConfig  # noqa: E402
from skippy_scheduler.cost_model import LAB_COST  # noqa: E402
from skippy_scheduler.engine import Engine, Request, VirtualClock  # noqa: E402
from skippy_scheduler.hosts.llama import LlamaHost  # noqa: E402
from skippy_scheduler.hosts.tiny_model import write_tiny_llama  # noqa: E402

N_SEQ = 2
HOLDERS = 4
MAX_GEN = 6


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-f32.gguf", seed=7)


@pytest.fixture(scope="module")
def alone(model_path):
    with LlamaHost(model_path, n_ctx=N_SEQ * 256, n_seq_max=N_SEQ, n_threads=1) as h:
        cache: dict[tuple[int, ...], list[int]] = {}

        def run(prompt: list[int]) -> list[int]:
            if tuple(prompt) not in cache:
                cache[tuple(prompt)] = h.generate_alone(prompt, MAX_GEN)
            return cache[tuple(prompt)]
        yield run


def _host(model_path, share=0.5) -> LlamaHost:
    # A stream per lane and holder (the default layout), 256 cells each.
    return LlamaHost(model_path, n_ctx=(N_SEQ + HOLDERS) * 256, n_seq_max=N_SEQ, n_threads=1,
                     prefix_cache_tokens=4096, prefix_holders=HOLDERS,
                     prefix_replace_share=share)


def _group(rng: random.Random, n: int) -> list[int]:
    return [1] + [rng.randrange(3, 384) for _ in range(n - 1)]


def _suffix(rng: random.Random) -> list[int]:
    return [rng.randrange(3, 384) for _ in range(6)]


def _run_one_by_one(impl, host: LlamaHost, prompts: list[list[int]], alone) -> None:
    """Each prompt arrives after the one before it has finished; outputs equal alone runs."""
    scheduler = impl(SchedulerConfig(max_active_sequences=N_SEQ, max_tokens_per_iteration=256,
                                     prefill_chunk_tokens=256, **host.sequence_id_settings))
    engine = Engine(scheduler, host, clock=VirtualClock(LAB_COST), max_iterations=2000)
    requests = [Request(f"r{i}", p, MAX_GEN, arrival_us=i * 1e9) for i, p in enumerate(prompts)]
    for req in requests:
        engine.submit(req)
    report = engine.run()
    scheduler.attach_prefix_store(None)
    for req, rec in zip(requests, report.records):
        expected = alone(req.prompt_tokens)
        assert rec.tokens == expected[:len(rec.tokens)] and rec.tokens, req.id
    m = scheduler.metrics()
    assert m.restored_tokens > 0
    assert host.active_sequences == [] and all(e.pins == 0 for e in host.prefix_store.resident())


def test_requests_of_one_group_end_with_one_holder_that_the_last_one_replaced(impl, model_path,
                                                                             alone):
    rng = random.Random(1)
    head = _group(rng, 40)
    prompts = [head + _suffix(rng) for _ in range(4)]
    with _host(model_path) as host:
        _run_one_by_one(impl, host, prompts, alone)
        store = host.prefix_store
        (entry,) = store.resident()
        # The last request's key (its prompt and what it decoded) replaced the others.
        assert list(entry.key[:len(prompts[-1])]) == prompts[-1]
        assert host.holders.kept == 4 and host.holders.replaced == 3
        assert store.evictions == 3


def test_two_groups_keep_two_holders(impl, model_path, alone):
    rng = random.Random(2)
    heads = [_group(rng, 40), _group(rng, 40)]
    prompts = [heads[i % 2] + _suffix(rng) for i in range(6)]
    with _host(model_path) as host:
        _run_one_by_one(impl, host, prompts, alone)
        resident = host.prefix_store.resident()
        assert len(resident) == 2
        assert sorted(list(e.key[:40]) for e in resident) == sorted(heads)
        assert host.holders.replaced == 4


def test_without_replacement_each_request_takes_a_holder(impl, model_path, alone):
    rng = random.Random(1)
    head = _group(rng, 40)
    prompts = [head + _suffix(rng) for _ in range(4)]
    with _host(model_path, share=None) as host:
        _run_one_by_one(impl, host, prompts, alone)
        assert len(host.prefix_store.resident()) == HOLDERS
        assert host.holders.replaced == 0


def test_a_holder_sharing_less_than_the_share_is_not_replaced(impl, model_path, alone):
    """A 40-token head in a 200-token first key: the second key shares a fifth of it."""
    rng = random.Random(3)
    head = _group(rng, 40)
    first = head + [rng.randrange(3, 384) for _ in range(154)]
    second = head + _suffix(rng)
    with _host(model_path) as host:
        _run_one_by_one(impl, host, [first, second], alone)
        assert len(host.prefix_store.resident()) == 2 and host.holders.replaced == 0
    with _host(model_path, share=0.2) as host:
        _run_one_by_one(impl, host, [first, second], alone)
        assert len(host.prefix_store.resident()) == 1 and host.holders.replaced == 1


def test_the_replace_share_is_checked(model_path):
    for bad in (0, 1.5, -0.1, True, "half"):
        with pytest.raises(ValueError, match="prefix_replace_share"):
            _host(model_path, share=bad)


def test_the_store_evicts_exactly_the_entry_asked_and_leaves_the_others_as_they_were():
    from skippy_scheduler.prefix_store import PrefixStore

    gone = []
    store = PrefixStore(capacity_tokens=100, holder_slots=4)
    store.backend.on_evict = gone.append
    a, b, c = (store.insert([k] * 5) for k in (1, 2, 3))
    child = store.insert([1] * 5 + [9], a)
    store.pin(b)
    order, epoch = store.lru_order(), store.epoch
    assert not store.evict(b) and not store.evict(a)  # pinned; has a resident child
    assert store.epoch == epoch and gone == []
    assert store.evict(c)
    assert gone == [c] and not c.alive and store.epoch == epoch + 1 and store.evictions == 1
    assert store.lru_order() == [e for e in order if e is not c]
    assert b.pins == 1 and child.pins == 0 and a.pins == 0
    assert not store.evict(c)  # evicted already


def test_a_replacement_the_store_would_refuse_keeps_the_old_holder(model_path):
    """A key that supersedes a holder but cannot be taken (the rest pinned, no room for it even
    with the holder gone) leaves that holder resident: evicting it first lost it for nothing."""
    with LlamaHost(model_path, n_ctx=(N_SEQ + 3) * 256, n_seq_max=N_SEQ, n_threads=1,
                   prefix_cache_tokens=100, prefix_holders=3) as host:
        store = host.prefix_store
        pinned = [1] + list(range(10, 69))  # 60 tokens
        old = [1] + list(range(100, 129))  # 30 tokens
        new = old[:20] + list(range(200, 230))  # 50, sharing 20 >= half of the old key's

        def compute(name: str, tokens: list[int]) -> None:
            host.run_rows([(name, tokens, 0, False)])
            host.release(name)

        compute("p", pinned)
        compute("o", old)
        entry = store.find(pinned)
        store.pin(entry)
        try:
            compute("n", new)  # 100 - 90 + 30 evictable < 50: refused whatever is evicted
            assert store.refused_inserts == 1 and host.holders.replaced == 0
            assert store.find(old) is not None and store.find(new) is None
        finally:
            store.unpin(entry)
