"""The llama.cpp host: batched schedules give every sequence the tokens it gets alone.

A tiny random-weight f32 LLaMA is written to a temp dir; each prompt's greedy tokens are computed
alone, then random schedules (arrivals over time, chunked prefill, mixed prefill+decode,
preemption with KV removal and recompute, cancellation) run through each scheduler
implementation and the host. Every completed sequence must equal its alone tokens and every
cancelled one must be a prefix of them.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("llama_cpp")

from skippy_scheduler import MemoryComponent, SchedulerConfig, Sequence  # noqa: E402
from skippy_scheduler import cli  # noqa: E402
from skippy_scheduler.cli import run as cli_run  # noqa: E402
from skippy_scheduler.engine.clock import CpuClock, VirtualClock  # noqa: E402
from skippy_scheduler.engine.host import CostModelHost  # noqa: E402
from skippy_scheduler.cost_model import LAB_COST, StepCost  # noqa: E402
from skippy_scheduler.hosts.calibrate import (  # noqa: E402
    COST_MODEL_RE, Calibration, calibrate_host, check_fit, default_shapes, fit_cost_model)
from skippy_scheduler.hosts.llama import LlamaHost  # noqa: E402
from skippy_scheduler.hosts.llama.host import NOT_STAGED_REASONS  # noqa: E402
from skippy_scheduler.engine import Engine, Request, VirtualClock  # noqa: E402
from skippy_scheduler.hosts.tiny_model import parameter_count, write_tiny_llama  # noqa: E402

N_SEQ = 8
MAX_GEN = 12
KV_BYTES = 10**9  # capacity of the test's memory component (1 byte per reserved token)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-f32.gguf", seed=7)


@pytest.fixture(scope="module")
def host(model_path):
    with LlamaHost(model_path, n_ctx=N_SEQ * 512, n_seq_max=N_SEQ, n_batch=512, n_threads=1) as h:
        yield h


class AloneReference:
    """Greedy tokens of each prompt run alone (MAX_GEN tokens; shorter runs are prefixes)."""

    def __init__(self, host: LlamaHost) -> None:
        self.host = host
        self.cache: dict[tuple[int, ...], list[int]] = {}

    def __call__(self, prompt, max_tokens: int) -> list[int]:
        key = tuple(prompt)
        if key not in self.cache:
            self.cache[key] = self.host.generate_alone(list(prompt), MAX_GEN)
        return self.cache[key][:max_tokens]


@pytest.fixture(scope="module")
def alone(host):
    return AloneReference(host)


@pytest.fixture(scope="module")
def eog_host(host, alone, model_path, tmp_path_factory):
    """The same weights with the end-of-generation id moved to the most often predicted token,
    so that sequences stop early and at different times (found on this machine, not hard-coded)."""
    rng = random.Random(11)
    counts: dict[int, int] = {}
    for _ in range(40):
        prompt = [1] + [rng.randrange(3, 384) for _ in range(rng.randrange(1, 30))]
        for t in alone(prompt, MAX_GEN):
            counts[t] = counts.get(t, 0) + 1
    eos = max(counts, key=lambda t: (counts[t], -t))
    path = write_tiny_llama(tmp_path_factory.mktemp("eog") / "tiny-eog.gguf", seed=7,
                            eos_token_id=eos)
    with LlamaHost(path, n_ctx=N_SEQ * 512, n_seq_max=N_SEQ, n_batch=512, n_threads=1) as h:
        assert h.is_eog(eos)
        yield h


@pytest.fixture(scope="module")
def eog_alone(eog_host):
    return AloneReference(eog_host)


# ---------------------------------------------------------------------------- model and host


def _read(path) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def test_tiny_model_is_deterministic_by_seed(tmp_path):
    a = write_tiny_llama(tmp_path / "a.gguf", seed=3)
    b = write_tiny_llama(tmp_path / "b.gguf", seed=3)
    c = write_tiny_llama(tmp_path / "c.gguf", seed=4)
    h = write_tiny_llama(tmp_path / "h.gguf", seed=3, dtype="f16")
    data = _read(a)
    assert data == _read(b)
    assert data != _read(c)
    assert parameter_count() == 123_200
    # f32 matrices dominate the file; the f16 file halves them.
    assert 4 * 123_200 < len(data) < 4 * 123_200 + 20_000
    assert 2 * 123_200 < os.path.getsize(h) < len(data) * 0.6
    with pytest.raises(ValueError):
        write_tiny_llama(tmp_path / "x.gguf", dtype="q4")


def test_host_loads_tiny_model_and_tokenizes_spm(host, tmp_path):
    assert host.n_vocab == 384
    assert host.n_params == 123_200
    assert host.tokenize("the cat\n") == [1, 373, 381, 356, 324, 343, 13]
    assert host.is_eog(2) and not host.is_eog(1) and not host.is_eog(373)
    f16 = write_tiny_llama(tmp_path / "h.gguf", seed=7, dtype="f16")
    with LlamaHost(f16, n_ctx=512, n_seq_max=1, n_threads=1) as h16:
        assert len(h16.generate_alone([1, 300, 301], 4)) == 4


def test_host_rejects_bad_settings(model_path, tmp_path):
    with pytest.raises(FileNotFoundError, match="no model file at"):
        LlamaHost(tmp_path / "missing.gguf")
    with pytest.raises(IsADirectoryError, match="is a directory, not a GGUF model file"):
        LlamaHost(tmp_path)
    with pytest.raises(ValueError):
        LlamaHost(model_path, n_seq_max=257)
    with pytest.raises(ValueError):
        LlamaHost(model_path, kv_type="q8")
    with pytest.raises(TypeError):
        LlamaHost(model_path, n_threads=True)


def test_alone_run_is_repeatable_and_has_clear_margins(host):
    prompt = [1, 300, 310, 320, 330, 340]
    first = host.generate_alone(prompt, 8)
    assert first == host.generate_alone(prompt, 8)
    assert host.active_sequences == [] and host.free_slots == N_SEQ
    # The logits behind the first greedy token are not a near tie (no fragile equality tests).
    host.run_rows([("probe", prompt, 0, True)])
    logits = host.logits_of_batch_row(len(prompt) - 1)
    top2 = np.sort(logits)[-2:]
    assert int(np.argmax(logits)) == first[0]
    assert top2[1] - top2[0] > 1e-4
    with pytest.raises(ValueError):
        host.logits_of_batch_row(0)  # that entry had no logits flag
    host.release_all()


def _plan_scheduler(impl, **overrides):
    settings = dict(max_active_sequences=N_SEQ, max_tokens_per_iteration=512)
    settings.update(overrides)
    config = SchedulerConfig(**settings)
    return impl(config)


def test_one_plan_is_one_decode_with_compact_outputs(impl, host, alone):
    prompts = [[1, 300, 301, 302], [1, 310, 311], [1, 320, 321, 322, 323, 324]]
    sched = _plan_scheduler(impl)
    for i, p in enumerate(prompts):
        sched.submit(Sequence(f"s{i}", p, 3))
    plan = sched.plan_iteration()
    assert len(plan) == 3 and plan.token_count == 13
    assert host.execute(plan) == 3
    out = plan.outputs
    assert out.count == 3
    assert out.request_indexes[:3].tolist() == [0, 1, 2]
    # The contiguous logits block the host samples from is what llama_get_logits_ith returns
    # for the last entry of each sampling row (batch rows 3, 6 and 12).
    last_entries = (np.asarray(plan.row_offsets)[1:] - 1).tolist()
    assert last_entries == [3, 6, 12]
    assert [int(np.argmax(host.logits_of_batch_row(b))) for b in last_entries] == \
        out.predicted_tokens[:3].tolist()
    assert out.predicted_tokens[:3].tolist() == [alone(p, 1)[0] for p in prompts]
    # Each sequence got its own llama sequence id, lowest ids first.
    assert sorted(host.seq_id_of(f"s{i}") for i in range(3)) == [0, 1, 2]
    assert [host.kv_tokens(f"s{i}") for i in range(3)] == [4, 3, 6]
    telemetry = sched.complete_iteration(plan)
    assert telemetry.finished_ids == []
    assert [list(sched.sequence(f"s{i}").generated_tokens) for i in range(3)] == [
        alone(p, 1) for p in prompts]
    for i in range(3):
        assert host.release(f"s{i}")
    assert not host.release("s0")
    assert host.free_slots == N_SEQ


def test_batch_holds_rows_in_lane_order_whatever_the_plan_order(host, alone):
    """With a KV stream per sequence llama.cpp cuts a batch into runs of consecutive sequence
    ids in batch order, a weight pass each: the host stages rows by lane, each row's entries
    together, and every row still gets its own tokens."""
    prompts = {"a": [1, 300, 301, 302], "b": [1, 310, 311], "c": [1, 320, 321, 322, 323],
               "d": [1, 330, 331, 332, 333, 334]}
    first = host.run_rows([(k, prompts[k], 0, True) for k in "abc"])
    assert [host.seq_id_of(k) for k in "abc"] == [0, 1, 2]
    assert host.release("a")  # lane 0 is free again: "d" takes it below
    # Plan order b, c (decode rows), d (its whole prompt): lanes 1, 2, 0.
    got = host.run_rows([("b", [first["b"]], 3, True), ("c", [first["c"]], 5, True),
                         ("d", prompts["d"], 0, True)])
    assert host.seq_id_of("d") == 0
    staged = host._decoder.batch.seq_ids[:8].tolist()
    assert staged == [0] * 6 + [1, 2]
    assert host._decoder.pos[:8].tolist() == [0, 1, 2, 3, 4, 5, 3, 5]
    assert [first["b"], got["b"]] == alone(prompts["b"], 2)
    assert [first["c"], got["c"]] == alone(prompts["c"], 2)
    assert got["d"] == alone(prompts["d"], 1)[0]
    for k in "bcd":
        assert host.release(k)


def test_gap_fill_closes_a_break_in_the_run_of_lanes_and_leaves_no_cell(host, alone):
    """A lane between two decoding lanes without a row of its own (a prompt waiting for its next
    chunk) would split the batch into two passes: the host decodes a filler entry on it, reads
    no logits for it and drops its cell, and every sequence's tokens stay what they are alone."""
    prompts = {"a": [1, 340, 341], "b": [1, 350, 351, 352], "c": [1, 360, 361, 362, 363]}
    first = host.run_rows([(k, prompts[k], 0, True) for k in "abc"])
    assert [host.seq_id_of(k) for k in "abc"] == [0, 1, 2]
    filled = host.gap_fill_rows
    got = host.run_rows([("a", [first["a"]], 3, True), ("c", [first["c"]], 5, True)])
    assert host.gap_fill_rows == filled + 1
    assert host._decoder.batch.seq_ids[:3].tolist() == [0, 1, 2]
    assert host._decoder.pos[:3].tolist() == [3, 4, 5]  # b's filler at its next position
    assert host.kv_tokens("b") == 4
    assert host.host_state(detail=True).lane_positions[1] == 3  # the filler's cell is gone
    assert [first["a"], got["a"]] == alone(prompts["a"], 2)
    assert [first["c"], got["c"]] == alone(prompts["c"], 2)
    # b goes on from where it was, as if no filler had been there
    got_b = host.run_rows([("b", [first["b"]], 4, True)])
    assert [first["b"], got_b["b"]] == alone(prompts["b"], 2)
    # with the fill off (or a gap wider than the limit) the break stays
    host.gap_fill_max = 0
    try:
        host.run_rows([("a", [got["a"]], 4, True), ("c", [got["c"]], 6, True)])
        assert host.gap_fill_rows == filled + 1
        assert host._decoder.batch.seq_ids[:2].tolist() == [0, 2]
    finally:
        host.gap_fill_max = 2
    for k in "abc":
        assert host.release(k)


def test_gap_fill_never_takes_the_batch_past_its_size(model_path):
    """A plan that fills the batch leaves its gaps alone: a filler past the batch size would
    make the decode fail (found in a trace replay, where a full prefill step beside decode rows
    had a waiting lane between them)."""
    for n_batch, fills in ((2, False), (3, True)):
        with LlamaHost(model_path, n_ctx=4 * 64, n_seq_max=4, n_batch=n_batch,
                       n_threads=1) as h:
            first = {}
            for i, k in enumerate("abc"):
                first.update(h.run_rows([(k, [1, 300 + i], 0, True)]))
            assert [h.seq_id_of(k) for k in "abc"] == [0, 1, 2]
            filled = h.gap_fill_rows
            # a and c decode, b (lane 1) has no row: two entries, and one more for its filler
            h.run_rows([("a", [first["a"]], 2, True), ("c", [first["c"]], 2, True)])
            assert h.gap_fill_rows == filled + fills
            assert h._decoder.batch.seq_ids[:2 + fills].tolist() == ([0, 1, 2] if fills
                                                                     else [0, 2])


def test_gap_fill_leaves_a_gap_beside_a_prompt_chunk(host, alone):
    """A filler closes a break only between one-token rows: beside a longer row llama.cpp
    runs the rest of that row as passes of its own anyway, so between two chunks a filler would
    add a pass, and between a chunk and a decode row it would save none."""
    prompts = {"a": [1, 270, 271], "b": [1, 280, 281], "c": [1, 290, 291]}
    first = host.run_rows([(k, prompts[k], 0, True) for k in "abc"])
    assert [host.seq_id_of(k) for k in "abc"] == [0, 1, 2]
    assert host.release("a") and host.release("c")
    filled = host.gap_fill_rows
    # lanes 0 and 2 take new prompts (chunks of 4 and 5 tokens), lane 1 (b) has no row
    host.run_rows([("d", [1, 200, 201, 202], 0, False), ("e", [1, 210, 211, 212, 213], 0, False)])
    assert [host.seq_id_of(k) for k in "de"] == [0, 2]
    assert host.gap_fill_rows == filled
    # a chunk on lane 0 beside a decode row on lane 2: no filler either
    host.run_rows([("d", [203, 204], 4, True), ("e", [214], 5, True)])
    assert host.gap_fill_rows == filled
    assert host._decoder.batch.seq_ids[:3].tolist() == [0, 0, 2]
    got = host.run_rows([("b", [first["b"]], 3, True)])
    assert [first["b"], got["b"]] == alone(prompts["b"], 2)
    for k in "bde":
        assert host.release(k)


def test_gap_fill_max_is_checked(model_path):
    with pytest.raises(ValueError, match="gap_fill_max"):
        LlamaHost(model_path, n_ctx=512, n_seq_max=2, gap_fill_max=-1)
    with pytest.raises(TypeError, match="gap_fill_max"):
        LlamaHost(model_path, n_ctx=512, n_seq_max=2, gap_fill_max=1.5)


class _Outputs:
    def __init__(self, n):
        self.request_indexes = np.zeros(n, dtype=np.uint64)
        self.predicted_tokens = np.zeros(n, dtype=np.int32)
        self.count = 0


class _Work:
    def __init__(self, sequence_id):
        self.sequence_id = sequence_id
        self.sampling = None
        self.restore_holder = None


class _RawPlan:
    """A hand-made plan (the plan surface only) to drive the host into its error paths; every
    row is a new one, restoring what it starts after."""

    def __init__(self, rows):
        self.work = [_Work(r[0]) for r in rows]
        self.sequence_ids = [r[0] for r in rows]
        self.new_rows = np.ones(len(rows), dtype=np.uint8)
        self.restored_tokens = np.array([r[2] for r in rows], dtype=np.uintp)
        lengths = [len(r[1]) for r in rows]
        self.row_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.intp)
        self.tokens = np.concatenate([r[1] for r in rows]).astype(np.int32)
        self.positions = np.concatenate(
            [np.arange(r[2], r[2] + len(r[1])) for r in rows]).astype(np.int32)
        self.token_count = int(self.row_offsets[-1])
        self.sample_rows = np.array([i for i, r in enumerate(rows) if r[3]], dtype=np.intp)
        self.outputs = _Outputs(len(rows))

    def __len__(self):
        return len(self.work)


def test_host_rejects_plans_it_cannot_run_without_side_effects(host):
    gap = _RawPlan([("a", [1, 300], 0, True), ("b", [5], 3, True)])
    with pytest.raises(ValueError, match="starts at position 3"):
        host.execute(gap)
    assert host.active_sequences == [] and host.free_slots == N_SEQ
    dup = _RawPlan([("a", [1, 300], 0, False), ("a", [5], 2, True)])
    with pytest.raises(ValueError, match="more than one row"):
        host.execute(dup)
    big = _RawPlan([("a", list(range(3, 300)) * 2, 0, True)])
    with pytest.raises(ValueError, match="batch"):
        host.execute(big)
    with pytest.raises(ValueError, match="plan tokens"):
        host.execute(_RawPlan([("a", [1, 384], 0, True)]))
    crowd = _RawPlan([(f"q{i}", [1, 300], 0, True) for i in range(N_SEQ + 1)])
    with pytest.raises(RuntimeError, match="free llama sequence ids"):
        host.execute(crowd)
    assert host.active_sequences == [] and host.free_slots == N_SEQ


def test_end_of_generation_becomes_a_negative_prediction(eog_host, eog_alone):
    rng = random.Random(5)
    for _ in range(300):
        prompt = [1] + [rng.randrange(3, 384) for _ in range(rng.randrange(1, 30))]
        first = eog_alone(prompt, 1)[0]
        if eog_host.is_eog(first):
            break
    else:
        pytest.fail("no prompt whose first greedy token ends generation in 300 tries")
    assert eog_alone(prompt, MAX_GEN) == [first]
    plan = _RawPlan([("e", prompt, 0, True)])
    assert eog_host.execute(plan) == 1
    assert plan.outputs.predicted_tokens[0] == -1 and plan.outputs.request_indexes[0] == 0
    eog_host.release("e")


# ---------------------------------------------------------------------------- random schedules


def _random_trial(impl, host, alone, seed: int, counters: dict, depth: int = 1) -> None:
    rng = random.Random(seed)
    n = rng.randrange(3, 11)
    requests = []
    for i in range(n):
        plen = rng.choice([1, 2, 3, rng.randrange(4, 40), rng.randrange(40, 120)])
        prompt = [1] + [rng.randrange(3, 384) for _ in range(plen - 1)]
        requests.append(Request(
            f"r{i}", prompt, rng.randrange(1, MAX_GEN + 1),
            arrival_us=rng.choice([0.0, rng.uniform(0, 4000)]), priority=rng.randrange(3)))
    budget = rng.choice([8, 16, 64, 512])
    config = dict(
        max_active_sequences=rng.randrange(1, N_SEQ + 1),
        max_tokens_per_iteration=budget,
        prefill_chunk_tokens=rng.choice([1, 3, 8, 32, 256]),
        mixed_prefill_decode=rng.random() < 0.5,
        max_consecutive_prefill_iterations=rng.choice([None, 1, 2]),
        memory_components=[MemoryComponent("kv", KV_BYTES, 0, 1, 0)],
        max_inflight_plans=depth,
    )
    scheduler = impl(SchedulerConfig(**config))
    reserved = {r.id: len(r.prompt_tokens) + r.max_tokens for r in requests}
    p_preempt, p_cancel = rng.uniform(0, 0.15), rng.uniform(0, 0.05)

    def pressure(engine):
        if rng.random() < p_preempt:
            # A usage spike evicts one sequence; then the measured usage is reported again.
            victims = engine.preempt([KV_BYTES + 1])
            for v in victims:
                # At depth > 1 a plan may still be running: the release waits for it.
                assert depth > 1 or host.seq_id_of(v) is None
            active = scheduler.snapshot().active_ids
            engine.preempt([sum(reserved[a] for a in active)])
            counters["preempted"] += len(victims)
        if rng.random() < p_cancel:
            open_ids = engine.open_ids()
            if open_ids and engine.cancel(rng.choice(open_ids)):
                counters["cancelled"] += 1

    engine = Engine(scheduler, host, clock=VirtualClock(LAB_COST), before_step=pressure,
                    max_iterations=5000)
    for req in requests:
        engine.submit(req)
    report = engine.run()
    counters["mixed"] += report.phase_mix()[2]
    counters["recompute"] += scheduler.metrics().recompute_tokens
    for req, res in zip(requests, report.records):
        assert res.id == req.id
        expected = alone(req.prompt_tokens, req.max_tokens)
        if res.finish_reason == "cancelled":
            assert res.tokens == expected[: len(res.tokens)], (seed, req.id)
        elif res.finish_reason == "stop":
            # The end-of-generation token ends the sequence and is not one of its tokens.
            assert res.tokens + expected[len(res.tokens):][:1] == expected, (seed, req.id)
            assert host.is_eog(expected[len(res.tokens)]), (seed, req.id)
            counters["completed"] += 1
            counters["eog"] += 1
        else:
            assert res.finish_reason == "length", (seed, req.id, res.finish_reason)
            assert res.tokens == expected, (seed, req.id, config)
            assert len(res.token_times_us) == len(res.tokens)
            counters["completed"] += 1
    # Every llama sequence id came back and no KV is left behind.
    assert host.active_sequences == [] and host.free_slots == N_SEQ


def _counters():
    return dict(completed=0, preempted=0, cancelled=0, mixed=0, recompute=0, eog=0)


def test_random_schedules_match_alone_runs(impl, host, alone):
    counters = _counters()
    for seed in range(40):
        _random_trial(impl, host, alone, seed, counters)
    # The schedules really exercised every mechanism the equality claim is about.
    assert counters["completed"] > 150
    assert counters["preempted"] > 5 and counters["recompute"] > 0
    assert counters["cancelled"] > 2
    assert counters["mixed"] > 5


def test_random_schedules_at_depth_two_match_alone_runs(impl, host, alone):
    """Two plans in flight: llama_decode runs on the host's worker thread while the engine makes
    the next plan (its decode inputs deferred) and completes the previous one."""
    counters = _counters()
    for seed in range(200, 230):
        _random_trial(impl, host, alone, seed, counters, depth=2)
    assert counters["completed"] > 100
    assert counters["preempted"] > 3 and counters["cancelled"] > 1


@pytest.fixture(scope="module")
def ahead_host(model_path):
    with LlamaHost(model_path, n_ctx=N_SEQ * 512, n_seq_max=N_SEQ, n_batch=512, n_threads=1,
                   stage_ahead=True) as h:
        yield h


def test_random_schedules_staged_ahead_match_alone_runs(impl, ahead_host, alone):
    """Two plans in flight, each plan staged while the one before it decodes (what a host on a
    GPU does): its rows' lanes and positions staged into the other batch before the plan's
    deferred inputs exist, its tokens copied in once they do."""
    assert ahead_host.settings["stage_ahead"] is True
    h = ahead_host
    before = (h.staged_ahead, h.staged_ahead_past_calls, h.staged_again)
    missed = dict(h.not_staged_ahead)
    counters = _counters()
    for seed in range(200, 215):
        _random_trial(impl, ahead_host, alone, seed, counters, depth=2)
    assert counters["completed"] > 50 and counters["preempted"] > 1
    ran, past_calls, again = (a - b for a, b in zip(
        (h.staged_ahead, h.staged_ahead_past_calls, h.staged_again), before))
    assert ran > 100  # plans ran as staged ahead, not only the plain way
    # Some ran as staged with releases queued before them; some were staged again when they
    # ran (a release changed the lanes they were staged against).
    assert past_calls > 5 and again > 0
    # The others are counted by why: every staging that did not hold, and plans that start
    # sequences (each trial's requests start over steps).
    missed = {k: n - missed[k] for k, n in h.not_staged_ahead.items()}
    assert set(missed) == set(NOT_STAGED_REASONS)
    assert missed["restaged"] >= again and missed["new_rows"] > 15
    assert h.host_state().not_staged_ahead == h.not_staged_ahead


def test_a_plan_staged_ahead_is_checked_against_the_lanes_it_was_staged_on(model_path):
    # Lanes 0, 1, 2 hold a, b, c; a plan of decode rows for a and c only, staged ahead, has a
    # filler row on b's lane (the gap between them) at b's next position.
    with LlamaHost(model_path, n_ctx=4 * 256, n_seq_max=4, n_batch=64, n_threads=1) as h:
        h.run_rows([("a", [1, 5, 6], 0, True), ("b", [1, 7], 0, True), ("c", [1, 8, 9], 0, True)])
        runner = h._rows

        def stage(ids, starts):
            n = len(ids)
            return runner.stage(ids, starts, {}, np.arange(n + 1), np.full(n, 10, np.int32),
                                np.array(starts, np.int32), np.arange(n), ahead=True)

        step = stage(["a", "c"], [3, 3])
        assert step is not None and step.fill is not None
        assert step.fill[0].tolist() == [1] and step.fill[1].tolist() == [2]
        assert runner.still_staged(step)
        # Rows that do not continue their lanes where they end are not staged ahead.
        assert stage(["a", "c"], [2, 3]) is None  # a replay from an earlier position
        assert stage(["a", "c"], [4, 3]) is None  # past what a's lane holds
        assert stage(["a", "x"], [3, 0]) is None  # x holds no lane
        # b's lane freed: the filler would land on an empty lane at b's old end.
        h.release("b")
        assert not runner.still_staged(step)
        again = stage(["a", "c"], [3, 3])
        assert again is not None and runner.still_staged(again)
        assert again.fill is not None and again.fill[1].tolist() == [0]
        # A row's own lane given back.
        h.release("a")
        assert not runner.still_staged(again)


def test_a_plan_staged_ahead_is_dropped_when_the_plan_before_it_fails(model_path, monkeypatch):
    from skippy_scheduler import Scheduler

    with LlamaHost(model_path, n_ctx=4 * 256, n_seq_max=4, n_batch=64, n_threads=1,
                   stage_ahead=True) as h:
        s = Scheduler(SchedulerConfig(max_active_sequences=4, max_tokens_per_iteration=64,
                                      max_inflight_plans=2, memory_components=[
                                          MemoryComponent("kv", KV_BYTES, 0, 1, 0)]))
        for i in range(3):
            s.submit(Sequence(f"s{i}", [1, 20 + i, 30 + i], 8))
        p0 = s.plan_iteration()
        h.execute(p0)  # the prompts: every sequence holds a lane now
        s.complete_iteration(p0)
        p1 = s.plan_iteration()
        p2 = s.plan_iteration()  # its decode rows' inputs are p1's samples
        ends = {seq: h.kv_tokens(seq) for seq in ("s0", "s1", "s2")}
        gate = threading.Event()
        finish = type(h._rows)._finish_rows
        failed = []

        def fail_first(runner, step):
            if not failed:
                failed.append(h._ahead is not None)  # p2 was staged while p1 ran
                raise RuntimeError("the device went away")
            return finish(runner, step)

        monkeypatch.setattr(type(h._rows), "_finish_rows", fail_first)
        held = h.call_after(lambda: gate.wait(10))  # p1 and p2 queue behind it
        one, two = h.execute_after(p1, [p0]), h.execute_after(p2, [p1])
        gate.set()
        held.result(10)
        with pytest.raises(RuntimeError, match="the device went away"):
            one.result(10)
        with pytest.raises(RuntimeError, match="was not run"):
            two.result(10)
        assert failed == [True]
        assert h._ahead is None and h.staged_ahead == 0
        # p1's rows undone: every lane holds what it held before p1.
        assert {seq: h.kv_tokens(seq) for seq in ("s0", "s1", "s2")} == ends
        s.abort_iteration(p2)
        s.abort_iteration(p1)


def test_random_schedules_with_early_stops_match_alone_runs(impl, eog_host, eog_alone):
    counters = _counters()
    for seed in range(100, 120):
        _random_trial(impl, eog_host, eog_alone, seed, counters)
    assert counters["eog"] > 5 and counters["completed"] > counters["eog"]


def test_wall_clock_serving_measures_latency(impl, host, alone):
    requests = [Request(f"w{i}", [1, 300 + i, 301, 302], 4, arrival_us=2000.0 * i)
                for i in range(4)]
    scheduler = _plan_scheduler(impl, max_active_sequences=2)
    report = Engine(scheduler, host, clock="wall").run(requests)
    for req, res in zip(requests, report.records):
        assert res.tokens == alone(req.prompt_tokens, 4)
        assert res.finish_reason == "length"
        assert res.queue_wait_us >= 0 and res.ttft_us > 0
        assert len(res.itl_us) == 3 and all(g > 0 for g in res.itl_us)
    # Request 3 arrives 6 ms in, so the run cannot be shorter than that.
    assert report.makespan_us >= 6000
    s = report.summary()
    assert s["completed"] == 4 and s["generated_tokens"] == 16
    assert s["p95_ttft_us"] >= s["p50_ttft_us"] > 0


# ---------------------------------------------------------------------------- CLI


def _cli(*argv):
    return cli.main(list(argv))


def test_run_writes_tokens_and_metrics(tmp_path, capsys, model_path, alone):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[1, 300, 301, 302], "the cat", [1, 310]]))
    out = tmp_path / "run.json"
    for scheduler in ("native", "twin"):
        assert _cli("run", "--model", str(model_path), "--prompts", str(prompts),
                    "--max-tokens", "5", "--max-active", "2", "--scheduler", scheduler,
                    "--threads", "1", "--json", str(out)) == 0
        doc = json.loads(out.read_text())
        assert set(doc) == {"model", "settings", "requests", "summary"}
        reqs = doc["requests"]
        assert [r["index"] for r in reqs] == [0, 1, 2]
        assert reqs[1]["prompt_tokens"] == [1, 373, 381, 356, 324, 343]
        for r in reqs:
            assert r["generated_tokens"] == alone(r["prompt_tokens"], 5)
            assert r["finish"] in ("length", "stop")
            assert r["queue_wait_us"] >= 0 and r["ttft_us"] > 0
            assert len(r["itl_us"]) == len(r["generated_tokens"]) - 1
        assert doc["summary"]["completed"] == 3
        assert doc["settings"]["kv_type"] == "f32" and doc["settings"]["flash_attn"] is False
        assert doc["settings"]["stage_ahead"] is False  # auto: off on the CPU
    assert "3/3 completed" in capsys.readouterr().out


def test_run_stages_ahead_when_asked_with_the_same_tokens(tmp_path, model_path, alone):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[1, 300 + i, 301, 302 + 2 * i] for i in range(5)]))
    out = tmp_path / "run.json"
    assert _cli("run", "--model", str(model_path), "--prompts", str(prompts), "-n", "6",
                "-np", "3", "--inflight", "2", "--stage-ahead", "--threads", "1",
                "--json", str(out)) == 0
    doc = json.loads(out.read_text())
    assert doc["settings"]["stage_ahead"] is True
    assert doc["summary"]["staged_ahead"] > 5  # plans ran as staged
    for r in doc["requests"]:
        assert r["generated_tokens"] == alone(r["prompt_tokens"], 6)
    assert _cli("run", "--model", str(model_path), "--stage-ahead", "sometimes") == 2
    with pytest.raises(ValueError, match="stage_ahead must be one of on, off, auto"):
        LlamaHost(model_path, stage_ahead="sometimes")


def test_run_offline_default_model_and_bad_prompts(tmp_path, capsys):
    out = tmp_path / "run.json"
    assert _cli("run", "--max-tokens", "3", "--threads", "1", "--json", str(out)) == 0
    doc = json.loads(out.read_text())
    assert len(doc["requests"]) == len(cli_run.BUILTIN_PROMPTS)
    assert all(len(r["generated_tokens"]) <= 3 for r in doc["requests"])
    assert doc["summary"]["iterations"] > 0
    capsys.readouterr()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([[1, 2], {"x": 1}]))
    assert _cli("run", "--threads", "1", "--prompts", str(bad)) == 2
    assert "run: error: prompt 1 must be a string" in capsys.readouterr().err
    bad.write_text(json.dumps([[1, 999]]))
    assert _cli("run", "--threads", "1", "--prompts", str(bad)) == 2
    assert "outside [0, 384)" in capsys.readouterr().err
    assert _cli("run", "--model", str(tmp_path / "none.gguf")) == 2
    assert "model file not found" in capsys.readouterr().err


def test_calibrate_prints_a_cost_model_the_lab_accepts(capsys, tmp_path):
    out = tmp_path / "calib.json"
    rc = _cli("calibrate", "--repeats", "4", "--warmup", "1", "--json", str(out))
    captured = capsys.readouterr()
    line = captured.out.strip().splitlines()[-1]
    assert COST_MODEL_RE.match(line), line
    model = StepCost.parse(line)
    assert str(model) == line
    doc = json.loads(out.read_text())
    # One thread timed by CPU clock unless asked otherwise: the settings that give a stable fit.
    assert doc["threads"] == 1 and doc["clock"] == "cpu"
    assert doc["cost_model"] == line and len(doc["shapes"]) >= 8
    # The exit status and the warnings follow the fit's own checks (timings depend on the
    # machine and its load, so only their consistency is checked here; the checks themselves
    # are tested on fixed fits below).
    assert rc == (1 if doc["problems"] else 0)
    assert ("warning:" in captured.err) == bool(doc["problems"])
    assert "% (cpu clock, 1 thread)" in captured.err
    # The printed model is the fit of the shapes it reports, each timed 4 times.
    samples = [(d["prefill_tokens"], d["decode_rows"], d["fastest_us"]) for d in doc["shapes"]]
    assert fit_cost_model(samples)[0] == model
    assert all(len(d["durations_us"]) == 4 and d["fastest_us"] == min(d["durations_us"])
               for d in doc["shapes"])
    assert {d for _, d, _ in samples} >= {0, 1, 2, 4, 8}
    assert {p for p, _, _ in samples} >= {0, 16, 64, 256}


class _PricedHost(CostModelHost):
    """A model-free host with the attributes calibration reads from a `LlamaHost`."""

    n_vocab, n_seq_max, n_batch = 384, N_SEQ, 512


@pytest.mark.parametrize("token", [1, -1], ids=["token", "end-of-generation"])
def test_calibration_times_exactly_the_shapes_the_engine_ran(impl, token):
    # Priced by a known model on a virtual clock, every timed iteration costs exactly what its
    # shape does, so the fit recovers the model only if each iteration had its intended shape;
    # a model that only ever predicts end-of-generation must not shrink the decode batches.
    truth = StepCost(30.0, 1.5, 80.0, 12.0)
    host = _PricedHost(token=token)
    calib = calibrate_host(host, repeats=3, warmup=1, clock=lambda: VirtualClock(truth),
                           scheduler_type=impl)
    assert calib.model == truth and calib.residual_us == 0 and calib.problems() == []
    shapes = default_shapes(N_SEQ, 512)
    assert [(t.prefill_tokens, t.decode_rows) for t in calib.timings] == shapes
    assert {(0, 8), (64, 2)} <= set(shapes)  # mixed and the widest decode batch are in it
    assert all(t.durations_us == (truth.duration_us(t.prefill_tokens, t.decode_rows),) * 3
               for t in calib.timings)
    assert calib.skipped == []


def test_calibration_says_when_the_scheduler_will_not_mix(impl):
    # A 64-token prefill that slows a decode step by 64 ms makes the scheduler turn mixed
    # planning off (docs/behaviour.md §2.6): the mixed shapes are reported as not timed and the
    # other shapes still determine the model.
    truth = StepCost(30.0, 1000.0, 80.0, 12.0)
    # Each of the two passes needs two mixed iterations; the scheduler plans one, then stops.
    calib = calibrate_host(_PricedHost(), repeats=4, warmup=0, clock=lambda: VirtualClock(truth),
                           scheduler_type=impl)
    assert calib.model == truth
    assert [(t.prefill_tokens, t.decode_rows) for t in calib.timings if t.prefill_tokens and
            t.decode_rows] == []
    assert len(calib.skipped) == 2
    assert all("prefill_tokens=64" in why and "(64, 0)" in why for why in calib.skipped)


def test_real_calibration_on_the_tiny_model(host):
    calib = calibrate_host(host, repeats=3, warmup=1)
    assert calib.clock == "cpu"
    coefficients = calib.model.as_dict()
    assert all(v >= 0 for v in coefficients.values()), coefficients
    # A shared CI machine can be busy; one thread on the CPU clock still fits to about 5%.
    assert calib.relative_residual < 0.5, calib.to_json()
    assert calib.model.per_prefill_token_us > 0 and calib.model.per_decode_row_us > 0
    assert [(t.prefill_tokens, t.decode_rows) for t in calib.timings] == \
        default_shapes(N_SEQ, 512)
    assert all(len(t.durations_us) == 3 for t in calib.timings)
    # Every calibration sequence ended and gave its llama sequence id back.
    assert host.active_sequences == [] and host.free_slots == N_SEQ


def test_calibration_refuses_what_it_cannot_time(host):
    with pytest.raises(ValueError, match="repeats"):
        calibrate_host(host, repeats=0)
    with pytest.raises(ValueError, match="clock"):
        calibrate_host(host, clock="sundial")
    with pytest.raises(ValueError, match="does not fit"):
        calibrate_host(host, shapes=[(0, N_SEQ + 1)])
    with pytest.raises(ValueError, match="prefill tokens or decode rows"):
        calibrate_host(host, shapes=[(0, 0)])
    with pytest.raises(ValueError, match="would reach position"):
        calibrate_host(host, repeats=1000)
    host.run_rows([("busy", [1, 300], 0, True)])
    try:
        with pytest.raises(ValueError, match="idle"):
            calibrate_host(host)
    finally:
        host.release_all()


def test_cpu_clock_charges_compute_not_sleep():
    clock = CpuClock()
    clock.start()
    clock.now()
    time.sleep(0.05)
    # Sleeping costs no CPU (the process's other threads may spend some meanwhile).
    assert clock.charge(0, 1, 50_000.0) < 40_000
    clock.now()
    deadline = time.process_time() + 0.02
    while time.process_time() < deadline:
        pass
    assert clock.charge(0, 1, 0.0) >= 19_000
    # An idle wait jumps to the arrival, as no CPU time passes while waiting.
    clock.wait_until(clock.now() + 1e6)
    assert clock.now() >= 1e6


def test_cost_model_fit_recovers_known_costs():
    truth = StepCost(30.0, 1.5, 80.0, 12.0)
    shapes = [(p, d) for p in (0, 16, 64, 256) for d in (0, 1, 4) if p or d]
    fitted, residual = fit_cost_model([(p, d, truth.duration_us(p, d)) for p, d in shapes])
    assert fitted == truth and residual < 1e-6
    # A fit that would go negative is constrained to zero instead of clipped afterwards.
    no_overhead = [(p, d, 2.0 * p + (5.0 + 3.0 * d if d else 0.0) - 4.0) for p, d in shapes]
    fitted, _ = fit_cost_model(no_overhead)
    assert fitted.base_us == 0.0
    assert min(fitted.per_prefill_token_us, fitted.decode_base_us, fitted.per_decode_row_us) >= 0


def test_cost_model_fit_keeps_short_shapes_as_close_as_long_ones():
    # Real prefill times bend a little (a few % off a line); fitting errors relative to each
    # shape's time keeps that from moving the decode steps, which an unweighted fit would get
    # wrong by 60% for one row to buy a few µs on the 6 ms prefill.
    truth = StepCost(60.0, 24.0, 0.0, 30.0)
    bend = {(128, 0): 1.04, (256, 0): 0.97, (64, 1): 1.05, (64, 2): 1.05}
    samples = [(p, d, truth.duration_us(p, d) * bend.get((p, d), 1.0))
               for p, d in default_shapes(N_SEQ, 512)]
    fitted, _ = fit_cost_model(samples)
    for p, d, us in samples:
        if not p:
            assert abs(fitted.duration_us(p, d) - us) < 0.01 * us, (p, d, fitted)
    assert check_fit(fitted, samples) == []


def _noisy_samples():
    # Medians measured on a busy 2-core machine with two llama.cpp threads on the CPU clock: a
    # thread descheduled at a barrier stalls the other, so a 64-token prefill took longer than
    # a 128-token one and one more decode row cost 3 ms.
    return [(16, 0, 674.6), (64, 0, 5903.4), (128, 0, 8415.1), (256, 0, 14019.3),
            (0, 1, 371.8), (0, 2, 429.5), (0, 4, 412.7), (0, 8, 700.2),
            (64, 1, 2010.6), (64, 2, 6033.4)]


def test_fit_checks_name_the_residual_and_the_missing_growth():
    samples = _noisy_samples()
    model, residual = fit_cost_model(samples)
    problems = check_fit(model, samples)
    assert len(problems) == 1
    assert f"rms residual is {residual:.1f} us, 32% of the measured times" in problems[0]
    # Timings that do not grow with prefill tokens, or with decode rows, are named even when a
    # model fits them closely.
    shapes = default_shapes(N_SEQ, 512)
    flat = [(p, d, 500.0 + 30.0 * d) for p, d in shapes]
    model, _ = fit_cost_model(flat)
    problems = check_fit(model, flat)
    assert len(problems) == 1 and "do not grow with prefill tokens" in problems[0]
    assert "prefill_token_us=0" in problems[0]
    flat = [(p, d, 100.0 + 20.0 * p + (50.0 if d else 0.0)) for p, d in shapes]
    model, _ = fit_cost_model(flat)
    problems = check_fit(model, flat)
    assert len(problems) == 1 and "do not grow with decode rows" in problems[0]


def _fixed_calibration(samples):
    model, residual = fit_cost_model(samples)
    return Calibration(model, samples, residual, "cpu")


@pytest.mark.parametrize("options, advice", [
    ((), "more --repeats (now 15) or a quieter machine"),
    (("--clock", "wall"), "--clock cpu"),
    (("--threads", "2"), "--threads 1"),
])
def test_calibrate_warns_about_a_bad_fit_and_exits_1(monkeypatch, capsys, options, advice):
    from skippy_scheduler.hosts import calibrate as calibration

    bad = _fixed_calibration(_noisy_samples())
    monkeypatch.setattr(calibration, "calibrate_host", lambda host, **kw: bad)
    assert _cli("calibrate", *options) == 1
    captured = capsys.readouterr()
    # The model is still printed (and parseable); stderr says why not to use it and what to do.
    assert captured.out.strip() == str(bad.model)
    assert f"{bad.relative_residual:.0%} of the measured times" in captured.err
    assert "warning: do not use this cost model" in captured.err
    assert advice in captured.err


def test_calibrate_exits_0_on_a_plausible_fit_and_flags_cpu_time_of_threads(monkeypatch,
                                                                           capsys):
    from skippy_scheduler.hosts import calibrate as calibration

    truth = StepCost(60.0, 24.0, 0.0, 30.0)
    good = _fixed_calibration([(p, d, truth.duration_us(p, d))
                               for p, d in default_shapes(N_SEQ, 512)])
    seen = {}

    def fake(host, **kw):
        seen.update(kw, threads=host.settings["n_threads"])
        return good

    monkeypatch.setattr(calibration, "calibrate_host", fake)
    assert _cli("calibrate") == 0
    assert seen["clock"] == "cpu" and seen["threads"] == 1
    assert "warning" not in capsys.readouterr().err
    assert _cli("calibrate", "--threads", "2") == 0
    assert seen["clock"] == "wall" and seen["threads"] == 2
    capsys.readouterr()
    assert _cli("calibrate", "--threads", "2", "--clock", "cpu") == 0
    assert "CPU time of every thread" in capsys.readouterr().err


def test_cost_model_round_trip_and_errors():
    m = StepCost.parse("iteration_overhead_us=50,prefill_token_us=2.5", LAB_COST)
    assert m == StepCost(50, 2.5, 100, 20)
    assert str(m) == "iteration_overhead_us=50,prefill_token_us=2.5,decode_batch_us=100,decode_sequence_us=20"
    assert m.duration_us(256, 0) == 50 + 2.5 * 256 and m.duration_us(0, 2) == 50 + 100 + 40
    with pytest.raises(ValueError):
        StepCost.parse("overhead=3")
    with pytest.raises(ValueError):
        StepCost(-1.0)


def test_console_script_has_run_and_calibrate():
    for command, option in (("run", "--max-active"), ("calibrate", "--repeats")):
        result = subprocess.run(
            [sys.executable, "-m", "skippy_scheduler.cli", command, "--help"],
            capture_output=True, text=True, check=False, cwd=os.path.dirname(sys.executable))
        assert result.returncode == 0, result.stderr
        assert option in result.stdout


# ---------------------------------------------------------------------------- sampling

from skippy_scheduler.sampling import SamplingParams  # noqa: E402


def _sampling_for(rng: random.Random, i: int):
    kind = i % 4
    if kind == 0:
        return None  # greedy, the fast path
    if kind == 1:
        return SamplingParams(temperature=rng.uniform(0.5, 1.5), seed=rng.randrange(1 << 40),
                              top_k=rng.choice([0, 5, 40]), top_p=rng.choice([1.0, 0.9]),
                              min_p=rng.choice([0.0, 0.05]))
    if kind == 2:  # penalties: the chain keeps a token window that recompute must rebuild
        return SamplingParams(temperature=0.8, seed=rng.randrange(1 << 40),
                              repetition_penalty=1.3, presence_penalty=0.4,
                              frequency_penalty=0.2, penalty_last_n=rng.choice([4, 64]))
    return SamplingParams(temperature=0.0, logit_bias={300: 3.0, 301: -50.0},
                          repetition_penalty=1.2, ignore_eos=True)


def test_seeded_sampling_is_the_same_alone_batched_and_preempted(impl, host):
    """Every sampled sequence's tokens equal its alone run, under random batching, chunked
    prefill, preemption with recompute and cancellation."""
    preempted = 0
    for seed in range(12):
        rng = random.Random(1000 + seed)
        requests = []
        for i in range(rng.randrange(4, 10)):
            prompt = [1] + [rng.randrange(3, 384) for _ in range(rng.randrange(1, 60))]
            requests.append(Request(f"s{i}", prompt, rng.randrange(4, MAX_GEN + 1),
                                    arrival_us=rng.choice([0.0, rng.uniform(0, 3000)]),
                                    sampling=_sampling_for(rng, i)))
        scheduler = impl(SchedulerConfig(
            max_active_sequences=rng.randrange(2, N_SEQ + 1),
            max_tokens_per_iteration=rng.choice([16, 64, 512]),
            prefill_chunk_tokens=rng.choice([3, 8, 256]),
            mixed_prefill_decode=rng.random() < 0.5,
            memory_components=[MemoryComponent("kv", KV_BYTES, 0, 1, 0)]))
        reserved = {r.id: len(r.prompt_tokens) + r.max_tokens for r in requests}

        def pressure(engine):
            nonlocal preempted
            if rng.random() < 0.15:
                preempted += len(engine.preempt([KV_BYTES + 1]))
                active = scheduler.snapshot().active_ids
                engine.preempt([sum(reserved[a] for a in active)])

        engine = Engine(scheduler, host, clock=VirtualClock(LAB_COST), before_step=pressure,
                        max_iterations=5000)
        for req in requests:
            engine.submit(req)
        report = engine.run()
        for req, res in zip(requests, report.records):
            alone = host.generate_alone(req.prompt_tokens, req.max_tokens, req.sampling)
            if res.finish_reason == "stop":
                assert res.tokens + [alone[len(res.tokens)]] == alone, (seed, req.id)
            else:
                assert res.finish_reason == "length", (seed, req.id, res.finish_reason)
                assert res.tokens == alone, (seed, req.id, req.sampling)
        assert host.active_sequences == [] and host.host_state().samplers == 0
    assert preempted > 5


def test_sampling_params_shape_the_tokens(host):
    prompt = [1, 373, 381, 356, 324, 343]
    greedy = host.generate_alone(prompt, MAX_GEN)
    assert host.generate_alone(prompt, MAX_GEN, SamplingParams(temperature=0.0)) == greedy
    # A dominating bias makes a token the greedy choice everywhere.
    assert host.generate_alone(prompt, 5, SamplingParams(temperature=0.0,
                                                         logit_bias={77: 100.0})) == [77] * 5
    # top_k 1 is greedy whatever the temperature and seed.
    assert host.generate_alone(prompt, MAX_GEN, SamplingParams(temperature=1.5, top_k=1,
                                                               seed=3)) == greedy
    a = host.generate_alone(prompt, MAX_GEN, SamplingParams(temperature=1.0, seed=1))
    b = host.generate_alone(prompt, MAX_GEN, SamplingParams(temperature=1.0, seed=2))
    assert a != b and a == host.generate_alone(prompt, MAX_GEN, SamplingParams(seed=1))
    # A strong repetition penalty over the whole window never repeats a token.
    rep = host.generate_alone(prompt, MAX_GEN, SamplingParams(
        temperature=0.0, repetition_penalty=1e6, penalty_last_n=64, ignore_eos=True))
    assert len(set(rep + prompt)) == len(rep) + len(set(prompt))
    # The native config of the runtime ABI means the same thing as the params it came from.
    params = SamplingParams(temperature=0.7, seed=9, top_k=20, presence_penalty=0.5,
                            logit_bias={300: 2.0})
    native = params.to_native()
    assert host.generate_alone(prompt, MAX_GEN, native) == host.generate_alone(
        prompt, MAX_GEN, params)


def test_eog_can_be_ignored(eog_host, eog_alone):
    rng = random.Random(5)
    for _ in range(300):
        prompt = [1] + [rng.randrange(3, 384) for _ in range(rng.randrange(1, 30))]
        if eog_host.is_eog(eog_alone(prompt, 1)[0]):
            break
    else:
        pytest.fail("no prompt whose first greedy token ends generation in 300 tries")
    tokens = eog_host.generate_alone(prompt, 8, SamplingParams(temperature=0.0,
                                                               ignore_eos=True))
    assert len(tokens) == 8 and not any(eog_host.is_eog(t) for t in tokens)
    with pytest.raises(ValueError, match="logit_bias names token 384"):
        eog_host.generate_alone(prompt, 2, SamplingParams(logit_bias={384: 1.0}))
    assert eog_host.active_sequences == []
