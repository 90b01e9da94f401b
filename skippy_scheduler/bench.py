"""Per-step scheduler overhead: the workloads of BENCHMARKS.md and the `skippy-scheduler bench` report.

Every workload builds a scheduler (native `Scheduler` or the pure-Python `TwinScheduler`, same
API) on an `Engine` with no clock and no recorder, brings it to a steady state, and returns a
`step()` closure (the engine's step); `measure()` times many calls of it with
`perf_counter_ns` and keeps every sample, so the report gives medians and 99th percentiles. A
step includes the fake host's work: it writes one sampled token per sampling row into
`plan.outputs`, as a batched runtime does.

The C workload compiles `c_overhead.c` (shipped in this package's `bench_src` folder, also at
`bench/c_overhead.c` in the source tree) against the installed headers and static library and
runs the same decode loop with no Python at all.

Times on shared machines are noisy: compare ratios measured in one run, and use the callgrind
instruction counts of BENCHMARKS.md for anything finer.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeAlias

import numpy as np

from . import get_include, get_library_dir
from ._core import IterationPlan, Scheduler
from .cost_model import RuntimeCostModel
from .engine import CostModelHost, Engine, VirtualClock
from .reference import TwinPlan, TwinScheduler
from .types import SchedulerConfig, Sequence

# The two implementations a workload can run on (same API).
SchedulerClass: TypeAlias = "type[Scheduler] | type[TwinScheduler]"

IMPLEMENTATIONS: dict[str, SchedulerClass] = {"native": Scheduler, "twin": TwinScheduler}
LONG_OUTPUT = 1 << 30  # max_tokens of the steady sequences: they never finish while measured
_TOKEN = 7


@dataclass
class Result:
    """Samples of one workload on one implementation (nanoseconds per step)."""

    workload: str
    impl: str
    size: int            # N active sequences, or W waiting requests for the ranking rows
    unit: str            # what `per` divides by: "row" or "waiting"
    per: int             # rows per step (or waiting requests per ranking)
    median_ns: float
    p99_ns: float
    steps: int
    note: str = ""

    @property
    def median_us(self) -> float:
        return self.median_ns / 1e3

    @property
    def p99_us(self) -> float:
        return self.p99_ns / 1e3

    @property
    def per_unit_ns(self) -> float:
        return self.median_ns / self.per if self.per else float("nan")


def _summary(samples: list[int]) -> tuple[float, float]:
    a = np.sort(np.asarray(samples, dtype=np.int64))
    return float(np.median(a)), float(a[min(len(a) - 1, (len(a) * 99) // 100)])


def measure(step: Callable[[], object], steps: int, warmup: int = 20, budget_s: float = 5.0) -> list[int]:
    """Per-call wall times (ns) of `step`; stops early once `budget_s` is spent (at least 5 calls)."""
    for _ in range(warmup):
        step()
    out: list[int] = []
    clock = time.perf_counter_ns
    deadline = clock() + int(budget_s * 1e9)
    for i in range(steps):
        t0 = clock()
        step()
        t1 = clock()
        out.append(t1 - t0)
        if t1 > deadline and i >= 4:
            break
    return out


# -- the fake host ---------------------------------------------------------------------------


class BenchHost(CostModelHost):
    """What a batched runtime does after running a plan: one sampled token per sampling row;
    with `end_last` set, the last sampling row's sequence ends (a negative token)."""

    def __init__(self, token: int = _TOKEN) -> None:
        super().__init__(token=token)
        self.end_last = False

    def execute(self, plan: Any) -> None:
        super().execute(plan)
        if self.end_last:
            out = plan.outputs
            if out.count:
                out.predicted_tokens[out.count - 1] = -1


def write_outputs(plan: IterationPlan | TwinPlan, token: int = _TOKEN) -> int:
    """One sampled token per sampling row of `plan` (the bench host's work, for callers that
    hold a plan of their own); returns the number written."""
    BenchHost(token).execute(plan)
    return plan.outputs.count


def _config(**kw: Any) -> SchedulerConfig:
    return SchedulerConfig(**kw)


def _engine(scheduler: Scheduler | TwinScheduler) -> Engine:
    # No clock, no recorder: a step is plan + host + complete and nothing else.
    return Engine(scheduler, BenchHost(), clock=None, record=False)


def _decoding(cls: SchedulerClass, n: int, prompt: int, *, extra_active: int = 0, waiting: int = 0,
              **cfg: Any) -> Engine:
    """An engine whose `n` sequences decode from the first plan (prompts already prefilled)."""
    active = n + extra_active
    s = cls(_config(max_active_sequences=active, sequence_id_limit=active + 16,
                    max_waiting_sequences=max(256, n + waiting + 16),
                    max_tokens_per_iteration=max(2048, active + 256), **cfg))
    engine = _engine(s)
    tokens = [(i * 7919) % 32000 for i in range(prompt)]
    for i in range(n):
        engine.submit(Sequence(f"d{i}", tokens, LONG_OUTPUT).with_prefilled_generation([1]))
    return engine


def _calibrated_step(engine: Engine) -> None:
    """One step that reports a 10 ms duration, so mixed planning knows this decode width."""
    engine.clock, engine.observe = VirtualClock(RuntimeCostModel(10_000, 0, 0, 0)), True
    engine.step()
    engine.clock, engine.observe = None, False


def steady_decode(cls: SchedulerClass, n: int, prompt: int = 512) -> Callable[[], object]:
    """N live decodes; one step = the engine's plan + host outputs + complete."""
    engine = _decoding(cls, n, prompt)

    def step() -> object:
        engine.step()
        return engine.last_telemetry

    step()
    return step


def steady_decode_inflight(cls: SchedulerClass, n: int, depth: int = 2,
                           prompt: int = 512) -> Callable[[], object]:
    """N live decodes with `depth` plans in flight; one step = one plan made (its deferred
    inputs filled from the previous plan's outputs, §2.11), the host's outputs for it, and the
    oldest plan completed: the same work per token as `steady_decode` at depth 1."""
    engine = _decoding(cls, n, prompt, max_inflight_plans=depth)

    def step() -> object:
        done = engine.iterations
        while engine.iterations == done:
            engine.step()
        return engine.last_telemetry

    for _ in range(depth + 2):
        step()
    return step


def mixed_decode_prefill(cls: SchedulerClass, n: int, prompt: int = 512, chunk: int = 256,
                         steps: int = 3000) -> Callable[[], object]:
    """N decode rows plus one `chunk`-token prefill chunk per step (mixed planning, §2.5)."""
    engine = _decoding(cls, n, prompt, extra_active=1, mixed_prefill_decode=True,
                       prefill_chunk_tokens=chunk)
    _calibrated_step(engine)  # decode-only: calibrates the EWMA for exactly n decode rows
    # One long prompt that stays in prefill for `steps` steps, one chunk per step.
    engine.submit(Sequence("long-prefill", [i % 32000 for i in range(chunk * (steps + 64))], 1))

    def step() -> object:
        engine.step()
        return engine.last_telemetry

    step()
    return step


def admission_churn(cls: SchedulerClass, n: int,
                    prompt: int = 512) -> tuple[Callable[[], object], Callable[[], object]]:
    """N active with mixed planning; returns (arrival_step, finish_step), to be called in turn.

    `finish_step`: plan + host + complete, where the host ends the last row's sequence (a
    negative token). `arrival_step`: submit a new `prompt`-token request, then plan (ranks the
    dirty queue, admits it, N-1 decode rows plus its whole prompt as one chunk) + host + complete.
    Both decode-row counts are calibrated first, so every plan is a mixed plan (§2.5).
    """
    engine = _decoding(cls, n - 1, prompt, extra_active=1, mixed_prefill_decode=True,
                       prefill_chunk_tokens=prompt)
    host = engine.host
    tokens = [(i * 104729) % 32000 for i in range(prompt)]
    arrival = Sequence("a0", tokens, LONG_OUTPUT)  # submit copies it: one object, new id each time
    for k in range(2):  # decode-only plans of n-1, then n rows set the EWMA entries
        if k:
            engine.submit(Sequence("d-extra", tokens, LONG_OUTPUT).with_prefilled_generation([1]))
        _calibrated_step(engine)
    counter = [0]

    def finish_step() -> object:
        host.end_last = True
        engine.step()
        host.end_last = False
        return engine.last_telemetry

    def arrival_step() -> object:
        counter[0] += 1
        arrival.id = f"a{counter[0]}"
        engine.submit(arrival)
        engine.step()
        return engine.last_telemetry

    for _ in range(3):
        finish_step()
        arrival_step()
    return arrival_step, finish_step


def measure_pairs(first: Callable[[], object], second: Callable[[], object], steps: int,
                  budget_s: float) -> tuple[list[int], list[int]]:
    """Alternates two step kinds, timing each into its own list."""
    a: list[int] = []
    b: list[int] = []
    clock = time.perf_counter_ns
    deadline = clock() + int(budget_s * 1e9)
    for i in range(steps):
        t0 = clock()
        second()
        t1 = clock()
        first()
        t2 = clock()
        b.append(t1 - t0)
        a.append(t2 - t1)
        if t2 > deadline and i >= 4:
            break
    return a, b


def ranking(cls: SchedulerClass, w: int, n_active: int = 64, prompt: int = 512, prefix: int = 256,
            groups: int = 16) -> tuple[Engine, Callable[[], None]]:
    """W waiting behind a full active set; returns (engine, make_dirty).

    Half of the prompts start with one of `groups` shared prefixes of `prefix` tokens; all have
    equal priority; grouping is on (the default). `make_dirty` cancels the oldest waiting request
    and submits a new one, so the queue length stays W and the next plan re-ranks it. The
    engine times its scheduler calls (`engine.last_plan_ns`).
    """
    engine = _decoding(cls, n_active, prompt, waiting=w, group_waiting_prefixes=True)
    engine.profile = True
    rng = np.random.default_rng(12345)
    prefixes: list[list[int]] = [rng.integers(0, 32000, prefix).tolist() for _ in range(groups)]
    serial = [0]

    def prompt_for(i: int) -> list[int]:
        tail: list[int] = rng.integers(0, 32000, prompt - prefix if i % 2 == 0 else prompt).tolist()
        return prefixes[(i // 2) % groups] + tail if i % 2 == 0 else tail

    pool = [prompt_for(i) for i in range(64)]
    for i in range(w):
        engine.submit(Sequence(f"w{i}", pool[i % len(pool)], LONG_OUTPUT))
    serial[0] = w
    oldest = [0]

    def make_dirty() -> None:
        engine.cancel(f"w{oldest[0]}")
        oldest[0] += 1
        engine.submit(Sequence(f"w{serial[0]}", pool[serial[0] % len(pool)], LONG_OUTPUT))
        serial[0] += 1

    engine.step()
    return engine, make_dirty


def measure_ranking(cls: SchedulerClass, w: int, reps: int,
                    budget_s: float) -> tuple[list[int], list[int]]:
    """(plan time with a dirty queue, plan time with a clean queue) samples."""
    engine, make_dirty = ranking(cls, w)
    dirty: list[int] = []
    clean: list[int] = []
    clock = time.perf_counter_ns
    deadline = clock() + int(budget_s * 1e9)
    for i in range(reps):
        make_dirty()
        engine.step()
        dirty.append(engine.last_plan_ns)
        engine.step()
        clean.append(engine.last_plan_ns)
        if clock() > deadline and i >= 2:
            break
    return dirty, clean


def first_plan_token_count(cls: SchedulerClass, n: int, prompt: int) -> int:
    """Tokens of a steady decode plan: N when each row copies only its pending token."""
    engine = _decoding(cls, n, prompt)
    counts: list[int] = []
    engine.on_plan = lambda plan, start, duration: counts.append(plan.token_count)
    for _ in range(4):
        engine.step()
    return counts[-1]


# -- the C program ---------------------------------------------------------------------------


def c_source() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    for path in (os.path.join(here, "bench_src", "c_overhead.c"),
                 os.path.join(os.path.dirname(here), "bench", "c_overhead.c")):
        if os.path.exists(path):
            return path
    return None


def build_c(workdir: str) -> tuple[str | None, str]:
    """Compiles c_overhead.c with `cc -O2`; returns (executable or None, message)."""
    src = c_source()
    if src is None:
        return None, "c_overhead.c not found"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None, "no C compiler (cc) found: C API rows skipped"
    exe = os.path.join(workdir, "c_overhead")
    cmd = [cc, "-O2", "-I", get_include(), src, "-L", get_library_dir(),
           "-lskippy_scheduler_core", "-lm", "-o", exe]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        return None, f"compiling c_overhead.c failed: {r.stderr.strip()[:300]}"
    return exe, " ".join(cmd)


def run_c(exe: str, n: int, prompt: int, steps: int, warmup: int = 200) -> tuple[float, float, int]:
    r = subprocess.run([exe, str(n), str(prompt), str(warmup), str(steps)], capture_output=True,
                       text=True, check=True)
    fields = dict(kv.split("=") for kv in r.stdout.split())
    return float(fields["median_ns"]), float(fields["p99_ns"]), int(fields["steps"])


def callgrind_per_step(exe: str, n: int, prompt: int = 512, k: int = 100) -> int | None:
    """Instructions of one decode step: callgrind counts of 2k minus k measured steps, over k.

    Only `bench_steps` (the measured loop) is collected, so set-up and warm-up do not count.
    """
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        return None
    counts = []
    for steps in (k, 2 * k):
        r = subprocess.run([valgrind, "--tool=callgrind", "--callgrind-out-file=/dev/null",
                            "--toggle-collect=bench_steps", exe, str(n), str(prompt), str(n),
                            str(steps), "count"], capture_output=True, text=True)
        found = [line for line in r.stderr.splitlines() if "Collected :" in line]
        if r.returncode != 0 or not found:
            return None
        counts.append(int(found[-1].split(":")[-1].strip().replace(",", "")))
    return (counts[1] - counts[0]) // k


# -- the report ------------------------------------------------------------------------------


def _result(workload: str, impl: str, size: int, unit: str, per: int, samples: list[int],
            note: str = "") -> Result:
    med, p99 = _summary(samples)
    return Result(workload, impl, size, unit, per, med, p99, len(samples), note)


def collect(quick: bool = False, twin: bool = True, c_api: bool = True, callgrind: bool = False,
            log: Callable[[str], object] = print) -> tuple[list[Result], list[str]]:
    sizes = (64, 256, 1024)
    steps = 300 if quick else 3000
    budget = 1.0 if quick else 4.0
    impls = ["native"] + (["twin"] if twin else [])
    results: list[Result] = []
    notes: list[str] = []

    for n in sizes:
        for impl in impls:
            log(f"steady decode N={n} {impl} ...")
            st = steady_decode(IMPLEMENTATIONS[impl], n)
            results.append(_result("decode", impl, n, "row", n,
                                   measure(st, steps if impl == "native" else steps // 10, budget_s=budget)))
    for n in (256, 1024):
        # Depth 1 and depth 2 alternate sample by sample, so load hits both alike: the ratio is
        # measured in one run.
        log(f"steady decode N={n}, depth 1 and 2 ...")
        depth1, depth2 = measure_pairs(steady_decode_inflight(Scheduler, n, 1),
                                       steady_decode_inflight(Scheduler, n, 2), steps, budget)
        ratio = _summary(depth2)[0] / _summary(depth1)[0]
        results.append(_result("decode, depth 1 (paired)", "native", n, "row", n, depth1))
        results.append(_result("decode, depth 2 (paired)", "native", n, "row", n, depth2,
                               note=f"depth 2 / depth 1 = {ratio:.2f}"))

    if c_api:
        with tempfile.TemporaryDirectory() as d:
            exe, msg = build_c(d)
            if exe is None:
                notes.append(msg)
            else:
                notes.append(f"C API rows: {msg}")
                for n in sizes:
                    log(f"C API decode N={n} ...")
                    med, p99, k = run_c(exe, n, 512, steps * 2)
                    results.append(Result("decode (C API)", "C", n, "row", n, med, p99, k))
                med, p99, k = run_c(exe, 256, 8192, steps * 2)
                results.append(Result("decode (C API), 8192-token prompts", "C", 256, "row", 256, med, p99, k))
                if callgrind:
                    for n, prompt in ((64, 512), (256, 512), (1024, 512), (256, 8192)):
                        log(f"callgrind N={n} prompt={prompt} ...")
                        ins = callgrind_per_step(exe, n, prompt)
                        notes.append("callgrind: valgrind not available" if ins is None else
                                     f"callgrind, one C API decode step at N={n}, {prompt}-token "
                                     f"prompts: {ins} instructions ({ins / n:.1f} per row)")

    for impl in impls:
        log(f"context length 8192 {impl} ...")
        st = steady_decode(IMPLEMENTATIONS[impl], 256, prompt=8192)
        results.append(_result("decode, 8192-token prompts", impl, 256, "row", 256,
                               measure(st, steps if impl == "native" else steps // 10, budget_s=budget)))

    for n in (64, 256):
        for impl in impls:
            log(f"mixed N={n} {impl} ...")
            k = steps if impl == "native" else steps // 10
            st = mixed_decode_prefill(IMPLEMENTATIONS[impl], n, steps=k + 40)
            results.append(_result("mixed: decode + 256-token chunk", impl, n, "row", n + 1,
                                   measure(st, k, budget_s=budget)))
            log(f"admission churn N={n} {impl} ...")
            arrive, finish = admission_churn(IMPLEMENTATIONS[impl], n)
            a, b = measure_pairs(arrive, finish, steps // 2 if impl == "native" else steps // 20, budget)
            results.append(_result("arrival: submit+admit+prefill", impl, n, "row", n, a))
            results.append(_result("decode step with one finish", impl, n, "row", n, b))

    for w in (1000, 10000):
        for impl in impls:
            log(f"ranking W={w} {impl} ...")
            reps = (60 if w == 1000 else 20) if impl == "native" else (10 if w == 1000 else 3)
            if quick:
                reps = max(3, reps // 4)
            dirty, clean = measure_ranking(IMPLEMENTATIONS[impl], w, reps, budget_s=budget * 3)
            results.append(_result("admission ranking (dirty queue)", impl, w, "waiting", w, dirty,
                                   note="64 active, plan after cancel+submit"))
            results.append(_result("same plan, clean queue", impl, w, "waiting", w, clean))
    return results, notes


def format_table(results: list[Result]) -> str:
    native = {(r.workload, r.size): r for r in results if r.impl == "native"}
    head = (f"{'workload':<38} {'impl':<6} {'N/W':>6} {'median µs':>10} {'p99 µs':>10} "
            f"{'per row/req':>12} {'twin/native':>11}")
    lines = [head, "-" * len(head)]
    for r in results:
        ratio = ""
        if r.impl == "twin" and (r.workload, r.size) in native:
            ratio = f"{r.median_ns / native[(r.workload, r.size)].median_ns:.1f}x"
        per = f"{r.per_unit_ns:.1f} ns" if r.per_unit_ns < 10_000 else f"{r.per_unit_ns / 1e3:.1f} µs"
        lines.append(f"{r.workload:<38} {r.impl:<6} {r.size:>6} {r.median_us:>10.2f} "
                     f"{r.p99_us:>10.2f} {per:>12} {ratio:>11}")
    return "\n".join(lines)


def context_line(results: list[Result]) -> str:
    parts = []
    for impl in ("native", "C", "twin"):
        short = [r for r in results if r.impl == impl and r.size == 256 and r.workload.startswith("decode")]
        a = [r for r in short if "8192" not in r.workload]
        b = [r for r in short if "8192" in r.workload]
        if a and b:
            parts.append(f"{impl}: {a[0].median_us:.2f} µs at 512 vs {b[0].median_us:.2f} µs at 8192 "
                         f"({b[0].median_ns / a[0].median_ns:.2f}x)")
    return "context length, N=256 decode step: " + "; ".join(parts)


def machine() -> str:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model or 'unknown CPU'}, {os.cpu_count()} logical CPUs, Python {sys.version.split()[0]}"
