"""The SLO the server is told, its shedding rule and its verdicts (docs/serving.md, "An SLO:
goodput and shedding").

An SLO is a pair of budgets: a first-token budget (TTFT, ms from the request's arrival) and an
inter-token budget (ITL, ms, for every gap between two tokens). `serve --slo-ttft-ms` and
`--slo-itl-ms` give them server-wide; a request's `"skippy": {"ttft_ms": T, "itl_ms": I}`
overrides either for that request (`Slo.budgets`). A request's TTFT budget is its first-token
deadline in the scheduler; the slack rule plans it to GAP_PLAN_SHARE (3/4) of its ITL budget.
Without either flag a request carries only what it gives itself, as before.

**Shedding** (`--slo-shed`, off by default). When a request that carries a TTFT budget
arrives, the server predicts whether the slack rule's prefill order (docs/behaviour.md §2.13
step 6) can give it its first token within its budget without making an admitted request miss
a deadline the rule keeps. The work it counts is the prompts this server admitted that have
not had their first token yet (once per prompt whatever n), each with its deadline (its arrival
plus its TTFT budget) or none, when it was admitted, and its tokens not yet prefilled: the
engine reports after every step it executes how far each prompt it prefilled has got
(`runner.PrefillProgress`; a restored prefix counts as done from the prompt's first chunk), and
a prompt counts whole until its first chunk has run or after a preemption took its KV. With A
the age bound (`--prefill-age-max-ms`) and p, b the per-token and fixed cost of the step cost
model the engine fitted (`scheduler.step_cost`):

1. *The deadlines the rule keeps*, decided as the scheduler decides them, with its terms:
   Moore and Hodgson's rule over the admitted deadlines in deadline order, `end` starting at
   now + b + p × the tokens of the prompts overdue now (no budget, admitted at least A ago),
   `end` += p × each one's tokens, and when `end` passes a deadline the longest so far gives
   way (the first of equals).
2. *The timing*: a run of w prompt tokens from now takes

       time(w) = w × t + ceil(w / B) × b          B: the step token budget

   where t is the larger of p and the time a token has been taking with a backlog: prompt
   tokens that reached their first token per ms during which at least B prompt tokens were
   waiting (a step's worth: the server was prefill-bound, not waiting for work or for a step
   boundary), over the last `RATE_WINDOW_MS` of such time (`Slo.drain_rate`; read once it
   covers `RATE_MIN_TOKENS` tokens and `RATE_MIN_MS`, else p). Under load a step's time also
   goes to its decode rows, to the prompts' attention to their own context and to whatever
   else the machine runs, which p does not count: on a trace replay of the bench model the
   model said 0.5 ms a token while a burst took about 0.9 ms, and requests predicted within
   their budget missed it by a second.
3. *The order*: first the prompts that turn overdue before the new request's deadline (no
   budget: admitted + A; a deadline given up: deadline + A), then the kept deadlines and the
   new one in deadline order (ties: the admitted first), each ending at now + time(the tokens
   up to and including it). The rule serves the ones without a budget, and the ones given up
   until they turn overdue, after these.

The request is admitted when its own first token ends within its budget and no kept deadline
after it, met without it, ends late with it (one late whatever it does is not held against
it, nor one of lower priority than the new request, which the server admits first and preempts
for, docs/behaviour.md §2.8a). Deadline order meets a set of deadlines whenever any order
does, and of a set that can be met Moore and Hodgson give up none and Smith's order meets
every one as predicted. Otherwise
the server answers 503 with `Retry-After` (whole seconds, at least 1: the largest predicted
lateness) before anything reaches the engine. With A = 0 (the walk order) no deadline reorders
anything, and every admitted prompt counts ahead. Until the engine has fitted its cost model
(its first refit, after 8 timed steps) nothing is shed: the prior is a guess, not a measurement.

**Verdicts.** Each request that carried a budget and ended with its answer complete (finish
reason `length` or `stop`; an error or a client gone counts nowhere) is judged once per choice
(under `best_of`, per choice returned: the candidates the ranking drops are not judged):
its TTFT (as `skippy:time_to_first_token_seconds` observes it) against its TTFT budget, its
largest inter-token gap against its ITL budget (a one-token answer has no gap and meets it).
`/metrics` counts `skippy:slo_met_total{part}` and `skippy:slo_missed_total{part}`: `part="ttft"`
and `part="itl"` judge the requests that carried that budget, `part="both"` those that carried
both (met: within both; missed: outside either), so for every part met + missed is the
requests judged on it. `skippy:slo_shed_total` counts the requests shed. Each verdict is also
logged at debug level on the `skippy_scheduler.serve` logger.

Everything here runs on the event loop; the engine thread only swaps the cost model, an
immutable object read whole, and writes single entries of the prefill report, read one at a
time.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, Optional, Sequence

from .._validate import as_float
from ..slack import StepCost
from .errors import RequestError

if TYPE_CHECKING:  # pragma: no cover
    from .metrics import ServeMetrics

log = logging.getLogger("skippy_scheduler.serve")

PARTS = ("ttft", "itl", "both")
#: The drain rate is measured over this much of the most recent backlog time.
RATE_WINDOW_MS = 30_000.0
#: ... and only read once it covers at least this many prompt tokens and this much time.
RATE_MIN_TOKENS = 256
RATE_MIN_MS = 200.0
#: A first token this soon after a backlog ended still counts as drained out of it (the other
#: prompts of the step that ended it).
RELEASE_GRACE_MS = 5.0
# The share of a request's gap budget the slack rule plans its steps to; the rest absorbs what
# the fitted cost model gets wrong. On the trace replay (BENCHMARKS.md, "Goodput under a
# declared SLO") the largest gap ran 1.32x the target at a 150 ms target and 1.2x-2x it when
# the target was the whole 200 ms budget, so a stream planned to the whole budget misses it.
GAP_PLAN_SHARE = 0.75


def planned_gap_ms(itl_ms: Optional[float]) -> Optional[float]:
    """The inter-token target the slack rule plans a request with gap budget `itl_ms` to."""
    return None if itl_ms is None else itl_ms * GAP_PLAN_SHARE


@dataclass(frozen=True)
class SloSettings:
    """The server-wide SLO (None: no such budget) and whether to shed."""

    ttft_ms: Optional[float] = None
    itl_ms: Optional[float] = None
    shed: bool = False


def check_budget(name: str, value: object) -> Optional[float]:
    """None, or a finite number of ms > 0 (ValueError naming `name` otherwise)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not (math.isfinite(as_float(value)) and value > 0):
        raise ValueError(f"{name} must be a finite number of ms > 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Prediction:
    """What the shedding rule predicted for one arriving request (module docstring)."""

    tokens: int  # prefill tokens ahead of its first token, its own included
    steps: int
    ttft_ms: float  # the predicted time to its first token
    budget_ms: float
    #: Admitted requests whose kept deadline it would push past (0: none).
    displaced: int = 0
    #: The largest predicted lateness, its own or an admitted request's, in ms (0: none).
    late_ms: float = 0.0

    @property
    def met(self) -> bool:
        """Whether it can be admitted: its first token and every kept deadline in time."""
        return self.ttft_ms <= self.budget_ms and self.displaced == 0

    @property
    def retry_after_s(self) -> int:
        """Whole seconds until the predicted lateness has been worked off (at least 1)."""
        late = max(self.late_ms, self.ttft_ms - self.budget_ms)
        return max(1, math.ceil(late / 1e3))


def slo_shed_error(p: Prediction) -> RequestError:
    """The 503 of a shed request (Retry-After: `p.retry_after_s`)."""
    if p.ttft_ms > p.budget_ms:
        why = (f"The server predicts this request's first token in {p.ttft_ms:.0f} ms "
               f"({p.tokens} prompt tokens to prefill ahead of it, its own included), over its "
               f"TTFT budget of {p.budget_ms:g} ms")
    else:
        why = (f"The server predicts this request's first token in {p.ttft_ms:.0f} ms, within "
               f"its TTFT budget of {p.budget_ms:g} ms, but serving it would make "
               f"{p.displaced} admitted request{'s' if p.displaced != 1 else ''} miss "
               f"{'their' if p.displaced != 1 else 'its'} own")
    return RequestError(
        f"{why}; it was not started. Retry later, or with a larger 'skippy.ttft_ms'.",
        status=503, type="server_error", code="slo_unattainable",
        retry_after=p.retry_after_s)


class Slo:
    """The server's SLO, its shedding bookkeeping and its verdicts (event loop only).

    `cost()` is the fitted step cost model, or None while the engine has not fitted one (then
    nothing is shed); a test may replace it. The prompts waiting for their first token are
    kept by `hold` (at admission: one entry per prompt, with the request's deadline and the
    engine sequence that prefills it) and `release` (at its first token, or when the request
    ends); `waiting_prefill_tokens` is their sum, whole (what decides whether a backlog holds).
    `prefilled` (sequence id -> prompt positions done, written by the engine thread) says how
    much of each is done. `age_max_ms` is the slack rule's age bound A, `clock` the event
    loop's ms clock."""

    def __init__(self, settings: SloSettings = SloSettings(),
                 cost: Callable[[], Optional[StepCost]] = lambda: None,
                 batch_tokens: int = 512, metrics: "Optional[ServeMetrics]" = None,
                 age_max_ms: float = 2000.0,
                 clock: Callable[[], float] = lambda: time.monotonic() * 1e3,
                 prefilled: Optional[Mapping[str, int]] = None) -> None:
        self.settings = settings
        self.cost = cost
        self.batch_tokens = max(int(batch_tokens), 1)
        self.metrics = metrics
        self.age_max_ms = float(age_max_ms)
        self.clock = clock
        self.waiting_prefill_tokens = 0
        # key -> (deadline on `clock` in ms, or None: no TTFT budget; prompt tokens; arrived
        # at; the engine sequence id whose prefill `prefilled` reports, or None; priority)
        self._held: dict[int, tuple[Optional[float], int, float, Optional[str], int]] = {}
        self._keys = itertools.count(1)
        self.prefilled: Mapping[str, int] = prefilled if prefilled is not None else {}
        # The drain rate: the ms with a backlog (counted up to `_mark`) and the prompt tokens
        # that got their first token out of one, in all; and those two totals after each such
        # first token of the last RATE_WINDOW_MS of backlog time (the first: at or before its
        # start).
        self._backlog_ms = 0.0
        self._backlog_at = -math.inf  # the clock when a backlog last held
        self._drained = 0
        self._mark = 0.0
        self._samples: deque[tuple[float, int]] = deque([(0.0, 0)])

    @property
    def shedding(self) -> bool:
        return self.settings.shed

    def budgets(self, ttft_ms: Optional[float],
                itl_ms: Optional[float]) -> tuple[Optional[float], Optional[float]]:
        """A request's (TTFT, ITL) budgets: its own, else the server's."""
        s = self.settings
        return (ttft_ms if ttft_ms is not None else s.ttft_ms,
                itl_ms if itl_ms is not None else s.itl_ms)

    # -- shedding ---------------------------------------------------------------------------

    def predict(self, own_tokens: int, budget_ms: float, priority: int = 0,
                spent_ms: float = 0.0) -> Optional[Prediction]:
        """The prediction for a request of `own_tokens` prompt tokens and `priority` admitted
        now, `spent_ms` after its arrival, with a TTFT budget of `budget_ms` from its arrival
        (None: no fitted model), as the module docstring lays out; its predicted TTFT counts
        from its arrival."""
        cost = self.cost()
        if cost is None:
            return None
        p, base, batch, age = (cost.per_prefill_token_us, cost.base_us, self.batch_tokens,
                               self.age_max_ms)
        rate = self.drain_rate()  # tokens a ms
        t = p if rate is None else max(p, 1e3 / rate)

        def time_ms(tokens: int) -> float:
            return (tokens * t + -(-tokens // batch) * base) / 1e3

        now = self.clock()
        deadline = now - spent_ms + budget_ms
        left = self._left
        if age <= 0:  # the walk order: everything admitted is ahead
            tokens = sum(left(w, sid) for _, w, _, sid, _ in self._held.values()) + own_tokens
            mine = spent_ms + time_ms(tokens)
            return Prediction(tokens=tokens, steps=-(-tokens // batch), ttft_ms=mine,
                              budget_ms=budget_ms, late_ms=max(mine - budget_ms, 0.0))
        ahead = 0  # turn overdue before its deadline (step 3)
        overdue_now = 0  # the scheduler's starting point (step 1)
        timed: list[tuple[float, int, int]] = []
        for d, w, at, sid, prio in self._held.values():
            w = left(w, sid)
            turns = at + age if d is None else d + age  # when it turns overdue
            if turns <= now:
                overdue_now += w
            if d is None or turns <= now:  # no deadline to order by (now <= its deadline)
                if turns <= deadline:
                    ahead += w
            else:
                timed.append((d, w, prio))
        # Moore and Hodgson over the admitted deadlines, with the scheduler's terms (step 1).
        timed.sort()
        kept: list[tuple[int, float, int, int]] = []  # a max-heap on tokens: (-w, d, order, prio)
        end_us = now * 1e3 + base + p * overdue_now
        for order, (d, w, prio) in enumerate(timed):
            end_us += p * w
            heapq.heappush(kept, (-w, d, order, prio))
            if end_us > d * 1e3:
                neg, given_up, _, _ = heapq.heappop(kept)
                end_us += p * neg
                if given_up + age <= deadline:  # overdue before its deadline: ahead of it
                    ahead -= neg
        # Its own deadline among the kept ones, in deadline order (ties: the admitted first);
        # a kept one is displaced when it ends in time without the new request, late with it,
        # unless its priority is below the new request's (which the server puts first:
        # docs/behaviour.md §2.8a).
        schedule = sorted([(d, 0, -neg, prio) for neg, d, _, prio in kept]
                          + [(deadline, 1, own_tokens, priority)])
        cum, tokens, mine, displaced, late = ahead, own_tokens, 0.0, 0, 0.0
        placed = False
        for d, is_new, w, prio in schedule:
            cum += w
            end = now + time_ms(cum)
            if is_new:
                mine, tokens, placed = spent_ms + time_ms(cum), cum, True
            elif (placed and prio >= priority and end > d
                  and now + time_ms(cum - own_tokens) <= d):
                displaced += 1
                late = max(late, end - d)
        return Prediction(tokens=tokens, steps=-(-tokens // batch), ttft_ms=mine,
                          budget_ms=budget_ms, displaced=displaced,
                          late_ms=max(late, mine - budget_ms, 0.0))

    def admit(self, own_tokens: int, ttft_ms: Optional[float], priority: int = 0,
              spent_ms: float = 0.0) -> None:
        """Raise the 503 when shedding is on and the request's TTFT budget (from its arrival,
        `spent_ms` ago) cannot be met, or meeting it would make an admitted request miss its
        own; nothing is changed either way (the caller holds its prompts once it is queued)."""
        if not self.settings.shed or ttft_ms is None:
            return
        p = self.predict(own_tokens, ttft_ms, priority, spent_ms)
        if p is not None and not p.met:
            if self.metrics is not None:
                self.metrics.slo_shed.inc()
            raise slo_shed_error(p)

    def hold(self, prompts: Sequence[int], ttft_ms: Optional[float],
             ids: Optional[Sequence[Optional[str]]] = None, priority: int = 0,
             spent_ms: float = 0.0) -> list[int]:
        """Count each prompt of `prompts` (their token counts) as waiting for prefill since
        their arrival `spent_ms` ago, with the deadline `ttft_ms` from then (None: no budget),
        prefilled as the engine sequence of the same place in `ids` (None: not reported; it
        counts whole); returns one key per prompt to `release` later (none when not shedding:
        nothing is counted)."""
        if not self.settings.shed:
            return []
        now = self.clock()
        deadline = None if ttft_ms is None else now - spent_ms + ttft_ms
        self._tick(now)
        keys = []
        for i, tokens in enumerate(prompts):
            key = next(self._keys)
            w = max(int(tokens), 0)
            self._held[key] = (deadline, w, now - spent_ms,  # its arrival
                               ids[i] if ids is not None else None, priority)
            self.waiting_prefill_tokens += w
            keys.append(key)
        return keys

    def _left(self, tokens: int, sequence_id: Optional[str]) -> int:
        """What of a held prompt of `tokens` tokens is still to be prefilled."""
        if sequence_id is None:
            return tokens
        return max(tokens - self.prefilled.get(sequence_id, 0), 0)

    def release(self, key: int, first_token: bool = False) -> None:
        """The prompt `key` (from `hold`) no longer waits for prefill: `first_token`, it got
        its first token (its tokens count toward the drain rate), else it ended or failed
        before one. A key released already is ignored."""
        if key not in self._held:
            return
        self._tick(self.clock())  # (while it still counts as waiting)
        held = self._held.pop(key)
        self.waiting_prefill_tokens -= held[1]
        # Out of a backlog: one that held until now, or until a moment ago (the other
        # prompts whose first token came in the same step, released just before this one).
        if first_token and self._mark - self._backlog_at <= RELEASE_GRACE_MS:
            self._drained += held[1]
            self._samples.append((self._backlog_ms, self._drained))
            self._trim()

    def _tick(self, now: float) -> None:
        """Count the time since the last mark as backlog time when at least a step's worth
        of prompt tokens was waiting."""
        if self.waiting_prefill_tokens >= self.batch_tokens:
            self._backlog_ms += max(now - self._mark, 0.0)
            self._backlog_at = now
        self._mark = now

    def _trim(self) -> None:
        """Keep one sample at or before the start of the last RATE_WINDOW_MS of backlog."""
        samples = self._samples
        while len(samples) > 1 and samples[1][0] <= self._backlog_ms - RATE_WINDOW_MS:
            samples.popleft()

    def drain_rate(self) -> Optional[float]:
        """Prompt tokens that got their first token per ms of backlog time (at least a step's
        token budget of prompts waiting), over the last `RATE_WINDOW_MS` of it (None: too
        little measured yet)."""
        self._tick(self.clock())
        self._trim()
        start_ms, start_tokens = self._samples[0]  # the last sample at the window's start
        span = self._backlog_ms - start_ms
        tokens = self._drained - start_tokens
        if tokens < RATE_MIN_TOKENS or span < RATE_MIN_MS:
            return None
        return tokens / span

    # -- verdicts ---------------------------------------------------------------------------

    def judge(self, request_id: str, ttft_budget_ms: Optional[float],
              itl_budget_ms: Optional[float], ttft_ms: Optional[float],
              max_gap_ms: float) -> Optional[bool]:
        """Count one finished request's verdict; True: within every budget it carried, None:
        it carried none (counted nowhere). `ttft_ms` None: it got no token (a miss of TTFT)."""
        if ttft_budget_ms is None and itl_budget_ms is None:
            return None
        m = self.metrics
        ttft_ok = itl_ok = True
        if ttft_budget_ms is not None:
            ttft_ok = ttft_ms is not None and ttft_ms <= ttft_budget_ms
            if m is not None:
                (m.slo_met if ttft_ok else m.slo_missed).labels("ttft").inc()
        if itl_budget_ms is not None:
            itl_ok = max_gap_ms <= itl_budget_ms
            if m is not None:
                (m.slo_met if itl_ok else m.slo_missed).labels("itl").inc()
        ok = ttft_ok and itl_ok
        if m is not None and ttft_budget_ms is not None and itl_budget_ms is not None:
            (m.slo_met if ok else m.slo_missed).labels("both").inc()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s: SLO %s (TTFT %s ms, budget %s; largest gap %.1f ms, budget %s)",
                      request_id, "met" if ok else "missed",
                      "-" if ttft_ms is None else f"{ttft_ms:.1f}",
                      "-" if ttft_budget_ms is None else f"{ttft_budget_ms:g}",
                      max_gap_ms, "-" if itl_budget_ms is None else f"{itl_budget_ms:g}")
        return ok
