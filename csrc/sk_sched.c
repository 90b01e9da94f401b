/*
 * The scheduler's decisions (behaviour.md §2) other than planning (sk_plan.c): submit,
 * admission, completion from compact sampled outputs, preemption and cancel.
 *
 * Every public entry point validates first and mutates after, so a failing call leaves the
 * scheduler exactly as it was.
 */
#include <stdlib.h>
#include <string.h>

#include "sk_internal.h"

static uint64_t reservation(const skippy_memory_component *c, size_t tokens)
{
    return sk_sat_add(c->bytes_per_sequence, sk_sat_mul(c->bytes_per_token, tokens));
}

static bool fits(const skippy_scheduler *s, const sk_seq *q)
{
    for (size_t i = 0; i < s->cfg.memory_component_count; i++) {
        uint64_t need = sk_sat_add(s->used[i], reservation(&s->comps[i], q->admission_tokens));
        if (need > s->available[i]) return false;
    }
    return true;
}

static void reserve(skippy_scheduler *s, const sk_seq *q)
{
    for (size_t i = 0; i < s->cfg.memory_component_count; i++)
        s->used[i] = sk_sat_add(s->used[i], reservation(&s->comps[i], q->admission_tokens));
}

static void release(skippy_scheduler *s, const sk_seq *q)
{
    for (size_t i = 0; i < s->cfg.memory_component_count; i++)
        s->used[i] = sk_sat_sub(s->used[i], reservation(&s->comps[i], q->admission_tokens));
}

/* Waiting queue and scratch grow together so permutations always have room. */
static int reserve_waiting(skippy_scheduler *s, size_t need)
{
    size_t cap = s->waiting_cap, cap2 = s->waiting_cap;
    if (sk_grow((void **)&s->waiting, &cap, need, sizeof(uint32_t))) return -1;
    if (sk_grow((void **)&s->scratch, &cap2, cap, sizeof(uint32_t))) return -1;
    s->waiting_cap = cap;
    return 0;
}

/* ---------------------------------------------------------------- submit (§2.1) */

static int submit(skippy_scheduler *s, const skippy_sequence_desc *d, uint32_t *out_slot)
{
    if (!d || (!d->id && d->id_len) || (!d->prompt_tokens && d->prompt_count) ||
        (!d->generated_tokens && d->generated_count))
        return sk_fail(s, SKIPPY_SCHED_INVALID, "sequence descriptor has NULL arrays");
    if (d->prompt_count == 0)
        return sk_fail(s, SKIPPY_SCHED_EMPTY_PROMPT, "sequence prompt must contain at least one token");
    if (d->status > SKIPPY_SEQ_FAILED)
        return sk_fail(s, SKIPPY_SCHED_INVALID, "sequence status %u is not a submit status", d->status);
    for (size_t i = 0; i < d->prompt_count; i++)
        if (d->prompt_tokens[i] < 0)
            return sk_fail(s, SKIPPY_SCHED_INVALID, "prompt token %zu is negative", i);
    for (size_t i = 0; i < d->generated_count; i++)
        if (d->generated_tokens[i] < 0)
            return sk_fail(s, SKIPPY_SCHED_INVALID, "generated token %zu is negative", i);
    uint64_t hash = sk_hash_id(d->id, d->id_len);
    if (sk_store_find(s, d->id, d->id_len, hash) != SK_NO_SLOT)
        return sk_fail(s, SKIPPY_SCHED_DUPLICATE, "sequence id is already queued or active: %.*s",
                       (int)(d->id_len > 200 ? 200 : d->id_len), d->id ? d->id : "");
    if (s->waiting_len >= s->cfg.max_waiting_sequences) {
        s->m.rejected_overload = sk_sat_add(s->m.rejected_overload, 1);
        return sk_fail(s, SKIPPY_SCHED_QUEUE_FULL, "scheduler waiting queue is full (%zu requests)",
                       s->cfg.max_waiting_sequences);
    }
    size_t ntok = d->prompt_count + d->generated_count;
    if (ntok < d->prompt_count) return sk_fail(s, SKIPPY_SCHED_INVALID, "token count overflows");
    /* Room for the whole generation up front (bounded), so decode appends do not allocate. */
    size_t want = ntok + (d->max_tokens > 4096 ? 4096 : d->max_tokens) + 1;
    if (want < ntok) want = ntok;
    if (sk_store_reserve(s) || reserve_waiting(s, s->waiting_len + 1)) goto oom;
    uint32_t slot = s->free_slots[s->free_len - 1];
    sk_seq *q = &s->seqs[slot];
    if (sk_grow((void **)&q->tokens, &q->token_cap, want, sizeof(int32_t)) ||
        sk_grow((void **)&q->id, &q->id_cap, d->id_len + 1, 1))
        goto oom;
    /* The slot stays free until it is taken below, so filling it first is harmless. */
    if (d->id_len) memcpy(q->id, d->id, d->id_len);
    q->id[d->id_len] = 0;
    q->id_len = d->id_len;
    q->id_hash = hash;
    memcpy(q->tokens, d->prompt_tokens, d->prompt_count * sizeof(int32_t));
    if (d->generated_count)
        memcpy(q->tokens + d->prompt_count, d->generated_tokens, d->generated_count * sizeof(int32_t));
    q->prompt_len = d->prompt_count;
    q->gen_len = d->generated_count;
    q->room = sk_room(q);
    q->last = d->generated_count ? d->generated_tokens[d->generated_count - 1] : 0;
    q->max_tokens = d->max_tokens;
    q->priority = d->priority;
    q->admission_tokens = d->admission_tokens;
    q->status = (uint8_t)d->status;
    q->has_restore = d->has_prefix_restore;
    q->restore_tokens = d->restore_token_count;
    /* A caller-set cursor never skips the pending token nor leaves nothing runnable. */
    size_t r = sk_replay_len(q);
    size_t cur = d->prefill_cursor < r ? d->prefill_cursor : r;
    if (q->gen_len == 0 && cur >= r) cur = r - 1;
    q->cursor = cur;
    q->saved_cost = d->saved_cost;
    q->sampling = d->sampling;
    q->session = d->session;
    q->admitted_at = 0;
    q->enqueued_turn = s->waiting_turn;
    q->enqueue_order = s->next_order;
    if (sk_waiting_add(s, slot, q->enqueue_order)) goto oom;
    /* From here on nothing can fail. */
    sk_store_take(s);
    s->next_order++;
    q->where = SK_WHERE_WAITING;
    sk_store_index(s, slot);
    if (q->has_restore) s->m.prefix_hits = sk_sat_add(s->m.prefix_hits, 1);
    else s->m.prefix_misses = sk_sat_add(s->m.prefix_misses, 1);
    s->waiting[s->waiting_len++] = slot;
    s->dirty = true;
    sk_refresh_counts(s);
    if (out_slot) *out_slot = slot;
    return 0;
oom:
    return sk_fail(s, SKIPPY_SCHED_NO_MEMORY, "out of memory submitting a sequence");
}

skippy_status skippy_scheduler_submit(skippy_scheduler *s, const skippy_sequence_desc *d,
                                      uint32_t *out_slot, skippy_error **out_error)
{
    return sk_result(s, submit(s, d, out_slot), out_error);
}

/* ---------------------------------------------------------------- admission (§2.3) */

int sk_admit_waiting(skippy_scheduler *s, size_t *out_admitted)
{
    *out_admitted = 0;
    if (s->dirty) {
        int rc = sk_waiting_rank(s);
        if (rc) return rc;
        s->dirty = false;
    }
    size_t n = s->waiting_len;
    if (n == 0 || s->active_len >= s->cfg.max_active_sequences) return 0;
    size_t room = s->cfg.max_active_sequences - s->active_len;
    if (sk_grow((void **)&s->active, &s->active_cap, s->active_len + (room < n ? room : n),
                sizeof(uint32_t)))
        return sk_fail(s, SKIPPY_SCHED_NO_MEMORY, "out of memory admitting sequences");
    size_t kept = 0, admitted = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t slot = s->waiting[i];
        sk_seq *q = &s->seqs[slot];
        if (s->active_len >= s->cfg.max_active_sequences || !fits(s, q)) {
            s->waiting[kept++] = slot; /* deferred, relative order kept */
            continue;
        }
        sk_waiting_remove(s, slot);
        reserve(s, q);
        q->status = SKIPPY_SEQ_RUNNING;
        q->admitted_at = ++s->admit_counter;
        q->where = SK_WHERE_ACTIVE;
        s->n_class[sk_class(q)]++;
        s->active[s->active_len++] = slot;
        admitted++;
    }
    s->waiting_len = kept;
    *out_admitted = admitted;
    return 0;
}

/* ---------------------------------------------------------------- completion (§2.7, §0.4e) */

static int retire(skippy_scheduler *s, uint32_t slot, uint32_t status)
{
    size_t cap = s->retired_cap;
    if (sk_grow((void **)&s->retired, &cap, s->retired_len + 1, sizeof(skippy_retired))) return -1;
    s->retired_cap = cap;
    sk_seq *q = &s->seqs[slot];
    if (q->where == SK_WHERE_ACTIVE) s->n_class[sk_class(q)]--;
    q->status = (uint8_t)status;
    q->where = SK_WHERE_RETIRED;
    sk_store_unindex(s, slot);
    s->retired[s->retired_len].slot = slot;
    s->retired[s->retired_len].status = status;
    s->retired_len++;
    return 0;
}

/* Appends a sampled token; false when the history cannot grow (the caller fails the row). */
static inline bool append_token(skippy_scheduler *s, sk_seq *q, int32_t token)
{
    size_t len = q->prompt_len + q->gen_len;
    if (q->room == 0) {
        size_t c = q->token_cap;
        if (len + 1 < len || sk_grow((void **)&q->tokens, &c, len + 1, sizeof(int32_t)))
            return false;
        q->token_cap = c;
        q->room = sk_room(q);
    }
    /* Appending moves R up by one (or not at all for the first token), so the class can only
     * change for a first token or when the cursor sits exactly at R. */
    bool moves = q->gen_len == 0 || q->cursor == len - 1;
    if (moves) s->n_class[sk_class(q)]--;
    q->tokens[len] = token;
    q->gen_len++;
    q->room--;
    q->last = token;
    if (moves) s->n_class[sk_class(q)]++;
    return true;
}

/*
 * Checks the outputs block (§0.4e) before anything changes. Returns 1 when it is exactly one
 * entry per sampling row in row order (what a batched runtime writes, checked with one memcmp),
 * 0 when it is some other valid set (then row_seen/row_token hold it by row), or an error.
 */
static int check_outputs(skippy_scheduler *s)
{
    const skippy_plan *p = &s->plan;
    const skippy_plan_outputs *o = &p->outputs;
    size_t rows = p->request_count;
    if (o->count > rows)
        return -sk_fail(s, SKIPPY_SCHED_BAD_OUTPUTS, "%zu sampled outputs for a plan of %zu rows",
                        o->count, rows);
    if (o->count == p->sample_count &&
        (o->count == 0 ||
         memcmp(o->sampled_request_indexes, p->sample_rows, o->count * sizeof(size_t)) == 0))
        return 1;
    memset(s->row_seen, 0, rows);
    for (size_t k = 0; k < o->count; k++) {
        size_t r = o->sampled_request_indexes[k];
        if (r >= rows)
            return -sk_fail(s, SKIPPY_SCHED_BAD_OUTPUTS, "sampled output %zu names work index "
                            "%zu outside the plan (%zu rows)", k, r, rows);
        if (s->row_seen[r])
            return -sk_fail(s, SKIPPY_SCHED_BAD_OUTPUTS, "work index %zu is sampled twice", r);
        if (!p->sample_last[r])
            return -sk_fail(s, SKIPPY_SCHED_BAD_OUTPUTS, "work index %zu does not sample", r);
        s->row_seen[r] = 1;
        s->row_token[r] = o->predicted_tokens[k];
    }
    return 0;
}

static int complete(skippy_scheduler *s, uint64_t serial, skippy_iteration_telemetry *t)
{
    int rc = sk_check_live(s, serial);
    if (rc) return rc;
    skippy_plan *p = &s->plan;
    int in_row_order = check_outputs(s);
    if (in_row_order < 0) return -in_row_order;
    /* Worst case every row's sequence retires: reserve that room before changing anything. */
    size_t cap = s->retired_cap;
    if (sk_grow((void **)&s->retired, &cap, s->retired_len + p->sample_count,
                sizeof(skippy_retired)))
        return sk_fail(s, SKIPPY_SCHED_NO_MEMORY, "out of memory completing the plan");
    s->retired_cap = cap;

    /* Only sampling rows change sequences; token totals were counted while planning. */
    size_t first_retired = s->retired_len;
    const size_t *srows = p->sample_rows;
    const uint32_t *slots = p->slots;
    const int32_t *predicted = p->outputs.predicted_tokens;
    sk_seq *seqs = s->seqs;
    for (size_t k = 0, ns = p->sample_count; k < ns; k++) {
        size_t r = srows[k];
        uint32_t slot = slots[r];
        sk_seq *q = &seqs[slot];
        if (q->where != SK_WHERE_ACTIVE) continue; /* cancelled or preempted meanwhile */
        int32_t token;
        if (in_row_order) {
            token = predicted[k];
        } else if (s->row_seen[r]) {
            token = s->row_token[r];
        } else {
            retire(s, slot, SKIPPY_SEQ_FAILED);
            continue;
        }
        if (token < 0) {
            retire(s, slot, SKIPPY_SEQ_FINISHED);
            continue;
        }
        if (!append_token(s, q, token)) {
            retire(s, slot, SKIPPY_SEQ_FAILED); /* cannot store the token: fail, never lose */
            continue;
        }
        if (q->gen_len >= q->max_tokens) retire(s, slot, SKIPPY_SEQ_FINISHED);
    }
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
    const uint64_t *tok = s->plan_tok;
    s->m.iterations = sk_sat_add(s->m.iterations, 1);
    s->m.admitted = sk_sat_add(s->m.admitted, p->admitted);
    s->m.prefill_tokens = sk_sat_add(s->m.prefill_tokens, tok[SKIPPY_PHASE_PREFILL]);
    s->m.recompute_tokens = sk_sat_add(s->m.recompute_tokens, tok[SKIPPY_PHASE_RECOMPUTE]);
    s->m.decode_tokens = sk_sat_add(s->m.decode_tokens, tok[SKIPPY_PHASE_DECODE]);
    sk_refresh_counts(s);
    s->plan_live = false;
    if (t) {
        t->iteration = s->m.iterations;
        t->active_sequences = s->active_len;
        t->waiting_sequences = s->waiting_len;
        t->admitted = p->admitted;
        t->preempted = p->preempted;
        t->prefill_tokens = tok[SKIPPY_PHASE_PREFILL];
        t->recompute_tokens = tok[SKIPPY_PHASE_RECOMPUTE];
        t->decode_tokens = tok[SKIPPY_PHASE_DECODE];
        t->prefix_hits = s->m.prefix_hits;
        t->prefix_misses = s->m.prefix_misses;
        t->finished = s->m.finished;
        t->failed = s->m.failed;
        t->cancelled = s->m.cancelled;
        t->rejected_overload = s->m.rejected_overload;
    }
    return 0;
}

skippy_status skippy_scheduler_complete(skippy_scheduler *s, uint64_t serial,
                                        skippy_iteration_telemetry *t, skippy_error **out_error)
{
    return sk_result(s, complete(s, serial, t), out_error);
}

/* ---------------------------------------------------------------- preemption (§2.8) */

static size_t pick_victim_builtin(const skippy_scheduler *s, const uint32_t *cand, size_t n)
{
    size_t best = SIZE_MAX;
    for (size_t i = 0; i < n; i++) {
        const sk_seq *q = &s->seqs[cand[i]];
        if (best == SIZE_MAX) { best = i; continue; }
        const sk_seq *b = &s->seqs[cand[best]];
        bool better;
        if (s->cfg.preemption_policy == SKIPPY_PREEMPT_FEWEST_COMPUTED) {
            better = q->cursor != b->cursor ? q->cursor < b->cursor
                     : q->priority != b->priority ? q->priority < b->priority
                                                  : q->admitted_at > b->admitted_at;
        } else {
            better = q->priority != b->priority ? q->priority < b->priority
                                                : q->admitted_at > b->admitted_at;
        }
        if (better) best = i;
    }
    return best;
}

static void reset_for_recompute(sk_seq *q)
{
    size_t r = sk_replay_len(q);
    size_t cur = q->has_restore ? q->restore_tokens : 0;
    if (cur > r) cur = r;
    /* Departure §0.4b: without a pending token keep one replay token runnable. */
    if (q->gen_len == 0 && cur >= r) cur = r - 1;
    q->cursor = cur;
    q->status = SKIPPY_SEQ_PREEMPTED;
    q->admitted_at = 0;
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
static int preempt(skippy_scheduler *s, const uint64_t *used, size_t n, size_t *out_n)
{
    if (n && !used) return sk_fail(s, SKIPPY_SCHED_INVALID, "used_bytes is NULL");
    size_t na = s->active_len, nc = s->cfg.memory_component_count;
    if (sk_grow((void **)&s->victims, &s->victim_cap, na ? na : 1, sizeof(uint32_t)) ||
        reserve_waiting(s, s->waiting_len + na))
        return sk_fail(s, SKIPPY_SCHED_NO_MEMORY, "out of memory preempting");
    uint64_t *u = s->used_scratch;
    memcpy(u, s->used, nc * sizeof(uint64_t));
    size_t m = n < nc ? n : nc;
    for (size_t i = 0; i < m; i++) u[i] = used[i];
    uint32_t *rem = s->scratch;
    if (na) memcpy(rem, s->active, na * sizeof(uint32_t)); /* both NULL before any admission */
    size_t rem_len = na, nv = 0;
    while (rem_len > 0 && over_budget(s, u)) {
        size_t idx;
        if (s->cfg.preemption_policy == SKIPPY_PREEMPT_CALLBACK) {
            if (!s->victim_cb || s->victim_cb(s->cb_ctx, s, rem, rem_len, &idx))
                return sk_fail(s, SKIPPY_SCHED_CALLBACK, "preemption policy failed");
            if (idx >= rem_len) break; /* the policy chose no victim */
        } else {
            idx = pick_victim_builtin(s, rem, rem_len);
        }
        uint32_t slot = rem[idx];
        memmove(rem + idx, rem + idx + 1, (rem_len - idx - 1) * sizeof(uint32_t));
        rem_len--;
        for (size_t i = 0; i < nc; i++)
            u[i] = sk_sat_sub(u[i], reservation(&s->comps[i], s->seqs[slot].admission_tokens));
        s->victims[nv++] = slot;
    }
    /* Joining the ranked set is the last step that can fail, so it comes before the commit. */
    for (size_t k = 0; k < nv; k++) {
        if (sk_waiting_add(s, s->victims[k], s->next_order + k)) {
            while (k-- > 0) sk_waiting_remove(s, s->victims[k]);
            return sk_fail(s, SKIPPY_SCHED_NO_MEMORY, "out of memory preempting");
        }
    }
    /* Commit. */
    memcpy(s->used, u, nc * sizeof(uint64_t));
    if (nv) {
        for (size_t k = 0; k < nv; k++) s->seqs[s->victims[k]].where = SK_WHERE_WAITING;
        size_t kept = 0;
        for (size_t i = 0; i < na; i++)
            if (s->seqs[s->active[i]].where == SK_WHERE_ACTIVE) s->active[kept++] = s->active[i];
        s->active_len = kept;
        memmove(s->waiting + nv, s->waiting, s->waiting_len * sizeof(uint32_t));
        for (size_t k = 0; k < nv; k++) {
            sk_seq *q = &s->seqs[s->victims[k]];
            s->n_class[sk_class(q)]--; /* left the active set */
            reset_for_recompute(q);
            q->enqueue_order = s->next_order++;
            s->waiting[nv - 1 - k] = s->victims[k];
        }
        s->waiting_len += nv;
        s->dirty = true;
        s->m.preempted = sk_sat_add(s->m.preempted, nv);
    }
    s->victim_len = nv;
    sk_refresh_counts(s);
    if (out_n) *out_n = nv;
    return 0;
}

skippy_status skippy_scheduler_preempt(skippy_scheduler *s, const uint64_t *used, size_t n,
                                       size_t *out_n, skippy_error **out_error)
{
    return sk_result(s, preempt(s, used, n, out_n), out_error);
}

/* ---------------------------------------------------------------- cancel (§2.9) */

bool skippy_scheduler_cancel(skippy_scheduler *s, const char *id, size_t len)
{
    uint32_t slot = sk_store_find(s, id, len, sk_hash_id(id, len));
    if (slot == SK_NO_SLOT) return false;
    size_t cap = s->retired_cap;
    if (sk_grow((void **)&s->retired, &cap, s->retired_len + 1, sizeof(skippy_retired))) {
        sk_fail(s, SKIPPY_SCHED_NO_MEMORY, "out of memory cancelling");
        return false;
    }
    s->retired_cap = cap;
    sk_seq *q = &s->seqs[slot];
    uint32_t *arr = q->where == SK_WHERE_ACTIVE ? s->active : s->waiting;
    size_t *len_p = q->where == SK_WHERE_ACTIVE ? &s->active_len : &s->waiting_len;
    for (size_t i = 0; i < *len_p; i++) {
        if (arr[i] != slot) continue;
        memmove(arr + i, arr + i + 1, (*len_p - i - 1) * sizeof(uint32_t));
        (*len_p)--;
        break;
    }
    if (q->where == SK_WHERE_ACTIVE) {
        release(s, q);
    } else {
        sk_waiting_remove(s, slot);
        s->dirty = true;
    }
    uint32_t keep = q->status;
    retire(s, slot, SKIPPY_SEQ_CANCELLED);
    s->retired[s->retired_len - 1].status = SKIPPY_SEQ_CANCELLED;
    q->status = (uint8_t)keep; /* the sequence's own status is not a cancellation state */
    s->m.cancelled = sk_sat_add(s->m.cancelled, 1);
    sk_refresh_counts(s);
    return true;
}
