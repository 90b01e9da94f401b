"""A holder replaced by a finished request's key, as vLLM KV events: the new key's own blocks are
stored after the last block both keys share, the old holder's own blocks are removed, and the
shared blocks are neither removed nor announced again (hosts/llama/holders.py, docs/fleet.md).
A real llama host and engine, a real ZeroMQ PUB/SUB pair, vLLM's schema and cbor2 hashes."""
from __future__ import annotations

import random

import pytest
from vllm_schema import AllBlocksCleared, BlockRemoved, BlockStored, Subscriber, vllm_hashes

pytest.importorskip("llama_cpp")

from skippy_scheduler import SchedulerConfig  # noqa: E402
from skippy_scheduler.cost_model import LAB_COST  # noqa: E402
from skippy_scheduler.engine import Engine, Request, VirtualClock  # noqa: E402
from skippy_scheduler.hosts.llama import LlamaHost  # noqa: E402
from skippy_scheduler.serve.kv_events import KvEventPublisher, StoreEvents  # noqa: E402

B = 4
# The publisher waits this long before its first batch, for a subscriber that connects (or
# reconnects, after a restart) on a loaded machine.
SETTLE_S = 1.0
N_SEQ = 2
HOLDERS = 4


def _count(n):
    return lambda got: len(got) >= n


def _run(impl, host: LlamaHost, prompt: list[int], alone: list[int]) -> list[int]:
    """Runs `prompt` to its end; returns the key its holder keeps."""
    scheduler = impl(SchedulerConfig(max_active_sequences=N_SEQ, max_tokens_per_iteration=256,
                                     prefill_chunk_tokens=256, **host.sequence_id_settings))
    engine = Engine(scheduler, host, clock=VirtualClock(LAB_COST), max_iterations=500)
    engine.submit(Request("r", prompt, len(alone)))
    (rec,) = engine.run().records
    scheduler.attach_prefix_store(None)
    assert rec.tokens == alone
    (entry,) = host.prefix_store.resident()
    return [int(t) for t in entry.key]


def test_a_replaced_holder_removes_only_its_own_blocks_and_the_new_key_stores_only_its_own(
        impl, model_path, endpoint):
    rng = random.Random(4)
    head = [1] + [rng.randrange(3, 384) for _ in range(39)]  # ten full blocks
    prompts = [head + [rng.randrange(3, 384) for _ in range(6)] for _ in range(2)]
    with LlamaHost(model_path, n_ctx=N_SEQ * 256, n_seq_max=N_SEQ, n_threads=1) as plain:
        alone = [plain.generate_alone(p, 6) for p in prompts]
    with LlamaHost(model_path, n_ctx=(N_SEQ + HOLDERS) * 256, n_seq_max=N_SEQ, n_threads=1,
                   prefix_cache_tokens=4096, prefix_holders=HOLDERS) as host:
        publisher = KvEventPublisher(endpoint, settle_s=SETTLE_S)
        sub = Subscriber(endpoint)
        try:
            StoreEvents.attach(host.prefix_store, publisher, block_size=B,
                               watch=host.holders.watch)
            ((_, cleared),) = sub.events_until(_count(1))
            assert isinstance(cleared, AllBlocksCleared)
            first = _run(impl, host, prompts[0], alone[0])
            ((_, stored),) = sub.events_until(_count(1))
            assert stored.block_hashes == vllm_hashes(first, B)
            second = _run(impl, host, prompts[1], alone[1])
            assert host.holders.replaced == 1
            (_, stored), (_, removed) = sub.events_until(_count(2))
            h1, h2 = vllm_hashes(first, B), vllm_hashes(second, B)
            shared = next(i for i, (a, b) in enumerate(zip(h1, h2)) if a != b)
            assert shared == 10  # the head's blocks
            assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
            assert stored.block_hashes == h2[shared:]
            assert stored.parent_block_hash == h2[shared - 1]
            assert stored.token_ids == second[shared * B:len(h2) * B]
            assert removed.block_hashes == list(reversed(h1[shared:]))
            # Nothing else went out: the shared blocks stay announced, once.
            assert sub.receive(timeout_s=0.3) is None
        finally:
            sub.close()
            publisher.close()
