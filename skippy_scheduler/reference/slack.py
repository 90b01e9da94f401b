"""The reference form of the slack-sized planning rule (behaviour.md §2.13; C: csrc/sk_slack.c).

`SlackRule.decide` says what one step runs when prefill and live decode both wait: decode
only, a mixed step, or a prefill step alone, and how many prefill tokens it may carry. It keeps
the one counter the rule has (decode-only steps in a row while prefill waited). Every
expression is evaluated in the same order as the C core's, so both choose the same chunk bit
for bit.
"""
from __future__ import annotations

import enum
import math
import sys
from typing import Iterable

from ..slack import StepCost
from ..types import SchedulerConfig


class SlackStep(enum.Enum):
    DECODE_ONLY = 0
    MIXED = 1
    PREFILL_ONLY = 2


def largest_chunk(spare_us: float, per_token_us: float, room: int) -> int:
    """Largest chunk whose prefill time fits in `spare_us`, at most `room` tokens."""
    if not spare_us >= 0.0:
        return 0
    if per_token_us <= 0.0:
        return room
    chunk = spare_us / per_token_us  # C: floor first; the same, and an infinite one fits
    return room if chunk >= room else int(math.floor(chunk))


def toll_tokens(cost: StepCost, max_tokens: int) -> int:
    """Tokens of the prefill budget each prefill row after the first pays for its own pass
    (C: sk_slack_toll): ceil(per_prefill_row_us / per_prefill_token_us), at most `max_tokens`
    (which no budget exceeds, so no second row), and `max_tokens` when only the row costs."""
    row, per_token = cost.per_prefill_row_us, cost.per_prefill_token_us
    if not row > 0.0:
        return 0
    if not per_token > 0.0:
        return max_tokens
    toll = row / per_token  # C: ceil first; the same, and no overflow of an infinite ratio
    return max_tokens if toll >= float(max_tokens) else math.ceil(toll)


def position_ratio(cost: StepCost) -> float:
    """Token equivalents each prefill token pays per position before it (C:
    sk_slack_position_ratio): per_prefill_position_us / (1000 × per_prefill_token_us), 0 when
    either is 0."""
    q, per_token = cost.per_prefill_position_us, cost.per_prefill_token_us
    if not q > 0.0 or not per_token > 0.0:
        return 0.0
    ratio = q / (1000.0 * per_token)
    return ratio if ratio <= sys.float_info.max else sys.float_info.max  # finite: × 0 stays 0


def position_equivalents(start: int, count: int, ratio: float) -> float:
    """Token equivalents of `count` tokens from position `start`."""
    positions = float(count) * float(start) + float(count * (count - 1) // 2)
    return float(count) + ratio * positions


def position_chunk(start: int, budget: int, ratio: float) -> int:
    """Longest chunk from `start` whose token equivalents fit in `budget` (C:
    sk_slack_position_chunk): the quadratic's root, then checked one token either way."""
    if budget == 0:
        return 0
    b = float(budget)
    lin = 1.0 + ratio * (float(start) - 0.5)
    root = 2.0 * b / (lin + math.sqrt(lin * lin + 2.0 * ratio * b))
    chunk = budget if root >= b else int(math.floor(root)) if root >= 0.0 else 0
    while chunk < budget and position_equivalents(start, chunk + 1, ratio) <= b:
        chunk += 1
    while chunk > 0 and position_equivalents(start, chunk, ratio) > b:
        chunk -= 1
    return chunk


def position_charge(start: int, count: int, ratio: float, cap: int) -> int:
    """What `count` tokens from `start` take from the budget: their equivalents rounded up, at
    most `cap` (C: sk_slack_position_charge)."""
    charge = position_equivalents(start, count, ratio)
    return cap if charge >= float(cap) else math.ceil(charge)


class SlackRule:
    """The rule's state: the clock (µs), the cost model and the interleave counter."""

    def __init__(self, config: SchedulerConfig) -> None:
        self._config = config
        self.now_us = 0.0
        self.cost: StepCost = config.step_cost
        self.interleaved = 0

    def min_slack_us(self, rows: Iterable[tuple[float, float | None]]) -> float:
        """Minimum over live decode rows of (previous token µs + target µs − now); each row is
        (its last-token µs, its own target in seconds or None)."""
        target = self._config.itl_target * 1e6
        now = self.now_us
        least = math.inf
        for last_us, own in rows:
            slack = last_us + (own * 1e6 if own is not None else target) - now
            if slack < least:
                least = slack
        return least

    def decide(self, min_slack: float, decode_rows: int, ratio: float = 0.0,
               first_start: int = 0) -> tuple[SlackStep, int]:
        """What the step runs and its prefill budget; under a position cost (`ratio` > 0) the
        budget is in token equivalents and the smallest useful chunk is counted in tokens of the
        first row, which starts at `first_start`."""
        cfg = self._config
        cost = self.cost
        base, per_token = cost.base_us, cost.per_prefill_token_us
        decode_part = cost.decode_base_us + cost.per_decode_row_us * float(decode_rows)
        decode_us = base + decode_part
        avail = min_slack / cfg.slack_safety
        min_chunk, max_tokens = cfg.slack_min_chunk_tokens, cfg.max_tokens_per_iteration
        mixed_room = max_tokens - decode_rows
        probe = float(min_chunk)
        mix = (mixed_room >= min_chunk
               and base + per_token * probe + decode_part < decode_us + (base + per_token * probe))
        if mix:
            chunk = largest_chunk(avail - decode_us, per_token, mixed_room)
        else:
            chunk = largest_chunk(avail - decode_us - base, per_token, max_tokens)
        kind = SlackStep.MIXED if mix else SlackStep.PREFILL_ONLY
        usable = position_chunk(first_start, chunk, ratio) if ratio > 0.0 else chunk
        if usable < min_chunk:
            if self.interleaved < cfg.slack_interleave_max:
                self.interleaved += 1
                return SlackStep.DECODE_ONLY, 0
            # the starvation bound: a prefill step now, of min_chunk tokens of its first row
            chunk = min_chunk
            if ratio > 0.0:
                chunk = position_charge(first_start, min_chunk, ratio, max_tokens)
        self.interleaved = 0
        return kind, chunk

    def position_ratio(self) -> float:
        """This step's `position_ratio` of the current cost model."""
        return position_ratio(self.cost)

    def toll(self) -> int:
        """This step's per-row toll (`toll_tokens` of the current cost model)."""
        return toll_tokens(self.cost, self._config.max_tokens_per_iteration)
