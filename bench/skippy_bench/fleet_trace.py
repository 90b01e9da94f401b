"""What each replica held while a fleet ran, from its KV events: why a policy hit or missed.

`bench/fleet.py --trace` subscribes to every replica's KV events (as the router does) for the
whole run and records every batch with the time it arrived. From that, with the token ids
of each prompt (the replicas' `/tokenize`), it rebuilds each replica's resident blocks at any
moment and reports, counts only (no timings):

* which replica served each request: the one whose events announced the request's own
  suffix blocks when its holder was kept (each request's suffix is its own, so that block is
  announced by the replica that ran it and by no other);
* for each request, where its group's prefix was resident when it was sent: on the replica
  that served it (a hit is possible), only on another (the policy sent it elsewhere; "fresh"
  when that replica's announcement was under 0.1 s old, so the router may not have seen it),
  or on none (no routing could have made it hit then), and of those, how many were sent while
  a request of the same group was running (its blocks exist in a lane but are announced only
  when it ends) and how many of them went to another replica than that one;
* how sticky the routing was: the share of each group's requests that went to the replica
  most of them went to (1.0: every group kept to one replica, a partition of the groups);
* how many distinct groups each replica held, averaged over the requests' send times, against
  its holder count: every finished request is kept as a holder of its own (its whole key), so
  requests of one group occupy several holders and a replica holds fewer groups than holders;
* what share of requests could hit at best, by a model of those holders (least recently used
  out, one holder per finished request, requests one at a time) replayed on the same request
  sequence, for round robin and for a partition of the groups over the replicas (each group
  always on one replica: what a perfectly sticky prefix-aware router does).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from collections import OrderedDict
from typing import Any, Callable, Optional

from skippy_scheduler.serve.kv_events import chain, wire_hash


FRESH_S = 0.1  # an announcement younger than this may not have reached the router


@dataclass
class ReplicaEvents:
    """The batches one replica published: (perf_counter at arrival, events)."""

    batches: list[tuple[float, list[dict[str, Any]]]] = field(default_factory=list)

    def resident_at(self, t: float) -> dict[int, float]:
        """The blocks resident at time `t`, each with the time its BlockStored arrived."""
        blocks: dict[int, float] = {}
        for at, events in self.batches:
            if at > t:
                break
            for e in events:
                kind = e.get("type")
                if kind == "BlockStored":
                    blocks.update((h, at) for h in e["block_hashes"] if h not in blocks)
                elif kind == "BlockRemoved":
                    for h in e["block_hashes"]:
                        blocks.pop(h, None)
                elif kind == "AllBlocksCleared":
                    blocks.clear()
        return blocks

    def stored(self) -> set[int]:
        """Every block hash this replica ever announced."""
        return {h for _, events in self.batches for e in events
                if e.get("type") == "BlockStored" for h in e["block_hashes"]}


class EventRecorder:
    """SUB sockets on the replicas' event endpoints, drained by a thread until `stop`."""

    def __init__(self, endpoints: list[str]) -> None:
        import msgspec
        import zmq

        self._decode = msgspec.msgpack.decode
        self._ctx = zmq.Context()
        self._socks = []
        for ep in endpoints:
            s = self._ctx.socket(zmq.SUB)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.connect(ep)
            self._socks.append(s)
        self.replicas = [ReplicaEvents() for _ in endpoints]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        for s in self._socks:
            poller.register(s, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(50):
                _topic, _seq, payload = sock.recv_multipart()
                _ts, events, _rank = self._decode(payload)
                self.replicas[self._socks.index(sock)].batches.append(
                    (time.perf_counter(), events))

    def stop(self) -> None:
        time.sleep(0.5)  # the last holders' events
        self._stop.set()
        self._thread.join(5)
        for s in self._socks:
            s.close(linger=0)
        self._ctx.term()


def analyse(recorder: EventRecorder, tokens: list[list[int]], groups: list[int],
            sent: list[Optional[float]], prefix_tokens: int, block: int,
            holders: int, ended: Optional[list[float]] = None) -> dict[str, Any]:
    """The counts described in the module docstring; `tokens[i]`, `groups[i]`, `sent[i]` are
    request i's prompt token ids, group and send time (None: never sent), `ended[i]` the time
    its answer ended."""
    seed = "0"
    n = len(recorder.replicas)
    last_prefix = prefix_tokens // block - 1  # the last full block inside the shared prefix
    stored = [r.stored() for r in recorder.replicas]
    served: list[Optional[int]] = []
    where = {"on_served": 0, "only_elsewhere": 0, "only_elsewhere_fresh": 0, "nowhere": 0,
             "nowhere_but_running": 0, "nowhere_but_running_elsewhere": 0, "unknown": 0}
    distinct: list[list[int]] = [[] for _ in recorder.replicas]
    group_last = {}  # group -> the hash of its prefix's last full block
    for ids, g in zip(tokens, groups):
        h = chain(ids[:prefix_tokens], block, seed)
        if h:
            group_last[g] = wire_hash(h[-1])
    chains = [[wire_hash(h) for h in chain(ids, block, seed)] for ids in tokens]
    for hashes in chains:
        own = hashes[last_prefix + 1] if len(hashes) > last_prefix + 1 else None
        by = [r for r, s in enumerate(stored) if own is not None and own in s]
        served.append(by[0] if len(by) == 1 else None)
    for i, hashes in enumerate(chains):
        t = sent[i]
        if t is None or last_prefix < 0:
            continue
        resident = [rep.resident_at(t) for rep in recorder.replicas]
        holding = [r for r, blocks in enumerate(resident) if hashes[last_prefix] in blocks]
        if served[i] is None:
            where["unknown"] += 1
        elif served[i] in holding:
            where["on_served"] += 1
        elif holding:
            where["only_elsewhere"] += 1
            # Announced less than FRESH_S before the send: the router may not have had it yet.
            if min(t - resident[r][hashes[last_prefix]] for r in holding) < FRESH_S:
                where["only_elsewhere_fresh"] += 1
        else:
            where["nowhere"] += 1
            # A request of the same group running then: its blocks exist, in a lane, and are
            # announced only when it ends and its holder is kept.
            running = [served[j] for j in range(len(tokens)) if ended is not None
                       and j != i and groups[j] == groups[i] and sent[j] is not None
                       and sent[j] < t < ended[j]]
            if running:
                where["nowhere_but_running"] += 1
                if served[i] not in running:
                    where["nowhere_but_running_elsewhere"] += 1
        for r, blocks in enumerate(resident):
            distinct[r].append(sum(1 for h in group_last.values() if h in blocks))
    return {
        "requests_by_replica": [served.count(r) for r in range(len(recorder.replicas))],
        "group_stickiness": stickiness(served, groups),
        "prefix_at_send": where,
        "groups_resident_mean": [sum(d) / len(d) if d else 0.0 for d in distinct],
        "holders_per_replica": holders,
        "modelled_hit_share": {
            "round_robin": store_model(groups, holders, lambda i, g: i % n),
            "partition": store_model(groups, holders, lambda i, g: g % n)},
    }


def stickiness(served: list[Optional[int]], groups: list[int]) -> float:
    """Requests that went to their group's most used replica, over the requests placed."""
    by_group: dict[int, list[int]] = {}
    for r, g in zip(served, groups):
        if r is not None:
            by_group.setdefault(g, []).append(r)
    placed = sum(len(v) for v in by_group.values())
    top = sum(max(v.count(r) for r in set(v)) for v in by_group.values())
    return top / placed if placed else 0.0


def store_model(groups: list[int], holders: int, assign: Callable[[int, int], int]) -> float:
    """The share of requests that find their group resident on the replica `assign(i, group)`
    sends them to, when each replica keeps its last `holders` finished requests (a hit
    refreshes the holder it used)."""
    stores: dict[int, OrderedDict[int, int]] = {}
    hits = 0
    for i, g in enumerate(groups):
        kept = stores.setdefault(assign(i, g), OrderedDict())
        same = [k for k, v in kept.items() if v == g]
        if same:
            hits += 1
            kept.move_to_end(same[-1])
        kept[i] = g
        while len(kept) > holders:
            kept.popitem(last=False)
    return hits / len(groups) if groups else 0.0
