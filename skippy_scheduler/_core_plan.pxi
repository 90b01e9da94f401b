# Included by _core.pyx: one plan's face. `_PlanBuffer` keeps numpy views over a native plan
# buffer (rebuilt only when the core reallocates it), `IterationPlan` is the plan a caller gets,
# and `PlanOutputs` the sampled-output block a host writes into. No Python object per row.

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
    cdef object owner  # the _Native whose memory the views show (they keep it alive)
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
            self.bases[_A_TOK] = _view(self.owner, p.tokens, p.token_capacity, np.int32)
            self.bases[_A_POS] = _view(self.owner, p.positions, p.token_capacity, np.int32)
            self.slice_n[_A_TOK] = SIZE_MAX
            self.slice_n[_A_POS] = SIZE_MAX
        if p.request_capacity != self.row_cap:
            self.row_cap = p.request_capacity
            n = p.request_capacity
            self.bases[_A_OFF] = _view(self.owner, p.row_offsets, n + 1, np.uintp)
            self.bases[_A_SAMPLE] = _view(self.owner, p.sample_last, n, np.uint8)
            self.bases[_A_PHASE] = _view(self.owner, p.phases, n, np.uint8)
            self.bases[_A_SLOT] = _view(self.owner, p.slots, n, np.uint32)
            self.bases[_A_SROWS] = _view(self.owner, p.sample_rows, n, np.uintp)
            self.bases[_A_OIDX] = _view(self.owner, p.outputs.sampled_request_indexes, n, np.uintp)
            self.bases[_A_OTOK] = _view(self.owner, p.outputs.predicted_tokens, n, np.int32)
            self.bases[_A_NEW] = _view(self.owner, p.new_rows, n, np.uint8)
            self.bases[_A_REST] = _view(self.owner, p.restored_tokens, n, np.uintp)
            for i in range(_A_OFF, _A_DROW):
                self.slice_n[i] = SIZE_MAX
            self.slice_n[_A_NEW] = self.slice_n[_A_REST] = SIZE_MAX
        if p.deferred.capacity != self.deferred_cap:
            self.deferred_cap = n = p.deferred.capacity
            self.bases[_A_DROW] = _view(self.owner, p.deferred.rows, n, np.uintp)
            self.bases[_A_DSTEP] = _view(self.owner, p.deferred.source_steps, n, np.uint64)
            self.bases[_A_DIDX] = _view(self.owner, p.deferred.source_indexes, n, np.uintp)
            for i in range(_A_DROW, _A_COUNT):
                self.slice_n[i] = SIZE_MAX

    cdef object slice(self, int a, size_t n):
        """The first n entries of plan array `a`: the cached slice when n did not change."""
        if self.slice_n[a] != n:
            self.slices[a] = self.bases[a][:n]
            self.slice_n[a] = n
        return self.slices[a]


cdef _PlanBuffer _plan_buffer(skippy_plan *p, object owner):
    cdef _PlanBuffer b = _PlanBuffer.__new__(_PlanBuffer)
    cdef int i
    b.p = p
    b.owner = owner
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


cdef class _NativeMemory:
    """Native memory lent to numpy: an array over it keeps this object, and so the memory's
    owner (the native scheduler), alive: an array kept after its plan, or after its Scheduler
    is gone, still reads and writes memory that exists (though no longer a live plan's:
    docs/hosts.md); the core keeps a plan array's old block when the array grows."""
    cdef object owner
    cdef char *data
    cdef Py_ssize_t nbytes

    def __getbuffer__(self, Py_buffer *buffer, int flags):
        PyBuffer_FillInfo(buffer, self, self.data, self.nbytes, 0, flags)

    def __releasebuffer__(self, Py_buffer *buffer):
        pass


cdef object _view(object owner, void *data, size_t count, object dtype):
    """A writable numpy array over `count` elements of native memory (no copy) that keeps
    `owner` alive."""
    if count == 0 or data == NULL:
        return np.zeros(0, dtype=dtype)
    cdef _NativeMemory memory = _NativeMemory.__new__(_NativeMemory)
    memory.owner = owner
    memory.data = <char *>data
    memory.nbytes = count * np.dtype(dtype).itemsize
    return np.frombuffer(memory, dtype=dtype)


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

    def __init__(self, *args, **kwargs):
        raise TypeError("PlanOutputs is made by Scheduler.plan_iteration (plan.outputs)")

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
    `preempted`, `priority_victims`, `step` and `len()` stay readable afterwards; `work` and
    `sequence_ids` too once they have been built.

    `priority_victims` is the tuple of ids this plan's admission preempted for priority
    (§2.8a), in the order chosen (`preempted` of them): the host releases their runtime state
    before it runs the plan.
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
    cdef readonly tuple priority_victims
    cdef size_t _rows
    cdef size_t _samples
    cdef object _work
    cdef object _ids
    cdef PlanOutputs _outputs

    def __init__(self, *args, **kwargs):
        raise TypeError("IterationPlan is made by Scheduler.plan_iteration")

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
        """uint8 array of `len(plan)` row kinds, the values of `IterationPhase` (0 PREFILL,
        1 RECOMPUTE, 2 DECODE)."""
        self._check()
        return self._b.slice(_A_PHASE, self._rows)

    @property
    def slots(self):
        """uint32 array of `len(plan)` scheduler slots, the native handle of each row's
        sequence (`sequence_ids` gives the ids)."""
        self._check()
        return self._b.slice(_A_SLOT, self._rows)

    @property
    def prefill_positions(self):
        """Sum of the positions of the prefill and recompute tokens (int): the context their
        attention reads, the term of `StepCost.per_prefill_position_us` (§2.13)."""
        cdef skippy_plan *p
        cdef size_t r, n, a
        cdef unsigned long long total = 0
        self._check()
        p = self._p
        for r in range(self._rows):
            if p.phases[r] == SKIPPY_PHASE_DECODE:
                continue
            a = p.row_offsets[r]
            n = p.row_offsets[r + 1] - a
            if n:
                total += <unsigned long long>n * <unsigned long long>p.positions[a] + \
                    <unsigned long long>(n * (n - 1) // 2)
        return total

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

    def fill_deferred(self, IterationPlan source not None):
        """Write, in C, every deferred input token of this plan that `source` sampled (the
        entries whose source step is `source.step`) from `source`'s output block: the token,
        or 0 where the output is the end signal or missing (that row's output is discarded,
        as `inflight.resolve_deferred` says). Returns how many entries it wrote; raises
        MalformedOutputs, writing nothing, when an output names a row outside `source`."""
        cdef skippy_plan *p
        cdef skippy_plan *q
        cdef size_t j, k, n, rows, written = 0
        cdef int32_t t
        cdef int32_t *sampled
        self._check()
        if source._s is not self._s:
            raise ValueError("the source plan belongs to another scheduler")
        p = self._p
        n = p.deferred.count
        for j in range(n):
            if p.deferred.source_steps[j] == source.step:
                break
        else:
            return 0  # nothing comes from it (it need not be live)
        source._check()
        q = source._p
        rows = source._rows
        if q.outputs.count > rows:  # (a runtime may leave a count it could not fit)
            raise MalformedOutputs(f"{q.outputs.count} sampled outputs for a plan of {rows} "
                                   "rows")
        sampled = <int32_t *> PyMem_Malloc((rows if rows else 1) * sizeof(int32_t))
        if sampled == NULL:
            raise MemoryError()
        try:
            for k in range(rows):
                sampled[k] = 0
            for k in range(q.outputs.count):
                j = q.outputs.sampled_request_indexes[k]
                t = q.outputs.predicted_tokens[k]
                if j >= rows:
                    raise MalformedOutputs(f"output names work index {j}, the plan has "
                                           f"{rows} rows")
                if t > 0:
                    sampled[j] = t
            for j in range(n):
                if p.deferred.source_steps[j] != q.step:
                    continue
                k = p.deferred.source_indexes[j]
                p.tokens[p.row_offsets[p.deferred.rows[j]]] = sampled[k] if k < rows else 0
                written += 1
        finally:
            PyMem_Free(sampled)
        return written

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
