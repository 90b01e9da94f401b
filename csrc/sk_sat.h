/*
 * sk_sat.h: saturating u64 arithmetic. Counters, byte sums, reservations and scores stop at
 * UINT64_MAX and at 0, never wrap (the integer arithmetic note at the top of docs/behaviour.md).
 */
#ifndef SK_SAT_H
#define SK_SAT_H

#include <stdint.h>

static inline uint64_t sk_sat_add(uint64_t a, uint64_t b)
{
    uint64_t sum = a + b;
    return sum < a ? UINT64_MAX : sum;
}

static inline uint64_t sk_sat_mul(uint64_t a, uint64_t b)
{
    if (a != 0 && b > UINT64_MAX / a) return UINT64_MAX;
    return a * b;
}

static inline uint64_t sk_sat_sub(uint64_t a, uint64_t b) { return a > b ? a - b : 0; }

#endif
