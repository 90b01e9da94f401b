"""Public types: config normalisation (§1.2, §6.4), memory formulas (§1.1), sequences (§1.3)."""
import numpy as np
import pytest

from skippy_scheduler import (
    AdmissionError,
    CacheAffinity,
    DuplicateSequence,
    EmptyPrompt,
    IterationPhase,
    IterationPrediction,
    MalformedOutputs,
    MemoryComponent,
    PrefixRestore,
    PrefixRestoreKind,
    QueueFull,
    SchedulerConfig,
    Sequence,
    SequenceStatus,
    StageCacheAffinity,
    StalePlanError,
)
from skippy_scheduler.sampling import SamplingParams

U64_MAX = (1 << 64) - 1


def test_enum_values_match_the_c_core():
    assert [p.value for p in IterationPhase] == [0, 1, 2]
    assert [p.name for p in IterationPhase] == ["PREFILL", "RECOMPUTE", "DECODE"]
    assert {s.name: s.value for s in SequenceStatus} == {
        "WAITING": 0, "RUNNING": 1, "PREEMPTED": 2, "FINISHED": 3, "FAILED": 4, "CANCELLED": 5,
    }
    assert [k.name for k in PrefixRestoreKind] == [
        "RESIDENT_KV", "RECURRENT_WHOLE_STATE", "KV_AND_RECURRENT_WHOLE_STATE"]


@pytest.mark.parametrize("old,member", [
    ("Prefill", IterationPhase.PREFILL), ("Decode", IterationPhase.DECODE),
    ("Preempted", SequenceStatus.PREEMPTED), ("Cancelled", SequenceStatus.CANCELLED),
    ("KvAndRecurrentWholeState", PrefixRestoreKind.KV_AND_RECURRENT_WHOLE_STATE)])
def test_old_member_spellings_are_deprecated_aliases(old, member):
    with pytest.warns(DeprecationWarning, match=f"use {type(member).__name__}.{member.name}"):
        assert getattr(type(member), old) is member
    with pytest.raises(AttributeError):
        getattr(type(member), old.upper() + "X")
    from skippy_scheduler.types import DEFAULT_SEQUENCE_ID_LIMIT

    assert DEFAULT_SEQUENCE_ID_LIMIT == SchedulerConfig().sequence_id_limit == 256


def test_config_defaults_are_the_table_and_already_normalized():
    c = SchedulerConfig()
    assert (c.max_active_sequences, c.sequence_id_limit, c.reserved_sequence_ids) == (32, 256, 16)
    assert (c.max_waiting_sequences, c.max_tokens_per_iteration, c.prefill_chunk_tokens) == (256, 2048, 256)
    assert c.max_prefill_sequences_per_iteration is None and c.max_consecutive_prefill_iterations is None
    assert (c.mixed_prefill_decode, c.cache_aging_cost_per_iteration, c.group_waiting_prefixes) == (False, 4096, True)
    assert c.iteration_interval == 0.002 and c.memory_components == []
    assert c.normalized() == c


def test_config_all_zero_normalization_example():
    c = SchedulerConfig(
        max_active_sequences=0, reserved_sequence_ids=300, max_waiting_sequences=0, max_tokens_per_iteration=0,
        prefill_chunk_tokens=9999, max_prefill_sequences_per_iteration=0, max_consecutive_prefill_iterations=0,
        cache_aging_cost_per_iteration=0,
    )
    n = c.normalized()
    assert (n.max_active_sequences, n.max_waiting_sequences, n.max_tokens_per_iteration) == (1, 1, 1)
    assert (n.prefill_chunk_tokens, n.max_prefill_sequences_per_iteration) == (1, 1)
    assert (n.max_consecutive_prefill_iterations, n.cache_aging_cost_per_iteration) == (1, 1)
    assert n.reserved_sequence_ids == 300
    # The constructor stores values as given.
    assert c.max_active_sequences == 0 and c.prefill_chunk_tokens == 9999


def test_hard_sequence_limit_accounts_for_reserved_ids():
    c = SchedulerConfig(max_active_sequences=U64_MAX, reserved_sequence_ids=24)
    assert c.normalized().max_active_sequences == 232


def test_sequence_id_limit_raises_the_hard_cap():
    c = SchedulerConfig(max_active_sequences=5000, sequence_id_limit=1024)
    assert c.normalized().max_active_sequences == 1008
    assert SchedulerConfig(sequence_id_limit=0).normalized().sequence_id_limit == 1
    assert SchedulerConfig(max_active_sequences=10, sequence_id_limit=20).normalized().max_active_sequences == 4


def test_prefill_chunk_is_clamped_to_the_iteration_budget():
    n = SchedulerConfig(max_tokens_per_iteration=100, prefill_chunk_tokens=500).normalized()
    assert n.prefill_chunk_tokens == 100


def test_config_replace_and_equality():
    c = SchedulerConfig()
    d = c.replace(max_active_sequences=4)
    assert d.max_active_sequences == 4 and c.max_active_sequences == 32
    assert d != c and d.replace(max_active_sequences=32) == c


@pytest.mark.parametrize(
    "field, value, error",
    [
        ("max_active_sequences", -1, ValueError),
        ("max_active_sequences", 1.5, TypeError),
        ("max_active_sequences", True, TypeError),
        ("max_active_sequences", "8", TypeError),
        ("max_tokens_per_iteration", 1 << 64, ValueError),
        ("cache_aging_cost_per_iteration", -4, ValueError),
        ("max_prefill_sequences_per_iteration", -1, ValueError),
        ("max_consecutive_prefill_iterations", 2.0, TypeError),
        ("mixed_prefill_decode", 1, TypeError),
        ("group_waiting_prefixes", None, TypeError),
        ("iteration_interval", -0.1, ValueError),
        ("iteration_interval", float("nan"), ValueError),
        ("iteration_interval", "2ms", TypeError),
        ("memory_components", [("kv", 1)], TypeError),
        ("memory_components", 3, TypeError),
        ("sequence_id_limit", -256, ValueError),
    ],
)
def test_config_rejects_bad_values(field, value, error):
    with pytest.raises(error):
        SchedulerConfig(**{field: value})
    c = SchedulerConfig()
    with pytest.raises(error):
        setattr(c, field, value)
    assert c == SchedulerConfig()


def test_memory_component_formulas():
    c = MemoryComponent("recurrent", 1_000_000, 0, 0, 4_096)
    assert c.request_bytes(8_192, 512) == 4_096
    kv = MemoryComponent("kv", 100, 30, 2, 5)
    assert kv.available_bytes() == 70
    assert kv.reservation_bytes(10) == 25
    assert kv.request_bytes(3, 4) == 19
    assert MemoryComponent("x", 10, 20, 0, 0).available_bytes() == 0
    huge = MemoryComponent("h", U64_MAX, 0, U64_MAX, U64_MAX)
    assert huge.reservation_bytes(U64_MAX) == U64_MAX
    assert huge.request_bytes(U64_MAX, U64_MAX) == U64_MAX
    assert kv == MemoryComponent("kv", 100, 30, 2, 5)


@pytest.mark.parametrize(
    "args, error",
    [
        ((None, 1, 0, 0, 0), TypeError),
        (("kv", -1, 0, 0, 0), ValueError),
        (("kv", 1, 0, 1.0, 0), TypeError),
        (("kv", 1, 0, 0, 1 << 64), ValueError),
        (("kv", 1, False, 0, 0), TypeError),
    ],
)
def test_memory_component_validation(args, error):
    with pytest.raises(error):
        MemoryComponent(*args)
    with pytest.raises(ValueError):
        MemoryComponent("kv", 1, 0, 0, 0).reservation_bytes(-1)


def test_sequence_defaults_and_builders():
    s = Sequence("a", [5, 6, 7], 4)
    assert s.generated_tokens == [] and s.status is SequenceStatus.WAITING
    assert s.admission_tokens == 7 and s.priority == 0 and s.sampling is None
    assert s.prefix_restore is None and s.cache_affinity == CacheAffinity() and s.admitted_at is None
    assert (s.prefill_cursor, s.enqueued_turn, s.enqueue_order) == (0, 0, 0)
    assert s.with_admission_tokens(1) is s and s.admission_tokens == 3
    assert s.with_admission_tokens(50).admission_tokens == 50
    aff = CacheAffinity.from_stage(StageCacheAffinity(0, 2, 10, 5))
    assert s.with_cache_affinity(aff).cache_affinity == aff
    assert s.recompute_tokens() == [5, 6, 7] and s.pending_decode_token() is None
    s.with_prefilled_generation([8, 9])
    assert s.recompute_tokens() == [5, 6, 7, 8] and s.recompute_token_count() == 4
    assert s.pending_decode_token() == 9 and s.prefill_cursor == 4
    assert not s.is_finished()
    s.status = SequenceStatus.FAILED
    assert s.is_finished()


def test_prefix_restore_keeps_the_last_token_runnable():
    s = Sequence("a", [1, 2, 3, 4], 2).with_prefix_restore(PrefixRestore("p", 10))
    assert s.prefill_cursor == 3
    assert Sequence("b", [1], 2).with_prefix_restore(PrefixRestore("p", 5)).prefill_cursor == 0
    assert Sequence("c", [1, 2, 3], 2).with_prefix_restore(PrefixRestore("p", 1)).prefill_cursor == 1


def test_sequence_accepts_an_empty_prompt_and_max_tokens_zero():
    assert Sequence("e", [], 0).prompt_tokens == []


def test_prefilled_generation_rejects_an_empty_list():
    s = Sequence("a", [1, 2], 4)
    with pytest.raises(ValueError):
        s.with_prefilled_generation([])
    assert s.generated_tokens == [] and s.prefill_cursor == 0


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(id=1), TypeError),
        (dict(id="\ud800"), ValueError),
        (dict(prompt_tokens=[1, -1]), ValueError),
        (dict(prompt_tokens=[1, 1 << 31]), ValueError),
        (dict(prompt_tokens=[True]), TypeError),
        (dict(prompt_tokens=[1.0]), TypeError),
        (dict(prompt_tokens="abc"), TypeError),
        (dict(prompt_tokens=None), TypeError),
        (dict(max_tokens=-1), ValueError),
        (dict(max_tokens=1 << 32), ValueError),
        (dict(max_tokens=None), TypeError),
        (dict(priority=-1), ValueError),
        (dict(priority=1 << 64), ValueError),
        (dict(priority=False), TypeError),
    ],
)
def test_sequence_constructor_validation(kwargs, error):
    args = dict(id="a", prompt_tokens=[1, 2], max_tokens=4)
    args.update(kwargs)
    with pytest.raises(error):
        Sequence(**args)


def test_sequence_builder_validation():
    s = Sequence("a", [1, 2], 4)
    with pytest.raises(ValueError):
        s.with_prefilled_generation([-3])
    with pytest.raises(TypeError):
        s.with_prefilled_generation([False])
    with pytest.raises(TypeError):
        s.with_prefix_restore(6)
    with pytest.raises(TypeError):
        s.with_cache_affinity(None)
    with pytest.raises(ValueError):
        s.with_admission_tokens(-1)
    with pytest.raises(TypeError):
        PrefixRestore("p", 3, kind=1)
    with pytest.raises(ValueError):
        PrefixRestore("p", -3)
    assert s == Sequence("a", [1, 2], 4)


def test_max_token_boundaries_are_accepted():
    s = Sequence("a", [0, (1 << 31) - 1], (1 << 32) - 1, SamplingParams(seed=(1 << 64) - 1),
                 U64_MAX)
    assert s.prompt_tokens == [0, (1 << 31) - 1]


def test_frozen_snapshot_is_read_only():
    s = Sequence("a", [1, 2], 4).with_prefilled_generation([7])
    snap = s._snapshot()
    assert snap == s and snap.prompt_tokens == (1, 2) and snap.generated_tokens == (7,)
    with pytest.raises(AttributeError):
        snap.priority = 3
    with pytest.raises(AttributeError):
        snap.with_admission_tokens(9)
    assert snap.recompute_tokens() == [1, 2] and snap.pending_decode_token() == 7


def test_prediction_validation():
    assert IterationPrediction(0, -(1 << 31)).token == -(1 << 31)
    with pytest.raises(ValueError):
        IterationPrediction(-1, 0)
    with pytest.raises(ValueError):
        IterationPrediction(0, 1 << 31)
    with pytest.raises(TypeError):
        IterationPrediction(0, 1.0)
    with pytest.raises(TypeError):
        IterationPrediction(True, 3)


def test_error_texts_and_equality():
    assert str(QueueFull(7)) == "scheduler waiting queue is full (7 requests)"
    assert str(DuplicateSequence("x")) == "sequence id is already queued or active: x"
    assert str(EmptyPrompt()) == "sequence prompt must contain at least one token"
    assert QueueFull(7).capacity == 7 and DuplicateSequence("x").id == "x"
    assert QueueFull(7) == QueueFull(7) != QueueFull(8)
    assert DuplicateSequence("x") != EmptyPrompt()
    for err in (QueueFull(1), DuplicateSequence("x"), EmptyPrompt()):
        assert isinstance(err, AdmissionError)
    assert issubclass(StalePlanError, ValueError) and issubclass(MalformedOutputs, ValueError)


def test_numpy_integers_are_accepted_as_tokens():
    s = Sequence("a", np.arange(4, dtype=np.int32), np.uint32(3), None, np.uint64(2))
    assert s.prompt_tokens == [0, 1, 2, 3] and all(type(t) is int for t in s.prompt_tokens)
    assert (s.max_tokens, s.priority) == (3, 2)
    with pytest.raises(TypeError):
        Sequence("b", np.array([True, False]), 1)
    with pytest.raises(TypeError):
        Sequence("c", np.array([1.0, 2.0]), 1)


def test_a_scheduler_says_what_it_holds_in_its_repr(impl):
    s = impl(SchedulerConfig())
    s.submit(Sequence("a", [1, 2, 3], max_tokens=4))
    assert repr(s) == (f"{impl.__name__}(active=0, waiting=1, live_plans=0, "
                       "admission=CacheAwareAdmission, preemption=LowestPriorityNewest)")
