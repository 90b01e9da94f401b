"""The driver's sockets to a chain of stage workers (docs/stages.md "Workers").

`StageChannel` owns the pyzmq context, one PUSH socket per stage and the PULL socket every
stage replies to. Everything a stage sends back arrives on that one socket, so one receive path
files it: *chain answers* (a plan's outputs or error, the last stage's `mem-done` for a memory
message that travelled down the chain) go to `terminal` and `chain_errors`, by step and tag, for
whoever waits on them, and the rest are answers to control messages (`_collect`). A worker
process that exits, or no answer within the timeout, is a `StageFailure`.
"""
from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import struct
import tempfile
import time
from typing import Any, Optional, Sequence as _Seq

from .wire import WireError, decode_outputs

log = logging.getLogger(__name__)

DRIVER_FRAME = struct.Struct("<Q")  # the driver id part of `plan` and `out` messages
# The largest frame the driver takes from a stage: its answers are sampled tokens and small JSON
# objects (a stage's KV usage per sequence the largest); a bigger one drops its connection.
REPLY_MAX_BYTES = 16 << 20


class StageFailure(RuntimeError):
    """A stage reported an error, timed out or died while running a plan."""


class StageTimeout(StageFailure):
    """No answer in time (the stages not heard from are taken for dead)."""


class StageInterrupted(StageFailure):
    """The wait was interrupted from another thread (`StageChannel.interrupt`)."""


def _local_address_towards(address: str) -> str:
    """This machine's IP address on the route to a `tcp://HOST:PORT` worker (loopback for a
    loopback worker): where the workers can reach the driver's reply socket."""
    import socket

    host, _, port = address[len("tcp://"):].rpartition(":")
    host = host.strip("[]")
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(host), int(port or 1)))  # no packet is sent
            return str(probe.getsockname()[0])
    except OSError as exc:  # a name that does not resolve, no route
        raise OSError(f"stage address {address}: {exc.strerror or exc}") from None


class StageChannel:
    """Sockets to the stages and the one receive path (see the module docstring)."""

    def __init__(self, addresses: _Seq[str], reply_address: Optional[str], timeout_s: float,
                 procs: _Seq[Any]) -> None:
        import zmq

        if not addresses:
            raise ValueError("a stage host needs at least one stage address")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_ms = int(timeout_s * 1e3)
        self.addresses = list(addresses)
        self._procs = list(procs)
        self._zmq = zmq
        # This driver's id: sent in `conf`, carried by every message to the stages and every
        # chain answer back, so a worker drops what an earlier driver left travelling and the
        # driver what a worker answers another one (docs/wire-format.md "Driver id").
        self.driver = secrets.randbits(64)
        self.driver_frame = DRIVER_FRAME.pack(self.driver)
        self._ctx: Any = zmq.Context()
        self._reply: Any = None
        self._reply_dir: Optional[str] = None
        self._out: list[Any] = []
        try:
            self._reply = self._ctx.socket(zmq.PULL)
            self._reply.setsockopt(zmq.LINGER, 0)
            self._reply.setsockopt(zmq.MAXMSGSIZE, REPLY_MAX_BYTES)
            tcp = [a for a in addresses if a.startswith("tcp://")]
            if reply_address is None and tcp:
                reply_address = f"tcp://{_local_address_towards(tcp[0])}:*"
            elif reply_address is None:
                self._reply_dir = tempfile.mkdtemp(prefix="skippy-reply-")
                reply_address = f"ipc://{self._reply_dir}/reply"
            self._reply.bind(reply_address)
            self.reply_address = self._reply.getsockopt_string(zmq.LAST_ENDPOINT)
            for a in self.addresses:
                sock = self._ctx.socket(zmq.PUSH)
                self._out.append(sock)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(a)
        except BaseException:
            self.close_channel()
            raise
        self.live: set[int] = set(range(len(self.addresses)))
        self._tag = 0
        # Chain answers by plan step: ("out", rows, tokens) or ("err", message).
        self.terminal: dict[int, tuple[Any, ...]] = {}
        self.awaited: set[int] = set()  # steps whose answers are kept (the plans in flight)
        self.mem_pending: set[int] = set()  # tags of memory messages still in the chain
        self.chain_errors: list[str] = []
        self._interrupted: Optional[str] = None  # set from another thread: stop waiting

    def interrupt(self, reason: str) -> None:
        """Have a wait for the stages on another thread end within a poll (200 ms) with a
        `StageFailure` of `reason`, and every later one at once (a server shutting down while
        a stage hangs). Only sets a flag: the sockets stay with the thread that uses them."""
        self._interrupted = reason

    def _named(self, stages: Any) -> str:
        """`stage K (ADDRESS)` for each stage index in `stages`."""
        return ", ".join(f"stage {k} ({self.addresses[k]})" for k in sorted(stages))

    @property
    def processes(self) -> list[Any]:
        """The local worker processes this host watches (empty for remote workers)."""
        return list(self._procs)

    def _recv(self, what: str, waiting: Optional[set[int]] = None,
              timeout_s: Optional[float] = None, note_s: Optional[float] = None,
              since: Optional[float] = None) -> list[bytes]:
        """One reply; `StageFailure` on a timeout (`timeout_s`, default the host's, counted from
        `since`, the start of the operation that waits, default now) or when a stage waited for
        (all live ones by default) runs as a local process that exited (it is then no longer
        live). With `note_s`, a warning names the stages still waited for every `note_s`
        seconds."""
        limit = self.timeout_ms / 1e3 if timeout_s is None else timeout_s
        start = time.monotonic() if since is None else since
        deadline = start + limit
        note = start + note_s if note_s else None
        watch = self.live if waiting is None else waiting
        while True:
            if self._interrupted is not None:
                raise StageInterrupted(f"{self._interrupted} while {what}")
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                raise StageTimeout(f"no answer from {self._named(watch)} within "
                                   f"{limit:g} s while {what}")
            if note is not None and note_s and now >= note:
                log.warning("still waiting for %s while %s (%.0f s of %g)",
                            self._named(watch), what, now - start, limit)
                while note <= now:
                    note += note_s
            if self._reply.poll(min(200, max(1, int(left * 1e3)))):
                return list(self._reply.recv_multipart())
            for k, proc in enumerate(self._procs):
                if k in watch and proc.poll() is not None:
                    self.live.discard(k)
                    raise StageFailure(f"stage {k} {exit_reason(proc, what)}")

    def exited(self) -> Optional[str]:
        """Why a local worker process has exited (None while they all run): a poll of each,
        for `/health` between requests."""
        for k, proc in enumerate(self._procs):
            if proc.poll() is not None:
                return f"stage {k} {exit_reason(proc)}"
        return None

    def _body(self, parts: list[bytes]) -> Optional[dict[str, Any]]:
        """The JSON object of an answer; None for one to another driver (its `driver` is not
        this one's: dropped); `StageFailure` for one that is not such an object or names no
        stage of this chain."""
        kind = parts[0].decode("ascii", "replace")[:16]
        try:
            body = json.loads(parts[1]) if len(parts) > 1 else {}
            if not isinstance(body, dict):
                raise ValueError(f"a JSON {type(body).__name__}, not an object")
            if "driver" in body and body["driver"] != self.driver:
                log.debug("dropped an answer to driver %s: %.200r", body["driver"], body)
                return None
            index = body.get("index")
            if not (isinstance(index, int) and 0 <= index < len(self.addresses)):
                raise ValueError(f"no stage index ({index!r})")
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise StageFailure(f"a stage sent a malformed {kind!r} answer: {exc}") from None
        return body

    def _file(self, parts: list[bytes]) -> Optional[dict[str, Any]]:
        """File a chain answer, or drop an answer to another driver (None), or return a
        control answer's body to the caller; a malformed answer is a `StageFailure`."""
        kind = parts[0]
        if kind == b"out":
            if len(parts) != 3 or parts[2] != self.driver_frame:
                log.debug("dropped an output frame without this driver's id")
                return None
            try:
                step, rows, tokens = decode_outputs(parts[1])
            except WireError as exc:
                self.chain_errors.append(f"the last stage sent a bad output frame: {exc}")
                return None
            if step in self.awaited:
                self.terminal[step] = ("out", rows, tokens)
            return None
        body = self._body(parts)
        if body is None:
            return None
        if kind == b"mem-done":
            self.mem_pending.discard(body.get("tag"))
            return None
        if kind == b"err" and body.get("kind") == "plan":
            failed = body.get("step")
            if failed in self.awaited and failed not in self.terminal:
                self.terminal[failed] = ("err", f"stage {body.get('index')} failed on step "
                                                f"{failed}: {body.get('message')}")
            return None
        if kind == b"err" and body.get("kind") == "taken":
            # Another driver configured the stage: it answers that driver from now on, and the
            # chain is no longer this one's (nothing waits for its stages' answers).
            self.chain_errors.append(str(body.get("message")))
            self.live.clear()
            return None
        if kind == b"err" and body.get("kind") in ("mem", "samp"):
            self.mem_pending.discard(body.get("tag"))
            self.chain_errors.append(f"stage {body.get('index')} failed on a {body['kind']} "
                                     f"message: {body.get('message')}")
            return None
        return body

    def _pump(self, what: str, since: Optional[float] = None,
              timeout_s: Optional[float] = None) -> None:
        """Receive one message and file it (late control answers are dropped); `since` and
        `timeout_s`: `_recv`'s."""
        self._file(self._recv(what, timeout_s=timeout_s, since=since))

    def _broadcast(self, kind: bytes, body: dict[str, Any]) -> int:
        """Send a control message to every live stage; its tag (replies echo it)."""
        self._tag += 1
        msg = [kind, json.dumps(dict(body, tag=self._tag, driver=self.driver)).encode()]
        for k in sorted(self.live):
            try:
                self._out[k].send_multipart(msg, flags=self._zmq.NOBLOCK)
            except self._zmq.Again:  # its queue is full: it has not read for a long time
                self.live.discard(k)
        return self._tag

    def _send_chain(self, kind: bytes, body: dict[str, Any]) -> int:
        """Send a message down the chain (to stage 0, which passes it on): it reaches every
        stage after the plans sent before it. Its tag."""
        self._tag += 1
        self._out[0].send_multipart([kind, json.dumps(
            dict(body, tag=self._tag, driver=self.driver)).encode()])
        return self._tag

    def _send_plan(self, frame: Any) -> None:
        """Send a plan frame down the chain, with this driver's id as its last part."""
        self._out[0].send_multipart([b"plan", frame, self.driver_frame], copy=False)

    def _collect(self, kind: bytes, what: str, timeout_s: Optional[float] = None,
                 note_s: Optional[float] = None) -> list[dict[str, Any]]:
        """The replies of `kind` to the last control message from every live stage, by stage
        index; replies to earlier messages (a stage answering late) are dropped, chain answers
        filed. A stage that does not answer in time (`timeout_s`, default the host's, for all
        the replies together) is no longer live; `note_s`: `_recv`'s."""
        got: dict[int, dict[str, Any]] = {}
        waiting = set(self.live)
        since = time.monotonic()
        while waiting - set(got):
            try:
                parts = self._recv(what, waiting - set(got), timeout_s, note_s, since)
            except StageTimeout:
                self.live -= waiting - set(got)
                raise
            body = self._file(parts)
            left = waiting - set(got) - self.live
            if left and self.chain_errors:
                # Those stages left the chain (another driver took one): the reason, now.
                raise StageFailure(f"{self.chain_errors[-1]} (while {what})")
            if body is None or body.get("tag") != self._tag:
                continue
            if parts[0] == b"err":
                raise StageFailure(f"stage {body.get('index')} failed while {what}: "
                                   f"{body.get('message')}")
            if parts[0] == kind:
                got[body["index"]] = body
        return [got[k] for k in sorted(got)]

    def close_channel(self) -> None:
        for sock in getattr(self, "_out", []):
            sock.close(linger=0)
        self._out = []
        if getattr(self, "_reply", None) is not None:
            self._reply.close(linger=0)
            self._reply = None
        if getattr(self, "_ctx", None) is not None:
            self._ctx.term()
            self._ctx = None
        if getattr(self, "_reply_dir", None) is not None:
            shutil.rmtree(self._reply_dir, ignore_errors=True)  # type: ignore[arg-type]
            self._reply_dir = None


def exit_reason(proc: Any, what: Optional[str] = None) -> str:
    """How a worker process that exited ended: its status or signal, `while {what}` it ended,
    and its own error line from its log when it wrote one."""
    import signal

    code = proc.returncode
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        how = f"was killed by signal {-code} ({name})"
    else:
        how = f"exited with status {code}"
    if what:
        how += f" while {what}"
    said = last_words(getattr(proc, "log_path", None))
    return f"{how}: {said}" if said and _is_error_line(said) else how


_ERROR_LINE = re.compile(r"(skippy-scheduler [\w-]+: )?(error|[\w.]*(Error|Exception|Exit|"
                         r"Interrupt)):", re.IGNORECASE)


def _is_error_line(line: str) -> bool:
    """A worker's own refusal (`skippy-scheduler stage: error: ...`) or the last line of a
    Python traceback (`MemoryError: ...`)."""
    return _ERROR_LINE.match(line) is not None


def last_words(log_path: Optional[str], limit: int = 400) -> str:
    """The last line a worker wrote to its log (`StageProcess.log_path`; its own `error: ...`
    line when it refused what it was given), at most `limit` characters; '' without one."""
    if not log_path:
        return ""
    try:
        with open(log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    return lines[-1][:limit] if lines else ""
