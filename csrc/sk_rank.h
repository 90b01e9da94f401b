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
    uint64_t deadline;       /* TTFT deadline key, nearer first (sk_rank_deadline_key);
                              * UINT64_MAX = none. Cache-aware mode only (behaviour.md §3.3a) */
} sk_rank_item;

/* The deadline key of a TTFT deadline in microseconds: the bits of the double, which order
 * as the values do for positive doubles; 0 (none), negatives and NaN give UINT64_MAX. */
uint64_t sk_rank_deadline_key(double deadline_us);

typedef enum sk_rank_mode {
    SK_RANK_CACHE_AWARE = 0, /* §3.3: priority, score (+band/DFS when grouping), deadline, order */
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

/*
 * Persistent ranked set: the same order as sk_rank_order, kept up to date across arrivals and
 * departures so that a re-rank after one change does not re-read every waiting prompt.
 *
 * The set holds a compressed radix tree over the live prompts with, per node, the number of
 * prompts below it and their smallest order; children stay sorted by the §3.2 bucket key
 * (size desc, smallest order asc, token asc). Adding or removing a prompt of L tokens costs
 * O(L + depth * log(siblings)); sk_rank_set_order then only walks the tree (no token reads)
 * and applies the score keys, which change with the turn, in linear radix passes.
 *
 * Lifetime: an added item's tokens are NOT copied; they must stay valid and unchanged until
 * the item is removed (the scheduler's waiting sequences own their prompts for that long).
 * Handles are small integers, reused after removal.
 *
 * Equivalence: sk_rank_set_order(set, ...) writes the handles of the live items in exactly
 * the order sk_rank_order would give for those items listed in the order they were added
 * (ties in every key fall to the earlier add). With unique `order` values, as the scheduler
 * gives, that is simply the sk_rank_order of the waiting queue.
 *
 * Memory: storage grows geometrically and is recycled; once the set has reached its peak
 * size, add/remove/order do not allocate. Every call that can fail returns 0,
 * SKIPPY_SCHED_INVALID (4) for a bad handle / mode, or SKIPPY_SCHED_NO_MEMORY (7) and then
 * leaves the set exactly as it was.
 */
typedef struct sk_rank_set sk_rank_set;

sk_rank_set *sk_rank_set_new(void);
void sk_rank_set_free(sk_rank_set *set);
size_t sk_rank_set_size(const sk_rank_set *set);
int sk_rank_set_add(sk_rank_set *set, const sk_rank_item *item, uint32_t *out_handle);
int sk_rank_set_remove(sk_rank_set *set, uint32_t handle);
/* Changes the score inputs of a live item (its order and tokens are fixed at add). */
int sk_rank_set_update(sk_rank_set *set, uint32_t handle, uint64_t priority,
                       uint64_t saved_cost, uint64_t enqueued_turn);
/* Handles of the live items whose prompt starts with tokens[0..n) into out (room for
 * sk_rank_set_size(set) handles), in no particular order; their number in *out_count. */
int sk_rank_set_under(sk_rank_set *set, const int32_t *tokens, size_t n, uint32_t *out,
                      size_t *out_count);
/* Writes the sk_rank_set_size(set) live handles into out, best first. */
int sk_rank_set_order(sk_rank_set *set, uint64_t current_turn, uint64_t aging_cost_per_turn,
                      int group_waiting_prefixes, int mode, uint32_t *out);

#endif
