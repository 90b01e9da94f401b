"""Production request traces: importers that stream a trace file as engine requests.

Three formats are read (docs/lab.md has the details):

* **Mooncake JSONL** (FAST'25 traces): one JSON object per line with `timestamp` (ms since the
  trace started), `input_length`, `output_length` and `hash_ids`, one id per 512-token block of
  the prompt (the last block partial). An id is a prefix hash: equal ids mean equal prompts from
  the start through that block. An optional `tenant` key names the request's tenant.
* **Azure LLM inference CSV** (2023): `TIMESTAMP` (`YYYY-MM-DD HH:MM:SS.fffffff`, seven
  fractional digits), `ContextTokens`, `GeneratedTokens`; CRLF line ends, no final newline.
* **BurstGPT CSV**: `Timestamp` (seconds), `Request tokens`, `Response tokens`, and optionally
  `Session ID` (the tenant) and `Log Type`. Rows with zero response tokens are failed requests:
  they are skipped and counted (`TraceStats.skipped_failures`).

`open_trace(path)` returns a `Trace`; iterating it reads the file from the start and yields
`TraceRequest`s in arrival order, one line at a time, so a trace of any length is never held in
memory. A request carries only its lengths and block ids; its prompt tokens are synthesised
when it is submitted (`to_sequence`) and live only as long as the request does.

Prompt tokens are a function of block ids: token `j` of block `b` is `(512·b + j) mod (2³¹−1)`.
Equal ids give equal tokens and different ids (below 4 194 304) different tokens, so the radix
prefix structure of a Mooncake trace is exactly that of its `hash_ids`. Azure and BurstGPT
traces carry no prefix identity: each request gets fresh block ids, so no two share a token
prefix.

A request's input and output lengths are at most `MAX_TOKENS` (2^24) each; a larger one, and any
other malformed line, raises `TraceFormatError` naming the file, the line and the field.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import re
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, TextIO

import numpy as np

from .._validate import as_float, json_loads
from ..types import Sequence

BLOCK_TOKENS = 512
TOKEN_MODULUS = (1 << 31) - 1
FORMATS = ("mooncake", "azure", "burstgpt")
# A parsed row: (line number, arrival µs, input tokens, output tokens, block ids or None, tenant)
Row = tuple[int, float, int, int, Any, Optional[str]]

_OFFSETS = np.arange(BLOCK_TOKENS, dtype=np.int64)
# The latest arrival a replay takes: whole µs stay exact in a float64 (to 2^53), with margin.
MAX_ARRIVAL_US = 2.0 ** 53 / 100
# The largest block id whose tokens stay distinct from every other block's (below the modulus).
MAX_BLOCK_ID = (TOKEN_MODULUS - BLOCK_TOKENS) // BLOCK_TOKENS
# The most input tokens, and the most output tokens, a request of a trace may have (2^24 =
# 16 777 216): more than any served context holds, and far inside the scheduler's 32-bit token
# counts and the KV capacity --kv-capacity-tokens can give (2^32 - 1). A length of 2^32 or more
# does not fit those counts, and a 2^32-token input would be a 32 GiB prompt.
MAX_TOKENS = 1 << 24
_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_BURST_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")
_BURST_SESSION = ("Session ID", "SessionID")
_AZURE_TIME = re.compile(r"(\d{4})-(\d{2})-(\d{2}) (\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?")


class TraceError(ValueError):
    """A trace file that cannot be read as a trace at all (missing, unknown format)."""


class TraceFormatError(TraceError):
    """A malformed line: `path:line: field: problem`."""

    def __init__(self, path: str, line: int, field_name: str, problem: str) -> None:
        super().__init__(f"{path}:{line}: {field_name}: {problem}")
        self.path = path
        self.line = line
        self.field = field_name
        self.problem = problem


def synthesize_prompt(blocks: Any, length: int) -> np.ndarray:
    """The `length` prompt tokens (int32) of a request whose 512-token blocks have these ids."""
    ids = np.asarray(blocks, dtype=np.int64)
    if len(ids) * BLOCK_TOKENS < length:
        raise ValueError(f"{len(ids)} blocks cannot hold {length} tokens")
    tokens = (ids[:, None] * BLOCK_TOKENS + _OFFSETS[None, :]).ravel()[:length]
    return (tokens % TOKEN_MODULUS).astype(np.int32)


def request_id(row: int) -> str:
    """The id of the request on data row `row` of a trace (from 0, skipped rows counted: a
    BurstGPT trace's ids skip its failed requests)."""
    return f"r{row}"


def blocks_for(length: int) -> int:
    """Number of 512-token blocks a prompt of `length` tokens spans."""
    return -(-length // BLOCK_TOKENS)


class TraceRequest:
    """One request of a trace: lengths, block ids, tenant; the prompt is built on demand.

    `arrival_us` is on the replay's clock (the trace time times the time scale, from 0 at the
    first row). `blocks` holds one id per 512-token block of the prompt. The prompt array is
    built by `prompt_array()` (cached until `drop_prompt()`), which `to_sequence()` uses.
    """

    __slots__ = ("id", "arrival_us", "input_length", "output_length", "blocks", "tenant", "line",
                 "row", "_prompt")

    def __init__(self, id: str, arrival_us: float, input_length: int, output_length: int,
                 blocks: Any, tenant: Optional[str] = None, line: int = 0,
                 row: Optional[int] = None) -> None:
        self.id = id
        self.arrival_us = arrival_us
        self.input_length = input_length
        self.output_length = output_length
        self.blocks = blocks
        self.tenant = tenant
        self.line = line
        self.row = row  # its data row, from 0 (a BurstGPT trace's skipped failures counted)
        self._prompt: Optional[np.ndarray] = None

    def prompt_array(self) -> np.ndarray:
        """The prompt tokens, int32, read-only (so caches may keep views of it)."""
        if self._prompt is None:
            prompt = synthesize_prompt(self.blocks, self.input_length)
            prompt.setflags(write=False)
            self._prompt = prompt
        return self._prompt

    def drop_prompt(self) -> None:
        self._prompt = None

    def to_sequence(self) -> Sequence:
        return Sequence(self.id, self.prompt_array().tolist(), self.output_length)

    def __repr__(self) -> str:
        return (f"TraceRequest(id={self.id!r}, arrival_us={self.arrival_us!r}, "
                f"input_length={self.input_length}, output_length={self.output_length}, "
                f"blocks={len(self.blocks)}, tenant={self.tenant!r})")


@dataclass
class TraceStats:
    """What one pass over a trace saw (complete once the iteration has ended)."""

    rows: int = 0  # data rows read (skipped ones included)
    requests: int = 0  # requests yielded
    skipped_failures: int = 0  # BurstGPT rows with zero response tokens
    first_arrival_us: Optional[float] = None
    last_arrival_us: Optional[float] = None
    input_tokens: int = 0
    output_tokens: int = 0
    tenants: set[str] = field(default_factory=set)
    nameless: int = 0  # requests without a tenant (the tenant "(none)" when others have one)
    complete: bool = False  # the pass ended (the file's end, or the limit)

    @property
    def span_s(self) -> float:
        if self.first_arrival_us is None or self.last_arrival_us is None:
            return 0.0
        return (self.last_arrival_us - self.first_arrival_us) / 1e6

    def as_dict(self) -> dict[str, Any]:
        n = self.requests
        return {"rows": self.rows, "requests": n, "skipped_failures": self.skipped_failures,
                "span_s": self.span_s, "input_tokens": self.input_tokens,
                "output_tokens": self.output_tokens,
                "mean_input_tokens": self.input_tokens / n if n else 0.0,
                "mean_output_tokens": self.output_tokens / n if n else 0.0,
                # no tenant field: one tenant; some rows without one: they are one more
                "tenants": max(len(self.tenants) + (1 if self.tenants and self.nameless else 0),
                               1)}


def _open_text(path: str) -> TextIO:
    # newline="" keeps "\r\n" visible so CRLF files are parsed the same as LF ones.
    return open(path, "r", encoding="utf-8-sig", newline="")


def _first_line(fh: TextIO) -> tuple[int, str]:
    """(line number, text) of the file's first line that is not blank; (0, "") if none."""
    for lineno, text in enumerate(fh, 1):
        if text.strip():
            return lineno, text
    return 0, ""


def detect_format(path: str) -> str:
    """`mooncake`, `azure` or `burstgpt`, from the first line of the file that is not blank."""
    try:
        with _open_text(path) as fh:
            lineno, first = _first_line(fh)
    except FileNotFoundError:
        raise TraceError(f"{path}: trace file not found") from None
    except IsADirectoryError:
        raise TraceError(f"{path}: is a directory, not a trace file") from None
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not a text file (not UTF-8)") from None
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror}") from None
    line = first.strip()
    if not line:
        raise TraceError(f"{path}: empty trace file")
    if line.startswith("{"):
        return "mooncake"
    header = [cell.strip() for cell in line.split(",")]
    if all(c in header for c in _AZURE_COLUMNS):
        return "azure"
    if all(c in header for c in _BURST_COLUMNS):
        return "burstgpt"
    raise TraceError(
        f"{path}:{lineno}: unknown trace format (expected a Mooncake JSON line, an Azure "
        f"header {','.join(_AZURE_COLUMNS)} or a BurstGPT header with "
        f"{', '.join(_BURST_COLUMNS)})")


def _in_range(path: str, line: int, name: str, value: int, minimum: int) -> int:
    """`value`, a token count, if it is in [minimum, MAX_TOKENS]."""
    if value < minimum:
        raise TraceFormatError(path, line, name, f"must be >= {minimum}, got {value}")
    if value > MAX_TOKENS:
        raise TraceFormatError(path, line, name, f"must be <= {MAX_TOKENS} (2^24 tokens, more "
                                                 f"than any served context holds), got {value}")
    return value


def _int_field(path: str, line: int, name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceFormatError(path, line, name, f"expected an integer, got {value!r}")
    return _in_range(path, line, name, value, minimum)


def _int_cell(path: str, line: int, name: str, text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise TraceFormatError(path, line, name, f"expected an integer, got {text!r}") from None
    return _in_range(path, line, name, value, minimum)


def _mooncake_rows(path: str) -> Iterator[Row]:
    """(line, time_us, input, output, blocks, tenant) per row; the other readers likewise."""
    with _open_text(path) as fh:
        for lineno, text in enumerate(fh, 1):
            if not text.strip():
                continue
            try:
                row = json_loads(text)
            except json.JSONDecodeError as exc:
                raise TraceFormatError(path, lineno, "json", f"not a JSON object ({exc.msg} at "
                                                             f"column {exc.colno})") from None
            except RecursionError:  # [[[[...: deeper than the parser goes
                raise TraceFormatError(path, lineno, "json",
                                       "not a JSON object (nested too deeply)") from None
            except ValueError as exc:  # e.g. an integer of more digits than Python reads
                raise TraceFormatError(path, lineno, "json", "not a JSON object the reader "
                                       f"takes ({str(exc).split(';')[0]})") from None
            if not isinstance(row, dict):
                raise TraceFormatError(path, lineno, "json", "not a JSON object")
            for key in ("timestamp", "input_length", "output_length", "hash_ids"):
                if key not in row:
                    raise TraceFormatError(path, lineno, key, "missing")
            ts = row["timestamp"]
            if isinstance(ts, bool) or not isinstance(ts, (int, float)) \
                    or not math.isfinite(as_float(ts)):
                raise TraceFormatError(path, lineno, "timestamp",
                                       f"expected a number of milliseconds, got {ts!r}")
            if ts < 0:
                raise TraceFormatError(path, lineno, "timestamp", f"must be >= 0, got {ts}")
            n_in = _int_field(path, lineno, "input_length", row["input_length"], 1)
            n_out = _int_field(path, lineno, "output_length", row["output_length"], 1)
            ids = row["hash_ids"]
            if not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int)
                                                or i < 0 for i in ids):
                raise TraceFormatError(path, lineno, "hash_ids",
                                       "expected a list of non-negative integers")
            if ids and max(ids) > MAX_BLOCK_ID:
                raise TraceFormatError(
                    path, lineno, "hash_ids",
                    f"block id {max(ids)} is above {MAX_BLOCK_ID}, the largest whose tokens "
                    "stay distinct; number the blocks 0, 1, 2, ... in order of first "
                    "appearance (raw hashes are too large)")
            if len(ids) != blocks_for(n_in):
                raise TraceFormatError(
                    path, lineno, "hash_ids",
                    f"{len(ids)} block ids for input_length {n_in}; 512-token blocks need "
                    f"ceil({n_in} / 512) = {blocks_for(n_in)}")
            tenant = row.get("tenant")
            if tenant is not None:
                if isinstance(tenant, bool) or not isinstance(tenant, (str, int)):
                    raise TraceFormatError(path, lineno, "tenant",
                                           f"expected a string or an integer, got {tenant!r}")
                tenant = str(tenant)
            yield lineno, ts * 1000.0, n_in, n_out, ids, tenant


def _header(path: str, fh: TextIO, required: tuple[str, ...]) -> tuple[dict[str, int], int]:
    """The CSV header, the first line that is not blank: (column index by name, its line)."""
    lineno, first = _first_line(fh)
    header = [cell.strip() for cell in first.rstrip("\r\n").split(",")]
    missing = [c for c in required if c not in header]
    if missing:
        raise TraceFormatError(path, max(lineno, 1), "header",
                               f"missing column(s) {', '.join(missing)} "
                               f"(header is {first.strip()!r})")
    return {name: k for k, name in enumerate(header)}, lineno


def _cells(path: str, lineno: int, text: str, width: int) -> list[str]:
    cells = text.rstrip("\r\n").split(",")
    if len(cells) != width:
        raise TraceFormatError(path, lineno, "row",
                               f"expected {width} comma-separated fields, got {len(cells)}")
    return cells


def _azure_time_ns(path: str, lineno: int, text: str) -> int:
    m = _AZURE_TIME.fullmatch(text.strip())
    if m is None:
        raise TraceFormatError(path, lineno, "TIMESTAMP",
                               f"expected YYYY-MM-DD HH:MM:SS.fffffff, got {text!r}")
    y, mo, d, h, mi, s = (int(g) for g in m.groups()[:6])
    try:
        day = _dt.date(y, mo, d).toordinal()
    except ValueError as exc:
        raise TraceFormatError(path, lineno, "TIMESTAMP", f"{text!r}: {exc}") from None
    if h > 23 or mi > 59 or s > 59:
        raise TraceFormatError(path, lineno, "TIMESTAMP", f"{text!r}: time out of range")
    # Integer nanoseconds: 7 fractional digits would be truncated by datetime's microseconds.
    frac = (m.group(7) or "").ljust(9, "0")
    return ((day * 86400 + h * 3600 + mi * 60 + s) * 1_000_000_000) + int(frac)


def _azure_rows(path: str) -> Iterator[Row]:
    with _open_text(path) as fh:
        col, header_line = _header(path, fh, _AZURE_COLUMNS)
        width = len(col)
        t0 = None
        for lineno, text in enumerate(fh, header_line + 1):
            if not text.strip():
                continue
            cells = _cells(path, lineno, text, width)
            ns = _azure_time_ns(path, lineno, cells[col["TIMESTAMP"]])
            if t0 is None:
                t0 = ns
            n_in = _int_cell(path, lineno, "ContextTokens", cells[col["ContextTokens"]], 1)
            n_out = _int_cell(path, lineno, "GeneratedTokens", cells[col["GeneratedTokens"]], 1)
            yield lineno, (ns - t0) / 1000.0, n_in, n_out, None, None


def _burstgpt_rows(path: str, stats: TraceStats) -> Iterator[Row]:
    with _open_text(path) as fh:
        col, header_line = _header(path, fh, _BURST_COLUMNS)
        width = len(col)
        session = next((col[name] for name in _BURST_SESSION if name in col), None)
        t0 = None
        for lineno, text in enumerate(fh, header_line + 1):
            if not text.strip():
                continue
            cells = _cells(path, lineno, text, width)
            raw = cells[col["Timestamp"]]
            try:
                ts = float(raw)
            except ValueError:
                raise TraceFormatError(path, lineno, "Timestamp",
                                       f"expected a number of seconds, got {raw!r}") from None
            if not math.isfinite(ts) or ts < 0:
                raise TraceFormatError(path, lineno, "Timestamp",
                                       f"must be a finite number >= 0, got {raw!r}")
            n_in = _int_cell(path, lineno, "Request tokens", cells[col["Request tokens"]], 0)
            n_out = _int_cell(path, lineno, "Response tokens", cells[col["Response tokens"]], 0)
            if n_out == 0:
                stats.rows += 1
                stats.skipped_failures += 1  # a failed request: nothing was generated
                continue
            if n_in == 0:
                raise TraceFormatError(path, lineno, "Request tokens",
                                       "must be >= 1 for a request that generated tokens")
            if t0 is None:
                t0 = ts
            tenant = cells[session].strip() if session is not None else None
            yield lineno, (ts - t0) * 1e6, n_in, n_out, None, tenant or None


def tenant_of_id(request_id: str, tenants: int) -> str:
    """The tenant `--tenants K` gives a request: a stable hash (CRC-32) of its id, mod K."""
    return f"t{zlib.crc32(request_id.encode('utf-8')) % tenants}"


class Trace:
    """A trace file, read lazily: each iteration streams the file again from the start.

    `time_scale` multiplies every arrival time (0.5 replays the trace twice as fast);
    `limit` stops after that many requests; `tenants=K` assigns tenant `t<crc32(id) mod K>` to
    every request (replacing any tenant the file names). `stats` describes the last pass.
    """

    def __init__(self, path: str, format: str = "auto", *, time_scale: float = 1.0,
                 limit: Optional[int] = None, tenants: Optional[int] = None) -> None:
        path = os.fspath(path)
        if format == "auto":
            format = detect_format(path)
        elif format not in FORMATS:
            raise TraceError(f"unknown trace format {format!r} (choose from auto, "
                             f"{', '.join(FORMATS)})")
        elif not os.path.isfile(path):
            detect_format(path)  # raises the precise reason
        if not (isinstance(time_scale, (int, float)) and math.isfinite(time_scale)
                and time_scale > 0):
            raise ValueError(f"time_scale must be a finite number > 0, got {time_scale!r}")
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        if tenants is not None and tenants < 1:
            raise ValueError(f"tenants must be >= 1, got {tenants}")
        self.path = path
        self.format = format
        self.time_scale = float(time_scale)
        self.limit = limit
        self.tenants = tenants
        self.stats = TraceStats()

    def _rows(self, stats: TraceStats) -> Iterator[Row]:
        if self.format == "mooncake":
            return _mooncake_rows(self.path)
        if self.format == "azure":
            return _azure_rows(self.path)
        return _burstgpt_rows(self.path, stats)

    def __iter__(self) -> Iterator[TraceRequest]:
        stats = self.stats = TraceStats()
        time_field = {"mooncake": "timestamp", "azure": "TIMESTAMP"}.get(self.format,
                                                                        "Timestamp")
        scale = self.time_scale
        limit = self.limit
        fresh_blocks = self.format != "mooncake"
        next_block = 0
        first_time: Optional[float] = None
        last_time = -math.inf
        last_line = 0
        for lineno, time_us, n_in, n_out, blocks, tenant in self._rows(stats):
            if time_us < last_time:
                raise TraceFormatError(self.path, lineno, time_field,
                                       f"earlier than the row on line {last_line}: a trace "
                                       "must be in arrival order")
            last_time, last_line = time_us, lineno
            stats.rows += 1
            if fresh_blocks:
                nb = blocks_for(n_in)
                blocks = range(next_block, next_block + nb)
                next_block += nb
            row = stats.rows - 1
            rid = request_id(row)
            if self.tenants is not None:
                tenant = tenant_of_id(rid, self.tenants)
            if first_time is None:
                first_time = time_us
            # Times count from the first row (Mooncake's first row is 0 anyway).
            arrival = (time_us - first_time) * scale
            if arrival > MAX_ARRIVAL_US:
                raise TraceFormatError(self.path, lineno, time_field,
                                       f"{arrival / 1e6:.3g} s after the first row at time "
                                       f"scale {scale:g}, beyond the lab's "
                                       f"{MAX_ARRIVAL_US / 1e6:.3g} s (its clock counts µs)")
            if stats.first_arrival_us is None:
                stats.first_arrival_us = arrival
            stats.last_arrival_us = arrival
            stats.requests += 1
            stats.input_tokens += n_in
            stats.output_tokens += n_out
            if tenant is not None:
                stats.tenants.add(tenant)
            else:
                stats.nameless += 1
            yield TraceRequest(rid, arrival, n_in, n_out, blocks, tenant, lineno, row)
            if limit is not None and stats.requests >= limit:
                break
        stats.complete = True

    def count_rows(self) -> int:
        """Data rows in the file (a fast line count; for a progress bar's total)."""
        with open(self.path, "rb") as fh:
            data_lines = 0
            last = b"\n"
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                data_lines += chunk.count(b"\n")
                last = chunk[-1:]
        if last != b"\n":
            data_lines += 1  # no newline after the last row (the Azure files)
        rows = data_lines - (0 if self.format == "mooncake" else 1)
        return min(rows, self.limit) if self.limit is not None else rows


def open_trace(path: str, format: str = "auto", **options: Any) -> Trace:
    """A `Trace` over `path` (`format` auto-detected unless given); see `Trace`."""
    return Trace(path, format, **options)
