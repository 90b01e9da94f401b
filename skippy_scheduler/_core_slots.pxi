# Included by _core.pyx: the Python objects a slot's sequence carries (ids, restores, sampling
# objects, tenants) and the slow-path policy callbacks the C core calls with the GIL.

cdef object _SEQ_FIELDS = Sequence.__slots__


cdef class _SlotObjects:
    """The Python objects of a slot's sequence that the core does not hold, only carries."""
    cdef object sequence_id
    cdef object prefix_restore
    cdef object cache_affinity
    cdef object sampling
    cdef object tenant  # the sequence's own `tenant` field, for snapshots and Python policies
    cdef object prompt  # the prompt as a tuple, built the first time a Python policy ranks it
    cdef object ttft_deadline  # the sequence's own deadlines (seconds), for snapshots
    cdef object itl_target


cdef _SlotObjects _slot_objects(object seq):
    cdef _SlotObjects o = _SlotObjects.__new__(_SlotObjects)
    o.sequence_id = seq.id
    o.prefix_restore = seq.prefix_restore
    o.cache_affinity = seq.cache_affinity
    o.sampling = seq.sampling
    o.tenant = seq.tenant
    o.ttft_deadline = seq.ttft_deadline
    o.itl_target = seq.itl_target
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
                order=info.enqueue_order, tenant=o.tenant, ttft_deadline=o.ttft_deadline))
        self._in_policy = True
        try:
            order = self.admission.order(candidates, turn)
        finally:
            self._in_policy = False
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
        self._in_policy = True
        try:
            choice = self.preemption.select_victim(candidates)
        finally:
            self._in_policy = False
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
