/*
 * The prefill walk's order (docs/behaviour.md §2.13): which prefill-pending sequence a prefill
 * walk of a plan (sk_plan.c) visits next. Walk order, except under the slack rule with an age
 * bound > 0, where the candidates go in four classes:
 *   1. overdue (submitted at least slack_prefill_age_max_us ago on the scheduler's clock, or
 *      for a first-token deadline still to meet, that long past the deadline), in walk order;
 *   2. those with a first-token deadline still to meet (no token planned yet) that can meet
 *      it, in the order that meets all of them with the least total time to first token
 *      (Smith's rule, below; among equal deadlines that is fewest tokens left first);
 *   3. those without one, fewest remaining prefill tokens (replay length - cursor) first;
 *   4. those whose deadline cannot be met in this order (relegated), fewest tokens left first;
 * ties in walk order. Without deadlines classes 2 and 4 are empty and the order is the
 * overdue-then-shortest order it always was.
 *
 * Which deadlines can be met is Moore and Hodgson's rule for the most jobs on time on one
 * machine: in that order (deadline, then tokens left), each candidate's prefill is predicted
 * to end at now + base_us + per_prefill_token_us x (the tokens left of the overdue ones, of
 * those kept before it and its own); when one would end after its deadline, the kept one with
 * the most tokens left (the first of equals) is relegated and its tokens no longer count. The
 * ones kept are then ordered by Smith's backward rule (W. E. Smith, Naval Research Logistics
 * Quarterly 3, 1956: least total completion time subject to every deadline): starting from the
 * predicted end of them all, the last place goes to the one with the most tokens left among
 * those whose deadline is not before that end (the latest in deadline order among equals; the
 * latest in deadline order outright if rounding left none), the end moves back by its
 * prediction, and so on to the first place. Sums are taken in these orders in core and twin
 * alike.
 *
 * One pass over the active set writes each candidate's class into a scratch array the
 * scheduler owns (sized with the active set before planning, so a step allocates nothing);
 * each row then takes the first of the smallest key left. A plan emits few prefill rows (the
 * budget, the toll and max_prefill_sequences_per_iteration bound them), so a scan per row costs
 * less than sorting the candidates; only the deadline class is sorted, by insertion into a
 * second scratch array, and only when it has members.
 *
 * NOTE: the keys are taken before the first row is written; each candidate gets at most one
 * row per plan, so the rows written meanwhile do not change the keys still to be read.
 */
#include <stdlib.h>

#include "sk_internal.h"

int sk_prefill_order_reserve(skippy_scheduler *s, size_t active_most)
{
    size_t need = active_most ? active_most : 1;
    if (need <= s->prefill_keys_cap) return 0;
    size_t cap = s->prefill_keys_cap * 2;
    if (cap < 16) cap = 16;
    if (cap < need) cap = need;
    if (sk_resize((void **)&s->prefill_keys, cap, sizeof(sk_prefill_key))) return -1;
    if (sk_resize((void **)&s->prefill_edf, cap, sizeof(uint32_t))) return -1;
    s->prefill_keys_cap = cap;
    return 0;
}

/* a goes before b in the deadline class: nearer deadline, then fewer tokens left (among equal
 * deadlines the shortest first brings the most of them within it); the rest in walk order. */
static inline bool edf_before(const sk_prefill_key *a, const sk_prefill_key *b)
{
    if (a->deadline_us != b->deadline_us) return a->deadline_us < b->deadline_us;
    return a->left < b->left;
}

/* Smith's backward rule over the kept members of order[0..n) (file comment): ranks them, 0
 * first; `end` is the predicted end of them all. */
static void smith_order(sk_prefill_key *keys, const uint32_t *order, size_t n, double end,
                        double per_token)
{
    uint32_t kept = 0;
    for (size_t k = 0; k < n; k++) {
        if (keys[order[k]].cls != SK_PF_DEADLINE) continue;
        keys[order[k]].rank = UINT32_MAX; /* not placed yet */
        kept++;
    }
    for (uint32_t place = kept; place-- > 0;) {
        size_t pick = SIZE_MAX, latest = SIZE_MAX;
        for (size_t k = 0; k < n; k++) {
            const sk_prefill_key *key = &keys[order[k]];
            if (key->cls != SK_PF_DEADLINE || key->rank != UINT32_MAX) continue;
            latest = k;
            if (key->deadline_us >= end &&
                (pick == SIZE_MAX || key->left >= keys[order[pick]].left))
                pick = k;
        }
        sk_prefill_key *last = &keys[order[pick != SIZE_MAX ? pick : latest]];
        last->rank = place;
        end -= per_token * (double)last->left;
    }
}

/* Moore-Hodgson over the deadline class (file comment): `ahead` is the overdue candidates'
 * predicted prefill time, summed in walk order. */
static void relegate(skippy_scheduler *s, double ahead)
{
    sk_prefill_key *keys = s->prefill_keys;
    uint32_t *order = s->prefill_edf;
    size_t n = 0;
    for (size_t i = 0, len = s->prefill_keys_len; i < len; i++) {
        if (keys[i].cls != SK_PF_DEADLINE) continue;
        size_t at = n++;
        while (at > 0 && edf_before(&keys[i], &keys[order[at - 1]])) {
            order[at] = order[at - 1];
            at--;
        }
        order[at] = (uint32_t)i;
    }
    double per_token = s->cost.per_prefill_token_us;
    double end = s->now_us + s->cost.base_us + ahead;
    for (size_t k = 0; k < n; k++) {
        sk_prefill_key *key = &keys[order[k]];
        end += per_token * (double)key->left;
        if (!(end > key->deadline_us)) continue;
        size_t longest = SIZE_MAX;
        for (size_t j = 0; j <= k; j++) {
            const sk_prefill_key *kept = &keys[order[j]];
            if (kept->cls == SK_PF_DEADLINE &&
                (longest == SIZE_MAX || kept->left > keys[order[longest]].left))
                longest = j;
        }
        sk_prefill_key *out = &keys[order[longest]];
        out->cls = SK_PF_RELEGATED;
        end -= per_token * (double)out->left;
        sk_seq *seq = &s->seqs[out->slot];
        if (!seq->slo_relegated) {
            seq->slo_relegated = true;
            s->m.slo_relegated = sk_sat_add(s->m.slo_relegated, 1);
        }
    }
    smith_order(keys, order, n, end, per_token);
}

static void collect(skippy_scheduler *s, bool disjoint)
{
    const uint32_t *active = s->active;
    const sk_seq *seqs = s->seqs;
    sk_prefill_key *keys = s->prefill_keys;
    double now = s->now_us, age_max = s->cfg.slack_prefill_age_max_us;
    double per_token = s->cost.per_prefill_token_us, ahead = 0.0;
    size_t len = 0, n_deadline = 0;
    for (size_t at = 0, n = s->active_len; at < n; at++) {
        const sk_seq *seq = &seqs[active[at]];
        if (!prefill_pending(seq) || (disjoint && sk_in_flight(s, seq))) continue;
        sk_prefill_key *key = &keys[len++];
        key->slot = active[at];
        key->left = sk_replay_len(seq) - seq->cursor;
        key->deadline_us = 0.0;
        key->rank = 0;
        /* a first-token deadline still to meet: the age bound counts from the deadline */
        bool first = sk_first_pending(seq);
        double since = first && seq->ttft_deadline_us > seq->submitted_us ? seq->ttft_deadline_us
                                                                           : seq->submitted_us;
        if (now - since >= age_max) {
            key->cls = SK_PF_OVERDUE;
            ahead += per_token * (double)key->left;
        } else if (first) {
            key->cls = SK_PF_DEADLINE;
            key->deadline_us = seq->ttft_deadline_us;
            n_deadline++;
        } else {
            key->cls = SK_PF_FREE;
        }
    }
    s->prefill_keys_len = len;
    if (n_deadline && len > 1) relegate(s, ahead); /* one alone goes first anyway */
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

/* a goes before b: class, then the deadline (SK_PF_DEADLINE) or the tokens left. */
static inline bool goes_before(const sk_prefill_key *a, const sk_prefill_key *b)
{
    if (a->cls != b->cls) return a->cls < b->cls;
    if (a->cls == SK_PF_DEADLINE) return a->rank < b->rank;
    return a->left < b->left;
}

static uint32_t next_by_key(skippy_scheduler *s)
{
    sk_prefill_key *keys = s->prefill_keys;
    size_t best = SIZE_MAX;
    for (size_t i = 0, n = s->prefill_keys_len; i < n; i++) {
        if (keys[i].cls == SK_PF_TAKEN) continue;
        if (keys[i].cls == SK_PF_OVERDUE) { /* none goes before it */
            best = i;
            break;
        }
        if (best == SIZE_MAX || goes_before(&keys[i], &keys[best])) best = i;
    }
    if (best == SIZE_MAX) return SK_NO_SLOT;
    keys[best].cls = SK_PF_TAKEN;
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
