/*
 * Cold prefix hold (docs/behaviour.md §2.3a, a departure from the reference, off by default).
 *
 * With a prefix store attached and cfg.cold_prefix_hold_tokens = H > 0, the admission walk
 * holds a waiting sequence W (defers it, as if it did not fit) when some active sequence A, its
 * *leader*, has the same first restore(W) + H prompt tokens and is still computing its prompt
 * (no confirmed generated token yet) or decodes (a *late* leader, running when W arrived; not
 * a recompute still replaying), and, once held on, has fewer than
 * max_inflight_plans confirmed tokens more than when first held on (with plans in flight, the
 * plans made before the engine can apply the keep below), and A was not itself admitted after
 * a hold that gained it nothing. W's own
 * restore is what the store backs of it, so a hold means: at least H more tokens of W's prompt
 * are being computed right now by A, or are computed in A's lane. Once A has a token confirmed
 * since its admission, the host keeps its prompt as a resident prefix
 * (skippy_scheduler_take_prompt_keeps says which), the store's epoch moves, the refresh before
 * the next selection extends W's restore over the shared tokens, and W is admitted restoring
 * them instead of prefilling them a second time.
 *
 * Bounds: a hold needs an active leader, so it ends when the leader leaves the active set
 * (finish, failure, cancel, preemption) or has confirmed that window's tokens since it was
 * first held on (after its prompt, for a leader held on while computing it), whether or not
 * the store took the prompt, and a sequence is held in at most
 * cfg.cold_prefix_hold_max_steps plans; a leader is active, so it has rows to run and a hold
 * never leaves the engine with nothing to do. A sequence admitted after a hold that gained it
 * nothing while its leader is still active (the leader's keep was refused, or its window or the
 * step limit ran out) leads nobody: where the store takes no prompt, a burst's peers would
 * otherwise each wait for the one admitted before them. The walk compares W's first restore +
 * H tokens with each eligible leader's (one memcmp each): leaders are active sequences, at most
 * max_active_sequences of them.
 */
#include <string.h>

#include "sk_internal.h"

bool sk_hold(skippy_scheduler *s, sk_seq *w)
{
    size_t hold = s->cfg.cold_prefix_hold_tokens;
    if (!hold || !s->store || w->held_steps >= s->cfg.cold_prefix_hold_max_steps) return false;
    size_t restored = w->has_restore ? w->restore_tokens : 0;
    size_t need = sk_sat_add(restored, hold);
    if (need > w->prompt_len) return false;
    const int32_t *prefix = w->tokens;
    /* A leader held on leads while its kept prompt may not have reached the store yet: the
     * plans made before the engine could apply the keep, about one per token at depth > 1,
     * counted from its confirmed tokens when first held on. */
    size_t depth = s->cfg.max_inflight_plans;
    for (size_t i = 0; i < s->active_len; i++) {
        sk_seq *a = &s->seqs[s->active[i]];
        if (a->no_lead) continue;
        if (a->lead == SK_LEAD_NONE) {
            /* computing its prompt, or a live decode (a late leader); not a recompute still
             * replaying */
            if (a->gen_len && prefill_pending(a)) continue;
        } else if (a->gen_len >= sk_sat_add(a->lead_base, depth)) {
            continue;
        }
        if (a->prompt_len < need) continue;
        if (a->tokens[0] != prefix[0] || memcmp(a->tokens, prefix, need * sizeof(int32_t)))
            continue;
        if (a->lead == SK_LEAD_NONE) {
            a->lead = SK_LEAD_HELD_ON;
            a->lead_base = a->gen_len;
            s->leaders++;
        }
        w->held_steps++;
        w->held_walk = s->admit_walks;
        w->held_restore = restored;
        w->held_on = s->active[i];
        w->held_on_admitted = a->admitted_at;
        return true;
    }
    return false;
}

/*
 * The leaders held on with a token confirmed since their admission are reported once, in walk
 * order: completions come in plan order, so every row planned before that token, the whole
 * prompt (and a recompute's replay) included, has run. Nothing in completion watches for that:
 * this walk runs only while some leader is marked and unreported, and recounts them (leaders
 * that left the active set drop out: their release offered their whole key already).
 */
size_t skippy_scheduler_take_prompt_keeps(skippy_scheduler *s, uint32_t *out, size_t cap)
{
    /* nowhere to write: nothing is taken (the leaders stay to be reported) */
    if (!s || !out || !s->leaders) return 0;
    size_t n = 0, waiting_leaders = 0;
    for (size_t i = 0; i < s->active_len; i++) {
        sk_seq *a = &s->seqs[s->active[i]];
        if (a->lead != SK_LEAD_HELD_ON) continue;
        if (a->gen_len > a->admit_gen && n < cap) {
            a->lead = SK_LEAD_REPORTED;
            out[n++] = s->active[i];
        } else {
            waiting_leaders++;
        }
    }
    s->leaders = waiting_leaders;
    return n;
}
