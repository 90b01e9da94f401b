"""The stage wire format in Python: plan frames, activation frames, output frames.

The layout is documented in docs/wire-format.md and mirrored by the C decoder
(`abi/sk_wire.h`, `csrc/sk_wire.c`). A plan is encoded once per step into one contiguous
buffer; `decode_plan` checks it completely and returns numpy views *into that buffer* (no copy),
or raises `WireError` with the reason, having built nothing. Activations travel as a 32-byte
header and the float32 rows; the last stage answers with the sampled (work index, token) pairs.
"""
from __future__ import annotations

import struct
import sys
from dataclasses import dataclass
from typing import Any, Optional, Sequence as _Seq

import numpy as np
import numpy.typing as npt

# The size of what a stage worker takes (docs/wire-format.md "Limits"): plans of at most
# `max_batch_tokens` tokens (`stage --max-batch-tokens`), so frames of at most `frame_limit`.
DEFAULT_MAX_BATCH_TOKENS = 8192  # the most tokens of a plan a worker takes unless told more
MESSAGE_FLOOR = 64 << 20  # a frame's bytes besides a batch's activations (plans, JSON)
UNKNOWN_EMBD = 16384  # the embedding width assumed for a stage file that does not say its own


def frame_limit(n_embd: int, max_batch_tokens: int) -> int:
    """The largest frame a worker takes: `max_batch_tokens` rows of float32 activations of
    width `n_embd` (UNKNOWN_EMBD when 0), plus MESSAGE_FLOOR for everything else."""
    return MESSAGE_FLOOR + 4 * (n_embd or UNKNOWN_EMBD) * max_batch_tokens


PLAN_MAGIC = 0x57504B53  # b"SKPW"
ACT_MAGIC = 0x57414B53  # b"SKAW"
OUT_MAGIC = 0x574F4B53  # b"SKOW"
VERSION = 1
HEADER_BYTES = 64
ACT_HEADER_BYTES = 32
OUT_HEADER_BYTES = 24

ROW_SAMPLE_LAST = 0x01
ROW_PHASE_SHIFT = 1
ROW_PHASE_MASK = 0x06
ROW_NEW = 0x08
ROW_KNOWN = 0x0F

_PLAN_HEADER = struct.Struct("<IHHQQQIIIIIIQ")  # 64 bytes
_ACT_HEADER = struct.Struct("<IHHQIIQ")  # 32 bytes
_OUT_HEADER = struct.Struct("<IHHQII")  # 24 bytes
assert _PLAN_HEADER.size == HEADER_BYTES and _ACT_HEADER.size == ACT_HEADER_BYTES
assert _OUT_HEADER.size == OUT_HEADER_BYTES

if sys.byteorder != "little":  # pragma: no cover - the views below are native-endian
    raise ImportError("the stage wire format is read in place on little-endian hosts only")


class WireError(ValueError):
    """A frame that is not a valid frame of this format (the message says why)."""


def _pad8(n: int) -> int:
    return (n + 7) & ~7


def _sections(n_rows: int, n_tokens: int, n_deferred: int, n_release: int
              ) -> list[tuple[str, Any, int]]:
    """(name, dtype, count) of every array section, in frame order."""
    return [("row_offsets", np.uint32, n_rows + 1), ("row_lanes", np.int32, n_rows),
            ("row_restore", np.int32, n_rows), ("row_flags", np.uint8, n_rows),
            ("tokens", np.int32, n_tokens), ("positions", np.int32, n_tokens),
            ("deferred_rows", np.uint32, n_deferred),
            ("deferred_steps", np.uint64, n_deferred),
            ("deferred_index", np.uint32, n_deferred), ("release_lanes", np.int32, n_release)]


def plan_bytes(n_rows: int, n_tokens: int, n_deferred: int = 0, n_release: int = 0) -> int:
    """Bytes of a plan frame with these counts."""
    return HEADER_BYTES + sum(_pad8(np.dtype(dt).itemsize * n)
                              for _, dt, n in _sections(n_rows, n_tokens, n_deferred, n_release))


@dataclass
class PlanView:
    """A decoded plan frame: every array is a view of the frame's own memory."""

    step: int
    serial: int
    row_offsets: npt.NDArray[np.uint32]
    row_lanes: npt.NDArray[np.int32]
    row_restore: npt.NDArray[np.int32]
    row_flags: npt.NDArray[np.uint8]
    tokens: npt.NDArray[np.int32]
    positions: npt.NDArray[np.int32]
    deferred_rows: npt.NDArray[np.uint32]
    deferred_steps: npt.NDArray[np.uint64]
    deferred_index: npt.NDArray[np.uint32]
    release_lanes: npt.NDArray[np.int32]

    @property
    def n_rows(self) -> int:
        return len(self.row_lanes)

    @property
    def sample_rows(self) -> npt.NDArray[np.intp]:
        return np.flatnonzero(self.row_flags & ROW_SAMPLE_LAST)

    @property
    def phases(self) -> npt.NDArray[np.uint8]:
        return ((self.row_flags & ROW_PHASE_MASK) >> ROW_PHASE_SHIFT).astype(np.uint8)

    @property
    def new_rows(self) -> npt.NDArray[np.intp]:
        return np.flatnonzero(self.row_flags & ROW_NEW)


def encode_plan(*, step: int, serial: int, row_offsets: Any, row_lanes: Any, tokens: Any,
                positions: Any, sample_last: Any, phases: Any, new_rows: Any = (),
                row_restore: Any = None, deferred: Optional[tuple[Any, Any, Any]] = None,
                release_lanes: Any = ()) -> bytearray:
    """One plan frame (a fresh buffer). `new_rows` lists the rows that bring their sequence in;
    `deferred` is (rows, source steps, source work indexes); `release_lanes` are freed before
    the rows run. The result is checked with `decode_plan` before it is returned."""
    offsets = np.asarray(row_offsets, dtype=np.uint32)
    n_rows = len(offsets) - 1
    toks = np.asarray(tokens, dtype=np.int32)
    flags = (np.asarray(sample_last, dtype=np.uint8) & 1) | (
        (np.asarray(phases, dtype=np.uint8) & 3) << ROW_PHASE_SHIFT)
    flags = flags.astype(np.uint8)
    new = np.asarray(new_rows, dtype=np.intp)
    if len(new):
        flags[new] |= ROW_NEW
    restore = (np.full(n_rows, -1, dtype=np.int32) if row_restore is None
               else np.asarray(row_restore, dtype=np.int32))
    d_rows, d_steps, d_index = deferred if deferred is not None else ((), (), ())
    release = np.asarray(release_lanes, dtype=np.int32)
    arrays = {"row_offsets": offsets, "row_lanes": np.asarray(row_lanes, dtype=np.int32),
              "row_restore": restore, "row_flags": flags, "tokens": toks,
              "positions": np.asarray(positions, dtype=np.int32),
              "deferred_rows": np.asarray(d_rows, dtype=np.uint32),
              "deferred_steps": np.asarray(d_steps, dtype=np.uint64),
              "deferred_index": np.asarray(d_index, dtype=np.uint32),
              "release_lanes": release}
    n_def = len(arrays["deferred_rows"])
    layout = _sections(n_rows, len(toks), n_def, len(release))
    total = plan_bytes(n_rows, len(toks), n_def, len(release))
    buf = bytearray(total)
    _PLAN_HEADER.pack_into(buf, 0, PLAN_MAGIC, VERSION, HEADER_BYTES, total, step, serial,
                           n_rows, len(toks), n_def, len(release), 0, 0, 0)
    at = HEADER_BYTES
    for name, dt, n in layout:
        arr = arrays[name]
        if len(arr) != n or arr.ndim != 1:
            raise WireError(f"{name} has {len(arr)} entries, the plan needs {n}")
        nbytes = np.dtype(dt).itemsize * n
        buf[at:at + nbytes] = arr.astype(dt, copy=False).tobytes()
        at += _pad8(nbytes)
    decode_plan(buf)  # the encoder never sends what a decoder refuses
    return buf


def decode_plan(frame: Any) -> PlanView:
    """Check a plan frame (any buffer: bytes, bytearray, memoryview, zmq frame buffer) and
    return views into it; `WireError` (nothing built) if any check fails."""
    mem = memoryview(frame).cast("B")
    n = len(mem)
    if n < HEADER_BYTES:
        raise WireError(f"plan frame truncated: {n} bytes, the header alone is {HEADER_BYTES}")
    (magic, version, header, total, step, serial, n_rows, n_tokens, n_def, n_release,
     r0, r1, r2) = _PLAN_HEADER.unpack_from(mem, 0)
    if magic != PLAN_MAGIC:
        raise WireError(f"not a plan frame (magic {magic:#010x})")
    if version != VERSION or header != HEADER_BYTES:
        raise WireError(f"plan frame version {version} with a {header}-byte header; this "
                        f"decoder reads version {VERSION}")
    if total > n:
        raise WireError(f"plan frame truncated: {n} of {total} bytes")
    if total < n:
        raise WireError(f"plan frame has {n - total} bytes after its stated size {total}")
    if r0 or r1 or r2:
        raise WireError("plan frame's reserved header fields are not zero")
    if n_rows > n_tokens or n_def > n_rows:
        raise WireError(f"plan frame counts are inconsistent: {n_rows} rows, {n_tokens} "
                        f"tokens, {n_def} deferred entries")
    if plan_bytes(n_rows, n_tokens, n_def, n_release) != total:
        raise WireError(f"plan frame counts disagree with its size {total}")
    views: dict[str, Any] = {}
    at = HEADER_BYTES
    for name, dt, count in _sections(n_rows, n_tokens, n_def, n_release):
        views[name] = np.frombuffer(mem, dtype=dt, count=count, offset=at)
        at += _pad8(np.dtype(dt).itemsize * count)
    off, flags = views["row_offsets"], views["row_flags"]
    if off[0] != 0 or off[-1] != n_tokens:
        raise WireError("plan frame's row offsets do not span the token arena")
    if n_rows and (np.diff(off.astype(np.int64)) <= 0).any():
        raise WireError("plan frame has a row without tokens (offsets not increasing)")
    if (views["row_lanes"] < 0).any() or (views["row_restore"] < -1).any():
        raise WireError("plan frame has a negative lane or restore holder")
    if (flags & ~np.uint8(ROW_KNOWN)).any() or ((flags & ROW_PHASE_MASK) == ROW_PHASE_MASK).any():
        raise WireError("plan frame has unknown row flag bits")
    if ((views["row_restore"] >= 0) & ((flags & ROW_NEW) == 0)).any():
        raise WireError("plan frame has a restore on a row that is not new")
    pos = views["positions"]
    if n_tokens and (pos < 0).any():
        raise WireError("plan frame has a negative position")
    if n_tokens > 1:
        step_ok = np.diff(pos.astype(np.int64)) == 1
        step_ok[off[1:-1].astype(np.int64) - 1] = True  # row boundaries may jump
        if not step_ok.all():
            raise WireError("plan frame's positions within a row are not consecutive")
    d = views["deferred_rows"]
    if n_def and ((d >= n_rows).any() or (off[np.minimum(d, n_rows - 1) + 1]
                                          - off[np.minimum(d, n_rows - 1)] != 1).any()):
        raise WireError("plan frame's deferred entry names a row that is not a one-token row")
    if (views["release_lanes"] < 0).any():
        raise WireError("plan frame has a negative lane to release")
    return PlanView(step=step, serial=serial, **views)


# ---------------------------------------------------------------------- activations
def encode_activations(step: int, rows: npt.NDArray[np.float32]) -> list[Any]:
    """The activation message: a header frame and the rows' bytes (sent without a copy)."""
    if rows.dtype != np.float32 or rows.ndim != 2:
        raise WireError("activations are a 2-D float32 array")
    rows = np.ascontiguousarray(rows)
    head = _ACT_HEADER.pack(ACT_MAGIC, VERSION, ACT_HEADER_BYTES, rows.nbytes, rows.shape[0],
                            rows.shape[1], step)
    return [head, rows]


def decode_activations(head: Any, data: Any, step: int, n_rows: int,
                       n_embd: int) -> npt.NDArray[np.float32]:
    """The (n_rows, n_embd) float32 view of an activation message for plan `step`."""
    mem = memoryview(head).cast("B")
    if len(mem) != ACT_HEADER_BYTES:
        raise WireError(f"activation header has {len(mem)} bytes, expected {ACT_HEADER_BYTES}")
    magic, version, header, nbytes, rows, cols, at_step = _ACT_HEADER.unpack_from(mem, 0)
    if magic != ACT_MAGIC or version != VERSION or header != ACT_HEADER_BYTES:
        raise WireError("not an activation frame of this version")
    body = memoryview(data).cast("B")
    if (rows, cols) != (n_rows, n_embd) or at_step != step or nbytes != rows * cols * 4:
        raise WireError(f"activations for step {at_step} are {rows} x {cols}; plan step {step} "
                        f"needs {n_rows} x {n_embd}")
    if len(body) < nbytes:
        raise WireError(f"activation data truncated: {len(body)} of {nbytes} bytes")
    if len(body) > nbytes:
        raise WireError(f"activation data has {len(body) - nbytes} bytes after the {nbytes} "
                        "its header states")
    return np.frombuffer(body, dtype=np.float32).reshape(rows, cols)


# ---------------------------------------------------------------------- sampled outputs
def encode_outputs(step: int, rows: _Seq[int] | npt.NDArray[Any],
                   tokens: _Seq[int] | npt.NDArray[Any]) -> bytes:
    """The last stage's answer: (work index, token) pairs of plan `step`."""
    r = np.asarray(rows, dtype=np.uint32)
    t = np.asarray(tokens, dtype=np.int32)
    if r.shape != t.shape or r.ndim != 1:
        raise WireError("one token per sampled row")
    return _OUT_HEADER.pack(OUT_MAGIC, VERSION, OUT_HEADER_BYTES, step, len(r), 0) + \
        r.tobytes() + t.tobytes()


def decode_outputs(frame: Any) -> tuple[int, npt.NDArray[np.uint32], npt.NDArray[np.int32]]:
    """(step, work indexes, tokens) of an output frame."""
    mem = memoryview(frame).cast("B")
    if len(mem) < OUT_HEADER_BYTES:
        raise WireError("output frame truncated")
    magic, version, header, step, k, reserved = _OUT_HEADER.unpack_from(mem, 0)
    if magic != OUT_MAGIC or version != VERSION or header != OUT_HEADER_BYTES or reserved:
        raise WireError("not an output frame of this version")
    if len(mem) != OUT_HEADER_BYTES + 8 * k:
        raise WireError(f"output frame of {len(mem)} bytes does not hold {k} outputs")
    rows = np.frombuffer(mem, dtype=np.uint32, count=k, offset=OUT_HEADER_BYTES)
    tokens = np.frombuffer(mem, dtype=np.int32, count=k, offset=OUT_HEADER_BYTES + 4 * k)
    return step, rows, tokens
