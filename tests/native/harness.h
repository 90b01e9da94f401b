/*
 * What the C harnesses of tests/native share: allocation failures injected through the
 * linker's --wrap of malloc, calloc and realloc (fail_after allocations from now; -1 = never),
 * a CHECK that reports the harness step, and a seeded xorshift generator.
 */
#ifndef SK_TEST_HARNESS_H
#define SK_TEST_HARNESS_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

void *__real_malloc(size_t n);
void *__real_calloc(size_t n, size_t m);
void *__real_realloc(void *p, size_t n);
static long fail_after = -1; /* allocations left before the next one fails; -1 = never */

static int t_fail(void)
{
    if (fail_after == 0) return 1;
    if (fail_after > 0) fail_after--;
    return 0;
}
void *__wrap_malloc(size_t n) { return t_fail() ? NULL : __real_malloc(n); }
void *__wrap_calloc(size_t n, size_t m) { return t_fail() ? NULL : __real_calloc(n, m); }
void *__wrap_realloc(void *p, size_t n) { return t_fail() ? NULL : __real_realloc(p, n); }

static long step;
#define CHECK(cond)                                                                          \
    do {                                                                                     \
        if (!(cond)) {                                                                       \
            fprintf(stderr, "step %ld: check failed: %s (line %d)\n", step, #cond, __LINE__); \
            exit(1);                                                                         \
        }                                                                                    \
    } while (0)

static uint64_t rng = 88172645463325252ull;
static uint64_t next_rand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}
static size_t below(size_t n) { return (size_t)(next_rand() % n); }

#endif
