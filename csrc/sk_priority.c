/*
 * Preemption for priority (docs/behaviour.md §2.8a), a departure from the reference scheduler,
 * on only with cfg.priority_preemption. After the admission pass, each waiting sequence in
 * queue order that still cannot be admitted (no lane, or its reservation does not fit) may take
 * what it lacks from running sequences of strictly lower priority: victims are the lowest
 * priority first, then the most recently admitted, taken one at a time until the waiting
 * sequence fits, and none at all when the eligible victims cannot make it fit. A sequence
 * preempted for priority is not preempted for priority again during the next
 * priority_preemption_guard_steps plans, and one plan makes at most
 * max_priority_preemptions_per_step such preemptions. Victims go back to waiting with the
 * recompute semantics of a memory preemption (§2.8), at the queue's front, last victim first.
 *
 * Under the cold prefix hold (§2.3a) a sequence the walk held stays waiting, and one this pass
 * would admit, with or without victims, is first put to the hold as the walk does: held, it is
 * not admitted and takes no victim.
 *
 * Admission (sk_admit.c) runs it after its pass; the moves of the victims and of the sequences
 * they make room for are sk_move.c's.
 */
#include <string.h>

#include "sk_internal.h"

static bool guarded(const skippy_scheduler *s, const sk_seq *seq, uint64_t step)
{
    if (seq->prio_preempted_at == 0) return false;
    return step - (seq->prio_preempted_at - 1) < s->cfg.priority_preemption_guard_steps;
}

static bool chosen(const uint32_t *victims, size_t from, size_t to, uint32_t slot)
{
    for (size_t i = from; i < to; i++)
        if (victims[i] == slot) return true;
    return false;
}

/* The next victim for `want` among the active set (not yet chosen), or SK_NO_SLOT. */
static uint32_t pick(const skippy_scheduler *s, const sk_seq *want, const uint32_t *victims,
                     size_t from, size_t to, uint64_t step)
{
    uint32_t best = SK_NO_SLOT;
    for (size_t i = 0; i < s->active_len; i++) {
        uint32_t slot = s->active[i];
        const sk_seq *seq = &s->seqs[slot];
        if (seq->priority >= want->priority || guarded(s, seq, step) ||
            chosen(victims, from, to, slot))
            continue;
        if (best != SK_NO_SLOT) {
            const sk_seq *b = &s->seqs[best];
            if (seq->priority != b->priority ? seq->priority > b->priority
                                             : seq->admitted_at < b->admitted_at)
                continue;
        }
        best = slot;
    }
    return best;
}

static bool admissible(const skippy_scheduler *s, const uint64_t *used, size_t lanes_freed,
                       const sk_seq *want)
{
    return s->active_len - lanes_freed < s->cfg.max_active_sequences &&
           sk_fits_on(s, used, want);
}

/* Room for every victim in the waiting array and for every admission in the active set, so
 * the pass itself allocates nothing but the ranked set's entries. */
int sk_priority_reserve(skippy_scheduler *s)
{
    size_t budget = s->cfg.max_priority_preemptions_per_step;
    size_t most = s->active_len + s->waiting_len; /* distinct victims at most */
    size_t cap = s->prio_victim_cap, room = budget < most ? budget : most;
    if (sk_grow((void **)&s->prio_victims, &cap, room ? room : 1, sizeof(uint32_t))) return -1;
    s->prio_victim_cap = cap;
    if (sk_reserve_waiting(s, s->waiting_len + room) ||
        sk_grow((void **)&s->active, &s->active_cap, s->cfg.max_active_sequences,
                sizeof(uint32_t)))
        return -1;
    return 0;
}

void sk_priority_preempt(skippy_scheduler *s, size_t *admitted)
{
    size_t budget = s->cfg.max_priority_preemptions_per_step;
    if (budget == 0 || s->waiting_len == 0 || s->active_len == 0) return;
    uint64_t step = s->plan_serial;
    size_t nc = s->cfg.memory_component_count, taken = 0, kept = 0;
    uint64_t *trial = s->used_scratch;
    bool hold = s->cfg.cold_prefix_hold_tokens && s->store; /* §2.3a */
    for (size_t w = 0; w < s->waiting_len; w++) {
        uint32_t want_slot = s->waiting[w];
        sk_seq *want = &s->seqs[want_slot];
        /* Held for a leader by this plan's admission walk: neither admitted nor preempting. */
        if (hold && want->held_walk == s->admit_walks) {
            s->waiting[kept++] = want_slot;
            continue;
        }
        bool admit = admissible(s, s->used, 0, want);
        size_t first = taken;
        if (admit) {
            admit = !(hold && sk_hold(s, want));
        } else if (taken < budget) {
            memcpy(trial, s->used, nc * sizeof(uint64_t));
            while (!admissible(s, trial, taken - first, want) && taken < budget) {
                uint32_t v = pick(s, want, s->prio_victims, first, taken, step);
                if (v == SK_NO_SLOT) break;
                for (size_t i = 0; i < nc; i++)
                    trial[i] = sk_sat_sub(trial[i], sk_reservation(&s->comps[i],
                                                                   s->seqs[v].admission_tokens));
                s->prio_victims[taken++] = v;
            }
            /* What would admit it is checked against the hold as the walk does (§2.3a). */
            admit = admissible(s, trial, taken - first, want) && !(hold && sk_hold(s, want));
            for (size_t nth = first; admit && nth < taken; nth++) {
                if (sk_waiting_add(s, s->prio_victims[nth], s->next_order + (nth - first))) {
                    while (nth-- > first) sk_waiting_remove(s, s->prio_victims[nth]);
                    admit = false;
                    budget = 0; /* out of memory: no more preemption in this plan */
                }
            }
            if (!admit) taken = first;
        }
        if (!admit) {
            s->waiting[kept++] = want_slot;
            continue;
        }
        if (taken > first) {
            memcpy(s->used, trial, nc * sizeof(uint64_t));
            size_t active_kept = 0;
            for (size_t i = 0; i < s->active_len; i++) {
                uint32_t slot = s->active[i];
                if (!chosen(s->prio_victims, first, taken, slot))
                    s->active[active_kept++] = slot;
            }
            s->active_len = active_kept;
            for (size_t nth = first; nth < taken; nth++) {
                sk_seq *v = &s->seqs[s->prio_victims[nth]];
                sk_requeue_victim(s, s->prio_victims[nth]);
                v->prio_preempted_at = step + 1;
                s->m.preempted_priority = sk_sat_add(s->m.preempted_priority, 1);
            }
        }
        sk_admit_one(s, want_slot);
        (*admitted)++;
    }
    /* Victims first (the last one at the front), then the sequences still waiting. */
    memmove(s->waiting + taken, s->waiting, kept * sizeof(uint32_t));
    for (size_t nth = 0; nth < taken; nth++) s->waiting[taken - 1 - nth] = s->prio_victims[nth];
    s->waiting_len = kept + taken;
    s->prio_victim_len = taken;
}
