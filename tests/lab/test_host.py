"""The lab host (one runtime for the suite and the replay): at the end of a run every request's
record, KV cell and prefix pin is given back, under memory pressure (preemptions) as without."""
from __future__ import annotations

import pytest

from lab_support import conversation_rows, mooncake_file
from skippy_scheduler.cost_model import LAB_COST
from skippy_scheduler.lab.backend import resolve_backend
from skippy_scheduler.lab.driver import drive
from skippy_scheduler.lab.host import LabHost
from skippy_scheduler.lab.options import SuiteOptions
from skippy_scheduler.lab.prefix import FamilyPrefixCache
from skippy_scheduler.lab.replay import ReplayOptions, run_replay
from skippy_scheduler.lab.suite import SuiteRequest, make_admission
from skippy_scheduler.lab.traces import BLOCK_TOKENS, open_trace
from skippy_scheduler.lab.workload import WorkloadSpec, generate


@pytest.mark.parametrize("capacity", [0, 6_000])
def test_a_suite_run_gives_back_every_cell_and_record(backend, capacity):
    w = generate(WorkloadSpec(requests=200, seed=3, rate=600.0, families=6))
    options = SuiteOptions(max_active=16, max_tokens=1_024, chunk=256,
                           kv_capacity_tokens=capacity)
    cost = LAB_COST
    sched = resolve_backend(backend).make(options.config("mixed"),
                                          admission=make_admission("cache-aware-aging"))
    cache = FamilyPrefixCache(w, 2)
    host = LabHost(sched, prefix=cache, memory=capacity > 0, reserve=options.reserve)
    arrivals = w.arrival_us.tolist()
    report, _ = drive(sched, host, (SuiteRequest(w, r, arrivals[r]) for r in range(w.n)), cost,
                      label="test")
    per = report.arrays()
    assert host.live == {} and host.usage == 0
    assert len(host.admit_time) == w.n  # one first admission per request
    assert host.memory_used() == ([0] if capacity else None)
    assert cache.hits == int(cache.has_restore.sum()) > 0
    if capacity:
        assert int(per["preemptions"].sum()) > 0  # resumes went through the host again
    # A request restored at its first admission exactly the family prefix it was given.
    assert sum(host.restored) == host.hit_tokens > 0


def test_a_replay_gives_back_every_pin_cell_and_record(tmp_path, backend):
    trace = open_trace(mooncake_file(tmp_path, conversation_rows(80, seed=6)), time_scale=0.2)
    hosts = []
    run = run_replay(trace, "cache-aware-aging", options=ReplayOptions(
        max_active=4, kv_capacity_tokens=20 * BLOCK_TOKENS, prefix_cache_tokens=10 * BLOCK_TOKENS),
        backend=backend, progress=False, host_hook=hosts.append)
    host = hosts[0]
    assert run.figures["completed"] == 80 and run.figures["preemptions"] > 0
    assert host.live == {} and host.usage == 0
    assert all(entry.pins == 0 for entry in host.prefix.store.resident())
    assert len(host.admit_restore) == 80 and sum(host.admit_restore) == host.hit_tokens
