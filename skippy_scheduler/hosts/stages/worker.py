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
  sequence holds, measured by llama.cpp).

A `conf` is checked whole (and its sockets connected) before it changes anything: one that is
refused is answered `err` at its own reply address, and the driver the worker serves keeps it.
A failure of this driver's message is reported to it as `err` with the stage index and the
step; a message that does not carry its id, or is not what its kind must be, is dropped without
an answer. The worker keeps serving either way. Replies never block: one the driver does not
take (a driver that went away) is dropped. No frame may be larger than the activations of
`max_batch_tokens` tokens plus `MESSAGE_FLOOR` bytes; libzmq drops a connection that sends one.
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
from ..llama.backend import KV_TYPES
from .runner import OP_COPY, OP_REMOVE, StageRunner
from .split import read_stage_info
from .wire import (DEFAULT_MAX_BATCH_TOKENS, WireError, decode_activations, decode_plan,
                   encode_activations, encode_outputs, frame_limit)


PARENT_CHECK_MS = 500
NEXT_SEND_TIMEOUT_MS = 30_000  # a next stage that takes no message for this long is stuck
ADDRESS_SCHEMES = ("tcp", "ipc", "inproc")

log = logging.getLogger(__name__)


def _json(obj: Any) -> bytes:
    return json.dumps(obj).encode()


class ConfRefused(ValueError):
    """A `conf` the worker does not take; nothing was changed."""


def _count(conf: dict[str, Any], name: str, default: Any = None, low: int = 1) -> int:
    value = conf.get(name, default)
    if not (isinstance(value, int) and not isinstance(value, bool) and low <= value < 2**31):
        raise ConfRefused(f"conf field {name!r} must be an integer in [{low}, 2^31), got "
                          f"{value!r:.80}")
    return value


def _address(conf: dict[str, Any], name: str) -> str:
    value = conf.get(name)
    if not (isinstance(value, str) and value.partition("://")[0] in ADDRESS_SCHEMES
            and value.partition("://")[2]):
        raise ConfRefused(f"conf field {name!r} must be a pyzmq address (tcp://, ipc:// or "
                          f"inproc://), got {value!r:.200}")
    return value


class StageWorker:
    """The loop of one stage process (see the module docstring)."""

    def __init__(self, model_path: str, listen: str, *, n_threads: Optional[int] = None,
                 parent_pid: Optional[int] = None, offload: Optional[Any] = None,
                 max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS) -> None:
        """`max_batch_tokens`: the most tokens a plan may carry (a driver asking a larger batch
        is refused); with the stage's embedding width it bounds every frame taken."""
        import zmq

        if not (isinstance(max_batch_tokens, int) and max_batch_tokens >= 1):
            raise ValueError(f"max_batch_tokens must be a positive int, got {max_batch_tokens!r}")
        self.info = read_stage_info(model_path)  # fail before binding anything
        self.model_path = model_path
        self.n_threads = n_threads
        self.offload = offload  # hosts.offload.OffloadSpec: where this stage's layers go
        self.max_batch_tokens = max_batch_tokens
        self.max_message_bytes = frame_limit(self.info.n_embd, max_batch_tokens)
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
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

    def _push(self, address: str, send_timeout_ms: int = -1) -> Any:
        """A PUSH socket connected to `address`; ZMQError (nothing left open) if it cannot be."""
        sock = self._ctx.socket(self._zmq.PUSH)
        try:
            sock.setsockopt(self._zmq.LINGER, 1000)
            sock.setsockopt(self._zmq.SNDTIMEO, send_timeout_ms)
            sock.connect(address)
        except BaseException:
            sock.close(linger=0)
            raise
        return sock

    def _answer(self, parts: list[Any]) -> None:
        """Send a reply to the driver without waiting: a driver that stopped reading (gone
        away) does not stall the worker, its replies are dropped."""
        if self._reply is None:
            return
        try:
            self._reply.send_multipart(parts, flags=self._zmq.NOBLOCK)
        except self._zmq.Again:
            log.warning("dropped a %r reply: the driver does not take its replies", parts[0])

    def _check_conf(self, conf: dict[str, Any]) -> dict[str, Any]:
        """A conf's settings, every field checked before anything changes (`ConfRefused`)."""
        driver = conf.get("driver")
        if not (isinstance(driver, int) and not isinstance(driver, bool)
                and 0 <= driver < 2**64):
            raise ConfRefused(f"conf carries no driver id (got {driver!r:.80}): a driver of an "
                              "earlier release")
        out: dict[str, Any] = dict(driver=driver, reply=_address(conf, "reply"),
                                   next=None if conf.get("next") is None
                                   else _address(conf, "next"),
                                   index=_count(conf, "index", low=0),
                                   n_ctx=_count(conf, "n_ctx"),
                                   n_seq_max=_count(conf, "n_seq_max"),
                                   n_batch=_count(conf, "n_batch"),
                                   n_threads=_count(conf, "n_threads", 2))
        if out["n_batch"] > self.max_batch_tokens:
            raise ConfRefused(f"n_batch {out['n_batch']} is more than this worker's "
                              f"--max-batch-tokens ({self.max_batch_tokens}): start it with "
                              f"--max-batch-tokens {out['n_batch']} or more")
        kv_type = conf.get("kv_type", "f32")
        if not (isinstance(kv_type, str) and kv_type in KV_TYPES):
            raise ConfRefused(f"conf field 'kv_type' must be one of {sorted(KV_TYPES)}, got "
                              f"{kv_type!r:.80}")
        flash_attn = conf.get("flash_attn", False)
        if not isinstance(flash_attn, bool):
            raise ConfRefused(f"conf field 'flash_attn' must be true or false, got "
                              f"{flash_attn!r:.80}")
        out.update(kv_type=kv_type, flash_attn=flash_attn)
        return out

    def _refuse_conf(self, conf: dict[str, Any], why: str) -> None:
        """Tell the sender of a refused conf why (at its reply address, if it gave one that can
        be connected); the worker's log says so too. The driver served so far is untouched."""
        print(f"skippy-scheduler stage: refused a conf: {why}", file=sys.stderr, flush=True)
        driver, index = conf.get("driver"), conf.get("index")
        try:
            address = _address(conf, "reply")
        except ConfRefused:
            return
        body: dict[str, Any] = {
            "index": index if isinstance(index, int) and not isinstance(index, bool)
            else self.index, "step": -1, "tag": conf.get("tag"), "kind": "conf",
            "message": why}
        if isinstance(driver, int) and not isinstance(driver, bool):
            body["driver"] = driver
        try:
            sock = self._push(address)
        except Exception:  # ZMQError, or an address pyzmq cannot even encode
            return
        try:
            sock.send_multipart([b"err", _json(body)], flags=self._zmq.NOBLOCK)
        except Exception:  # ZMQError, or a tag nested too deep to encode
            pass
        finally:
            sock.close(linger=1000)

    def _configure(self, conf: dict[str, Any]) -> None:
        """Take a driver's conf: checked and its sockets connected first (`ConfRefused`, nothing
        changed), then the worker is that driver's and loads its context for it."""
        c = self._check_conf(conf)
        try:
            reply = self._push(c["reply"])
        except Exception as exc:  # ZMQError, UnicodeEncodeError
            raise ConfRefused(f"cannot connect to the reply address {c['reply']!r:.200}: "
                              f"{exc}") from None
        try:
            nxt = None if c["next"] is None else self._push(c["next"], NEXT_SEND_TIMEOUT_MS)
        except Exception as exc:
            reply.close(linger=0)
            raise ConfRefused(f"cannot connect to the next stage {c['next']!r:.200}: {exc}") \
                from None
        old = self._reply_address
        if self._reply is not None and c["reply"] != old:
            # Another driver takes this worker (a restarted server, or a second one started by
            # mistake): the first one is told, so its next wait ends with the reason instead
            # of a timeout, and the worker's log says so.
            message = (f"stage {self.index} was configured by another driver (replying to "
                       f"{c['reply']}); this driver ({old}) no longer has it")
            print(f"skippy-scheduler stage: {message}", file=sys.stderr, flush=True)
            self._answer([b"err", _json({
                "index": self.index, "step": -1, "tag": None, "kind": "taken",
                "driver": self._driver, "message": message})])
        for sock in (self._reply, self._next):
            if sock is not None:
                sock.close(linger=1000)
        self._reply, self._next, self._reply_address = reply, nxt, c["reply"]
        driver = c["driver"]
        self._driver, self._driver_frame = driver, DRIVER_FRAME.pack(driver)
        self._sampling.clear()  # what an earlier driver sent matches none of this one's plans
        if self._runner is not None:
            self._runner.close()
            self._runner = None
        # Replies name the worker by its place in the chain; its file says which stage it is.
        self.index = c["index"]
        self._runner = StageRunner(self.model_path, n_ctx=c["n_ctx"],
                                   n_seq_max=c["n_seq_max"], n_batch=c["n_batch"],
                                   n_threads=self.n_threads or c["n_threads"],
                                   kv_type=c["kv_type"], flash_attn=c["flash_attn"],
                                   offload=self.offload)
        r = self._runner
        i = self.info
        self._answer([b"ready", _json({
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
        runner.check_input(n, view.positions, view.tokens if runner.first else None)
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
            self._answer([b"out", encode_outputs(view.step, view.sample_rows, out),
                          self._driver_frame])
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
        self._answer([b"undone", _json({"index": self.index, "tag": body.get("tag")})])

    def _coming_sampling(self, body: dict[str, Any]) -> dict[
            int, tuple[int, Optional[SamplingParams], list[int]]]:
        """A `samp` message, read and checked whole before the last stage keeps any of it:
        lane -> (step, params, the restored prefix's tokens for the penalty window). Each
        lane's params are checked as the driver checks them (tokens of this vocabulary, a
        grammar llama.cpp parses), so a plan never fails on them after its decode."""
        runner = self._runner
        step, lanes, prefixes = body.get("step"), body.get("lanes"), body.get("prefixes", {})
        if not (isinstance(step, int) and not isinstance(step, bool) and step >= 0):
            raise ValueError(f"a samp message's step must be a non-negative integer, got "
                             f"{step!r:.80}")
        if not (isinstance(lanes, dict) and isinstance(prefixes, dict)):
            raise ValueError("a samp message's lanes and prefixes are JSON objects")
        n_vocab = runner.n_vocab
        out = {}
        for key, params in lanes.items():
            lane = int(key) if key.isdigit() else -1
            if not 0 <= lane < runner.n_seq_max:
                raise ValueError(f"a samp message names lane {key!r:.40}, outside "
                                 f"[0, {runner.n_seq_max})")
            prefix = prefixes.get(key, [])
            if not (isinstance(prefix, list) and all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t < n_vocab
                    for t in prefix)):
                raise ValueError(f"lane {lane}'s restored prefix must be token ids in "
                                 f"[0, {n_vocab})")
            if params is not None and not isinstance(params, dict):
                raise ValueError(f"lane {lane}'s sampling is a JSON object or null")
            sampling = None if params is None else SamplingParams(**params)
            if sampling is not None and runner.samplers is not None:
                # ValueError for this model's vocabulary; a window cut to the context
                sampling = runner.samplers.resolve(sampling) or sampling
            out[lane] = (step, sampling, prefix)
        return out

    def serve(self) -> None:
        """Answer messages until the process is stopped (or, with `parent_pid`, its driver
        goes away)."""
        while True:
            if self.parent_pid is not None:
                # A worker started for a driver goes away with it, even when the driver was
                # killed and could not stop it (it is then no longer this process's parent).
                while not self._pull.poll(PARENT_CHECK_MS):
                    if os.getppid() != self.parent_pid:
                        return
            parts = self._pull.recv_multipart(copy=False)
            try:
                self._take(parts)
            except Exception:  # whatever a message holds, the worker goes on serving
                log.exception("a %.16r message could not be handled", parts[0].bytes)

    def _take(self, parts: list[Any]) -> None:
        """Act on one message (see the module docstring)."""
        kind = parts[0].bytes
        step, tag = -1, None
        if kind == b"plan":
            if len(parts) < 3 or parts[-1].bytes != self._driver_frame:
                log.debug("dropped a plan message without this worker's driver id")
                return
            if len(parts[1]) >= 24:
                step = int(np.frombuffer(parts[1].buffer, np.uint64, 1, 16)[0])
            body: Any = None
        else:
            try:
                body = json.loads(parts[1].bytes) if len(parts) == 2 else None
            except (ValueError, RecursionError):  # not JSON, not UTF-8, nested too deep
                body = None
            if not isinstance(body, dict):
                log.debug("dropped a %.16r message that is not one JSON object", kind)
                return
            if kind == b"conf":
                try:
                    self._configure(body)
                except ConfRefused as exc:
                    self._refuse_conf(body, str(exc))
                except Exception as exc:  # loading the context for the driver that took it
                    self._fail(kind, -1, body.get("tag"), exc)
                return
            if self._driver is None or body.get("driver") != self._driver:
                # An earlier driver's message, still travelling (or sent by one that has not
                # heard that another took this worker, or by no driver at all): not to be run,
                # nor answered.
                log.debug("dropped a %.16r message of driver %.40r", kind, body.get("driver"))
                return
            tag = body.get("tag")
        if self._runner is None or self._reply is None:
            return  # this driver's conf failed: nothing runs until the next one
        try:
            self._run_message(kind, parts, body, tag)
        except Exception as exc:
            self._fail(kind, step, tag, exc)

    def _fail(self, kind: bytes, step: int, tag: Any, exc: BaseException) -> None:
        """Report a failure of the driver's message to it (`err`)."""
        self._answer([b"err", _json({
            "index": self.index, "step": step, "tag": tag, "driver": self._driver,
            "kind": kind.decode("ascii", "replace"),
            "message": f"{type(exc).__name__}: {exc}"})])

    def _run_message(self, kind: bytes, parts: list[Any], body: Any, tag: Any) -> None:
        """Run one message of the driver this worker serves."""
        runner = self._runner
        if kind == b"plan":
            self._plan(parts)
        elif kind == b"undo":
            self._undo(body)
        elif kind == b"samp":
            # The sampling of a coming plan's new rows travels down the chain before it; the
            # last stage keeps it for the plan of that step.
            if self._next is not None:
                self._next.send_multipart([b"samp", parts[1]], copy=True)
            else:
                self._sampling.update(self._coming_sampling(body))
        elif kind == b"mem":
            # Memory operations travel down the chain as plans do: each stage runs them in
            # order with the plans, the last one answers.
            ops = body.get("ops")
            runner.apply_ops(ops)  # checked whole first
            for op in ops:
                if op[0] == OP_REMOVE and op[2] <= 0:  # the lane is emptied
                    self._forget_sampling(int(op[1]))
            if self._next is not None:
                self._next.send_multipart([b"mem", parts[1]], copy=True)
            else:
                self._answer([b"mem-done", _json({"index": self.index, "tag": tag})])
        elif kind == b"release":
            lanes = body.get("lanes")
            if not (isinstance(lanes, list) and all(
                    isinstance(x, int) and not isinstance(x, bool) for x in lanes)):
                raise ValueError("a release message's lanes are a list of integers")
            for lane in lanes:
                runner.release(lane)
                self._forget_sampling(lane)
            self._answer([b"released", _json({"index": self.index, "tag": tag})])
        elif kind == b"held":
            self._answer([b"held", _json({
                "index": self.index, "tag": tag, "samplers": len(runner.samplers or ()),
                "lanes": {str(k): runner.held(k) for k in runner.held_lanes()}})])
        elif kind == b"ping":
            self._answer([b"pong", _json({"index": self.index, "tag": tag})])
        elif kind == b"usage":
            self._answer([b"usage", _json({
                "index": self.index, "tag": tag,
                "kv_bytes_per_token": runner.kv_bytes_per_token,
                "seqs": {str(k): list(v) for k, v in runner.measure_kv().items()}})])
        else:
            raise ValueError(f"unknown message kind {kind!r:.24}")

    def close(self) -> None:
        if self._runner is not None:
            self._runner.close()
            self._runner = None
        for sock in (self._next, self._reply, self._pull):
            if sock is not None:
                sock.close(linger=0)
        self._next = self._reply = None
        self._ctx.destroy(linger=0)  # and any socket an exception left open
