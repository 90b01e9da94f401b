/*
 * Lifecycle, configuration and read-only accessors of the scheduler. The decisions are
 * elsewhere: admission in sk_admit.c, completion, preemption and cancel in sk_sched.c, planning
 * in sk_plan.c (plans in flight and abort in sk_live.c), and failure reporting in sk_error.c.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "sk_internal.h"
#include "sk_prefix.h"
#include "sk_fair.h"

void skippy_scheduler_config_default(skippy_scheduler_config *c)
{
    if (!c) return;
    memset(c, 0, sizeof *c);
    c->max_active_sequences = 32;
    c->sequence_id_limit = 256;
    c->reserved_sequence_ids = 16;
    c->max_waiting_sequences = 256;
    c->max_tokens_per_iteration = 2048;
    c->prefill_chunk_tokens = 256;
    c->max_prefill_sequences_per_iteration = SIZE_MAX;
    c->max_consecutive_prefill_iterations = SIZE_MAX;
    c->cache_aging_cost_per_iteration = 4096;
    c->mixed_prefill_decode = false;
    c->group_waiting_prefixes = true;
    c->admission_policy = SKIPPY_ADMISSION_CACHE_AWARE;
    c->preemption_policy = SKIPPY_PREEMPT_LOWEST_PRIORITY_NEWEST;
    c->max_inflight_plans = 1;
    c->fair_prefill_cost = 1.0;
    c->fair_decode_cost = 2.0;
    c->priority_preemption = false;
    c->priority_preemption_guard_steps = 8;
    c->max_priority_preemptions_per_step = 4;
    c->planning_rule = SKIPPY_PLANNING_REFERENCE;
    c->itl_target_us = 100000.0;
    c->slack_safety = 1.2;
    c->slack_interleave_max = 4;
    c->slack_min_chunk_tokens = 32;
    c->step_cost.base_us = 8000.0;
    c->step_cost.per_prefill_token_us = 600.0;
    c->step_cost.decode_base_us = 0.0;
    c->step_cost.per_decode_row_us = 700.0;
    c->step_cost.per_prefill_row_us = 0.0;
    c->step_cost.per_prefill_position_us = 0.0;
    c->disjoint_inflight_plans = false;
    c->cold_prefix_hold_tokens = 0;
    c->cold_prefix_hold_max_steps = 64;
    c->slack_prefill_age_max_us = 2000000.0;
    c->slack_first_token_hold = false;
}

static size_t clamp_sz(size_t v, size_t lo, size_t hi) { return v < lo ? lo : (v > hi ? hi : v); }

void skippy_scheduler_config_normalize(skippy_scheduler_config *c)
{
    if (!c) return;
    if (c->sequence_id_limit < 1) c->sequence_id_limit = 1;
    size_t hard = c->sequence_id_limit > c->reserved_sequence_ids
                      ? c->sequence_id_limit - c->reserved_sequence_ids : 0;
    if (hard < 1) hard = 1;
    c->max_active_sequences = clamp_sz(c->max_active_sequences, 1, hard);
    if (c->max_waiting_sequences < 1) c->max_waiting_sequences = 1;
    if (c->max_tokens_per_iteration < 1) c->max_tokens_per_iteration = 1;
    c->prefill_chunk_tokens = clamp_sz(c->prefill_chunk_tokens, 1, c->max_tokens_per_iteration);
    if (c->max_prefill_sequences_per_iteration < 1) c->max_prefill_sequences_per_iteration = 1;
    if (c->max_consecutive_prefill_iterations < 1) c->max_consecutive_prefill_iterations = 1;
    /* A sequence counts its in-flight samples in one byte (sk_seq.pending). */
    c->max_inflight_plans = clamp_sz(c->max_inflight_plans, 1, SK_MAX_INFLIGHT_PLANS);
    c->slack_min_chunk_tokens = clamp_sz(c->slack_min_chunk_tokens, 1, c->max_tokens_per_iteration);
}

void skippy_sequence_desc_init(skippy_sequence_desc *d, const char *id, size_t id_len,
                               const int32_t *prompt, size_t prompt_count, uint32_t max_tokens)
{
    if (!d) return;
    memset(d, 0, sizeof *d);
    d->id = id;
    d->id_len = id_len;
    d->prompt_tokens = prompt;
    d->prompt_count = prompt_count;
    d->max_tokens = max_tokens;
    d->admission_tokens = prompt_count + max_tokens < prompt_count ? SIZE_MAX
                                                                   : prompt_count + max_tokens;
    d->status = SKIPPY_SEQ_WAITING;
}

void skippy_scheduler_free(skippy_scheduler *s)
{
    if (!s) return;
    sk_affinity_release_pins(s);
    sk_affinity_detach_store(s);
    free(s->under);
    if (s->comps)
        for (size_t i = 0; i < s->cfg.memory_component_count; i++) free((void *)s->comps[i].name);
    free(s->comps);
    free(s->used);
    free(s->available);
    free(s->used_scratch);
    sk_store_free(s);
    free(s->waiting);
    free(s->scratch);
    free(s->active);
    free(s->retired);
    free(s->victims);
    free(s->prio_victims);
    free(s->ewma);
    free(s->prefill_keys);
    free(s->prefill_edf);
    for (size_t k = 0; s->plans && k < s->cfg.max_inflight_plans; k++) {
        sk_plan_slot *slot = &s->plans[k];
        skippy_plan *plan = &slot->plan;
        free(plan->requests);
        free(plan->tokens);
        free(plan->positions);
        free(plan->row_offsets);
        free(plan->slots);
        free(plan->phases);
        free(plan->sample_last);
        free(plan->sample_rows);
        free(plan->new_rows);
        free(plan->restored_tokens);
        free(plan->outputs.sampled_request_indexes);
        free(plan->outputs.predicted_tokens);
        free(plan->deferred.rows);
        free(plan->deferred.source_steps);
        free(plan->deferred.source_indexes);
        free(slot->row_cursor);
        free(slot->row_epoch);
        free(slot->row_prev_step);
        free(slot->row_prev_row);
        free(slot->new_list);
    }
    free(s->plans);
    for (size_t k = 0; k < s->moved_len; k++) free(s->moved_blocks[k]);
    free(s->moved_blocks);
    free(s->row_seen);
    free(s->row_token);
    sk_waiting_free(s);
    free(s);
}

skippy_status skippy_scheduler_create(const skippy_scheduler_config *config,
                                      skippy_scheduler **out, skippy_error **out_error)
{
    if (out_error) *out_error = NULL;
    if (out) *out = NULL;
    if (!config)
        return sk_fail_alone(SKIPPY_STATUS_INVALID_ARGUMENT, "config is NULL", out_error);
    if (!out)
        return sk_fail_alone(SKIPPY_STATUS_INVALID_ARGUMENT, "out_scheduler is NULL", out_error);
    skippy_scheduler *s = calloc(1, sizeof *s);
    if (!s)
        return sk_fail_alone(SKIPPY_STATUS_ERROR, "out of memory creating the scheduler",
                             out_error);
    s->cfg = *config;
    skippy_scheduler_config_normalize(&s->cfg);
    int rc = 0;
    size_t nc = s->cfg.memory_component_count;
    if (nc && !s->cfg.memory_components) {
        rc = sk_fail(s, SKIPPY_SCHED_INVALID, "memory_components is NULL with a non-zero count");
        goto fail;
    }
    if (s->cfg.admission_policy > SKIPPY_ADMISSION_FAIR_SHARE ||
        s->cfg.preemption_policy > SKIPPY_PREEMPT_CALLBACK) {
        rc = sk_fail(s, SKIPPY_SCHED_INVALID, "unknown admission or preemption policy");
        goto fail;
    }
    if (s->cfg.admission_policy == SKIPPY_ADMISSION_FAIR_SHARE &&
        sk_fair_check_config(&s->cfg)) {
        rc = sk_fail(s, SKIPPY_SCHED_INVALID, "fair_prefill_cost and fair_decode_cost must be "
                     "finite numbers >= 0");
        goto fail;
    }
    if (s->cfg.planning_rule > SKIPPY_PLANNING_SLACK ||
        !(isfinite(s->cfg.itl_target_us) && s->cfg.itl_target_us > 0.0) ||
        !(isfinite(s->cfg.slack_safety) && s->cfg.slack_safety > 0.0) ||
        sk_check_step_cost(&s->cfg.step_cost)) {
        rc = sk_fail(s, SKIPPY_SCHED_INVALID, "unknown planning rule, or itl_target_us, "
                     "slack_safety or step_cost out of range (finite; > 0, > 0, >= 0)");
        goto fail;
    }
    if (!(isfinite(s->cfg.slack_prefill_age_max_us) && s->cfg.slack_prefill_age_max_us >= 0.0)) {
        rc = sk_fail(s, SKIPPY_SCHED_INVALID, "slack_prefill_age_max_us must be a finite number "
                     ">= 0 (µs)");
        goto fail;
    }
    s->cost = s->cfg.step_cost;
    s->comps = calloc(nc ? nc : 1, sizeof *s->comps);
    s->used = calloc(nc ? nc : 1, sizeof *s->used);
    s->available = calloc(nc ? nc : 1, sizeof *s->available);
    s->used_scratch = calloc(nc ? nc : 1, sizeof *s->used_scratch);
    if (!s->comps || !s->used || !s->available || !s->used_scratch) goto oom;
    for (size_t i = 0; i < nc; i++) {
        const skippy_memory_component *c = &config->memory_components[i];
        const char *name = c->name ? c->name : "";
        char *copy = malloc(strlen(name) + 1);
        if (!copy) goto oom;
        strcpy(copy, name);
        s->comps[i] = *c;
        s->comps[i].name = copy;
        s->available[i] = sk_sat_sub(c->capacity_bytes, c->resident_bytes);
    }
    s->cfg.memory_components = s->comps;
    s->plans = calloc(s->cfg.max_inflight_plans, sizeof *s->plans);
    if (!s->plans) goto oom;
    if (sk_waiting_init(s) || sk_store_init(s)) goto oom;
    s->mixed_viable = true;
    *out = s;
    return SKIPPY_STATUS_OK;
oom:
    rc = sk_fail(s, SKIPPY_SCHED_NO_MEMORY, "out of memory creating the scheduler");
fail: {
    skippy_status st = sk_result(s, rc, out_error);
    skippy_scheduler_free(s);
    return st;
}
}

const skippy_scheduler_config *skippy_scheduler_get_config(const skippy_scheduler *s)
{
    return s ? &s->cfg : NULL;
}

skippy_sched_code skippy_scheduler_last_code(const skippy_scheduler *s)
{
    return s ? s->code : SKIPPY_SCHED_INVALID;
}

const char *skippy_scheduler_last_message(const skippy_scheduler *s)
{
    return s ? s->message : SK_NULL_SCHEDULER;
}

void skippy_scheduler_set_callbacks(skippy_scheduler *s, skippy_rank_callback rank,
                                    skippy_victim_callback victim, void *ctx)
{
    if (!s) return;
    s->rank_cb = rank;
    s->victim_cb = victim;
    s->cb_ctx = ctx;
}

uint32_t skippy_scheduler_find(const skippy_scheduler *s, const char *id, size_t len)
{
    if (!s || (!id && len)) return SK_NO_SLOT; /* NULL with length 0 is the empty id */
    return sk_store_find(s, id, len, sk_hash_id(id, len));
}

bool skippy_scheduler_sequence(const skippy_scheduler *s, uint32_t slot, skippy_sequence_info *o)
{
    if (!s || !o || slot >= s->seq_cap || s->seqs[slot].where == SK_WHERE_FREE) return false;
    const sk_seq *q = &s->seqs[slot];
    o->id = q->id;
    o->id_len = q->id_len;
    o->tokens = q->tokens;
    o->prompt_count = q->prompt_len;
    o->generated_count = q->gen_len;
    o->max_tokens = q->max_tokens;
    o->priority = q->priority;
    o->admission_tokens = q->admission_tokens;
    o->status = q->status;
    o->prefill_cursor = q->cursor;
    o->has_prefix_restore = q->has_restore;
    o->restore_token_count = q->restore_tokens;
    o->enqueued_turn = q->enqueued_turn;
    o->enqueue_order = q->enqueue_order;
    o->admitted_at = q->admitted_at;
    o->saved_cost = q->saved_cost;
    o->sampling = q->sampling;
    o->session = q->session;
    /* an active sequence reports the entry it holds pinned; a waiting one the entry of its
     * last read (refreshed before the next selection) */
    o->restore_entry = SKIPPY_PREFIX_NONE;
    if (q->where == SK_WHERE_ACTIVE) {
        o->restore_entry = q->pinned_entry;
    } else if (q->where == SK_WHERE_WAITING && s->store && q->has_restore) {
        size_t matched = 0; /* the backing entry now (it may differ from the last read's) */
        o->restore_entry = skippy_prefix_store_match(s->store, q->tokens,
                                                     sk_affinity_key_len(q), &matched);
    }
    o->restore_holder = s->store && o->restore_entry != SKIPPY_PREFIX_NONE
                            ? sk_prefix_holder(s->store, o->restore_entry) : SKIPPY_PREFIX_NONE;
    o->cache_epoch = q->cache_epoch;
    o->tenant = q->tenant;
    o->itl_target_us = q->itl_target_us;
    o->ttft_deadline_us = q->ttft_deadline_us;
    o->last_token_us = q->last_token_us;
    return true;
}

const skippy_scheduler_metrics *skippy_scheduler_get_metrics(const skippy_scheduler *s)
{
    return s ? &s->m : NULL;
}

/* The list getters: a NULL count is allowed (the array is returned all the same); a NULL
 * scheduler gives NULL and a count of 0. */
const uint32_t *skippy_scheduler_active_slots(const skippy_scheduler *s, size_t *n)
{
    if (n) *n = s ? s->active_len : 0;
    return s ? s->active : NULL;
}

const uint32_t *skippy_scheduler_waiting_slots(const skippy_scheduler *s, size_t *n)
{
    if (n) *n = s ? s->waiting_len : 0;
    return s ? s->waiting : NULL;
}

const uint64_t *skippy_scheduler_component_used(const skippy_scheduler *s, size_t *n)
{
    if (n) *n = s ? s->cfg.memory_component_count : 0;
    return s ? s->used : NULL;
}

const skippy_retired *skippy_scheduler_retired(const skippy_scheduler *s, size_t *n)
{
    if (n) *n = s ? s->retired_len : 0;
    return s ? s->retired : NULL;
}

const uint32_t *skippy_scheduler_priority_victims(const skippy_scheduler *s, size_t *n)
{
    if (n) *n = s ? s->prio_victim_len : 0;
    return s ? s->prio_victims : NULL;
}

const uint32_t *skippy_scheduler_preempted_slots(const skippy_scheduler *s)
{
    return s ? s->victims : NULL;
}

uint64_t skippy_scheduler_waiting_turn(const skippy_scheduler *s)
{
    return s ? s->waiting_turn : 0;
}

bool skippy_scheduler_mixed_viable(const skippy_scheduler *s) { return s && s->mixed_viable; }
