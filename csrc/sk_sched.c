/*
 * The scheduler's entry points besides planning (docs/behaviour.md §2): submit, completion from
 * compact sampled outputs, preemption for memory and cancel. Admission is sk_admit.c's (the
 * planner runs it); the moves of a sequence between the waiting queue and the active set are
 * sk_move.c's.
 *
 * Every public entry point validates first and mutates after, so a failing call leaves the
 * scheduler exactly as it was.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "sk_internal.h"
#include "sk_fair.h"

static uint64_t reservation(const skippy_memory_component *component, size_t tokens)
{
    return sk_reservation(component, tokens);
}

static void release(skippy_scheduler *s, const sk_seq *seq)
{
    for (size_t i = 0; i < s->cfg.memory_component_count; i++)
        s->used[i] = sk_sat_sub(s->used[i], reservation(&s->comps[i], seq->admission_tokens));
}

/* ---------------------------------------------------------------- submit (§2.1) */

static int submit(skippy_scheduler *s, const skippy_sequence_desc *desc, uint32_t *out_slot)
{
    if (!desc) return sk_fail(s, SKIPPY_SCHED_INVALID, "sequence descriptor is NULL");
    if ((!desc->id && desc->id_len) || (!desc->prompt_tokens && desc->prompt_count) ||
        (!desc->generated_tokens && desc->generated_count))
        return sk_fail(s, SKIPPY_SCHED_INVALID, "sequence descriptor has NULL arrays");
    if (desc->prompt_count == 0)
        return sk_fail(s, SKIPPY_SCHED_EMPTY_PROMPT, "sequence prompt must contain at least one token");
    if (desc->status > SKIPPY_SEQ_FAILED)
        return sk_fail(s, SKIPPY_SCHED_INVALID, "sequence status %u is not a submit status",
                       desc->status);
    for (size_t i = 0; i < desc->prompt_count; i++)
        if (desc->prompt_tokens[i] < 0)
            return sk_fail(s, SKIPPY_SCHED_INVALID, "prompt token %zu is negative", i);
    for (size_t i = 0; i < desc->generated_count; i++)
        if (desc->generated_tokens[i] < 0)
            return sk_fail(s, SKIPPY_SCHED_INVALID, "generated token %zu is negative", i);
    if (s->store && (desc->has_prefix_restore || desc->restore_token_count || desc->saved_cost ||
                     desc->prefill_cursor))
        return sk_fail(s, SKIPPY_SCHED_INVALID, "a prefix store is attached: it decides prefix "
                       "restores and saved costs, so the descriptor must carry none");
    if (!(isfinite(desc->itl_target_us) && desc->itl_target_us >= 0.0) ||
        !(isfinite(desc->ttft_deadline_us) && desc->ttft_deadline_us >= 0.0))
        return sk_fail(s, SKIPPY_SCHED_INVALID, "itl_target_us and ttft_deadline_us must be "
                       "finite numbers >= 0 (0 = none)");
    uint64_t hash = sk_hash_id(desc->id, desc->id_len);
    if (sk_store_find(s, desc->id, desc->id_len, hash) != SK_NO_SLOT)
        return sk_fail(s, SKIPPY_SCHED_DUPLICATE, "sequence id is already queued or active: %.*s",
                       (int)(desc->id_len > 200 ? 200 : desc->id_len), desc->id ? desc->id : "");
    if (s->waiting_len >= s->cfg.max_waiting_sequences) {
        s->m.rejected_overload = sk_sat_add(s->m.rejected_overload, 1);
        return sk_fail(s, SKIPPY_SCHED_QUEUE_FULL, "scheduler waiting queue is full (%zu requests)",
                       s->cfg.max_waiting_sequences);
    }
    size_t token_count = desc->prompt_count + desc->generated_count;
    if (token_count < desc->prompt_count)
        return sk_fail(s, SKIPPY_SCHED_INVALID, "token count overflows");
    /* Room for the whole generation up front (bounded), so decode appends do not allocate. */
    size_t want = token_count + (desc->max_tokens > 4096 ? 4096 : desc->max_tokens) + 1;
    if (want < token_count) want = token_count;
    if (sk_store_reserve(s) || sk_reserve_waiting(s, s->waiting_len + 1)) goto oom;
    uint32_t slot = s->free_slots[s->free_len - 1];
    sk_seq *seq = &s->seqs[slot];
    if (sk_grow((void **)&seq->tokens, &seq->token_cap, want, sizeof(int32_t)) ||
        sk_grow((void **)&seq->id, &seq->id_cap, desc->id_len + 1, 1))
        goto oom;
    /* The slot stays free until it is taken below, so filling it first is harmless. */
    if (desc->id_len) memcpy(seq->id, desc->id, desc->id_len);
    seq->id[desc->id_len] = 0;
    seq->id_len = desc->id_len;
    seq->id_hash = hash;
    memcpy(seq->tokens, desc->prompt_tokens, desc->prompt_count * sizeof(int32_t));
    if (desc->generated_count)
        memcpy(seq->tokens + desc->prompt_count, desc->generated_tokens,
               desc->generated_count * sizeof(int32_t));
    seq->prompt_len = desc->prompt_count;
    seq->gen_len = desc->generated_count;
    seq->pending = 0;
    seq->room = sk_room(seq);
    seq->last = desc->generated_count ? desc->generated_tokens[desc->generated_count - 1] : 0;
    seq->max_tokens = desc->max_tokens;
    seq->priority = desc->priority;
    /* Never below the prompt: what `with_admission_tokens` gives a sequence (docs/behaviour.md
     * §2.10); a smaller count set on the field would reserve less than the prompt's cells. */
    seq->admission_tokens = desc->admission_tokens > desc->prompt_count ? desc->admission_tokens
                                                                        : desc->prompt_count;
    seq->status = (uint8_t)desc->status;
    seq->has_restore = desc->has_prefix_restore;
    seq->restore_tokens = desc->restore_token_count;
    /* A caller-set cursor never skips the pending token nor leaves nothing runnable. */
    size_t replay = sk_replay_len(seq);
    size_t cursor = desc->prefill_cursor < replay ? desc->prefill_cursor : replay;
    if (seq->gen_len == 0 && cursor >= replay) cursor = replay - 1;
    seq->cursor = cursor;
    seq->saved_cost = desc->saved_cost;
    seq->sampling = desc->sampling;
    seq->session = desc->session;
    seq->tenant = desc->tenant;
    seq->source_step = 0;
    seq->source_row = 0;
    seq->flight_serial = 0;
    seq->admitted_at = 0;
    seq->enqueued_turn = s->waiting_turn;
    seq->enqueue_order = s->next_order;
    seq->pinned_entry = SKIPPY_PREFIX_NONE;
    seq->cache_epoch = 0;
    seq->where = SK_WHERE_FREE;
    seq->fresh = false;
    seq->prio_preempted_at = 0;
    seq->itl_target_us = desc->itl_target_us;
    seq->ttft_deadline_us = desc->ttft_deadline_us;
    seq->last_token_us = 0.0;
    seq->submitted_us = s->now_us; /* its age under the slack rule's prefill order (§2.13) */
    seq->held_steps = 0;
    seq->held_walk = 0;
    seq->held_restore = 0;
    seq->lead = SK_LEAD_NONE;
    seq->no_lead = false;
    seq->slo_relegated = false;
    sk_affinity_read(s, seq); /* with a store: its restore and saved cost, before ranking */
    if (sk_fair_submit(s, slot, desc->tenant)) goto oom;
    if (sk_waiting_add(s, slot, seq->enqueue_order)) goto oom;
    /* From here on nothing can fail. */
    sk_store_take(s);
    s->next_order++;
    seq->where = SK_WHERE_WAITING;
    sk_store_index(s, slot);
    if (!s->store) { /* with a store, hits are counted at admission (sk_affinity_pin) */
        if (seq->has_restore) s->m.prefix_hits = sk_sat_add(s->m.prefix_hits, 1);
        else s->m.prefix_misses = sk_sat_add(s->m.prefix_misses, 1);
    }
    s->waiting[s->waiting_len++] = slot;
    s->dirty = true;
    sk_refresh_counts(s);
    if (out_slot) *out_slot = slot;
    return 0;
oom:
    return sk_fail(s, SKIPPY_SCHED_NO_MEMORY, "out of memory submitting a sequence");
}

skippy_status skippy_scheduler_submit(skippy_scheduler *s, const skippy_sequence_desc *desc,
                                      uint32_t *out_slot, skippy_error **out_error)
{
    if (!s) return SK_NO_SCHEDULER(out_error);
    return sk_result(s, submit(s, desc, out_slot), out_error);
}

/* ---------------------------------------------------------------- completion (§2.7, §0.4e) */

static int retire(skippy_scheduler *s, uint32_t slot, uint32_t status, uint32_t reason)
{
    size_t cap = s->retired_cap;
    if (sk_grow((void **)&s->retired, &cap, s->retired_len + 1, sizeof(skippy_retired))) return -1;
    s->retired_cap = cap;
    sk_seq *seq = &s->seqs[slot];
    if (seq->where == SK_WHERE_ACTIVE) {
        s->n_class[sk_class(seq)]--;
        sk_affinity_unpin(s, seq);
        sk_unfresh(s, seq);
    }
    seq->status = (uint8_t)status;
    seq->where = SK_WHERE_RETIRED;
    seq->pending = 0;
    seq->epoch++;      /* rows of later live plans for it are void (discarded on completion) */
    s->void_count++;
    sk_store_unindex(s, slot);
    s->retired[s->retired_len].slot = slot;
    s->retired[s->retired_len].status = status;
    s->retired[s->retired_len].reason = reason;
    s->retired_len++;
    return 0;
}

/* Appends a sampled token; false when the history cannot grow (the caller fails the row).
 * The caller keeps the class counts (it also moves a placeholder). */
static inline bool append_token(sk_seq *seq, int32_t token)
{
    size_t history_len = seq->prompt_len + seq->gen_len;
    if (seq->room == 0) {
        size_t cap = seq->token_cap;
        if (history_len + 1 < history_len ||
            sk_grow((void **)&seq->tokens, &cap, history_len + 1, sizeof(int32_t)))
            return false;
        seq->token_cap = cap;
        seq->room = sk_room(seq);
    }
    seq->tokens[history_len] = token;
    seq->gen_len++;
    seq->room--;
    seq->last = token;
    return true;
}

static inline void move_class(skippy_scheduler *s, int before, const sk_seq *seq)
{
    int after = sk_class(seq);
    if (after != before) {
        s->n_class[before]--;
        s->n_class[after]++;
    }
}

/*
 * Checks the outputs block (§0.4e) before anything changes. Returns 1 when it is exactly one
 * entry per sampling row in row order (what a batched runtime writes, checked with one memcmp),
 * 0 when it is some other valid set (then row_seen/row_token hold it by row), or an error.
 */
static int check_outputs(skippy_scheduler *s, const skippy_plan *plan)
{
    const skippy_plan_outputs *outputs = &plan->outputs;
    size_t rows = plan->request_count;
    if (outputs->count > rows)
        return -sk_fail(s, SKIPPY_SCHED_BAD_OUTPUTS, "%zu sampled outputs for a plan of %zu rows",
                        outputs->count, rows);
    if (outputs->count == plan->sample_count &&
        (outputs->count == 0 ||
         memcmp(outputs->sampled_request_indexes, plan->sample_rows,
                outputs->count * sizeof(size_t)) == 0))
        return 1;
    memset(s->row_seen, 0, rows);
    for (size_t entry = 0; entry < outputs->count; entry++) {
        size_t row = outputs->sampled_request_indexes[entry];
        if (row >= rows)
            return -sk_fail(s, SKIPPY_SCHED_BAD_OUTPUTS, "sampled output %zu names work index "
                            "%zu outside the plan (%zu rows)", entry, row, rows);
        if (s->row_seen[row])
            return -sk_fail(s, SKIPPY_SCHED_BAD_OUTPUTS, "work index %zu is sampled twice", row);
        if (!plan->sample_last[row])
            return -sk_fail(s, SKIPPY_SCHED_BAD_OUTPUTS, "work index %zu does not sample", row);
        s->row_seen[row] = 1;
        s->row_token[row] = outputs->predicted_tokens[entry];
    }
    return 0;
}

static int complete(skippy_scheduler *s, uint64_t serial, skippy_iteration_telemetry *telemetry)
{
    sk_plan_slot *plan_slot;
    int rc = sk_check_live(s, serial, true, &plan_slot);
    if (rc) return rc;
    skippy_plan *plan = &plan_slot->plan;
    int in_row_order = check_outputs(s, plan);
    if (in_row_order < 0) return -in_row_order;
    /* Worst case every row's sequence retires: reserve that room before changing anything. */
    size_t cap = s->retired_cap;
    if (sk_grow((void **)&s->retired, &cap, s->retired_len + plan->sample_count,
                sizeof(skippy_retired)))
        return sk_fail(s, SKIPPY_SCHED_NO_MEMORY, "out of memory completing the plan");
    s->retired_cap = cap;
    if (s->fair) sk_fair_charge(s, plan_slot); /* before any row's sequence can end */

    /* Only sampling rows change sequences; token totals were counted while planning. A row is
     * void when its sequence left the active set, or (when something went void since the plan
     * was made) its sequence is another incarnation or was preempted: its output is dropped. */
    size_t first_retired = s->retired_len, discarded = 0;
    bool check_epochs = plan_slot->void_mark != s->void_count;
    const size_t *sample_rows = plan->sample_rows;
    const uint32_t *slots = plan->slots;
    const uint32_t *row_epoch = plan_slot->row_epoch;
    const int32_t *predicted = plan->outputs.predicted_tokens;
    sk_seq *seqs = s->seqs;
    bool stamp = s->cfg.planning_rule == SKIPPY_PLANNING_SLACK;
    double now = s->now_us;
    for (size_t entry = 0, sample_count = plan->sample_count; entry < sample_count; entry++) {
        size_t row = sample_rows[entry];
        uint32_t slot = slots[row];
        sk_seq *seq = &seqs[slot];
        if (seq->where != SK_WHERE_ACTIVE || (check_epochs && seq->epoch != row_epoch[row])) {
            discarded++;
            continue;
        }
        int32_t token;
        bool has_token = true;
        if (in_row_order) token = predicted[entry];
        else if (s->row_seen[row]) token = s->row_token[row];
        else { token = -1; has_token = false; }
        int before = sk_class(seq);
        /* Plans complete in order, so this sample is the sequence's oldest placeholder. */
        if (!has_token || token < 0) {
            seq->pending = 0; /* the end (or a failure): later placeholders go with it */
            move_class(s, before, seq);
            if (has_token) retire(s, slot, SKIPPY_SEQ_FINISHED, SKIPPY_END_STOP);
            else retire(s, slot, SKIPPY_SEQ_FAILED, SKIPPY_END_FAILED);
            continue;
        }
        seq->pending--;
        if (!append_token(seq, token)) {
            seq->pending = 0;
            move_class(s, before, seq);
            retire(s, slot, SKIPPY_SEQ_FAILED, SKIPPY_END_FAILED); /* never lose: fail */
            continue;
        }
        move_class(s, before, seq);
        if (stamp) seq->last_token_us = now;
        if (seq->gen_len >= seq->max_tokens)
            retire(s, slot, SKIPPY_SEQ_FINISHED, SKIPPY_END_LENGTH);
    }
    s->m.discarded_rows = sk_sat_add(s->m.discarded_rows, discarded);
    if (s->retired_len > first_retired) {
        size_t kept = 0;
        for (size_t i = 0; i < s->active_len; i++) {
            uint32_t slot = s->active[i];
            if (s->seqs[slot].where == SK_WHERE_ACTIVE) s->active[kept++] = slot;
            else release(s, &s->seqs[slot]);
        }
        s->active_len = kept;
        for (size_t i = first_retired; i < s->retired_len; i++) {
            if (s->retired[i].status == SKIPPY_SEQ_FAILED)
                s->m.failed = sk_sat_add(s->m.failed, 1);
            else
                s->m.finished = sk_sat_add(s->m.finished, 1);
        }
    }
    const uint64_t *phase_tokens = plan_slot->tokens_by_phase;
    s->m.iterations = sk_sat_add(s->m.iterations, 1);
    s->m.admitted = sk_sat_add(s->m.admitted, plan->admitted);
    s->m.prefill_tokens = sk_sat_add(s->m.prefill_tokens, phase_tokens[SKIPPY_PHASE_PREFILL]);
    s->m.recompute_tokens = sk_sat_add(s->m.recompute_tokens, phase_tokens[SKIPPY_PHASE_RECOMPUTE]);
    s->m.decode_tokens = sk_sat_add(s->m.decode_tokens, phase_tokens[SKIPPY_PHASE_DECODE]);
    sk_refresh_counts(s);
    plan_slot->live = false;
    s->live_head = sk_live_ring(s, 1);
    s->live_count--;
    if (telemetry) {
        telemetry->iteration = s->m.iterations;
        telemetry->active_sequences = s->active_len;
        telemetry->waiting_sequences = s->waiting_len;
        telemetry->admitted = plan->admitted;
        telemetry->preempted = plan->preempted;
        telemetry->prefill_tokens = phase_tokens[SKIPPY_PHASE_PREFILL];
        telemetry->recompute_tokens = phase_tokens[SKIPPY_PHASE_RECOMPUTE];
        telemetry->decode_tokens = phase_tokens[SKIPPY_PHASE_DECODE];
        telemetry->prefix_hits = s->m.prefix_hits;
        telemetry->stale_refreshes = s->m.stale_refreshes;
        telemetry->prefix_misses = s->m.prefix_misses;
        telemetry->finished = s->m.finished;
        telemetry->failed = s->m.failed;
        telemetry->cancelled = s->m.cancelled;
        telemetry->rejected_overload = s->m.rejected_overload;
    }
    return 0;
}

skippy_status skippy_scheduler_complete(skippy_scheduler *s, uint64_t serial,
                                        skippy_iteration_telemetry *telemetry,
                                        skippy_error **out_error)
{
    if (!s) return SK_NO_SCHEDULER(out_error);
    return sk_result(s, complete(s, serial, telemetry), out_error);
}

/* ---------------------------------------------------------------- preemption (§2.8) */

static size_t pick_victim_builtin(const skippy_scheduler *s, const uint32_t *candidates,
                                  size_t count)
{
    size_t best = SIZE_MAX;
    for (size_t i = 0; i < count; i++) {
        const sk_seq *seq = &s->seqs[candidates[i]];
        if (best == SIZE_MAX) { best = i; continue; }
        const sk_seq *best_seq = &s->seqs[candidates[best]];
        /* §2.8: lowest priority, then the most recently admitted; FEWEST_COMPUTED puts the
         * fewest computed tokens first. */
        bool better;
        if (s->cfg.preemption_policy == SKIPPY_PREEMPT_FEWEST_COMPUTED &&
            seq->cursor != best_seq->cursor)
            better = seq->cursor < best_seq->cursor;
        else if (seq->priority != best_seq->priority)
            better = seq->priority < best_seq->priority;
        else
            better = seq->admitted_at > best_seq->admitted_at;
        if (better) best = i;
    }
    return best;
}

static bool over_budget(const skippy_scheduler *s, const uint64_t *used)
{
    for (size_t i = 0; i < s->cfg.memory_component_count; i++)
        if (used[i] > s->available[i]) return true;
    return false;
}

/*
 * Victims are all chosen first, on a copy of the usage, so a failing policy callback leaves the
 * scheduler untouched; then the measured usage is applied and the victims move to the front of
 * the waiting queue (the last victim ends up first).
 */
static int preempt(skippy_scheduler *s, const uint64_t *used, size_t used_count,
                   size_t *out_count)
{
    if (used_count && !used) return sk_fail(s, SKIPPY_SCHED_INVALID, "used_bytes is NULL");
    size_t active_count = s->active_len, component_count = s->cfg.memory_component_count;
    if (sk_grow((void **)&s->victims, &s->victim_cap, active_count ? active_count : 1,
                sizeof(uint32_t)) ||
        sk_reserve_waiting(s, s->waiting_len + active_count))
        return sk_fail(s, SKIPPY_SCHED_NO_MEMORY, "out of memory preempting");
    uint64_t *trial_used = s->used_scratch;
    memcpy(trial_used, s->used, component_count * sizeof(uint64_t));
    size_t measured = used_count < component_count ? used_count : component_count;
    for (size_t i = 0; i < measured; i++) trial_used[i] = used[i];
    uint32_t *candidates = s->scratch;
    /* (the guard: both arrays are NULL before the first admission) */
    if (active_count) memcpy(candidates, s->active, active_count * sizeof(uint32_t));
    size_t candidate_count = active_count, victim_count = 0;
    while (candidate_count > 0 && over_budget(s, trial_used)) {
        size_t victim;
        if (s->cfg.preemption_policy == SKIPPY_PREEMPT_CALLBACK) {
            if (!s->victim_cb || s->victim_cb(s->cb_ctx, s, candidates, candidate_count, &victim))
                return sk_fail(s, SKIPPY_SCHED_CALLBACK, "preemption policy failed");
            if (victim >= candidate_count) break; /* the policy chose no victim */
        } else {
            victim = pick_victim_builtin(s, candidates, candidate_count);
        }
        uint32_t slot = candidates[victim];
        memmove(candidates + victim, candidates + victim + 1,
                (candidate_count - victim - 1) * sizeof(uint32_t));
        candidate_count--;
        for (size_t i = 0; i < component_count; i++)
            trial_used[i] = sk_sat_sub(trial_used[i],
                                       reservation(&s->comps[i], s->seqs[slot].admission_tokens));
        /* The candidates shrank by one: the victims fill the scratch from its end, last first
         * (s->victims, what the previous call reported, stays as it is until the commit). */
        candidates[active_count - 1 - victim_count++] = slot;
    }
    uint32_t *picked = candidates + candidate_count; /* the victims, in order once reversed */
    for (size_t i = 0, j = victim_count; i + 1 < j; i++, j--) {
        uint32_t t = picked[i];
        picked[i] = picked[j - 1];
        picked[j - 1] = t;
    }
    /* Joining the ranked set is the last step that can fail, so it comes before the commit. */
    for (size_t nth = 0; nth < victim_count; nth++) {
        if (sk_waiting_add(s, picked[nth], s->next_order + nth)) {
            while (nth-- > 0) sk_waiting_remove(s, picked[nth]);
            return sk_fail(s, SKIPPY_SCHED_NO_MEMORY, "out of memory preempting");
        }
    }
    /* Commit. */
    if (victim_count) memcpy(s->victims, picked, victim_count * sizeof(uint32_t));
    memcpy(s->used, trial_used, component_count * sizeof(uint64_t));
    if (victim_count) {
        for (size_t nth = 0; nth < victim_count; nth++)
            s->seqs[s->victims[nth]].where = SK_WHERE_WAITING;
        size_t kept = 0;
        for (size_t i = 0; i < active_count; i++)
            if (s->seqs[s->active[i]].where == SK_WHERE_ACTIVE) s->active[kept++] = s->active[i];
        s->active_len = kept;
        memmove(s->waiting + victim_count, s->waiting, s->waiting_len * sizeof(uint32_t));
        for (size_t nth = 0; nth < victim_count; nth++)
            sk_requeue_victim(s, s->victims[nth]);
        for (size_t nth = 0; nth < victim_count; nth++)
            s->waiting[victim_count - 1 - nth] = s->victims[nth];
        s->waiting_len += victim_count;
    }
    s->victim_len = victim_count;
    sk_refresh_counts(s);
    if (out_count) *out_count = victim_count;
    return 0;
}

skippy_status skippy_scheduler_preempt(skippy_scheduler *s, const uint64_t *used, size_t used_count,
                                       size_t *out_count, skippy_error **out_error)
{
    if (!s) return SK_NO_SCHEDULER(out_error);
    return sk_result(s, preempt(s, used, used_count, out_count), out_error);
}

/* ---------------------------------------------------------------- cancel (§2.9) */

/* false for an unknown id (last_code OK) and for a failure (last_code says which). */
bool skippy_scheduler_cancel(skippy_scheduler *s, const char *id, size_t id_len)
{
    if (!s) return false;
    if (!id && id_len) { /* NULL with length 0 is the empty id */
        sk_fail(s, SKIPPY_SCHED_INVALID, "sequence id is NULL with id_len %zu", id_len);
        return false;
    }
    s->code = SKIPPY_SCHED_OK;
    s->message[0] = 0;
    uint32_t slot = sk_store_find(s, id, id_len, sk_hash_id(id, id_len));
    if (slot == SK_NO_SLOT) return false;
    size_t cap = s->retired_cap;
    if (sk_grow((void **)&s->retired, &cap, s->retired_len + 1, sizeof(skippy_retired))) {
        sk_fail(s, SKIPPY_SCHED_NO_MEMORY, "out of memory cancelling");
        return false;
    }
    s->retired_cap = cap;
    sk_seq *seq = &s->seqs[slot];
    /* The active set or the waiting queue, whichever holds it. */
    uint32_t *members = seq->where == SK_WHERE_ACTIVE ? s->active : s->waiting;
    size_t *member_count = seq->where == SK_WHERE_ACTIVE ? &s->active_len : &s->waiting_len;
    for (size_t i = 0; i < *member_count; i++) {
        if (members[i] != slot) continue;
        memmove(members + i, members + i + 1, (*member_count - i - 1) * sizeof(uint32_t));
        (*member_count)--;
        break;
    }
    if (seq->where == SK_WHERE_ACTIVE) {
        release(s, seq);
    } else {
        sk_waiting_remove(s, slot);
        s->dirty = true;
    }
    uint32_t keep = seq->status;
    retire(s, slot, SKIPPY_SEQ_CANCELLED, SKIPPY_END_CANCELLED);
    s->retired[s->retired_len - 1].status = SKIPPY_SEQ_CANCELLED;
    seq->status = (uint8_t)keep; /* the sequence's own status is not a cancellation state */
    s->m.cancelled = sk_sat_add(s->m.cancelled, 1);
    sk_refresh_counts(s);
    return true;
}
