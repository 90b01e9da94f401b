/*
 * Waiting-work ranking kernel (behaviour.md §3): the order in which admission considers
 * waiting sequences. Pure C over caller-owned arrays; scratch memory lives in a reusable
 * workspace so steady-state calls do not allocate.
 */
#ifndef SK_RANK_H
#define SK_RANK_H

#include <stddef.h>
#include <stdint.h>

typedef struct sk_rank_item {
    uint64_t priority;       /* higher first */
    uint64_t saved_cost;     /* CacheAffinity.estimated_saved_cost() */
    uint64_t enqueued_turn;  /* turn at enqueue (aging origin) */
    uint64_t order;          /* enqueue order: FIFO tie-break */
    const int32_t *tokens;   /* prompt tokens (for the waiting-prefix radix) */
    size_t token_count;
} sk_rank_item;

typedef enum sk_rank_mode {
    SK_RANK_CACHE_AWARE = 0, /* §3.3: priority, score (+band/DFS when grouping), order */
    SK_RANK_FCFS = 1,        /* order only */
    SK_RANK_PRIORITY = 2     /* priority, then order */
} sk_rank_mode;

typedef struct sk_rank_ws sk_rank_ws;

sk_rank_ws *sk_rank_ws_new(void);
void sk_rank_ws_free(sk_rank_ws *ws);

/*
 * Writes into out[0..n) the positions (0..n-1 into items) best first. Ties in every key fall
 * to the smaller position (the order is that of a stable sort). Tokens are only read during
 * the call. Scores saturate at UINT64_MAX as §3.1 says.
 * Returns 0; SKIPPY_SCHED_INVALID (4) for an unknown mode or n >= 2^32; or
 * SKIPPY_SCHED_NO_MEMORY (7) when scratch could not grow. out is untouched on failure.
 */
int sk_rank_order(sk_rank_ws *ws, const sk_rank_item *items, size_t n, uint64_t current_turn,
                  uint64_t aging_cost_per_turn, int group_waiting_prefixes, int mode,
                  size_t *out);

#endif
