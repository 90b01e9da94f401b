/*
 * Plans in flight (docs/behaviour.md §2.11): the ring of live plan buffers that planning
 * (sk_plan.c) fills. Looking a live plan up, checking that a completion or an observation names
 * one, and undoing live plans (abort, or a depth-1 plan replaced by the next). Nothing here calls
 * into another unit but errors: planning, completion, the slack rule and the prefill order read
 * the ring through it.
 */
#include "sk_internal.h"

sk_plan_slot *sk_find_live(skippy_scheduler *s, uint64_t serial, size_t *out_nth)
{
    /* At most max_inflight_plans live plans, oldest first from live_head. */
    if (serial == 0) return NULL;
    for (size_t nth = 0; nth < s->live_count; nth++) {
        sk_plan_slot *slot = &s->plans[sk_live_ring(s, nth)];
        if (slot->plan.serial == serial) {
            if (out_nth) *out_nth = nth;
            return slot;
        }
    }
    return NULL;
}

int sk_check_live(skippy_scheduler *s, uint64_t serial, bool oldest, sk_plan_slot **out_slot)
{
    size_t nth = 0;
    sk_plan_slot *slot = sk_find_live(s, serial, &nth);
    if (!slot)
        return sk_fail(s, SKIPPY_SCHED_STALE_PLAN, "plan %llu is no longer live",
                       (unsigned long long)serial);
    if (oldest && nth != 0)
        return sk_fail(s, SKIPPY_SCHED_PLAN_IN_FLIGHT, "plan step %llu completed before plan "
                       "step %llu: complete plans in the order they were made",
                       (unsigned long long)slot->plan.step,
                       (unsigned long long)s->plans[s->live_head].plan.step);
    *out_slot = slot;
    return 0;
}

/*
 * Undoes the live plans from the nth oldest on, newest first and each row last to first, so
 * every sequence still in them (same epoch: not preempted, cancelled or ended since) returns
 * to the cursor and placeholders it had before. Admissions, the turn counter and the queue
 * stay; the planner's counters return to their values before the first undone plan.
 */
void sk_abort_from(skippy_scheduler *s, size_t nth)
{
    bool sources = s->cfg.max_inflight_plans > 1;
    for (size_t k = s->live_count; k-- > nth;) {
        sk_plan_slot *slot = &s->plans[sk_live_ring(s, k)];
        const skippy_plan *plan = &slot->plan;
        for (size_t row = plan->request_count; row-- > 0;) {
            sk_seq *seq = &s->seqs[plan->slots[row]];
            if (seq->where != SK_WHERE_ACTIVE || seq->epoch != slot->row_epoch[row]) continue;
            s->n_class[sk_class(seq)]--;
            seq->cursor = slot->row_cursor[row];
            if (plan->new_rows[row]) { /* its first row is undone: the next one is new again */
                seq->fresh = true;
                s->fresh_count++;
            }
            if (plan->sample_last[row]) {
                seq->pending--;
                if (sources) {
                    seq->source_step = slot->row_prev_step[row];
                    seq->source_row = slot->row_prev_row[row];
                }
            }
            s->n_class[sk_class(seq)]++;
        }
        slot->live = false;
        if (k == nth) {
            s->consecutive_prefill = slot->consecutive_before;
            s->mixed_cursor = slot->mixed_before;
            s->interleaved = slot->interleaved_before;
        }
    }
    s->m.aborted_plans = sk_sat_add(s->m.aborted_plans, s->live_count - nth);
    s->live_count = nth;
}

static int abort_plan(skippy_scheduler *s, uint64_t serial)
{
    size_t nth = 0;
    if (!sk_find_live(s, serial, &nth))
        return sk_fail(s, SKIPPY_SCHED_STALE_PLAN, "plan %llu is no longer live",
                       (unsigned long long)serial);
    sk_abort_from(s, nth);
    return 0;
}

skippy_status skippy_scheduler_abort(skippy_scheduler *s, uint64_t serial,
                                     skippy_error **out_error)
{
    if (!s) return SK_NO_SCHEDULER(out_error);
    return sk_result(s, abort_plan(s, serial), out_error);
}

bool skippy_scheduler_plan_live(const skippy_scheduler *s, uint64_t serial)
{
    return s && sk_find_live((skippy_scheduler *)s, serial, NULL) != NULL;
}

size_t skippy_scheduler_live_plans(const skippy_scheduler *s) { return s ? s->live_count : 0; }

uint64_t skippy_scheduler_oldest_plan(const skippy_scheduler *s)
{
    return s && s->live_count ? s->plans[s->live_head].plan.serial : 0;
}
