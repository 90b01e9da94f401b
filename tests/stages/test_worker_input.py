"""What a stage worker takes from its socket (docs/wire-format.md "Driver id", docs/stages.md
"Workers"): a message without its driver's id is dropped unanswered, a `conf` is checked whole
before it changes anything, this driver's messages are checked whole before they change a lane,
replies never wait for a driver that stopped reading, and a frame over the worker's limit only
drops its sender's connection."""
from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("llama_cpp")
zmq = pytest.importorskip("zmq")

from skippy_scheduler import MemoryComponent, Scheduler, SchedulerConfig  # noqa: E402
from skippy_scheduler.cost_model import LAB_COST  # noqa: E402
from skippy_scheduler.engine import Engine, Request, VirtualClock  # noqa: E402
from skippy_scheduler.hosts.stages.local import LocalStages  # noqa: E402
from skippy_scheduler.hosts.stages.runner import OP_COPY, OP_REMOVE  # noqa: E402
from skippy_scheduler.hosts.stages.wire import encode_plan  # noqa: E402
from skippy_scheduler.hosts.stages.worker import (  # noqa: E402
    DEFAULT_MAX_BATCH_TOKENS, frame_limit)

from stages_common import N_SEQ  # noqa: E402

HOST = dict(n_ctx=N_SEQ * 512, n_seq_max=N_SEQ, n_batch=512, n_threads=1)
PROMPT = [1, 20, 30, 40]


@pytest.fixture(scope="module")
def local2(splits, model4):
    with LocalStages(splits[2], source_model=model4) as local:
        yield local


@pytest.fixture
def push():
    """push(address) -> a PUSH socket to it, closed after the test."""
    ctx = zmq.Context()
    socks = []

    def make(address: str):
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        socks.append(sock)
        return sock
    yield make
    for sock in socks:
        sock.close(linger=0)
    ctx.term()


def _greedy(host, n: int = 6) -> list[int]:
    scheduler = Scheduler(SchedulerConfig(
        max_active_sequences=2, max_tokens_per_iteration=64,
        memory_components=[MemoryComponent("kv", 10**9, 0, 1, 0)]))
    engine = Engine(scheduler, host, clock=VirtualClock(LAB_COST), max_iterations=500)
    engine.add_requests([Request("g", PROMPT, n)])
    return engine.run().records[0].tokens


def _still_serves(local, host, alone) -> None:
    """The worker processes run, the host's chain is whole and answers, tokens are right."""
    assert all(p.poll() is None for p in local.procs)
    assert host.check_alive(60.0) is None, host.broken
    assert host.chain_errors == []
    assert _greedy(host) == alone(PROMPT, 6)


def _body(host, **fields) -> bytes:
    return json.dumps(dict(fields, driver=host.driver)).encode()


def _answers(host, seconds: float, tags: frozenset = frozenset()) -> list[list[bytes]]:
    """Every raw message on the host's reply socket within `seconds`, or until answers with
    each of `tags` have come."""
    out = []
    seen = set()
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0 and not (tags and tags <= seen):
        if host._reply.poll(int(left * 1e3) + 1):
            out.append(host._reply.recv_multipart())
            seen.add(json.loads(out[-1][1]).get("tag"))
    return out


def test_messages_without_this_drivers_id_are_dropped_unanswered(local2, alone, push):
    """Garbage, JSON that is not an object, a message of no driver and `stop` (which is no
    longer a verb) reach both stages: none is answered, none breaks the chain or the worker."""
    with local2.host(**HOST) as host:
        for address in local2.addresses:
            sock = push(address)
            for parts in ([b"samp", b"[]"], [b"samp", b"{not json"], [b"mem", b"\xff\xfe"],
                          [b"ping", b"{}"], [b"stop"], [b"held", b"{}", b"{}"],
                          [b"mem", json.dumps({"ops": [[OP_REMOVE, 0, -1, -1, 0]],
                                               "driver": host.driver ^ 1}).encode()]):
                sock.send_multipart(parts)
        assert _answers(host, 1.0) == []
        _still_serves(local2, host, alone)


def test_a_refused_conf_leaves_the_driver_in_charge(local2, alone, push, tmp_path):
    """Confs that cannot be taken (no driver id, a reply address of no transport, a batch
    over the worker's limit, a field of the wrong type) are answered at their own reply
    address where there is one, and the worker goes on serving the driver it had."""
    ctx = zmq.Context()
    sender = ctx.socket(zmq.PULL)
    sender.setsockopt(zmq.LINGER, 0)
    sender.bind(f"ipc://{tmp_path}/other-driver")
    other = sender.getsockopt_string(zmq.LAST_ENDPOINT)
    good = dict(index=1, reply=other, next=None, driver=7, n_ctx=1024, n_seq_max=2,
                n_batch=64, n_threads=1, tag=1)
    try:
        with local2.host(**HOST) as host:
            sock = push(local2.addresses[1])
            for conf, says in [
                    (dict(good, driver=None), "conf carries no driver id"),
                    (dict(good, n_batch=DEFAULT_MAX_BATCH_TOKENS + 1), "--max-batch-tokens"),
                    (dict(good, n_ctx="1024"), "'n_ctx' must be an integer"),
                    (dict(good, kv_type="q2"), "'kv_type' must be one of"),
                    (dict(good, next="bogus://x"), "'next' must be a pyzmq address"),
                    (dict(good, reply="bogus://x"), None)]:  # nowhere to answer
                sock.send_multipart([b"conf", json.dumps(conf).encode()])
                if says is None:
                    continue
                assert sender.poll(10_000), conf
                kind, body = sender.recv_multipart()
                assert kind == b"err" and says in json.loads(body)["message"], body
            assert not sender.poll(500)
            _still_serves(local2, host, alone)
    finally:
        sender.close(linger=0)
        ctx.term()
    with open(local2.logs[1]) as f:
        assert "refused a conf" in f.read()


def test_a_plan_with_a_token_outside_the_vocabulary_changes_nothing(local2, push):
    """Stage 0 gets a plan that releases the running sequence's lane and carries a token id
    past the vocabulary: refused before the release runs."""
    with local2.host(**HOST) as host:
        scheduler = Scheduler(SchedulerConfig(
            max_active_sequences=2, max_tokens_per_iteration=64,
            memory_components=[MemoryComponent("kv", 10**9, 0, 1, 0)]))
        engine = Engine(scheduler, host, clock=VirtualClock(LAB_COST), max_iterations=50)
        engine.submit(Request("keep", [1, 40, 41, 42, 43], 8))
        engine.step()
        host.sync()
        before = host.held()
        lane = next(iter(before[0]))
        frame = encode_plan(step=900, serial=0, row_offsets=[0, 1], row_lanes=[lane + 1],
                            tokens=[10**6], positions=[0], sample_last=[1], phases=[0],
                            new_rows=[0], release_lanes=[lane])
        push(local2.addresses[0]).send_multipart([b"plan", frame, host.driver_frame])
        parts = host._recv("waiting for the refusal")
        assert parts[0] == b"err" and b"tokens must be in [0," in parts[1], parts
        assert host.held() == before
        engine.cancel("keep")


def test_memory_operations_and_coming_sampling_are_checked_whole(local2, alone, push):
    """A memory message whose second operation is not integers runs none of them; sampling
    for a lane outside the stage, or with a token outside the vocabulary, is refused when it
    arrives, not when its plan has been decoded."""
    with local2.host(**HOST) as host:
        host.sync()
        before = host.held(holders=True)
        last = push(local2.addresses[1])
        last.send_multipart([b"mem", _body(host, tag=501, ops=[
            [OP_COPY, 0, 2, 0, -1], [OP_REMOVE, 1.5, -1, -1, 0]])])
        last.send_multipart([b"samp", _body(host, tag=502, step=3, lanes={"99": None})])
        last.send_multipart([b"samp", _body(host, tag=503, step=3, lanes={
            "0": {"temperature": 1.0, "seed": 1, "min_end_tokens": [10**5],
                  "min_end_position": 4}})])
        got = {json.loads(p[1])["tag"]: json.loads(p[1])["message"]
               for p in _answers(host, 60.0, frozenset({501, 502, 503}))}
        assert "list of five integers" in got[501]
        assert "lane '99', outside" in got[502]
        assert "min_end_tokens" in got[503]
        assert host.held(holders=True) == before
        _still_serves(local2, host, alone)


def test_a_driver_that_stopped_reading_does_not_stall_the_worker(local2, model4, alone, push):
    """The first driver goes away without its worker knowing, and messages with its id keep
    coming (more than a socket queues): the worker drops the replies nobody takes instead of
    waiting, and a new driver configures it at once."""
    first = local2.host(**HOST)
    driver = first.driver
    first.close()
    sock = push(local2.addresses[1])
    ping = json.dumps({"driver": driver, "tag": 1}).encode()
    for _ in range(1500):
        sock.send_multipart([b"ping", ping])
    # (A worker that waited for the first driver would not answer this conf at all.)
    with local2.host(**dict(HOST, configure_timeout_s=60.0)) as second:
        _still_serves(local2, second, alone)


def test_the_driver_learns_at_once_that_another_driver_took_a_stage(local2, model4):
    """A control wait (the idle heartbeat) ends with the reason when the answer is that
    another driver took the stage, not with a timeout naming no reason."""
    with local2.host(**HOST) as first:
        with local2.host(**HOST):
            why = first.check_alive(30.0)
            assert "configured by another driver" in (why or ""), why


def test_a_frame_over_the_limit_drops_only_its_connection(local2, alone, push):
    """A ping padded past the worker's frame limit is not taken (libzmq drops the sender's
    connection); the driver's own connection and the chain are unaffected."""
    info_width = 64  # the tiny model's embedding width, or less
    limit = frame_limit(info_width, DEFAULT_MAX_BATCH_TOKENS)
    with local2.host(**HOST) as host:
        assert host.n_embd <= info_width
        big = _body(host, tag=777, pad="x" * (limit + 1))
        push(local2.addresses[1]).send_multipart([b"ping", big])
        del big
        assert not any(json.loads(p[1]).get("tag") == 777 for p in _answers(host, 2.0))
        _still_serves(local2, host, alone)


def test_local_workers_take_the_drivers_batch(splits, model4):
    """A driver asking a batch over a worker's default limit starts its local workers with
    that limit (a worker with the default refuses it by name: the refused-conf test)."""
    with LocalStages(splits[2], source_model=model4,
                     n_batch=DEFAULT_MAX_BATCH_TOKENS + 8) as local:
        assert all(f"--max-batch-tokens {DEFAULT_MAX_BATCH_TOKENS + 8}" in " ".join(p.args)
                   for p in local.procs)


def test_messages_that_break_a_parser_or_an_encoder_leave_the_worker_serving(local2, alone,
                                                                              push, tmp_path):
    """JSON nested past the parser's depth, a conf whose reply address pyzmq cannot encode,
    a tag nested too deep to encode again, a kv_type that is not a name: each is dropped or
    refused, and the worker goes on serving its driver."""
    ctx = zmq.Context()
    sender = ctx.socket(zmq.PULL)
    sender.setsockopt(zmq.LINGER, 0)
    sender.bind(f"ipc://{tmp_path}/other")
    other = sender.getsockopt_string(zmq.LAST_ENDPOINT)
    try:
        with local2.host(**HOST) as host:
            sock = push(local2.addresses[1])
            sock.send_multipart([b"ping", b"[" * 100_000])
            sock.send_multipart([b"conf", json.dumps({"reply": "tcp://\ud800:1"}).encode()])
            deep = json.loads("[" * 900 + "]" * 900)
            sock.send_multipart([b"ping", json.dumps({"driver": host.driver, "tag": deep})
                                 .encode()])
            sock.send_multipart([b"conf", json.dumps(dict(
                index=1, reply=other, driver=7, n_ctx=1024, n_seq_max=2, n_batch=64,
                kv_type=[])).encode()])
            assert sender.poll(60_000)
            kind, body = sender.recv_multipart()
            assert kind == b"err" and "'kv_type' must be one of" in json.loads(body)["message"]
            _still_serves(local2, host, alone)
    finally:
        sender.close(linger=0)
        ctx.term()
