"""What a run looked like: the engine's one recorder and the report built from it.

Per request: arrival, first time in a plan, every sampled token with its time, how it ended
and when, preemptions. Per iteration: start, duration, rows, decode rows, tokens, admissions,
queue depth. Definitions (docs/behaviour.md §5.4): queue wait = first time in a plan −
arrival; TTFT = end of the iteration that sampled the first token − arrival; inter-token gaps
between consecutive tokens of a request; latency = end − arrival. Percentiles are nearest-rank
(`percentile`), the one definition every report in the package uses.

The token log is kept as flat int32 arrays with one time per iteration, so a run of a hundred
thousand requests costs a few bytes per token; per-request views are built when asked.
A negative sampled token is the end signal a runtime reports; it ends the request ("stop") and
is not one of its tokens.
"""
from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence as _Seq

import numpy as np

from ..types import COMPLETED_REASONS, FINISH_REASONS as FINISH_REASONS

NAN = float("nan")


def percentile(values: Any, p: float) -> Any:
    """Nearest-rank percentile: element ceil(n·p/100) − 1 of the sorted values (clamped); 0 for
    no values. A list gives one of its own elements; a numpy array gives a float."""
    n = len(values)
    if n == 0:
        return 0
    k = min(max(math.ceil(n * p / 100) - 1, 0), n - 1)
    if isinstance(values, np.ndarray):
        return float(np.partition(values, k)[k])
    return sorted(values)[k]


@dataclass
class RequestRecord:
    """One request as a client saw it; times in µs on the engine's clock, None = never."""

    id: str
    arrival_us: float
    first_scheduled_us: Optional[float] = None
    first_token_us: Optional[float] = None
    finished_us: Optional[float] = None
    finish_reason: Optional[str] = None  # one of FINISH_REASONS; None while running
    tokens: list[int] = field(default_factory=list)
    token_times_us: list[float] = field(default_factory=list)
    preemptions: int = 0
    error: Optional[str] = None  # why a rejected request was refused

    @property
    def queue_wait_us(self) -> Optional[float]:
        return None if self.first_scheduled_us is None else self.first_scheduled_us - self.arrival_us

    @property
    def ttft_us(self) -> Optional[float]:
        return None if self.first_token_us is None else self.first_token_us - self.arrival_us

    @property
    def latency_us(self) -> Optional[float]:
        return None if self.finished_us is None else self.finished_us - self.arrival_us

    @property
    def itl_us(self) -> list[float]:
        t = self.token_times_us
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def max_itl_us(self) -> Optional[float]:
        gaps = self.itl_us
        return max(gaps) if gaps else None


@dataclass
class TokenTimeline:
    """Per-request token figures as arrays indexed by submission order (NaN = never)."""

    first_token_us: np.ndarray
    last_token_us: np.ndarray
    generated: np.ndarray  # int64 token counts
    max_gap_us: np.ndarray  # 0 for fewer than two tokens
    gaps_us: np.ndarray  # every inter-token gap of every request


class Recorder:
    """Append-only log of one engine run (the engine writes it; `report()` reads it)."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.arrival_us: list[float] = []
        self.first_scheduled_us: list[Optional[float]] = []
        self.finished_us: list[Optional[float]] = []
        self.finish: list[Optional[str]] = []
        self.errors: dict[int, str] = {}
        self.preemptions: list[int] = []
        # Sampled outputs: owner and token per sample; one end time and count per iteration.
        self._owner = array("i")
        self._token = array("i")
        self._time: list[float] = []
        self._count = array("q")
        # Iterations: (start, duration, rows, decode rows, tokens, admitted, waiting) each.
        self.iterations: list[tuple[float, float, int, int, int, int, int]] = []

    # -- writing (engine) ---------------------------------------------------------------------

    def add_request(self, request_id: str, arrival_us: float) -> int:
        self.ids.append(request_id)
        self.arrival_us.append(arrival_us)
        self.first_scheduled_us.append(None)
        self.finished_us.append(None)
        self.finish.append(None)
        self.preemptions.append(0)
        return len(self.ids) - 1

    def scheduled(self, owners: list[int], now: float) -> None:
        first = self.first_scheduled_us
        for o in owners:
            if first[o] is None:
                first[o] = now

    def sampled(self, end: float, owners: list[int], tokens: Any) -> None:
        if not owners:
            return
        self._owner.extend(owners)
        self._token.frombytes(tokens.tobytes())  # an int32 slice of the output block
        self._time.append(end)
        self._count.append(len(owners))

    def ended(self, index: int, reason: str, now: float) -> None:
        self.finish[index] = reason
        self.finished_us[index] = now

    def iteration(self, start: float, duration: float, rows: int, decode_rows: int,
                  tokens: int, admitted: int, waiting: int) -> None:
        self.iterations.append((start, duration, rows, decode_rows, tokens, admitted, waiting))


class EngineReport:
    """Read side of a `Recorder`: per-request records, token timelines, iteration arrays."""

    def __init__(self, recorder: Recorder, makespan_us: float) -> None:
        self._rec = recorder
        self.makespan_us = makespan_us
        owners = np.frombuffer(recorder._owner, dtype=np.int32) if len(recorder._owner) else \
            np.zeros(0, dtype=np.int32)
        tokens = np.frombuffer(recorder._token, dtype=np.int32) if len(recorder._token) else \
            np.zeros(0, dtype=np.int32)
        counts = np.frombuffer(recorder._count, dtype=np.int64) if len(recorder._count) else \
            np.zeros(0, dtype=np.int64)
        keep = tokens >= 0  # the end signal is not a token
        self._event_iter = np.repeat(np.arange(len(counts)), counts)[keep]
        self._owners = owners[keep]
        self._tokens = tokens[keep]
        self._order = np.argsort(self._owners, kind="stable")
        n = len(recorder.ids)
        self._starts = np.searchsorted(self._owners[self._order], np.arange(n + 1))
        self._records: Optional[list[RequestRecord]] = None

    # -- per request --------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._rec.ids)

    @property
    def ids(self) -> list[str]:
        return list(self._rec.ids)

    def record(self, index: int) -> RequestRecord:
        """The request submitted `index`-th (0-based), with its tokens and their times."""
        rec = self._rec
        events = self._order[self._starts[index]:self._starts[index + 1]]
        times = rec._time
        token_times = [times[i] for i in self._event_iter[events].tolist()]
        return RequestRecord(
            id=rec.ids[index], arrival_us=rec.arrival_us[index],
            first_scheduled_us=rec.first_scheduled_us[index],
            first_token_us=token_times[0] if token_times else None,
            finished_us=rec.finished_us[index], finish_reason=rec.finish[index],
            tokens=self._tokens[events].tolist(), token_times_us=token_times,
            preemptions=rec.preemptions[index], error=rec.errors.get(index))

    def __repr__(self) -> str:
        return (f"EngineReport(requests={len(self)}, iterations={self.iterations}, "
                f"tokens={len(self._tokens)}, makespan_us={self.makespan_us:g})")

    @property
    def records(self) -> list[RequestRecord]:
        """Every request in submission order."""
        if self._records is None:
            self._records = [self.record(i) for i in range(len(self))]
        return self._records

    def by_id(self) -> dict[str, RequestRecord]:
        """The last submission of every id."""
        return {r.id: r for r in self.records}

    # -- arrays -------------------------------------------------------------------------------

    def arrays(self) -> dict[str, np.ndarray]:
        """Per-request float arrays (µs, NaN = never): arrival, first_scheduled, finished."""
        rec = self._rec

        def floats(values: _Seq[Optional[float]]) -> np.ndarray:
            return np.array([NAN if v is None else v for v in values], dtype=np.float64)

        return {"arrival_us": np.asarray(rec.arrival_us, dtype=np.float64),
                "first_scheduled_us": floats(rec.first_scheduled_us),
                "finished_us": floats(rec.finished_us),
                "preemptions": np.asarray(rec.preemptions, dtype=np.int64)}

    def timeline(self) -> TokenTimeline:
        """Token figures of every request at once (vectorised: for large runs)."""
        n = len(self)
        first = np.full(n, np.nan)
        last = np.full(n, np.nan)
        generated = np.zeros(n, dtype=np.int64)
        max_gap = np.zeros(n)
        if len(self._order) == 0:
            return TokenTimeline(first, last, generated, max_gap, np.zeros(0))
        ends = np.asarray(self._rec._time, dtype=np.float64)
        o = self._owners[self._order]
        t = ends[self._event_iter[self._order]]
        starts = np.flatnonzero(np.r_[True, o[1:] != o[:-1]])
        stops = np.r_[starts[1:], len(o)] - 1
        first[o[starts]] = t[starts]
        last[o[stops]] = t[stops]
        generated[o[starts]] = stops - starts + 1
        gaps = np.r_[0.0, np.diff(t)]
        gaps[starts] = 0.0  # a request's first token has no gap
        max_gap[o[starts]] = np.maximum.reduceat(gaps, starts)
        keep = np.ones(len(o), dtype=bool)
        keep[starts] = False
        return TokenTimeline(first, last, generated, max_gap, gaps[keep])

    @property
    def iterations(self) -> int:
        return len(self._rec.iterations)

    def iteration_arrays(self) -> dict[str, np.ndarray]:
        """Per-iteration arrays: start_us, duration_us, rows, decode_rows, tokens, admitted,
        waiting (queue depth after the iteration)."""
        its = self._rec.iterations
        cols = list(zip(*its)) if its else [()] * 7
        names = ("start_us", "duration_us", "rows", "decode_rows", "tokens", "admitted", "waiting")
        return {name: np.asarray(col, dtype=np.float64 if k < 2 else np.int64)
                for k, (name, col) in enumerate(zip(names, cols))}

    def phase_mix(self) -> tuple[int, int, int]:
        """(prompt-only, decode-only, mixed) iteration counts."""
        prefill = decode = mixed = 0
        for _, _, rows, dec, _, _, _ in self._rec.iterations:
            if dec == rows:
                decode += 1
            elif dec:
                mixed += 1
            else:
                prefill += 1
        return prefill, decode, mixed

    # -- summary ------------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """Counts and nearest-rank percentiles over the run (times in µs)."""
        records = self.records
        reasons = {r: 0 for r in FINISH_REASONS}
        for r in records:
            if r.finish_reason is not None:
                reasons[r.finish_reason] += 1
        ttft = [r.ttft_us for r in records if r.ttft_us is not None]
        queue = [r.queue_wait_us for r in records if r.queue_wait_us is not None]
        latency = [r.latency_us for r in records if r.latency_us is not None]
        itl = [g for r in records for g in r.itl_us]
        generated = sum(len(r.tokens) for r in records)
        done = sum(reasons[r] for r in COMPLETED_REASONS)
        span_s = self.makespan_us / 1e6
        prefill, decode, mixed = self.phase_mix()
        its = self.iterations
        out: dict[str, Any] = {
            "requests": len(records),
            "completed": done,
            **{f"finish_{k}": v for k, v in reasons.items()},
            "generated_tokens": generated,
            "makespan_s": span_s,
            "requests_per_s": done / span_s if span_s > 0 else 0.0,
            "tokens_per_s": generated / span_s if span_s > 0 else 0.0,
            "iterations": its,
            "prefill_iterations": prefill,
            "decode_iterations": decode,
            "mixed_iterations": mixed,
            "mean_batch_size": sum(it[2] for it in self._rec.iterations) / its if its else 0.0,
            "tokens_executed": sum(it[4] for it in self._rec.iterations),
            "preemptions": sum(self._rec.preemptions),
        }
        for name, values in (("queue_wait", queue), ("ttft", ttft), ("itl", itl),
                             ("latency", latency)):
            for p in (50, 95, 99):
                out[f"p{p}_{name}_us"] = float(percentile(values, p))
        return out
