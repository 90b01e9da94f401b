# Cython view of abi/skippy_scheduler.h (declarations in abi/skippy_scheduler_decls.h): the C
# interface of the scheduler core. Only what the extension modules use is declared.
from libc.stdint cimport int32_t, uint32_t, uint64_t
from libcpp cimport bool as cbool

from ._skippy_abi cimport (
    skippy_error,
    skippy_plan,
    skippy_sampling_config,
    skippy_session,
    skippy_status,
    skippy_version,
)

cdef extern from "skippy_scheduler.h" nogil:
    ctypedef enum skippy_sched_code:
        SKIPPY_SCHED_OK
        SKIPPY_SCHED_QUEUE_FULL
        SKIPPY_SCHED_DUPLICATE
        SKIPPY_SCHED_EMPTY_PROMPT
        SKIPPY_SCHED_INVALID
        SKIPPY_SCHED_STALE_PLAN
        SKIPPY_SCHED_BAD_OUTPUTS
        SKIPPY_SCHED_NO_MEMORY
        SKIPPY_SCHED_CALLBACK
        SKIPPY_SCHED_PLAN_IN_FLIGHT

    ctypedef enum skippy_seq_status:
        SKIPPY_SEQ_FINISHED
        SKIPPY_SEQ_FAILED
        SKIPPY_SEQ_CANCELLED

    ctypedef enum skippy_admission_policy:
        SKIPPY_ADMISSION_CACHE_AWARE
        SKIPPY_ADMISSION_FCFS
        SKIPPY_ADMISSION_PRIORITY
        SKIPPY_ADMISSION_CALLBACK
        SKIPPY_ADMISSION_FAIR_SHARE

    ctypedef enum skippy_preemption_policy:
        SKIPPY_PREEMPT_LOWEST_PRIORITY_NEWEST
        SKIPPY_PREEMPT_FEWEST_COMPUTED
        SKIPPY_PREEMPT_CALLBACK

    ctypedef struct skippy_memory_component:
        const char *name
        uint64_t capacity_bytes
        uint64_t resident_bytes
        uint64_t bytes_per_token
        uint64_t bytes_per_sequence

    ctypedef struct skippy_step_cost:
        double base_us
        double per_prefill_token_us
        double decode_base_us
        double per_decode_row_us
        double per_prefill_row_us
        double per_prefill_position_us

    ctypedef struct skippy_scheduler_config:
        size_t max_active_sequences
        size_t sequence_id_limit
        size_t reserved_sequence_ids
        size_t max_waiting_sequences
        size_t max_tokens_per_iteration
        size_t prefill_chunk_tokens
        size_t max_prefill_sequences_per_iteration
        size_t max_consecutive_prefill_iterations
        uint64_t cache_aging_cost_per_iteration
        cbool mixed_prefill_decode
        cbool group_waiting_prefixes
        uint32_t admission_policy
        uint32_t preemption_policy
        const skippy_memory_component *memory_components
        size_t memory_component_count
        size_t max_inflight_plans
        double fair_prefill_cost
        double fair_decode_cost
        bint priority_preemption
        size_t priority_preemption_guard_steps
        size_t max_priority_preemptions_per_step
        uint32_t planning_rule
        double itl_target_us
        double slack_safety
        size_t slack_interleave_max
        size_t slack_min_chunk_tokens
        skippy_step_cost step_cost
        bint disjoint_inflight_plans
        size_t cold_prefix_hold_tokens
        size_t cold_prefix_hold_max_steps
        double slack_prefill_age_max_us
        bint slack_first_token_hold

    ctypedef struct skippy_sequence_desc:
        const char *id
        size_t id_len
        const int32_t *prompt_tokens
        size_t prompt_count
        const int32_t *generated_tokens
        size_t generated_count
        uint32_t max_tokens
        uint64_t priority
        size_t admission_tokens
        uint32_t status
        size_t prefill_cursor
        cbool has_prefix_restore
        size_t restore_token_count
        uint64_t saved_cost
        const skippy_sampling_config *sampling
        skippy_session *session
        uint32_t tenant
        double itl_target_us
        double ttft_deadline_us

    ctypedef struct skippy_sequence_info:
        const char *id
        size_t id_len
        const int32_t *tokens
        size_t prompt_count
        size_t generated_count
        uint32_t max_tokens
        uint64_t priority
        size_t admission_tokens
        uint32_t status
        size_t prefill_cursor
        cbool has_prefix_restore
        size_t restore_token_count
        uint64_t enqueued_turn
        uint64_t enqueue_order
        uint64_t admitted_at
        uint64_t saved_cost
        const skippy_sampling_config *sampling
        skippy_session *session
        uint32_t restore_entry
        uint32_t restore_holder
        uint64_t cache_epoch
        uint32_t tenant
        double itl_target_us
        double ttft_deadline_us
        double last_token_us

    ctypedef struct skippy_scheduler_metrics:
        uint64_t iterations
        uint64_t admitted
        uint64_t preempted
        uint64_t finished
        uint64_t failed
        uint64_t cancelled
        uint64_t rejected_overload
        uint64_t prefill_tokens
        uint64_t recompute_tokens
        uint64_t decode_tokens
        uint64_t prefix_hits
        uint64_t prefix_misses
        uint64_t active_sequences
        uint64_t waiting_sequences
        uint64_t discarded_rows
        uint64_t aborted_plans
        uint64_t restored_tokens
        uint64_t stale_refreshes
        uint64_t preempted_priority
        uint64_t slo_relegated

    ctypedef struct skippy_iteration_telemetry:
        uint64_t iteration
        uint64_t active_sequences
        uint64_t waiting_sequences
        uint64_t admitted
        uint64_t preempted
        uint64_t prefill_tokens
        uint64_t recompute_tokens
        uint64_t decode_tokens
        uint64_t prefix_hits
        uint64_t prefix_misses
        uint64_t finished
        uint64_t failed
        uint64_t cancelled
        uint64_t rejected_overload
        uint64_t stale_refreshes

    ctypedef enum skippy_end_reason:
        SKIPPY_END_STOP
        SKIPPY_END_LENGTH
        SKIPPY_END_FAILED
        SKIPPY_END_CANCELLED

    ctypedef struct skippy_retired:
        uint32_t slot
        uint32_t status
        uint32_t reason

    ctypedef struct skippy_scheduler:
        pass

    ctypedef int (*skippy_rank_callback)(void *ctx, const skippy_scheduler *scheduler,
                                         const uint32_t *waiting_slots, size_t count,
                                         uint64_t current_turn, size_t *out_order) noexcept
    ctypedef int (*skippy_victim_callback)(void *ctx, const skippy_scheduler *scheduler,
                                           const uint32_t *active_slots, size_t count,
                                           size_t *out_index) noexcept

    skippy_version skippy_scheduler_abi_version()
    uint32_t skippy_scheduler_plan_abi_version()
    void skippy_scheduler_error_free(skippy_error *error)
    void skippy_scheduler_config_default(skippy_scheduler_config *config)
    skippy_status skippy_scheduler_create(const skippy_scheduler_config *config,
                                          skippy_scheduler **out_scheduler, skippy_error **out_error)
    void skippy_scheduler_free(skippy_scheduler *scheduler)
    skippy_sched_code skippy_scheduler_last_code(const skippy_scheduler *scheduler)
    const char *skippy_scheduler_last_message(const skippy_scheduler *scheduler)
    void skippy_scheduler_set_callbacks(skippy_scheduler *scheduler, skippy_rank_callback rank,
                                        skippy_victim_callback victim, void *ctx)
    skippy_status skippy_scheduler_submit(skippy_scheduler *scheduler,
                                          const skippy_sequence_desc *desc, uint32_t *out_slot,
                                          skippy_error **out_error)
    skippy_status skippy_scheduler_plan(skippy_scheduler *scheduler, skippy_plan **out_plan,
                                        skippy_error **out_error)
    skippy_status skippy_scheduler_observe(skippy_scheduler *scheduler, uint64_t plan_serial,
                                           double elapsed_us, skippy_error **out_error)
    skippy_status skippy_scheduler_complete(skippy_scheduler *scheduler, uint64_t plan_serial,
                                            skippy_iteration_telemetry *out_telemetry,
                                            skippy_error **out_error)
    skippy_status skippy_scheduler_abort(skippy_scheduler *scheduler, uint64_t plan_serial,
                                         skippy_error **out_error)
    cbool skippy_scheduler_plan_live(const skippy_scheduler *scheduler, uint64_t plan_serial)
    size_t skippy_scheduler_live_plans(const skippy_scheduler *scheduler)
    uint64_t skippy_scheduler_oldest_plan(const skippy_scheduler *scheduler)
    skippy_status skippy_scheduler_preempt(skippy_scheduler *scheduler, const uint64_t *used_bytes,
                                           size_t used_count, size_t *out_preempted,
                                           skippy_error **out_error)
    const uint32_t *skippy_scheduler_preempted_slots(const skippy_scheduler *scheduler)
    const uint32_t *skippy_scheduler_priority_victims(const skippy_scheduler *scheduler,
                                                      size_t *out_count)
    size_t skippy_scheduler_take_prompt_keeps(skippy_scheduler *scheduler, uint32_t *out,
                                              size_t cap)
    cbool skippy_scheduler_cancel(skippy_scheduler *scheduler, const char *id, size_t id_len)
    uint32_t skippy_scheduler_find(const skippy_scheduler *scheduler, const char *id, size_t id_len)
    cbool skippy_scheduler_sequence(const skippy_scheduler *scheduler, uint32_t slot,
                                    skippy_sequence_info *out_info)
    const skippy_scheduler_metrics *skippy_scheduler_get_metrics(const skippy_scheduler *scheduler)
    const uint32_t *skippy_scheduler_active_slots(const skippy_scheduler *scheduler, size_t *out_count)
    const uint32_t *skippy_scheduler_waiting_slots(const skippy_scheduler *scheduler, size_t *out_count)
    const uint64_t *skippy_scheduler_component_used(const skippy_scheduler *scheduler, size_t *out_count)
    const skippy_retired *skippy_scheduler_retired(const skippy_scheduler *scheduler, size_t *out_count)
    uint64_t skippy_scheduler_waiting_turn(const skippy_scheduler *scheduler)
    cbool skippy_scheduler_mixed_viable(const skippy_scheduler *scheduler)
    void skippy_scheduler_set_clock(skippy_scheduler *scheduler, double now_us)
    skippy_status skippy_scheduler_set_step_cost(skippy_scheduler *scheduler,
                                                 const skippy_step_cost *cost,
                                                 skippy_error **out_error)

    # prefix store (docs/behaviour.md §8c)
    uint32_t SKIPPY_PREFIX_NONE

    ctypedef struct skippy_prefix_store:
        pass

    ctypedef struct skippy_prefix_store_config:
        uint64_t capacity_tokens
        size_t holder_slots
        uint32_t first_holder_id

    ctypedef struct skippy_prefix_entry_info:
        uint32_t parent
        uint32_t holder
        size_t start
        size_t length
        uint32_t pins
        uint32_t children
        uint64_t last_used
        uint64_t serial
        uint64_t handle
        const int32_t *segment

    ctypedef struct skippy_prefix_store_stats:
        uint64_t used_tokens
        uint64_t entries
        uint64_t inserts
        uint64_t evictions
        uint64_t evicted_tokens
        uint64_t refused_inserts
        uint64_t epoch

    ctypedef struct skippy_prefix_eviction:
        uint32_t entry
        uint32_t holder
        uint64_t handle
        size_t start
        size_t length

    void skippy_prefix_store_config_default(skippy_prefix_store_config *config)
    skippy_sched_code skippy_prefix_store_create(const skippy_prefix_store_config *config,
                                                 skippy_prefix_store **out_store)
    void skippy_prefix_store_free(skippy_prefix_store *store)
    const char *skippy_prefix_store_last_message(const skippy_prefix_store *store)
    uint32_t skippy_prefix_store_match(const skippy_prefix_store *store, const int32_t *tokens,
                                       size_t count, size_t *out_matched)
    uint32_t skippy_prefix_store_find(const skippy_prefix_store *store, const int32_t *tokens,
                                      size_t count)
    skippy_sched_code skippy_prefix_store_insert(skippy_prefix_store *store,
                                                 const int32_t *tokens, size_t count,
                                                 uint32_t parent, uint64_t handle,
                                                 uint32_t *out_entry)
    skippy_sched_code skippy_prefix_store_touch(skippy_prefix_store *store, uint32_t entry)
    skippy_sched_code skippy_prefix_store_pin(skippy_prefix_store *store, uint32_t entry)
    skippy_sched_code skippy_prefix_store_unpin(skippy_prefix_store *store, uint32_t entry)
    uint32_t skippy_prefix_store_evict_one(skippy_prefix_store *store)
    const skippy_prefix_eviction *skippy_prefix_store_evicted(const skippy_prefix_store *store,
                                                              size_t *out_count)
    cbool skippy_prefix_store_entry(const skippy_prefix_store *store, uint32_t entry,
                                    skippy_prefix_entry_info *out_info)
    cbool skippy_prefix_store_key(const skippy_prefix_store *store, uint32_t entry, int32_t *dst)
    void skippy_prefix_store_get_stats(const skippy_prefix_store *store,
                                       skippy_prefix_store_stats *out_stats)
    size_t skippy_prefix_store_lru_order(const skippy_prefix_store *store, uint32_t *out)
    skippy_status skippy_scheduler_set_prefix_store(skippy_scheduler *scheduler,
                                                    skippy_prefix_store *store,
                                                    uint64_t prefill_cost_per_token,
                                                    uint64_t restore_cost_per_token,
                                                    skippy_error **out_error)
    skippy_prefix_store *skippy_scheduler_prefix_store(const skippy_scheduler *scheduler)
    skippy_status skippy_scheduler_set_tenant_weight(skippy_scheduler *scheduler, uint32_t tenant,
                                                     double weight, skippy_error **out_error)
    double skippy_scheduler_tenant_counter(const skippy_scheduler *scheduler, uint32_t tenant)
    uint64_t skippy_scheduler_fair_share_lifts(const skippy_scheduler *scheduler)
