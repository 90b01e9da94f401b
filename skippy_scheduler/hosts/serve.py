"""A serving loop that drives a scheduler and a runtime host, and measures what clients see.

Each step: submit the requests that have arrived, let a hook cancel or preempt, make a plan, run
it on the host, report the iteration's duration, complete it, and free the host's resources of
every sequence that ended. The loop works with any host that has `execute(plan)`,
`release(sequence_id)`, `last_sample_rows` and `last_tokens` (the raw sampled tokens, so that an
end-of-generation token the host reported as -1 still reaches the client).

Time is either the wall clock (`clock="wall"`, idle gaps are slept through) or virtual
(`clock="virtual"`: each iteration advances time by `cost_model.plan_duration_us(plan)` when a cost
model is given, else by the measured execution time; idle gaps jump to the next arrival). The
per-request figures follow the lab's definitions (behaviour.md §5.4): queue wait = first time
in a plan − arrival, TTFT = end of the iteration that sampled the first token − arrival, and
inter-token gaps between consecutive tokens.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence as _Seq

from skippy_scheduler.types import AdmissionError, IterationPhase, Sequence


@dataclass
class ServeRequest:
    id: str
    prompt_tokens: list[int]
    max_tokens: int
    arrival_s: float = 0.0
    priority: int = 0


@dataclass
class RequestResult:
    index: int
    id: str
    prompt_tokens: list[int]
    arrival_s: float
    generated_tokens: list[int] = field(default_factory=list)
    first_scheduled_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    finished_s: float | None = None
    finish: str | None = None  # "length" | "eog" | "failed" | "cancelled" | "rejected"
    preemptions: int = 0

    @property
    def queue_wait_us(self) -> float | None:
        if self.first_scheduled_s is None:
            return None
        return (self.first_scheduled_s - self.arrival_s) * 1e6

    @property
    def ttft_us(self) -> float | None:
        if not self.token_times_s:
            return None
        return (self.token_times_s[0] - self.arrival_s) * 1e6

    @property
    def itl_us(self) -> list[float]:
        t = self.token_times_s
        return [(b - a) * 1e6 for a, b in zip(t, t[1:])]

    def to_json(self) -> dict:
        return {
            "index": self.index,
            "id": self.id,
            "prompt_tokens": list(self.prompt_tokens),
            "generated_tokens": list(self.generated_tokens),
            "queue_wait_us": self.queue_wait_us,
            "ttft_us": self.ttft_us,
            "itl_us": self.itl_us,
            "finish": self.finish,
            "preemptions": self.preemptions,
        }


def percentile(values: _Seq[float], p: float) -> float:
    """Nearest-rank percentile as the lab computes it (0 for an empty list)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    idx = min(max(math.ceil(len(ordered) * p / 100.0) - 1, 0), len(ordered) - 1)
    return float(ordered[idx])


@dataclass
class ServeReport:
    results: list[RequestResult]
    iterations: int = 0
    prefill_iterations: int = 0
    decode_iterations: int = 0
    mixed_iterations: int = 0
    batch_rows: int = 0
    tokens_executed: int = 0
    makespan_s: float = 0.0
    execute_s: float = 0.0  # wall time spent inside host.execute

    def summary(self) -> dict:
        ttft = [r.ttft_us for r in self.results if r.ttft_us is not None]
        queue = [r.queue_wait_us for r in self.results if r.queue_wait_us is not None]
        itl = [g for r in self.results for g in r.itl_us]
        generated = sum(len(r.generated_tokens) for r in self.results)
        done = sum(r.finish in ("length", "eog") for r in self.results)
        span = self.makespan_s
        return {
            "requests": len(self.results),
            "completed": done,
            "generated_tokens": generated,
            "makespan_s": span,
            "requests_per_s": done / span if span > 0 else 0.0,
            "tokens_per_s": generated / span if span > 0 else 0.0,
            "p50_queue_wait_us": percentile(queue, 50),
            "p95_queue_wait_us": percentile(queue, 95),
            "p50_ttft_us": percentile(ttft, 50),
            "p95_ttft_us": percentile(ttft, 95),
            "p50_itl_us": percentile(itl, 50),
            "p95_itl_us": percentile(itl, 95),
            "iterations": self.iterations,
            "prefill_iterations": self.prefill_iterations,
            "decode_iterations": self.decode_iterations,
            "mixed_iterations": self.mixed_iterations,
            "mean_batch_size": self.batch_rows / self.iterations if self.iterations else 0.0,
            "tokens_executed": self.tokens_executed,
            "execute_s": self.execute_s,
        }


class ServeLoop:
    """State of one serving run; hooks receive it to cancel or preempt between iterations."""

    def __init__(
        self,
        scheduler,
        host,
        requests: _Seq[ServeRequest],
        *,
        make_sequence: Callable[[ServeRequest], object],
        clock: str = "wall",
        cost_model=None,
        before_iteration: Callable[["ServeLoop"], None] | None = None,
        max_iterations: int | None = None,
    ) -> None:
        if clock not in ("wall", "virtual"):
            raise ValueError(f"clock must be 'wall' or 'virtual', got {clock!r}")
        ids = [r.id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids must be unique")
        self.scheduler = scheduler
        self.host = host
        self.requests = list(requests)
        self.make_sequence = make_sequence
        self.clock = clock
        self.cost_model = cost_model
        self.before_iteration = before_iteration
        self.max_iterations = max_iterations
        self.results = {
            r.id: RequestResult(i, r.id, list(r.prompt_tokens), float(r.arrival_s))
            for i, r in enumerate(self.requests)
        }
        self.report = ServeReport([self.results[r.id] for r in self.requests])
        self._pending = sorted(self.requests, key=lambda r: (r.arrival_s, r.id), reverse=True)
        self._open = set(ids)  # not yet ended
        self._submitted: set[str] = set()
        self._t0 = 0.0
        self._vnow = 0.0
        self.iteration = 0

    # ------------------------------------------------------------------ time
    def now(self) -> float:
        if self.clock == "virtual":
            return self._vnow
        return time.perf_counter() - self._t0

    def _wait_until(self, t: float) -> None:
        if self.clock == "virtual":
            self._vnow = max(self._vnow, t)
        else:
            delay = t - self.now()
            if delay > 0:
                time.sleep(delay)

    # ------------------------------------------------------------------ hook verbs
    def cancel(self, request_id: str) -> bool:
        """Cancel a request (arrived or not); frees its host slot. False if it already ended."""
        if request_id not in self._open:
            return False
        if request_id in self._submitted:
            if not self.scheduler.cancel(request_id):
                return False
            self.host.release(request_id)
        else:
            self._pending = [r for r in self._pending if r.id != request_id]
        self._end(request_id, "cancelled")
        return True

    def preempt(self, used_bytes: _Seq[int]) -> list[str]:
        """Report measured component usage; preempted sequences lose their KV on the host."""
        ids = list(self.scheduler.preempt_for_component_pressure(list(used_bytes)))
        for seq_id in ids:
            self.host.release(seq_id)
            self.results[seq_id].preemptions += 1
        return ids

    def running(self, request_id: str) -> bool:
        return request_id in self._submitted and request_id in self._open

    # ------------------------------------------------------------------ loop
    def _end(self, request_id: str, finish: str) -> None:
        res = self.results[request_id]
        res.finish = finish
        res.finished_s = self.now()
        self._open.discard(request_id)

    def _submit_arrivals(self) -> None:
        while self._pending and self._pending[-1].arrival_s <= self.now():
            req = self._pending.pop()
            try:
                self.scheduler.submit(self.make_sequence(req))
            except AdmissionError:  # queue full: the client sees a rejection
                self._end(req.id, "rejected")
                continue
            self._submitted.add(req.id)

    def _has_work(self) -> bool:
        return any(i in self._submitted for i in self._open)

    def run(self) -> ServeReport:
        self._t0 = time.perf_counter()
        self._vnow = 0.0
        report = self.report
        while self._open:
            self._submit_arrivals()
            if self.before_iteration is not None:
                self.before_iteration(self)
                if not self._open:
                    break
            if not self._has_work():
                if not self._pending:
                    break
                self._wait_until(self._pending[-1].arrival_s)
                continue
            if self.max_iterations is not None and self.iteration >= self.max_iterations:
                raise RuntimeError(f"no completion after {self.iteration} iterations")
            self._step(report)
        report.makespan_s = self.now()
        return report

    def _step(self, report: ServeReport) -> None:
        plan = self.scheduler.plan_iteration()
        work = plan.work
        if not work:
            raise RuntimeError("scheduler stalled: empty plan with sequences in flight")
        start = self.now()
        kinds = set()
        for w in work:
            res = self.results[w.sequence_id]
            if res.first_scheduled_s is None:
                res.first_scheduled_s = start
            kinds.add("decode" if w.phase is IterationPhase.Decode else "prefill")
        t = time.perf_counter()
        self.host.execute(plan)
        elapsed = time.perf_counter() - t
        report.execute_s += elapsed
        if self.clock == "virtual":
            if self.cost_model is not None:
                elapsed = self.cost_model.plan_duration_us(plan) / 1e6
            self._vnow += elapsed
        done = self.now()
        for row, token in zip(self.host.last_sample_rows.tolist(), self.host.last_tokens.tolist()):
            res = self.results[work[row].sequence_id]
            res.generated_tokens.append(int(token))
            res.token_times_s.append(done)
        self.scheduler.observe_iteration_duration(plan, elapsed)
        telemetry = self.scheduler.complete_iteration(plan)
        for seq_id in telemetry.finished_ids:
            self.host.release(seq_id)
            last = self.results[seq_id].generated_tokens[-1:]
            eog = bool(last) and self.host.is_eog(last[0])
            self._end(seq_id, "eog" if eog else "length")
        for seq_id in telemetry.failed_ids:
            self.host.release(seq_id)
            self._end(seq_id, "failed")
        self.iteration += 1
        report.iterations += 1
        report.batch_rows += len(work)
        report.tokens_executed += int(plan.token_count)
        if kinds == {"decode"}:
            report.decode_iterations += 1
        elif kinds == {"prefill"}:
            report.prefill_iterations += 1
        else:
            report.mixed_iterations += 1


def serve(scheduler, host, requests: _Seq[ServeRequest], **kwargs) -> ServeReport:
    """Run `requests` through `scheduler` and `host` until every one has ended (see module doc)."""
    if "make_sequence" not in kwargs:
        kwargs["make_sequence"] = default_sequence
    return ServeLoop(scheduler, host, requests, **kwargs).run()


def default_sequence(req: ServeRequest) -> Sequence:
    return Sequence(req.id, list(req.prompt_tokens), req.max_tokens, None, req.priority)
