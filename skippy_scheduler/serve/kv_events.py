"""KV cache events in vLLM's wire format, published over a ZeroMQ PUB socket (an XPUB).

Cache-aware routers (vLLM's `vllm-router --policy kv_aware`, llm-d's precise prefix scorer,
Dynamo's KV router) learn what each replica holds from the events vLLM publishes when blocks
of its prefix cache are stored and evicted. This module makes the server's prefix store speak
the same stream, so those routers consume it unchanged (docs/fleet.md).

What goes over the wire (vLLM's `vllm/distributed/kv_events.py`, as of v0.28):

* one ZeroMQ multipart message per batch: ``[topic, seq, payload]``; `topic` is empty by
  default, `seq` is the batch's sequence number as 8 bytes big-endian, counted from 0 at
  server start, `payload` is the msgpack of the batch;
* a batch is an array ``[ts, events, data_parallel_rank]`` (`ts` a float of seconds since the
  epoch, rank 0 here);
* an event is a map tagged by ``"type"``: ``BlockStored`` (`block_hashes`, `parent_block_hash`,
  `token_ids`, `block_size`, `lora_id`, `medium`, `lora_name`), ``BlockRemoved``
  (`block_hashes`, `medium`) or ``AllBlocksCleared`` (no fields); fields whose value is the
  default of an optional trailing field are left out, as msgspec's `omit_defaults` does;
* the optional replay socket (ROUTER) answers a request frame holding a start sequence number
  (8 bytes big-endian) with every buffered ``[seq, payload]`` from there on, then
  ``[-1 as 8 signed bytes, b""]``.

Blocks: a holder's key (the token ids its KV stands for) is cut into blocks of `block_size`
tokens; only full blocks are announced. A block's hash chains its parent's, as vLLM's
`hash_block_tokens` with the reproducible `sha256_cbor` function: ``sha256(cbor([parent,
tokens, None]))`` with the first block's parent the seed hash ``sha256(cbor(seed))`` (vLLM's
`NONE_HASH` when `PYTHONHASHSEED` is the seed); the wire carries the low 64 bits as an
unsigned integer (vLLM's `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` default). Holders may share
leading blocks (each holder keeps its whole key), so blocks are reference-counted: a block is
stored when its first holder arrives and removed when its last one goes. A running request's
prompt counts as one more such key from its first token to its end (`watch_running`), as vLLM
announces blocks as they fill. A server start sends `AllBlocksCleared` first, so a router drops
whatever the previous run had announced.
"""
from __future__ import annotations

import hashlib
import logging
import queue
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterable, Optional, Sequence, Union

from ..engine.contract import PrefixEventsHost, ServingHost

if TYPE_CHECKING:  # pragma: no cover
    from ..engine import Engine

log = logging.getLogger("skippy_scheduler.serve.kv_events")

MEDIUM = "GPU"  # vLLM's name for the engine's own KV cache (the tier routers credit fully)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_MASK64 = (1 << 64) - 1


# -- block hashing (vLLM's sha256_cbor chain) ----------------------------------------------


def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for extra, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if n < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | extra]) + struct.pack(fmt, n)
    raise ValueError(f"{n} does not fit a CBOR length")


def cbor(value: Any) -> bytes:
    """Canonical CBOR of what block hashing feeds it: None, non-negative ints, bytes, str and
    sequences of those (what `cbor2.dumps(value, canonical=True)` gives for them)."""
    if value is None:
        return b"\xf6"
    if isinstance(value, bool):
        raise TypeError("booleans do not occur in block hashes")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("token ids are non-negative")
        return _cbor_head(0, value)
    if isinstance(value, bytes):
        return _cbor_head(2, len(value)) + value
    if isinstance(value, str):
        raw = value.encode("utf-8")
        return _cbor_head(3, len(raw)) + raw
    if isinstance(value, (list, tuple)):
        return _cbor_head(4, len(value)) + b"".join(cbor(v) for v in value)
    raise TypeError(f"cannot hash a {type(value).__name__}")


def seed_hash(seed: str) -> bytes:
    """The parent of a prompt's first block (vLLM's NONE_HASH for PYTHONHASHSEED=seed)."""
    return hashlib.sha256(cbor(seed)).digest()


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The 32-byte hash of a full block after `parent` (a block hash or the seed hash)."""
    return hashlib.sha256(cbor((parent, tuple(int(t) for t in tokens), None))).digest()


def wire_hash(digest: bytes) -> int:
    """The integer a block hash travels as: its low 64 bits."""
    return int.from_bytes(digest, "big") & _MASK64


def chain(tokens: Sequence[int], block_size: int, seed: str) -> list[bytes]:
    """The hashes of every full block of `tokens`, first block first."""
    out: list[bytes] = []
    parent = seed_hash(seed)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start:start + block_size])
        out.append(parent)
    return out


# -- events ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int] = None
    medium: Optional[str] = MEDIUM
    lora_name: Optional[str] = None

    def wire(self) -> dict[str, Any]:
        return {"type": "BlockStored", "block_hashes": self.block_hashes,
                "parent_block_hash": self.parent_block_hash, "token_ids": self.token_ids,
                "block_size": self.block_size, "lora_id": self.lora_id, "medium": self.medium,
                "lora_name": self.lora_name}


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: Optional[str] = MEDIUM

    def wire(self) -> dict[str, Any]:
        return {"type": "BlockRemoved", "block_hashes": self.block_hashes,
                "medium": self.medium}


@dataclass(frozen=True)
class AllBlocksCleared:
    def wire(self) -> dict[str, Any]:
        return {"type": "AllBlocksCleared"}


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]


def encode_batch(events: Iterable[Event], ts: float, rank: int = 0) -> bytes:
    """The msgpack payload of one batch (vLLM's KVEventBatch layout)."""
    import msgspec

    return bytes(msgspec.msgpack.encode([ts, [e.wire() for e in events], rank]))


# -- which blocks the store holds -------------------------------------------------------------


@dataclass
class BlockLedger:
    """Reference-counted full blocks of the resident holders' keys.

    `stored(entry_id, key)` returns the event announcing the blocks that became resident (None
    when every block was resident already or the key is shorter than a block);
    `removed(entry_id)` the event withdrawing the blocks no holder has any more. An entry id is
    ("entry", a store entry's insert serial) or ("running", request id) for a running
    request's prompt."""

    block_size: int
    seed: str = "0"
    _refs: dict[bytes, int] = field(default_factory=dict)
    _entries: dict[Hashable, list[bytes]] = field(default_factory=dict)
    _keys: dict[Hashable, list[int]] = field(default_factory=dict)  # each entry's full blocks

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) \
                or self.block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {self.block_size!r}")

    @property
    def blocks(self) -> int:
        """Distinct blocks resident."""
        return len(self._refs)

    def stored(self, entry_id: Hashable, key: Sequence[int]) -> Optional[BlockStored]:
        if entry_id in self._entries:
            raise ValueError(f"entry {entry_id} is already resident")
        hashes = chain(key, self.block_size, self.seed)
        self._entries[entry_id] = hashes
        self._keys[entry_id] = [int(t) for t in key[:len(hashes) * self.block_size]]
        first_new = len(hashes)
        for i, h in enumerate(hashes):
            n = self._refs.get(h, 0)
            self._refs[h] = n + 1
            if n == 0 and first_new == len(hashes):
                first_new = i
        if first_new == len(hashes):
            return None
        # NOTE: a block can only be new if every later block is too (a later block's hash
        # chains this one's), so the new blocks are one run to the end of the key.
        b = self.block_size
        parent = wire_hash(hashes[first_new - 1]) if first_new else None
        return BlockStored([wire_hash(h) for h in hashes[first_new:]], parent,
                           [int(t) for t in key[first_new * b:len(hashes) * b]], b)

    def removed(self, entry_id: Hashable) -> Optional[BlockRemoved]:
        hashes = self._entries.pop(entry_id, None)
        if hashes is None:
            return None
        del self._keys[entry_id]
        gone = []
        for h in reversed(hashes):  # deepest first, as a cache evicts
            n = self._refs[h] - 1
            if n:
                self._refs[h] = n
            else:
                del self._refs[h]
                gone.append(wire_hash(h))
        return BlockRemoved(gone) if gone else None

    def clear(self) -> None:
        self._refs.clear()
        self._entries.clear()
        self._keys.clear()

    def snapshot(self) -> list[Event]:
        """The whole of what is resident, as one batch: AllBlocksCleared, then each entry's
        blocks not announced before it in the batch (what a subscriber that joins late needs
        to know; one already subscribed rebuilds the same index from it)."""
        events: list[Event] = [AllBlocksCleared()]
        seen: set[bytes] = set()
        b = self.block_size
        for entry_id, hashes in self._entries.items():
            first_new = next((i for i, h in enumerate(hashes) if h not in seen), len(hashes))
            if first_new == len(hashes):
                continue
            seen.update(hashes)
            key = self._keys[entry_id]
            parent = wire_hash(hashes[first_new - 1]) if first_new else None
            events.append(BlockStored([wire_hash(h) for h in hashes[first_new:]], parent,
                                      key[first_new * b:], b))
        return events


# -- the publisher ----------------------------------------------------------------------------


class KvEventPublisher:
    """Batches of events on a PUB socket (an XPUB, bound to `endpoint`), from a thread of its
    own.

    `publish` only queues (the engine thread never touches ZeroMQ); the thread numbers the
    batches, sends them and keeps the last `buffer_batches` for the replay socket. The socket
    is an XPUB, which tells the thread of each new subscription: `on_subscribe()` is called
    then (from that thread), so that whoever keeps the state can publish it whole for a
    subscriber that joined late (`start` has the engine thread publish the ledger's
    snapshot)."""

    def __init__(self, endpoint: str, replay_endpoint: Optional[str] = None, topic: str = "",
                 buffer_batches: int = 10_000, max_queue: int = 100_000,
                 settle_s: float = 0.3) -> None:
        import zmq

        _check_endpoint(endpoint, "endpoint")
        if replay_endpoint is not None:
            _check_endpoint(replay_endpoint, "replay_endpoint")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._topic = topic.encode("utf-8")
        self._queue: queue.Queue[Optional[tuple[int, bytes]]] = queue.Queue(maxsize=max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._replay = None
        self.on_subscribe: Optional[Callable[[], None]] = None
        self.subscriptions = 0  # subscriptions seen (each subscriber's, repeated ones too)
        try:
            self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's, not the first only
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.SNDHWM, 100_000)  # as vLLM's: a burst is not dropped
            self._pub.bind(endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise OSError(f"cannot bind the KV events socket {endpoint}: {exc}") from None
        # NOTE: subscribers that were connected to a previous run reconnect within ZeroMQ's
        # reconnect interval (0.1 s); the first batch (AllBlocksCleared) waits that long so it
        # is not dropped before they are back.
        self._settle_s = settle_s
        self.sent = 0  # batches sent
        self.dropped = 0  # batches not queued because the queue was full
        self._lost = 0  # of those, the ones the next queued batch's sequence number skips
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: Sequence[Event]) -> None:
        if not events:
            return
        try:
            self._queue.put_nowait((self._lost, encode_batch(events, time.time())))
            self._lost = 0
        except queue.Full:
            # Lost: the next batch queued skips its sequence number, so a subscriber sees the
            # gap where the batch would have been.
            self.dropped += 1
            self._lost += 1

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (up to `timeout_s`), then close the sockets."""
        if self._thread.is_alive():
            try:
                self._queue.put(None, timeout=timeout_s)
            except queue.Full:
                pass
            self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        seq = 0
        time.sleep(self._settle_s)
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            while self._pub.poll(0):
                self._subscribed(self._pub.recv())
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            lost, payload = item
            seq += lost
            seq_bytes = seq.to_bytes(8, "big")
            self._pub.send_multipart((self._topic, seq_bytes, payload))
            self._buffer.append((seq, payload))
            self.sent += 1
            seq += 1

    def _subscribed(self, message: bytes) -> None:
        """A subscription message (b"\\x01" + topic; b"\\x00" + topic: one ended)."""
        if message[:1] != b"\x01":
            return
        self.subscriptions += 1
        on_subscribe = self.on_subscribe
        if on_subscribe is not None:
            try:
                on_subscribe()
            except Exception:  # (the engine stopped, say): the events go on all the same
                log.exception("could not have the KV state published for a new subscriber")

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("ignoring a malformed KV event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


def _check_endpoint(endpoint: str, name: str) -> None:
    if not isinstance(endpoint, str) or not endpoint.startswith(("tcp://", "ipc://",
                                                                 "inproc://")):
        raise ValueError(f"{name} must be a ZeroMQ address such as tcp://127.0.0.1:5557, got "
                         f"{endpoint!r}")


# -- the store hook ---------------------------------------------------------------------------


class StoreEvents:
    """Publishes the blocks that change when a prefix store's residency changes.

        events = StoreEvents.attach(store, publisher, block_size=16, watch=host.watch_prefixes)

    With `watch` (a host's `watch_prefixes`, `PrefixEventsHost` in engine/contract.py: it
    calls `watcher(kind, entry)` after every insert and eviction) the hook is a watcher;
    without, it wraps the store's backend and forwards every call to it first. Either way it
    runs on the thread that changes the store (the engine's), the only one that touches the
    ledger."""

    def __init__(self, inner: Any, publisher: Any, ledger: BlockLedger) -> None:
        self.inner = inner  # the wrapped backend (None when attached as a watcher)
        self.publisher = publisher
        self.ledger = ledger

    @classmethod
    def attach(cls, store: Any, publisher: Any, block_size: int, seed: str = "0",
               watch: Optional[Callable[[Callable[[str, Any], None]], None]] = None,
               ledger: Optional[BlockLedger] = None) -> "StoreEvents":
        """Hook `store`; the first batch clears whatever a previous run announced, and the
        entries already resident are announced after it. `ledger`: how keys become blocks
        (default: `BlockLedger(block_size, seed)`)."""
        hook = cls(None if watch is not None else store.backend, publisher,
                   ledger if ledger is not None else BlockLedger(block_size, seed))
        events: list[Event] = [AllBlocksCleared()]
        for entry in store.resident():
            stored = hook.ledger.stored(_ledger_id(entry), entry.key)
            if stored is not None:
                events.append(stored)
        publisher.publish(events)
        if watch is not None:
            watch(hook.changed)
        else:
            store.backend = hook
        return hook

    def changed(self, kind: str, entry: Any) -> None:
        """A watcher's call: `kind` is "inserted" or "evicted"."""
        if kind == "inserted":
            stored = self.ledger.stored(_ledger_id(entry), entry.key)
            if stored is not None:
                self.publisher.publish([stored])
        elif kind == "evicted":
            removed = self.ledger.removed(_ledger_id(entry))
            if removed is not None:
                self.publisher.publish([removed])
        else:
            raise ValueError(f"unknown residency change {kind!r}")

    def running(self, request_id: str, prompt: Sequence[int]) -> None:
        """A request's prompt is in its lane's cells (its first token was sampled): its blocks
        are announced, as vLLM announces blocks as they fill."""
        stored = self.ledger.stored(("running", request_id), prompt)
        if stored is not None:
            self.publisher.publish([stored])

    def ended(self, request_id: str) -> None:
        """The request let go of its lane (its holder, if the store kept one, is announced
        already): the blocks nothing else holds are withdrawn."""
        removed = self.ledger.removed(("running", request_id))
        if removed is not None:
            self.publisher.publish([removed])

    def inserted(self, entry: Any) -> None:
        self.inner.inserted(entry)
        self.changed("inserted", entry)

    def evicted(self, entry: Any) -> None:
        self.inner.evicted(entry)
        self.changed("evicted", entry)


def _ledger_id(entry: Any) -> Hashable:
    """An entry's name in the ledger: its insert serial, unique for the store's life (entry ids
    are reused, and a replacement's insert may be told before the eviction that freed its id)."""
    return ("entry", entry.serial)


def check(settings: Any) -> None:
    """Refuse KV event settings that cannot work, before a server loads its model."""
    if settings.kv_events_endpoint is None:
        return
    if settings.prefix_cache_tokens <= 0:
        raise ValueError("KV events announce the prefix store's blocks: they need prefix "
                         "reuse (prefix_cache_tokens > 0)")
    _check_endpoint(settings.kv_events_endpoint, "kv_events_endpoint")
    if settings.kv_events_replay_endpoint is not None:
        _check_endpoint(settings.kv_events_replay_endpoint, "kv_events_replay_endpoint")
    BlockLedger(settings.kv_block_size)


def watch_running(engine: "Engine", host: PrefixEventsHost, hook: StoreEvents) -> None:
    """Announce each request's prompt blocks when its first token is sampled and withdraw them
    when it finishes or is preempted (an engine listener and observer: on the engine thread,
    as the holders' watcher). Without this a router learns of a prompt only when its request
    ends and is kept, so the next request of the same prefix, sent while the first still runs,
    is routed as if no replica had it. A preempted request's lane is freed: its blocks are
    withdrawn once the host has released it (those its holder kept stay announced), and
    announced again at its next first token."""
    from ..engine import BaseObserver, FinishEvent, TokenEvent

    seen: set[str] = set()
    preempted: list[str] = []  # told before their release; withdrawn at the next plan

    def end(rid: str) -> None:
        if rid in seen:
            seen.discard(rid)
            hook.ended(rid)

    def on_event(event: Any) -> None:
        rid = event.request_id
        if isinstance(event, TokenEvent):
            if rid in seen:
                return
            tokens = host.held_tokens(rid)
            if tokens is None:
                return
            seen.add(rid)
            hook.running(rid, tokens)
        elif isinstance(event, FinishEvent):
            end(rid)

    class Preempted(BaseObserver):
        def preempted(self, ids: list[str]) -> None:
            preempted.extend(i for i in ids if i in seen)

        def planned(self, flight: Any) -> None:
            # Once the host has released it (with plans in flight the release waits on the
            # host's worker): what a holder kept of it is announced by then, not withdrawn.
            if preempted:
                waiting = [rid for rid in preempted if host.held_tokens(rid) is not None]
                for rid in preempted:
                    if rid not in waiting:
                        end(rid)
                preempted[:] = waiting

    engine.add_listener(on_event)
    engine.observers.append(Preempted())


def start(settings: Any, host: ServingHost, engine: Optional["Engine"] = None,
          post: Optional[Callable[[Callable[[], Any]], Any]] = None
          ) -> Optional[KvEventPublisher]:
    """The publisher a server's settings ask for, watching its host's prefix store and, given
    the `engine`, its running requests (None when `kv_events_endpoint` is unset). The host
    must be a `PrefixEventsHost` with a store. `post(fn)`: runs `fn` on the engine thread (an
    `EngineRunner`'s): each new subscriber has the ledger's snapshot published there, so a
    router that starts after the replica learns what it holds."""
    check(settings)
    if settings.kv_events_endpoint is None:
        return None
    if not isinstance(host, PrefixEventsHost) or host.prefix_store is None:
        raise ValueError("the host keeps no prefixes: KV events need prefix reuse")
    store = host.prefix_store
    publisher = KvEventPublisher(settings.kv_events_endpoint,
                                 settings.kv_events_replay_endpoint)
    try:
        hook = StoreEvents.attach(store, publisher, settings.kv_block_size,
                                  settings.kv_hash_seed, watch=host.watch_prefixes)
        if engine is not None:
            watch_running(engine, host, hook)
        if post is not None:
            def resync() -> None:
                post(lambda: publisher.publish(hook.ledger.snapshot()))
            publisher.on_subscribe = resync
    except BaseException:
        publisher.close()
        raise
    return publisher
