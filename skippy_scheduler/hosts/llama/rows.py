"""One call's rows through one `llama_decode`: checks, lanes, staging, logits, sampling, undo.

`RowRunner` runs the rows of a plan (`LlamaHost.execute`) or of a direct call (direct.py) on the
host's parts, which the host hands it when it is built. It checks the rows against the lanes and
sets up the sequences that start (host.py reads them from the plan); the rows a fork's followers
run are left out of the batch (forks.py); logits are flagged for each sampling row's last entry
and, for a sequence that asks for prompt log-probabilities, every entry of its prompt rows
(logprobs.py); the sampled tokens are the argmax of each sampling row's logits, overwritten for
the lanes with a sampler chain (samplers.py), which also report the details asked for. A failed
decode leaves every row's sequence as it was.

A call runs in three parts over a `Staged` record: `stage` (the checks, the sequences that
start, the batch's positions, lanes and flags), `launch` (the tokens copied in, the decode
started; the lanes then hold the rows) and `finish` (the outputs waited for, sampled,
reported). `run` is the three at once. The host stages the next plan between this plan's
launch and finish when that changes no state (`stage(..., ahead=True)`, into the decoder's
spare batch; docs/hosts.md, "Staging ahead").
"""
from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ..kit import IntArray, LlamaBatch, check_lanes
from ...sampling import SampleDetail
from .decode import Decoder
from .forks import Forks
from .holders import PrefixHolders
from .lanes import Lanes, Start
from .samplers import Samplers



class RowRunner:
    """Runs rows on the host's context and parts; counts what it decodes.

    `gap_fill_max`: filler rows close gaps of at most this many lanes in a batch's run of
    decoding lanes (0: off; `_gap_fill`). `solo_fill`: a batch of one token gets a filler row
    on another lane (`_solo_fill`). `decoded_tokens`: batch entries decoded (a fork's copied
    rows not included); `gap_fill_rows` and `solo_fill_rows`: filler entries decoded by each
    (not in `decoded_tokens`).
    """

    def __init__(self, ctx: Any, decoder: Decoder, lanes: Lanes, samplers: Samplers,
                 forks: Forks, holders: PrefixHolders | None, *, n_batch: int, n_ctx_seq: int,
                 stage_by_lane: bool, gap_fill_max: int, solo_fill: bool) -> None:
        self._ctx = ctx
        self._decoder = decoder
        self._lanes = lanes
        self._samplers = samplers
        self._forks = forks
        self._holders = holders
        self._n_batch = n_batch
        self._n_ctx_seq = n_ctx_seq
        self._stage_by_lane = stage_by_lane  # a KV stream per sequence: stage in lane order
        self.gap_fill_max = gap_fill_max
        self.solo_fill = solo_fill
        self.gap_fill_rows = 0
        self.solo_fill_rows = 0
        self.decoded_tokens = 0

    def run(self, ids: list[str], starts: list[int], starting: dict[str, Start],
            offsets: IntArray, tokens_in: IntArray, positions: IntArray, sample_rows: IntArray,
            ) -> tuple[npt.NDArray[np.int32], dict[int, SampleDetail] | None]:
        """Check the rows, set up new sequences, decode; on failure undo every row. Returns
        the sampled token of every sampling row and the details reported with them."""
        step = self.stage(ids, starts, starting, offsets, tokens_in, positions, sample_rows)
        assert step is not None
        self.launch(step)
        return self.finish(step)

    def stage(self, ids: list[str], starts: list[int], starting: dict[str, Start],
              offsets: IntArray, tokens_in: IntArray, positions: IntArray,
              sample_rows: IntArray, *, ahead: bool = False) -> "Staged | None":
        """Check the rows, set up the sequences that start, and stage the rows' positions,
        lanes and flags into a batch (the tokens are copied at `launch`).

        `ahead`: stage a plan queued behind one whose decode is still running, into the
        decoder's other batch, changing no state: None when the plan needs any (a new row, a
        replay from an earlier position, a fork to follow, a prompt whose log-probabilities
        are being collected) or its rows do not match the lanes, so that it is staged when it
        runs. Its deferred input tokens need not be filled yet."""
        if ahead:
            samplers = self._samplers
            held = None if self._forks.following else self._continued_lanes(ids, starts)
            if held is None or (samplers.reporting and any(
                    samplers.prompt_state(lane) is not None for lane in held)):
                return None
            row_lanes = np.array(held, dtype=np.int32)
            new_keys: dict[int, Any] = {}
        else:
            row_lanes = self._assign(ids, starts, starting)
            # A sequence that samples on the device decodes its own rows: a follower has no
            # output of its own to sample (backend_sampling.py), so its key matches no other.
            on_device = self._samplers.on_device
            new_keys = {r: ("device", r) if on_device(int(row_lanes[r]))
                        else _fork_key(starting[seq], starts[r])
                        for r, seq in enumerate(ids) if seq in starting}
        ends = (positions[offsets[1:] - 1] + 1).tolist()
        step = Staged(ids, starts, starting, row_lanes, offsets, tokens_in, positions,
                      sample_rows, ends)
        try:
            self._stage_rows(step, new_keys,
                             self._decoder.spare() if ahead else self._decoder.batch)
        except RuntimeError:
            if not ahead:
                self._undo(ids, row_lanes, starts, starting)
            raise
        return step

    def still_staged(self, step: "Staged") -> bool:
        """Whether `step`, staged ahead, still holds after calls that ran since (releases,
        prompt keeps): every row's sequence on the lane it was staged on, ending where the row
        starts, and the same filler rows (a freed lane changes them)."""
        if self._continued_lanes(step.ids, step.starts) != step.row_lanes.tolist():
            return False
        fill = self._fillers(step.row_lanes, step.lens, step.row_lanes,
                             self._n_batch - int(step.offsets[-1]))
        was = step.fill
        if fill is None or was is None:
            return fill is None and was is None
        return bool(np.array_equal(fill[0], was[0]) and np.array_equal(fill[1], was[1]))

    def _continued_lanes(self, ids: list[str], starts: list[int]) -> list[int] | None:
        """Each row's lane when every row continues its sequence's lane where the lane ends
        (one row a sequence), else None."""
        lanes = self._lanes
        held = []
        for seq, start in zip(ids, starts):
            lane = lanes.lane_of(seq)
            if lane is None or lanes.end(lane) != start:
                return None
            held.append(lane)
        return held if len(set(ids)) == len(ids) else None

    def launch(self, step: "Staged", *, wait: bool = True) -> None:
        """Copy the rows' tokens into the staged batch and start the decode; with `wait`, also
        wait for its outputs (one C call). The rows' lanes then hold their new ends. On
        failure every row is undone."""
        try:
            self._launch_rows(step, wait)
        except RuntimeError:
            self._undo(step.ids, step.row_lanes, step.starts, step.starting)
            raise
        lanes = self._lanes
        for lane, end in zip(step.row_lanes.tolist(), step.ends):
            lanes.advance(lane, end)

    def finish(self, step: "Staged") -> tuple[npt.NDArray[np.int32], dict[int, SampleDetail] | None]:
        """Wait for the launched decode's outputs (when `launch` did not), sample, report.
        On failure every row is undone."""
        try:
            tokens, details = self._finish_rows(step)
        except RuntimeError:
            self._undo(step.ids, step.row_lanes, step.starts, step.starting)
            raise
        if self._holders is not None:
            self._holders.wrote(np.repeat(step.row_lanes, np.diff(step.offsets)),
                                step.positions, step.tokens_in)
        return tokens, details

    def _assign(self, ids: list[str], starts: list[int],
                starting: dict[str, Start]) -> npt.NDArray[np.int32]:
        lanes = self._lanes
        holders = self._holders
        check_lanes(ids, starts, {seq: begin.holder for seq, begin in starting.items()},
                    lanes, holders, "the host")
        samplers = self._samplers
        forks = self._forks
        row_lanes = np.empty(len(ids), dtype=np.int32)
        for i, (seq, start) in enumerate(zip(ids, starts)):
            begin = starting.get(seq)
            if begin is not None:
                lane = lanes.take(seq)
                chain = samplers.start(lane, begin.params)
                if start > 0:
                    assert holders is not None and begin.holder is not None  # checked above
                    prefix = holders.restore(lane, begin.holder, start)
                    lanes.advance(lane, start)
                    if chain is not None:
                        chain.feed(prefix, 0)  # the penalty window sees the prefix too
            else:
                held = lanes.lane_of(seq)
                assert held is not None
                lane = held
                if start < lanes.end(lane):
                    # Replaying from an earlier position: drop the cells the replay rewrites.
                    lanes.cut(lane, start)
                    samplers.rewind(lane, start)
                    forks.forget(lane)
            row_lanes[i] = lane
        return row_lanes

    def _undo(self, ids: list[str], row_lanes: IntArray, starts: list[int],
              starting: dict[str, Start]) -> None:
        # A failed decode leaves each row's sequence as it was before the call: a new one holds
        # nothing (its next row is new again), a running one is cut back to the row's start.
        lanes = self._lanes
        forks = self._forks
        device = self._samplers.device
        for seq, lane, start in zip(ids, row_lanes.tolist(), starts):
            forks.forget(lane)
            if seq in starting:
                self._drop(seq)
            else:
                lanes.cut(lane, start)
                if device is not None:
                    device.rewind(lane, start)  # its window took the row before the decode

    def _drop(self, sequence_id: str) -> None:
        """Free a lane without offering its cells (they were never completed)."""
        lane = self._lanes.lane_of(sequence_id)
        if lane is not None:
            self._samplers.drop(lane)
            self._forks.forget(lane)
            self._lanes.give_back(sequence_id)

    def _stage_rows(self, step: "Staged", new_keys: dict[int, Any], batch: LlamaBatch) -> None:
        """Stage the rows that decode (a fork's followers do not, forks.py) into `batch`:
        their positions and the order their tokens go in, and flag the entries whose logits
        are read (sampling rows' last, prompt rows' all)."""
        samplers = self._samplers
        row_lanes, offsets, positions = step.row_lanes, step.offsets, step.positions
        starts, ends = step.starts, step.ends
        sample_rows = step.sample_rows
        if samplers.reporting:
            for r in new_keys:
                if starts[r] > 0:
                    self._score_restored(int(row_lanes[r]), starts[r])
        lens = np.diff(offsets)
        lead = self._forks.leaders(row_lanes, offsets, step.tokens_in, starts, new_keys)
        kept = None if lead is None else np.flatnonzero(lead == np.arange(len(lead)))
        lanes_kept = row_lanes if kept is None else row_lanes[kept]
        reordered = (self._stage_by_lane and len(lanes_kept) > 1
                     and bool(np.any(np.diff(lanes_kept) < 0)))
        lens_kept = lens if kept is None else lens[kept]
        staged = int(offsets[-1]) if kept is None else int(lens_kept.sum())
        fill = self._fillers(lanes_kept, lens_kept, row_lanes, self._n_batch - staged)
        idx = None
        if kept is None and not reordered and fill is None:
            n = int(offsets[-1])
            batch.pos[:n] = positions
            entry_lanes = np.repeat(row_lanes, lens)
            first = offsets[:-1]
        else:
            # The batch holds the decoding rows in ascending lane order, each row's entries
            # together: with a KV stream per sequence llama.cpp cuts a batch into micro-batches
            # of consecutive sequence ids taken in batch order, and each micro-batch is a pass
            # over the weights, so rows in plan order (admission order, prefill order) cost
            # passes that lane order does not (docs/hosts.md, "Batch order"). With one shared
            # stream (kv_unified) llama.cpp cuts a batch by size alone: plan order is kept.
            # Gap fill: a lane between two decoding lanes that has no row in the plan (a prompt
            # waiting for its next chunk, a free lane) would split the run of consecutive ids
            # into two passes; a one-entry filler row on it (decoded, no logits, its cell
            # dropped after the decode, `_gap_fill`) costs a row instead of a pass.
            stage = np.arange(len(row_lanes)) if kept is None else kept
            seg_lanes = row_lanes[stage]
            seg_lens = lens[stage]
            seg_src = offsets[:-1][stage]
            poss = positions
            if fill is not None:
                fill_lanes, fill_pos = fill
                k = len(fill_lanes)
                seg_lanes = np.concatenate([seg_lanes, fill_lanes])
                seg_lens = np.concatenate([seg_lens, np.ones(k, dtype=seg_lens.dtype)])
                seg_src = np.concatenate([seg_src, offsets[-1] + np.arange(k)])
                poss = np.concatenate([positions, fill_pos.astype(positions.dtype)])
            order = (np.argsort(seg_lanes, kind="stable") if reordered or fill is not None
                     else np.arange(len(seg_lanes)))
            seg_lens = seg_lens[order]
            begins = np.zeros(len(order), dtype=np.int64)
            np.cumsum(seg_lens[:-1], out=begins[1:])
            n = int(seg_lens.sum())
            idx = np.repeat(seg_src[order] - begins, seg_lens) + np.arange(n)
            batch.pos[:n] = poss[idx]
            entry_lanes = np.repeat(seg_lanes[order], seg_lens)
            real = order < len(stage)  # the plan's rows (the rest are fillers)
            first = np.zeros(len(row_lanes), dtype=np.int64)
            first[stage[order[real]]] = begins[real]
            if lead is not None:
                first = first[lead]
        out_rows = first[sample_rows] + lens[sample_rows] - 1
        flagged = out_rows
        prompt_rows = []
        if samplers.reporting:
            for r, lane in enumerate(row_lanes.tolist()):
                state = samplers.prompt_state(lane)
                if state is not None and state.wants(starts[r], ends[r]):
                    prompt_rows.append((r, state))
            if prompt_rows:
                extra = [np.arange(first[r], first[r] + lens[r]) for r, _ in prompt_rows]
                flagged = np.concatenate([out_rows, *extra])
        if fill is not None and n - len(fill[0]) == 1:
            # The solo fill's entry has logits too (a pass with one output rounds otherwise).
            assert idx is not None  # a batch with fillers is staged through `idx`
            flagged = np.concatenate([flagged, np.flatnonzero(idx >= int(offsets[-1]))])
        elif (self.solo_fill and self._stage_by_lane and samplers.device is None
              and staged > len(lens_kept) and len(sample_rows)):
            # llama.cpp's first pass takes one token of each sequence in a run of lanes: a
            # lone decode row meets the prompt chunks' first tokens there, one output among
            # several tokens, which rounds otherwise. Those first tokens get logits too, read
            # by nobody, so that the pass has two outputs or more (not where the device
            # samples: an output row of a lane with a chain attached is sampled there). A batch
            # of single-entry rows (`staged` is their count) has no chunk: nothing to check.
            chunks = np.flatnonzero(lens >= 2)
            if int(np.count_nonzero(lens[sample_rows] == 1)) == 1:
                flagged = np.concatenate([flagged, first[chunks]])
        if flagged is not out_rows or lead is not None:
            flagged = np.unique(flagged)  # a fork's followers share the leader's entry
        elif reordered:
            # One entry per row, all distinct: a sort (numpy's unique hashes, about 50 µs a
            # call on the worker against 14 for the sort).
            flagged = np.sort(out_rows)
        step.batch, step.n, step.idx, step.fill = batch, n, idx, fill
        step.entry_lanes, step.first, step.lens, step.lead = entry_lanes, first, lens, lead
        step.out_rows, step.flagged, step.prompt_rows = out_rows, flagged, prompt_rows

    def _launch_rows(self, step: "Staged", wait: bool) -> None:
        """The rows' tokens into the staged batch (a deferred input is filled by now), the
        device's chains prepared, the decode started (and with `wait` its outputs waited for);
        the filler rows' cells dropped after it."""
        batch, n, idx, fill = step.batch, step.n, step.idx, step.fill
        tokens_in = step.tokens_in
        if idx is None:
            batch.tok[:n] = tokens_in
        elif fill is None:
            batch.tok[:n] = tokens_in[idx]
        else:
            batch.tok[:n] = np.concatenate(
                [tokens_in, np.zeros(len(fill[0]), dtype=tokens_in.dtype)])[idx]
        samplers = self._samplers
        device = samplers.device
        device_rows: list[int] = []
        if device is not None and len(device):
            # The device samples inside the decode: its penalty windows take the rows' tokens
            # first (undone with the rows if the decode fails), its draws are reseeded.
            device.feed(step.row_lanes, step.offsets, tokens_in, step.positions)
            device_rows = device.rows(step.row_lanes, step.sample_rows)
            device.prepare(step.row_lanes, step.sample_rows, device_rows, step.out_rows,
                           batch.pos)
        step.device_rows = device_rows
        decoder = self._decoder
        try:
            if wait or len(step.flagged) == 0:
                step.logits = decoder.decode(n, step.entry_lanes, step.flagged, batch)
            else:
                decoder.launch(n, step.entry_lanes, step.flagged, batch)
        finally:
            if fill is not None:
                lanes = self._lanes
                for lane, pos in zip(fill[0].tolist(), fill[1].tolist()):
                    lanes.cut(lane, pos)  # the filler's cell; the lane's end is pos
        if fill is not None:
            n -= len(fill[0])
            if n == 1:  # a gap fill needs two rows of the plan: this is the solo fill
                self.solo_fill_rows += 1
            else:
                self.gap_fill_rows += len(fill[0])
        self.decoded_tokens += n
        samplers.feed(step.row_lanes, step.offsets, tokens_in, step.positions)

    def _finish_rows(self, step: "Staged",
                     ) -> tuple[npt.NDArray[np.int32], dict[int, SampleDetail] | None]:
        """The launched decode's outputs (waited for here unless `launch` did), sampled and
        reported; a fork's followers take their leader's cells."""
        samplers = self._samplers
        logits = step.logits
        if logits is None:
            logits = step.logits = self._decoder.wait(len(step.flagged))
        row_lanes, offsets, tokens_in = step.row_lanes, step.offsets, step.tokens_in
        sample_rows, out_rows, flagged = step.sample_rows, step.out_rows, step.flagged
        starts, first, lens = step.starts, step.first, step.lens
        pos = step.batch.pos
        for r, state in step.prompt_rows:
            entries = np.searchsorted(flagged, np.arange(first[r], first[r] + lens[r]))
            state.take(starts[r], tokens_in[offsets[r]:offsets[r + 1]], logits[entries])
        at = np.searchsorted(flagged, out_rows) if flagged is not out_rows else None
        tokens: npt.NDArray[np.int32]
        device_rows = step.device_rows
        if not device_rows:
            if at is None:
                tokens = logits.argmax(axis=1).astype(np.int32)
            elif len(flagged) <= 2 * len(at):
                # Rows staged in lane order: the flagged entries are the sampling rows' permuted
                # (or a few more), so the tokens are permuted, not the rows (`logits[at]` would
                # copy every row's logits: 8 MB a step for 64 rows of a 32 000-token vocabulary).
                tokens = logits.argmax(axis=1).astype(np.int32)[at]
            else:  # many prompt entries flagged for their log-probabilities
                tokens = logits[at].argmax(axis=1).astype(np.int32)
        else:
            # The device sampled these rows (their raw logits may not have crossed): the
            # host's argmax covers only the others.
            device = samplers.device
            assert device is not None
            tokens = np.zeros(len(sample_rows), dtype=np.int32)
            host = np.ones(len(sample_rows), dtype=np.bool_)
            host[device_rows] = False
            if host.any():
                js = np.flatnonzero(host)
                tokens[js] = logits[js if at is None else at[js]].argmax(axis=1)
            device.read(tokens, row_lanes, sample_rows, device_rows, out_rows, pos,
                        synchronized=True)
        raw = samplers.raw_logprobs(logits, at, row_lanes, sample_rows)
        samplers.pick(self._ctx, tokens, logits, at, row_lanes, sample_rows, out_rows, pos)
        details = samplers.report(tokens, raw, row_lanes, sample_rows)
        if step.lead is not None:
            self._forks.copy(row_lanes, step.lead, starts, step.ends)
        return tokens, details

    def _fillers(self, lanes_kept: IntArray, lens_kept: IntArray, row_lanes: IntArray,
                 spare: int) -> tuple[IntArray, IntArray] | None:
        """The batch's filler rows (lanes, positions; None: none): the gap fill's (with a KV
        stream per sequence), or the solo fill's for a batch of one token."""
        fill = self._gap_fill(lanes_kept, lens_kept, row_lanes, spare) \
            if self._stage_by_lane else None
        if fill is None and self.solo_fill and spare > 0 and len(lens_kept) == 1 \
                and int(lens_kept[0]) == 1:
            # The one row that decodes (a fork's leader, when the plan's other rows follow
            # it: those lanes have rows in the plan, and no filler goes on them).
            fill = self._solo_fill(int(lanes_kept[0]), row_lanes)
        return fill

    def _solo_fill(self, lane: int, row_lanes: IntArray) -> tuple[IntArray, IntArray] | None:
        """One filler row for a batch of one token. On llama.cpp's CPU backend a pass of one
        token, or with one output, goes through other kernel arithmetic than a pass of two or
        more, and its logits differ in the last bits (bench/batch_invariance.py); a second
        token, in another sequence and with logits of its own, gives the row the bits a decode
        row gets beside other decode rows (docs/hosts.md, "When the tokens are the same"). With
        a KV stream per sequence llama.cpp passes only consecutive sequence ids together, so
        the filler goes on a neighbouring lane: one with no row in the plan, room for a cell,
        and no device sampler attached (its output would be sampled there), the emptier of the
        two, at its next position; `lane` is the decoding row's, `row_lanes` every lane with
        a row in the plan. None when there is no such lane."""
        busy = set(row_lanes.tolist())
        if self._stage_by_lane:
            candidates = [c for c in (lane - 1, lane + 1)
                          if 0 <= c < self._lanes.count and c not in busy]
        else:
            candidates = [c for c in range(self._lanes.count) if c not in busy]
        device = self._samplers.device
        end_of = self._lanes.end
        best, best_end = -1, self._n_ctx_seq
        for c in candidates:
            end = end_of(c)
            if end < best_end and (device is None or not device.attached(c)):
                best, best_end = c, end
        if best < 0:
            return None
        return np.array([best], dtype=np.int64), np.array([best_end], dtype=np.int64)

    def _gap_fill(self, lanes_kept: IntArray, lens_kept: IntArray, row_lanes: IntArray,
                  spare: int) -> tuple[IntArray, IntArray] | None:
        """The filler rows for the lanes that break the batch's run of decoding lanes: each gap
        of at most `gap_fill_max` lanes between two lanes whose rows are one token each (the
        rows' lengths `lens_kept`, beside `lanes_kept`: decode rows, a prompt's last token),
        whose lanes have no row in the plan and room for one more cell, gets one entry per lane,
        at the lane's next position, while the batch has `spare` entries left beyond the plan's
        (lanes, positions; None when there is nothing to fill). A filler costs about a decode
        row (its lane's context read once), the break it closes a pass over the weights. Beside
        a longer row it closes nothing: llama.cpp takes one token of each sequence in the run
        into the first pass and the rest of the longer row as passes of its own, so a filler
        between two prompt chunks would add a pass, and one between a chunk and a decode row
        would save none."""
        limit = self.gap_fill_max
        if limit <= 0 or len(lanes_kept) < 2 or spare <= 0:
            return None
        # A plan's lanes are distinct: they are one run exactly when they span their count (the
        # usual case, checked without sorting).
        if int(lanes_kept.max()) - int(lanes_kept.min()) + 1 == len(lanes_kept):
            return None
        order = np.argsort(lanes_kept)
        present = lanes_kept[order]
        ones = lens_kept[order] == 1
        steps = np.diff(present)
        at = np.flatnonzero((steps > 1) & (steps <= limit + 1) & ones[:-1] & ones[1:])
        if len(at) == 0:
            return None
        lanes: list[int] = []
        ends: list[int] = []
        busy = set(row_lanes.tolist())
        room = self._n_ctx_seq
        end_of = self._lanes.end
        for i in at.tolist():
            gap = range(int(present[i]) + 1, int(present[i + 1]))
            at_end = [end_of(g) for g in gap]
            if len(lanes) + len(gap) > spare or any(g in busy for g in gap) or max(at_end) >= room:
                continue  # no room in the batch, a fork's follower, a full lane: it stays
            lanes.extend(gap)
            ends.extend(at_end)
        if not lanes:
            return None
        return np.array(lanes, dtype=np.int64), np.array(ends, dtype=np.int64)

    def _score_restored(self, lane: int, start: int) -> None:
        """A new sequence that asks for prompt log-probabilities was restored up to `start`: the
        restored positions are decoded again on its lane (the logits they need were never
        kept), so its prompt is reported whole; the scheduler still counts them restored."""
        assert self._holders is not None  # a restore had a holder
        state = self._samplers.prompt_state(lane)
        if state is None or not state.wants(0, start):
            return
        prefix = self._holders.lane_tokens(lane, start)
        self._lanes.cut(lane, 0)
        decoder = self._decoder
        for a in range(0, start, self._n_batch):
            b = min(a + self._n_batch, start)
            m = b - a
            decoder.tok[:m] = prefix[a:b]
            decoder.pos[:m] = np.arange(a, b, dtype=np.int32)
            logits = decoder.decode(m, np.full(m, lane, dtype=np.int32),
                                    np.arange(m, dtype=np.int64))
            self.decoded_tokens += m
            state.take(a, prefix[a:b], logits)
        self._lanes.advance(lane, start)


class Staged:
    """One call's rows from staging to their outputs (`RowRunner.stage`, `launch`, `finish`):
    the rows as read, each row's lane and end, and what staging worked out (the batch, the
    entries' order and lanes, the flagged entries, the fillers)."""

    __slots__ = ("ids", "starts", "starting", "row_lanes", "offsets", "tokens_in", "positions",
                 "sample_rows", "ends", "batch", "n", "idx", "fill", "entry_lanes", "first",
                 "lens", "lead", "out_rows", "flagged", "prompt_rows", "device_rows", "logits")

    def __init__(self, ids: list[str], starts: list[int], starting: dict[str, Start],
                 row_lanes: IntArray, offsets: IntArray, tokens_in: IntArray,
                 positions: IntArray, sample_rows: IntArray, ends: list[int]) -> None:
        self.ids = ids
        self.starts = starts
        self.starting = starting
        self.row_lanes = row_lanes
        self.offsets = offsets
        self.tokens_in = tokens_in
        self.positions = positions
        self.sample_rows = sample_rows
        self.ends = ends
        self.batch: Any = None
        self.n = 0
        self.idx: IntArray | None = None  # batch entry i takes the rows' entry idx[i]
        self.fill: tuple[IntArray, IntArray] | None = None
        self.entry_lanes: Any = None
        self.first: Any = None
        self.lens: Any = None
        self.lead: IntArray | None = None
        self.out_rows: Any = None
        self.flagged: Any = None
        self.prompt_rows: list[tuple[int, Any]] = []
        self.device_rows: list[int] = []
        self.logits: npt.NDArray[np.float32] | None = None


def _fork_key(begin: Start, start: int) -> Any:
    """What a new sequence must share with another to follow it (forks.py): where its KV comes
    from, and its held end tokens, which `pick` writes into the logits they would share."""
    p = begin.params
    hold = (p.min_end_position, p.min_end_tokens) if p is not None else None
    return (begin.holder if start else None, hold)
