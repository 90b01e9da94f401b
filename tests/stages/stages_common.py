"""Constants and the random schedule trial the staged-serving tests share (importable:
conftest modules are not)."""
import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import time
from unittest import mock

import numpy as np

from skippy_scheduler import MemoryComponent, SchedulerConfig
from skippy_scheduler.cost_model import LAB_COST
from skippy_scheduler.engine import Engine, Request, VirtualClock
from skippy_scheduler.hosts.tiny_model import TinyModelShape

N_SEQ = 8
MAX_GEN = 10
SHAPE = TinyModelShape(n_layer=4)

KV_BYTES = 10**9


@contextlib.contextmanager
def lane_outside_the_stages(host):
    """Meanwhile every plan frame names the lane the host hands out next as one outside every
    stage's context (N_SEQ + 3): the first stage refuses the rows of the sequence it admits."""
    from skippy_scheduler.hosts.stages import host as host_module

    held = {host._lanes.lane_of(s) for s in host.active_sequences}
    lane = min(set(range(host.n_seq_max)) - held)
    encode_plan = host_module.encode_plan

    def encode(**frame):
        frame["row_lanes"] = np.where(frame["row_lanes"] == lane, N_SEQ + 3, frame["row_lanes"])
        return encode_plan(**frame)

    with mock.patch.object(host_module, "encode_plan", encode):
        yield


def random_trial(impl, host, alone, seed: int, counters: dict, **extra) -> None:
    rng = random.Random(seed)
    n = rng.randrange(3, 10)
    requests = []
    for i in range(n):
        if requests and rng.random() < 0.15:  # a full-prompt duplicate of an earlier request
            prompt = list(rng.choice(requests).prompt_tokens)
        else:
            plen = rng.choice([1, 2, rng.randrange(3, 30), rng.randrange(30, 100)])
            prompt = [1] + [rng.randrange(3, 384) for _ in range(plen - 1)]
        requests.append(Request(f"r{i}", prompt, rng.randrange(1, MAX_GEN + 1),
                                arrival_us=rng.choice([0.0, rng.uniform(0, 3000)])))
    config = dict(
        max_active_sequences=rng.randrange(1, N_SEQ + 1),
        max_tokens_per_iteration=rng.choice([8, 16, 64, 512]),
        prefill_chunk_tokens=rng.choice([1, 3, 8, 32, 256]),
        mixed_prefill_decode=rng.random() < 0.8,
        memory_components=[MemoryComponent("kv", KV_BYTES, 0, 1, 0)],
        **extra,
    )
    if host.prefix_store is not None:
        config.update(host.sequence_id_settings)
    scheduler = impl(SchedulerConfig(**config))
    reserved = {r.id: len(r.prompt_tokens) + r.max_tokens for r in requests}
    p_preempt, p_cancel = rng.uniform(0, 0.15), rng.uniform(0, 0.05)

    def pressure(engine):
        roll = rng.random()
        if roll < p_preempt:  # a usage spike evicts a sequence, then the usage is measured again
            counters["preempted"] += len(engine.preempt([KV_BYTES + 1]))
            engine.preempt([sum(reserved[a] for a in scheduler.snapshot().active_ids)])
        elif roll < p_preempt + p_cancel and engine.open_ids():
            counters["cancelled"] += engine.cancel(rng.choice(engine.open_ids()))

    engine = Engine(scheduler, host, clock=VirtualClock(LAB_COST), before_step=pressure,
                    max_iterations=5000)
    engine.add_requests(sorted(requests, key=lambda r: r.arrival_us))
    report = engine.run()
    counters["mixed"] += report.phase_mix()[2]
    counters["recompute"] += scheduler.metrics().recompute_tokens
    by_id = {r.id: r for r in report.records}
    for req in requests:
        got = by_id[req.id]
        want = alone(req.prompt_tokens, req.max_tokens)
        if got.finish_reason == "cancelled":  # what it had so far is a prefix of its tokens
            want = want[: len(got.tokens)]
        elif got.finish_reason == "stop":  # the alone run ends at the same end-of-generation
            assert want and host.is_eog(want[-1]), (seed, req.id, want)
            want = want[:-1]
            counters["completed"] += 1
        else:
            assert got.finish_reason == "length", (seed, req.id, got.finish_reason)
            counters["completed"] += 1
        assert got.tokens == want, (seed, req.id, config)
    counters["restored"] = counters.get("restored", 0) + scheduler.metrics().restored_tokens
    if host.prefix_store is not None:
        scheduler.attach_prefix_store(None)  # the store serves the next trial's scheduler
    assert host.active_sequences == []
    host.sync()
    assert host.held() == [{}] * len(host.stages), seed  # no stage keeps KV of ended requests


def listen_workers(tmp_path, stage_dir) -> tuple[list[subprocess.Popen], list[str]]:
    """`stage --listen tcp://127.0.0.1:*` workers, one a stage of `stage_dir` (ports chosen by
    the system), and the address each printed."""
    from skippy_scheduler.hosts.stages.split import stage_paths

    procs, logs, addresses = [], [], []
    for k, path in enumerate(stage_paths(stage_dir)):
        log = tmp_path / f"w{k}.log"
        with open(log, "wb") as err:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "skippy_scheduler.cli", "stage", "-m", path,
                 "--listen", "tcp://127.0.0.1:*", "-t", "1"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, cwd=tmp_path))
        logs.append(log)
    for log in logs:
        deadline = time.monotonic() + 60
        while not (m := re.search(r"listening on (tcp://\S+)", log.read_text())):
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        addresses.append(m.group(1))
    return procs, addresses


def stop_workers(procs: list[subprocess.Popen]) -> None:
    """Terminate the workers (a stopped one is continued first), killing one that lingers."""
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=60)  # a loaded machine may take a while to run the exit
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
