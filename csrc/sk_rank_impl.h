/*
 * Pieces shared by the one-shot ranking kernel (sk_rank.c) and the persistent ranked set
 * (sk_rank_set.c). Not part of the public interface.
 */
#ifndef SK_RANK_IMPL_H
#define SK_RANK_IMPL_H

#include "sk_grow.h"
#include "sk_rank.h"
#include "sk_sat.h"

#define SK_RANK_OK 0
#define SK_RANK_INVALID 4
#define SK_RANK_NO_MEMORY 7
#define SK_BAND_TURNS 4u

#if defined(__GNUC__)
#define SK_PREFETCH(p) __builtin_prefetch(p)
#else
#define SK_PREFETCH(p) ((void)0)
#endif

/* A sort record: a 64-bit key and the item it belongs to. */
typedef struct sk_kv {
    uint64_t key;
    uint32_t idx;  /* item position or handle, or a start offset for radix buckets */
    uint32_t aux;  /* bucket size */
} sk_kv;

/* §3.1: effective score and grouping score of one item. */
static inline void sk_rank_scores(const sk_rank_item *it, uint64_t turn, uint64_t aging,
                                  uint64_t *eff, uint64_t *grp)
{
    uint64_t age = turn > it->enqueued_turn ? turn - it->enqueued_turn : 0;
    /* NOTE: ceil(age / 4) as the reference computes it, with a saturating age + 3, so the
     * three largest ages lose their last band instead of wrapping to band 0. */
    uint64_t bands = sk_sat_add(age, SK_BAND_TURNS - 1) / SK_BAND_TURNS;
    uint64_t band_cost = sk_sat_mul(aging > 1 ? aging : 1, SK_BAND_TURNS);
    *eff = sk_sat_add(it->saved_cost, sk_sat_mul(age, aging));
    *grp = sk_sat_add(it->saved_cost, sk_sat_mul(bands, band_cost));
}

/* Stable sort of a[0..n) by key (tmp: n records of scratch). */
void sk_rank_kv_sort(sk_kv *a, sk_kv *tmp, size_t n);

/* Length of the common prefix of a and b, at most n tokens. */
size_t sk_rank_lcp32(const int32_t *a, const int32_t *b, size_t n);

#endif
