"""Fuzz the native `UnifiedRadixCache` (behaviour.md §8) against its flat pure-Python twin.

Bytes decode into operations (inserts with small or huge byte counts, peeks, lookups, acquire /
release, exact reads, removals, predicate removals, LRU candidates and evictions) over a few
namespaces and keys from a small alphabet, with occasional long keys sharing a prefix so edges
split and re-merge. After every operation results, epoch and stats must be equal, and the
stats must be consistent (entries and refs never negative, refs only on existing entries).

    python tests/fuzz/fuzz_radix.py tests/fuzz/corpus/fuzz_radix -max_total_time=60
"""
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bytes import ByteReader  # noqa: E402

radix = twin_mod = None

INSERTS = ["insert_resident", "insert_resident_if_vacant", "insert_recurrent"]
KEYED = ["peek_resident", "peek_recurrent", "lookup_resident", "lookup_recurrent", "acquire_resident",
         "acquire_recurrent", "release_resident", "release_recurrent", "resident_exact", "recurrent_exact",
         "remove_resident", "remove_recurrent"]
GLOBAL = ["evict_lru_resident", "evict_lru_recurrent", "lru_resident_candidate", "lru_recurrent_candidate"]
NAMESPACES = ["stage-0", "stage-1", ""]
BIG = (1 << 64) - 1


def _imports():
    from skippy_scheduler import radix
    from skippy_scheduler.reference import radix as reference_radix

    return radix, reference_radix


def key(r: ByteReader) -> list:
    k = [r.below(5) - 1 for _ in range(r.below(7))]  # includes -1 and empty keys
    if r.below(8) == 0:
        k = [7] * (40 + r.below(60)) + k  # long shared run
    return k


def call(cache, name, args):
    try:
        if name.endswith("_where"):
            mod = args[0]
            return getattr(cache, name)(lambda e: e.logical_bytes % mod == 0)
        return getattr(cache, name)(*args)
    except ValueError as exc:
        return ("ValueError", str(exc))


def run(data: bytes) -> None:
    global radix, twin_mod
    if radix is None:
        radix, twin_mod = _imports()
    r = ByteReader(data)
    native, twin = radix.UnifiedRadixCache(), twin_mod.RadixTwin()
    step = 0
    while r.remaining() > 0:
        kind = r.below(10)
        if kind < 4:
            nbytes = BIG - r.below(3) if r.below(10) == 0 else r.below(1000)
            name, args = INSERTS[r.below(3)], (NAMESPACES[r.below(3)], key(r), nbytes, f"v{step}")
        elif kind < 8:
            name, args = KEYED[r.below(len(KEYED))], (NAMESPACES[r.below(3)], key(r))
        elif kind == 8:
            name, args = GLOBAL[r.below(4)], ()
        else:
            name, args = ["remove_resident_where", "remove_recurrent_where"][r.below(2)], (2 + r.below(4),)
        a, b = call(native, name, args), call(twin, name, args)
        assert a == b, (name, args, a, b)
        assert native.epoch() == twin.epoch()
        stats = dataclasses.asdict(native.stats())
        assert stats == twin.stats(), (name, stats, twin.stats())
        assert stats["resident_active_refs"] == 0 or stats["resident_entries"] > 0
        assert stats["recurrent_active_refs"] == 0 or stats["recurrent_entries"] > 0
        step += 1
    assert native.resident_entries() == twin.resident_entries()
    assert native.recurrent_entries() == twin.recurrent_entries()


def TestOneInput(data: bytes) -> None:  # noqa: N802 - the atheris entry point name
    run(data)


if __name__ == "__main__":
    import atheris

    with atheris.instrument_imports():
        radix, twin_mod = _imports()
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()
