# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Native scheduler: a thin Python face over the C core (csrc/).

All state lives in the C core; this module validates arguments at the boundary, converts
Python sequences into the core's descriptors once at submit, and exposes each plan's arrays
as numpy views over the core's memory (no copies). Python objects that the core only carries
(ids, affinities, restores, sampling objects) are kept per slot on this side.
"""
from cpython.array cimport array, clone
from cpython.buffer cimport PyBUF_WRITE
from cpython.memoryview cimport PyMemoryView_FromMemory
from libc.stdint cimport int32_t, uint8_t, uint32_t, uint64_t, UINT32_MAX
from libc.stdint cimport SIZE_MAX

from ._boundary cimport check_u64, token_array
from ._skippy_abi cimport (
    SKIPPY_PLAN_ABI_VERSION,
    SKIPPY_STATUS_OK,
    skippy_error,
    skippy_iteration_request,
    skippy_plan,
    skippy_deferred_inputs,
    skippy_plan_outputs,
    skippy_sampling_config,
    skippy_session,
)
from ._skippy_scheduler cimport *

import numbers

import numpy as np

from ._abi import ffi as _ffi
from .cache_policy import CacheAwareCandidate
from .policies import (
    AdmissionKind,
    AdmissionPolicy,
    CacheAwareAdmission,
    FairShareAdmission,
    FcfsAdmission,
    LowestPriorityNewest,
    FewestComputedTokens,
    PreemptionKind,
    PreemptionPolicy,
    PriorityAdmission,
    VictimCandidate,
    VirtualTokenCounters,
)
from .types import (
    DuplicateSequence,
    EmptyPrompt,
    FinishReason,
    IterationPhase,
    IterationPrediction,
    IterationTelemetry,
    IterationWork,
    MalformedOutputs,
    PlanInFlight,
    QueueFull,
    SchedulerConfig,
    SchedulerMetrics,
    SchedulerSnapshot,
    Sequence,
    SequenceStatus,
    StalePlanError,
)

PLAN_ABI_VERSION = SKIPPY_PLAN_ABI_VERSION

# The policies name the core's built-in policies by these values; a build whose header
# disagrees would run a different policy than the one the caller chose.
if ([(k.name, k.value) for k in AdmissionKind] != [
        ("CACHE_AWARE", SKIPPY_ADMISSION_CACHE_AWARE), ("FCFS", SKIPPY_ADMISSION_FCFS),
        ("PRIORITY", SKIPPY_ADMISSION_PRIORITY), ("CALLBACK", SKIPPY_ADMISSION_CALLBACK),
        ("FAIR_SHARE", SKIPPY_ADMISSION_FAIR_SHARE)]
        or [(k.name, k.value) for k in PreemptionKind] != [
        ("LOWEST_PRIORITY_NEWEST", SKIPPY_PREEMPT_LOWEST_PRIORITY_NEWEST),
        ("FEWEST_COMPUTED", SKIPPY_PREEMPT_FEWEST_COMPUTED),
        ("CALLBACK", SKIPPY_PREEMPT_CALLBACK)]):
    raise ImportError("policies.AdmissionKind / PreemptionKind do not match the compiled "
                      "skippy_admission_policy / skippy_preemption_policy")

cdef array _UINT32_ARRAY = array("I")
cdef object _PHASES = (IterationPhase.Prefill, IterationPhase.Recompute, IterationPhase.Decode)
cdef object _STATUSES = tuple(SequenceStatus)
# skippy_end_reason -> FinishReason, by value.
cdef object _END_REASONS = (FinishReason.STOP, FinishReason.LENGTH, FinishReason.FAILED,
                            FinishReason.CANCELLED)
if [SKIPPY_END_STOP, SKIPPY_END_LENGTH, SKIPPY_END_FAILED, SKIPPY_END_CANCELLED] != [0, 1, 2, 3]:
    raise ImportError("FinishReason does not match the compiled skippy_end_reason")
cdef object _SAMPLING_CTYPE = _ffi.typeof("skippy_sampling_config *")
cdef uint64_t _U64_MAX = 0xFFFFFFFFFFFFFFFF

# Plan arrays exposed as numpy views (Scheduler._bases / _slice).
cdef enum:
    _A_TOK = 0
    _A_POS = 1
    _A_OFF = 2
    _A_SAMPLE = 3
    _A_PHASE = 4
    _A_SLOT = 5
    _A_SROWS = 6
    _A_OIDX = 7
    _A_OTOK = 8
    _A_DROW = 9
    _A_DSTEP = 10
    _A_DIDX = 11
    _A_NEW = 12
    _A_REST = 13
    _A_COUNT = 14


cdef class _PlanBuffer:
    """Numpy views over one of the scheduler's plan buffers (there are max_inflight_plans).

    Views over the whole native arrays are rebuilt only when the core reallocates them, and per
    array the last slice handed out is kept: a steady state reuses the same slices.
    """
    cdef skippy_plan *p
    cdef list bases
    cdef list slices
    cdef size_t slice_n[_A_COUNT]
    cdef size_t tok_cap, row_cap, deferred_cap  # capacities the views were made for

    cdef void refresh(self):
        # NOTE: the core reallocates plan arrays only when a capacity grows, and then all the
        # arrays of that group at once (any of them may move), so capacity is the key.
        cdef skippy_plan *p = self.p
        cdef size_t n
        cdef int i
        if p.token_capacity != self.tok_cap:
            self.tok_cap = p.token_capacity
            self.bases[_A_TOK] = _view(p.tokens, p.token_capacity, np.int32)
            self.bases[_A_POS] = _view(p.positions, p.token_capacity, np.int32)
            self.slice_n[_A_TOK] = SIZE_MAX
            self.slice_n[_A_POS] = SIZE_MAX
        if p.request_capacity != self.row_cap:
            self.row_cap = p.request_capacity
            n = p.request_capacity
            self.bases[_A_OFF] = _view(p.row_offsets, n + 1, np.uintp)
            self.bases[_A_SAMPLE] = _view(p.sample_last, n, np.uint8)
            self.bases[_A_PHASE] = _view(p.phases, n, np.uint8)
            self.bases[_A_SLOT] = _view(p.slots, n, np.uint32)
            self.bases[_A_SROWS] = _view(p.sample_rows, n, np.uintp)
            self.bases[_A_OIDX] = _view(p.outputs.sampled_request_indexes, n, np.uintp)
            self.bases[_A_OTOK] = _view(p.outputs.predicted_tokens, n, np.int32)
            self.bases[_A_NEW] = _view(p.new_rows, n, np.uint8)
            self.bases[_A_REST] = _view(p.restored_tokens, n, np.uintp)
            for i in range(_A_OFF, _A_DROW):
                self.slice_n[i] = SIZE_MAX
            self.slice_n[_A_NEW] = self.slice_n[_A_REST] = SIZE_MAX
        if p.deferred.capacity != self.deferred_cap:
            self.deferred_cap = n = p.deferred.capacity
            self.bases[_A_DROW] = _view(p.deferred.rows, n, np.uintp)
            self.bases[_A_DSTEP] = _view(p.deferred.source_steps, n, np.uint64)
            self.bases[_A_DIDX] = _view(p.deferred.source_indexes, n, np.uintp)
            for i in range(_A_DROW, _A_COUNT):
                self.slice_n[i] = SIZE_MAX

    cdef object slice(self, int a, size_t n):
        """The first n entries of plan array `a`: the cached slice when n did not change."""
        if self.slice_n[a] != n:
            self.slices[a] = self.bases[a][:n]
            self.slice_n[a] = n
        return self.slices[a]


cdef _PlanBuffer _plan_buffer(skippy_plan *p):
    cdef _PlanBuffer b = _PlanBuffer.__new__(_PlanBuffer)
    cdef int i
    b.p = p
    b.bases = [None] * _A_COUNT
    b.slices = [None] * _A_COUNT
    for i in range(_A_COUNT):
        b.slice_n[i] = SIZE_MAX
    b.tok_cap = b.row_cap = b.deferred_cap = 0
    b.bases[_A_DROW] = np.zeros(0, dtype=np.uintp)
    b.bases[_A_DSTEP] = np.zeros(0, dtype=np.uint64)
    b.bases[_A_DIDX] = np.zeros(0, dtype=np.uintp)
    return b


cdef inline size_t _size(object v):
    return SIZE_MAX if v is None else <size_t>v


cdef object _view(void *data, size_t count, object dtype):
    """A writable numpy array over `count` elements of native memory (no copy)."""
    if count == 0 or data == NULL:
        return np.zeros(0, dtype=dtype)
    memory = PyMemoryView_FromMemory(<char *>data, count * np.dtype(dtype).itemsize, PyBUF_WRITE)
    return np.frombuffer(memory, dtype=dtype)


cdef object _telemetry(const skippy_iteration_telemetry *t, list used, list available,
                       list finished, list failed, dict reasons):
    # NOTE: positional, in IterationTelemetry's field order (test_telemetry_fields_follow_the_core
    # fails when a field is added to one side only).
    return IterationTelemetry(
        t.iteration, t.active_sequences, t.waiting_sequences, t.admitted, t.preempted,
        t.prefill_tokens, t.recompute_tokens, t.decode_tokens, used, available,
        t.prefix_hits, t.prefix_misses, t.finished, t.failed, t.cancelled,
        t.rejected_overload, finished, failed, t.stale_refreshes, reasons)


cdef object _SEQ_FIELDS = Sequence.__slots__


cdef class _SlotObjects:
    """The Python objects of a slot's sequence that the core does not hold, only carries."""
    cdef object sequence_id
    cdef object prefix_restore
    cdef object cache_affinity
    cdef object sampling
    cdef object tenant  # the sequence's own `tenant` field, for snapshots and Python policies
    cdef object prompt  # the prompt as a tuple, built the first time a Python policy ranks it


cdef _SlotObjects _slot_objects(object seq):
    cdef _SlotObjects o = _SlotObjects.__new__(_SlotObjects)
    o.sequence_id = seq.id
    o.prefix_restore = seq.prefix_restore
    o.cache_affinity = seq.cache_affinity
    o.sampling = seq.sampling
    o.tenant = seq.tenant
    return o


cdef inline _SlotObjects _carried(list objects, size_t slot):
    """The objects of a waiting, active or just-retired slot (never None for those)."""
    return <_SlotObjects>objects[slot]


cdef int _rank_trampoline(void *ctx, const skippy_scheduler *s, const uint32_t *slots,
                          size_t n, uint64_t turn, size_t *out) noexcept with gil:
    cdef Scheduler self = <Scheduler>ctx
    cdef skippy_sequence_info info
    cdef size_t i
    cdef _SlotObjects o
    try:
        candidates = []
        store_affinity = None
        if self._store is not None:
            # With a store the core holds each sequence's (refreshed) affinity; the carried
            # object is the descriptor's, which carries none then.
            from .prefix_store import store_affinity  # (that module imports this one)
        for i in range(n):
            skippy_scheduler_sequence(s, slots[i], &info)
            o = _carried(self._objects, slots[i])
            # NOTE: a submitted prompt never changes, so its tuple is built once per
            # submission, not at every ranking (a long queue of long prompts re-ranks often).
            if o.prompt is None:
                o.prompt = tuple([info.tokens[k] for k in range(info.prompt_count)])
            affinity = o.cache_affinity
            if store_affinity is not None:
                affinity = store_affinity(
                    info.restore_token_count if info.has_prefix_restore else 0,
                    self._aff_costs[0], self._aff_costs[1], info.cache_epoch)[1]
            candidates.append(CacheAwareCandidate(
                index=i, priority=info.priority, affinity=affinity,
                prompt_tokens=o.prompt, enqueued_turn=info.enqueued_turn,
                order=info.enqueue_order, tenant=o.tenant))
        order = self.admission.order(candidates, turn)
        try:
            order = [int(k) for k in order]
        except (TypeError, ValueError):
            raise TypeError("admission policy must return a list of candidate indexes") from None
        if sorted(order) != list(range(n)):
            raise ValueError("admission policy must return a permutation of the candidate indexes")
        for i in range(n):
            out[i] = order[i]
        return 0
    except BaseException as exc:
        self._cb_error = exc
        return 1


cdef int _victim_trampoline(void *ctx, const skippy_scheduler *s, const uint32_t *slots,
                            size_t n, size_t *out) noexcept with gil:
    cdef Scheduler self = <Scheduler>ctx
    cdef skippy_sequence_info info
    cdef size_t i
    try:
        candidates = []
        for i in range(n):
            skippy_scheduler_sequence(s, slots[i], &info)
            candidates.append(VictimCandidate(
                sequence_id=_carried(self._objects, slots[i]).sequence_id, priority=info.priority,
                admitted_at=info.admitted_at, computed_tokens=info.prefill_cursor,
                generated_tokens=info.generated_count))
        choice = self.preemption.select_victim(candidates)
        if choice is None:
            out[0] = n
        else:
            if isinstance(choice, bool) or not isinstance(choice, int) or not 0 <= choice < n:
                raise ValueError(f"preemption policy returned {choice!r}, not a candidate position")
            out[0] = choice
        return 0
    except BaseException as exc:
        self._cb_error = exc
        return 1


cdef class PlanOutputs:
    """The plan's compact sampled-output block, as a native runtime writes it.

    Entry k says: work row `request_indexes[k]` sampled token `predicted_tokens[k]`.
    Set `count` to the number of entries written. Both arrays have one entry per plan row (at
    most one sample per row), and are views of the native block the scheduler reads.

    request_indexes: uintp array of `capacity` entries; the work row of each entry.
    predicted_tokens: int32 array of `capacity` entries; the sampled token of each entry (a
        negative token ends the row's sequence).
    """
    cdef IterationPlan _plan
    cdef readonly object request_indexes
    cdef readonly object predicted_tokens

    @property
    def capacity(self):
        """Entries the block holds: one per plan row (int)."""
        return self._plan._rows

    @property
    def count(self):
        """Entries written, an int in [0, capacity]; set it once the entries are in place."""
        self._plan._check()
        return self._plan._p.outputs.count

    @count.setter
    def count(self, value):
        self._plan._check()
        value = check_u64("count", value)
        if value > self._plan._rows:
            raise ValueError(f"count must be in [0, {self._plan._rows}]")
        self._plan._p.outputs.count = value


cdef class IterationPlan:
    """One iteration's work rows; row index = work index.

    Arrays are views of the scheduler's native plan memory: valid until this plan is completed
    or aborted (at depth 1, making the next plan aborts a live one). `token_count`, `admitted`,
    `preempted`, `step` and `len()` stay readable afterwards; `work` and `sequence_ids` too once
    they have been built.
    """
    cdef Scheduler _s
    cdef skippy_plan *_p
    cdef _PlanBuffer _b
    cdef list _row_objects                 # depth > 1: each row's _SlotObjects, taken when made
    cdef array _row_holders                # attached store: each row's restore holder, ditto
    cdef readonly uint64_t serial
    cdef readonly uint64_t step
    cdef readonly size_t token_count
    cdef readonly size_t admitted
    cdef readonly size_t preempted
    cdef size_t _rows
    cdef size_t _samples
    cdef object _work
    cdef object _ids
    cdef PlanOutputs _outputs

    def __len__(self):
        return self._rows

    cdef int _check(self) except -1:
        if not skippy_scheduler_plan_live(self._s._s, self.serial):
            raise StalePlanError(f"plan {self.serial} is no longer live (completed, aborted or "
                                 "replaced)")
        return 0

    @property
    def live(self):
        """Whether the arrays may still be read: not completed, aborted or replaced."""
        return bool(skippy_scheduler_plan_live(self._s._s, self.serial))

    @property
    def tokens(self):
        """int32 array of `token_count` input token ids, the rows one after another: row r is
        `tokens[row_offsets[r]:row_offsets[r + 1]]`."""
        self._check()
        return self._b.slice(_A_TOK, self.token_count)

    @property
    def positions(self):
        """int32 array of `token_count` absolute positions in their sequence, one per token of
        `tokens`."""
        self._check()
        return self._b.slice(_A_POS, self.token_count)

    @property
    def row_offsets(self):
        """uintp array of `len(plan) + 1` offsets into `tokens` and `positions`: row r spans
        `[row_offsets[r], row_offsets[r + 1])`; the last entry is `token_count`."""
        self._check()
        return self._b.slice(_A_OFF, self._rows + 1)

    @property
    def sample_last(self):
        """uint8 array of `len(plan)` flags: 1 when the row samples a token after its last
        input token (one output entry is expected for it), else 0."""
        self._check()
        return self._b.slice(_A_SAMPLE, self._rows)

    @property
    def phases(self):
        """uint8 array of `len(plan)` row kinds, the values of `IterationPhase` (0 Prefill,
        1 Recompute, 2 Decode)."""
        self._check()
        return self._b.slice(_A_PHASE, self._rows)

    @property
    def slots(self):
        """uint32 array of `len(plan)` scheduler slots, the native handle of each row's
        sequence (`sequence_ids` gives the ids)."""
        self._check()
        return self._b.slice(_A_SLOT, self._rows)

    @property
    def sample_rows(self):
        """uintp array of the work indexes of the sampling rows (those with `sample_last` set),
        ascending: one output entry is expected for each."""
        self._check()
        return self._b.slice(_A_SROWS, self._samples)

    @property
    def requests(self):
        """cffi `skippy_iteration_request *` over the rows (for a native runtime call)."""
        self._check()
        return _ffi.cast("skippy_iteration_request *", <size_t>self._p.requests)

    @property
    def native(self):
        """cffi `skippy_plan *` of the whole plan struct."""
        self._check()
        return _ffi.cast("skippy_plan *", <size_t>self._p)

    @property
    def outputs(self):
        """The `PlanOutputs` block a runtime writes this plan's sampled tokens into."""
        cdef PlanOutputs o
        self._check()
        if self._outputs is None:
            o = PlanOutputs.__new__(PlanOutputs)
            o._plan = self
            o.request_indexes = self._b.slice(_A_OIDX, self._rows)
            o.predicted_tokens = self._b.slice(_A_OTOK, self._rows)
            self._outputs = o
        return self._outputs

    @property
    def new_rows(self):
        """uint8 array of `len(plan)` flags: 1 when the row is its sequence's first since
        admission (a first admission, or a resume after preemption), else 0. A host sets up the
        sequence's state at a new row (and restores its prefix first), never by diffing ids."""
        self._check()
        return self._b.slice(_A_NEW, self._rows)

    @property
    def restored_tokens(self):
        """uintp array of `len(plan)` token counts: for a new row, the positions [0, n) of its
        sequence the host must already hold before the row (copied from the row's restore
        holder, or left in the cache by the caller); 0 for every other row."""
        self._check()
        return self._b.slice(_A_REST, self._rows)

    @property
    def deferred_rows(self):
        """uintp array of the work indexes whose one input token an earlier plan is still
        sampling (ascending; empty at depth 1). The arena holds -1 there until it is written
        (`resolve_deferred`, §2.11)."""
        self._check()
        return self._b.slice(_A_DROW, self._p.deferred.count)

    @property
    def deferred_source_steps(self):
        """uint64 array, one per `deferred_rows` entry: the `step` of the plan that samples
        that row's input token."""
        self._check()
        return self._b.slice(_A_DSTEP, self._p.deferred.count)

    @property
    def deferred_source_indexes(self):
        """uintp array, one per `deferred_rows` entry: the work index, in that earlier plan,
        of the sample that is this row's input token."""
        self._check()
        return self._b.slice(_A_DIDX, self._p.deferred.count)

    @property
    def sequence_ids(self):
        """Sequence id of every row (built once, on first use; readable afterwards)."""
        cdef skippy_plan *p
        cdef size_t r
        if self._ids is None:
            if self._row_objects is not None:
                self._ids = [(<_SlotObjects>o).sequence_id for o in self._row_objects]
                return self._ids
            self._check()
            p = self._p
            objects = self._s._objects
            self._ids = [_carried(objects, p.slots[r]).sequence_id for r in range(self._rows)]
        return self._ids

    @property
    def work(self):
        """The rows as `IterationWork` values (built once, on first use)."""
        cdef skippy_plan *p
        cdef size_t r, a, b
        cdef _SlotObjects o
        if self._work is None:
            self._check()
            p = self._p
            objects = self._s._objects
            toks = self._b.bases[_A_TOK]
            poss = self._b.bases[_A_POS]
            work = []
            for r in range(self._rows):
                a = p.row_offsets[r]
                b = p.row_offsets[r + 1]
                o = (self._row_objects[r] if self._row_objects is not None
                     else _carried(objects, p.slots[r]))
                holder = None
                if self._row_holders is not None and \
                        self._row_holders.data.as_uints[r] != SKIPPY_PREFIX_NONE:
                    holder = self._row_holders.data.as_uints[r]
                work.append(IterationWork(o.sequence_id, tuple(toks[a:b].tolist()),
                                          tuple(poss[a:b].tolist()), bool(p.sample_last[r]),
                                          _PHASES[p.phases[r]], o.sampling, holder,
                                          bool(p.new_rows[r]), p.restored_tokens[r]))
            self._work = work
        return self._work

    def __repr__(self):
        return (f"IterationPlan(step={self.step}, rows={self._rows}, "
                f"token_count={self.token_count}, admitted={self.admitted})")


cdef class Scheduler:
    """Scheduler(config=None, admission=None, preemption=None)
--

    Iteration-level scheduler with native state (behaviour.md §1–§2).

    The defaults are the reference config and policies: cache-aware admission (§3) and
    lowest-priority-newest preemption (§2.8).
    """
    cdef skippy_scheduler *_s
    cdef dict _buffers                     # plan buffer address -> _PlanBuffer
    cdef uint64_t _last_serial             # serial of the last plan made
    cdef readonly object config
    cdef readonly object admission
    cdef readonly object preemption
    cdef list _objects                     # _SlotObjects of every occupied slot, by slot
    cdef list _comp_names
    cdef list _available
    cdef object _cb_error
    cdef object _store                     # the attached PrefixStore (keeps it alive)
    cdef tuple _aff_costs                  # (prefill, restore) cost per token with a store
    cdef bint _fair                        # the core runs fair share (SKIPPY_ADMISSION_FAIR_SHARE)
    cdef dict _tenant_ids                  # fair share: tenant object -> the core's uint32 id
    cdef list _tenants                     #   and back, by id
    cdef double _default_weight            #   weight of a tenant first seen at submit

    def __cinit__(self, config=None, admission=None, preemption=None):
        self._s = NULL

    def __init__(self, config=None, admission=None, preemption=None):
        cdef skippy_scheduler_config c
        cdef skippy_error *err = NULL
        cdef array names_keep
        if config is None:
            config = SchedulerConfig()
        if not isinstance(config, SchedulerConfig):
            raise TypeError(f"config must be a SchedulerConfig, got {type(config).__name__}")
        if admission is None:
            admission = CacheAwareAdmission()
        if not isinstance(admission, AdmissionPolicy):
            raise TypeError("admission must be an AdmissionPolicy")
        if preemption is None:
            preemption = LowestPriorityNewest()
        if not isinstance(preemption, PreemptionPolicy):
            raise TypeError("preemption must be a PreemptionPolicy")
        cfg = config.normalized()
        skippy_scheduler_config_default(&c)
        c.max_active_sequences = cfg.max_active_sequences
        c.sequence_id_limit = cfg.sequence_id_limit
        c.reserved_sequence_ids = cfg.reserved_sequence_ids
        c.max_waiting_sequences = cfg.max_waiting_sequences
        c.max_tokens_per_iteration = cfg.max_tokens_per_iteration
        c.prefill_chunk_tokens = cfg.prefill_chunk_tokens
        c.max_prefill_sequences_per_iteration = _size(cfg.max_prefill_sequences_per_iteration)
        c.max_consecutive_prefill_iterations = _size(cfg.max_consecutive_prefill_iterations)
        c.mixed_prefill_decode = cfg.mixed_prefill_decode
        c.cache_aging_cost_per_iteration = cfg.cache_aging_cost_per_iteration
        c.group_waiting_prefixes = cfg.group_waiting_prefixes
        # Every policy is resolved against the config (subclasses keep their type).
        admission = admission.resolved(cfg)
        # Only the built-in classes themselves run in C: a subclass may override their methods.
        fair = (type(admission) is FairShareAdmission
                and admission.native_kind == AdmissionKind.FAIR_SHARE)
        if type(admission) in (CacheAwareAdmission, FcfsAdmission, PriorityAdmission) or fair:
            c.admission_policy = admission.native_kind
        else:
            c.admission_policy = SKIPPY_ADMISSION_CALLBACK
        inner = admission.within if fair else admission
        if type(inner) is CacheAwareAdmission:
            c.cache_aging_cost_per_iteration = inner.aging_cost_per_turn
            c.group_waiting_prefixes = inner.group_waiting_prefixes
        if fair:
            c.fair_prefill_cost = admission.counters.prefill_cost
            c.fair_decode_cost = admission.counters.decode_cost
        if type(preemption) in (LowestPriorityNewest, FewestComputedTokens):
            c.preemption_policy = preemption.native_kind
        else:
            c.preemption_policy = SKIPPY_PREEMPT_CALLBACK
        comps = list(cfg.memory_components)
        names = [m.name.encode("utf-8") for m in comps]
        cdef list holder = []
        cdef skippy_memory_component *mc = NULL
        raw = _ffi.new("skippy_memory_component[]", max(len(comps), 1))
        for i, m in enumerate(comps):
            nm = _ffi.new("char[]", names[i])
            holder.append(nm)
            raw[i].name = nm
            raw[i].capacity_bytes = m.capacity_bytes
            raw[i].resident_bytes = m.resident_bytes
            raw[i].bytes_per_token = m.bytes_per_token
            raw[i].bytes_per_sequence = m.bytes_per_sequence
        c.memory_components = <const skippy_memory_component *><size_t>int(_ffi.cast("uintptr_t", raw))
        c.memory_component_count = len(comps)
        c.max_inflight_plans = cfg.max_inflight_plans
        if self._s != NULL:
            raise RuntimeError("Scheduler.__init__ called twice")
        if skippy_scheduler_create(&c, &self._s, &err) != SKIPPY_STATUS_OK:
            msg = err.message.decode("utf-8", "replace") if err != NULL else "scheduler creation failed"
            skippy_error_free(err)
            raise MemoryError(msg)
        skippy_scheduler_set_callbacks(self._s, _rank_trampoline, _victim_trampoline, <void *>self)
        self.config = cfg
        self.admission = admission
        self.preemption = preemption
        self._objects = []
        self._comp_names = [m.name for m in comps]
        self._available = [(m.name, m.available_bytes()) for m in comps]
        self._buffers = {}
        self._last_serial = 0
        self._fair = fair
        self._tenant_ids = {}
        self._tenants = []
        self._default_weight = 1.0
        if fair:
            counters = admission.counters
            # None is tenant 0, the id a sequence without a tenant gets (as in C).
            self._tenant_id(None)
            for tenant, weight in counters.weights.items():
                self._set_weight(self._tenant_id(tenant), weight)
            self._default_weight = counters.default_weight
            if self._default_weight != 1.0 and None not in counters.weights:
                self._set_weight(0, self._default_weight)

    def __dealloc__(self):
        if self._s != NULL:
            skippy_scheduler_free(self._s)
            self._s = NULL

    # -- prefix store (§2.12) -----------------------------------------------------------------

    def attach_prefix_store(self, store, *, prefill_cost_per_token=1, restore_cost_per_token=0):
        """Read every waiting sequence's prefix restore and saved cost from `store` (a
        `PrefixStore`, or None to detach): at submit, and again before each admission selection
        for the sequences under a prefix inserted or evicted since (stale refresh, counted in
        `metrics().stale_refreshes`). The entry a sequence is admitted with stays pinned while
        it is active. Only while the scheduler holds no sequence; submitted sequences must then
        carry no prefix restore or affinity (the store decides)."""
        cdef NativePrefixStore native = None
        cdef uint64_t prefill = check_u64("prefill_cost_per_token", prefill_cost_per_token)
        cdef uint64_t restore = check_u64("restore_cost_per_token", restore_cost_per_token)
        if store is not None:
            native = getattr(store, "_native", store)
            if not isinstance(native, NativePrefixStore):
                raise TypeError("store must be a PrefixStore (native), got "
                                f"{type(store).__name__}")
        if skippy_scheduler_set_prefix_store(self._s, native._p if native is not None else NULL,
                                             prefill, restore, NULL) != SKIPPY_STATUS_OK:
            self._raise_last()
        self._store = store
        self._aff_costs = (prefill, restore)

    @property
    def prefix_store(self):
        """The attached `PrefixStore`, or None."""
        return self._store

    cdef int _raise_last(self, object seq_id=None) except -1:
        cdef skippy_sched_code code = skippy_scheduler_last_code(self._s)
        msg = skippy_scheduler_last_message(self._s).decode("utf-8", "replace")
        if code == SKIPPY_SCHED_QUEUE_FULL:
            raise QueueFull(self.config.max_waiting_sequences)
        if code == SKIPPY_SCHED_DUPLICATE:
            raise DuplicateSequence(seq_id)
        if code == SKIPPY_SCHED_EMPTY_PROMPT:
            raise EmptyPrompt()
        if code == SKIPPY_SCHED_STALE_PLAN:
            raise StalePlanError(msg)
        if code == SKIPPY_SCHED_BAD_OUTPUTS:
            raise MalformedOutputs(msg)
        if code == SKIPPY_SCHED_NO_MEMORY:
            raise MemoryError(msg)
        if code == SKIPPY_SCHED_PLAN_IN_FLIGHT:
            raise PlanInFlight(msg)
        if code == SKIPPY_SCHED_CALLBACK:
            exc, self._cb_error = self._cb_error, None
            if exc is not None:
                raise exc
            raise RuntimeError(msg)
        raise ValueError(msg)

    # -- submit -----------------------------------------------------------------------------

    def submit(self, seq, *, session=None):
        """Queue a copy of `seq`. `session` is an optional native session handle (int address or
        cffi pointer) placed in every row of this sequence."""
        cdef skippy_sequence_desc d
        cdef uint32_t slot = 0
        cdef array prompt, gen
        if not isinstance(seq, Sequence):
            raise TypeError(f"submit takes a Sequence, got {type(seq).__name__}")
        prompt = token_array(seq.prompt_tokens)
        gen = token_array(seq.generated_tokens)
        if prompt is not None and gen is not None:
            # Tokens are already checked and converted: validate everything else as usual.
            shell = Sequence.__new__(Sequence)
            for name in _SEQ_FIELDS:
                object.__setattr__(shell, name, getattr(seq, name))
            shell.prompt_tokens = []
            shell.generated_tokens = []
            q = shell._validated_copy()
        else:
            q = seq._validated_copy()
            # The checks return lists of exact ints in the token range, which always convert.
            prompt = token_array(q.prompt_tokens)
            gen = token_array(q.generated_tokens)
            if prompt is None or gen is None:
                raise RuntimeError("validated tokens did not convert to int32")
        id_bytes = q.id.encode("utf-8")
        sampling = q.sampling
        cdef size_t sampling_addr = 0
        if sampling is not None and isinstance(sampling, _ffi.CData) and _ffi.typeof(sampling) is _SAMPLING_CTYPE:
            sampling_addr = int(_ffi.cast("uintptr_t", sampling))
        cdef size_t session_addr = 0
        if session is not None:
            if isinstance(session, _ffi.CData):
                session_addr = int(_ffi.cast("uintptr_t", session))
            elif isinstance(session, int) and not isinstance(session, bool) and session >= 0:
                session_addr = session
            else:
                raise TypeError("session must be a non-negative int address or a cffi pointer")
        d.id = id_bytes
        d.id_len = len(id_bytes)
        d.prompt_tokens = <const int32_t *>prompt.data.as_ints
        d.prompt_count = len(prompt)
        d.generated_tokens = <const int32_t *>gen.data.as_ints if len(gen) else NULL
        d.generated_count = len(gen)
        d.max_tokens = q.max_tokens
        d.priority = q.priority
        d.admission_tokens = q.admission_tokens
        d.status = q.status.value
        d.prefill_cursor = q.prefill_cursor
        d.has_prefix_restore = q.prefix_restore is not None
        d.restore_token_count = q.prefix_restore.token_count if q.prefix_restore is not None else 0
        d.saved_cost = q.cache_affinity.estimated_saved_cost()
        d.sampling = <const skippy_sampling_config *>sampling_addr
        d.session = <skippy_session *>session_addr
        d.tenant = 0
        new_tenant = False
        if self._fair:
            tenant = FairShareAdmission.tenant_of_sequence(q)
            known = self._tenant_ids.get(tenant)
            new_tenant = known is None
            # A refused submit must not introduce the tenant: its id is taken only afterwards.
            d.tenant = self._next_tenant_id() if new_tenant else known
        if skippy_scheduler_submit(self._s, &d, &slot, NULL) != SKIPPY_STATUS_OK:
            self._raise_last(q.id)
        if new_tenant:
            self._add_tenant(tenant)
        while len(self._objects) <= slot:
            self._objects.append(None)
        self._objects[slot] = _slot_objects(q)

    # -- planning ---------------------------------------------------------------------------

    def plan_iteration(self):
        """Admit what fits and build the next iteration plan.

        Raises PlanInFlight when `max_inflight_plans` (> 1) plans are live; at depth 1 a live
        plan is aborted first (§0.4f, §2.11)."""
        cdef size_t n, i, r
        cdef const skippy_retired *ret = skippy_scheduler_retired(self._s, &n)
        cdef skippy_plan *p
        cdef list objects = self._objects
        cdef IterationPlan plan
        cdef _PlanBuffer b
        cdef skippy_sequence_info info
        retired = [ret[i].slot for i in range(n)] if n else None
        if skippy_scheduler_plan(self._s, &p, NULL) != SKIPPY_STATUS_OK:
            self._raise_last()
        if retired is not None:
            for slot in retired:
                objects[slot] = None
        b = self._buffers.get(<size_t>p)
        if b is None:
            b = _plan_buffer(p)
            self._buffers[<size_t>p] = b
        b.refresh()
        plan = IterationPlan.__new__(IterationPlan)
        plan._s = self
        plan._p = p
        plan._b = b
        plan.serial = p.serial
        plan.step = p.step
        plan.token_count = p.token_count
        plan.admitted = p.admitted
        plan.preempted = p.preempted
        plan._rows = p.request_count
        plan._samples = p.sample_count
        self._last_serial = p.serial
        if self.config.max_inflight_plans > 1:
            # Slots of sequences that end while this plan is live may be reused before it is
            # read: keep what each row names now.
            plan._row_objects = [objects[p.slots[r]] for r in range(p.request_count)]
        if self._store is not None:
            # The holder a row names is the one its sequence was admitted with when the plan
            # was made (read later, a cancel or a reused slot would change it); kept in a C
            # array, so making a plan adds no Python object per row.
            holders = clone(_UINT32_ARRAY, p.request_count, False)
            for r in range(p.request_count):
                holders.data.as_uints[r] = (
                    info.restore_holder
                    if skippy_scheduler_sequence(self._s, p.slots[r], &info)
                    else SKIPPY_PREFIX_NONE)
            plan._row_holders = holders
        return plan

    @property
    def live_plans(self):
        """Plans made and not yet completed or aborted (an int in [0, max_inflight_plans])."""
        return skippy_scheduler_live_plans(self._s)

    cdef int _own_live(self, object plan) except -1:
        if not isinstance(plan, IterationPlan):
            raise TypeError(f"expected an IterationPlan, got {type(plan).__name__}")
        if (<IterationPlan>plan)._s is not self:
            raise ValueError("the plan belongs to another scheduler")
        (<IterationPlan>plan)._check()
        return 0

    def observe_iteration_duration(self, plan, elapsed):
        """Record how long `plan` took (seconds) to calibrate mixed planning (§2.6)."""
        self._own_live(plan)
        if isinstance(elapsed, bool) or not isinstance(elapsed, numbers.Real):
            raise TypeError(f"elapsed must be seconds as a float, got {type(elapsed).__name__}")
        if skippy_scheduler_observe(self._s, (<IterationPlan>plan).serial, float(elapsed) * 1e6,
                                    NULL) != SKIPPY_STATUS_OK:
            self._raise_last()

    def abort_iteration(self, plan):
        """Undo `plan` and every later live plan, for a runtime that could not run them: each
        sequence in them returns to the cursor and tokens it had before (§2.11)."""
        self._own_live(plan)
        if skippy_scheduler_abort(self._s, (<IterationPlan>plan).serial, NULL) != SKIPPY_STATUS_OK:
            self._raise_last()

    def complete_iteration(self, plan, predictions=None):
        """Apply the sampled outputs of `plan` (its `outputs` block, or `predictions`); plans
        complete in the order they were made (PlanInFlight otherwise)."""
        cdef skippy_iteration_telemetry t
        cdef size_t n_before, n_after, i, k
        cdef const skippy_retired *ret
        cdef skippy_plan *p
        cdef uint64_t oldest
        self._own_live(plan)
        p = (<IterationPlan>plan)._p
        oldest = skippy_scheduler_oldest_plan(self._s)
        if (<IterationPlan>plan).serial != oldest:
            raise PlanInFlight(f"plan step {(<IterationPlan>plan).step} completed before an "
                               "older live plan: complete plans in the order they were made")
        if predictions is not None:
            preds = list(predictions)
            for pr in preds:
                if not isinstance(pr, IterationPrediction):
                    raise TypeError(f"predictions must be IterationPrediction values, got {type(pr).__name__}")
            if len(preds) > p.request_count:
                raise MalformedOutputs(f"{len(preds)} predictions for a plan of {p.request_count} rows")
            for pr in preds:
                if pr.work_index >= p.request_count:
                    raise MalformedOutputs(f"prediction names work index {pr.work_index} outside "
                                           f"the plan ({p.request_count} rows)")
            k = 0
            for pr in preds:
                p.outputs.sampled_request_indexes[k] = pr.work_index
                p.outputs.predicted_tokens[k] = pr.token
                k += 1
            p.outputs.count = k
        skippy_scheduler_retired(self._s, &n_before)
        if skippy_scheduler_complete(self._s, (<IterationPlan>plan).serial, &t, NULL) != SKIPPY_STATUS_OK:
            self._raise_last()
        ret = skippy_scheduler_retired(self._s, &n_after)
        finished = []
        failed = []
        reasons = {}
        for i in range(n_before, n_after):
            sid = _carried(self._objects, ret[i].slot).sequence_id
            if ret[i].status == SKIPPY_SEQ_FAILED:
                failed.append(sid)
            else:
                finished.append(sid)
            reasons[sid] = _END_REASONS[ret[i].reason]
        return _telemetry(&t, self._used_list(), list(self._available), finished, failed,
                          reasons)
    cdef list _used_list(self):
        cdef size_t n, i
        cdef const uint64_t *u = skippy_scheduler_component_used(self._s, &n)
        return [(self._comp_names[i], u[i]) for i in range(n)]

    # -- pressure, cancel, inspection -------------------------------------------------------

    def preempt_for_component_pressure(self, used_bytes):
        """Overwrite used bytes with measured values and preempt until every component fits."""
        cdef size_t n = 0, i, out = 0
        cdef array vals
        if isinstance(used_bytes, (str, bytes)) or not hasattr(used_bytes, "__iter__"):
            raise TypeError("used_bytes must be a list of ints")
        values = [check_u64(f"used_bytes[{k}]", v) for k, v in enumerate(used_bytes)]
        vals = array("Q", values)
        n = len(vals)
        if skippy_scheduler_preempt(self._s, <const uint64_t *>vals.data.as_ulonglongs if n else NULL, n, &out,
                                    NULL) != SKIPPY_STATUS_OK:
            self._raise_last()
        cdef const uint32_t *v_slots = skippy_scheduler_preempted_slots(self._s)
        return [_carried(self._objects, v_slots[i]).sequence_id for i in range(out)]

    def cancel(self, sequence_id):
        """Remove a waiting or active sequence; False when the id is unknown."""
        if not isinstance(sequence_id, str):
            raise TypeError(f"sequence id must be a str, got {type(sequence_id).__name__}")
        b = sequence_id.encode("utf-8")
        return bool(skippy_scheduler_cancel(self._s, b, len(b)))

    def snapshot(self):
        """A new `SchedulerSnapshot`: active ids in walk (admission) order, waiting ids in queue
        order, and the used bytes of each memory component."""
        cdef size_t n, i
        cdef const uint32_t *a = skippy_scheduler_active_slots(self._s, &n)
        active = [_carried(self._objects, a[i]).sequence_id for i in range(n)]
        cdef const uint32_t *w = skippy_scheduler_waiting_slots(self._s, &n)
        waiting = [_carried(self._objects, w[i]).sequence_id for i in range(n)]
        return SchedulerSnapshot(active, waiting, self._used_list())

    def sequence(self, sequence_id):
        """Read-only snapshot of a waiting or active sequence, or None."""
        if not isinstance(sequence_id, str):
            raise TypeError(f"sequence id must be a str, got {type(sequence_id).__name__}")
        b = sequence_id.encode("utf-8")
        cdef uint32_t slot = skippy_scheduler_find(self._s, b, len(b))
        if slot == UINT32_MAX:
            return None
        return self._slot_snapshot(slot, None)

    def retired(self):
        """Sequences that left the scheduler since the last plan (finished, failed or
        cancelled, in that order of events), as read-only snapshots with their generated
        tokens and final status; the next `plan_iteration` forgets them."""
        cdef size_t n, i
        cdef const skippy_retired *ret = skippy_scheduler_retired(self._s, &n)
        return [self._slot_snapshot(ret[i].slot, _STATUSES[ret[i].status]) for i in range(n)]

    cdef object _slot_snapshot(self, uint32_t slot, object status):
        cdef skippy_sequence_info info
        cdef size_t k
        if not skippy_scheduler_sequence(self._s, slot, &info):
            return None
        cdef _SlotObjects o = _carried(self._objects, slot)
        total = info.prompt_count + info.generated_count
        toks = [info.tokens[k] for k in range(total)]
        restore, affinity = o.prefix_restore, o.cache_affinity
        if self._store is not None:
            from .prefix_store import store_affinity  # (that module imports this one)
            restore, affinity = store_affinity(
                info.restore_token_count if info.has_prefix_restore else 0,
                self._aff_costs[0], self._aff_costs[1], info.cache_epoch)
        return Sequence._frozen_snapshot(
            id=o.sequence_id, prompt_tokens=toks[:info.prompt_count],
            generated_tokens=toks[info.prompt_count:], max_tokens=info.max_tokens,
            sampling=o.sampling, priority=info.priority, admission_tokens=info.admission_tokens,
            status=_STATUSES[info.status] if status is None else status,
            prefix_restore=restore, cache_affinity=affinity,
            admitted_at=info.admitted_at if info.admitted_at else None,
            prefill_cursor=info.prefill_cursor, enqueued_turn=info.enqueued_turn,
            enqueue_order=info.enqueue_order, tenant=o.tenant)

    def metrics(self):
        """A new `SchedulerMetrics` with the cumulative counters (changing it changes nothing
        here; call again for fresh values)."""
        cdef const skippy_scheduler_metrics *m = skippy_scheduler_get_metrics(self._s)
        return SchedulerMetrics(
            m.iterations, m.admitted, m.preempted, m.finished, m.failed, m.cancelled,
            m.rejected_overload, m.prefill_tokens, m.recompute_tokens, m.decode_tokens,
            m.prefix_hits, m.prefix_misses, m.active_sequences, m.waiting_sequences,
            m.discarded_rows, m.aborted_plans, m.restored_tokens, m.stale_refreshes)

    @property
    def waiting_turn(self):
        """The queue turn new submits are stamped with; each plan advances it (int)."""
        return skippy_scheduler_waiting_turn(self._s)

    @property
    def mixed_prefill_viable(self):
        """Whether observed durations still allow mixing prefill into decode plans (§2.6)."""
        return bool(skippy_scheduler_mixed_viable(self._s))

    @property
    def native(self):
        """Address of the underlying `skippy_scheduler *` (for native hosts sharing it)."""
        return <size_t>self._s

    # -- fair share ---------------------------------------------------------------------------

    cdef uint32_t _next_tenant_id(self) except? 0xFFFFFFFF:
        cdef size_t n = len(self._tenants)
        if n >= UINT32_MAX:
            raise OverflowError("more than 2**32 - 1 tenants")
        return <uint32_t>n

    cdef uint32_t _add_tenant(self, object tenant) except? 0xFFFFFFFF:
        """Give `tenant` the next id, with the policy's default weight. After a submit the core
        already holds the tenant, so setting its weight allocates nothing and cannot fail."""
        cdef uint32_t k = self._next_tenant_id()
        if self._default_weight != 1.0:
            self._set_weight(k, self._default_weight)
        self._tenant_ids[tenant] = k
        self._tenants.append(tenant)
        return k

    cdef uint32_t _tenant_id(self, object tenant) except? 0xFFFFFFFF:
        """The core's id of `tenant`, given on first sight."""
        known = self._tenant_ids.get(tenant)
        return self._add_tenant(tenant) if known is None else known

    cdef int _set_weight(self, uint32_t tenant, double weight) except -1:
        if skippy_scheduler_set_tenant_weight(self._s, tenant, weight, NULL) != SKIPPY_STATUS_OK:
            self._raise_last()
        return 0

    def set_tenant_weight(self, tenant, weight):
        """Give `tenant` the fair-share weight `weight` (a finite number > 0) from now on: every
        later charge to its counter is divided by it. ValueError unless the admission policy
        is the native fair share."""
        if not self._fair:
            raise ValueError("tenant weights apply to the native fair-share admission only")
        weight = VirtualTokenCounters._check_weight("weight", weight)
        self._set_weight(self._tenant_id(tenant), weight)

    def tenant_counters(self):
        """Fair share: each tenant this scheduler has seen (submitted or weighted; None for
        sequences without one) with its service counter, a float (docs/behaviour.md §3.6). An
        empty dict under any other admission policy."""
        cdef uint32_t k
        if not self._fair:
            return {}
        return {tenant: skippy_scheduler_tenant_counter(self._s, k)
                for k, tenant in enumerate(self._tenants)}

    @property
    def fair_share_lifts(self):
        """Fair share: how many times a returning tenant was raised to the floor (int)."""
        return skippy_scheduler_fair_share_lifts(self._s)


def _layout():
    """Sizes and field offsets of the shared structs as this compiled module sees them."""
    cdef skippy_iteration_request r
    cdef skippy_plan p
    cdef skippy_plan_outputs o
    cdef skippy_deferred_inputs d
    cdef skippy_retired t
    cdef size_t rb = <size_t>&r, pb = <size_t>&p, ob = <size_t>&o, db = <size_t>&d
    cdef size_t tb = <size_t>&t
    return {
        "skippy_iteration_request": (sizeof(skippy_iteration_request), {
            "session": <size_t>&r.session - rb, "token_ids": <size_t>&r.token_ids - rb,
            "token_count": <size_t>&r.token_count - rb, "positions": <size_t>&r.positions - rb,
            "position_count": <size_t>&r.position_count - rb,
            "sampling": <size_t>&r.sampling - rb, "input_desc": <size_t>&r.input_desc - rb,
            "input_payload": <size_t>&r.input_payload - rb,
            "sample_last": <size_t>&r.sample_last - rb}),
        "skippy_plan_outputs": (sizeof(skippy_plan_outputs), {
            "sampled_request_indexes": <size_t>&o.sampled_request_indexes - ob,
            "predicted_tokens": <size_t>&o.predicted_tokens - ob,
            "capacity": <size_t>&o.capacity - ob, "count": <size_t>&o.count - ob}),
        "skippy_plan": (sizeof(skippy_plan), {
            "serial": <size_t>&p.serial - pb, "requests": <size_t>&p.requests - pb,
            "request_count": <size_t>&p.request_count - pb,
            "request_capacity": <size_t>&p.request_capacity - pb,
            "tokens": <size_t>&p.tokens - pb, "positions": <size_t>&p.positions - pb,
            "token_count": <size_t>&p.token_count - pb,
            "token_capacity": <size_t>&p.token_capacity - pb,
            "row_offsets": <size_t>&p.row_offsets - pb, "slots": <size_t>&p.slots - pb,
            "phases": <size_t>&p.phases - pb, "sample_last": <size_t>&p.sample_last - pb,
            "sample_rows": <size_t>&p.sample_rows - pb,
            "sample_count": <size_t>&p.sample_count - pb, "admitted": <size_t>&p.admitted - pb,
            "preempted": <size_t>&p.preempted - pb, "outputs": <size_t>&p.outputs - pb,
            "step": <size_t>&p.step - pb, "deferred": <size_t>&p.deferred - pb,
            "new_rows": <size_t>&p.new_rows - pb,
            "restored_tokens": <size_t>&p.restored_tokens - pb}),
        "skippy_retired": (sizeof(skippy_retired), {
            "slot": <size_t>&t.slot - tb, "status": <size_t>&t.status - tb,
            "reason": <size_t>&t.reason - tb}),
        "skippy_deferred_inputs": (sizeof(skippy_deferred_inputs), {
            "rows": <size_t>&d.rows - db, "source_steps": <size_t>&d.source_steps - db,
            "source_indexes": <size_t>&d.source_indexes - db, "count": <size_t>&d.count - db,
            "capacity": <size_t>&d.capacity - db}),
        "skippy_sampling_config": (sizeof(skippy_sampling_config), {}),
    }


cdef class NativePrefixStore:
    """NativePrefixStore(capacity_tokens=None, holder_slots=None, first_holder_id=0)
--

    The C prefix store (csrc/sk_prefix.c, behaviour.md §8c); `skippy_scheduler.PrefixStore`
    is its Python face. Entries are small integer ids, reused after eviction; -1 = none."""
    cdef skippy_prefix_store *_p

    def __cinit__(self, capacity_tokens=None, holder_slots=None, first_holder_id=0):
        cdef skippy_prefix_store_config c
        self._p = NULL
        skippy_prefix_store_config_default(&c)
        if capacity_tokens is not None:
            c.capacity_tokens = check_u64("capacity_tokens", capacity_tokens, (1 << 64) - 2)
        if holder_slots is not None:
            c.holder_slots = check_u64("holder_slots", holder_slots, UINT32_MAX)
        c.first_holder_id = check_u64("first_holder_id", first_holder_id, UINT32_MAX - 1)
        if holder_slots is not None and c.first_holder_id + c.holder_slots > UINT32_MAX - 1:
            raise ValueError("first_holder_id + holder_slots must stay below 2**32 - 1")
        code = skippy_prefix_store_create(&c, &self._p)
        if code == SKIPPY_SCHED_NO_MEMORY:
            raise MemoryError("out of memory creating a prefix store")
        if code != SKIPPY_SCHED_OK:
            raise ValueError("invalid prefix store configuration")

    def __init__(self, capacity_tokens=None, holder_slots=None, first_holder_id=0):
        pass  # (__cinit__ made the store; this gives the class its signature)

    def __dealloc__(self):
        if self._p != NULL:
            skippy_prefix_store_free(self._p)
            self._p = NULL

    cdef int _check(self, skippy_sched_code code) except -1:
        if code == SKIPPY_SCHED_OK:
            return 0
        msg = skippy_prefix_store_last_message(self._p).decode("utf-8", "replace")
        if code == SKIPPY_SCHED_NO_MEMORY:
            raise MemoryError(msg)
        raise ValueError(msg)

    def match(self, const int32_t[::1] tokens):
        """(entry or -1, matched tokens) of the longest resident prefix (a read)."""
        cdef size_t matched = 0
        cdef uint32_t e = skippy_prefix_store_match(self._p, &tokens[0] if len(tokens) else NULL,
                                                    len(tokens), &matched)
        return (-1 if e == SKIPPY_PREFIX_NONE else e), matched

    def find(self, const int32_t[::1] tokens):
        cdef uint32_t e = skippy_prefix_store_find(self._p, &tokens[0] if len(tokens) else NULL,
                                                   len(tokens))
        return -1 if e == SKIPPY_PREFIX_NONE else e

    def insert(self, const int32_t[::1] tokens, long long parent=-1, uint64_t handle=0):
        """The new (or existing, touched) entry, or -1 when no room could be made."""
        cdef uint32_t out = SKIPPY_PREFIX_NONE
        cdef uint32_t par = SKIPPY_PREFIX_NONE if parent < 0 else <uint32_t>parent
        self._check(skippy_prefix_store_insert(self._p, &tokens[0] if len(tokens) else NULL,
                                               len(tokens), par, handle, &out))
        return -1 if out == SKIPPY_PREFIX_NONE else out

    def evicted(self):
        """Evictions of the last insert / evict_one: (entry, holder or -1, handle, start,
        length) each."""
        cdef size_t n, i
        cdef const skippy_prefix_eviction *ev = skippy_prefix_store_evicted(self._p, &n)
        return [(ev[i].entry, -1 if ev[i].holder == SKIPPY_PREFIX_NONE else ev[i].holder,
                 ev[i].handle, ev[i].start, ev[i].length) for i in range(n)]

    def touch(self, uint32_t entry):
        self._check(skippy_prefix_store_touch(self._p, entry))

    def pin(self, uint32_t entry):
        self._check(skippy_prefix_store_pin(self._p, entry))

    def unpin(self, uint32_t entry):
        self._check(skippy_prefix_store_unpin(self._p, entry))

    def evict_one(self):
        cdef uint32_t e = skippy_prefix_store_evict_one(self._p)
        return -1 if e == SKIPPY_PREFIX_NONE else e

    def entry(self, uint32_t entry):
        """(parent, holder, start, length, pins, children, last_used, serial, handle) of a
        resident entry (-1 for no parent / holder), or None."""
        cdef skippy_prefix_entry_info i
        if not skippy_prefix_store_entry(self._p, entry, &i):
            return None
        return (-1 if i.parent == SKIPPY_PREFIX_NONE else i.parent,
                -1 if i.holder == SKIPPY_PREFIX_NONE else i.holder,
                i.start, i.length, i.pins, i.children, i.last_used, i.serial, i.handle)

    def key(self, uint32_t entry):
        """The full key of a resident entry (int32 array), or None."""
        cdef skippy_prefix_entry_info i
        if not skippy_prefix_store_entry(self._p, entry, &i):
            return None
        out = np.empty(i.length, dtype=np.int32)
        cdef int32_t[::1] view = out
        if i.length:
            skippy_prefix_store_key(self._p, entry, &view[0])
        return out

    def stats(self):
        """(used_tokens, entries, inserts, evictions, evicted_tokens, refused_inserts, epoch)."""
        cdef skippy_prefix_store_stats st
        skippy_prefix_store_get_stats(self._p, &st)
        return (st.used_tokens, st.entries, st.inserts, st.evictions, st.evicted_tokens,
                st.refused_inserts, st.epoch)

    def lru_order(self):
        """Evictable entries, next victim first."""
        cdef skippy_prefix_store_stats st
        skippy_prefix_store_get_stats(self._p, &st)
        out = np.empty(st.entries + 1, dtype=np.uint32)
        cdef uint32_t[::1] view = out
        cdef size_t n = skippy_prefix_store_lru_order(self._p, &view[0])
        return out[:n].tolist()

    @property
    def native(self):
        """Address of the underlying `skippy_prefix_store *` (for native hosts)."""
        return <size_t>self._p
