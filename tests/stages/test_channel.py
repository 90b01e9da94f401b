"""The driver's side of the stage sockets, against fake stages (threads that answer as a worker
would, or wrongly): one deadline per wait however many stale answers arrive, malformed or
out-of-range answers are stage failures, answers to another driver are dropped, and a channel
that cannot be made leaves nothing behind."""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import threading
import time

import numpy as np
import pytest

zmq = pytest.importorskip("zmq")

from skippy_scheduler.hosts.stages.channel import (StageChannel, StageFailure,  # noqa: E402
                                                   StageTimeout)
from skippy_scheduler.hosts.stages.wire import encode_outputs  # noqa: E402


class FakeStages:
    """Stages at `addresses` served by one thread: `answer(k, parts, body)` returns the
    messages stage k sends the driver for each message it gets (by default the answer a
    worker gives a control message). `conf` is answered `ready` with `infos[k]`."""

    def __init__(self, tmp_path, n: int, answer=None, infos=None) -> None:
        self.ctx = zmq.Context()
        self.addresses = [f"ipc://{tmp_path}/fake-{k}" for k in range(n)]
        self.pulls = []
        for a in self.addresses:
            sock = self.ctx.socket(zmq.PULL)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(a)
            self.pulls.append(sock)
        self.push = None
        self.answer = answer or (lambda k, parts, body: None)
        self.infos = infos
        self.driver = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        for sock in self.pulls:
            poller.register(sock, zmq.POLLIN)
        while not self.stop.is_set():
            for sock, _ in poller.poll(50):
                k = self.pulls.index(sock)
                parts = sock.recv_multipart()
                body = json.loads(parts[1]) if parts[0] != b"plan" else {}
                if parts[0] == b"conf":
                    self.driver = body["driver"]
                    if self.push is None:
                        self.push = self.ctx.socket(zmq.PUSH)
                        self.push.setsockopt(zmq.LINGER, 0)
                        self.push.connect(body["reply"])
                for msg in self._answers(k, parts, body):
                    self.push.send_multipart(msg)

    def _answers(self, k, parts, body):
        got = self.answer(k, parts, body)
        if got is not None:
            return got
        kind = parts[0]
        reply = {"index": k, "tag": body.get("tag"), "driver": self.driver}
        if kind == b"conf":
            i = self.infos[k]
            reply.update(dataclasses.asdict(i), stage_index=i.index, n_embd=64, n_vocab=0,
                         n_ctx=body["n_ctx"], n_batch=body["n_batch"], kv_bytes_per_token=4,
                         answers_ping=True)
            return [[b"ready", json.dumps(reply).encode()]]
        names = {b"ping": b"pong", b"undo": b"undone", b"release": b"released"}
        if kind in names:
            return [[names[kind], json.dumps(reply).encode()]]
        return []

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        for sock in self.pulls + ([self.push] if self.push is not None else []):
            sock.close(linger=0)
        self.ctx.term()


def _ping(channel: StageChannel) -> list:
    channel._broadcast(b"ping", {})
    return channel._collect(b"pong", "pinging")


def test_stale_answers_do_not_keep_a_wait_alive(tmp_path):
    """A stage that keeps answering an earlier message but never the one waited for: the wait
    ends at the timeout, counted from its start, not from the last message received."""
    def chatter(k, parts, body):
        for _ in range(30):  # 3 s of answers to a tag the driver no longer waits for
            yield [b"pong", json.dumps({"index": k, "tag": -1}).encode()]
            time.sleep(0.1)

    fake = FakeStages(tmp_path, 1, answer=lambda k, p, b: chatter(k, p, b))
    channel = StageChannel(fake.addresses, None, 1.0, [])
    fake.push = fake.ctx.socket(zmq.PUSH)
    fake.push.connect(channel.reply_address)
    guard = threading.Timer(8.0, lambda: channel.interrupt("the wait did not end"))
    guard.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(StageTimeout, match="within 1 s while pinging"):
            _ping(channel)
        assert time.monotonic() - t0 < 2.5
    finally:
        guard.cancel()
        channel.close_channel()
        fake.close()


@pytest.mark.parametrize("reply, says", [
    (b"{not json", "malformed 'pong' answer: Expecting property name"),
    (b"[1, 2]", "malformed 'pong' answer: a JSON list, not an object"),
    (b'{"tag": 1}', "malformed 'pong' answer: no stage index (None)"),
    (b"\xff\xfe", "malformed 'pong' answer"),
])
def test_a_malformed_answer_is_a_stage_failure(tmp_path, reply, says):
    fake = FakeStages(tmp_path, 1, answer=lambda k, p, b: [[b"pong", reply]])
    channel = StageChannel(fake.addresses, None, 5.0, [])
    fake.push = fake.ctx.socket(zmq.PUSH)
    fake.push.connect(channel.reply_address)
    try:
        with pytest.raises(StageFailure, match="a stage sent a " + says.replace("(", r"\(")
                           .replace(")", r"\)").replace("[", r"\[")):
            _ping(channel)
    finally:
        channel.close_channel()
        fake.close()


def test_answers_to_another_driver_are_dropped(tmp_path):
    """An output frame or a plan error that carries another driver's id (a worker that
    ran an earlier driver's plan) is not this driver's answer; its own id's is."""
    channel = StageChannel([f"ipc://{tmp_path}/nobody"], None, 5.0, [])
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(channel.reply_address)
    other = (channel.driver ^ 1).to_bytes(8, "little")
    frame = encode_outputs(0, [0], [7])
    try:
        channel.awaited.add(0)
        push.send_multipart([b"out", frame, other])
        push.send_multipart([b"out", frame])  # no id at all
        push.send_multipart([b"err", json.dumps({
            "index": 0, "step": 0, "tag": None, "kind": "plan", "driver": channel.driver ^ 1,
            "message": "not yours"}).encode()])
        for _ in range(3):
            channel._pump("receiving")
        assert channel.terminal == {} and channel.chain_errors == []
        push.send_multipart([b"out", frame, channel.driver_frame])
        channel._pump("receiving")
        assert channel.terminal[0][0] == "out" and channel.terminal[0][2].tolist() == [7]
    finally:
        push.close(linger=0)
        ctx.term()
        channel.close_channel()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
def test_a_channel_that_cannot_be_made_leaves_nothing_behind(tmp_path):
    def reply_dirs():
        return {d for d in os.listdir(tempfile.gettempdir()) if d.startswith("skippy-reply-")}

    before, fds = reply_dirs(), _open_fds()
    for addresses in ([f"ipc://{tmp_path}/ok", "bogus://x"], ["tcp://no-such-host.invalid:5600"]):
        with pytest.raises((zmq.ZMQError, OSError)):
            StageChannel(addresses, None, 1.0, [])
    assert reply_dirs() == before
    assert _open_fds() == fds


# ---------------------------------------------------------------------- against a StageHost
@pytest.fixture
def fake_chain(tmp_path, splits, model4):
    """fake stages of the 2-stage split that answer plans with `answer_plan(parts)`, and a
    `StageHost` on them."""
    pytest.importorskip("llama_cpp")
    from skippy_scheduler.hosts.stages.host import StageHost
    from skippy_scheduler.hosts.stages.split import read_stage_info, stage_paths

    infos = [read_stage_info(p) for p in stage_paths(splits[2])]
    plan_answer = {}

    def answer(k, parts, body):
        if parts[0] == b"plan":
            return plan_answer["fn"](parts)
        return None

    fake = FakeStages(tmp_path, 2, answer=answer, infos=infos)
    host = StageHost(fake.addresses, n_ctx=1024, n_seq_max=2, n_batch=64, timeout_s=5.0,
                     vocab_model=str(model4))
    try:
        yield host, plan_answer
    finally:
        host.close()
        fake.close()


def _step(host):
    from skippy_scheduler import Scheduler, SchedulerConfig
    from skippy_scheduler.cost_model import LAB_COST
    from skippy_scheduler.engine import Engine, Request, VirtualClock

    engine = Engine(Scheduler(SchedulerConfig(max_active_sequences=1,
                                              max_tokens_per_iteration=64)),
                    host, clock=VirtualClock(LAB_COST))
    engine.submit(Request("r", [1, 2, 3], 2))
    engine.step()


def test_tokens_outside_the_vocabulary_fail_the_plan(fake_chain):
    host, plan_answer = fake_chain

    def out(parts):
        step = int(np.frombuffer(parts[1], np.uint64, 1, 16)[0])
        return [[b"out", encode_outputs(step, [0], [host.n_vocab]), parts[-1]]]

    plan_answer["fn"] = out
    with pytest.raises(StageFailure, match=rf"tokens outside \[-1, {host.n_vocab}\)"):
        _step(host)
    assert host.broken is None  # undone on every stage, as for a stage's own error


def test_a_malformed_plan_error_is_undone_as_a_stage_failure(fake_chain):
    host, plan_answer = fake_chain
    plan_answer["fn"] = lambda parts: [[b"err", b"{oops"]]
    with pytest.raises(StageFailure, match="a stage sent a malformed 'err' answer"):
        _step(host)
    assert host.broken is None and host.active_sequences == []
