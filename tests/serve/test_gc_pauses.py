"""The garbage collector's pauses counted for `/metrics`, and the startup heap `serve` freezes
out of the collector's passes before it listens (serve/gc_pauses.py)."""
from __future__ import annotations

import gc
import weakref

import pytest

from skippy_scheduler.serve.gc_pauses import GcPauses, freeze_startup_heap


def test_each_collection_is_counted_and_timed_by_generation():
    pauses = GcPauses().install()
    try:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    finally:
        pauses.remove()
    assert pauses.collections[0] >= 1 and pauses.collections[2] >= 2
    assert pauses.seconds[2] > 0 and 0 < pauses.longest[2] <= pauses.seconds[2]
    counted = list(pauses.collections)
    gc.collect()
    assert pauses.collections == counted  # removed: no longer called
    pauses("stop", {"generation": 1})  # an end without its start (installed mid-pass)
    assert pauses.collections == counted


class _Node:
    def __init__(self) -> None:
        self.other: object = self  # a cycle: only the collector frees it


def test_the_startup_heap_is_collected_before_it_is_frozen():
    garbage = _Node()
    ref = weakref.ref(garbage)
    del garbage
    try:
        frozen = freeze_startup_heap()
        assert ref() is None  # collected, not frozen with the rest
        # (Frozen objects that die since, other threads' among them, leave the count.)
        assert frozen > 1000 and 0 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


def test_serve_freezes_its_heap_and_reports_the_pauses(tmp_path):
    pytest.importorskip("llama_cpp")
    pytest.importorskip("fastapi")
    import httpx
    from serve_support import Spawned, metrics

    srv = Spawned(tmp_path)
    try:
        r = httpx.post(srv.url + "/v1/completions", json={
            "model": "tiny-random-llama", "prompt": "the cat", "max_tokens": 8}, timeout=30)
        assert r.status_code == 200, r.text
        m = metrics(srv.url)
    finally:
        assert srv.stop() == 0
    assert m["skippy:gc_frozen_objects"] > 1000
    for g in ("0", "1", "2"):
        assert f'skippy:gc_collections_total{{generation="{g}"}}' in m
        assert f'skippy:gc_pause_seconds_total{{generation="{g}"}}' in m
        assert f'skippy:gc_pause_max_seconds{{generation="{g}"}}' in m
    # The collection before the freeze was timed (and more passes since start-up).
    assert m['skippy:gc_collections_total{generation="2"}'] >= 1
    assert m['skippy:gc_pause_max_seconds{generation="2"}'] > 0
