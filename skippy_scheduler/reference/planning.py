"""The reference scheduler's planner: which rows one iteration runs (behaviour.md §2.4–§2.6).

Owns `RowPlanner`, the state planning keeps between plans (the consecutive-prefill counter,
the mixed rotation cursor, one decode-duration average per decode-row count and the
mixed-viability latch) and the two ways of filling a plan: phase-homogeneous and mixed. It
reads the active sequences and moves their cursors; admission, in-flight bookkeeping and
completion belong to `TwinScheduler`.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

from .._validate import I32_MAX, USIZE_MAX, sat
from ..slack import PlanningRule
from ..types import IterationPhase, IterationWork, SchedulerConfig, Sequence
from .slack import SlackRule, SlackStep, position_charge, position_chunk

EWMA_ALPHA = 0.25
MIXED_SLOWDOWN_FRACTION = 0.20
MIXED_MIN_EXTRA_US = 8_000.0
MIXED_MAX_EXTRA_US = 20_000.0


# The classes of the slack rule's prefill order (§2.13; C: SK_PF_*), in the order they go.
_OVERDUE, _DEADLINE, _FREE, _RELEGATED = 0, 1, 2, 3


def _left(s: Sequence) -> int:
    """Prefill tokens it still has to feed (replay length − cursor)."""
    return s.recompute_token_count() - s.prefill_cursor


def _deadline_us(s: Sequence) -> float:
    """Its first-token deadline in µs, as the core holds it."""
    assert s.ttft_deadline is not None
    return s.ttft_deadline * 1e6


def _smith_order(pending: list[Sequence], kept: list[int], end: float,
                 per_token: float) -> dict[int, int]:
    """Smith's backward rule (C: smith_order): `kept` in deadline order, `end` the predicted end
    of them all; from the last place to the first, the place goes to the one with the most
    tokens left among those not placed whose deadline is not before `end` (the latest in
    deadline order among equals; the latest in deadline order outright when none is), and
    `end` moves back by its prediction. Returns each one's place, 0 first."""
    rank: dict[int, int] = {}
    for place in range(len(kept) - 1, -1, -1):
        pick: Optional[int] = None
        latest: Optional[int] = None
        for i in kept:
            if i in rank:
                continue
            latest = i
            if _deadline_us(pending[i]) >= end and (
                    pick is None or _left(pending[i]) >= _left(pending[pick])):
                pick = i
        chosen = pick if pick is not None else latest
        assert chosen is not None  # a place is left, so one is not placed
        rank[chosen] = place
        end -= per_token * float(_left(pending[chosen]))
    return rank


def prefill_pending(s: Sequence) -> bool:
    return s.prefill_cursor < s.recompute_token_count()


def _first_pending(s: Sequence) -> bool:
    """It has a first-token deadline and no token planned (C: sk_first_pending)."""
    return s.ttft_deadline is not None and not s.generated_tokens


class _Hold:
    """The first-token hold of one plan (§2.13; C: sk_ft_hold, hold_begin): `pressed` when the
    prefill that may be planned would take, at twice its predicted time, until the nearest
    first-token deadline among it; then a first-pending sequence whose deadline is later than
    `release_us` (a few full steps from now) is held while another has more than one token
    left (`longer` counts those). A leader of the cold prefix hold (`leading`) is never held:
    its peers wait for its first token."""

    def __init__(self, on: bool, pressed: bool = False, release_us: float = 0.0,
                 longer: int = 0,
                 leading: Callable[[Sequence], bool] = lambda s: False) -> None:
        self.on, self.pressed, self.release_us, self.longer = on, pressed, release_us, longer
        self.leading = leading

    def held(self, s: Sequence, left: int) -> bool:
        return (self.pressed and _first_pending(s) and _deadline_us(s) > self.release_us
                and self.longer > (1 if left > 1 else 0) and not self.leading(s))


class RowPlanner:
    """Writes one plan's rows from the active set, in walk order.

    `live_decode(s)` says whether a sequence has a pending token to feed now, `take_new(s)`
    whether the row being written is its first since admission (and makes later ones not new),
    `holder(s)` the restore holder every row of it names, `last_token_us(s)` the clock at its
    last token or admission (the slack rule, §2.13), `in_flight(s)` (disjoint plans in
    flight, §2.11a) whether it has a row in a live plan, which leaves it out of this one; a
    plan then takes at most ceil(active / max_inflight_plans) decode rows (its share).
    `submitted_us(s)` is the clock at its submit, its age in the slack rule's prefill order;
    `on_relegate(s)` is told each time that order relegates a sequence for its deadline;
    `leading(s)` says whether it leads a cold prefix hold (peers wait for its prompt), which
    the first-token hold never holds.
    """

    def __init__(self, config: SchedulerConfig, live_decode: Callable[[Sequence], bool],
                 take_new: Callable[[Sequence], bool],
                 holder: Callable[[Sequence], Optional[int]],
                 last_token_us: Callable[[Sequence], float],
                 in_flight: Optional[Callable[[Sequence], bool]] = None,
                 submitted_us: Optional[Callable[[Sequence], float]] = None,
                 on_relegate: Optional[Callable[[Sequence], None]] = None,
                 leading: Optional[Callable[[Sequence], bool]] = None) -> None:
        self._config = config
        self._leading = leading if leading is not None else lambda s: False
        self._submitted_us = submitted_us if submitted_us is not None else lambda s: 0.0
        self._on_relegate = on_relegate if on_relegate is not None else lambda s: None
        # Whose slack counts (§2.13): the live decodes, but under disjoint plans (§2.11a) not
        # those in flight, which this plan cannot give a row; the share bounds rows only.
        self._slack_decode = live_decode
        self._disjoint = in_flight is not None
        self._decode_share = 0  # §2.11a: decode rows the plan being written may still take
        if in_flight is not None:
            def slack_decode(s: Sequence) -> bool:
                return live_decode(s) and not in_flight(s)

            def plannable_decode(s: Sequence) -> bool:
                return live_decode(s) and self._decode_share > 0 and not in_flight(s)

            def plannable_prefill(s: Sequence) -> bool:
                return prefill_pending(s) and not in_flight(s)

            self._live_decode: Callable[[Sequence], bool] = plannable_decode
            self._prefill_pending: Callable[[Sequence], bool] = plannable_prefill
            self._slack_decode = slack_decode
        else:
            self._live_decode = live_decode
            self._prefill_pending = prefill_pending
        self._take_new = take_new
        self._holder = holder
        self._last_token_us = last_token_us
        self.slack = SlackRule(config)
        self.consecutive_prefill = 0
        self.mixed_cursor = 0
        self._decode_us_ewma: dict[int, float] = {}
        self.mixed_viable = True
        # (sequence, cursor before) of each row written by the last `rows` call
        self.cursors_before: list[tuple[Sequence, int]] = []

    @property
    def counters(self) -> tuple[int, int, int]:
        """What aborting a plan puts back: (consecutive prefill plans, mixed cursor, decode-only
        plans in a row while prefill waited)."""
        return self.consecutive_prefill, self.mixed_cursor, self.slack.interleaved

    def restore(self, counters: tuple[int, int, int]) -> None:
        self.consecutive_prefill, self.mixed_cursor, self.slack.interleaved = counters

    def rows(self, active: list[Sequence], preempted: bool = False) -> list[IterationWork]:
        """The plan's rows; `preempted`: its admission preempted for priority (§2.8a point 6:
        then the plan is mixed whatever §2.6's gate says)."""
        if self._disjoint:
            depth = self._config.max_inflight_plans
            self._decode_share = -(-len(active) // depth)
        live = sum(1 for s in active if self._live_decode(s))
        if self._disjoint:
            live = min(live, self._decode_share)
        decode_rows = min(live, self._config.max_tokens_per_iteration)
        self.cursors_before = []
        if self._config.planning_rule is PlanningRule.SLACK:
            if live and any(self._prefill_pending(s) for s in active):
                return self._slack(active, decode_rows)
            self.slack.interleaved = 0  # nothing waits on the other phase
            return self._homogeneous(active)
        if self._config.mixed_prefill_decode and decode_rows > 0 and (
                preempted or (self.mixed_viable and decode_rows in self._decode_us_ewma)):
            return self._mixed(active)
        return self._homogeneous(active)

    def _slack(self, active: list[Sequence], decode_rows: int) -> list[IterationWork]:
        """The slack rule (§2.13) when prefill and live decode both wait."""
        least = self.slack.min_slack_us((self._last_token_us(s), s.itl_target)
                                        for s in active if self._slack_decode(s))
        ratio = self.slack.position_ratio()
        first_start = 0
        if ratio > 0.0:
            order = self._prefill_order(active)
            first_start = order[0].prefill_cursor if order else 0
        kind, budget = self.slack.decide(least, decode_rows, ratio, first_start)
        if kind is SlackStep.MIXED:
            return self._mixed(active, budget, toll=self.slack.toll(), ratio=ratio)
        if kind is SlackStep.PREFILL_ONLY:
            return self._homogeneous(active, prefill_budget=budget, force_prefill=True,
                                     toll=self.slack.toll(), ratio=ratio)
        work = self._homogeneous(active, decode_only=True)
        budget = self._config.max_tokens_per_iteration - len(work)
        work.extend(self._released(active, self._hold(active), budget, self._prefill_limit()))
        self.consecutive_prefill = 0
        return work

    # -- rows -------------------------------------------------------------------------------

    def _prefill_row(self, s: Sequence, budget: int) -> IterationWork:
        replay = s.recompute_tokens()
        start = s.prefill_cursor
        count = min(self._config.prefill_chunk_tokens, len(replay) - start, budget)
        end = start + count
        fresh = not s.generated_tokens
        new = self._take_new(s)
        self.cursors_before.append((s, start))
        s.prefill_cursor = end
        return IterationWork(
            sequence_id=s.id,
            tokens=tuple(replay[start:end]),
            positions=tuple(min(p, I32_MAX) for p in range(start, end)),
            sample_last=end == len(replay) and fresh,
            phase=IterationPhase.PREFILL if fresh else IterationPhase.RECOMPUTE,
            sampling=s.sampling,
            restore_holder=self._holder(s),
            new_row=new,
            restored_tokens=start if new else 0,
        )

    def _decode_row(self, s: Sequence) -> IterationWork:
        position = s.recompute_token_count()
        before = s.prefill_cursor
        new = self._take_new(s)
        self.cursors_before.append((s, before))
        s.prefill_cursor = sat(position + 1)  # the fed token is never replayed
        self._decode_share -= 1
        return IterationWork(
            sequence_id=s.id,
            tokens=(s.generated_tokens[-1],),
            positions=(min(position, I32_MAX),),
            sample_last=True,
            phase=IterationPhase.DECODE,
            sampling=s.sampling,
            restore_holder=self._holder(s),
            new_row=new,
            restored_tokens=before if new else 0,
        )

    def _prefill_limit(self) -> int:
        limit = self._config.max_prefill_sequences_per_iteration
        return USIZE_MAX if limit is None else limit

    def _pay_toll(self, budget: int, prefill_rows: int, toll: int) -> int | None:
        """The slack rule's toll (§2.13; C: pay_toll): the budget left once a prefill row after
        the first paid `toll` tokens, None when it would leave less than the minimum chunk."""
        if toll == 0 or prefill_rows == 0:
            return budget
        if budget <= toll or budget - toll < self._config.slack_min_chunk_tokens:
            return None
        return budget - toll

    def _prefill_order(self, active: list[Sequence]) -> list[Sequence]:
        """The prefill-pending sequences in the order a prefill walk visits them (§2.13; C:
        sk_prefill_order.c): walk order, but under the slack rule with an age bound > 0 in four
        classes, ties in walk order: those submitted at least that long ago, or that long past
        a first-token deadline still to meet (walk order); those
        with a first-token deadline still to meet that they can meet (Smith's order: all of
        them on time with the least total time to first token; the shortest first among equal
        deadlines); those without one (fewest prefill tokens left
        first); those relegated because theirs cannot be met in this order (fewest tokens left
        first)."""
        pending = [s for s in active if self._prefill_pending(s)]
        age_max_us = self._config.slack_prefill_age_max * 1e6
        if self._config.planning_rule is not PlanningRule.SLACK or not age_max_us > 0.0:
            return pending
        now = self.slack.now_us
        per_token = self.slack.cost.per_prefill_token_us
        ahead = 0.0
        classes: list[int] = []
        for s in pending:
            # a first-token deadline still to meet: the age bound counts from the deadline
            first = _first_pending(s)
            since = self._submitted_us(s)
            if first and _deadline_us(s) > since:
                since = _deadline_us(s)
            if now - since >= age_max_us:
                classes.append(_OVERDUE)
                ahead += per_token * float(_left(s))
            elif first:
                classes.append(_DEADLINE)
            else:
                classes.append(_FREE)
        rank: dict[int, int] = {}
        if len(pending) > 1 and _DEADLINE in classes:  # one alone goes first anyway
            rank = self._relegate(pending, classes, ahead)

        def key(i: int) -> tuple[int, float]:
            cls = classes[i]
            if cls == _OVERDUE:
                return (cls, 0.0)
            if cls == _DEADLINE:
                return (cls, float(rank.get(i, 0)))
            return (cls, float(_left(pending[i])))

        # stable: ties keep walk order
        return [pending[i] for i in sorted(range(len(pending)), key=key)]

    def _relegate(self, pending: list[Sequence], classes: list[int],
                  ahead: float) -> dict[int, int]:
        """Moore and Hodgson's rule over the deadline class (C: relegate): in deadline order
        (fewest tokens left first among equal deadlines) each one's prefill is predicted to end
        at now + base + per-token cost × (the overdue ones' tokens, the kept ones' before it and
        its own); one that would end after its deadline relegates the kept one with the most
        tokens left (the first of equals). Returns the kept ones' places in Smith's order
        (`_smith_order`), by index into `pending`."""
        order = sorted((i for i, c in enumerate(classes) if c == _DEADLINE),
                       key=lambda i: (_deadline_us(pending[i]), _left(pending[i])))
        per_token = self.slack.cost.per_prefill_token_us
        end = self.slack.now_us + self.slack.cost.base_us + ahead
        for k, i in enumerate(order):
            end += per_token * float(_left(pending[i]))
            if not end > _deadline_us(pending[i]):
                continue
            longest: Optional[int] = None
            for j in order[:k + 1]:
                if classes[j] == _DEADLINE and (
                        longest is None or _left(pending[j]) > _left(pending[longest])):
                    longest = j
            assert longest is not None  # i itself is still in the class
            classes[longest] = _RELEGATED
            end -= per_token * float(_left(pending[longest]))
            self._on_relegate(pending[longest])
        return _smith_order(pending, [i for i in order if classes[i] == _DEADLINE], end,
                            per_token)

    def _hold(self, active: list[Sequence]) -> _Hold:
        """This plan's first-token hold (C: hold_begin)."""
        config = self._config
        if not config.slack_first_token_hold or config.planning_rule is not PlanningRule.SLACK:
            return _Hold(False)
        left_sum = longer = 0
        nearest = math.inf
        for s in active:
            if not self._prefill_pending(s):
                continue
            left = _left(s)
            left_sum += left
            if left > 1:
                longer += 1
            if _first_pending(s) and _deadline_us(s) < nearest:
                nearest = _deadline_us(s)
        cost = self.slack.cost
        now = self.slack.now_us
        work = cost.base_us + cost.per_prefill_token_us * float(left_sum)
        if nearest == math.inf or now + 2.0 * work < nearest:
            return _Hold(True, longer=longer)
        full = cost.base_us + cost.per_prefill_token_us * float(config.max_tokens_per_iteration)
        release = now + (float(config.max_inflight_plans) + 2.0) * full
        return _Hold(True, True, release, longer, self._leading)

    def _released(self, active: list[Sequence], hold: _Hold, budget: int,
                  limit: int) -> list[IterationWork]:
        """The released last tokens (C: emit_released): a one-token row for each first-pending
        sequence with one token left that is not held, in walk order, within `budget` and
        `limit` rows."""
        work: list[IterationWork] = []
        if not hold.on:
            return work
        for s in active:
            if budget == 0 or len(work) >= limit:
                break
            if (self._prefill_pending(s) and _first_pending(s) and _left(s) == 1
                    and not hold.held(s, 1)):
                work.append(self._prefill_row(s, 1))
                budget -= 1
        return work

    def _fill_prefill(self, active: list[Sequence], budget: int, toll: int,
                      ratio: float = 0.0) -> list[IterationWork]:
        """Prefill rows within `budget` tokens in `_prefill_order`, each row after the first
        paying `toll` (C: fill_prefill); under a position cost (`ratio` > 0) the budget is in
        token equivalents, and each row's chunk the longest whose equivalents fit (the first
        row at least one token), paying them (at most what is left). Under the first-token
        hold the released last tokens go first, paying nothing, and a held sequence's chunk
        stops one token short of its prompt."""
        prefill_limit = self._prefill_limit()
        hold = self._hold(active)
        order = self._prefill_order(active)
        work = self._released(active, hold, budget, prefill_limit)
        budget -= len(work)
        rows = 0  # the walk's rows: the toll's count
        for s in order:
            if budget == 0 or len(work) >= prefill_limit:
                break
            left_tokens = _left(s)
            if left_tokens == 0:
                continue  # released above
            cap = USIZE_MAX
            if hold.held(s, left_tokens):
                if left_tokens == 1:
                    continue
                cap = left_tokens - 1
            left = self._pay_toll(budget, rows, toll)
            if left is None:
                break
            room = min(left, cap)
            if ratio > 0.0:
                start = s.prefill_cursor
                chunk = position_chunk(start, room, ratio)
                if chunk == 0:
                    if rows:
                        break
                    chunk = 1  # a step that prefills makes progress, whatever one token costs
                row = self._prefill_row(s, chunk)
                budget = left - position_charge(start, len(row.tokens), ratio, left)
            else:
                row = self._prefill_row(s, room)
                budget = left - len(row.tokens)
            work.append(row)
            rows += 1
        return work

    def _homogeneous(self, active: list[Sequence], prefill_budget: int | None = None,
                     force_prefill: bool = False, decode_only: bool = False,
                     toll: int = 0, ratio: float = 0.0) -> list[IterationWork]:
        """A prefill plan or a decode-only plan (§2.4); the slack rule forces one or the other
        and may bound the prefill tokens and charge each prefill row after the first a toll."""
        has_prefill = any(self._prefill_pending(s) for s in active)
        has_live_decode = any(self._live_decode(s) for s in active)
        max_consecutive = self._config.max_consecutive_prefill_iterations
        run_prefill = has_prefill and (
            not has_live_decode or max_consecutive is None
            or self.consecutive_prefill < max_consecutive)
        if force_prefill or decode_only:
            run_prefill = force_prefill
        budget = self._config.max_tokens_per_iteration
        if prefill_budget is not None:
            budget = min(budget, prefill_budget)
        work: list[IterationWork] = []
        if run_prefill:
            work = self._fill_prefill(active, budget, toll, ratio)
        else:
            for s in active:
                if budget == 0:
                    break
                if not self._prefill_pending(s) and self._live_decode(s):
                    work.append(self._decode_row(s))
                    budget -= 1
        if any(w.phase is not IterationPhase.DECODE for w in work):
            self.consecutive_prefill = sat(self.consecutive_prefill + 1) if has_live_decode else 0
        elif work:
            self.consecutive_prefill = 0
        return work

    def _mixed(self, active: list[Sequence], prefill_cap: int = USIZE_MAX,
               toll: int = 0, ratio: float = 0.0) -> list[IterationWork]:
        n = len(active)
        budget = self._config.max_tokens_per_iteration
        work: list[IterationWork] = []
        start = self.mixed_cursor % n if n else 0
        examined = 0
        for offset in range(n):
            if budget == 0:
                break
            examined = offset + 1
            s = active[(start + offset) % n]
            if self._live_decode(s):
                work.append(self._decode_row(s))
                budget -= 1
        if n:
            self.mixed_cursor = (start + examined) % n
        work.extend(self._fill_prefill(active, min(budget, prefill_cap), toll, ratio))
        self.consecutive_prefill = 0
        return work

    # -- durations (§2.6) -------------------------------------------------------------------

    def observe(self, rows: tuple[IterationWork, ...], elapsed_us: float) -> None:
        """A decode-only plan updates the average for its row count; a mixed plan slower than
        that average by more than the allowed margin ends mixing for good."""
        if not math.isfinite(elapsed_us) or elapsed_us <= 0:
            return
        prefill_tokens = sum(len(w.tokens) for w in rows if w.phase is not IterationPhase.DECODE)
        decode_rows = sum(1 for w in rows if w.phase is IterationPhase.DECODE)
        if decode_rows == 0:
            return
        if prefill_tokens == 0:
            previous = self._decode_us_ewma.get(decode_rows, elapsed_us)
            self._decode_us_ewma[decode_rows] = previous + EWMA_ALPHA * (elapsed_us - previous)
            return
        predicted = self._decode_us_ewma.get(decode_rows)
        if predicted is None:
            return
        observed_extra = max(elapsed_us - predicted, 1.0)
        allowed = min(max(predicted * MIXED_SLOWDOWN_FRACTION, MIXED_MIN_EXTRA_US),
                      MIXED_MAX_EXTRA_US)
        if observed_extra > allowed:
            self.mixed_viable = False
