/*
 * A sequence's moves between the waiting queue and the active set (docs/behaviour.md §2.3,
 * §2.8), the steps admission (sk_admit.c), preemption for priority (sk_priority.c) and
 * preemption for memory (sk_sched.c) share: admitting one sequence, requeueing one victim, and
 * room in the waiting array. They change one sequence, its memory reservation, its prefix pin
 * and the counters; which sequences move is the caller's decision, and so is the order of the
 * waiting and active arrays. Nothing here calls back into those callers.
 */
#include "sk_internal.h"

/* Waiting queue and scratch grow together so permutations always have room. */
int sk_reserve_waiting(skippy_scheduler *s, size_t need)
{
    size_t cap = s->waiting_cap, scratch_cap = s->waiting_cap;
    if (sk_grow((void **)&s->waiting, &cap, need, sizeof(uint32_t))) return -1;
    if (sk_grow((void **)&s->scratch, &scratch_cap, cap, sizeof(uint32_t))) return -1;
    s->waiting_cap = cap;
    return 0;
}

static void reserve(skippy_scheduler *s, const sk_seq *seq)
{
    for (size_t i = 0; i < s->cfg.memory_component_count; i++)
        s->used[i] = sk_sat_add(s->used[i], sk_reservation(&s->comps[i], seq->admission_tokens));
}

/* Moves a waiting sequence that fits into the active set (room in s->active is the caller's). */
void sk_admit_one(skippy_scheduler *s, uint32_t slot)
{
    sk_seq *seq = &s->seqs[slot];
    sk_waiting_remove(s, slot);
    reserve(s, seq);
    sk_affinity_pin(s, seq);
    seq->status = SKIPPY_SEQ_RUNNING;
    seq->admitted_at = ++s->admit_counter;
    seq->last_token_us = s->now_us; /* its slack counts from here until its first token */
    seq->where = SK_WHERE_ACTIVE;
    seq->fresh = true;
    seq->lead = SK_LEAD_NONE;
    seq->admit_gen = seq->gen_len;
    /* Held, its restore no better for it, and its leader still active (the leader's keep was
     * refused or came too late, not the leader gone): were it to lead, the next peer would wait
     * for a keep that fails the same way (§2.3a). */
    const sk_seq *leader = seq->held_steps ? &s->seqs[seq->held_on] : NULL;
    seq->no_lead = leader && leader->where == SK_WHERE_ACTIVE &&
                   leader->admitted_at == seq->held_on_admitted &&
                   (seq->has_restore ? seq->restore_tokens : 0) <= seq->held_restore;
    s->fresh_count++;
    s->n_class[sk_class(seq)]++;
    s->active[s->active_len++] = slot;
}

static void reset_for_recompute(sk_seq *seq)
{
    seq->pending = 0; /* its in-flight rows are void: the KV they would build is gone */
    seq->epoch++;
    seq->cursor = sk_restore_cursor(seq); /* the restored length, with §0.4b's rule */
    seq->status = SKIPPY_SEQ_PREEMPTED;
    seq->admitted_at = 0;
}

/*
 * A victim (no longer in the active set, already in the ranked set with order next_order)
 * becomes a preempted waiting sequence; the caller puts it in the waiting array.
 */
void sk_requeue_victim(skippy_scheduler *s, uint32_t slot)
{
    sk_seq *seq = &s->seqs[slot];
    seq->where = SK_WHERE_WAITING;
    s->n_class[sk_class(seq)]--; /* left the active set */
    sk_affinity_unpin(s, seq);
    sk_unfresh(s, seq);
    reset_for_recompute(seq);
    seq->held_steps = 0;
    sk_affinity_read(s, seq); /* with a store: what is resident now */
    seq->enqueue_order = s->next_order++;
    s->void_count++;
    s->dirty = true;
    s->m.preempted = sk_sat_add(s->m.preempted, 1);
}
