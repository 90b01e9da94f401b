/*
 * The waiting queue's order (behaviour.md §2.3 step 1, §3).
 *
 * The cache-aware policy with prefix grouping (the default) keeps every waiting sequence in one
 * persistent sk_rank_set: a sequence enters it when it enters the queue (submit, preemption) and
 * leaves it when it leaves the queue (admission, cancel), so a dirty re-rank walks the existing
 * prefix tree instead of re-reading every waiting prompt. The other built-in policies never
 * read prompts, and one radix sort of the queue costs them less than the set's upkeep, so they
 * rank the whole queue with sk_rank_order; a user policy (SKIPPY_ADMISSION_CALLBACK) is handed
 * the whole queue as before. Fair share (SKIPPY_ADMISSION_FAIR_SHARE) ranks the whole queue
 * cache-aware with sk_rank_order, then sk_fair_order interleaves the tenants (sk_fair.c).
 *
 * The set breaks exact ties by insertion, ranking the queue in place would break them by queue
 * position; neither is ever consulted, because every policy's last key is enqueue_order and that
 * is unique among live sequences (next_order only grows, and a preempted sequence is re-added
 * with a fresh one). So the order is the one sk_rank_order gives for the queue.
 *
 * With a prefix store attached (sk_affinity.c) every policy keeps the set, as the index that
 * finds the waiting prompts under a changed prefix; only the grouped cache-aware order ranks
 * with it (rank_by_set).
 *
 * The set reads the prompt through the sequence's token buffer without copying it. That buffer
 * is only reallocated when a generated token is appended, which happens to active sequences
 * only, or when submit reuses a free slot, which a sequence reaches only after leaving the set.
 */
#include <stdlib.h>
#include <string.h>

#include "sk_internal.h"
#include "sk_fair.h"

static int rank_mode(const skippy_scheduler *s)
{
    return s->cfg.admission_policy == SKIPPY_ADMISSION_FCFS       ? SK_RANK_FCFS
           : s->cfg.admission_policy == SKIPPY_ADMISSION_PRIORITY ? SK_RANK_PRIORITY
                                                                  : SK_RANK_CACHE_AWARE;
}

int sk_waiting_init(skippy_scheduler *s)
{
    if (s->cfg.admission_policy == SKIPPY_ADMISSION_CALLBACK) return 0;
    if (s->cfg.admission_policy == SKIPPY_ADMISSION_FAIR_SHARE && !(s->fair = sk_fair_new()))
        return -1;
    if (s->cfg.admission_policy == SKIPPY_ADMISSION_CACHE_AWARE && s->cfg.group_waiting_prefixes) {
        s->rank_set = sk_rank_set_new();
        s->rank_by_set = true;
        return s->rank_set ? 0 : -1;
    }
    s->rank_ws = sk_rank_ws_new();
    return s->rank_ws ? 0 : -1;
}

void sk_waiting_free(skippy_scheduler *s)
{
    sk_rank_set_free(s->rank_set);
    free(s->rank_slot);
    free(s->resumers);
    sk_rank_ws_free(s->rank_ws);
    free(s->rank_items);
    free(s->rank_out);
    sk_fair_free(s->fair);
}

int sk_waiting_add(skippy_scheduler *s, uint32_t slot, uint64_t order)
{
    if (!s->rank_set) return 0;
    /* A fresh handle equals the live count (no handle is free then) and a reused one is below
     * an earlier fresh one, so a table of live + 1 entries, never shrunk, covers every handle. */
    if (sk_grow((void **)&s->rank_slot, &s->rank_slot_cap, sk_rank_set_size(s->rank_set) + 1,
                sizeof(uint32_t)))
        return -1;
    sk_seq *q = &s->seqs[slot];
    /* A waiting sequence's tokens do not change, so one with generated tokens is listed from
     * here until it leaves the set (sk_affinity.c re-reads them). */
    if (q->gen_len && sk_grow((void **)&s->resumers, &s->resumers_cap, s->resumers_len + 1,
                              sizeof(uint32_t)))
        return -1;
    sk_rank_item it = {q->priority, q->saved_cost, q->enqueued_turn, order, q->tokens,
                       q->prompt_len, sk_rank_deadline_key(q->ttft_deadline_us)};
    uint32_t h;
    if (sk_rank_set_add(s->rank_set, &it, &h)) return -1;
    s->rank_slot[h] = slot;
    q->rank_handle = h;
    if (q->gen_len) s->resumers[s->resumers_len++] = slot;
    return 0;
}

void sk_waiting_remove(skippy_scheduler *s, uint32_t slot)
{
    if (!s->rank_set) return;
    sk_rank_set_remove(s->rank_set, s->seqs[slot].rank_handle);
    if (!s->seqs[slot].gen_len) return;
    for (size_t i = 0; i < s->resumers_len; i++) {
        if (s->resumers[i] != slot) continue;
        s->resumers[i] = s->resumers[--s->resumers_len];
        break;
    }
}

/* Without the prefix tree: the user policy, or the one-shot kernel over the queue. */
static int rank_whole_queue(skippy_scheduler *s)
{
    size_t n = s->waiting_len;
    if (n > s->rank_cap) {
        size_t cap = s->rank_cap, cap2 = s->rank_cap;
        if (sk_grow((void **)&s->rank_out, &cap, n, sizeof(size_t)) ||
            sk_grow((void **)&s->rank_items, &cap2, cap, sizeof(sk_rank_item)))
            return sk_fail(s, SKIPPY_SCHED_NO_MEMORY, "out of memory ranking the waiting queue");
        s->rank_cap = cap;
    }
    if (s->cfg.admission_policy == SKIPPY_ADMISSION_CALLBACK) {
        if (!s->rank_cb) return sk_fail(s, SKIPPY_SCHED_CALLBACK, "no rank callback installed");
        if (s->rank_cb(s->cb_ctx, s, s->waiting, n, s->waiting_turn, s->rank_out))
            return sk_fail(s, SKIPPY_SCHED_CALLBACK, "admission policy failed");
    } else {
        sk_rank_item *items = s->rank_items;
        for (size_t i = 0; i < n; i++) {
            const sk_seq *q = &s->seqs[s->waiting[i]];
            sk_rank_item it = {q->priority, q->saved_cost, q->enqueued_turn, q->enqueue_order,
                               q->tokens, q->prompt_len,
                               sk_rank_deadline_key(q->ttft_deadline_us)};
            items[i] = it;
        }
        if (sk_rank_order(s->rank_ws, items, n, s->waiting_turn,
                          s->cfg.cache_aging_cost_per_iteration, s->cfg.group_waiting_prefixes,
                          rank_mode(s), s->rank_out))
            return sk_fail(s, SKIPPY_SCHED_NO_MEMORY, "out of memory ranking the waiting queue");
        if (s->fair && sk_fair_order(s, s->rank_out, n))
            return sk_fail(s, SKIPPY_SCHED_NO_MEMORY, "out of memory ranking the waiting queue");
    }
    /* Apply only a complete permutation (the reference's defensive check). */
    uint8_t *seen = (uint8_t *)s->scratch; /* n bytes fit in n uint32 */
    memset(seen, 0, n);
    for (size_t i = 0; i < n; i++) {
        size_t k = s->rank_out[i];
        if (k >= n || seen[k]) return 0;
        seen[k] = 1;
    }
    for (size_t i = 0; i < n; i++) s->scratch[i] = s->waiting[s->rank_out[i]];
    memcpy(s->waiting, s->scratch, n * sizeof(uint32_t));
    return 0;
}

int sk_waiting_rank(skippy_scheduler *s)
{
    size_t n = s->waiting_len;
    if (n == 0) return 0;
    if (!s->rank_by_set) return rank_whole_queue(s);
    if (sk_rank_set_size(s->rank_set) != n) return 0; /* cannot happen; keep the queue as is */
    uint32_t *order = s->scratch; /* waiting_cap >= n entries */
    if (sk_rank_set_order(s->rank_set, s->waiting_turn, s->cfg.cache_aging_cost_per_iteration,
                          s->cfg.group_waiting_prefixes, rank_mode(s), order))
        return sk_fail(s, SKIPPY_SCHED_NO_MEMORY, "out of memory ranking the waiting queue");
    for (size_t i = 0; i < n; i++) s->waiting[i] = s->rank_slot[order[i]];
    return 0;
}
