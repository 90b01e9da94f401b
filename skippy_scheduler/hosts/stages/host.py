"""The stage host: drives P stage workers with one shared plan per step (docs/stages.md).

`StageHost` is a host for the `Engine` (`execute`, `execute_async` and `release`). It lives in
the scheduler's process, maps each scheduler sequence to a lane (a llama sequence id every stage
uses for it), encodes each plan once into a plan frame and sends it to stage 0; the frame
travels down the chain with each stage's activations, and the last stage sends the sampled
(work index, token) pairs straight back here. Released lanes travel in the next plan's release
table and memory operations (prefix holders) down the chain, so every stage applies them after
the plans sent before them and before the plans sent after.

Pipelining (`pipeline_depth` P > 1, docs/stages.md "Pipelined plans"): up to P plans are in
the chain at once, plan k in stage 0 while plan k-1 is in stage 1. The driver's view of every
lane is updated when a plan is sent (the stages run plans in order), and every plan's answer
is taken in order.

A plan that fails in any stage (an error report, a timeout, a worker that died) is undone with
every plan sent after it: the driver waits until each of them has ended somewhere, then every
stage that still answers frees the released lanes and rewinds the rows' lanes to where the
first failed plan found them (lanes the plans brought in are freed), and the error is raised,
so the engine aborts those plans and the scheduler undoes their rows too.

`LocalStages` (local.py) starts the workers of a stage directory on this machine.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from collections import deque
from typing import Any, Optional, Sequence as _Seq

from ..._validate import as_float, check_int
from ...engine.contract import HostState
from ..kit import LaneTable, check_lanes, read_plan
from ..llama.holders import Watcher
from ..llama.samplers import Samplers
from ...sampling import SamplingParams
from ...types import ReleaseReason

import numpy as np

from .channel import StageChannel, StageFailure, StageInterrupted, StageTimeout
from .flight import Flight, FlightHandle
from .holders import (PrefixHolders, RemoteCells, StageHolders, check_stage_capacities,
                      restored, restored_prefixes)
from .split import StageInfo, check_stage_set
from .usage import UsageVerbs, check_stage_cells
from .vocab import Vocabulary, VocabularyVerbs
from .wire import encode_plan

__all__ = ["StageFailure", "StageHost", "StageTimeout"]

CONFIGURE_NOTE_S = 10.0  # how often the wait for the stages' configuration says what it waits for


class StageHost(VocabularyVerbs, UsageVerbs, StageChannel):
    """Runs plans on a chain of stage workers (see the module docstring)."""

    def __init__(self, addresses: _Seq[str], *, n_ctx: int = 4096, n_seq_max: int = 8,
                 n_batch: int = 512, n_threads: int = 2, kv_type: str = "f32",
                 flash_attn: bool = False, reply_address: Optional[str] = None,
                 timeout_s: float = 60.0, configure_timeout_s: float = 600.0,
                 source_id: Optional[str] = None,
                 vocab_model: Optional[str] = None, procs: _Seq[Any] = (),
                 prefix_cache_tokens: int = 0, prefix_holders: int = 16,
                 pipeline_depth: int = 1,
                 stage_prefix_cache_tokens: Optional[_Seq[int]] = None,
                 stage_n_ctx: Optional[_Seq[int]] = None) -> None:
        self.n_seq_max = check_int("n_seq_max", n_seq_max, 1)
        self.n_ctx = check_int("n_ctx", n_ctx, 1)
        self.n_batch = check_int("n_batch", n_batch, 1)
        self.pipeline_depth = check_int("pipeline_depth", pipeline_depth, 1)
        prefix_cache_tokens = check_int("prefix_cache_tokens", prefix_cache_tokens, 0)
        self.prefix_cache_tokens = prefix_cache_tokens
        self.prefix_holders = (check_int("prefix_holders", prefix_holders, 1)
                               if prefix_cache_tokens else 0)
        if self.n_seq_max + self.prefix_holders > 256:
            raise ValueError("lanes and prefix holders must be <= 256 sequence ids together")
        self.stage_prefix_cache_tokens = check_stage_capacities(
            stage_prefix_cache_tokens, prefix_cache_tokens, len(addresses))
        self._stage_n_ctx = check_stage_cells(n_ctx, stage_n_ctx, len(addresses))
        if not (math.isfinite(as_float(configure_timeout_s)) and configure_timeout_s > 0):
            raise ValueError(f"configure_timeout_s must be a finite number > 0, got "
                             f"{configure_timeout_s}")
        self.configure_timeout_s = float(configure_timeout_s)
        self._vocab: Any = None
        self.on_close: list[Any] = []  # called after close (e.g. stopping local workers)
        StageChannel.__init__(self, addresses, reply_address, timeout_s, procs)
        self.broken: Optional[str] = None
        self.answers_ping = False  # every worker answers the idle heartbeat (`_configure`)
        try:
            self.stages = self._configure(n_ctx, n_threads, kv_type, flash_attn, source_id)
            self._vocab = Vocabulary(vocab_model or self.stages[0].path)
        except BaseException:
            self.close()
            raise
        self.n_vocab = self._vocab.n_vocab
        # Sampling parameters are checked here and sent to the last stage, which samples.
        self._resolver = Samplers(self.n_vocab, self._vocab.eog, self._vocab.eog_ids,
                                  self._vocab.vocab, max_window=n_ctx)
        self.stage_samplers: list[int] = []  # sampler chains per stage, as last asked (held)
        self.n_ctx_seq = n_ctx // n_seq_max  # a lane's share of the cells (the server's bound)
        self.settings = {
            "stages": len(self.stages), "stage_addresses": self.addresses,
            "stage_layers": [[s.layer_start, s.layer_end] for s in self.stages],
            "n_ctx": n_ctx, "n_seq_max": n_seq_max, "n_batch": n_batch,
            "n_threads": n_threads, "kv_type": kv_type, "flash_attn": bool(flash_attn),
            "kv_unified": True, "prefix_cache_tokens": prefix_cache_tokens,
            "prefix_holders": self.prefix_holders, "pipeline_depth": self.pipeline_depth,
            "stage_prefix_cache_tokens": self.stage_prefix_cache_tokens,
            "stage_cells": self.stage_cells,
        }
        # Prefix reuse: the store of what every stage holds, its decisions queued as memory
        # operations (with a capacity per stage, also a store per stage: holders.py).
        self._cells = RemoteCells()
        self._holders: Optional[PrefixHolders] = None
        self.prefix_store: Any = None
        caps = self.stage_prefix_cache_tokens
        if prefix_cache_tokens and any(c != prefix_cache_tokens for c in caps):
            self._holders = StageHolders(prefix_cache_tokens, caps, self.prefix_holders,
                                         n_seq_max, n_seq_max, n_ctx, self._cells)
        elif prefix_cache_tokens:
            self._holders = PrefixHolders(prefix_cache_tokens, self.prefix_holders, n_seq_max,
                                          n_seq_max, n_ctx, self._cells,  # type: ignore[arg-type]
                                          shared_cells=True)
        if self._holders is not None:
            self.prefix_store = self._holders.store
        # Per lane: its sequence, what the stages hold once the plans sent have run, and a
        # generation that changes with the lane's owner (what the plans in flight did to it is
        # then stale). The stages drop a lane's cells with the release table or the holders'
        # memory operations, so the table has no cells of its own.
        self._lanes = LaneTable(n_seq_max)
        self._pending_release: list[int] = []
        self._flights: deque[Flight] = deque()  # sent, not yet answered, oldest first
        self.steps = 0
        self.most_in_flight = 0  # the most plans that were in the chain at once

    # ------------------------------------------------------------------ setup
    def _configure(self, n_ctx: int, n_threads: int, kv_type: str, flash_attn: bool,
                   source_id: Optional[str]) -> list[StageInfo]:
        p = len(self.addresses)
        for k, sock in enumerate(self._out):
            conf = {"index": k, "tag": self._tag + 1, "driver": self.driver,
                    "reply": self.reply_address,
                    "next": self.addresses[k + 1] if k + 1 < p else None,
                    "n_ctx": self._stage_n_ctx[k],
                    "n_seq_max": self.n_seq_max + self.prefix_holders,
                    "n_batch": self.n_batch,
                    "n_threads": n_threads, "kv_type": kv_type, "flash_attn": flash_attn}
            sock.send_multipart([b"conf", json.dumps(conf).encode()])
        self._tag += 1
        # A worker loads its layers when configured: a large stage takes a while to read, so
        # the wait is longer than a plan's, and says every 10 s which stages it waits for.
        ready = self._collect(b"ready", "configuring (each stage loads its layers)",
                              timeout_s=self.configure_timeout_s, note_s=CONFIGURE_NOTE_S)
        unmarked = [r["index"] for r in ready if r.get("driver") != self.driver]
        if unmarked:
            raise StageFailure(f"{self._named(unmarked)} did not take this driver's id (a "
                               "worker of an earlier release): restart it with this release")
        try:
            infos = [StageInfo(path=r["path"], index=r["stage_index"], count=r["count"],
                               layer_start=r["layer_start"], layer_end=r["layer_end"],
                               source_layers=r["source_layers"], source_id=r["source_id"],
                               source_name=r["source_name"]) for r in ready]
            dims = {int(r["n_embd"]) for r in ready}
            n_batch = [int(r["n_batch"]) for r in ready]
            self.stage_cells = [int(r["n_ctx"]) for r in ready]
            self.stage_kv_bytes = [int(r.get("kv_bytes_per_token", 0)) for r in ready]
        except (KeyError, TypeError, ValueError) as exc:
            raise StageFailure(f"a stage sent a malformed ready answer: {exc!r}") from None
        check_stage_set(infos, source_id)
        if len(dims) != 1:
            raise StageFailure(f"stages disagree on the embedding width: {sorted(dims)}")
        self.n_embd = dims.pop()
        # A stage whose context got a smaller batch than asked sizes every plan.
        self.n_batch = min([self.n_batch] + n_batch)
        # Workers of an earlier release do not answer the idle heartbeat (nor say they do).
        self.answers_ping = all(bool(r.get("answers_ping")) for r in ready)
        return infos

    # ------------------------------------------------------------------ Host verbs
    @property
    def sequence_id_settings(self) -> dict[str, int]:
        """The scheduler config fields that match the stages' sequence ids: the lanes, then
        the holders in the reserved range above them."""
        return {"sequence_id_limit": self.n_seq_max + self.prefix_holders,
                "reserved_sequence_ids": self.prefix_holders}

    def release(self, sequence_id: str, reason: Optional[ReleaseReason] = None) -> bool:
        """Free the sequence's lane; the stages free its KV after the plans already sent. With
        prefix reuse its positions are first offered to the store (not for a failed one, nor
        for one with a row still in the chain)."""
        lane = self._lanes.lane_of(sequence_id)
        if lane is None:
            return False
        busy = any(lane in f.lane_set for f in self._flights)
        end = self._lanes.end(lane)
        self._lanes.give_back(sequence_id)
        if self._holders is not None and self.broken is None:
            # Memory operations keep their order: the holders copy the lane before it empties.
            if end and reason is not ReleaseReason.FAILED and not busy:
                self._holders.keep(lane, end)
            self._cells.remove(lane)
        else:
            self._pending_release.append(lane)
        return True

    def _flush_ops(self) -> None:
        """Send the queued memory operations down the chain: every stage runs them after the
        plans sent before and before the next plan (its answer is taken when it comes)."""
        ops = self._cells.take()
        if ops and self.broken is None:
            self.mem_pending.add(self._send_chain(b"mem", {"ops": ops}))

    def _settle(self) -> None:
        """A chain message that failed on a stage leaves the stages disagreeing: broken."""
        if self.chain_errors:
            self._break_chain(self.chain_errors[0])

    def _break_chain(self, reason: str) -> None:
        """The chain cannot run any more: `broken` says why (the first reason stays), and the
        stages still live free every lane."""
        if self.broken is None:
            self.broken = reason
            self._free_survivors()

    def execute(self, plan: Any) -> int:
        """Run `plan` on every stage and fill `plan.outputs`; return the output count."""
        return self.execute_async(plan).result()

    def execute_async(self, plan: Any) -> FlightHandle:
        """Send `plan` down the chain and return at once; `result()` takes its answer (plans
        are answered in the order sent) and fills `plan.outputs`."""
        self._settle()
        return FlightHandle(self, self._send(plan), plan)

    def _send(self, plan: Any) -> Optional[Flight]:
        rows = len(plan)
        if rows == 0 or self.broken is not None:
            # Broken stages run nothing: every sampling row is left without an output, which
            # fails its sequence (docs/stages.md "When a stage fails").
            return None
        plan_rows = read_plan(plan, self.n_batch, self.n_vocab)
        offsets, tokens, positions = plan_rows.offsets, plan_rows.tokens, plan_rows.positions
        ids, starts, new = plan_rows.ids, plan_rows.starts, plan_rows.new_rows
        self._flush_ops()
        holders = self._holders
        # Row -> holder of every new row that restores a resident prefix, and row -> sampling
        # of every new row that does not sample plain greedy.
        restore = {n.row: n.holder for n in plan_rows.new
                   if holders is not None and n.holder is not None}
        sampling = {n.row: params for n in plan_rows.new
                    if (params := self._resolver.resolve(n.sampling)) is not None}
        check_lanes(ids, starts, {n.sequence_id: n.holder for n in plan_rows.new}, self._lanes,
                    holders, "the stages")
        lanes = np.empty(rows, dtype=np.int32)
        for r, seq in enumerate(ids):
            lane = self._lanes.lane_of(seq)
            lanes[r] = self._lanes.take(seq) if lane is None else lane
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
            for r in new:  # nothing was sent: the new sequences give their lanes back
                self._lanes.give_back(ids[r])
            raise
        released, self._pending_release = self._pending_release, []
        if self._holders is not None:  # the lanes restored get the holders' prefixes
            for r, holder in restore.items():
                restored(self._holders, self._cells, int(lanes[r]), holder, starts[r])
        if sampling:  # every new row's sampling, ahead of the plan (the last stage keeps it)
            self._send_chain(b"samp", {"step": step, "lanes": {
                str(int(lanes[r])): dataclasses.asdict(sampling[r]) if r in sampling else None
                for r in new},
                "prefixes": restored_prefixes(self._holders, sampling, restore, lanes, starts)})
        self._send_plan(frame)
        lane_list = lanes.tolist()
        flight = Flight(plan, step, ids, lanes, [self._lanes.generation(x) for x in lane_list],
                        starts, new, released, [self._lanes.end(x) for x in lane_list],
                        plan_rows.sample_rows)
        self._flights.append(flight)
        self.most_in_flight = max(self.most_in_flight, len(self._flights))
        self.awaited.add(step)
        # What every stage holds once it has run the plan (they run plans in the order sent).
        for lane, end in zip(lane_list, plan_rows.ends):
            self._lanes.advance(lane, end)
        if self._holders is not None:
            self._holders.wrote(np.repeat(lanes, np.diff(offsets)), positions, tokens)
        return flight

    def _resolve(self, flight: Flight) -> int:
        """The answer of `flight` (the plans sent before it are answered first)."""
        while flight.state == "sent":
            self._answer_oldest()
        if flight.error is not None:
            raise flight.error
        return flight.count

    def _answer_oldest(self) -> None:
        f = self._flights[0]
        since = time.monotonic()
        try:
            while f.step not in self.terminal and self.broken is None and not self.chain_errors:
                self._pump(f"running step {f.step}", since)
            if self.broken is not None or self.chain_errors:
                raise StageFailure(self.broken or self.chain_errors[0])
            answer = self.terminal.pop(f.step)
            if answer[0] == "err":
                raise StageFailure(answer[1])
            _, out_rows, out_tokens = answer
            if not np.array_equal(out_rows, f.sample_rows):
                raise StageFailure(f"the last stage answered step {f.step} rows "
                                   f"{out_rows.tolist()} for rows {f.sample_rows.tolist()}")
            if len(out_tokens) and not (-1 <= int(out_tokens.min())
                                        and int(out_tokens.max()) < self.n_vocab):
                raise StageFailure(f"the last stage answered step {f.step} with tokens outside "
                                   f"[-1, {self.n_vocab}): {out_tokens.tolist()}")
        except StageFailure as exc:
            self._fail_from(exc)
            return
        self._flights.popleft()
        self.awaited.discard(f.step)
        k = len(f.sample_rows)
        outputs = f.plan.outputs
        outputs.request_indexes[:k] = f.sample_rows
        outputs.predicted_tokens[:k] = out_tokens
        outputs.count = k
        f.finish(k)
        self.steps += 1

    def _fail_from(self, exc: StageFailure) -> None:
        """The oldest plan in flight failed: it and every later one are undone (module
        docstring), or, with a stage gone, the chain is broken and they all end empty."""
        flights = list(self._flights)
        self.awaited.discard(flights[0].step)  # its answer came, or never will
        if (not isinstance(exc, (StageTimeout, StageInterrupted)) and self.broken is None
                and len(self.live) == len(self._out)):
            try:  # every later plan and memory message ends somewhere first
                self._quiesce("waiting for the plans in flight after a failure")
            except StageFailure:
                pass  # a stage is gone too: the chain breaks below
        if isinstance(exc, (StageTimeout, StageInterrupted)):
            # The chain did not answer in time, and which stage holds it up cannot be told:
            # every stage is taken for dead, so nothing waits for one as long again (an undo,
            # freeing the survivors); the chain breaks. (Interrupted: the driver is going.)
            self.live.clear()
        undo_stages = (self.broken is None and not self.chain_errors
                       and len(self.live) == len(self._out))
        for f in reversed(flights):
            try:
                self._undo(f, undo_stages)
            except StageFailure as more:
                self.broken = str(more)  # a stage cannot be put back: nothing more runs on it
                undo_stages = False
        self._flights.clear()
        self.awaited.clear()
        self.terminal.clear()
        if self.broken is None and undo_stages:
            flights[0].fail(exc)
            for f in flights[1:]:
                f.fail(StageFailure(f"step {f.step} was undone: an earlier plan failed ({exc})"))
            return
        if self.broken is None:
            self.broken = str(exc)
        elif str(exc) not in self.broken:
            self.broken = f"{exc}; then {self.broken}"
        self._free_survivors()
        for f in flights:
            f.plan.outputs.count = 0
            f.finish(0)

    def _quiesce(self, what: str, timeout_s: Optional[float] = None) -> None:
        """Wait until every plan and memory message sent has been answered (within
        `timeout_s`, default the host's, for all of them together)."""
        since = time.monotonic()
        while (self.awaited - self.terminal.keys() or self.mem_pending) and not self.chain_errors:
            self._pump(what, since, timeout_s)

    def _drain(self, what: str, timeout_s: Optional[float] = None) -> None:
        """`_quiesce` for the inspection verbs: a stage that fails meanwhile breaks the chain
        (the plans in flight are then left to end empty), and the failure is raised."""
        try:
            self._quiesce(what, timeout_s)
        except StageFailure as exc:
            self._break_chain(str(exc))
            raise

    def _send_releases(self, what: str, timeout_s: Optional[float] = None) -> None:
        """Have every stage free the released lanes now (with no plan in flight: they would
        otherwise ride on the next plan); a stage that does not answer breaks the chain."""
        if not self._pending_release or self.broken is not None:
            return
        self._broadcast(b"release", {"lanes": self._pending_release})
        try:
            self._collect(b"released", what, timeout_s)
        except StageFailure as exc:
            self._break_chain(str(exc))
            raise
        self._pending_release = []

    def _undo(self, f: Flight, stages: bool) -> None:
        """Put the driver (and, with `stages`, every stage) back where `f` found them."""
        new_set = set(f.new)
        lanes = self._lanes
        for r, lane in enumerate(f.lanes.tolist()):
            if lanes.generation(lane) != f.gens[r]:
                continue  # released since: its lane is another sequence's business now
            if r in new_set and lanes.lane_of(f.ids[r]) == lane:
                lanes.give_back(f.ids[r])
            else:
                lanes.advance(lane, f.prev_pos[r])
        if stages:
            self._broadcast(b"undo", {
                "release": f.released, "lanes": f.lanes.tolist(),
                "starts": [0 if r in new_set else s for r, s in enumerate(f.starts)]})
            self._collect(b"undone", "undoing a failed plan")

    def _free_survivors(self) -> None:
        """With the chain broken: every live stage frees every lane (best effort), and the
        driver forgets its lanes' positions; sequences keep their lanes until released."""
        self._pending_release = []
        self._cells.take()
        self._lanes.forget_positions()
        try:
            self._broadcast(b"release",
                            {"lanes": list(range(self.n_seq_max + self.prefix_holders))})
            self._collect(b"released", "freeing the surviving stages")
        except StageFailure:
            pass  # a stage that does not answer now is not live any more

    # ------------------------------------------------------------------ vocabulary, sampling
    @property
    def holders(self) -> Optional[PrefixHolders]:
        """The prefix holders every stage keeps (None without reuse)."""
        return self._holders

    def watch_prefixes(self, watcher: Watcher) -> None:
        """Call `watcher("inserted" | "evicted", entry)` after every change of the prefix
        store's residency (the serving seam's `PrefixEventsHost`; nothing without reuse)."""
        if self._holders is not None:
            self._holders.watch(watcher)

    def held_tokens(self, sequence_id: str) -> Optional[list[int]]:
        """The tokens the stages hold for running `sequence_id` once the plans sent have run,
        position 0 first; None when it holds no lane, or without reuse."""
        lane = self._lanes.lane_of(sequence_id)
        if lane is None or self._holders is None:
            return None
        tokens: list[int] = self._holders.lane_tokens(lane, self._lanes.end(lane)).tolist()
        return tokens

    def prepare_sequence(self, sequence: Any) -> Any:
        """Refuse at submit, before anything is queued, sampling the stages cannot do: a bias
        on a token outside the vocabulary, reports (log-probabilities) or a grammar."""
        params = self._resolver.resolve(getattr(sequence, "sampling", None))
        out = params.output if params is not None else None
        if out is not None:
            asked = []
            if out.logprobs is not None or out.prompt_logprobs is not None:
                asked.append("log-probabilities (logprobs, top_logprobs, echo with logprobs, "
                             "best_of, which ranks the choices on them)")
            if out.grammar is not None:
                asked.append("output constrained by a grammar (response_format other than "
                             "text)")
            if asked:
                raise ValueError(f"staged serving cannot give {' nor '.join(asked)} yet")
        return sequence

    # ------------------------------------------------------------------ inspection
    def sync(self, timeout_s: Optional[float] = None) -> None:
        """Let every plan in flight reach every stage, then send pending releases now (they
        otherwise ride on the next plan); each wait at most `timeout_s` (None: the default)."""
        self._settle()
        if self.broken is not None:
            self._pending_release = []  # the live stages were freed when the chain broke
            return
        self._flush_ops()
        self._drain("waiting for the plans in flight", timeout_s)
        self._settle()
        self._send_releases("releasing lanes", timeout_s)

    def check_alive(self, timeout_s: float) -> Optional[str]:
        """A heartbeat between requests: every live stage answers a ping within `timeout_s`,
        or the chain is broken (a remote worker that died or hung while idle is otherwise
        noticed only when a plan reaches it). Skipped while plans or memory messages are in
        flight (their answers already tell), and with workers of an earlier release, which do
        not answer pings (their `ready` does not say `answers_ping`). The lanes released since
        the last plan are freed on the stages first (an idle server keeps no KV of a finished
        request). Why the chain is broken, or None."""
        self._settle()
        if (self.broken is not None or self._flights or self.mem_pending
                or not self.answers_ping):
            return self.broken
        what = "checking that the idle stages answer"
        try:
            # The ping first: each stage answers it on its own, so a timeout names only the
            # stages that did not (a memory message's answer comes from the chain's end, and
            # its timeout would name every stage).
            self._broadcast(b"ping", {})
            self._collect(b"pong", what, timeout_s)
            if self._cells.ops:  # with prefix reuse a released lane's removal waits here
                self._flush_ops()
                self._drain(what, timeout_s)
                self._settle()
            self._send_releases(what, timeout_s)
        except StageFailure as exc:
            self._break_chain(str(exc))
        self._settle()
        gone = set(range(len(self.addresses))) - self.live
        if gone:  # dropped earlier, its queue full (`_broadcast`)
            self._break_chain(f"{self._named(gone)} stopped reading its messages")
        return self.broken

    def held(self, holders: bool = False) -> list[dict[int, int]]:
        """Per live stage: positions held by every lane with KV (after `sync`); with `holders`
        the prefix holders' too."""
        if self.broken is None:
            self._drain("waiting for the plans in flight")
        self._broadcast(b"held", {})
        top = self.n_seq_max + (self.prefix_holders if holders else 0)
        replies = self._collect(b"held", "asking what is held")
        try:
            samplers = [int(r.get("samplers", 0)) for r in replies]
            held = [{int(k): int(v) for k, v in r["lanes"].items() if int(k) < top}
                    for r in replies]
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise StageFailure(f"a stage sent a malformed held answer: {exc!r}") from None
        self.stage_samplers = samplers
        return held

    @property
    def active_sequences(self) -> list[str]:
        return self._lanes.active

    def release_all(self) -> None:
        """Release every sequence (recovery after a failure), then free the lanes on the
        stages at once."""
        for sequence_id in self._lanes.active:
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
            lanes=self.n_seq_max, free_lanes=self._lanes.free, active=tuple(self._lanes.active),
            kv_tokens=self._lanes.kv_tokens,
            kv_capacity=self.n_ctx, kv_lane_capacity=self.n_seq_max * self.n_ctx_seq,
            lane_positions=positions,
            samplers=sum(self.stage_samplers) if detail else 0)

    def abandon(self) -> None:
        """Stop the local workers (the `on_close` callbacks) without closing the sockets:
        what a server shutting down does when its engine thread is still waiting on them."""
        self.interrupt("the stage host was abandoned")
        callbacks, self.on_close = self.on_close, []
        for callback in callbacks:
            callback()

    def close(self) -> None:
        self.close_channel()
        if self._vocab is not None:
            self._vocab.close()
            self._vocab = None
        callbacks, self.on_close = self.on_close, []
        for callback in callbacks:
            callback()

    def __enter__(self) -> "StageHost":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
