"""One plan's rows through one `llama_decode`: staging, the logits read, sampling, reports.

Mixed into `LlamaHost` (host.py checks and assigns the rows first). The rows a fork's followers
run are left out of the batch (forks.py); logits are flagged for each sampling row's last entry
and, for a sequence that asks for prompt log-probabilities, every entry of its prompt rows
(logprobs.py); the sampled tokens are the argmax of each sampling row's logits, overwritten for
the lanes with a sampler chain (samplers.py), and the details the chains report are kept for the
engine until it takes them (`sample_details`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import numpy as np
import numpy.typing as npt

from ..kit import IntArray
from ...engine.contract import Plan
from ...sampling import SampleDetail

if TYPE_CHECKING:  # pragma: no cover
    from .decode import Decoder
    from .forks import Forks
    from .holders import PrefixHolders
    from .lanes import Lanes
    from .samplers import Samplers



class RowDecoding:
    """Mixed into `LlamaHost` (which provides the attributes below)."""

    if TYPE_CHECKING:
        n_batch: int
        decoded_tokens: int
        holders: PrefixHolders | None
        _ctx: Any
        _decoder: Decoder
        _forks: Forks
        _stage_by_lane: bool
        _lanes: Lanes
        n_ctx_seq: int
        gap_fill_max: int
        gap_fill_rows: int
        _samplers: Samplers | None
        _details: dict[int, tuple[Plan, dict[int, SampleDetail]]]

    def _decode_rows(self, row_lanes: IntArray, offsets: IntArray, tokens_in: IntArray,
                     positions: IntArray, sample_rows: IntArray, starts: list[int],
                     ends: list[int], new_keys: dict[int, Any],
                     ) -> tuple[npt.NDArray[np.int32], dict[int, SampleDetail] | None]:
        """Stage the rows that decode (a fork's followers do not, forks.py), flag the entries
        whose logits are read (sampling rows' last, prompt rows' all), decode, sample, report."""
        decoder = self._decoder
        samplers = self._samplers
        assert samplers is not None
        if samplers.reporting:
            for r in new_keys:
                if starts[r] > 0:
                    self._score_restored(int(row_lanes[r]), starts[r])
        lens = np.diff(offsets)
        lead = self._forks.leaders(row_lanes, offsets, tokens_in, starts, new_keys)
        kept = None if lead is None else np.flatnonzero(lead == np.arange(len(lead)))
        lanes_kept = row_lanes if kept is None else row_lanes[kept]
        reordered = (self._stage_by_lane and len(lanes_kept) > 1
                     and bool(np.any(np.diff(lanes_kept) < 0)))
        fill = None
        if self._stage_by_lane:
            staged = int(offsets[-1]) if kept is None else int(lens[kept].sum())
            fill = self._gap_fill(lanes_kept, row_lanes, self.n_batch - staged)
        if kept is None and not reordered and fill is None:
            n = int(offsets[-1])
            decoder.tok[:n] = tokens_in
            decoder.pos[:n] = positions
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
            toks, poss = tokens_in, positions
            if fill is not None:
                fill_lanes, fill_pos = fill
                k = len(fill_lanes)
                seg_lanes = np.concatenate([seg_lanes, fill_lanes])
                seg_lens = np.concatenate([seg_lens, np.ones(k, dtype=seg_lens.dtype)])
                seg_src = np.concatenate([seg_src, offsets[-1] + np.arange(k)])
                toks = np.concatenate([tokens_in, np.zeros(k, dtype=tokens_in.dtype)])
                poss = np.concatenate([positions, fill_pos.astype(positions.dtype)])
            order = (np.argsort(seg_lanes, kind="stable") if reordered or fill is not None
                     else np.arange(len(seg_lanes)))
            seg_lens = seg_lens[order]
            begins = np.zeros(len(order), dtype=np.int64)
            np.cumsum(seg_lens[:-1], out=begins[1:])
            n = int(seg_lens.sum())
            idx = np.repeat(seg_src[order] - begins, seg_lens) + np.arange(n)
            decoder.tok[:n] = toks[idx]
            decoder.pos[:n] = poss[idx]
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
        if flagged is not out_rows or lead is not None or reordered:
            flagged = np.unique(flagged)
        try:
            logits = decoder.decode(n, entry_lanes, flagged)
        finally:
            if fill is not None:
                for lane, pos in zip(fill[0].tolist(), fill[1].tolist()):
                    self._lanes.cut(lane, pos)  # the filler's cell; the lane's end is pos
        if fill is not None:
            self.gap_fill_rows += len(fill[0])
            n -= len(fill[0])
        self.decoded_tokens += n
        samplers.feed(row_lanes, offsets, tokens_in, positions)
        for r, state in prompt_rows:
            entries = np.searchsorted(flagged, np.arange(first[r], first[r] + lens[r]))
            state.take(starts[r], tokens_in[offsets[r]:offsets[r + 1]], logits[entries])
        at = np.searchsorted(flagged, out_rows) if flagged is not out_rows else None
        sampled = logits if at is None else logits[at]
        tokens: npt.NDArray[np.int32] = sampled.argmax(axis=1).astype(np.int32)
        raw = samplers.raw_logprobs(logits, at, row_lanes, sample_rows)
        samplers.pick(self._ctx, tokens, logits, at, row_lanes, sample_rows, out_rows,
                      decoder.pos)
        details = samplers.report(tokens, raw, row_lanes, sample_rows)
        if lead is not None:
            self._forks.copy(row_lanes, lead, starts, ends)
        return tokens, details

    def _gap_fill(self, lanes_kept: IntArray, row_lanes: IntArray, spare: int,
                  ) -> tuple[IntArray, IntArray] | None:
        """The filler rows for the lanes that break the batch's run of decoding lanes: each gap
        of at most `gap_fill_max` lanes between two decoding lanes whose lanes have no row in the
        plan and room for one more cell gets one entry per lane, at the lane's next position,
        while the batch has `spare` entries left beyond the plan's (lanes, positions; None when
        there is nothing to fill). A filler costs about a decode row (its lane's context read
        once), the break it closes a pass over the weights."""
        limit = self.gap_fill_max
        if limit <= 0 or len(lanes_kept) < 2 or spare <= 0:
            return None
        # A plan's lanes are distinct: they are one run exactly when they span their count (the
        # usual case, checked without sorting).
        if int(lanes_kept.max()) - int(lanes_kept.min()) + 1 == len(lanes_kept):
            return None
        present = np.sort(lanes_kept)
        steps = np.diff(present)
        at = np.flatnonzero((steps > 1) & (steps <= limit + 1))
        if len(at) == 0:
            return None
        lanes: list[int] = []
        ends: list[int] = []
        busy = set(row_lanes.tolist())
        room = self.n_ctx_seq
        for i in at.tolist():
            gap = range(int(present[i]) + 1, int(present[i + 1]))
            at_end = [self._lanes.end(g) for g in gap]
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
        assert self._samplers is not None and self.holders is not None
        state = self._samplers.prompt_state(lane)
        if state is None or not state.wants(0, start):
            return
        prefix = self.holders.lane_tokens(lane, start)
        self._lanes.cut(lane, 0)
        decoder = self._decoder
        for a in range(0, start, self.n_batch):
            b = min(a + self.n_batch, start)
            m = b - a
            decoder.tok[:m] = prefix[a:b]
            decoder.pos[:m] = np.arange(a, b, dtype=np.int32)
            logits = decoder.decode(m, np.full(m, lane, dtype=np.int32),
                                    np.arange(m, dtype=np.int64))
            self.decoded_tokens += m
            state.take(a, prefix[a:b], logits)
        self._lanes.advance(lane, start)

    def sample_details(self, plan: Plan) -> Mapping[int, SampleDetail] | None:
        """What `execute(plan)` reported with its samples (`SampleDetail` by work index), once;
        None when no sequence of the plan asked for any."""
        if not self._details:
            return None
        kept = self._details.pop(id(plan), None)
        return kept[1] if kept is not None and kept[0] is plan else None
