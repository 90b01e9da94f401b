/*
 * sk_sat.h: saturating u64 arithmetic. Counters, scores and reservations clamp at UINT64_MAX
 * instead of wrapping (behaviour.md §3.1 for the scores; the counters follow the same rule).
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
