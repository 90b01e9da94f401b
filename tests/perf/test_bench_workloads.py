"""The overhead report's workloads do what their names say (small sizes, no timing)."""
import os
from collections import Counter

import numpy as np
import pytest

from skippy_scheduler import IterationPhase, Scheduler, TwinScheduler
from skippy_scheduler import bench as B
from skippy_scheduler.cli import bench as bench_cli, build_parser

IMPLS = [pytest.param(Scheduler, id="native"), pytest.param(TwinScheduler, id="twin")]


def _phases(plan):
    return [int(x) for x in np.asarray(plan.phases)]


@pytest.mark.parametrize("impl", IMPLS)
def test_steady_decode_steps_are_all_decode(impl):
    step = B.steady_decode(impl, 8)
    for _ in range(3):
        t = step()
        assert t.decode_tokens == 8 and t.prefill_tokens == 0 and t.active_sequences == 8


@pytest.mark.parametrize("impl", IMPLS)
def test_mixed_steps_carry_decode_rows_and_one_chunk(impl):
    step = B.mixed_decode_prefill(impl, 8, steps=10)
    for _ in range(3):
        t = step()
        assert t.decode_tokens == 8 and t.prefill_tokens == 256


@pytest.mark.parametrize("impl", IMPLS)
def test_churn_admits_one_arrival_and_finishes_one_sequence(impl):
    arrive, finish = B.admission_churn(impl, 8)
    for _ in range(3):
        t = finish()
        assert t.decode_tokens == 8 and len(t.finished_ids) == 1 and t.active_sequences == 7
        t = arrive()
        assert t.admitted == 1 and t.prefill_tokens == 512 and t.decode_tokens == 7
        assert t.active_sequences == 8 and t.waiting_sequences == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_ranking_reranks_a_constant_queue_behind_a_full_active_set(impl):
    engine, make_dirty = B.ranking(impl, 64)
    s = engine.scheduler
    # Half the prompts start with one of 16 shared 256-token prefixes (twice each in 64).
    prompts = [s.sequence(i).prompt_tokens for i in s.snapshot().waiting_ids]
    heads = Counter(tuple(p[:256]) for p in prompts)
    assert all(len(p) == 512 for p in prompts)
    assert sorted(heads.values()) == [1] * 32 + [2] * 16
    for _ in range(3):
        make_dirty()
        assert engine.step() and engine.last_plan_ns > 0
        snap = s.snapshot()
        assert len(snap.waiting_ids) == 64 and len(snap.active_ids) == 64


def test_fake_host_writes_one_output_per_sampling_row():
    s = B.decoding_engine(Scheduler, 5, 16).scheduler
    plan = s.plan_iteration()
    assert B.write_outputs(plan, token=3) == 5
    out = plan.outputs
    assert out.count == 5
    assert np.asarray(out.request_indexes[:5]).tolist() == np.asarray(plan.sample_rows).tolist()
    assert np.asarray(out.predicted_tokens[:5]).tolist() == [3] * 5
    assert _phases(plan) == [IterationPhase.DECODE.value] * 5


def test_bench_is_a_cli_subcommand_and_finds_the_c_driver_in_the_source_tree(monkeypatch,
                                                                            tmp_path):
    """c_overhead.c is not installed: SKIPPY_BENCH_C or the checkout provides it."""
    args = build_parser().parse_args(["bench", "--quick", "--scheduler", "native"])
    assert args.func is bench_cli.run and args.quick and args.scheduler == ["native"]
    assert not args.no_c
    checkout = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "c_overhead.c")
    monkeypatch.setenv("SKIPPY_BENCH_C", checkout)
    src = B.c_source()
    assert src is not None and os.path.samefile(src, checkout)
    # Not shipped in the package: without a checkout the report says where it is.
    exe, message = B.build_c(str(tmp_path), source=str(tmp_path / "absent.c"))
    assert exe is None and "bench/c_overhead.c" in message


@pytest.mark.parametrize("impl", IMPLS)
def test_first_plan_token_count_is_one_token_per_row(impl):
    assert B.first_plan_token_count(impl, 8, 64) == 8
