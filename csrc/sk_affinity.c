/*
 * Cache affinity read from an attached prefix store (docs/behaviour.md §2.12).
 *
 * Without a store the caller gives each sequence its restore and saved cost at submit and the
 * core only carries them (§3.5). With a store the core reads them itself: at submit, when a
 * preempted sequence re-enters the queue, and before every admission selection for exactly the
 * waiting sequences whose prompt lies under a prefix the store inserted or evicted since (the
 * store's change journal, looked up in the waiting-prompt tree of sk_rank_set). A re-read that
 * changes a sequence's restore or saved cost is a stale refresh: the sequence is re-ranked and
 * the counter rises. A match reads the sequence's replay, not only its prompt: a preempted
 * sequence whose computed tokens the host kept resident restores them, generated tokens
 * included, instead of recomputing them. The entry a sequence is admitted with is pinned until
 * the sequence leaves the active set, so the host can copy it at any point while it runs.
 */
#include <stdlib.h>

#include "sk_internal.h"
#include "sk_prefix.h"

size_t sk_restore_cursor(const sk_seq *seq)
{
    size_t replay = sk_replay_len(seq);
    size_t cursor = seq->has_restore ? seq->restore_tokens : 0;
    if (cursor > replay) cursor = replay;
    /* §0.4b: without a pending token keep one replay token runnable */
    if (seq->gen_len == 0 && cursor >= replay) cursor = replay - 1;
    return cursor;
}

static uint64_t saved_cost(const skippy_scheduler *s, size_t matched)
{
    return sk_sat_sub(sk_sat_mul(matched, s->aff_prefill_cost),
                      sk_sat_mul(matched, s->aff_restore_cost));
}

/* The restore the store backs `matched` prompt tokens of the sequence with. (Which entry backs
 * it is looked up when the sequence is admitted and pinned.) */
static void set_affinity(skippy_scheduler *s, sk_seq *seq, size_t matched)
{
    seq->has_restore = matched > 0;
    seq->restore_tokens = matched;
    seq->saved_cost = saved_cost(s, matched);
    seq->cache_epoch = sk_prefix_epoch(s->store);
    seq->cursor = sk_restore_cursor(seq);
    if (s->rank_set && seq->where == SK_WHERE_WAITING)
        sk_rank_set_update(s->rank_set, seq->rank_handle, seq->priority, seq->saved_cost,
                           seq->enqueued_turn);
}

void sk_affinity_read(skippy_scheduler *s, sk_seq *seq)
{
    if (!s->store) return;
    size_t matched = 0;
    skippy_prefix_store_match(s->store, seq->tokens, sk_affinity_key_len(seq), &matched);
    set_affinity(s, seq, matched);
}

/* A re-read of a waiting sequence that found `matched` restorable tokens. */
static void reread_as(skippy_scheduler *s, sk_seq *seq, size_t matched)
{
    /* The same restore: the epoch of the observation still in force stays, and the ranked
     * set has nothing to learn. */
    if (seq->restore_tokens == matched && seq->saved_cost == saved_cost(s, matched)) return;
    set_affinity(s, seq, matched);
    s->m.stale_refreshes = sk_sat_add(s->m.stale_refreshes, 1);
    s->dirty = true;
}

static void reread(skippy_scheduler *s, sk_seq *seq, uint32_t round)
{
    if (seq->probe_round == round) return;
    seq->probe_round = round;
    size_t matched = 0;
    skippy_prefix_store_match(s->store, seq->tokens, sk_affinity_key_len(seq), &matched);
    reread_as(s, seq, matched);
}

/*
 * A waiting sequence with generated tokens (a preempted one) matches its replay, which runs
 * past its prompt, so the waiting-prompt tree cannot tell which changes concern it. There are
 * few of them (sk_waiting.c lists them as they enter and leave the tree): each is re-read
 * whenever the store changed.
 */
static void reread_resumers(skippy_scheduler *s, uint32_t round)
{
    for (size_t i = 0; i < s->resumers_len; i++) reread(s, &s->seqs[s->resumers[i]], round);
}

/*
 * In a long queue a re-read is dominated by cache misses: the sequence's slot and its prompt
 * are cold, and the prompts under a changed prefix are scattered. The refresh loop therefore
 * fetches the slots REREAD_AHEAD re-reads ahead and, once a slot has arrived (half that
 * distance later), the first PROMPT_LINES lines of its prompt (256 tokens, what a match against
 * a shared prefix compares), so the misses of several re-reads overlap instead of following one
 * another.
 */
#define REREAD_AHEAD 16
#define PROMPT_LINES 16

static inline void fetch_slot(const skippy_scheduler *s, uint32_t handle)
{
#if defined(__GNUC__)
    const char *q = (const char *)&s->seqs[s->rank_slot[handle]];
    for (size_t off = 0; off < sizeof(sk_seq); off += SK_SEQ_ALIGN) __builtin_prefetch(q + off);
#else
    (void)s, (void)handle;
#endif
}

static inline void fetch_prompt(const skippy_scheduler *s, uint32_t handle)
{
#if defined(__GNUC__)
    const sk_seq *q = &s->seqs[s->rank_slot[handle]];
    size_t lines = (q->prompt_len * sizeof(int32_t) + SK_SEQ_ALIGN - 1) / SK_SEQ_ALIGN;
    for (size_t i = 0; i < lines && i < PROMPT_LINES; i++)
        __builtin_prefetch((const char *)q->tokens + i * SK_SEQ_ALIGN);
#else
    (void)s, (void)handle;
#endif
}

/* Re-reads the `count` waiting sequences under one changed prefix `key` (handles in s->under). */
static void reread_under(skippy_scheduler *s, const int32_t *key, size_t len, size_t count,
                         uint32_t round)
{
    const uint32_t *under = s->under;
    size_t m = 0;
    skippy_prefix_store_match(s->store, key, len, &m);
    if (m < len) {
        /* The resident keys leave this prefix after m tokens, and every prompt under it starts
         * with the whole prefix: each is backed by the same m tokens of the same entry, which
         * matching its own tokens would only find again (at the price of reading them). */
        for (size_t k = 0; k < count && k < REREAD_AHEAD; k++) fetch_slot(s, under[k]);
        for (size_t k = 0; k < count; k++) {
            if (k + REREAD_AHEAD < count) fetch_slot(s, under[k + REREAD_AHEAD]);
            sk_seq *seq = &s->seqs[s->rank_slot[under[k]]];
            if (seq->probe_round == round) continue;
            seq->probe_round = round;
            reread_as(s, seq, m);
        }
        return;
    }
    for (size_t k = 0; k < count && k < REREAD_AHEAD; k++) {
        fetch_slot(s, under[k]);
        if (k < REREAD_AHEAD / 2) fetch_prompt(s, under[k]);
    }
    for (size_t k = 0; k < count; k++) {
        if (k + REREAD_AHEAD < count) fetch_slot(s, under[k + REREAD_AHEAD]);
        if (k + REREAD_AHEAD / 2 < count) fetch_prompt(s, under[k + REREAD_AHEAD / 2]);
        reread(s, &s->seqs[s->rank_slot[under[k]]], round);
    }
}

int sk_affinity_refresh(skippy_scheduler *s)
{
    if (!s->store) return 0;
    uint64_t epoch = sk_prefix_epoch(s->store);
    if (epoch == s->store_epoch_seen) return 0;
    size_t n_changes;
    const int32_t *pool;
    bool overflow;
    const sk_prefix_change *changes = sk_prefix_journal(s->store, &n_changes, &pool, &overflow);
    uint32_t round = ++s->probe_round;
    if (overflow || !s->rank_set) {
        for (size_t i = 0; i < s->waiting_len; i++) reread(s, &s->seqs[s->waiting[i]], round);
    } else if (s->waiting_len) {
        if (sk_grow((void **)&s->under, &s->under_cap, sk_rank_set_size(s->rank_set) + 1,
                    sizeof(uint32_t)))
            return sk_fail(s, SKIPPY_SCHED_NO_MEMORY, "out of memory refreshing cache affinity");
        for (size_t c = 0; c < n_changes; c++) {
            size_t count = 0;
            if (sk_rank_set_under(s->rank_set, pool + changes[c].offset, changes[c].length,
                                  s->under, &count))
                return sk_fail(s, SKIPPY_SCHED_NO_MEMORY,
                               "out of memory refreshing cache affinity");
            reread_under(s, pool + changes[c].offset, changes[c].length, count, round);
        }
        reread_resumers(s, round);
    }
    sk_prefix_journal_clear(s->store);
    s->store_epoch_seen = epoch;
    return 0;
}

void sk_affinity_pin(skippy_scheduler *s, sk_seq *seq)
{
    if (!s->store) return;
    if (seq->has_restore) {
        /* The entry backing the restore is looked up now: the journal only records changes of
         * match lengths, and another entry may have come to back the same tokens since the
         * read. Should it not pin (it cannot fail after a refresh), the sequence runs without
         * the restore rather than with one no host could copy. */
        size_t matched = 0;
        uint32_t entry = skippy_prefix_store_match(s->store, seq->tokens,
                                                   sk_affinity_key_len(seq), &matched);
        if (entry != SKIPPY_PREFIX_NONE && matched >= seq->restore_tokens &&
            skippy_prefix_store_pin(s->store, entry) == SKIPPY_SCHED_OK) {
            seq->pinned_entry = entry;
        } else {
            seq->has_restore = false;
            seq->restore_tokens = 0;
            seq->saved_cost = 0;
            seq->cursor = sk_restore_cursor(seq);
        }
    }
    if (seq->has_restore) {
        s->m.prefix_hits = sk_sat_add(s->m.prefix_hits, 1);
        s->m.restored_tokens = sk_sat_add(s->m.restored_tokens, seq->restore_tokens);
    } else {
        s->m.prefix_misses = sk_sat_add(s->m.prefix_misses, 1);
    }
}

void sk_affinity_unpin(skippy_scheduler *s, sk_seq *seq)
{
    if (s->store && seq->pinned_entry != SKIPPY_PREFIX_NONE)
        skippy_prefix_store_unpin(s->store, seq->pinned_entry);
    seq->pinned_entry = SKIPPY_PREFIX_NONE;
}

void sk_affinity_release_pins(skippy_scheduler *s)
{
    if (!s->store) return;
    /* The scheduler is going away but the store stays (a host's store outlives it). */
    for (uint32_t i = 0; i < s->seq_cap; i++) sk_affinity_unpin(s, &s->seqs[i]);
}

void sk_affinity_detach_store(skippy_scheduler *s)
{
    if (!s->store) return;
    /* The store is going away: what the sequences point at in it goes with it. */
    for (uint32_t i = 0; i < s->seq_cap; i++) {
        s->seqs[i].pinned_entry = SKIPPY_PREFIX_NONE;
    }
    sk_prefix_set_owner(s->store, NULL, NULL);
    s->store = NULL;
}

static int set_store(skippy_scheduler *s, skippy_prefix_store *store, uint64_t prefill_cost,
                     uint64_t restore_cost)
{
    if (s->waiting_len || s->active_len || s->live_count)
        return sk_fail(s, SKIPPY_SCHED_INVALID, "a prefix store can only be attached or detached "
                       "while the scheduler holds no sequence and no live plan");
    if (store && sk_prefix_owner(store) && sk_prefix_owner(store) != s)
        return sk_fail(s, SKIPPY_SCHED_INVALID, "the prefix store serves another scheduler");
    if (store && !s->rank_set) {
        /* The waiting-prompt tree finds the sequences under a changed prefix; policies that do
         * not rank with it keep it as an index only (rank_by_set stays false). */
        s->rank_set = sk_rank_set_new();
        if (!s->rank_set)
            return sk_fail(s, SKIPPY_SCHED_NO_MEMORY, "out of memory attaching a prefix store");
    }
    if (s->store && s->store != store) sk_affinity_detach_store(s);
    s->store = store;
    s->aff_prefill_cost = prefill_cost;
    s->aff_restore_cost = restore_cost;
    if (store) {
        sk_prefix_set_owner(store, s, sk_affinity_detach_store);
        s->store_epoch_seen = sk_prefix_epoch(store);
    }
    return 0;
}

skippy_status skippy_scheduler_set_prefix_store(skippy_scheduler *s, skippy_prefix_store *store,
                                                uint64_t prefill_cost_per_token,
                                                uint64_t restore_cost_per_token,
                                                skippy_error **out_error)
{
    if (!s) return SK_NO_SCHEDULER(out_error);
    return sk_result(s, set_store(s, store, prefill_cost_per_token, restore_cost_per_token),
                     out_error);
}

skippy_prefix_store *skippy_scheduler_prefix_store(const skippy_scheduler *s)
{
    return s ? s->store : NULL;
}
