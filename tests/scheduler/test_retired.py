"""`retired()`: what finished, failed or cancelled sequences generated, until the next plan."""
import pytest

from skippy_scheduler import IterationPrediction, SchedulerConfig, Sequence, SequenceStatus
from sched_helpers import complete


def _step(s, tokens):
    """Plan and complete, sampling `tokens[row]` for each sampling row (None: no output)."""
    plan = s.plan_iteration()
    preds = [IterationPrediction(i, tokens[i]) for i in plan.sample_rows.tolist()
             if tokens[i] is not None]
    return plan, complete(s, plan, preds)


def test_finished_failed_and_cancelled_sequences_are_readable_until_the_next_plan(impl):
    s = impl(SchedulerConfig(max_active_sequences=4))
    s.submit(Sequence("len", [1, 2, 3], 2))
    s.submit(Sequence("stop", [4, 5], 5))
    s.submit(Sequence("fail", [6], 5))
    s.submit(Sequence("wait", [7], 5))
    s.cancel("wait")
    assert [(q.id, q.status) for q in s.retired()] == [("wait", SequenceStatus.CANCELLED)]
    _step(s, [10, 20, 30])  # every prompt samples its first token
    assert s.retired() == []  # the plan forgot the cancellation
    _, t = _step(s, [11, -1, None])
    assert t.finished_ids == ["len", "stop"] and t.failed_ids == ["fail"]
    got = {q.id: q for q in s.retired()}
    assert list(got) == ["len", "stop", "fail"]
    assert got["len"].status is SequenceStatus.FINISHED
    assert list(got["len"].generated_tokens) == [10, 11]
    assert list(got["len"].prompt_tokens) == [1, 2, 3]
    # A negative prediction ends a sequence without becoming one of its tokens.
    assert got["stop"].status is SequenceStatus.FINISHED
    assert list(got["stop"].generated_tokens) == [20]
    assert got["fail"].status is SequenceStatus.FAILED
    assert list(got["fail"].generated_tokens) == [30]
    assert all(q.is_finished() for q in got.values())
    with pytest.raises(AttributeError):
        got["len"].max_tokens = 9  # snapshots are read-only
    s.plan_iteration()
    assert s.retired() == []


def test_a_cancelled_status_cannot_be_submitted(impl):
    s = impl(SchedulerConfig())
    seq = Sequence("x", [1], 2)
    seq.status = SequenceStatus.CANCELLED
    with pytest.raises(ValueError, match="cancelled"):
        s.submit(seq)
    assert s.snapshot().waiting_ids == []
