"""The stage host: drives P stage workers with one shared plan per step (docs/stages.md).

`StageHost` is a host for the `Engine` (`execute` and `release`). It lives in the scheduler's
process, maps each scheduler sequence to a lane (a llama sequence id every stage uses for it),
encodes each plan once into a plan frame and sends it to stage 0; the frame travels down the
chain with each stage's activations, and the last stage sends the sampled (work index, token)
pairs straight back here. Released lanes travel in the next plan's release table, so every stage
frees them before it runs the rows that may reuse them.

A plan that fails in any stage (an error report, a timeout, a worker that died) is undone on
every stage that still answers: the released lanes are freed, the rows' lanes rewound to where
the plan found them (lanes the plan brought in are freed), and the error is raised, so the
engine aborts the plan and the scheduler undoes its rows too.

`LocalStages` (stages/local.py) starts the workers of a stage directory on this machine.
"""
from __future__ import annotations

import heapq
import json
import shutil
import tempfile
import time
from typing import Any, Optional, Sequence as _Seq

from ..engine.contract import HostState
from ..types import ReleaseReason

import numpy as np

from .holders import PrefixHolders, RemoteCells, restored
from .split import StageInfo, check_stage_set
from .vocab import Vocabulary
from .wire import decode_outputs, encode_plan


class StageFailure(RuntimeError):
    """A stage reported an error, timed out or died while running a plan."""


class StageTimeout(StageFailure):
    """No answer in time (the stages not heard from are taken for dead)."""


def _check_int(name: str, value: object, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
    return value


def _local_address_towards(address: str) -> str:
    """This machine's IP address on the route to a `tcp://HOST:PORT` worker (loopback for a
    loopback worker): where the workers can reach the driver's reply socket."""
    import socket

    host, _, port = address[len("tcp://"):].rpartition(":")
    host = host.strip("[]")
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), int(port or 1)))  # no packet is sent
        return str(probe.getsockname()[0])


class StageHost:
    """Runs plans on a chain of stage workers (see the module docstring)."""

    def __init__(self, addresses: _Seq[str], *, n_ctx: int = 4096, n_seq_max: int = 8,
                 n_batch: int = 512, n_threads: int = 2, kv_type: str = "f32",
                 flash_attn: bool = False, reply_address: Optional[str] = None,
                 timeout_s: float = 60.0, source_id: Optional[str] = None,
                 vocab_model: Optional[str] = None, procs: _Seq[Any] = (),
                 prefix_cache_tokens: int = 0, prefix_holders: int = 16) -> None:
        import zmq

        if not addresses:
            raise ValueError("a stage host needs at least one stage address")
        self.n_seq_max = _check_int("n_seq_max", n_seq_max, 1)
        self.n_ctx = _check_int("n_ctx", n_ctx, 1)
        self.n_batch = _check_int("n_batch", n_batch, 1)
        prefix_cache_tokens = _check_int("prefix_cache_tokens", prefix_cache_tokens, 0)
        self.prefix_holders = (_check_int("prefix_holders", prefix_holders, 1)
                               if prefix_cache_tokens else 0)
        if self.n_seq_max + self.prefix_holders > 256:
            raise ValueError("lanes and prefix holders must be <= 256 sequence ids together")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_ms = int(timeout_s * 1e3)
        self.addresses = list(addresses)
        self._procs = list(procs)
        self._zmq = zmq
        self._ctx: Any = zmq.Context()
        self._reply: Any = self._ctx.socket(zmq.PULL)
        self._reply.setsockopt(zmq.LINGER, 0)
        self._reply_dir: Optional[str] = None
        tcp = [a for a in addresses if a.startswith("tcp://")]
        if reply_address is None and tcp:
            reply_address = f"tcp://{_local_address_towards(tcp[0])}:*"
        elif reply_address is None:
            self._reply_dir = tempfile.mkdtemp(prefix="skippy-reply-")
            reply_address = f"ipc://{self._reply_dir}/reply"
        self._reply.bind(reply_address)
        self.reply_address = self._reply.getsockopt_string(zmq.LAST_ENDPOINT)
        self._out = []
        for a in self.addresses:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(a)
            self._out.append(sock)
        self.broken: Optional[str] = None
        self.live: set[int] = set(range(len(self.addresses)))
        self.on_close: list[Any] = []  # called after close (e.g. stopping local workers)
        self._vocab: Any = None
        self._tag = 0
        try:
            self.stages = self._configure(n_ctx, n_threads, kv_type, flash_attn, source_id)
            self._vocab = Vocabulary(vocab_model or self.stages[0].path)
        except BaseException:
            self.close()
            raise
        self.n_vocab = self._vocab.n_vocab
        self.n_ctx_seq = n_ctx // n_seq_max  # a lane's share of the cells (the server's bound)
        self.settings = {
            "stages": len(self.stages), "stage_addresses": self.addresses,
            "stage_layers": [[s.layer_start, s.layer_end] for s in self.stages],
            "n_ctx": n_ctx, "n_seq_max": n_seq_max, "n_batch": n_batch,
            "n_threads": n_threads, "kv_type": kv_type, "flash_attn": bool(flash_attn),
            "kv_unified": True, "prefix_cache_tokens": prefix_cache_tokens,
            "prefix_holders": self.prefix_holders,
        }
        # Prefix reuse: one store for all stages, its decisions queued as memory operations.
        self._cells = RemoteCells()
        self._holders: Optional[PrefixHolders] = None
        self.prefix_store: Any = None
        if prefix_cache_tokens:
            self._holders = PrefixHolders(prefix_cache_tokens, self.prefix_holders, n_seq_max,
                                          n_seq_max, n_ctx, self._cells,  # type: ignore[arg-type]
                                          shared_cells=True)
            self.prefix_store = self._holders.store
        self._free: list[int] = list(range(n_seq_max))
        self._slot: dict[str, int] = {}
        self._next_pos = [0] * n_seq_max
        self._pending_release: list[int] = []
        self.steps = 0

    # ------------------------------------------------------------------ setup
    def _configure(self, n_ctx: int, n_threads: int, kv_type: str, flash_attn: bool,
                   source_id: Optional[str]) -> list[StageInfo]:
        p = len(self.addresses)
        for k, sock in enumerate(self._out):
            conf = {"index": k, "tag": self._tag + 1, "reply": self.reply_address,
                    "next": self.addresses[k + 1] if k + 1 < p else None,
                    "n_ctx": n_ctx, "n_seq_max": self.n_seq_max + self.prefix_holders,
                    "n_batch": self.n_batch,
                    "n_threads": n_threads, "kv_type": kv_type, "flash_attn": flash_attn}
            sock.send_multipart([b"conf", json.dumps(conf).encode()])
        self._tag += 1
        ready = self._collect(b"ready", "configuring")
        infos = [StageInfo(path=r["path"], index=r["stage_index"], count=r["count"],
                           layer_start=r["layer_start"], layer_end=r["layer_end"],
                           source_layers=r["source_layers"], source_id=r["source_id"],
                           source_name=r["source_name"]) for r in ready]
        check_stage_set(infos, source_id)
        dims = {r["n_embd"] for r in ready}
        if len(dims) != 1:
            raise StageFailure(f"stages disagree on the embedding width: {sorted(dims)}")
        self.n_embd = dims.pop()
        # A stage whose context got a smaller batch than asked sizes every plan.
        self.n_batch = min([self.n_batch] + [int(r["n_batch"]) for r in ready])
        return infos

    def _recv(self, what: str, waiting: Optional[set[int]] = None) -> list[bytes]:
        """One reply; `StageFailure` on a timeout or when a stage waited for (all live ones by
        default) runs as a local process that exited (it is then no longer live)."""
        deadline = time.monotonic() + self.timeout_ms / 1e3
        watch = self.live if waiting is None else waiting
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise StageTimeout(f"no answer from the stages within "
                                   f"{self.timeout_ms / 1e3:g} s while {what}")
            if self._reply.poll(min(200, max(1, int(left * 1e3)))):
                return list(self._reply.recv_multipart())
            for k, proc in enumerate(self._procs):
                if k in watch and proc.poll() is not None:
                    self.live.discard(k)
                    raise StageFailure(f"stage {k} exited with status {proc.returncode} "
                                       f"while {what}")

    def _broadcast(self, kind: bytes, body: dict[str, Any]) -> int:
        """Send a control message to every live stage; its tag (replies echo it)."""
        self._tag += 1
        msg = [kind, json.dumps(dict(body, tag=self._tag)).encode()]
        for k in sorted(self.live):
            try:
                self._out[k].send_multipart(msg, flags=self._zmq.NOBLOCK)
            except self._zmq.Again:  # its queue is full: it has not read for a long time
                self.live.discard(k)
        return self._tag

    def _collect(self, kind: bytes, what: str) -> list[dict[str, Any]]:
        """The replies of `kind` to the last control message from every live stage, by stage
        index; replies to earlier messages (a stage answering late) are dropped. A stage that
        does not answer in time is no longer live."""
        got: dict[int, dict[str, Any]] = {}
        waiting = set(self.live)
        while waiting - set(got):
            try:
                parts = self._recv(what, waiting - set(got))
            except StageTimeout:
                self.live -= waiting - set(got)
                raise
            if parts[0] == b"out":
                continue
            body = json.loads(parts[1]) if len(parts) > 1 else {}
            if body.get("tag") != self._tag:
                continue
            if parts[0] == b"err":
                raise StageFailure(f"stage {body.get('index')} failed while {what}: "
                                   f"{body.get('message')}")
            if parts[0] == kind:
                got[int(body["index"])] = body
        return [got[k] for k in sorted(got)]

    # ------------------------------------------------------------------ Host verbs
    @property
    def sequence_id_settings(self) -> dict[str, int]:
        """The scheduler config fields that match the stages' sequence ids: the lanes, then
        the holders in the reserved range above them."""
        return {"sequence_id_limit": self.n_seq_max + self.prefix_holders,
                "reserved_sequence_ids": self.prefix_holders}

    def release(self, sequence_id: str, reason: Optional[ReleaseReason] = None) -> bool:
        """Free the sequence's lane; the stages free its KV before the next plan's rows. With
        prefix reuse its positions are first offered to the store (not for a failed one)."""
        lane = self._slot.pop(sequence_id, None)
        if lane is None:
            return False
        if self._holders is not None and self.broken is None:
            # Memory operations keep their order: the holders copy the lane before it empties.
            if self._next_pos[lane] and reason is not ReleaseReason.FAILED:
                self._holders.keep(lane, self._next_pos[lane])
            self._cells.remove(lane)
        else:
            self._pending_release.append(lane)
        self._next_pos[lane] = 0
        heapq.heappush(self._free, lane)
        return True

    def _flush_ops(self) -> None:
        """Run the queued memory operations on every stage (before a plan that may rely on
        them); a stage that cannot breaks the chain, as the stages no longer agree."""
        ops = self._cells.take()
        if not ops or self.broken is not None:
            return
        try:
            self._broadcast(b"mem", {"ops": ops})
            self._collect(b"mem-done", "running memory operations")
        except StageFailure as exc:
            self.broken = str(exc)
            self._free_survivors()

    def execute(self, plan: Any) -> int:
        """Run `plan` on every stage and fill `plan.outputs`; return the output count."""
        rows = len(plan)
        if rows == 0 or self.broken is not None:
            # Broken stages run nothing: every sampling row is left without an output, which
            # fails its sequence (docs/stages.md "When a stage fails").
            plan.outputs.count = 0
            return 0
        offsets, tokens, positions = self._plan_arrays(plan)
        self._flush_ops()
        if self.broken is not None:
            plan.outputs.count = 0
            return 0
        ids = list(plan.sequence_ids)
        if len(set(ids)) != len(ids):
            raise ValueError("a sequence appears in more than one row of the plan")
        for w in getattr(plan, "work", None) or []:
            if getattr(w, "sampling", None) is not None:
                raise ValueError("staged serving samples greedily only (Sequence.sampling must "
                                 "be None)")
        starts = positions[offsets[:-1]].tolist()
        flagged = getattr(plan, "new_rows", None)
        new = [r for r, i in enumerate(ids)
               if i not in self._slot or (flagged is not None and flagged[r])]
        if sum(1 for r in new if ids[r] not in self._slot) > len(self._free):
            raise RuntimeError(f"{len(new)} new sequences but {len(self._free)} free lanes "
                               f"(n_seq_max={self.n_seq_max})")
        restore = self._restores(plan, new)
        for r, (seq, start) in enumerate(zip(ids, starts)):
            if r in restore:
                have = self._holders.length(restore[r]) if self._holders is not None else 0
            elif seq in self._slot and r not in new:
                have = self._next_pos[self._slot[seq]]
            else:
                have = 0
            if start > have:
                raise ValueError(f"row of {seq!r} starts at position {start} but the stages "
                                 f"hold {have} positions for it")
        lanes = np.empty(rows, dtype=np.int32)
        fresh = [r for r in new if ids[r] not in self._slot]  # rows that take a lane now
        for r, seq in enumerate(ids):
            lane = self._slot.get(seq)
            if lane is None:
                lane = self._slot[seq] = heapq.heappop(self._free)
            lanes[r] = lane
        sample_rows = np.asarray(plan.sample_rows, dtype=np.int64)
        step = int(plan.step)
        try:
            frame = encode_plan(
                step=step, serial=int(getattr(plan, "serial", step)), row_offsets=offsets,
                row_lanes=lanes, tokens=tokens, positions=positions,
                sample_last=np.asarray(plan.sample_last)[:rows],
                phases=np.asarray(plan.phases)[:rows], new_rows=new,
                row_restore=[restore.get(r, -1) for r in range(rows)],
                release_lanes=self._pending_release,
                deferred=(plan.deferred_rows, plan.deferred_source_steps,
                          plan.deferred_source_indexes) if len(plan.deferred_rows) else None)
        except BaseException:
            for r in fresh:  # nothing was sent: the new sequences give their lanes back
                heapq.heappush(self._free, self._slot.pop(ids[r]))
            raise
        released = self._pending_release
        self._pending_release = []
        try:
            self._out[0].send_multipart([b"plan", frame], copy=False)
            got_step, out_rows, out_tokens = self._await_outputs(step)
            if got_step != step or not np.array_equal(out_rows, sample_rows):
                raise StageFailure(f"the last stage answered step {got_step} rows "
                                   f"{out_rows.tolist()} for step {step} rows "
                                   f"{sample_rows.tolist()}")
        except StageFailure as exc:
            self._undo(ids, lanes, starts, new, fresh, released)
            if self.broken is None and len(self.live) == len(self._out):
                raise  # every stage is back where the plan found it: the engine aborts it
            self.broken = str(exc) if self.broken is None else f"{exc}; then {self.broken}"
            self._free_survivors()
            plan.outputs.count = 0
            return 0
        ends = positions[offsets[1:] - 1] + 1
        for lane, end in zip(lanes.tolist(), ends.tolist()):
            self._next_pos[lane] = end
        if self._holders is not None:
            for r, holder in restore.items():
                restored(self._holders, self._cells, int(lanes[r]), holder, starts[r])
            self._holders.wrote(np.repeat(lanes, np.diff(offsets)), positions, tokens)
        k = len(sample_rows)
        outputs = plan.outputs
        outputs.request_indexes[:k] = sample_rows
        outputs.predicted_tokens[:k] = out_tokens
        outputs.count = k
        self.steps += 1
        return k

    def _plan_arrays(self, plan: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The plan's row offsets, tokens and positions, checked against the stages' limits."""
        offsets = np.asarray(plan.row_offsets, dtype=np.int64)
        n = int(offsets[-1])
        tokens = np.asarray(plan.tokens)[:n]
        positions = np.asarray(plan.positions)[:n]
        if n > self.n_batch:
            raise ValueError(f"a plan of {n} tokens does not fit the stages' batch of "
                             f"{self.n_batch} (keep max_tokens_per_iteration <= n_batch)")
        if len(tokens) != n or len(positions) != n:
            raise ValueError(f"the plan's rows end at {n} but it has {len(tokens)} tokens and "
                             f"{len(positions)} positions")
        if n and (int(tokens.min()) < 0 or int(tokens.max()) >= self.n_vocab):
            raise ValueError(f"plan tokens must be in [0, {self.n_vocab}) for this model")
        return offsets, tokens, positions

    def _await_outputs(self, step: int) -> tuple[int, Any, Any]:
        while True:
            parts = self._recv(f"running step {step}")
            if parts[0] == b"out":
                got = decode_outputs(parts[1])
                if got[0] == step:
                    return got
                continue  # a late answer to a plan that was given up
            if parts[0] == b"err":
                body = json.loads(parts[1])
                if body.get("step") != step:
                    continue
                raise StageFailure(f"stage {body.get('index')} failed on step {step}: "
                                   f"{body.get('message')}")

    def _restores(self, plan: Any, new: list[int]) -> dict[int, int]:
        """Row -> holder of every new row that restores a resident prefix."""
        if self._holders is None or not new:
            return {}
        work = plan.work
        return {r: int(work[r].restore_holder) for r in new
                if getattr(work[r], "restore_holder", None) is not None}

    def _undo(self, ids: list[str], lanes: np.ndarray, starts: list[int], new: list[int],
              fresh: list[int], released: list[int]) -> None:
        """Put every stage back where the failed plan found it (module docstring)."""
        new_set = set(new)
        body = {"release": released, "lanes": lanes.tolist(),
                "starts": [0 if r in new_set else s for r, s in enumerate(starts)]}
        for r in fresh:
            lane = self._slot.pop(ids[r])
            heapq.heappush(self._free, lane)
        try:
            self._broadcast(b"undo", body)
            self._collect(b"undone", "undoing a failed plan")
        except StageFailure as exc:
            self.broken = str(exc)  # a stage cannot be put back: nothing more runs on it

    def _free_survivors(self) -> None:
        """With the chain broken: every live stage frees every lane (best effort), and the
        driver forgets its lanes' positions; sequences keep their lanes until released."""
        self._pending_release = []
        self._cells.take()
        self._next_pos = [0] * self.n_seq_max
        try:
            self._broadcast(b"release",
                            {"lanes": list(range(self.n_seq_max + self.prefix_holders))})
            self._collect(b"released", "freeing the surviving stages")
        except StageFailure:
            pass  # a stage that does not answer now is not live any more

    # ------------------------------------------------------------------ vocabulary
    # (a vocabulary-only model: safe from any thread while the engine runs plans)
    def tokenize(self, text: str, *, add_bos: Optional[bool] = None,
                 special: bool = False) -> list[int]:
        return list(self._vocab.tokenize(text, add_bos=add_bos, special=special))

    def is_eog(self, token: int) -> bool:
        return bool(self._vocab.is_eog(token))

    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        return bytes(self._vocab.token_bytes(token, special=special))

    def chat_template(self) -> Optional[str]:
        template: Optional[str] = self._vocab.chat_template()
        return template

    @property
    def holders(self) -> Optional[PrefixHolders]:
        """The prefix holders every stage keeps (None without reuse)."""
        return self._holders

    def prepare_sequence(self, sequence: Any) -> Any:
        """Refuse at submit, before anything is queued, what the stages cannot serve."""
        if getattr(sequence, "sampling", None) is not None:
            raise ValueError("staged serving samples greedily only: this model's stages have "
                             "no per-request samplers (use temperature 0 and no penalties, "
                             "bias or ignore_eos)")
        return sequence

    # ------------------------------------------------------------------ inspection
    def sync(self) -> None:
        """Send pending releases to every stage now (they otherwise ride on the next plan)."""
        if self.broken is not None:
            self._pending_release = []  # the live stages were freed when the chain broke
        self._flush_ops()
        if self._pending_release:
            self._broadcast(b"release", {"lanes": self._pending_release})
            self._collect(b"released", "releasing lanes")
            self._pending_release = []

    def held(self, holders: bool = False) -> list[dict[int, int]]:
        """Per live stage: positions held by every lane with KV (after `sync`); with `holders`
        the prefix holders' too."""
        self._broadcast(b"held", {})
        top = self.n_seq_max + (self.prefix_holders if holders else 0)
        return [{int(k): v for k, v in r["lanes"].items() if int(k) < top}
                for r in self._collect(b"held", "asking what is held")]

    @property
    def processes(self) -> list[Any]:
        """The local worker processes this host watches (empty for remote workers)."""
        return list(self._procs)

    @property
    def active_sequences(self) -> list[str]:
        return list(self._slot)

    def release_all(self) -> None:
        """Release every sequence (recovery after a failure), then free the lanes on the
        stages at once."""
        for sequence_id in list(self._slot):
            self.release(sequence_id, ReleaseReason.FAILED)
        if self.broken is None:
            self.sync()

    def host_state(self, detail: bool = False) -> HostState:
        """Lanes and KV positions as the driver counts them; with `detail`, the highest
        position each lane holds on every live stage (asked of the stages: for leak checks),
        which must agree between stages."""
        positions: dict[int, int] = {}
        if detail and self.broken is None:
            self.sync()
            per_stage = self.held()
            if any(h != per_stage[0] for h in per_stage):
                raise StageFailure(f"the stages disagree on what their lanes hold: {per_stage}")
            positions = {lane: n - 1 for lane, n in per_stage[0].items()}
        return HostState(
            lanes=self.n_seq_max, free_lanes=len(self._free), active=tuple(self._slot),
            kv_tokens=sum(self._next_pos[lane] for lane in self._slot.values()),
            kv_capacity=self.n_ctx, lane_positions=positions)

    def close(self) -> None:
        for sock in getattr(self, "_out", []):
            sock.close(linger=0)
        self._out = []
        if getattr(self, "_reply", None) is not None:
            self._reply.close(linger=0)
            self._reply = None
        if getattr(self, "_ctx", None) is not None:
            self._ctx.term()
            self._ctx = None
        if self._vocab is not None:
            self._vocab.close()
            self._vocab = None
        if self._reply_dir is not None:
            shutil.rmtree(self._reply_dir, ignore_errors=True)
            self._reply_dir = None
        callbacks, self.on_close = getattr(self, "on_close", []), []
        for callback in callbacks:
            callback()

    def __enter__(self) -> "StageHost":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
