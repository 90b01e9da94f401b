"""The KV events Dynamo's router reads (skippy_scheduler/dynamo/routing_events.py): blocks of
each key less the BOS the worker put in front, so they are the blocks of the token ids
Dynamo's frontend hashed. No Dynamo needed."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("msgspec")

from skippy_scheduler.dynamo.routing_events import (RoutingLedger, attach,  # noqa: E402
                                                   connect_endpoint)
from skippy_scheduler.serve.kv_events import (AllBlocksCleared, BlockLedger,  # noqa: E402
                                              BlockStored)

BOS = 1
IDS = list(range(100, 140))  # what the frontend sends: 40 ids, two full blocks of 16


def test_blocks_are_the_frontends_ids_without_the_bos():
    routed = RoutingLedger(16, bos=BOS).stored("a", [BOS, *IDS])
    plain = BlockLedger(16).stored("a", IDS)
    assert isinstance(routed, BlockStored) and routed.wire() == plain.wire()
    assert routed.token_ids == IDS[:32] and routed.parent_block_hash is None


def test_a_key_without_the_bos_and_no_bos_at_all_are_kept_as_they_are():
    assert RoutingLedger(16, bos=BOS).stored("a", IDS).wire() == \
        BlockLedger(16).stored("a", IDS).wire()
    assert RoutingLedger(16, bos=None).stored("a", [BOS, *IDS]).wire() == \
        BlockLedger(16).stored("a", [BOS, *IDS]).wire()


def test_removal_withdraws_what_was_stored():
    ledger = RoutingLedger(16, bos=BOS)
    stored = ledger.stored("a", [BOS, *IDS])
    removed = ledger.removed("a")
    assert sorted(removed.block_hashes) == sorted(stored.block_hashes)
    assert ledger.blocks == 0


class _Publisher:
    def __init__(self) -> None:
        self.batches: list[list] = []

    def publish(self, events) -> None:
        self.batches.append(list(events))


def test_attach_clears_announces_the_resident_and_follows_the_store():
    entry = SimpleNamespace(serial=1, key=[BOS, *IDS])
    watchers = []
    host = SimpleNamespace(prefix_store=SimpleNamespace(resident=lambda: [entry]),
                           watch_prefixes=watchers.append, held_tokens=lambda rid: None)
    pub = _Publisher()
    attach(host, None, pub, 16, bos=BOS)
    first = pub.batches[0]
    assert isinstance(first[0], AllBlocksCleared)
    assert first[1].wire() == BlockLedger(16).stored("x", IDS).wire()
    later = SimpleNamespace(serial=2, key=[BOS, *IDS, *range(200, 216)])
    watchers[0]("inserted", later)
    assert pub.batches[-1][0].token_ids == IDS[32:] + list(range(200, 208))


def test_attach_needs_a_prefix_store():
    with pytest.raises(ValueError, match="prefix"):
        attach(SimpleNamespace(prefix_store=None), None, _Publisher(), 16)


@pytest.mark.parametrize("bound, connect", [
    ("tcp://*:5600", "tcp://127.0.0.1:5600"),
    ("tcp://0.0.0.0:5600", "tcp://127.0.0.1:5600"),
    ("tcp://127.0.0.1:5600", "tcp://127.0.0.1:5600"),
    ("tcp://10.1.2.3:5600", "tcp://10.1.2.3:5600"),
    ("ipc:///tmp/routing", "ipc:///tmp/routing"),
])
def test_the_relay_connects_where_a_connector_can(bound, connect):
    assert connect_endpoint(bound) == connect


@pytest.mark.parametrize("bound", ["tcp://*:*", "tcp://127.0.0.1", "127.0.0.1:5600",
                                   "tcp://:5600"])
def test_an_address_the_relay_cannot_connect_to_is_refused(bound):
    with pytest.raises(ValueError, match="routing events endpoint"):
        connect_endpoint(bound)
