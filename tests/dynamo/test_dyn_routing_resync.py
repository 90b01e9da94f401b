"""Dynamo's routing events on a real engine (the tiny model, as `dynamo-worker` builds it,
without Dynamo): a subscriber that joins late (Dynamo's relay subscribing after the worker
started, or again) gets what the replica holds, in the router's blocks (BOS left out), and a
subscriber there from the start keeps the same index through that batch."""
from __future__ import annotations

import asyncio
import socket
import time

import pytest

pytest.importorskip("llama_cpp")
for _module in ("zmq", "msgspec", "cbor2"):  # (vllm_schema's)
    pytest.importorskip(_module)

from vllm_schema import (AllBlocksCleared, BlockStored, Subscriber,  # noqa: E402
                         apply_events)

from skippy_scheduler.dynamo import routing_events  # noqa: E402
from skippy_scheduler.dynamo.adapter import EngineAdapter, Vocabulary  # noqa: E402
from skippy_scheduler.hosts.tiny_model import write_tiny_llama  # noqa: E402
from skippy_scheduler.serve import Server, ServeSettings  # noqa: E402

BLOCK = 16


def _endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def test_a_relay_that_subscribes_late_gets_what_is_resident(tmp_path):
    model = write_tiny_llama(tmp_path / "tiny.gguf", seed=7)
    server = Server(ServeSettings(model=str(model), max_active=2, ctx_size=1024,
                                  max_waiting=16, threads=1, prefix_cache_tokens=2048,
                                  prefix_holders=4, kv_block_size=BLOCK))
    endpoint = _endpoint()
    bos = server.host.tokenize("", add_bos=True)[0]
    publisher = routing_events.start(server.host, server.runner.engine, endpoint, BLOCK,
                                     server.settings.kv_hash_seed, bos=bos,
                                     post=server.runner.post)
    early = Subscriber(endpoint)
    late = None
    try:
        server.runner.start()
        adapter = EngineAdapter(server.runner, Vocabulary(server.host.n_vocab, 512, bos))

        async def run(k: int) -> None:
            prompt = server.host.tokenize(f"a tenant's system prompt number {k}, long enough "
                                          f"for a few blocks of sixteen tokens. " * 2)
            agen = adapter.stream({"token_ids": prompt, "stop_conditions": {
                "max_tokens": 3}}, f"r{k}")
            try:
                async for _ in agen:
                    pass
            finally:
                await agen.aclose()

        async def main() -> None:
            for k in range(3):
                await run(k)

        asyncio.run(main())
        index: set = set()
        stored_tokens: list[int] = []
        end = time.monotonic() + 30
        quiet_until = time.monotonic() + 1.0
        while time.monotonic() < quiet_until:  # until no batch for a second
            item = early.receive(0.2)
            if item is not None:
                events = item[2].events
                apply_events(index, events)
                stored_tokens += [t for e in events if isinstance(e, BlockStored)
                                  for t in e.token_ids]
                quiet_until = time.monotonic() + 1.0
            assert time.monotonic() < end
        assert index, "nothing resident to announce"
        assert bos not in stored_tokens[:1]  # the router's blocks: no BOS in front
        late = Subscriber(endpoint)
        got = late.events_until(  # (fails naming what came, if the subscriber is told nothing)
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
        server.close()
        publisher.close()
