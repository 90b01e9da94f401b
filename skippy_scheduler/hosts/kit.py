"""What the llama host and the stage host share: a lane table, a plan reader, a batch builder.

* `LaneTable`: which sequence holds which lane (a llama sequence id below the lane count, lowest
  free first), the positions [0, `end(lane)`) each lane holds, and a generation per lane that
  changes with its owner. Given the context's cells, it drops a lane's cells when it empties or
  cuts the lane. A stage runner, whose lanes the driver assigns, keeps only the positions.
* `read_plan`: a plan's rows, checked against a host's batch and vocabulary, with its new rows
  as the plan states them (`plan.new_rows`, never guessed from the lanes): `PlanRows`, `NewRow`.
  `check_lanes`: every row fits the lanes (a new row brings a sequence without a lane, any other
  row continues one, and no row starts past what is held for it), before anything changes.
* `LlamaBatch`: a `llama_batch` over numpy buffers sized once (token or embedding input), each
  entry with one sequence id, logits for the entries flagged; `decode(..., synchronize=True)`
  returns with the outputs ready and in batch order, the GIL given up once
  (`_llama_calls.decode_synced`).
* `function_address`, `pointer_address`: llama.cpp's functions and objects as addresses, for
  the calls `_llama_calls` makes.
"""
from __future__ import annotations

import ctypes
import heapq
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Protocol

import numpy as np
import numpy.typing as npt

import llama_cpp as _ll

from .. import _llama_calls
from ..engine.contract import Plan

IntArray = npt.NDArray[np.integer[Any]]

__all__ = ["Cells", "HolderLengths", "LaneTable", "LlamaBatch", "NewRow", "PlanRows",
           "check_lanes", "read_plan"]


# ------------------------------------------------------------------------------------- lanes
class Cells(Protocol):
    """The cell verb a lane table uses: drop `seq`'s positions [start, end) (-1: open end)."""

    def remove(self, seq: int, start: int = -1, end: int = -1) -> None: ...


class LaneTable:
    """Which sequence holds which lane and how many positions each lane holds."""

    def __init__(self, count: int, cells: Optional[Cells] = None) -> None:
        self.count = count
        self._cells = cells
        self._free: list[int] = list(range(count))
        self._lane: dict[str, int] = {}
        self._end = [0] * count
        self._gen = [0] * count
        self.changes = 0  # bumped by every change of an owner or an end (a staleness check)

    @property
    def active(self) -> list[str]:
        return list(self._lane)

    @property
    def free(self) -> int:
        return len(self._free)

    def lane_of(self, sequence_id: str) -> int | None:
        return self._lane.get(sequence_id)

    def holds(self, sequence_id: str) -> bool:
        return sequence_id in self._lane

    def end(self, lane: int) -> int:
        """Positions [0, end) of `lane` are held."""
        return self._end[lane]

    def advance(self, lane: int, end: int) -> None:
        """`lane` holds positions [0, end) now (its cells are left as they are)."""
        self._end[lane] = end
        self.changes += 1

    def generation(self, lane: int) -> int:
        """Changes whenever `lane` is given back: what was recorded of it before is stale."""
        return self._gen[lane]

    @property
    def kv_tokens(self) -> int:
        """Positions held by the lanes of running sequences."""
        return sum(self._end[lane] for lane in self._lane.values())

    def held_lanes(self) -> list[int]:
        """The lanes holding any position."""
        return [lane for lane, end in enumerate(self._end) if end]

    def take(self, sequence_id: str) -> int:
        """The lowest free lane, empty, now held by `sequence_id`."""
        lane = heapq.heappop(self._free)
        self._lane[sequence_id] = lane
        if self._cells is not None:
            self._cells.remove(lane)
        self._end[lane] = 0
        self.changes += 1
        return lane

    def cut(self, lane: int, start: int) -> None:
        """Drop the lane's positions >= start (a replay rewrites them)."""
        if self._cells is not None:
            self._cells.remove(lane, start, -1)
        self._end[lane] = start
        self.changes += 1

    def give_back(self, sequence_id: str) -> int:
        """`sequence_id` lets go of its lane (returned): emptied, a new generation, free."""
        lane = self._lane.pop(sequence_id)
        if self._cells is not None:
            self._cells.remove(lane)
        self._end[lane] = 0
        self._gen[lane] += 1
        self.changes += 1
        heapq.heappush(self._free, lane)
        return lane

    def forget_positions(self) -> None:
        """Every lane holds nothing now (its owner keeps it until given back)."""
        self._end = [0] * self.count
        self.changes += 1


# ------------------------------------------------------------------------------------- plans
@dataclass(frozen=True)
class NewRow:
    """A row where a sequence's runtime state starts (`plan.new_rows`)."""

    row: int
    sequence_id: str
    start: int
    sampling: Any  # the sequence's `sampling`, as submitted
    holder: int | None  # the prefix holder positions [0, start) come from


@dataclass(frozen=True)
class PlanRows:
    """A plan's rows as a host runs them (`read_plan`)."""

    offsets: npt.NDArray[np.int64]
    tokens: IntArray
    positions: IntArray
    ids: list[str]
    starts: list[int]
    sample_rows: npt.NDArray[np.int64]
    new: list[NewRow]

    @property
    def ends(self) -> list[int]:
        """Per row: positions [0, end) are held once the row has run."""
        ends: list[int] = (self.positions[self.offsets[1:] - 1] + 1).tolist()
        return ends

    @property
    def new_rows(self) -> list[int]:
        return [n.row for n in self.new]


def check_tokens(tokens: IntArray, n_vocab: int, offsets: npt.NDArray[np.int64],
                 positions: IntArray, ids: list[str]) -> None:
    """ValueError unless every input token of a plan's rows (`offsets`, `positions`, `ids`)
    is in [0, n_vocab), naming the first row that is not and why: a deferred input still
    unfilled (-1, the placeholder of an input an earlier plan samples), or a token the model
    does not have (a sequence given to the scheduler without its host's `prepare_sequence`)."""
    if not len(tokens) or (int(tokens.min()) >= 0 and int(tokens.max()) < n_vocab):
        return
    at = int(np.flatnonzero((tokens < 0) | (tokens >= n_vocab))[0])
    row = int(np.searchsorted(offsets, at, side="right")) - 1
    token = int(tokens[at])
    where = (f"plan tokens must be in [0, {n_vocab}) for this model: row {row} ({ids[row]!r}) "
             f"has token {token} at position {int(positions[at])}")
    if token < 0:
        raise ValueError(f"{where}, a deferred input left unfilled (fill it from the plan "
                         "that samples it before running this one: resolve_deferred)")
    raise ValueError(f"{where}, outside the model's vocabulary (the engine refuses such a "
                     "request at submit, through its host's prepare_sequence)")


def read_plan(plan: Plan, n_batch: int, n_vocab: int, *, check: bool = True) -> PlanRows:
    """The rows of a non-empty plan, checked: the batch holds them, the arrays agree, every
    token is in the vocabulary (`check=False`: not yet, for a plan whose deferred inputs
    are filled later, `check_tokens`), every new row starts where the plan says it restored
    to. ValueError otherwise. The tokens are a view of the plan's, so inputs filled later
    show through."""
    offsets = np.asarray(plan.row_offsets, dtype=np.int64)
    n = int(offsets[-1])
    if n > n_batch:
        raise ValueError(f"plan has {n} tokens but the batch holds {n_batch}; keep "
                         "max_tokens_per_iteration <= n_batch")
    tokens = np.asarray(plan.tokens)[:n]
    positions = np.asarray(plan.positions)[:n]
    if len(tokens) != n or len(positions) != n or n != plan.token_count:
        raise ValueError(f"plan arrays disagree: row_offsets end at {n}, token_count is "
                         f"{plan.token_count}, {len(tokens)} tokens and {len(positions)} "
                         "positions")
    ids = list(plan.sequence_ids)
    if check:
        check_tokens(tokens, n_vocab, offsets, positions, ids)
    starts: list[int] = positions[offsets[:-1]].tolist()
    new = []
    rows = np.flatnonzero(plan.new_rows).tolist()
    if rows:
        work = plan.work
        restored = plan.restored_tokens
        for r in rows:
            if int(restored[r]) != starts[r]:
                raise ValueError(f"the new row of {ids[r]!r} starts at position {starts[r]} "
                                 f"but the plan says it restored {int(restored[r])} tokens")
            w = work[r]
            new.append(NewRow(r, ids[r], starts[r], w.sampling, w.restore_holder))
    return PlanRows(offsets, tokens, positions, ids, starts,
                    np.asarray(plan.sample_rows, dtype=np.int64), new)


class HolderLengths(Protocol):
    """How many positions a prefix holder holds (the hosts' `PrefixHolders`)."""

    def length(self, holder: int) -> int: ...


def check_lanes(ids: list[str], starts: list[int], new: Mapping[str, Optional[int]],
                lanes: LaneTable, holders: Optional[HolderLengths], where: str) -> None:
    """Rows (a sequence id and a start each) that fit `lanes` (module docstring): ValueError
    for a sequence with two rows or a row that does not fit, RuntimeError when the new rows
    need more lanes than are free. `new`: the sequences whose row is new, each with the holder
    its positions come from (`holders`: None without reuse); `where` names the host."""
    if len(set(ids)) != len(ids):
        raise ValueError("a sequence appears in more than one row of the plan")
    if len(new) > lanes.free:
        raise RuntimeError(
            f"{len(new)} new sequences but only {lanes.free} free llama sequence ids "
            f"(n_seq_max={lanes.count}); keep max_active_sequences <= n_seq_max")
    for seq, start in zip(ids, starts):
        lane = lanes.lane_of(seq)
        if seq in new:
            if lane is not None:
                raise ValueError(f"a new row of {seq!r}, but a lane of {where} still holds it "
                                 "(release it first)")
            holder = new[seq]
            have = holders.length(holder) if holders is not None and holder is not None else 0
        elif lane is None:
            raise ValueError(f"row of {seq!r} is not a new row but nothing is held for it on "
                             f"{where}")
        else:
            have = lanes.end(lane)
        if start > have:
            raise ValueError(f"row of {seq!r} starts at position {start} but {have} positions "
                             f"are held for it on {where} (no resident prefix restores them)")


# ------------------------------------------------------------------------------------- batch
def pointer_address(pointer: Any) -> int:
    """A pointer llama.cpp handed back as an integer (ctypes gives an int or a c_void_p)."""
    if isinstance(pointer, int):
        return pointer
    return ctypes.cast(pointer, ctypes.c_void_p).value or 0


def function_address(name: str) -> int:
    """The address of llama.cpp's function `name` in the library llama-cpp-python loaded, or of
    its binding; 0 when neither gives one."""
    lib = getattr(getattr(_ll, "llama_cpp", None), "_lib", None)
    candidates: list[Any] = []
    try:
        candidates.append(lib[name] if lib is not None else None)
    except (AttributeError, KeyError, TypeError):
        pass
    candidates.append(getattr(_ll, name, None))
    for fn in candidates:
        if fn is None:
            continue
        try:
            address = ctypes.cast(fn, ctypes.c_void_p).value
        except (ctypes.ArgumentError, TypeError):
            continue
        if address:
            return int(address)
    return 0


_synced: Optional[tuple[int, int]] = None  # llama_decode's and llama_get_logits's addresses


def _synced_calls() -> tuple[int, int]:
    """The addresses `decode_synced` calls, found once ((0, 0) when either is missing)."""
    global _synced
    if _synced is None:
        found = (function_address("llama_decode"), function_address("llama_get_logits"))
        _synced = found if all(found) else (0, 0)
    return _synced


class LlamaBatch:
    """A `llama_batch` whose struct points into numpy buffers of `size` entries: `tok` (or
    `embd`, (size, n_embd) float32, when `n_embd` is given) and `pos`, staged by the caller;
    `decode` sets each entry's sequence id (`seq_ids`) and logits flag."""

    def __init__(self, size: int, n_embd: int = 0) -> None:
        self.size = size
        self.tok = np.zeros(size, dtype=np.int32)
        self.embd = np.zeros((size, n_embd), dtype=np.float32) if n_embd else None
        self.pos = np.zeros(size, dtype=np.int32)
        self._nsid = np.ones(size, dtype=np.int32)
        self.seq_ids = np.zeros(size, dtype=np.int32)
        self._flag = np.zeros(size, dtype=np.int8)
        # seq_id is int32**: entry i points at seq_ids[i], so seq ids are filled with numpy.
        self._sid_ptrs = np.uint64(self.seq_ids.ctypes.data) + np.uint64(4) * np.arange(
            size, dtype=np.uint64)
        b: Any = _ll.llama_batch()  # its fields are typed as arrays; they take pointers
        b.n_tokens = 0
        if self.embd is None:
            b.token = self.tok.ctypes.data_as(ctypes.POINTER(_ll.llama_token))
            b.embd = ctypes.POINTER(ctypes.c_float)()
        else:
            b.token = ctypes.POINTER(_ll.llama_token)()
            b.embd = self.embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        b.pos = self.pos.ctypes.data_as(ctypes.POINTER(_ll.llama_pos))
        b.n_seq_id = self._nsid.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        b.seq_id = ctypes.cast(self._sid_ptrs.ctypes.data,
                               ctypes.POINTER(ctypes.POINTER(_ll.llama_seq_id)))
        b.logits = self._flag.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self._batch = b
        self.logits_address = 0  # after a decode with synchronize: its logits (0: none)

    def decode(self, ctx: Any, n: int, entry_lanes: IntArray,
               flagged: Optional[IntArray], *, synchronize: bool = False) -> int:
        """`llama_decode` of the first `n` staged entries, entry i in lane `entry_lanes[i]`,
        with logits for the `flagged` entries (None: every entry); llama.cpp's return code.

        `synchronize`: also wait for the outputs and put them in batch order (after a decode
        that returned 0, `llama_get_logits`, whose address is kept as `logits_address`: on a
        GPU `llama_decode` returns before the device is done, and the first read of an output
        waits and reorders), both in one C call that gives the GIL up once
        (`_llama_calls.decode_synced`; two ctypes calls where llama.cpp's functions cannot be
        found by name). The reads after it are lookups."""
        self.seq_ids[:n] = entry_lanes
        if flagged is None:
            self._flag[:n] = 1
        else:
            self._flag[:n] = 0
            self._flag[flagged] = 1
        self._batch.n_tokens = n
        self.logits_address = 0
        if not synchronize:
            return int(_ll.llama_decode(ctx, self._batch))
        run, outputs = _synced_calls()
        if run:
            rc, self.logits_address = _llama_calls.decode_synced(
                run, outputs, pointer_address(ctx), ctypes.addressof(self._batch))
            return int(rc)
        rc = int(_ll.llama_decode(ctx, self._batch))
        if rc == 0:
            self.read_outputs(ctx)
        return rc

    def read_outputs(self, ctx: Any) -> None:
        """After a decode without `synchronize`: wait for its outputs and put them in batch
        order (`llama_get_logits`, its address kept as `logits_address`)."""
        self.logits_address = pointer_address(_ll.llama_get_logits(ctx))
