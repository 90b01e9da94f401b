# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Native scheduler: a thin Python face over the C core (csrc/).

All state lives in the C core; this module validates arguments at the boundary, converts
Python sequences into the core's descriptors once at submit, and exposes each plan's arrays
as numpy views over the core's memory (no copies). Python objects that the core only carries
(ids, affinities, restores, sampling objects) are kept per slot on this side.
"""
from cpython.array cimport array, clone
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.buffer cimport PyBuffer_FillInfo
from libc.stdint cimport int32_t, uint8_t, uint32_t, uint64_t, UINT32_MAX
from libc.stdint cimport SIZE_MAX

from ._boundary cimport check_u64, token_array
from ._skippy_abi cimport (
    SKIPPY_PLAN_ABI_VERSION,
    SKIPPY_PHASE_DECODE,
    SKIPPY_STATUS_INVALID_ARGUMENT,
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
from ._sk_prefix cimport sk_prefix_owner

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
from .slack import check_clock, check_step_cost
from ._validate import check_id
from .types import (
    DuplicateSequence,
    EmptyPrompt,
    FinishReason,
    IterationPhase,
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
cdef object _PHASES = (IterationPhase.PREFILL, IterationPhase.RECOMPUTE, IterationPhase.DECODE)
cdef object _STATUSES = tuple(SequenceStatus)
# skippy_end_reason -> FinishReason, by value.
cdef object _END_REASONS = (FinishReason.STOP, FinishReason.LENGTH, FinishReason.FAILED,
                            FinishReason.CANCELLED)
if [SKIPPY_END_STOP, SKIPPY_END_LENGTH, SKIPPY_END_FAILED, SKIPPY_END_CANCELLED] != [0, 1, 2, 3]:
    raise ImportError("FinishReason does not match the compiled skippy_end_reason")
cdef object _SAMPLING_CTYPE = _ffi.typeof("skippy_sampling_config *")
cdef uint64_t _U64_MAX = 0xFFFFFFFFFFFFFFFF

cdef object _telemetry(const skippy_iteration_telemetry *t, list used, list available,
                       list finished, list failed, dict reasons, tuple keeps):
    # NOTE: positional, in IterationTelemetry's field order (test_telemetry_fields_follow_the_core
    # fails when a field is added to one side only).
    return IterationTelemetry(
        t.iteration, t.active_sequences, t.waiting_sequences, t.admitted, t.preempted,
        t.prefill_tokens, t.recompute_tokens, t.decode_tokens, used, available,
        t.prefix_hits, t.prefix_misses, t.finished, t.failed, t.cancelled,
        t.rejected_overload, finished, failed, t.stale_refreshes, reasons, keeps)


include "_core_plan.pxi"
include "_core_slots.pxi"
include "_core_config.pxi"


cdef class _Native:
    """Owns the native scheduler: freed when the last holder goes (the Scheduler, and any
    numpy view of its plan memory still kept)."""
    cdef skippy_scheduler *s

    def __dealloc__(self):
        if self.s != NULL:
            skippy_scheduler_free(self.s)
            self.s = NULL


cdef class Scheduler:
    """Scheduler(config=None, admission=None, preemption=None)
--

    Iteration-level scheduler with native state (behaviour.md §1–§2).

    The defaults are the reference config and policies: cache-aware admission (§3) and
    lowest-priority-newest preemption (§2.8).
    """
    cdef skippy_scheduler *_s
    cdef _Native _native                   # owns _s (freed when the last holder goes)
    cdef bint _in_policy                   # a policy callback is running (_core_slots.pxi)
    cdef dict _buffers                     # plan buffer address -> _PlanBuffer
    cdef uint64_t _last_serial             # serial of the last plan made
    cdef object _config
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
    cdef object _step_cost                 # the slack rule's cost model (a StepCost)

    def __cinit__(self, config=None, admission=None, preemption=None):
        self._s = NULL

    def __init__(self, config=None, admission=None, preemption=None):
        cdef skippy_scheduler_config c
        cdef skippy_error *err = NULL
        cdef skippy_status status
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
        admission = admission.resolved(cfg)  # (subclasses keep their type)
        cdef list keep = []
        fair = _native_config(&c, cfg, admission, preemption, keep)
        comps = cfg.memory_components
        if self._s != NULL:
            raise RuntimeError("Scheduler.__init__ called twice")
        self._native = _Native.__new__(_Native)
        status = skippy_scheduler_create(&c, &self._native.s, &err)
        if status != SKIPPY_STATUS_OK:
            msg = err.message.decode("utf-8", "replace") if err != NULL else "scheduler creation failed"
            skippy_scheduler_error_free(err)
            if status == SKIPPY_STATUS_INVALID_ARGUMENT:  # a setting the core refuses
                raise ValueError(msg)
            raise MemoryError(msg)
        self._s = self._native.s
        skippy_scheduler_set_callbacks(self._s, _rank_trampoline, _victim_trampoline, <void *>self)
        self._config = cfg
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
        self._step_cost = cfg.step_cost
        if fair:
            counters = admission.counters
            # None is tenant 0, the id a sequence without a tenant gets (as in C).
            self._tenant_id(None)
            for tenant, weight in counters.weights.items():
                self._set_weight(self._tenant_id(tenant), weight)
            self._default_weight = counters.default_weight
            if self._default_weight != 1.0 and None not in counters.weights:
                self._set_weight(0, self._default_weight)

    # (No __dealloc__: `_native` frees the native scheduler when its last holder goes, this
    # object or a kept view of plan memory. Nothing calls into the native scheduler after this
    # object is gone, so its policy callbacks, which point here, are never called again.)

    def __repr__(self):
        if self._s == NULL:
            return "Scheduler(<not initialised>)"
        snap = self.snapshot()
        return (f"Scheduler(active={len(snap.active_ids)}, waiting={len(snap.waiting_ids)}, "
                f"live_plans={self.live_plans}, admission={type(self.admission).__name__}, "
                f"preemption={type(self.preemption).__name__})")

    cdef int _changing(self) except -1:
        """Refuse a call that changes the scheduler from inside its own policy callback (the
        core is between two states there: such a call would lose or duplicate sequences)."""
        if self._in_policy:
            raise RuntimeError("the scheduler cannot be changed from inside its admission or "
                               "preemption policy (the policy only orders or picks)")
        return 0

    # -- prefix store (§2.12) -----------------------------------------------------------------

    def attach_prefix_store(self, store, *, prefill_cost_per_token=1, restore_cost_per_token=0):
        """Read every waiting sequence's prefix restore and saved cost from `store` (a
        `PrefixStore`, or None to detach): at submit, and again before each admission selection
        for the sequences under a prefix inserted or evicted since (stale refresh, counted in
        `metrics().stale_refreshes`). The entry a sequence is admitted with stays pinned while
        it is active. Only while the scheduler holds no sequence; submitted sequences must then
        carry no prefix restore or affinity (the store decides)."""
        self._changing()
        cdef NativePrefixStore native = None
        cdef uint64_t prefill = check_u64("prefill_cost_per_token", prefill_cost_per_token)
        cdef uint64_t restore = check_u64("restore_cost_per_token", restore_cost_per_token)
        if store is not None:
            from .prefix_store import PrefixStore  # (that module imports this one)
            given = store.native_store if isinstance(store, PrefixStore) else store
            if not isinstance(given, NativePrefixStore):  # checked before Cython converts it
                raise TypeError("store must be a PrefixStore (native), got "
                                f"{type(store).__name__}")
            native = given
            # A twin scheduler records its store's owner on the store (the core, its own).
            owner = getattr(store, "owner", None)
            if owner is not None and owner() is not None:
                raise ValueError("the prefix store serves another scheduler")
        if skippy_scheduler_set_prefix_store(self._s, native._p if native is not None else NULL,
                                             prefill, restore, NULL) != SKIPPY_STATUS_OK:
            self._raise_last()
        self._store = store
        self._aff_costs = (prefill, restore)

    @property
    def config(self):
        """The config in use (normalized), as a copy: changing it changes nothing here (the
        core took its values when it was made)."""
        return self._config.replace()

    @property
    def prefix_store(self):
        """The attached `PrefixStore`, or None."""
        return self._store

    cdef int _raise_last(self, object seq_id=None) except -1:
        cdef skippy_sched_code code = skippy_scheduler_last_code(self._s)
        msg = skippy_scheduler_last_message(self._s).decode("utf-8", "replace")
        if code == SKIPPY_SCHED_QUEUE_FULL:
            raise QueueFull(self._config.max_waiting_sequences)
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
        self._changing()
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
                try:
                    session_addr = session
                except OverflowError:
                    raise ValueError(f"session must be an address (a size_t), got {session:#x}"
                                     ) from None
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
        d.itl_target_us = q.itl_target * 1e6 if q.itl_target is not None else 0.0
        d.ttft_deadline_us = q.ttft_deadline * 1e6 if q.ttft_deadline is not None else 0.0
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
        self._changing()
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
            b = _plan_buffer(p, self._native)
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
        # The victims' ids, read now: the core keeps them only until the next plan.
        plan.priority_victims = self._priority_victims() if p.preempted else ()
        plan._rows = p.request_count
        plan._samples = p.sample_count
        self._last_serial = p.serial
        if self._config.max_inflight_plans > 1:
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
        self._changing()
        self._own_live(plan)
        if isinstance(elapsed, bool) or not isinstance(elapsed, numbers.Real):
            raise TypeError(f"elapsed must be seconds as a float, got {type(elapsed).__name__}")
        try:
            seconds = float(elapsed)
        except OverflowError:  # an int past float's range: infinite, ignored like inf
            seconds = float("inf")
        if skippy_scheduler_observe(self._s, (<IterationPlan>plan).serial, seconds * 1e6,
                                    NULL) != SKIPPY_STATUS_OK:
            self._raise_last()

    def abort_iteration(self, plan):
        """Undo `plan` and every later live plan, for a runtime that could not run them: each
        sequence in them returns to the cursor and tokens it had before (§2.11)."""
        self._changing()
        self._own_live(plan)
        if skippy_scheduler_abort(self._s, (<IterationPlan>plan).serial, NULL) != SKIPPY_STATUS_OK:
            self._raise_last()

    def complete_iteration(self, plan):
        """Apply the sampled outputs the host wrote into `plan.outputs`; plans complete in the
        order they were made (PlanInFlight otherwise)."""
        self._changing()
        cdef skippy_iteration_telemetry t
        cdef size_t n_before, n_after, i
        cdef const skippy_retired *ret
        cdef skippy_plan *p
        cdef uint64_t oldest
        self._own_live(plan)
        p = (<IterationPlan>plan)._p
        oldest = skippy_scheduler_oldest_plan(self._s)
        if (<IterationPlan>plan).serial != oldest:
            raise PlanInFlight(f"plan step {(<IterationPlan>plan).step} completed before an "
                               "older live plan: complete plans in the order they were made")
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
                          reasons, self._prompt_keeps())

    cdef list _used_list(self):
        cdef size_t n, i
        cdef const uint64_t *u = skippy_scheduler_component_used(self._s, &n)
        return [(self._comp_names[i], u[i]) for i in range(n)]

    # -- pressure, cancel, inspection -------------------------------------------------------

    def preempt_for_component_pressure(self, used_bytes):
        """Overwrite used bytes with measured values and preempt until every component fits."""
        self._changing()
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

    cdef tuple _priority_victims(self):
        """Ids the plan just made preempted for priority (§2.8a), in the order chosen (the
        plan's `priority_victims`)."""
        cdef size_t n = 0, i
        cdef const uint32_t *v_slots = skippy_scheduler_priority_victims(self._s, &n)
        return tuple([_carried(self._objects, v_slots[i]).sequence_id for i in range(n)])

    cdef tuple _prompt_keeps(self):
        """Cold prefix hold (§2.3a): (id, prompt length) of each leader held on that has
        confirmed a token since its admission (its prompt is computed), in walk order, each once
        (the telemetry's `prompt_keeps`); the core walks
        nothing unless a leader is marked and not yet reported."""
        cdef uint32_t buf[64]
        cdef size_t n, i
        cdef skippy_sequence_info info
        n = skippy_scheduler_take_prompt_keeps(self._s, buf, 64)
        if n == 0:
            return ()
        out = []
        while True:
            for i in range(n):
                skippy_scheduler_sequence(self._s, buf[i], &info)
                out.append((_carried(self._objects, buf[i]).sequence_id, info.prompt_count))
            if n < 64:
                return tuple(out)
            n = skippy_scheduler_take_prompt_keeps(self._s, buf, 64)

    def cancel(self, sequence_id):
        """Remove a waiting or active sequence; False when the id is unknown."""
        self._changing()
        b = check_id("sequence_id", sequence_id).encode("utf-8")
        if skippy_scheduler_cancel(self._s, b, len(b)):
            return True
        if skippy_scheduler_last_code(self._s) != SKIPPY_SCHED_OK:  # not only an unknown id
            self._raise_last()
        return False

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
        b = check_id("sequence_id", sequence_id).encode("utf-8")
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
            enqueue_order=info.enqueue_order, tenant=o.tenant,
            ttft_deadline=o.ttft_deadline, itl_target=o.itl_target)

    def metrics(self):
        """A new `SchedulerMetrics` with the cumulative counters (changing it changes nothing
        here; call again for fresh values)."""
        if self._s == NULL:
            raise ValueError("scheduler is NULL")
        cdef const skippy_scheduler_metrics *m = skippy_scheduler_get_metrics(self._s)
        return SchedulerMetrics(
            m.iterations, m.admitted, m.preempted, m.finished, m.failed, m.cancelled,
            m.rejected_overload, m.prefill_tokens, m.recompute_tokens, m.decode_tokens,
            m.prefix_hits, m.prefix_misses, m.active_sequences, m.waiting_sequences,
            m.discarded_rows, m.aborted_plans, m.restored_tokens, m.stale_refreshes,
            m.preempted_priority, m.slo_relegated)

    @property
    def waiting_turn(self):
        """The queue turn new submits are stamped with; each plan advances it (int)."""
        return skippy_scheduler_waiting_turn(self._s)

    # -- the slack rule's inputs (§2.13) -----------------------------------------------------

    def set_clock(self, now):
        """The time now (seconds, any monotonic origin): read by the next plan, and stamped on
        the sequences the next completion gives a token. Set it before both."""
        self._changing()
        skippy_scheduler_set_clock(self._s, check_clock(now) * 1e6)

    def set_step_cost(self, cost):
        """The slack rule's cost model from now on (the engine refits it online)."""
        self._changing()
        cdef skippy_step_cost c
        _step_cost(&c, check_step_cost("cost", cost))
        if skippy_scheduler_set_step_cost(self._s, &c, NULL) != SKIPPY_STATUS_OK:
            self._raise_last()
        self._step_cost = cost

    @property
    def step_cost(self):
        return self._step_cost

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
        self._changing()
        if not self._fair:
            raise ValueError("tenant weights apply to the native fair-share admission only")
        weight = VirtualTokenCounters.check_weight("weight", weight)
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



include "_core_store.pxi"
