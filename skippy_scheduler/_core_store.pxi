# Included by _core.pyx: `NativePrefixStore`, the Python face of the C prefix store, and the
# struct layout the ABI test compares across C, cffi and Cython.

def _layout():
    """Sizes and field offsets of the shared structs as this compiled module sees them."""
    cdef skippy_iteration_request r
    cdef skippy_plan p
    cdef skippy_plan_outputs o
    cdef skippy_deferred_inputs d
    cdef skippy_retired t
    cdef skippy_step_cost c
    cdef skippy_scheduler_config g
    cdef size_t gb = <size_t>&g
    cdef size_t rb = <size_t>&r, pb = <size_t>&p, ob = <size_t>&o, db = <size_t>&d
    cdef size_t tb = <size_t>&t, cb = <size_t>&c
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
        "skippy_step_cost": (sizeof(skippy_step_cost), {
            "base_us": <size_t>&c.base_us - cb,
            "per_prefill_token_us": <size_t>&c.per_prefill_token_us - cb,
            "decode_base_us": <size_t>&c.decode_base_us - cb,
            "per_decode_row_us": <size_t>&c.per_decode_row_us - cb,
            "per_prefill_row_us": <size_t>&c.per_prefill_row_us - cb,
            "per_prefill_position_us": <size_t>&c.per_prefill_position_us - cb}),
        # the fields appended last (the rest keep the layout they had)
        "skippy_scheduler_config": (sizeof(skippy_scheduler_config), {
            "planning_rule": <size_t>&g.planning_rule - gb,
            "step_cost": <size_t>&g.step_cost - gb,
            "disjoint_inflight_plans": <size_t>&g.disjoint_inflight_plans - gb,
            "cold_prefix_hold_tokens": <size_t>&g.cold_prefix_hold_tokens - gb,
            "cold_prefix_hold_max_steps": <size_t>&g.cold_prefix_hold_max_steps - gb,
            "slack_prefill_age_max_us": <size_t>&g.slack_prefill_age_max_us - gb,
            "slack_first_token_hold": <size_t>&g.slack_first_token_hold - gb}),
    }


cdef class NativePrefixStore:
    """NativePrefixStore(capacity_tokens=None, holder_slots=None, first_holder_id=0)
--

    The C prefix store (csrc/sk_prefix.c, behaviour.md §8c); `skippy_scheduler.PrefixStore`
    is its Python face. Entries are small integer ids, reused after eviction; -1 = none."""
    cdef skippy_prefix_store *_p

    @property
    def attached(self):
        """Whether a native scheduler serves from this store now (one at a time)."""
        return self._p != NULL and sk_prefix_owner(self._p) != NULL

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
