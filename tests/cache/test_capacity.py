"""Conformance cases of behaviour.md §6.5 (component "kv-cells") and validation."""
import pytest

from skippy_scheduler.capacity import (
    CapacityDemand,
    CapacityPlan,
    ComponentCapacitySnapshot,
    EvictableCacheEntry,
    plan_component_capacity,
)

U64_MAX = (1 << 64) - 1


def plan(capacity, active=0, pinned=0, entries=(), demand=(0, 0, 0)):
    snap = ComponentCapacitySnapshot(
        "kv-cells", capacity, active, pinned, tuple(EvictableCacheEntry(*e) for e in entries))
    return plan_component_capacity(snap, CapacityDemand(*demand))


def test_rejects_when_pinned_capacity_cannot_leave_the_minimum_watermark():
    p = plan(100, 50, 40, [("evictable", 10, 10, 0)], (5, 10, 20))
    assert p == CapacityPlan("kv-cells", False, [], 0, 0, 0, 5, 5)


def test_admits_a_request_that_fits_when_watermarks_exceed_the_pool():
    p = plan(256, demand=(39, 512, 1024))
    assert p.admitted and p.victim_ids == [] and p.projected_free_units == 217
    assert p.admission_deficit_units == 0 and p.required_eviction_units == 0


def test_admits_a_request_when_minimum_watermark_matches_pool_capacity():
    p = plan(256, demand=(39, 256, 256))
    assert p.admitted and p.projected_free_units == 217
    assert p.required_eviction_units == 0 and p.admission_deficit_units == 0


def test_still_rejects_when_non_evictable_work_exceeds_the_pool():
    p = plan(256, 200, 0, [("evictable", 100, 100, 0)], (57, 512, 1024))
    assert not p.admitted and p.admission_deficit_units == 1 and p.victim_ids == []
    assert p.projected_free_units == 0


def test_evicts_low_recompute_cost_before_older_expensive_entries():
    p = plan(100, 30, 0, [("old-expensive", 30, 300, 1), ("new-cheap", 30, 30, 2)], (20, 10, 20))
    assert p == CapacityPlan("kv-cells", True, ["new-cheap"], 30, 30, 30, 20, 0)


def test_equal_cost_density_prefers_cold_entries_before_smaller_hot_entries():
    p = plan(100, 30, 0, [("cold-large", 30, 300, 1), ("hot-small", 10, 100, 2)], (20, 10, 20))
    assert p == CapacityPlan("kv-cells", True, ["cold-large"], 10, 30, 300, 40, 0)


def test_target_watermark_evicts_when_the_hard_minimum_was_already_met():
    p = plan(100, 30, 0, [("cheap", 20, 20, 0)], (20, 10, 40))
    assert p == CapacityPlan("kv-cells", True, ["cheap"], 10, 20, 20, 50, 0)


def test_keeps_every_entry_when_the_target_watermark_is_already_met():
    p = plan(100, 20, 0, [("keep", 20, 20, 0)], (10, 10, 30))
    assert p == CapacityPlan("kv-cells", True, [], 0, 0, 0, 50, 0)


def test_zero_unit_entries_are_skipped_and_ties_fall_to_cost_then_id():
    entries = [("z", 0, 0, 0), ("b", 10, 10, 5), ("a", 10, 10, 5), ("c", 5, 5, 5)]
    p = plan(100, 70, 0, entries, (0, 0, 20))  # must evict 70 + 25 + 20 - 100 = 15
    # densities all 1 (z: 0 units -> cost 0 / 1 = 0, first but skipped), last_used equal,
    # then recompute cost 5 < 10, then id a < b
    assert p.victim_ids == ["c", "a"] and p.evicted_units == 15
    assert p.required_eviction_units == 15 and p.projected_free_units == 20


def test_density_uses_exact_products_beyond_float_precision():
    # densities 1 + 2^-62 (x) and 1 + 1/(2^62 + 1) (y) are equal as floats; exactly, y is
    # cheaper, although x is colder
    g = 1 << 62
    entries = [("x", g, g + 1, 0), ("y", g + 1, g + 2, 9)]
    p = plan(3 * g, 0, 0, entries, (0, 0, g + 1))  # must evict (2g + 1) + (g + 1) - 3g = 2
    assert p.required_eviction_units == 2
    assert p.victim_ids == ["y"] and p.predicted_recompute_cost == g + 2


def test_sums_saturate():
    m = U64_MAX
    entries = [("a", m, m, 0), ("b", m, m, 1)]
    p = plan(m, 0, 0, entries, (0, 0, 0))
    assert p.admitted and p.required_eviction_units == 0 and p.victim_ids == []
    p = plan(10, m, m, [], (m, 0, 0))
    assert not p.admitted and p.admission_deficit_units == m - 10


@pytest.mark.parametrize(
    "build, exc",
    [
        (lambda: EvictableCacheEntry(1, 1, 1, 1), TypeError),
        (lambda: EvictableCacheEntry("a", -1, 1, 1), ValueError),
        (lambda: EvictableCacheEntry("a", 1, 2**64, 1), ValueError),
        (lambda: CapacityDemand(True, 0, 0), TypeError),
        (lambda: ComponentCapacitySnapshot("c", 1.0), TypeError),
        (lambda: ComponentCapacitySnapshot("c", 1, 0, 0, [("a", 1, 1, 1)]), TypeError),
        (lambda: ComponentCapacitySnapshot(None, 1), TypeError),
        (lambda: plan_component_capacity(None, CapacityDemand(0)), TypeError),
        (lambda: plan_component_capacity(ComponentCapacitySnapshot("c", 1), (0, 0, 0)), TypeError),
    ],
)
def test_validation(build, exc):
    with pytest.raises(exc):
        build()


def test_numpy_integers_are_plain_ints_and_do_not_wrap():
    import numpy as np

    big = np.uint64(U64_MAX)
    p = plan(np.uint64(100), big, np.uint64(1), [], (np.uint64(5), 0, 0))
    assert not p.admitted and p.admission_deficit_units == U64_MAX - 100
    assert type(p.admission_deficit_units) is int
    with pytest.raises(TypeError):
        CapacityDemand(np.bool_(True), 0, 0)
