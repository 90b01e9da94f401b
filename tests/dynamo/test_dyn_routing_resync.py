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
zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

from skippy_scheduler.dynamo import routing_events  # noqa: E402
from skippy_scheduler.dynamo.adapter import EngineAdapter, Vocabulary  # noqa: E402
from skippy_scheduler.hosts.tiny_model import write_tiny_llama  # noqa: E402
from skippy_scheduler.serve import Server, ServeSettings  # noqa: E402

BLOCK = 16


def _endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


class _Sub:
    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def batch(self, timeout_s: float) -> list | None:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        _, _, payload = self.sock.recv_multipart()
        return msgspec.msgpack.decode(payload)[1]

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def _apply(index: set, events: list) -> None:
    for e in events:
        if e["type"] == "AllBlocksCleared":
            index.clear()
        elif e["type"] == "BlockStored":
            index.update(e["block_hashes"])
        else:
            index.difference_update(e["block_hashes"])


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
    early = _Sub(endpoint)
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
            events = early.batch(0.2)
            if events is not None:
                _apply(index, events)
                stored_tokens += [t for e in events if e["type"] == "BlockStored"
                                  for t in e["token_ids"]]
                quiet_until = time.monotonic() + 1.0
            assert time.monotonic() < end
        assert index, "nothing resident to announce"
        assert bos not in stored_tokens[:1]  # the router's blocks: no BOS in front
        late = _Sub(endpoint)
        joined: set = set()
        seen_clear = False
        while not (seen_clear and joined):
            assert time.monotonic() < end, "the late subscriber was told nothing"
            events = late.batch(0.2)
            if events is not None:
                seen_clear = seen_clear or any(e["type"] == "AllBlocksCleared" for e in events)
                _apply(joined, events)
        assert joined == index
        # The early subscriber got the same batch: its index is unchanged by it.
        while True:
            events = early.batch(5.0)
            assert events is not None, "the resync batch did not reach the early subscriber"
            _apply(index, events)
            if any(e["type"] == "AllBlocksCleared" for e in events):
                break
        assert index == joined
    finally:
        early.close()
        if late is not None:
            late.close()
        server.close()
        publisher.close()
