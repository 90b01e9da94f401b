"""The cold prefix hold (behaviour.md §2.3a) on the native core and the twin: with their own
prefix stores, both must hold the same waiting sequences, report the same leaders' prompts, and
make the same plans, on random operation sequences (bursts of shared-prefix prompts of mixed
priorities, steps whose keeps insert the reported prompts or not, evictions, unrelated
inserts, cancels, memory preemption, aborts, plans in flight), with and without preemption
for priority (§2.8a).
"""
import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from skippy_scheduler import (
    MemoryComponent,
    Scheduler,
    SchedulerConfig,
    Sequence,
    TwinScheduler,
)
from skippy_scheduler.prefix_store import PrefixStore
from skippy_scheduler.reference import PrefixStoreTwin
from sched_helpers import TwinPair

IDS = [f"s{i}" for i in range(8)]
HEADS = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 9, 9, 9], [4, 4, 4, 4]]


def _settings(examples):
    profile = settings.get_current_profile_name()
    if profile != "default":
        return settings(settings.get_profile(profile), suppress_health_check=list(HealthCheck))
    return settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))


def config_strategy(lanes=st.integers(1, 6), hold=st.sampled_from([0, 1, 2, 2, 4, 7]),
                    depth=st.sampled_from([1, 1, 2])):
    return st.builds(
        SchedulerConfig,
        max_active_sequences=lanes,
        max_tokens_per_iteration=st.integers(2, 40),
        prefill_chunk_tokens=st.integers(1, 12),
        mixed_prefill_decode=st.booleans(),
        max_inflight_plans=depth,
        memory_components=st.sampled_from([[], [MemoryComponent("kv", 300, 0, 4, 8)]]),
        cold_prefix_hold_tokens=hold,
        cold_prefix_hold_max_steps=st.sampled_from([0, 1, 3, 64, 64]),
        priority_preemption=st.booleans(),
        sequence_id_limit=st.just(40), reserved_sequence_ids=st.just(8),
    )


configs = config_strategy()

submit = st.tuples(st.just("submit"), st.integers(0, len(IDS) - 1),
                   st.integers(0, len(HEADS) - 1),  # its head
                   st.sampled_from([8, 8, 8, 6, 3, 0]),  # head tokens kept
                   st.integers(0, 4),  # own tail tokens
                   st.integers(1, 5),  # max tokens
                   st.sampled_from([0, 0, 1, 3]))  # priority
step = st.tuples(st.just("step"), st.integers(0, 9), st.booleans())  # token, keep reports
ops = st.lists(st.one_of(submit, submit, step, step, step, step,
                         st.tuples(st.just("evict")),
                         st.tuples(st.just("insert"), st.integers(0, 3)),
                         st.tuples(st.just("abort")),
                         st.tuples(st.just("preempt"), st.integers(0, 400)),
                         st.tuples(st.just("cancel"), st.integers(0, len(IDS) - 1))),
               min_size=5, max_size=70)


class Pair(TwinPair):
    def __init__(self, config):
        super().__init__(Scheduler(config), TwinScheduler(config))
        self.stores = (PrefixStore(64, 8, first_holder_id=32),
                       PrefixStoreTwin(64, 8, first_holder_id=32))
        for s, store in zip(self.scheds, self.stores):
            s.attach_prefix_store(store, prefill_cost_per_token=10)
        self.prompts = {}

    def check(self):
        super().check(IDS)


def run(pair, op):
    kind = op[0]
    if kind == "submit":
        _, k, head, kept, tail, max_tokens, priority = op
        prompt = HEADS[head][:kept] + [10 + k + j for j in range(tail)] or [k + 20]
        seq = Sequence(IDS[k], prompt, max_tokens, priority=priority)
        if pair.both(lambda s, _: s.submit(seq))[0][0] == "ok":
            pair.prompts[IDS[k]] = prompt
    elif kind == "evict":
        pair.both(lambda s, i: pair.stores[i].evict_one() is not None)
    elif kind == "insert":  # a key no prompt shares: the store changes (its epoch moves)
        key = np.asarray([99, 98, 97 + op[1]], dtype=np.int32)
        pair.both(lambda s, i: pair.stores[i].insert(key) is not None)
    elif kind == "cancel":
        pair.both(lambda s, _: s.cancel(IDS[op[1]]))
    elif kind == "preempt":
        if not pair.live[0]:
            pair.both(lambda s, _: s.preempt_for_component_pressure([op[1]]))
    elif kind == "abort":
        if pair.live[0]:
            pair.both(lambda s, i: s.abort_iteration(pair.live[i][0]))
            pair.live = ([], [])
    elif kind == "step":
        _, token, keep = op
        plans = pair.both(lambda s, _: s.plan_iteration())
        if plans[0][0] != "ok":
            return
        pn, pt = plans[0][1], plans[1][1]
        assert pn.work == pt.work
        pair.live = ([pn] + pair.live[0], [pt] + pair.live[1])
        depth = pair.scheds[1].config.max_inflight_plans
        if len(pair.live[0]) >= depth or len(pt) == 0:
            done = pair.finish_oldest(token)
            keeps = done[0][1].prompt_keeps if done[0][0] == "ok" else ()
            if keeps:
                event("prompt kept")
                if any(len(pair.scheds[1].sequence(sid).generated_tokens) > 1 for sid, _ in keeps):
                    event("a decoding leader's prompt kept")
            if keep:
                for sid, n in keeps:
                    key = np.asarray(pair.prompts[sid][:n], dtype=np.int32)
                    pair.both(lambda s, i: pair.stores[i].insert(key) is not None)
    pair.check()


@_settings(300)
@given(config=configs, first=st.lists(submit, min_size=2, max_size=8), operations=ops)
def test_native_and_twin_agree_under_the_cold_prefix_hold(config, first, operations):
    pair = Pair(config)
    # a burst, the random operations, then steps enough to run most of it out
    for op in first + operations + [("step", 3, True)] * 12:
        run(pair, op)


@_settings(200)
@given(config=config_strategy(lanes=st.integers(2, 6), hold=st.sampled_from([1, 2, 4, 7]),
                              depth=st.sampled_from([1, 2, 3])),
       head=st.integers(0, len(HEADS) - 1), lead_tokens=st.integers(6, 20),
       steps=st.integers(1, 10),
       operations=st.lists(st.one_of(submit, step, step, st.tuples(st.just("evict")),
                                     st.tuples(st.just("insert"), st.integers(0, 3)),
                                     st.tuples(st.just("preempt"), st.integers(0, 400))),
                           min_size=5, max_size=40))
def test_native_and_twin_agree_when_peers_come_while_the_leader_decodes(config, head,
                                                                         lead_tokens, steps,
                                                                         operations):
    """Late leaders (§2.3a): a long-running request of one head, some steps, then submits of
    that head (mostly while it decodes) among steps, evictions and memory preemption."""
    pair = Pair(config)
    run(pair, ("submit", 7, head, 8, 1, lead_tokens, 0))
    operations = [(op[0], op[1], head) + op[3:] if op[0] == "submit" else op
                  for op in operations]
    for op in [("step", 1, True)] * steps + operations + [("step", 3, True)] * 12:
        run(pair, op)
