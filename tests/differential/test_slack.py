"""The slack-sized planning rule (behaviour.md §2.13) on the native core and the twin: both
must make the same plans, for any clock, cost model and per-sequence targets, on random
operation sequences; and on both, the interleave bound (at most k decode-only plans in a row
while prefill waits) and the starvation bound (the oldest admitted prefill gets a row within
k + 1 plans) hold. Beside disjoint plans in flight (§2.11a) the same holds, and the least slack
leaves out the sequences in flight, which the plan being made cannot give a row. Some examples
run the cold prefix hold (§2.3a) beside the rule, with a prefix store each that takes the
leaders' kept prompts (the first-token hold never holds a leader).
"""
import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from skippy_scheduler import (
    IterationPhase,
    IterationPrediction,
    MemoryComponent,
    PlanningRule,
    Scheduler,
    SchedulerConfig,
    Sequence,
    StepCost,
    TwinScheduler,
)
from skippy_scheduler.prefix_store import PrefixStore
from skippy_scheduler.reference import PrefixStoreTwin
from sched_helpers import TwinPair, complete

IDS = ["a", "b", "c", "d", "e", "f"]


def _settings(examples):
    profile = settings.get_current_profile_name()
    if profile != "default":
        return settings(settings.get_profile(profile), suppress_health_check=list(HealthCheck))
    return settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))


costs = st.builds(StepCost, base_us=st.sampled_from([0.0, 50.0, 2000.0]),
                  per_prefill_token_us=st.sampled_from([0.0, 1.0, 300.0, 1e4, 5e-324]),
                  decode_base_us=st.sampled_from([0.0, 100.0, 3000.0]),
                  per_decode_row_us=st.sampled_from([0.0, 20.0, 700.0]),
                  per_prefill_row_us=st.sampled_from([0.0, 0.0, 1.0, 650.0, 3000.0, 1e6]),
                  per_prefill_position_us=st.sampled_from([0.0, 0.0, 5.0, 400.0, 3e4, 1e9]))

configs = st.builds(
    SchedulerConfig,
    max_active_sequences=st.integers(1, 5),
    max_tokens_per_iteration=st.integers(1, 40),
    prefill_chunk_tokens=st.integers(1, 16),
    max_prefill_sequences_per_iteration=st.none() | st.integers(1, 2),
    mixed_prefill_decode=st.booleans(),  # ignored under the slack rule
    max_inflight_plans=st.sampled_from([1, 1, 2]),
    memory_components=st.sampled_from([[], [MemoryComponent("kv", 400, 0, 4, 8)]]),
    planning_rule=st.just(PlanningRule.SLACK),
    itl_target=st.sampled_from([0.001, 0.01, 0.05, 1.0]),
    slack_safety=st.sampled_from([0.5, 1.0, 1.2, 3.0]),
    slack_interleave_max=st.integers(0, 3),
    slack_min_chunk_tokens=st.integers(0, 12),
    step_cost=costs,
    # the prefill order's age bound: 0 = walk order, then small, the default, huge (pure SRPT)
    slack_prefill_age_max=st.sampled_from([0.0, 0.0005, 0.003, 0.05, 2.0, 1e9]),
    slack_first_token_hold=st.booleans(),
    cold_prefix_hold_tokens=st.sampled_from([0, 0, 0, 2, 4]),
    sequence_id_limit=st.just(40), reserved_sequence_ids=st.just(8),
)

submit = st.tuples(st.just("submit"), st.integers(0, len(IDS) - 1),
                   st.integers(1, 40),  # prompt length
                   st.integers(1, 6),  # max tokens
                   st.none() | st.sampled_from([0.002, 0.02, 0.5]),  # its own itl target
                   st.none() | st.sampled_from([0.001, 0.01, 0.1, 3.0]))  # its ttft deadline
step = st.tuples(st.just("step"), st.sampled_from([0.0, 0.0005, 0.003, 0.02, 0.2]),
                 st.integers(0, 9))
ops = st.lists(st.one_of(submit, step, step, step, step,
                         st.tuples(st.just("cost"), costs),
                         st.tuples(st.just("abort")),
                         st.tuples(st.just("cancel"), st.integers(0, len(IDS) - 1))),
               min_size=5, max_size=60)


class Pair(TwinPair):
    def __init__(self, config):
        super().__init__(Scheduler(config), TwinScheduler(config))
        self.now = 0.0
        self.prompts = {}
        self.stores = None
        if config.cold_prefix_hold_tokens:
            self.stores = (PrefixStore(64, 8, first_holder_id=32),
                           PrefixStoreTwin(64, 8, first_holder_id=32))
            for s, store in zip(self.scheds, self.stores):
                s.attach_prefix_store(store, prefill_cost_per_token=10)

    def keep(self, done):
        """What the engine does with a completion's prompt keeps: each store takes the prompt."""
        if self.stores is None or done[0][0] != "ok":
            return
        for sid, n in done[0][1].prompt_keeps:
            event("prompt kept")
            key = np.asarray(self.prompts[sid][:n], dtype=np.int32)
            self.both(lambda s, i: self.stores[i].insert(key) is not None)

    def check(self):
        super().check(IDS)


def run(pair, op):
    kind = op[0]
    if kind == "submit":
        _, k, prompt, max_tokens, itl, ttft = op
        # under the cold prefix hold, three ids share each prompt pattern (a burst's peers)
        pattern = k % 2 if pair.stores is not None else k
        seq = Sequence(IDS[k], [(pattern * 7 + j) % 5 for j in range(prompt)], max_tokens)
        seq.with_deadlines(ttft_deadline=None if ttft is None else pair.now + ttft,
                           itl_target=itl)
        if pair.both(lambda s, _: s.submit(seq))[0][0] == "ok":
            pair.prompts[IDS[k]] = seq.prompt_tokens
    elif kind == "cost":
        pair.both(lambda s, _: s.set_step_cost(op[1]))
    elif kind == "cancel":
        pair.both(lambda s, _: s.cancel(IDS[op[1]]))
    elif kind == "abort":
        if pair.live[0]:
            pair.both(lambda s, i: s.abort_iteration(pair.live[i][0]))
            pair.live = ([], [])
    elif kind == "step":
        _, elapsed, token = op
        pair.both(lambda s, _: s.set_clock(pair.now))
        plans = pair.both(lambda s, _: s.plan_iteration())
        if plans[0][0] != "ok":
            return
        pn, pt = plans[0][1], plans[1][1]
        assert pn.work == pt.work
        phases = {w.phase for w in pt.work}
        event("plan " + "+".join(sorted(p.name for p in phases)) if phases else "empty plan")
        pair.live = ([pn] + pair.live[0], [pt] + pair.live[1])
        depth = pair.scheds[1].config.max_inflight_plans
        if len(pair.live[0]) >= depth or len(pt) == 0:
            pair.now += elapsed
            pair.both(lambda s, _: s.set_clock(pair.now))
            pair.keep(pair.finish_oldest(token))
    pair.check()
    if pair.scheds[0].metrics().slo_relegated:
        event("a deadline relegated")
    if kind == "step" and pair.scheds[1].config.slack_first_token_hold and any(
            w.phase is IterationPhase.PREFILL and len(w.tokens) == 1 and w.sample_last
            for w in pt.work):
        event("a last prompt token alone")


@_settings(250)
@given(config=configs, first=st.lists(submit, min_size=1, max_size=4), operations=ops)
def test_native_and_twin_agree_under_the_slack_rule(config, first, operations):
    pair = Pair(config)
    for op in first + operations:
        run(pair, op)


disjoint_configs = st.builds(
    lambda c, depth: dataclasses.replace(c, max_inflight_plans=depth,
                                         disjoint_inflight_plans=True),
    configs, st.sampled_from([2, 3]))


@_settings(250)
@given(config=disjoint_configs, first=st.lists(submit, min_size=1, max_size=4), operations=ops)
def test_native_and_twin_agree_under_the_slack_rule_with_disjoint_plans(config, first,
                                                                       operations):
    pair = Pair(config)
    # A row of a sequence cancelled after its plan was made belongs to an ended sequence (the
    # id may be submitted again as a new one): per live plan, the ids cancelled since.
    ended: dict[int, set[str]] = {}
    for op in first + operations:
        if op[0] == "cancel":
            for plan in pair.live[0]:
                ended.setdefault(id(plan), set()).add(IDS[op[1]])
        run(pair, op)
        live = {id(plan) for plan in pair.live[0]}  # a retired plan's id may be reused
        ended = {k: v for k, v in ended.items() if k in live}
        for plans in zip(*pair.live):  # §2.11a still holds: live plans hold disjoint sequences
            assert plans[0].work == plans[1].work
        ids = [w.sequence_id for plan in pair.live[0] for w in plan.work
               if w.sequence_id not in ended.get(id(plan), ())]
        assert len(ids) == len(set(ids))


# -- the bounds, on each implementation --------------------------------------------------------

@pytest.fixture(params=[Scheduler, TwinScheduler], ids=["native", "twin"])
def impl(request):
    return request.param


def _config(**overrides):
    base = dict(planning_rule=PlanningRule.SLACK, max_tokens_per_iteration=64,
                prefill_chunk_tokens=32, slack_min_chunk_tokens=8, slack_interleave_max=3,
                itl_target=0.001, step_cost=StepCost(base_us=2000, per_prefill_token_us=300,
                                                     decode_base_us=0, per_decode_row_us=500))
    base.update(overrides)
    return SchedulerConfig(**base)


def _run_late(impl, k, steps=120):
    """Three long decodes whose target (1 ms) is far below a step (10 ms): no chunk ever fits
    the slack. Two 60-token prompts arrive at steps 2 and 3. Per plan: (the prefill-pending
    ids before it, in walk order; its rows as (id, phase, tokens))."""
    sched = impl(_config(slack_interleave_max=k))
    arrivals = {0: [Sequence(f"d{i}", [1, 2], 200) for i in range(3)],
                2: [Sequence("p1", list(range(60)), 2)], 3: [Sequence("p2", list(range(60)), 2)]}
    now = 0.0
    history = []
    for i in range(steps):
        for seq in arrivals.get(i, []):
            sched.submit(seq)
        sched.set_clock(now)
        plan = sched.plan_iteration()
        pending = [sid for sid in sched.snapshot().active_ids
                   if (q := sched.sequence(sid)).prefill_cursor < q.recompute_token_count()]
        rows = [(w.sequence_id, w.phase, len(w.tokens)) for w in plan.work]
        # the ids whose prefill was pending before the plan: pending now, or given a chunk
        before = [sid for sid, p, _ in rows if p is not IterationPhase.DECODE] + pending
        history.append((before, rows))
        now += 0.01
        sched.set_clock(now)
        complete(sched, plan, [IterationPrediction(r, 3) for r, w in enumerate(plan.work)
                               if w.sample_last])
    return history


@pytest.mark.parametrize("k", [0, 1, 3])
def test_interleave_and_starvation_bounds(impl, k):
    history = _run_late(impl, k)
    run = 0
    gaps = {"p1": 0, "p2": 0}
    contended = 0
    for before, rows in history:
        decode = [sid for sid, p, _ in rows if p is IterationPhase.DECODE]
        chunked = {sid: n for sid, p, n in rows if p is not IterationPhase.DECODE}
        if not before or not decode and not chunked:
            run = 0
            continue
        if before and (decode or any(sid.startswith("d") for sid, _, _ in rows)):
            contended += 1
        if chunked:
            run = 0
            if decode:  # forced: the smallest useful chunk, to the oldest prefill first
                assert sum(chunked.values()) == 8
                assert next(iter(chunked)) == before[0]
        else:
            run += 1
            assert run <= k  # the interleave bound
        for sid in gaps:
            if sid in before:
                gaps[sid] = 0 if sid in chunked else gaps[sid] + 1
        oldest = before[0]
        assert gaps.get(oldest, 0) <= k  # the starvation bound on the oldest admitted prefill
    assert contended > 10
    # both prompts got through prefill although no chunk ever fit the slack
    decoded = {sid for _, rows in history for sid, p, _ in rows if p is IterationPhase.DECODE}
    assert {"p1", "p2"} <= decoded


def test_chunk_fills_the_slack(impl):
    """With a generous target the chunk is the largest whose predicted time × safety fits."""
    cost = StepCost(base_us=1000, per_prefill_token_us=100, decode_base_us=0,
                    per_decode_row_us=1000)
    sched = impl(_config(itl_target=0.05, slack_safety=1.25, step_cost=cost,
                         max_tokens_per_iteration=1000, prefill_chunk_tokens=1000))
    sched.set_clock(0.0)
    sched.submit(Sequence("d", [1, 2], 100))
    plan = sched.plan_iteration()
    complete(sched, plan, [IterationPrediction(0, 5)])  # d's first token at t = 0
    sched.submit(Sequence("p", list(range(900)), 2))
    sched.set_clock(0.002)  # 2 ms later: slack 48 ms, /1.25 = 38.4 ms
    plan = sched.plan_iteration()
    tokens = {w.sequence_id: len(w.tokens) for w in plan.work}
    # 38 400 µs - (1000 base + 1000 per row) = 36 400 µs of prefill at 100 µs a token
    assert tokens == {"d": 1, "p": 364}


def test_prefill_alone_when_mixing_does_not_pay(impl):
    """With no per-step base cost a mixed step saves nothing: the chunk runs alone, sized so
    the decode step after it still fits."""
    cost = StepCost(base_us=0, per_prefill_token_us=100, decode_base_us=0, per_decode_row_us=1000)
    sched = impl(_config(itl_target=0.05, slack_safety=1.0, step_cost=cost,
                         max_tokens_per_iteration=1000, prefill_chunk_tokens=1000))
    sched.set_clock(0.0)
    sched.submit(Sequence("d", [1, 2], 100))
    plan = sched.plan_iteration()
    complete(sched, plan, [IterationPrediction(0, 5)])
    sched.submit(Sequence("p", list(range(900)), 2))
    sched.set_clock(0.0)
    plan = sched.plan_iteration()
    assert [(w.sequence_id, len(w.tokens)) for w in plan.work] == [("p", 490)]


def _sample_all(sched, plan):
    return complete(sched, plan, [IterationPrediction(r, 5) for r, w in enumerate(plan.work)
                                  if w.sample_last])


def test_sequences_in_flight_do_not_count_toward_the_least_slack(impl):
    """Disjoint plans at depth 2: "a" is in flight with its slack long spent; the plan being
    made cannot give it a row, so a's slack does not decide it: "b" has 10 ms of slack, and
    the plan mixes b's decode row with the chunk that fits (counting a, it is decode only)."""
    cost = StepCost(base_us=1000, per_prefill_token_us=100, decode_base_us=0,
                    per_decode_row_us=1000)
    sched = impl(_config(itl_target=0.05, slack_safety=1.25, step_cost=cost,
                         max_tokens_per_iteration=1000, prefill_chunk_tokens=1000,
                         max_inflight_plans=2, disjoint_inflight_plans=True))
    sched.set_clock(0.0)
    sched.submit(Sequence("a", [1, 2], 100))
    sched.submit(Sequence("b", [3, 4], 100))
    _sample_all(sched, sched.plan_iteration())  # both prefilled, first tokens at 0
    first = sched.plan_iteration()  # the share: one decode row a plan
    sched.set_clock(0.1)
    second = sched.plan_iteration()
    assert [[w.sequence_id for w in p.work] for p in (first, second)] == [["a"], ["b"]]
    _sample_all(sched, first)  # a stamped at 0.1
    sched.set_clock(0.2)
    _sample_all(sched, second)  # b stamped at 0.2
    assert [w.sequence_id for w in sched.plan_iteration().work] == ["a"]  # a in flight
    sched.set_clock(0.24)  # a: 90 ms past its target; b: 10 ms of slack, / 1.25 = 8 ms
    sched.submit(Sequence("p", list(range(900)), 2))
    plan = sched.plan_iteration()
    # 8 000 µs - (1000 base + 1000 per row) = 6 000 µs of prefill at 100 µs a token
    assert [(w.sequence_id, len(w.tokens)) for w in plan.work] == [("b", 1), ("p", 60)]


def test_a_first_token_in_flight_does_not_spend_the_slack(impl):
    """Plans in flight (depth 2): "p" is admitted at 0 and its 2 000-token prompt takes two
    plans; the second, which samples its first token, is still in flight at 0.3 s when the next
    plan is made. p's stamp is still its admission (300 ms ago against a 50 ms target), but its
    gap has not begun: the plan mixes p's decode row with the chunk of "q" that p's whole target
    leaves (counting the admission stamp, the slack is spent and the plan is p's row alone)."""
    cost = StepCost(base_us=1000, per_prefill_token_us=100, decode_base_us=0,
                    per_decode_row_us=1000)
    sched = impl(_config(itl_target=0.05, slack_safety=1.25, step_cost=cost,
                         max_tokens_per_iteration=1000, prefill_chunk_tokens=1000,
                         max_inflight_plans=2))
    sched.set_clock(0.0)
    sched.submit(Sequence("p", list(range(1, 2001)), 10))
    first = sched.plan_iteration()
    second = sched.plan_iteration()
    sched.submit(Sequence("q", list(range(900)), 2))
    assert [(w.sequence_id, len(w.tokens)) for w in first.work] == [("p", 1000)]
    assert [(w.sequence_id, len(w.tokens), w.sample_last) for w in second.work] == \
        [("p", 1000, True)]
    sched.set_clock(0.3)
    _sample_all(sched, first)
    third = sched.plan_iteration()  # p's first token still in flight (the second plan)
    # 50 ms / 1.25 = 40 ms; 40 000 - (1000 base + 1000 for p's row) = 38 000 µs of prefill at
    # 100 µs a token
    assert [(w.sequence_id, len(w.tokens)) for w in third.work] == [("p", 1), ("q", 380)]


def _two_pending(impl, per_row_us, base_us=1000.0, per_token_us=100.0):
    """A live decode "d" and two 20-token prompts pending; a generous target: the chunk budget
    (the whole 60-token room) covers both prompts. The plan's rows as (id, tokens)."""
    cost = StepCost(base_us=base_us, per_prefill_token_us=per_token_us, decode_base_us=0,
                    per_decode_row_us=1000, per_prefill_row_us=per_row_us)
    sched = impl(_config(itl_target=1.0, slack_safety=1.0, step_cost=cost,
                         max_tokens_per_iteration=61, prefill_chunk_tokens=60))
    sched.set_clock(0.0)
    sched.submit(Sequence("d", [1, 2], 100))
    _sample_all(sched, sched.plan_iteration())
    sched.submit(Sequence("p1", list(range(20)), 2))
    sched.submit(Sequence("p2", list(range(20)), 2))
    plan = sched.plan_iteration()
    return [(w.sequence_id, len(w.tokens)) for w in plan.work]


def test_each_further_prefill_row_pays_the_toll(impl):
    """§2.13: a prefill row after the first costs ceil(per_prefill_row_us /
    per_prefill_token_us) tokens of the budget and starts only with the minimum chunk left."""
    both = [("d", 1), ("p1", 20), ("p2", 20)]
    assert _two_pending(impl, 0.0) == both  # no toll: as the rule always planned
    assert _two_pending(impl, 1500.0) == both  # toll 15: 60 - 20 - 15 = 25 left for p2
    # toll 33 (ceil 32.01): 40 - 33 = 7 left, under the 8-token minimum chunk: p2 waits
    assert _two_pending(impl, 3201.0) == [("d", 1), ("p1", 20)]
    # toll 32: exactly the minimum chunk left for p2
    assert _two_pending(impl, 3200.0) == [("d", 1), ("p1", 20), ("p2", 8)]
    assert _two_pending(impl, 1e9) == [("d", 1), ("p1", 20)]  # only the first


def test_toll_applies_to_prefill_only_steps(impl):
    """No base cost: mixing saves nothing, the chunk runs alone; the toll still applies."""
    assert _two_pending(impl, 0.0, base_us=0.0) == [("p1", 20), ("p2", 20)]
    assert _two_pending(impl, 1500.0, base_us=0.0) == [("p1", 20), ("p2", 20)]
    assert _two_pending(impl, 1e6, base_us=0.0) == [("p1", 20)]


def test_a_row_cost_with_free_tokens_admits_one_prefill_row(impl):
    assert _two_pending(impl, 0.0, per_token_us=0.0) == [("d", 1), ("p1", 20), ("p2", 20)]
    assert _two_pending(impl, 1.0, per_token_us=0.0) == [("d", 1), ("p1", 20)]


def test_reference_rule_ignores_the_row_cost(impl):
    """The reference rule's plans never pay the toll (the lab's outputs stay as they were)."""
    cost = StepCost(per_prefill_row_us=1e9)
    sched = impl(SchedulerConfig(max_tokens_per_iteration=64, prefill_chunk_tokens=32,
                                 step_cost=cost))
    sched.submit(Sequence("p1", list(range(20)), 2))
    sched.submit(Sequence("p2", list(range(20)), 2))
    assert [(w.sequence_id, len(w.tokens)) for w in sched.plan_iteration().work] == [
        ("p1", 20), ("p2", 20)]


def test_set_step_cost_carries_the_row_cost(impl):
    sched = impl(_config())
    cost = StepCost(base_us=1000, per_prefill_token_us=100, per_prefill_row_us=1e9)
    sched.set_step_cost(cost)
    assert sched.step_cost == cost
    assert sched.step_cost.per_prefill_row_us == 1e9


def test_predict_charges_each_further_prefill_row():
    cost = StepCost(base_us=1000, per_prefill_token_us=10, decode_base_us=200,
                    per_decode_row_us=50, per_prefill_row_us=7000)
    assert cost.predict_us(30, 0) == cost.predict_us(30, 0, prefill_rows=1) == 1300
    assert cost.predict_us(30, 0, prefill_rows=0) == 1300
    assert cost.predict_us(30, 4, prefill_rows=3) == 1000 + 300 + 14000 + 200 + 200


def _deep_prefill(impl, per_position_us, prompt=900, chunk_tokens=1000):
    """A live decode "d" (its token at t = 0) and a long prompt "p"; at t = 2 ms each step has
    38.4 ms of slack (target 50 ms, safety 1.25). Returns (scheduler, cost, the plans' rows as
    (id, tokens, first position) step by step, each plan's prefill positions)."""
    cost = StepCost(base_us=1000, per_prefill_token_us=100, decode_base_us=0,
                    per_decode_row_us=1000, per_prefill_position_us=per_position_us)
    sched = impl(_config(itl_target=0.05, slack_safety=1.25, step_cost=cost,
                         max_tokens_per_iteration=1000, prefill_chunk_tokens=chunk_tokens))
    sched.set_clock(0.0)
    sched.submit(Sequence("d", [1, 2], 100))
    complete(sched, sched.plan_iteration(), [IterationPrediction(0, 5)])
    sched.submit(Sequence("p", list(range(prompt)), 2))
    steps = []
    for _ in range(3):
        sched.set_clock(0.002)
        plan = sched.plan_iteration()
        steps.append(([(w.sequence_id, len(w.tokens), w.positions[0]) for w in plan.work],
                      plan.prefill_positions))
        sched.set_clock(0.0)  # d's next token stamped at 0 again: the same slack next step
        _sample_all(sched, plan)
    return sched, cost, steps


def test_position_cost_shortens_chunks_deep_in_a_prompt(impl):
    """§2.13: with a cost per prefill token per thousand positions before it, each chunk is
    the longest whose predicted step (the model's own prediction, positions included) fits
    the slack, so chunks further into the prompt are shorter."""
    _, cost, steps = _deep_prefill(impl, 200.0)
    avail = 38400.0
    starts, chunks = [], []
    for rows, positions in steps:
        (did, dn, _), (pid, n, start) = rows
        assert (did, dn, pid) == ("d", 1, "p")
        assert positions == n * start + n * (n - 1) // 2
        assert cost.predict_us(n, 1, 1, positions) <= avail
        longer = (n + 1) * start + (n + 1) * n // 2
        assert cost.predict_us(n + 1, 1, 1, longer) > avail  # one more token would not fit
        starts.append(start)
        chunks.append(n)
    assert starts == [0, chunks[0], chunks[0] + chunks[1]]
    assert chunks[0] < 364  # without the term: 364 (test_chunk_fills_the_slack)
    assert chunks[0] > chunks[1] > chunks[2]
    _, _, flat = _deep_prefill(impl, 0.0)
    assert [rows[1][1] for rows, _ in flat] == [364, 364, 172]


def test_position_cost_never_stalls_a_prompt(impl):
    """Even when one token past the prompt's start costs more than the whole budget (here 10^4
    tokens' worth per position), the prompt keeps its starvation bound: at most k = 3
    decode-only steps in a row, then a prefill step that gives it at least one token."""
    sched, _, steps = _deep_prefill(impl, 1e9, prompt=12)
    given = [sum(n for sid, n, _ in rows if sid == "p") for rows, _ in steps]
    for _ in range(60):
        if sched.sequence("p").prefill_cursor == 12:
            break
        sched.set_clock(0.002)
        plan = sched.plan_iteration()
        given.append(sum(len(w.tokens) for w in plan.work if w.sequence_id == "p"))
        sched.set_clock(0.0)
        _sample_all(sched, plan)
    assert sched.sequence("p").prefill_cursor == 12
    run = 0
    for n in given:
        run = run + 1 if n == 0 else 0
        assert run <= 3
    assert given.count(1) >= 11  # one token a step once past position 0


def test_prefill_positions_of_a_plan(impl):
    """The plan's prefill positions: its prefill and recompute tokens' positions summed; the
    decode rows do not count."""
    _, _, steps = _deep_prefill(impl, 0.0, chunk_tokens=100)
    for rows, positions in steps:
        assert positions == sum(n * start + n * (n - 1) // 2 for sid, n, start in rows
                                if sid == "p")
    assert steps[1][1] == sum(range(100, 200))


def test_predict_charges_prefill_positions():
    cost = StepCost(base_us=1000, per_prefill_token_us=10, per_prefill_position_us=500)
    assert cost.predict_us(30, 0) == 1300  # positions default to none
    assert cost.predict_us(30, 0, 1, 4000) == 1000 + 300 + 2000


def test_reference_rule_is_the_default(impl):
    assert SchedulerConfig().planning_rule is PlanningRule.REFERENCE


@pytest.mark.parametrize("bad", [
    dict(itl_target=0), dict(itl_target=-1.0), dict(itl_target=math.inf),
    dict(itl_target=1e305),  # finite in seconds, not in the core's µs
    dict(slack_safety=0.0), dict(slack_safety=math.nan), dict(planning_rule=1),
    dict(step_cost=(1, 2, 3, 4)),
])
def test_bad_slack_config_is_refused(bad):
    with pytest.raises((TypeError, ValueError)):
        SchedulerConfig(**bad)


@pytest.mark.parametrize("bad", [dict(base_us=-1.0), dict(per_prefill_token_us=math.inf),
                                 dict(per_decode_row_us=math.nan), dict(decode_base_us="1"),
                                 dict(per_prefill_row_us=-1.0), dict(per_prefill_row_us=math.inf),
                                 dict(per_prefill_row_us=math.nan),
                                 dict(per_prefill_position_us=-1.0),
                                 dict(per_prefill_position_us=math.inf),
                                 dict(per_prefill_position_us=math.nan),
                                 dict(per_prefill_position_us=True)])
def test_bad_step_cost_is_refused(bad):
    with pytest.raises((TypeError, ValueError)):
        StepCost(**bad)


def test_bad_deadlines_are_refused_before_any_change(impl):
    s = Sequence("x", [1], 3)
    for kw in (dict(itl_target=0), dict(ttft_deadline=-1.0), dict(itl_target=math.nan),
               dict(ttft_deadline=1e305)):
        with pytest.raises(ValueError):
            s.with_deadlines(**kw)
    assert (s.itl_target, s.ttft_deadline) == (None, None)
    sched = impl(_config())
    with pytest.raises((TypeError, ValueError)):
        sched.set_clock(math.nan)
    with pytest.raises(TypeError):
        sched.set_step_cost((1.0, 2.0))
    assert sched.step_cost == _config().step_cost
