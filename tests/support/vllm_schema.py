"""vLLM's KV event schema (vllm/distributed/kv_events.py, v0.28), declared here as vLLM
declares it, to decode what the server publishes exactly as a vLLM consumer would, and the
block hash recomputed with cbor2 (what vLLM's `sha256_cbor` uses), independently of the
server's own encoder; a subscriber, and the index a router keeps of what it is told
(`apply_events`)."""
from __future__ import annotations

import hashlib
import time
from typing import Any, Optional, Union

import cbor2
import msgspec
import zmq


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[Union[bytes, int]]
    parent_block_hash: Union[bytes, int, None]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[Union[bytes, int]]
    medium: Optional[str]
    group_idx: Optional[int] = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def vllm_hashes(tokens: list[int], block_size: int, seed: str = "0") -> list[int]:
    """The wire hashes vLLM gives the full blocks of `tokens` with sha256_cbor and
    PYTHONHASHSEED=seed (the low 64 bits of each block's digest)."""
    parent = hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tuple(tokens[start:start + block_size])
        parent = hashlib.sha256(cbor2.dumps((parent, block, None), canonical=True)).digest()
        out.append(int.from_bytes(parent, "big") & ((1 << 64) - 1))
    return out


def apply_events(index: set, events) -> None:
    """A router's view: the block hashes announced and not withdrawn."""
    for e in events:
        if isinstance(e, AllBlocksCleared):
            index.clear()
        elif isinstance(e, BlockStored):
            index.update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            index.difference_update(e.block_hashes)


class Subscriber:
    """A SUB socket on an endpoint, as a router's subscriber: (topic, seq, batch) triples."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def receive(self, timeout_s: float = 5.0) -> Optional[tuple[bytes, int, KVEventBatch]]:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        frames = self.sock.recv_multipart()
        assert len(frames) == 3, frames
        topic, seq, payload = frames
        assert len(seq) == 8
        return topic, int.from_bytes(seq, "big"), DECODER.decode(payload)

    def events_until(self, predicate, timeout_s: float = 10.0) -> list[tuple[int, Any]]:
        """(seq, event) pairs received until `predicate(all so far)` holds (bounded)."""
        got: list[tuple[int, Any]] = []
        end = time.monotonic() + timeout_s
        while not predicate(got):
            left = end - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out; received {got}")
            item = self.receive(left)
            if item is not None:
                _, seq, batch = item
                got.extend((seq, e) for e in batch.events)
        return got

    def joined(self, timeout_s: float = 10.0) -> None:
        """Wait for the batch a serving replica publishes for a new subscriber (its whole
        state after AllBlocksCleared), so that what follows is news."""
        self.events_until(lambda got: any(isinstance(e, AllBlocksCleared) for _, e in got),
                          timeout_s)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def replay(endpoint: str, start: int, timeout_s: float = 10.0) -> list[tuple[int, KVEventBatch]]:
    """The batches a replay socket holds from sequence `start` on (as a router asks)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert sock.poll(int(timeout_s * 1000)), "no replay answer"
            _, seq, payload = sock.recv_multipart()
            number = int.from_bytes(seq, "big", signed=True)
            if number == -1:
                return out
            out.append((number, DECODER.decode(payload)))
    finally:
        sock.close(linger=0)
        ctx.term()
