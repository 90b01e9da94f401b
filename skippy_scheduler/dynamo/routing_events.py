"""The KV events Dynamo's router reads: the prefix store's blocks as the frontend counts them.

Dynamo's KV router hashes the token ids its frontend produced, block by block
(`kv_cache_block_size` tokens, xxh3 of each block's ids), and matches them against the blocks
the workers' events announce (it rehashes each announced block's `token_ids` the same way).
Dynamo 1.6's frontend tokenizes `/v1/completions` prompts and rendered chat templates without
the model's BOS (the `tokenizers` encode runs with `add_special_tokens=false`, whatever the
folder's post-processor or `add_bos_token` say), while this engine runs a prompt with the BOS in
front, as llama.cpp and `skippy-scheduler serve` do (adapter.py puts it there). The engine's own
keys (and the server's vLLM-format events, `serve/kv_events.py`) start with that BOS, so every
block is shifted by one token against the router's: not one block ever matched, and the KV
router routed as if no replica held anything.

`RoutingLedger` cuts blocks from a key less its leading BOS, so the blocks announced here are
the blocks of the ids the frontend sent: the router's hashes and these agree, and the engine's
cache (what is reused) stays the same tokens as for traffic sent straight to `serve`.
`attach` publishes them on a PUB socket of their own (vLLM's wire format, the server's
`KvEventPublisher`), which the worker hands Dynamo's relay as its `ZmqSource`; the server's
own stream (`--kv-events-endpoint`, BOS included, for vllm-router and llm-d) is unchanged.
As that stream does, each new subscriber (Dynamo's relay, when it subscribes after the worker
started or subscribes again) has the ledger's snapshot published: AllBlocksCleared, then
every block resident. The relay connects to `connect_endpoint` of the bound address.

What does not line up: a request whose token ids reach the worker with the BOS already in
front (a `prompt` of token ids starting with it): the router hashed the BOS as the first token,
the announced blocks have it stripped, so its prefix does not match (it is routed on load
only; the engine still reuses its cache).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional, Sequence

from ..engine.contract import PrefixEventsHost
from ..serve.kv_events import (BlockLedger, BlockStored, KvEventPublisher, StoreEvents,
                               watch_running)


@dataclass
class RoutingLedger(BlockLedger):
    """A `BlockLedger` over each key less its leading `bos` (None: keys as they are)."""

    bos: Optional[int] = None

    def stored(self, entry_id: Hashable, key: Sequence[int]) -> Optional[BlockStored]:
        if self.bos is not None and len(key) and int(key[0]) == self.bos:
            key = key[1:]
        return super().stored(entry_id, key)


def attach(host: Any, engine: Any, publisher: Any, block_size: int, seed: str = "0",
           bos: Optional[int] = None) -> StoreEvents:
    """Announce `host`'s prefix store (a `PrefixEventsHost`, engine/contract.py) and, given
    the `engine`, its running prompts on `publisher` in the router's blocks, as the server's
    own stream does (`StoreEvents`, `watch_running`) but through a `RoutingLedger`; call before
    the engine thread starts."""
    if not isinstance(host, PrefixEventsHost) or host.prefix_store is None:
        raise ValueError("the host keeps no prefixes: Dynamo's KV routing needs prefix reuse")
    hook = StoreEvents.attach(host.prefix_store, publisher, block_size, seed,
                              watch=host.watch_prefixes,
                              ledger=RoutingLedger(block_size, seed, bos=bos))
    if engine is not None:
        watch_running(engine, host, hook)
    return hook


def start(host: Any, engine: Any, endpoint: str, block_size: int, seed: str = "0",
          bos: Optional[int] = None,
          post: Optional[Callable[[Callable[[], Any]], Any]] = None) -> KvEventPublisher:
    """A PUB socket bound at `endpoint` carrying `attach`'s events. `post(fn)` runs `fn` on
    the engine thread (an `EngineRunner`'s): each new subscriber has the ledger's snapshot
    published there, so a relay that subscribes late learns what is resident."""
    publisher = KvEventPublisher(endpoint)
    try:
        hook = attach(host, engine, publisher, block_size, seed, bos)
        if post is not None:
            def resync() -> None:
                post(lambda: publisher.publish(hook.ledger.snapshot()))
            publisher.on_subscribe = resync
    except BaseException:
        publisher.close()
        raise
    return publisher


_WILDCARD_HOSTS = ("*", "0.0.0.0")


def connect_endpoint(endpoint: str) -> str:
    """Where a subscriber on this machine connects to a socket bound at `endpoint`: a
    wildcard host (``tcp://*:5600``, ``tcp://0.0.0.0:5600``) becomes 127.0.0.1, which the
    wildcard bind listens on too; anything else is as it is. ValueError for what cannot be
    connected to (not a ZeroMQ address, a wildcard port)."""
    if not isinstance(endpoint, str) or not endpoint.startswith(("tcp://", "ipc://",
                                                                 "inproc://")):
        raise ValueError(f"the routing events endpoint must be a ZeroMQ address such as "
                         f"tcp://127.0.0.1:5600, got {endpoint!r}")
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"the routing events endpoint needs a host and a port number that "
                         f"Dynamo's relay can connect to (tcp://HOST:PORT), got {endpoint!r}")
    if host in _WILDCARD_HOSTS:
        host = "127.0.0.1"
    return f"tcp://{host}:{port}"
