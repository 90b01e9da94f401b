"""The prefix store's changes as vLLM KV events: decoded with vLLM's own schema, hashes
recomputed with cbor2 from the token ids, over a real ZeroMQ PUB/SUB pair."""
from __future__ import annotations

import random

import pytest
import zmq
from vllm_schema import (DECODER, AllBlocksCleared, BlockRemoved, BlockStored, Subscriber,
                         apply_events, vllm_hashes)

from skippy_scheduler.prefix_store import PrefixStore
from skippy_scheduler.serve import kv_events
from skippy_scheduler.serve.kv_events import BlockLedger, KvEventPublisher, StoreEvents

B = 4
# The publisher waits this long before its first batch, for a subscriber that connects (or
# reconnects, after a restart) on a loaded machine.
SETTLE_S = 1.0


@pytest.fixture
def wire(endpoint):
    """(store, subscriber, publisher): a store whose changes are published on `endpoint`."""
    publisher = KvEventPublisher(endpoint, settle_s=SETTLE_S)
    sub = Subscriber(endpoint)
    store = PrefixStore(capacity_tokens=64, holder_slots=8)
    StoreEvents.attach(store, publisher, block_size=B)
    yield store, sub, publisher
    sub.close()
    publisher.close()


def _count(n):
    return lambda got: len(got) >= n


def _stored_tokens(events):
    return [e for _, e in events if isinstance(e, BlockStored)]


def test_a_start_clears_then_an_insert_announces_its_full_blocks_with_vllms_hashes(wire):
    store, sub, _ = wire
    (seq, first), = sub.events_until(_count(1))
    assert seq == 0 and isinstance(first, AllBlocksCleared)
    key = list(range(100, 110))  # two full blocks and two tokens that are not announced
    store.insert(key)
    (seq, ev), = sub.events_until(_count(1))
    assert seq == 1 and isinstance(ev, BlockStored)
    assert ev.block_hashes == vllm_hashes(key, B) and len(ev.block_hashes) == 2
    assert ev.parent_block_hash is None
    assert ev.token_ids == key[:8] and ev.block_size == B
    assert ev.lora_id is None and ev.lora_name is None and ev.medium == "GPU"
    assert ev.extra_keys is None and ev.group_idx is None


def test_a_key_sharing_blocks_announces_only_its_new_blocks_after_the_shared_parent(wire):
    store, sub, _ = wire
    sub.events_until(_count(1))
    a = [7] * 8 + [1, 2, 3, 4]
    b = [7] * 8 + [5, 6, 7, 8, 9, 9, 9, 9]  # a restore of a's first 8 tokens, extended
    store.insert(a)
    store.insert(b)
    (_, ev_a), (_, ev_b) = sub.events_until(_count(2))
    ha, hb = vllm_hashes(a, B), vllm_hashes(b, B)
    assert ev_a.block_hashes == ha
    assert ha[:2] == hb[:2]
    assert ev_b.block_hashes == hb[2:] and ev_b.parent_block_hash == hb[1]
    assert ev_b.token_ids == b[8:16]
    # A key shorter than a block, or all of whose blocks are resident, announces nothing:
    # the next event is the one after them.
    store.insert([1, 2, 3])
    store.insert(a[:8] + [0])
    c = [3] * 4
    store.insert(c)
    (_, ev_c), = sub.events_until(_count(1))
    assert ev_c.block_hashes == vllm_hashes(c, B)


def test_an_eviction_removes_the_blocks_no_other_holder_keeps(endpoint):
    publisher = KvEventPublisher(endpoint, settle_s=SETTLE_S)
    sub = Subscriber(endpoint)
    try:
        store = PrefixStore(capacity_tokens=24, holder_slots=8)
        StoreEvents.attach(store, publisher, block_size=B)
        sub.events_until(_count(1))
        a = [5] * 8 + [1] * 4
        b = [5] * 8 + [2] * 4
        store.insert(a)
        store.insert(b)
        sub.events_until(_count(2))
        store.insert([9] * 12)  # 36 tokens > 24: the least recently used (a) goes
        got = sub.events_until(_count(2))
        removed = [e for _, e in got if isinstance(e, BlockRemoved)]
        assert len(removed) == 1
        # a's own last block goes; the two it shares with b stay announced.
        assert removed[0].block_hashes == [vllm_hashes(a, B)[2]]
        assert removed[0].medium == "GPU"
        assert _stored_tokens(got)[0].block_hashes == vllm_hashes([9] * 12, B)
        store.evict_one()  # b: now its shared blocks go too, deepest first
        (_, ev), = sub.events_until(_count(1))
        assert ev.block_hashes == list(reversed(vllm_hashes(b, B)))
    finally:
        sub.close()
        publisher.close()


def test_a_restart_sends_all_blocks_cleared_at_sequence_zero_then_whats_resident(endpoint):
    store = PrefixStore(capacity_tokens=64, holder_slots=8)
    first = KvEventPublisher(endpoint, settle_s=SETTLE_S)
    sub = Subscriber(endpoint)
    try:
        StoreEvents.attach(store, first, block_size=B)
        store.insert(list(range(8)))
        got = sub.events_until(_count(2))
        assert [s for s, _ in got] == [0, 1]
        first.close()
        # The server comes back (the same endpoint, the same subscriber): numbering restarts
        # and the first batch clears what the previous run announced.
        again = KvEventPublisher(endpoint, settle_s=SETTLE_S)
        try:
            StoreEvents.attach(store, again, block_size=B)
            got = sub.events_until(_count(2))
            assert [s for s, _ in got] == [0, 0]  # one batch: the clear, then the residents
            assert isinstance(got[0][1], AllBlocksCleared)
            assert got[1][1].block_hashes == vllm_hashes(list(range(8)), B)
        finally:
            again.close()
    finally:
        sub.close()


def test_the_replay_socket_answers_buffered_batches_from_a_sequence_number(endpoint):
    replay = endpoint.rsplit(":", 1)[0] + ":" + str(int(endpoint.rsplit(":", 1)[1]) + 1)
    try:
        publisher = KvEventPublisher(endpoint, replay_endpoint=replay)
    except OSError:
        pytest.skip("the next port is taken")
    sub = Subscriber(endpoint)
    ctx = zmq.Context()
    req = ctx.socket(zmq.DEALER)  # a router's replay client: many answers to one request
    req.setsockopt(zmq.LINGER, 0)
    try:
        store = PrefixStore(capacity_tokens=64, holder_slots=8)
        StoreEvents.attach(store, publisher, block_size=B)
        keys = [[i] * 8 for i in range(3)]
        for key in keys:
            store.insert(key)
        live = {}
        while len(live) < 4:
            item = sub.receive()
            assert item is not None, "no live batch"
            live[item[1]] = item[2]
        req.connect(replay)
        req.send_multipart([b"", (2).to_bytes(8, "big")])
        frames = []
        while not frames or frames[-1][0] != -1:
            assert req.poll(5000), "no replay answer"
            empty, seq, payload = req.recv_multipart()
            assert empty == b""
            frames.append((int.from_bytes(seq, "big", signed=True), payload))
        assert [s for s, _ in frames] == [2, 3, -1] and frames[-1][1] == b""
        for seq, payload in frames[:-1]:
            assert DECODER.decode(payload) == live[seq]
    finally:
        req.close(linger=0)
        ctx.term()
        sub.close()
        publisher.close()


def test_a_batch_that_could_not_be_queued_leaves_a_gap_in_the_sequence(endpoint):
    """A full queue drops a batch (the engine thread never waits); the next batch sent skips
    its sequence number, so a subscriber sees where one was lost."""
    publisher = KvEventPublisher(endpoint, settle_s=SETTLE_S, max_queue=2)
    sub = Subscriber(endpoint)
    try:
        for _ in range(6):  # while the publisher settles: 2 queued, 4 lost
            publisher.publish([kv_events.AllBlocksCleared()])
        assert publisher.dropped == 4
        seqs = []
        while len(seqs) < 2:
            item = sub.receive()
            assert item is not None, "no batch"
            seqs.append(item[1])
        publisher.publish([kv_events.AllBlocksCleared()])
        item = sub.receive()
        assert item is not None, "no batch after the loss"
        assert seqs + [item[1]] == [0, 1, 6]
    finally:
        sub.close()
        publisher.close()


def test_the_ledger_announces_exactly_the_blocks_of_the_resident_keys():
    rng = random.Random(3)
    store = PrefixStore(capacity_tokens=80, holder_slots=6)
    announced: dict[int, int] = {}  # wire hash -> times announced minus removed

    class Sink:
        def publish(self, events):
            for e in events:
                if isinstance(e, kv_events.BlockStored):
                    for h in e.block_hashes:
                        announced[h] = announced.get(h, 0) + 1
                elif isinstance(e, kv_events.BlockRemoved):
                    for h in e.block_hashes:
                        announced[h] -= 1

    StoreEvents.attach(store, Sink(), block_size=B)
    stems = [[rng.randrange(50) for _ in range(8)] for _ in range(4)]
    for _ in range(300):
        key = rng.choice(stems) + [rng.randrange(4) for _ in range(rng.randrange(0, 14))]
        store.insert(key)
        if rng.random() < 0.2:
            store.evict_one()
        resident = {h for e in store.resident() for h in vllm_hashes(e.key.tolist(), B)}
        assert {h for h, n in announced.items() if n} == resident
        assert all(n in (0, 1) for n in announced.values())


def test_bad_settings_are_refused_before_anything_binds(endpoint):
    with pytest.raises(ValueError, match="block_size"):
        BlockLedger(0)
    with pytest.raises(ValueError, match="ZeroMQ address"):
        KvEventPublisher("127.0.0.1:5557")
    publisher = KvEventPublisher(endpoint)
    try:
        with pytest.raises(OSError, match="cannot bind"):
            KvEventPublisher(endpoint)
    finally:
        publisher.close()


def test_serve_refuses_kv_events_it_cannot_publish_before_loading_a_model(tmp_path):
    import subprocess
    import sys

    cases = [(["--prefix-cache-tokens", "0", "--kv-events-endpoint", "tcp://127.0.0.1:1"],
              "prefix reuse"),
             (["--prefix-cache-tokens", "64", "--kv-events-endpoint", "127.0.0.1:1"],
              "ZeroMQ address"),
             (["--prefix-cache-tokens", "64", "--kv-events-endpoint", "tcp://127.0.0.1:1",
               "--kv-block-size", "0"], "--kv-block-size")]
    for extra, message in cases:
        r = subprocess.run([sys.executable, "-m", "skippy_scheduler.cli", "serve", "--port",
                            "0", *extra], capture_output=True, text=True, timeout=60,
                           cwd=tmp_path)  # not the checkout: `-m` would import its sources
        assert r.returncode == 2 and message in r.stderr, (extra, r.stderr)


def test_the_ledger_s_snapshot_is_what_is_resident():
    rng = random.Random(5)
    store = PrefixStore(capacity_tokens=80, holder_slots=6)
    ledger = BlockLedger(B)

    class Sink:
        def publish(self, events):
            pass

    StoreEvents.attach(store, Sink(), block_size=B, ledger=ledger)
    stems = [[rng.randrange(50) for _ in range(8)] for _ in range(4)]
    for _ in range(200):
        store.insert(rng.choice(stems) + [rng.randrange(4) for _ in range(rng.randrange(14))])
        if rng.random() < 0.2:
            store.evict_one()
        # As a subscriber decodes it, with vLLM's schema.
        snapshot = DECODER.decode(kv_events.encode_batch(ledger.snapshot(), 0.0)).events
        assert isinstance(snapshot[0], AllBlocksCleared)
        index: set = set()
        apply_events(index, snapshot)
        assert index == {h for e in store.resident() for h in vllm_hashes(e.key.tolist(), B)}
        seen: list = []
        for e in snapshot[1:]:  # every block once, with its tokens, after its parent
            assert len(e.token_ids) == B * len(e.block_hashes)
            assert e.parent_block_hash is None or e.parent_block_hash in seen
            assert not set(e.block_hashes) & set(seen)
            seen += e.block_hashes
            if e.parent_block_hash is None:
                assert e.block_hashes == vllm_hashes(e.token_ids, B)


def test_a_subscriber_that_joins_late_gets_what_the_replica_holds(model_path):
    """A router started after its replicas (or restarted) subscribes late: the replica
    publishes its whole state for it (AllBlocksCleared, then every resident block), and a
    subscriber there from the start keeps the same index through it."""
    pytest.importorskip("llama_cpp")
    import time

    import httpx
    from fleet_support import start_replica

    server, endpoint = start_replica(model_path)
    early = Subscriber(endpoint)
    late = None
    try:
        index: set = set()
        prompts = [f"a tenant's system prompt number {k}, long enough for a few blocks. " * 2
                   for k in range(4)]
        for p in prompts:
            r = httpx.post(server.url + "/v1/completions", timeout=60,
                           json={"prompt": p, "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200, r.text
        quiet_until = time.monotonic() + 1.0
        end = time.monotonic() + 30
        while time.monotonic() < quiet_until:  # until no batch for a second
            item = early.receive(0.2)
            if item is not None:
                apply_events(index, item[2].events)
                quiet_until = time.monotonic() + 1.0
            assert time.monotonic() < end
        assert index, "nothing resident to announce"
        late = Subscriber(endpoint)
        got = late.events_until(
            lambda g: any(isinstance(e, AllBlocksCleared) for _, e in g)
            and sum(isinstance(e, BlockStored) for _, e in g) > 0, timeout_s=20)
        joined: set = set()
        apply_events(joined, [e for _, e in got])
        assert joined == index
        # The early subscriber got the same batch: its index is unchanged by it.
        batch = early.events_until(lambda g: any(isinstance(e, AllBlocksCleared) for _, e in g))
        apply_events(index, [e for _, e in batch])
        assert index == joined
    finally:
        early.close()
        if late is not None:
            late.close()
        server.shutdown()
