/*
 * Admission (docs/behaviour.md §2.3): before each plan (sk_plan.c), the waiting sequences that
 * fit are admitted from the front of the ranked queue, in order, deferring those that do not
 * (and, under the cold prefix hold, those held for a leader, sk_hold.c); then, when it is on,
 * preemption for priority (sk_priority.c, §2.8a) admits what the pass left waiting at the
 * expense of running sequences of lower priority. The moves themselves are sk_move.c's.
 */
#include "sk_internal.h"

static bool fits(const skippy_scheduler *s, const sk_seq *seq) { return sk_fits_on(s, s->used, seq); }

int sk_admit_waiting(skippy_scheduler *s, size_t *out_admitted)
{
    *out_admitted = 0;
    /* Affinity read from the store now, so selection sees what is resident (§2.12). */
    int refreshed = sk_affinity_refresh(s);
    if (refreshed) return refreshed;
    if (s->dirty) {
        int rc = sk_waiting_rank(s);
        if (rc) return rc;
        s->dirty = false;
    }
    size_t waiting_count = s->waiting_len;
    s->prio_victim_len = 0;
    s->admit_walks++;
    if (waiting_count == 0) return 0;
    /* Everything preemption for priority may need is allocated before anything changes. */
    if (s->cfg.priority_preemption && sk_priority_reserve(s))
        return sk_fail(s, SKIPPY_SCHED_NO_MEMORY, "out of memory preempting for priority");
    if (s->active_len < s->cfg.max_active_sequences) {
        size_t room = s->cfg.max_active_sequences - s->active_len;
        size_t admissible = room < waiting_count ? room : waiting_count;
        if (sk_grow((void **)&s->active, &s->active_cap, s->active_len + admissible,
                    sizeof(uint32_t)))
            return sk_fail(s, SKIPPY_SCHED_NO_MEMORY, "out of memory admitting sequences");
        size_t kept = 0, admitted = 0;
        bool hold = s->cfg.cold_prefix_hold_tokens && s->store; /* §2.3a */
        for (size_t i = 0; i < waiting_count; i++) {
            uint32_t slot = s->waiting[i];
            if (s->active_len >= s->cfg.max_active_sequences || !fits(s, &s->seqs[slot]) ||
                (hold && sk_hold(s, &s->seqs[slot]))) {
                s->waiting[kept++] = slot; /* deferred, relative order kept */
                continue;
            }
            sk_admit_one(s, slot);
            admitted++;
        }
        s->waiting_len = kept;
        *out_admitted = admitted;
    }
    if (s->cfg.priority_preemption) sk_priority_preempt(s, out_admitted);
    return 0;
}
