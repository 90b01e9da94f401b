/*
 * The prefill walk's order (docs/behaviour.md §2.13): which prefill-pending sequence a prefill
 * walk of a plan (sk_plan.c) visits next. Walk order, except under the slack rule with an age
 * bound > 0: first the overdue ones (submitted at least slack_prefill_age_max_us ago on the
 * scheduler's clock) in walk order, then the others by fewest remaining prefill tokens (replay
 * length - cursor), ties in walk order.
 *
 * One pass over the active set writes each candidate's key into a scratch array the scheduler
 * owns (sized with the active set before planning, so a step allocates nothing); each row then
 * takes the smallest key left, the first in walk order among equals. Overdue keys are 0 and the
 * others at least 1, so the overdue ones come first, in walk order. A plan emits few prefill
 * rows (the budget, the toll and max_prefill_sequences_per_iteration bound them), so a scan per
 * row costs less than sorting the candidates.
 *
 * NOTE: the keys are taken before the first row is written; each candidate gets at most one
 * row per plan, so the rows written meanwhile do not change the keys still to be read.
 */
#include <stdlib.h>

#include "sk_internal.h"

int sk_prefill_order_reserve(skippy_scheduler *s)
{
    size_t need = s->active_len ? s->active_len : 1;
    if (need <= s->prefill_keys_cap) return 0;
    size_t cap = s->prefill_keys_cap * 2;
    if (cap < 16) cap = 16;
    if (cap < need) cap = need;
    if (sk_resize((void **)&s->prefill_keys, cap, sizeof(sk_prefill_key))) return -1;
    s->prefill_keys_cap = cap;
    return 0;
}

static void collect(skippy_scheduler *s, bool disjoint)
{
    const uint32_t *active = s->active;
    const sk_seq *seqs = s->seqs;
    sk_prefill_key *keys = s->prefill_keys;
    double now = s->now_us, age_max = s->cfg.slack_prefill_age_max_us;
    size_t len = 0;
    for (size_t at = 0, n = s->active_len; at < n; at++) {
        const sk_seq *seq = &seqs[active[at]];
        if (!prefill_pending(seq) || (disjoint && sk_in_flight(s, seq))) continue;
        keys[len].slot = active[at];
        keys[len].key = now - seq->submitted_us >= age_max ? 0 : sk_replay_len(seq) - seq->cursor;
        len++;
    }
    s->prefill_keys_len = len;
}

/* With a single candidate both orders are the same, so the key pass is skipped; age bound 0
 * is the walk order by definition (every sequence is overdue at once). */
sk_prefill_walk sk_prefill_walk_begin(skippy_scheduler *s, bool disjoint)
{
    sk_prefill_walk walk = {false, disjoint, 0};
    if (s->cfg.planning_rule == SKIPPY_PLANNING_SLACK && s->cfg.slack_prefill_age_max_us > 0.0 &&
        s->n_class[SK_CLASS_PREFILL] > 1) {
        collect(s, disjoint);
        walk.ordered = true;
    }
    return walk;
}

static uint32_t next_by_key(skippy_scheduler *s)
{
    sk_prefill_key *keys = s->prefill_keys;
    size_t best = SIZE_MAX, best_key = SIZE_MAX;
    for (size_t i = 0, n = s->prefill_keys_len; i < n; i++) {
        if (keys[i].key < best_key) {
            best_key = keys[i].key;
            best = i;
            if (best_key == 0) break; /* an overdue one: none goes before it */
        }
    }
    if (best == SIZE_MAX) return SK_NO_SLOT;
    keys[best].key = SIZE_MAX;
    return keys[best].slot;
}

uint32_t sk_prefill_walk_next(skippy_scheduler *s, sk_prefill_walk *walk)
{
    if (walk->ordered) return next_by_key(s);
    while (walk->at < s->active_len) {
        uint32_t slot = s->active[walk->at++];
        const sk_seq *seq = &s->seqs[slot];
        if (prefill_pending(seq) && !(walk->disjoint && sk_in_flight(s, seq))) return slot;
    }
    return SK_NO_SLOT;
}
