"""The lab's runtime host: one model-free runtime for the workload suite and the trace replay.

`LabHost` adds to `CostModelHost`'s echo sampling (each sampling row predicts its last input
token) what a serving runtime would hold per request:

* **KV cells** (with `kv_capacity_tokens`): one memory component "kv-cells" at one byte per
  cell. After each plan a running request holds the cells up to the position after its last
  fed token; the engine reads the sum through `memory_used` and preempts when it does not fit.
  A preempted or ended request frees its cells.
* **A prefix model** (`PrefixModel`, lab/prefix.py): the suite's family radix cache
  (`FamilyPrefixCache`) or the replay's bounded block store (`BlockPrefixCache`). The host tells
  it about submits, admissions (with the tokens each restored), the prefill rows of each plan
  and releases.
* **Tenant service** (`TenantService`, lab/tenants.py): tokens computed per tenant, when the
  run has more than one.

and records each admission (time, restored tokens, prompt length) for the figures.
Requests reach the host through `stream()`, which registers each one as the engine pulls it.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional, Protocol

import numpy as np

from ..cost_model import DECODE_PHASE
from ..engine import CostModelHost, Plan
from ..types import IterationPhase, ReleaseReason, Sequence
from .tenants import TenantService

_PHASE_PREFILL = IterationPhase.PREFILL.value


class LabRequest(Protocol):
    """What the host reads off a request of a lab run (`SuiteRequest`, `TraceRequest`)."""

    @property
    def id(self) -> str: ...

    @property
    def arrival_us(self) -> float: ...

    @property
    def input_length(self) -> int: ...

    @property
    def output_length(self) -> int: ...

    @property
    def tenant(self) -> Optional[str]: ...

    def to_sequence(self) -> Sequence: ...

    def prompt_array(self) -> np.ndarray: ...

    def drop_prompt(self) -> None: ...


class Live:
    """Host-side state of one request from submit until it ends."""

    __slots__ = ("id", "request", "prompt", "n", "out", "tenant", "record", "restore",
                 "progress", "done", "admitted", "broken", "fed")

    def __init__(self, request: LabRequest, tenant: int, record: int) -> None:
        self.id = request.id
        self.request: Optional[LabRequest] = request  # until the prefix model has read it
        self.prompt: Any = None  # the prompt array, if the prefix model keeps one
        self.n = request.input_length
        self.out = request.output_length
        self.tenant = tenant
        self.record = record  # submission index (= the recorder's index)
        self.restore = 0  # tokens restored at its (latest) admission
        self.progress: Any = None  # prefix model state while it runs (the block it pins)
        self.done = 0  # leading prompt blocks resident through `progress`
        self.admitted = False  # had its first admission (a later new row is a resume)
        self.broken = False  # a block of its prompt could not be cached
        self.fed = 0  # KV cells it holds (memory model)


class PrefixModel(Protocol):
    """A prefix cache model the lab host drives (lab/prefix.py)."""

    def prepare(self, live: Live, seq: Sequence) -> Sequence:
        """At submit: `seq`, with whatever restore or affinity the model gives it."""

    def start(self, live: Live) -> None:
        """At an admission (first row, `live.restore` set): take hold of the restore."""

    def prefill(self, rows: list[tuple[Live, int]], plan: Any, phases: bytes) -> None:
        """After a plan with prefill rows: (request, row index) of each of them."""

    def release(self, live: Live) -> None:
        """The request's KV is gone (it ended or was preempted)."""

    def preempted(self, live: Live) -> None:
        """The request is preempted, just before `release`: its cells (`live.fed`, with the
        memory model) are still there to keep."""


class LabHost(CostModelHost):
    """The lab's runtime model (module docstring)."""

    def __init__(self, scheduler: Any, *, prefix: Optional[PrefixModel] = None,
                 memory: bool = False, reserve: Optional[int] = None,
                 tenants: Optional[TenantService] = None) -> None:
        super().__init__(token=None)
        self.scheduler = scheduler
        self.prefix = prefix
        self.memory = memory
        self.reserve = reserve  # cells an admission reserves for output (None: no reservation)
        self.tenants = tenants if tenants is not None else TenantService()
        # (TTFT s, gap s): the SLO each request is told (its first-token deadline from its
        # arrival, its inter-token target), None: none (ReplayOptions.slo_told).
        self.slo: Optional[tuple[float, float]] = None
        self.clock: Any = None  # the engine's clock (for time stamps)
        self.live: dict[str, Live] = {}
        self._arrived: dict[str, LabRequest] = {}
        self._records = 0
        # Per-request figures in submission order.
        self.output_len: list[int] = []
        self.tenant_of: list[int] = []  # each request's tenant index, by submission
        self.restored: list[int] = []  # tokens restored at first admission
        self.admit_time: list[float] = []
        self.admit_restore: list[int] = []
        self.admit_prompt: list[int] = []
        self.hit_tokens = 0
        self.prompt_tokens = 0
        self.usage = 0

    # -- the request stream -------------------------------------------------------------------

    def stream(self, requests: Iterable[LabRequest]) -> Iterator[LabRequest]:
        """`requests`, registered with the host as the engine pulls them."""
        tenants = self.tenants
        for request in requests:
            self._arrived[request.id] = request
            tenants.arrived(request.arrival_us)
            yield request
        tenants.stream_done = True

    def prepare_sequence(self, seq: Sequence) -> Sequence:
        request = self._arrived.pop(seq.id)
        tenants = self.tenants
        live = Live(request, tenants.index(request.tenant), self._records)
        self._records += 1
        self.live[live.id] = live
        self.output_len.append(live.out)
        self.tenant_of.append(live.tenant)
        self.restored.append(0)
        if tenants.fair_share is not None:
            seq.with_tenant(tenants.names[live.tenant])
        if self.reserve is not None:
            seq.with_admission_tokens(live.n + min(live.out, self.reserve))
        if self.slo is not None:
            ttft_s, itl_s = self.slo
            seq.with_deadlines(ttft_deadline=request.arrival_us / 1e6 + ttft_s,
                               itl_target=itl_s)
        if self.prefix is not None:
            seq = self.prefix.prepare(live, seq)
        request.drop_prompt()
        live.request = None
        return seq

    # -- running --------------------------------------------------------------------------------

    def _restore_of(self, live: Live, restored: int, fresh: bool) -> int:
        """The tokens a request restored at an admission: what its new row says, except that a
        request with nothing generated replays its last prompt token when the restore covers
        the whole prompt (§0.4b): a fresh row that restored n - 1 tokens cannot tell a restore
        of n - 1 from one of n, so only then is the scheduler asked (its snapshot copies the
        prompt)."""
        if fresh and restored == live.n - 1:
            snap = self.scheduler.sequence(live.id)
            return snap.prefix_restore.token_count if snap.prefix_restore is not None else 0
        return restored

    def _admissions(self, rows: list[tuple[Live, int]], plan: Any, phases: bytes) -> None:
        """Every new row in `rows` (an admission, or a resume after a preemption) takes hold of
        its restore before any row's new prefix blocks can evict it."""
        # NOTE: a lab sequence's new row is never a decode row (no sequence is submitted with
        # generated tokens), so only the prefill and recompute rows are looked at.
        new = plan.new_rows
        restored = plan.restored_tokens
        now = self.clock.now() if self.clock is not None else 0.0
        prefix = self.prefix
        for live, i in rows:
            if not new[i]:
                continue
            live.restore = self._restore_of(live, int(restored[i]), phases[i] == _PHASE_PREFILL)
            if prefix is not None:
                prefix.start(live)
            if live.admitted:
                continue  # a resume: only first admissions are figures
            live.admitted = True
            self.restored[live.record] = live.restore
            self.hit_tokens += live.restore
            self.prompt_tokens += live.n
            self.admit_time.append(now)
            self.admit_restore.append(live.restore)
            self.admit_prompt.append(live.n)

    def execute(self, plan: Plan) -> None:
        super().execute(plan)
        phases = bytes(plan.phases)
        prefill = phases.count(DECODE_PHASE) < len(phases)
        tenants = self.tenants
        if not (prefill or self.memory or tenants.enabled):
            return  # NOTE: most plans: the row ids (built on first use) are not needed
        live_of = self.live
        ids = plan.sequence_ids
        if prefill:
            rows = [(live_of[ids[i]], i) for i, phase in enumerate(phases)
                    if phase != DECODE_PHASE]
            self._admissions(rows, plan, phases)
            if self.prefix is not None:
                self.prefix.prefill(rows, plan, phases)
        if self.memory:
            held = plan.positions[plan.row_offsets[1:] - 1].astype(np.int64) + 1
            for rid, cells in zip(ids, held.tolist()):
                live = live_of[rid]
                self.usage += cells - live.fed
                live.fed = cells
        if tenants.enabled:
            now = self.clock.now() if self.clock is not None else float("-inf")
            tenants.account(plan, phases, [live_of[rid].tenant for rid in ids], now)

    def release(self, sequence_id: str,
                reason: ReleaseReason = ReleaseReason.FINISHED) -> None:
        live = self.live.get(sequence_id)
        if live is None:
            return
        if reason is ReleaseReason.PREEMPTED and self.prefix is not None:
            self.prefix.preempted(live)
        if self.memory:
            self.usage -= live.fed
            live.fed = 0
        if self.prefix is not None:
            self.prefix.release(live)
        if reason is ReleaseReason.PREEMPTED:
            # Its KV is gone; it recomputes from a new row (its restore is read again, §2.12).
            return
        del self.live[sequence_id]
        live.prompt = None

    def memory_used(self) -> Optional[list[int]]:
        return [self.usage] if self.memory else None
