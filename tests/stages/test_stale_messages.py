"""What a driver leaves behind on its workers does not reach the next one: a plan of another
driver still travelling is dropped, sampling kept for a plan that never came is forgotten,
a plan a stage refuses changes nothing, the lanes of finished requests are freed while the
server idles, and a stage that hangs while the plans in flight drain breaks the chain."""
from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

import numpy as np
import pytest

pytest.importorskip("llama_cpp")
zmq = pytest.importorskip("zmq")

from skippy_scheduler import MemoryComponent, Scheduler, SchedulerConfig  # noqa: E402
from skippy_scheduler.cost_model import LAB_COST  # noqa: E402
from skippy_scheduler.engine import Engine, Request, VirtualClock  # noqa: E402
from skippy_scheduler.hosts.stages.channel import StageFailure, StageTimeout  # noqa: E402
from skippy_scheduler.hosts.stages.host import StageHost  # noqa: E402
from skippy_scheduler.hosts.stages.local import LocalStages  # noqa: E402
from skippy_scheduler.hosts.stages.wire import encode_activations, encode_plan  # noqa: E402
from skippy_scheduler.sampling import SamplingParams  # noqa: E402

from stages_common import N_SEQ, lane_outside_the_stages  # noqa: E402

HOST = dict(n_ctx=N_SEQ * 512, n_seq_max=N_SEQ, n_batch=512, n_threads=1)
PROMPT = [1, 20, 30, 40]
HOT = SamplingParams(temperature=5.0, seed=123)


@pytest.fixture(scope="module")
def local2(splits, model4):
    with LocalStages(splits[2], source_model=model4) as local:
        yield local


def _engine(host, **config) -> Engine:
    config.setdefault("memory_components", [MemoryComponent("kv", 10**9, 0, 1, 0)])
    if host.prefix_store is not None:
        config.update(host.sequence_id_settings)
    scheduler = Scheduler(SchedulerConfig(max_active_sequences=2, max_tokens_per_iteration=64,
                                          **config))
    return Engine(scheduler, host, clock=VirtualClock(LAB_COST), max_iterations=500)


def _greedy(host, n: int = 6) -> list[int]:
    engine = _engine(host)
    engine.add_requests([Request("g", PROMPT, n)])
    record = engine.run().records[0]
    if host.prefix_store is not None:
        engine.scheduler.attach_prefix_store(None)
    return record.tokens


def _push(address: str):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return ctx, sock


def test_a_plan_of_another_driver_still_in_the_chain_is_dropped(local2, alone):
    """A plan an earlier driver sent (here: arriving at stage 1 while this driver's step 0 is
    held up in stage 0) carries that driver's id: stage 1 runs none of it, and this driver's
    step 0 is answered with its own tokens."""
    with local2.host(**HOST) as host:
        got: list[list[int]] = []
        os.kill(local2.procs[0].pid, signal.SIGSTOP)
        try:
            runner = threading.Thread(target=lambda: got.append(_greedy(host)))
            runner.start()
            time.sleep(0.5)
            frame = encode_plan(step=0, serial=1, row_offsets=[0, 4], row_lanes=[0],
                                tokens=PROMPT, positions=[0, 1, 2, 3], sample_last=[1],
                                phases=[0], new_rows=[0])
            head, rows = encode_activations(0, np.zeros((4, host.n_embd), np.float32))
            earlier = (host.driver ^ 1).to_bytes(8, "little")
            ctx, sock = _push(local2.addresses[1])
            sock.send_multipart([b"plan", frame, head, rows, earlier])
            time.sleep(0.5)
        finally:
            os.kill(local2.procs[0].pid, signal.SIGCONT)
        runner.join(60)
        sock.close(linger=0)
        ctx.term()
        assert got == [alone(PROMPT, 6)] and host.broken is None


def test_sampling_kept_for_a_plan_that_failed_does_not_reach_the_next_sequence(local2, alone):
    """A sampled request's first plan is refused by stage 0 after its sampling went down the
    chain: the last stage forgets it with the undo, and a greedy request of a new scheduler
    (whose steps start at 0 again) on the same lane samples greedily."""
    with local2.host(**HOST) as host:
        engine = _engine(host)
        engine.submit(Request("hot", PROMPT, 4, sampling=HOT))
        with lane_outside_the_stages(host):
            with pytest.raises(StageFailure, match="stage 0 failed"):
                engine.step()
        assert host.broken is None
        assert _greedy(host) == alone(PROMPT, 6)


def test_sampling_an_earlier_driver_left_is_cleared_by_configuring(local2, model4, alone):
    with local2.host(**HOST) as first:
        assert _greedy(first) == alone(PROMPT, 6)
        first.sync()
        # Sampling for a lane and step this driver's plan never brought (then a memory
        # message through the chain, to know it has arrived).
        first._send_chain(b"samp", {"step": 0, "lanes": {"0": dataclasses.asdict(HOT)}})
        first.mem_pending.add(first._send_chain(b"mem", {"ops": []}))
        first.sync()
        with local2.host(**HOST) as second:
            assert _greedy(second) == alone(PROMPT, 6)


def test_a_refused_plan_changes_nothing_on_the_stage(local2):
    """Stage 1 gets plans that release the running sequence's lane and then fail a check (the
    activations of another step; a row past what the lane holds once released): it refuses
    each before freeing anything."""
    with local2.host(**HOST) as host:
        engine = _engine(host)
        engine.submit(Request("keep", [1, 40, 41, 42, 43], 8))
        engine.step()
        host.sync()
        before = host.held()
        lane = next(iter(before[1]))
        assert before[1][lane] == 5
        ctx, sock = _push(local2.addresses[1])
        try:
            plans = [
                (encode_plan(step=777, serial=0, row_offsets=[0, 1], row_lanes=[lane + 1],
                             tokens=[9], positions=[0], sample_last=[1], phases=[0],
                             new_rows=[0], release_lanes=[lane]), 776, "activations for step"),
                (encode_plan(step=778, serial=0, row_offsets=[0, 1], row_lanes=[lane],
                             tokens=[9], positions=[5], sample_last=[1], phases=[2],
                             release_lanes=[lane]), 778, "starts at position 5 but the stage "
                                                         "holds 0"),
            ]
            for frame, act_step, says in plans:
                head, rows = encode_activations(act_step, np.zeros((1, host.n_embd),
                                                                   np.float32))
                sock.send_multipart([b"plan", frame, head, rows, host.driver_frame])
                parts = host._recv("waiting for the refusal")
                assert parts[0] == b"err" and says.encode() in parts[1], parts
            sock.send_multipart([b"plan", plans[0][0], host.driver_frame])  # no activations
            parts = host._recv("waiting for the refusal")
            assert b"must carry activations" in parts[1], parts
        finally:
            sock.close(linger=0)
            ctx.term()
        assert host.held() == before
        engine.cancel("keep")


@pytest.mark.parametrize("reuse", [False, True], ids=["plain", "prefix-reuse"])
def test_the_idle_heartbeat_frees_the_lanes_of_finished_requests(local2, alone, reuse):
    """Released lanes ride on the next plan; while the server idles the heartbeat sends them
    (and, with prefix reuse, the memory operations that empty them), as does asking for the
    stages' KV use."""
    extra = dict(prefix_cache_tokens=200, prefix_holders=2) if reuse else {}
    with local2.host(**dict(HOST, n_ctx=(N_SEQ + 2) * 512), **extra) as host:
        assert _greedy(host) == alone(PROMPT, 6)
        assert host.check_alive(30.0) is None
        assert host.held() == [{}, {}]  # the lanes (holders may keep the prefix)
        engine = _engine(host)
        engine.add_requests([Request("again", [1, 50, 51], 3)])
        engine.run()
        if reuse:
            engine.scheduler.attach_prefix_store(None)
        assert all(u.lane_cells == 0 for u in host.stage_usage())


def test_a_stage_that_hangs_while_the_chain_drains_breaks_it(local2):
    """`sync` (and so `stage_usage`) waits for the messages in flight; a stage that does not
    let them through in time breaks the chain with the reason, as a plan's timeout does."""
    for verb in ("sync", "stage_usage"):
        with local2.host(**HOST) as host:
            host.timeout_ms = 1000
            os.kill(local2.procs[1].pid, signal.SIGSTOP)
            try:
                host.mem_pending.add(host._send_chain(b"mem", {"ops": []}))
                with pytest.raises(StageTimeout):
                    getattr(host, verb)()
            finally:
                os.kill(local2.procs[1].pid, signal.SIGCONT)
            assert (host.broken or "").startswith("no answer from"), (verb, host.broken)
            assert "waiting for the plans in flight" in host.broken


def test_a_worker_refuses_a_driver_without_an_id(local2, model4):
    """A driver of an earlier release sends no id in its `conf`: the worker refuses it, so no
    plan of a driver it cannot tell apart from another runs."""
    from skippy_scheduler.hosts.stages import host as host_module

    configure = host_module.StageHost._configure

    def without_id(self, *args):
        self.driver = None  # conf then says "driver": null
        return configure(self, *args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(host_module.StageHost, "_configure", without_id)
        with pytest.raises(StageFailure, match="conf carries no driver id"):
            StageHost(local2.addresses, source_id=local2.source_id, vocab_model=str(model4),
                      **HOST)
