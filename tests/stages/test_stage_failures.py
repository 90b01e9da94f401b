"""How a driver meets stages that stop being its own: a stage that does not answer in time
breaks the chain after one timeout (no undo that would wait for it as long again) and the
reason names the stages; a second driver that configures the workers takes them, and the first
one's next plan ends with that reason instead of a timeout; a worker that exited is described
by its status or signal, and quoted only when its last line is its own error."""
from __future__ import annotations

import os
import signal
import time
import subprocess
import sys

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("zmq")

from skippy_scheduler import MemoryComponent, SchedulerConfig, TwinScheduler  # noqa: E402
from skippy_scheduler.cost_model import LAB_COST  # noqa: E402
from skippy_scheduler.engine import Engine, Request, VirtualClock  # noqa: E402
from skippy_scheduler.hosts.stages.channel import _local_address_towards, exit_reason  # noqa: E402
from skippy_scheduler.hosts.stages.host import StageHost  # noqa: E402
from skippy_scheduler.hosts.stages.local import LocalStages  # noqa: E402
from skippy_scheduler.hosts.stages.split import file_identity  # noqa: E402

from stages_common import N_SEQ  # noqa: E402

HOST = dict(n_ctx=N_SEQ * 512, n_seq_max=N_SEQ, n_batch=512, n_threads=1)


def _run(host, n: int = 2, max_tokens: int = 4) -> list[str]:
    """Finish reasons of `n` greedy requests run to their end on `host`."""
    scheduler = TwinScheduler(SchedulerConfig(
        max_active_sequences=4, max_tokens_per_iteration=64, prefill_chunk_tokens=16,
        memory_components=[MemoryComponent("kv", 10**9, 0, 1, 0)]))
    engine = Engine(scheduler, host, clock=VirtualClock(LAB_COST), max_iterations=500)
    engine.add_requests([Request(f"r{i}", [1, 20 + i, 30 + i, 40], max_tokens)
                         for i in range(n)])
    return [r.finish_reason for r in engine.run().records]


def test_a_stage_that_does_not_answer_breaks_the_chain_after_one_timeout(splits, model4):
    with LocalStages(splits[2], source_model=model4) as local:
        with local.host(**HOST) as host:
            assert _run(host) == ["length", "length"]
            host.timeout_ms = 1500  # short from here on (a healthy step may take longer)
            os.kill(local.procs[1].pid, signal.SIGSTOP)
            try:
                assert set(_run(host)) == {"failed"}
            finally:
                os.kill(local.procs[1].pid, signal.SIGCONT)
            broken = host.broken or ""
            assert "within 1.5 s while running step" in broken, broken
            assert f"stage 1 ({local.addresses[1]})" in broken, broken
            assert "undoing" not in broken, broken  # no second wait for the silent stage
            assert host.live == set()  # the stages not heard from are taken for dead


def test_a_second_driver_takes_the_workers_and_the_first_one_is_told(splits, model4):
    with LocalStages(splits[2], source_model=model4) as local:
        with local.host(**HOST) as first:
            assert _run(first) == ["length", "length"]
            with StageHost(local.addresses, source_id=file_identity(model4),
                           vocab_model=str(model4), **HOST) as second:
                assert set(_run(first)) == {"failed"}
                assert "was configured by another driver" in (first.broken or ""), first.broken
                assert _run(second) == ["length", "length"]  # the workers serve the second
        for log in local.logs:
            with open(log) as f:
                assert "configured by another driver" in f.read()


def _exited(tmp_path, code: str, log_text: str) -> subprocess.Popen:
    log = tmp_path / "worker.log"
    log.write_text(log_text)
    proc = subprocess.Popen([sys.executable, "-c", code])
    proc.wait(30)
    proc.log_path = str(log)  # type: ignore[attr-defined]
    return proc


def test_an_exited_worker_is_described_by_its_status_or_signal(tmp_path):
    killed = _exited(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
                     "stage 1 of 2 (layers 2-3) listening on ipc:///tmp/x/stage-1\n")
    assert exit_reason(killed) == "was killed by signal 9 (SIGKILL)"  # no banner quoted
    refused = _exited(tmp_path, "raise SystemExit(2)",
                      "stage 1 of 2\nerror: stage-1.gguf is not a stage file\n")
    assert exit_reason(refused) == "exited with status 2: error: stage-1.gguf is not a stage file"
    crashed = _exited(tmp_path, "raise SystemExit(1)",
                      "Traceback (most recent call last):\n  ...\nMemoryError: out of memory\n")
    assert exit_reason(crashed) == "exited with status 1: MemoryError: out of memory"


def test_an_address_that_does_not_resolve_is_named():
    with pytest.raises(OSError, match=r"stage address tcp://nohost\.invalid:5700"):
        _local_address_towards("tcp://nohost.invalid:5700")


def test_configuring_waits_longer_than_a_plan_and_says_what_it_waits_for(monkeypatch, caplog,
                                                                         model4):
    """A worker loads its layers when configured: the wait has its own timeout, says every
    few seconds which stages it waits for, and names the silent one when it gives up."""
    import socket

    from skippy_scheduler.hosts.stages import host as host_module
    from skippy_scheduler.hosts.stages.channel import StageTimeout

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    monkeypatch.setattr(host_module, "CONFIGURE_NOTE_S", 0.4)
    caplog.set_level("WARNING")
    with pytest.raises(StageTimeout) as info:
        StageHost([address], timeout_s=0.5, configure_timeout_s=1.5,
                  source_id=file_identity(model4), vocab_model=str(model4), **HOST)
    assert str(info.value) == (f"no answer from stage 0 ({address}) within 1.5 s while "
                               "configuring (each stage loads its layers)")
    notes = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
    assert notes and notes[0].startswith(f"still waiting for stage 0 ({address}) while "
                                         "configuring"), notes
    with pytest.raises(ValueError, match="configure_timeout_s must be a finite number > 0"):
        StageHost([address], configure_timeout_s=0, source_id=file_identity(model4),
                  vocab_model=str(model4), **HOST)


def test_the_idle_heartbeat_finds_a_hung_stage_and_spares_workers_that_cannot_answer(
        splits, model4):
    """`check_alive` pings every stage; a stopped one breaks the chain after the timeout. A
    worker of an earlier release never answered pings (its `ready` does not say it does): no
    ping is sent to such a chain, rather than taking a healthy one for dead."""
    with LocalStages(splits[2], source_model=model4) as local:
        with local.host(**HOST) as host:
            assert host.answers_ping
            assert host.check_alive(30.0) is None and host.broken is None
            os.kill(local.procs[1].pid, signal.SIGSTOP)
            try:
                host.answers_ping = False  # as with a worker that does not say it answers
                t0 = time.monotonic()
                assert host.check_alive(1.0) is None and host.broken is None
                assert time.monotonic() - t0 < 0.5  # nothing was sent, nothing waited for
                host.answers_ping = True
                broken = host.check_alive(1.0) or ""
            finally:
                os.kill(local.procs[1].pid, signal.SIGCONT)
            assert broken.startswith(f"no answer from stage 1 ({local.addresses[1]}) within "
                                     "1 s while checking that the idle stages answer"), broken
            assert host.broken == broken


def test_a_measurement_a_stage_does_not_answer_breaks_the_chain_with_its_reason(splits,
                                                                                 model4):
    from skippy_scheduler.hosts.stages.channel import StageTimeout

    with LocalStages(splits[2], source_model=model4) as local:
        with local.host(**HOST) as host:
            assert len(host.stage_usage()) == 2
            host.timeout_ms = 1000
            os.kill(local.procs[1].pid, signal.SIGSTOP)
            try:
                with pytest.raises(StageTimeout):
                    host.stage_usage()
            finally:
                os.kill(local.procs[1].pid, signal.SIGCONT)
            assert (host.broken or "").startswith(
                f"no answer from stage 1 ({local.addresses[1]}) within 1 s while asking for "
                "KV use"), host.broken
            assert host.check_alive(30.0) == host.broken  # the reason stays the first one
