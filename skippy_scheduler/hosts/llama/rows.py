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

from ...engine.contract import Plan
from ...sampling import SampleDetail

if TYPE_CHECKING:  # pragma: no cover
    from .decode import Decoder
    from .forks import Forks
    from .holders import PrefixHolders
    from .lanes import Lanes
    from .samplers import Samplers

IntArray = npt.NDArray[np.integer[Any]]


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
        if kept is None and not reordered:
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
            stage = np.arange(len(row_lanes)) if kept is None else kept
            if reordered:
                stage = stage[np.argsort(lanes_kept, kind="stable")]
            stage_lens = lens[stage]
            begins = np.zeros(len(stage), dtype=np.int64)
            np.cumsum(stage_lens[:-1], out=begins[1:])
            n = int(stage_lens.sum())
            idx = np.repeat(offsets[stage] - begins, stage_lens) + np.arange(n)
            decoder.tok[:n] = tokens_in[idx]
            decoder.pos[:n] = positions[idx]
            entry_lanes = np.repeat(row_lanes[stage], stage_lens)
            first = np.zeros(len(row_lanes), dtype=np.int64)
            first[stage] = begins
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
        logits = decoder.decode(n, entry_lanes, flagged)
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
