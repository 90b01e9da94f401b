"""A stage worker: one stage's layers behind a pyzmq socket (docs/stages.md "Workers").

The worker binds a PULL socket at its listen address and answers what arrives there:

* `conf` (JSON): its place in the chain (index, the next stage's address, the driver's reply
  address), the driver's id and the context settings; the worker (re)creates its llama.cpp
  context and answers `ready` with what its stage file says about itself. Every other message
  must carry that driver id (docs/wire-format.md "Driver id"): one that does not is dropped.
* `plan` (a plan frame, then for a later stage an activation header and data): the worker frees
  the plan's released lanes, runs its rows, and sends the same plan frame (the received zmq frame
  itself, not a copy) with its activations to the next stage; the last stage sends the sampled
  (work index, token) pairs to the driver instead.
* `mem` (JSON memory operations, from the driver to stage 0 and on down the chain): run them,
  pass them on; the last stage answers `mem-done`.
* `samp` (JSON, down the chain like `mem`): the sampling parameters of the new rows of the plan
  of a step; the last stage starts their sampler chains when that plan's new rows arrive.
* `undo` (JSON lanes, starts, releases): the plan did not complete somewhere; rewind its rows.
* `release` (JSON lanes), `held` (what lanes hold KV), `usage` (the KV cells and bytes every
  sequence holds, measured by llama.cpp), `stop`.

Any failure is reported to the driver as `err` with the stage index and the step; the worker
keeps serving.
"""
from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any, Optional

import numpy as np

from ...sampling import SamplingParams
from .channel import DRIVER_FRAME
from .runner import OP_COPY, OP_REMOVE, StageRunner
from .split import read_stage_info
from .wire import WireError, decode_activations, decode_plan, encode_activations, encode_outputs


PARENT_CHECK_MS = 500

log = logging.getLogger(__name__)


def _json(obj: Any) -> bytes:
    return json.dumps(obj).encode()


class StageWorker:
    """The loop of one stage process (see the module docstring)."""

    def __init__(self, model_path: str, listen: str, *, n_threads: Optional[int] = None,
                 parent_pid: Optional[int] = None, offload: Optional[Any] = None) -> None:
        import zmq

        self.info = read_stage_info(model_path)  # fail before binding anything
        self.model_path = model_path
        self.n_threads = n_threads
        self.offload = offload  # hosts.offload.OffloadSpec: where this stage's layers go
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(listen)
        self.address = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)
        self._next: Any = None
        self._reply: Any = None
        self._reply_address: Optional[str] = None  # the driver this worker answers
        # That driver's id (`conf`): every other message must carry it, or it is dropped.
        self._driver: Optional[int] = None
        self._driver_frame: Optional[bytes] = None
        self._runner: Any = None
        # The last stage: sampling of the new rows of a coming plan, lane -> (step, params,
        # the tokens of the prefix the row restores when its chain keeps a penalty window).
        self._sampling: dict[int, tuple[int, Optional[SamplingParams], list[int]]] = {}
        self.index = self.info.index
        self.parent_pid = parent_pid  # stop when this process is no longer the parent

    def _connect(self, which: str, address: Optional[str]) -> Any:
        old = getattr(self, which)
        if old is not None:
            old.close(linger=1000)
        if address is None:
            return None
        sock = self._ctx.socket(self._zmq.PUSH)
        sock.setsockopt(self._zmq.LINGER, 1000)
        sock.connect(address)
        return sock

    def _configure(self, conf: dict[str, Any]) -> None:
        old = self._reply_address
        if self._reply is not None and conf["reply"] != old:
            # Another driver takes this worker (a restarted server, or a second one started by
            # mistake): the first one is told, so its next wait ends with the reason instead
            # of a timeout, and the worker's log says so.
            message = (f"stage {self.index} was configured by another driver (replying to "
                       f"{conf['reply']}); this driver ({old}) no longer has it")
            print(f"skippy-scheduler stage: {message}", file=sys.stderr, flush=True)
            try:
                self._reply.send_multipart([b"err", _json({
                    "index": self.index, "step": -1, "tag": None, "kind": "taken",
                    "driver": self._driver, "message": message})], flags=self._zmq.NOBLOCK)
            except self._zmq.Again:
                pass  # that driver is gone
        self._reply = self._connect("_reply", conf["reply"])
        self._reply_address = conf["reply"]
        driver = conf.get("driver")
        if not (isinstance(driver, int) and 0 <= driver < 2**64):
            # Refused to the driver that sent it; until the next conf nothing is run.
            self._driver, self._driver_frame = None, None
            if self._runner is not None:
                self._runner.close()
                self._runner = None
            raise ValueError(f"conf carries no driver id (got {driver!r}): a driver of an "
                             "earlier release")
        self._driver, self._driver_frame = driver, DRIVER_FRAME.pack(driver)
        self._sampling.clear()  # what an earlier driver sent matches none of this one's plans
        self._next = self._connect("_next", conf.get("next"))
        if self._runner is not None:
            self._runner.close()
            self._runner = None
        threads = self.n_threads or int(conf.get("n_threads", 2))
        self._runner = StageRunner(self.model_path, n_ctx=int(conf["n_ctx"]),
                                   n_seq_max=int(conf["n_seq_max"]),
                                   n_batch=int(conf["n_batch"]), n_threads=threads,
                                   kv_type=str(conf.get("kv_type", "f32")),
                                   flash_attn=bool(conf.get("flash_attn", False)),
                                   offload=self.offload)
        r = self._runner
        i = self.info
        # Replies name the worker by its place in the chain; its file says which stage it is.
        self.index = int(conf["index"])
        self._reply.send_multipart([b"ready", _json({
            "index": self.index, "tag": conf.get("tag"), "stage_index": i.index,
            "count": i.count, "layer_start": i.layer_start,
            "layer_end": i.layer_end, "source_layers": i.source_layers,
            "source_id": i.source_id, "source_name": i.source_name, "path": i.path,
            "n_embd": r.n_embd, "n_vocab": r.n_vocab, "n_ctx": r.n_ctx,
            "n_batch": r.n_batch, "kv_bytes_per_token": r.kv_bytes_per_token,
            "answers_ping": True, "driver": driver})])

    def _plan(self, parts: list[Any]) -> None:
        """Run a plan (its driver id checked by `serve`). Everything is checked against what
        the plan's releases and restores would leave before any of it is done."""
        runner = self._runner
        view = decode_plan(parts[1].buffer)
        if runner.first and len(parts) != 3:
            raise WireError(f"the first stage's plan message has {len(parts)} parts, not 3 "
                            "(plan frame, driver id)")
        if not runner.first and len(parts) != 5:
            raise WireError(f"a later stage's plan message has {len(parts)} parts, not 5: it "
                            "must carry activations (header, data) before the driver id")
        lanes = view.row_lanes
        offsets = view.row_offsets.astype(np.int64)
        n = int(offsets[-1])
        embd = None
        if not runner.first:
            embd = decode_activations(parts[2].buffer, parts[3].buffer, view.step, n,
                                      runner.n_embd)
        released = view.release_lanes.tolist()
        gone = set(released)

        def held(lane: int) -> int:  # positions once the releases ran
            return 0 if lane in gone else runner.held(lane)

        # A new row starts on an empty lane, from position 0 or from a holder's prefix.
        ops: list[list[int]] = []
        begins: dict[int, int] = {}  # a new row's lane -> the positions it holds once restored
        for r in view.new_rows.tolist():
            lane, start = int(lanes[r]), int(view.positions[offsets[r]])
            holder = int(view.row_restore[r])
            ops.append([OP_REMOVE, lane, -1, -1, 0])
            if holder >= 0:
                has = held(holder) if 0 <= holder < runner.n_seq_max else 0
                if has < start:
                    raise ValueError(f"new row {r} restores {start} positions from holder "
                                     f"{holder}, which holds {has}")
                ops.append([OP_COPY, holder, lane, 0, start])
            elif start != 0:
                raise ValueError(f"new row {r} starts at {start} without a restore")
            begins[lane] = start
        runner.check_ops(ops)
        runner.check_rows(lanes, view.positions[offsets[:-1]],
                          lambda lane: begins.get(lane, held(lane)))
        # Checked: from here on the plan changes the stage.
        for lane in released:
            runner.release(lane)
            self._forget_sampling(lane, keep_step=view.step)
        runner.apply_ops(ops)
        if runner.last:  # every new row's sequence starts its sampler (none: greedy)
            for lane in begins:
                step, params, prefix = self._sampling.pop(lane, (-1, None, []))
                if step != view.step:
                    params, prefix = None, []
                runner.start_sampling(lane, params, prefix)
        out = runner.run(lanes, offsets, view.positions, view.sample_rows,
                         tokens=view.tokens if runner.first else None, embd=embd,
                         feed_tokens=view.tokens if runner.last else None)
        if runner.last:
            self._reply.send_multipart([b"out", encode_outputs(view.step, view.sample_rows,
                                                               out), self._driver_frame])
        else:
            head, rows = encode_activations(view.step, out)
            # The plan frame goes on as received; the activations are copied into the message
            # because the capture buffer is rewritten by the next decode.
            self._next.send_multipart([b"plan", parts[1], head, rows, self._driver_frame],
                                      copy=True)

    def _forget_sampling(self, lane: int, keep_step: Optional[int] = None) -> None:
        """Drop the sampling kept for `lane`'s next new row (the last stage), but that of the
        plan of `keep_step`: the lane was freed, so what a plan that never came left for it
        must not reach the lane's next sequence."""
        entry = self._sampling.get(lane)
        if entry is not None and entry[0] != keep_step:
            del self._sampling[lane]

    def _undo(self, body: dict[str, Any]) -> None:
        runner = self._runner
        for lane in body.get("release", []):
            runner.release(int(lane))
            self._forget_sampling(int(lane))
        for lane, start in zip(body.get("lanes", []), body.get("starts", [])):
            self._forget_sampling(int(lane))  # the undone plan's new rows never start
            if start == 0:
                runner.release(int(lane))
            else:
                runner.rewind(int(lane), int(start))
        self._reply.send_multipart([b"undone", _json({"index": self.index,
                                                       "tag": body.get("tag")})])

    def _coming_sampling(self, body: dict[str, Any]) -> dict[
            int, tuple[int, Optional[SamplingParams], list[int]]]:
        """A `samp` message, read and checked whole before the last stage keeps any of it:
        lane -> (step, params, the restored prefix's tokens for the penalty window)."""
        step = int(body["step"])
        prefixes = body.get("prefixes", {})
        n_vocab = self._runner.n_vocab
        out = {}
        for lane, params in body["lanes"].items():
            prefix = [int(t) for t in prefixes.get(lane, ())]
            if any(not 0 <= t < n_vocab for t in prefix):
                raise ValueError(f"lane {lane}'s restored prefix has tokens outside "
                                 f"[0, {n_vocab})")
            out[int(lane)] = (step, None if params is None else SamplingParams(**params),
                              prefix)
        return out

    def serve(self) -> None:
        """Answer messages until `stop`."""
        while True:
            if self.parent_pid is not None:
                # A worker started for a driver goes away with it, even when the driver was
                # killed and could not stop it (it is then no longer this process's parent).
                while not self._pull.poll(PARENT_CHECK_MS):
                    if os.getppid() != self.parent_pid:
                        return
            parts = self._pull.recv_multipart(copy=False)
            kind = parts[0].bytes
            if kind == b"stop":
                break
            step, tag = -1, None
            try:
                if kind == b"plan":
                    if len(parts) < 3 or parts[-1].bytes != self._driver_frame:
                        log.debug("dropped a plan message without this worker's driver id")
                        continue
                    if len(parts[1]) >= 24:
                        step = int(np.frombuffer(parts[1].buffer, np.uint64, 1, 16)[0])
                    if self._runner is not None:
                        self._plan(parts)
                    continue
                body = json.loads(parts[1].bytes) if len(parts) > 1 else {}
                if not isinstance(body, dict):
                    raise ValueError(f"a {kind!r} message is not a JSON object")
                tag = body.get("tag")
                if kind == b"conf":
                    self._configure(body)
                    continue
                if self._runner is None or self._reply is None:
                    continue  # nothing to answer to before a conf
                if body.get("driver") != self._driver:
                    # An earlier driver's message, still travelling (or sent by one that has
                    # not heard that another took this worker): not this driver's to run.
                    log.debug("dropped a %r message of driver %r", kind, body.get("driver"))
                    continue
                if kind == b"undo":
                    self._undo(body)
                elif kind == b"samp":
                    # The sampling of a coming plan's new rows travels down the chain before
                    # it; the last stage keeps it for the plan of that step.
                    if self._next is not None:
                        self._next.send_multipart([b"samp", parts[1]], copy=True)
                    else:
                        self._sampling.update(self._coming_sampling(body))
                elif kind == b"mem":
                    # Memory operations travel down the chain as plans do: each stage runs
                    # them in order with the plans, the last one answers.
                    self._runner.apply_ops(body["ops"])
                    for op in body["ops"]:
                        if op[0] == OP_REMOVE and op[2] <= 0:  # the lane is emptied
                            self._forget_sampling(int(op[1]))
                    if self._next is not None:
                        self._next.send_multipart([b"mem", parts[1]], copy=True)
                    else:
                        self._reply.send_multipart([b"mem-done", _json({"index": self.index,
                                                                        "tag": tag})])
                elif kind == b"release":
                    for lane in body["lanes"]:
                        self._runner.release(int(lane))
                        self._forget_sampling(int(lane))
                    self._reply.send_multipart([b"released", _json({"index": self.index,
                                                                    "tag": tag})])
                elif kind == b"held":
                    self._reply.send_multipart([b"held", _json({
                        "index": self.index, "tag": tag,
                        "samplers": len(self._runner.samplers or ()),
                        "lanes": {str(k): self._runner.held(k)
                                  for k in self._runner.held_lanes()}})])
                elif kind == b"ping":
                    self._reply.send_multipart([b"pong", _json({"index": self.index,
                                                                "tag": tag})])
                elif kind == b"usage":
                    self._reply.send_multipart([b"usage", _json({
                        "index": self.index, "tag": tag,
                        "kv_bytes_per_token": self._runner.kv_bytes_per_token,
                        "seqs": {str(k): list(v)
                                 for k, v in self._runner.measure_kv().items()}})])
            except Exception as exc:
                if self._reply is not None:
                    self._reply.send_multipart([b"err", _json({
                        "index": self.index, "step": step, "tag": tag,
                        "driver": self._driver, "kind": kind.decode("ascii", "replace"),
                        "message": f"{type(exc).__name__}: {exc}"})])

    def close(self) -> None:
        if self._runner is not None:
            self._runner.close()
            self._runner = None
        for sock in (self._next, self._reply, self._pull):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
