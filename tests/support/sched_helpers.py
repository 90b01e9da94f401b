"""Factories shared by the scheduler tests (behaviour.md §6 notation)."""
from skippy_scheduler import (
    CacheAffinity,
    IterationPrediction,
    PlanningRule,
    SchedulerConfig,
    Sequence,
    StageCacheAffinity,
    StepCost,
)


def make_scheduler(impl, admission=None, preemption=None, **config_overrides):
    """`impl(SchedulerConfig() + overrides)`, with optional policies."""
    kwargs = {}
    if admission is not None:
        kwargs["admission"] = admission
    if preemption is not None:
        kwargs["preemption"] = preemption
    return impl(SchedulerConfig(**config_overrides), **kwargs)


def seq(id, prompt_len, max_tokens, priority=1):
    """seq(id, P, M): prompt tokens 0..P-1, max_tokens M, priority 1, no sampling."""
    return Sequence(id, list(range(prompt_len)), max_tokens, None, priority)


def pred(index, token):
    return IterationPrediction(index, token)


def row_ids(plan):
    return [w.sequence_id for w in plan.work]


def row_sizes(plan):
    """(sequence id, tokens) of every row of `plan`."""
    return [(w.sequence_id, len(w.tokens)) for w in plan.work]


def seeded_prompt(n, seed):
    """n tokens that differ from seed to seed (no prefix shared between them)."""
    return [(seed * 7 + j) % 11 for j in range(n)]


def slack_order_config(**overrides):
    """The slack rule with a 10-token budget, 1 ms a step, 0.1 ms a prompt token, 1 ms a decode
    row, a 1 s target and no safety margin: the prefill order tests' scheduler."""
    base = dict(planning_rule=PlanningRule.SLACK, max_tokens_per_iteration=10,
                prefill_chunk_tokens=10, slack_min_chunk_tokens=4, itl_target=1.0,
                slack_safety=1.0, step_cost=StepCost(base_us=1000, per_prefill_token_us=100,
                                                     decode_base_us=0, per_decode_row_us=1000))
    base.update(overrides)
    return SchedulerConfig(**base)


def affinity(saved_per_token, matched=1):
    """One-stage affinity whose saved cost is matched × saved_per_token."""
    return CacheAffinity.from_stage(
        StageCacheAffinity(stage_index=0, matched_tokens=matched, prefill_cost_per_token=saved_per_token)
    )


def state(scheduler):
    """Everything observable about a scheduler's state, for unchanged-after-error checks."""
    snap = scheduler.snapshot()
    ids = list(snap.active_ids) + list(snap.waiting_ids)
    sequences = {i: scheduler.sequence(i) for i in ids}
    return snap, scheduler.metrics(), sequences


def complete(scheduler, plan, predictions=()):
    """Complete `plan` the way a host does: write `predictions` (IterationPrediction values or
    (work index, token) pairs) into its outputs block, then `complete_iteration(plan)`. A plan
    that is not live (or not a plan) is completed as it is, so the scheduler's error shows."""
    pairs = [(p.work_index, p.token) if isinstance(p, IterationPrediction) else tuple(p)
             for p in predictions]
    if getattr(plan, "live", False):
        out = plan.outputs
        for k, (index, token) in enumerate(pairs[: out.capacity]):
            out.request_indexes[k] = index
            out.predicted_tokens[k] = token
        out.count = len(pairs)
    return scheduler.complete_iteration(plan)


class TwinPair:
    """The native scheduler and its twin driven side by side (`scheds`): `both` runs one call
    on each (with the index 0 or 1) and requires the same outcome, or the same exception type;
    `check` requires the same snapshot, metrics and sequences of `ids`."""

    def __init__(self, native, twin):
        self.scheds = (native, twin)
        self.live = ([], [])  # each side's plans in flight, newest first

    def finish_oldest(self, token):
        """Complete the oldest plan in flight on both, every sampling row given `token` (9: the
        end signal, -1), require the same outcome (the telemetry included), drop it from
        `live`, and return both sides' outcomes."""
        oldest = (self.live[0][-1], self.live[1][-1])

        def finish(s, i):
            plan = oldest[i]
            return complete(s, plan, [IterationPrediction(r, -1 if token == 9 else token)
                                      for r, w in enumerate(plan.work) if w.sample_last])
        out = self.both(finish)
        if out[0][0] == "ok":
            assert out[0][1] == out[1][1]
        self.live = (self.live[0][:-1], self.live[1][:-1])
        return out

    def both(self, fn):
        out = []
        for i, s in enumerate(self.scheds):
            try:
                out.append(("ok", fn(s, i)))
            except Exception as exc:  # noqa: BLE001 - the type is compared
                out.append(("raised", type(exc)))
        assert out[0][0] == out[1][0], out
        if out[0][0] == "raised":
            assert out[0] == out[1]
        return out

    def check(self, ids):
        n, t = self.scheds
        assert n.snapshot() == t.snapshot()
        assert n.metrics() == t.metrics()
        for i in ids:
            assert n.sequence(i) == t.sequence(i)
