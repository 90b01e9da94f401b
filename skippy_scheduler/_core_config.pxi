# Included by _core.pyx: the C config a Scheduler is made with, from a normalized
# SchedulerConfig and resolved policies.


cdef bint _native_config(skippy_scheduler_config *c, object cfg, object admission,
                         object preemption, list keep) except? True:
    """Fill `c` (the core's config) and return whether the core runs fair share itself. Only
    the built-in policy classes themselves run in C: a subclass may override their methods.
    `keep` holds the cffi memory `c` points into until the core has copied it."""
    skippy_scheduler_config_default(c)
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
    raw = _ffi.new("skippy_memory_component[]", max(len(comps), 1))
    keep.append(raw)
    for i, m in enumerate(comps):
        name = _ffi.new("char[]", m.name.encode("utf-8"))
        keep.append(name)
        raw[i].name = name
        raw[i].capacity_bytes = m.capacity_bytes
        raw[i].resident_bytes = m.resident_bytes
        raw[i].bytes_per_token = m.bytes_per_token
        raw[i].bytes_per_sequence = m.bytes_per_sequence
    c.memory_components = <const skippy_memory_component *><size_t>int(_ffi.cast("uintptr_t", raw))
    c.memory_component_count = len(comps)
    c.max_inflight_plans = cfg.max_inflight_plans
    c.priority_preemption = cfg.priority_preemption
    c.priority_preemption_guard_steps = cfg.priority_preemption_guard_steps
    c.max_priority_preemptions_per_step = cfg.max_priority_preemptions_per_step
    c.planning_rule = cfg.planning_rule.value
    c.itl_target_us = cfg.itl_target * 1e6
    c.slack_safety = cfg.slack_safety
    c.slack_interleave_max = cfg.slack_interleave_max
    c.slack_min_chunk_tokens = cfg.slack_min_chunk_tokens
    _step_cost(&c.step_cost, cfg.step_cost)
    c.disjoint_inflight_plans = cfg.disjoint_inflight_plans
    c.cold_prefix_hold_tokens = cfg.cold_prefix_hold_tokens
    c.cold_prefix_hold_max_steps = cfg.cold_prefix_hold_max_steps
    c.slack_prefill_age_max_us = cfg.slack_prefill_age_max * 1e6
    c.slack_first_token_hold = cfg.slack_first_token_hold
    return fair


cdef void _step_cost(skippy_step_cost *out, object cost):
    out.base_us = cost.base_us
    out.per_prefill_token_us = cost.per_prefill_token_us
    out.decode_base_us = cost.decode_base_us
    out.per_decode_row_us = cost.per_decode_row_us
    out.per_prefill_row_us = cost.per_prefill_row_us
    out.per_prefill_position_us = cost.per_prefill_position_us
