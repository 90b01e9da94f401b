"""Waiting-queue ranking through the scheduler: what a dirty `plan_iteration()` costs.

Workload (as in bench_rank.py): W waiting prompts of 512 tokens, half of them starting with one
of 16 shared 256-token prefixes, all other tokens random; equal priority; grouping on (the
default CACHE_AWARE policy). 64 sequences are decoding and fill the active set, so every plan
re-ranks the whole queue when it is dirty and admits nothing.

Rows:
  * full re-rank: the first plan after W submits (a fresh scheduler per sample);
  * submit one: one more `submit()` into the queue of W;
  * plan after one arrival: the plan right after that submit (a dirty queue of W + 1).

Store rows (native only; `--no-store` skips them): the plan after one arrival again, on
schedulers that differ only in where cache affinity comes from, one sample of each in turn
(the order rotating every round) so that every ratio is measured in one run:
  * no store: the row above (no sequence carries affinity);
  * affinity given at submit: no store, the caller hands each shared-prefix prompt its
    256-token restore (the affinity the store rows find), so the queue ranks on the same
    scores without any refresh;
  * store, unchanged: a prefix store holding the 16 shared prefixes is attached and nothing
    changed since the previous plan (the refresh is a no-op);
  * store, one insert + one eviction: the store has room for 15 of the 16 prefixes; before
    each plan the missing one is inserted, which evicts the least recently used one, so the
    refresh re-reads the prompts under those two prefixes (about W/32 each);
  * store, ... under a prefix W/2 share: as the previous row, but the 16 shared prefixes begin
    with one common token (as prompts that open with the same BOS or system token do), so each
    change touches a prefix that all W/2 shared-prefix prompts lie under and the refresh
    re-reads all of them; `no store, common first token` is its baseline on that workload.
Each store row reports its median, its ratio to the no-store plan after one arrival, and the
stale refreshes (re-reads that changed a sequence's restore) per plan.

Run: python bench/rank_scheduler.py [--quick] [--no-twin] [--no-store] [--sizes 1000,10000]
                                    [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from skippy_scheduler import Scheduler, SchedulerConfig, Sequence, TwinScheduler
from skippy_scheduler.bench import BenchHost
from skippy_scheduler.engine import Engine
from skippy_scheduler.prefix_store import PrefixStore, VirtualBackend, store_affinity

IMPLS = {"native": Scheduler, "twin": TwinScheduler}
ACTIVE = 64
PROMPT = 512
SHARED = 256
GROUPS = 16
LONG = 1 << 30


def workload(count: int, seed: int = 7,
             common_first: bool = False) -> tuple[list[list[int]], list[list[int]]]:
    """(the GROUPS shared prefixes, `count` prompts); even-numbered prompts start with a shared
    prefix. `common_first`: every shared prefix begins with the same token."""
    rng = np.random.default_rng(seed)
    heads = rng.integers(0, 32000, (GROUPS, SHARED))
    body = rng.integers(0, 32000, (count, PROMPT))
    body[0::2, :SHARED] = heads[rng.integers(0, GROUPS, (count + 1) // 2)]
    if common_first:
        heads[:, 0] = heads[0, 0]
        body[0::2, 0] = heads[0, 0]
    return heads.tolist(), body.tolist()


def prompts(count: int, seed: int = 7) -> list[list[int]]:
    return workload(count, seed)[1]


def waiting(name: str, pool: list[list[int]], index: int, give_affinity: bool) -> Sequence:
    """Prompt `index` of `pool`; with `give_affinity`, a shared-prefix prompt carries the restore
    a store holding its prefix would find (prefill cost 1 per token, restores free)."""
    seq = Sequence(name, pool[index], LONG)
    if give_affinity and index % 2 == 0:
        restore, affinity = store_affinity(SHARED, 1, 0, 0)
        seq = seq.with_prefix_restore(restore).with_cache_affinity(affinity)
    return seq


def build(cls, w: int, extra: int, pool: list[list[int]], store: PrefixStore | None = None,
          give_affinity: bool = False, prefill_active: bool = False) -> Engine:
    """W waiting behind ACTIVE decoding sequences. The decoding ones arrive with their prompt
    prefilled, or with `prefill_active` (always with a store, which decides restores, so that
    nothing may arrive part-prefilled) are prefilled by real plans first."""
    s = cls(SchedulerConfig(max_active_sequences=ACTIVE, sequence_id_limit=ACTIVE + 16,
                            max_waiting_sequences=w + extra + 16, max_tokens_per_iteration=2048,
                            group_waiting_prefixes=True))
    if store is not None:
        s.attach_prefix_store(store)  # only while the scheduler holds nothing
    engine = Engine(s, BenchHost(), clock=None, record=False)
    engine.profile = True  # the engine times plan_iteration (last_plan_ns)
    busy = [(i * 7919) % 32000 for i in range(PROMPT)]
    if store is None and not prefill_active:
        for i in range(ACTIVE):
            engine.submit(Sequence(f"d{i}", busy, LONG).with_prefilled_generation([1]))
        engine.step()  # fills the active set while the queue is still empty
    else:
        for i in range(ACTIVE):
            engine.submit(Sequence(f"d{i}", busy, LONG))
        while engine.step() and engine.last_telemetry.decode_tokens < ACTIVE:
            pass
    for i in range(w):
        engine.submit(waiting(f"w{i}", pool, i, give_affinity))
    return engine


def step(engine: Engine) -> int:
    """One engine step; the time its plan_iteration took (ns)."""
    engine.step()
    assert engine.last_telemetry.admitted == 0
    return engine.last_plan_ns


def run_one(impl: str, w: int, full_reps: int, arrivals: int) -> dict[str, float]:
    cls = IMPLS[impl]
    pool = prompts(w + arrivals)
    full = []
    for _ in range(full_reps):
        s = build(cls, w, arrivals, pool)
        full.append(step(s))
    seqs = [Sequence(f"a{i}", pool[w + i], LONG) for i in range(arrivals)]
    sub, plan = [], []
    for q in seqs:
        t0 = time.perf_counter_ns()
        s.submit(q)  # through the engine: the submit a serving loop makes
        sub.append(time.perf_counter_ns() - t0)
        plan.append(step(s))
    return {"full re-rank (first plan after W submits)": statistics.median(full) / 1e3,
            "submit one": statistics.median(sub) / 1e3,
            "plan after one arrival": statistics.median(plan) / 1e3}


class Churn:
    """A store with room for all shared prefixes but one. `change()` inserts the missing one,
    which evicts the least recently used: one insert and one eviction of a shared prefix."""

    def __init__(self, heads: list[list[int]]) -> None:
        self.gone: list = []
        self.store = PrefixStore(capacity_tokens=(GROUPS - 1) * SHARED,
                                 backend=VirtualBackend(on_evict=self.gone.append))
        self.heads = [np.asarray(h, dtype=np.int32) for h in heads]
        self.index = {h.tobytes(): i for i, h in enumerate(self.heads)}
        for h in self.heads[:-1]:
            self.store.insert(h)
        self.missing = GROUPS - 1

    def change(self) -> None:
        self.gone.clear()
        if self.store.insert(self.heads[self.missing]) is None or len(self.gone) != 1:
            raise RuntimeError("the store did not make exactly one eviction for the insert")
        self.missing = self.index[self.gone[0].key.tobytes()]


STORE_BASE = "no store (plan after one arrival)"


def run_store(w: int, arrivals: int) -> dict[str, dict[str, float]]:
    """The store rows (module docs): one plan after one arrival on each scheduler per round."""
    heads, pool = workload(w + arrivals)
    common_heads, common_pool = workload(w + arrivals, common_first=True)
    static = PrefixStore()
    for h in heads:
        static.insert(h)
    churn, wide = Churn(heads), Churn(common_heads)

    def make(rows_pool: list[list[int]], **kw) -> Engine:
        # every scheduler of the comparison reaches its active set the same way
        return build(Scheduler, w, arrivals, rows_pool, prefill_active=True, **kw)

    # (label, engine, pool, affinity given at submit, store change before the plan)
    rows = [
        (STORE_BASE, make(pool), pool, False, None),
        ("affinity given at submit, no store", make(pool, give_affinity=True), pool, True, None),
        ("store, unchanged (no-op refresh)", make(pool, store=static), pool, False, None),
        ("store, one insert + one eviction", make(pool, store=churn.store), pool, False,
         churn.change),
        ("no store, common first token", make(common_pool), common_pool, False, None),
        ("store, same under a prefix W/2 share", make(common_pool, store=wide.store),
         common_pool, False, wide.change),
    ]
    plan: list[list[int]] = [[] for _ in rows]
    sub: list[list[int]] = [[] for _ in rows]
    stale: list[list[int]] = [[] for _ in rows]
    for i in range(arrivals):
        for k in range(len(rows)):
            j = (i + k) % len(rows)  # rotate which scheduler goes first
            _, engine, rows_pool, give, change = rows[j]
            seq = waiting(f"a{i}", rows_pool, w + i, give)
            t0 = time.perf_counter_ns()
            engine.submit(seq)
            sub[j].append(time.perf_counter_ns() - t0)
            if change is not None:
                change()
            before = engine.scheduler.metrics().stale_refreshes
            plan[j].append(step(engine))
            stale[j].append(engine.scheduler.metrics().stale_refreshes - before)
    base = statistics.median(plan[0])
    return {label: {"plan_us": statistics.median(plan[j]) / 1e3,
                    "ratio": statistics.median(plan[j]) / base,
                    "stale_per_plan": statistics.mean(stale[j]),
                    "submit_us": statistics.median(sub[j]) / 1e3}
            for j, (label, *_rest) in enumerate(rows)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-twin", action="store_true")
    ap.add_argument("--no-store", action="store_true", help="skip the prefix-store rows")
    ap.add_argument("--sizes", default="1000,10000")
    ap.add_argument("--json", help="also write the medians (µs) to this file")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    impls = ["native"] + ([] if args.no_twin else ["twin"])
    out: dict[str, dict[str, float]] = {}
    for w in sizes:
        for impl in impls:
            print(f"W={w} {impl} ...", file=sys.stderr, flush=True)
            big = w >= 5000
            if impl == "native":
                reps, arr = (3, 15) if args.quick else ((7, 60) if big else (15, 200))
            else:
                reps, arr = (1, 3) if args.quick else ((2, 5) if big else (3, 10))
            out[f"{impl} {w}"] = run_one(impl, w, reps, arr)
    head = f"{'operation':<44} {'W':>6} {'native µs':>11} {'twin µs':>11} {'twin/native':>11}"
    print(head)
    print("-" * len(head))
    for w in sizes:
        nat = out[f"native {w}"]
        twin = out.get(f"twin {w}")
        for op, v in nat.items():
            t = twin[op] if twin else float("nan")
            ratio = f"{t / v:.1f}x" if twin else ""
            print(f"{op:<44} {w:>6} {v:>11.1f} {t:>11.1f} {ratio:>11}")
    stores: dict[str, dict[str, dict[str, float]]] = {}
    if not args.no_store:
        for w in sizes:
            print(f"W={w} store rows ...", file=sys.stderr, flush=True)
            stores[f"store {w}"] = run_store(w, 15 if args.quick else 200)
        head = (f"{'plan after one arrival, native':<44} {'W':>6} {'plan µs':>9} "
                f"{'/no store':>9} {'stale/plan':>10} {'submit µs':>9}")
        print()
        print(head)
        print("-" * len(head))
        for w in sizes:
            for op, r in stores[f"store {w}"].items():
                print(f"{op:<44} {w:>6} {r['plan_us']:>9.1f} {r['ratio']:>8.2f}x "
                      f"{r['stale_per_plan']:>10.1f} {r['submit_us']:>9.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**out, **stores}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
