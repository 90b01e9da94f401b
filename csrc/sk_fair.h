/*
 * sk_fair.h: fair-share admission (SKIPPY_ADMISSION_FAIR_SHARE, docs/behaviour.md §3.6).
 *
 * The state lives in one sk_fair owned by the scheduler (s->fair, NULL under every other
 * policy): a counter and a weight per tenant, and per slot the tenant of its sequence and the
 * last ranking that saw it queued. The rest of the core calls in at four points: submit
 * (sk_fair_submit), the waiting queue's ranking (sk_fair_order, sk_waiting.c), completion
 * (sk_fair_charge) and the public accessors (skippy_scheduler_set_tenant_weight and friends).
 */
#ifndef SK_FAIR_H
#define SK_FAIR_H

#include "sk_internal.h"

typedef struct sk_fair sk_fair;

sk_fair *sk_fair_new(void);
void sk_fair_free(sk_fair *f);

/* 0 when the fair-share costs of `cfg` are finite and >= 0 (checked at create). */
int sk_fair_check_config(const skippy_scheduler_config *cfg);

/* Records the tenant of the sequence just placed in `slot` (a new request: not seen queued).
 * -1 on out of memory; the scheduler's visible state is then unchanged. No-op without s->fair. */
int sk_fair_submit(skippy_scheduler *s, uint32_t slot, uint32_t tenant);

/* `order` holds the waiting queue's positions in the within-tenant (cache-aware) order; applies
 * the lift rule and rewrites `order` into the fair order. -1 on out of memory, and then neither
 * `order` nor any counter changed. */
int sk_fair_order(skippy_scheduler *s, size_t *order, size_t n);

/* Charges every row of a plan being completed whose sequence is still the one it was planned
 * for (the rows whose output completion applies). Call before completion changes anything. */
void sk_fair_charge(skippy_scheduler *s, const sk_plan_slot *plan_slot);

#endif
