/*
 * sk_grow.h: the one growth rule for the core's arrays.
 *
 * A capacity doubles until it holds what is needed, so appends cost amortised O(1) and a
 * structure that has reached its peak size never allocates again (the steady-state promise of
 * the scheduler, the ranking kernels and the radix cache). Every helper leaves the array and its
 * capacity as they were when it fails.
 *
 * Header-only: the ranking kernels and the radix cache are also compiled on their own, without
 * the rest of the core, and the radix stress harness swaps the allocator of the file that
 * includes this one.
 */
#ifndef SK_GROW_H
#define SK_GROW_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

/* Capacity of an array's first allocation (sk_grown_capacity callers may choose another). */
#define SK_GROW_FIRST 8

/* The capacity that holds `need` elements: `cap` (or `first`, for an empty array) doubled as
 * often as needed; `need` itself once doubling would overflow. */
static inline size_t sk_grown_capacity(size_t cap, size_t need, size_t first)
{
    size_t next = cap ? cap : first;
    while (next < need) {
        if (next > SIZE_MAX / 2) return need;
        next *= 2;
    }
    return next;
}

/* Resizes *ptr to `count` elements of `elem` bytes (count > 0); -1 on overflow or no memory. */
static inline int sk_resize(void **ptr, size_t count, size_t elem)
{
    void *moved;
    if (count > SIZE_MAX / elem) return -1;
    moved = realloc(*ptr, count * elem);
    if (!moved) return -1;
    *ptr = moved;
    return 0;
}

/* Makes room for `need` elements in *ptr, whose capacity is *cap; 0 on success, else -1. */
static inline int sk_grow(void **ptr, size_t *cap, size_t need, size_t elem)
{
    size_t next;
    if (need <= *cap) return 0;
    next = sk_grown_capacity(*cap, need, SK_GROW_FIRST);
    if (sk_resize(ptr, next, elem)) return -1;
    *cap = next;
    return 0;
}

#endif
