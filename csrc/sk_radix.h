/*
 * Unified token radix cache (behaviour.md §8): one compressed radix tree per namespace whose
 * nodes carry an optional resident-KV payload and an optional recurrent-state payload. The tree
 * only stores opaque 64-bit handles; whoever owns the payload objects maps handles back.
 *
 * Storage is arena-like so that steady-state calls do not allocate: nodes live in one growable
 * array recycled through a free list, edge tokens live in one growable int32 pool (spans, with
 * occasional compaction), and each node keeps a small child array sorted by first edge token.
 * Every walk is iterative, so no stack depth follows key length.
 *
 * Failure model: a call returning SK_RADIX_NO_MEMORY (or any error status) changed nothing.
 * Node ids and namespace indexes reported by a call stay valid until the next mutating call.
 */
#ifndef SK_RADIX_H
#define SK_RADIX_H

#include <stddef.h>
#include <stdint.h>

typedef enum sk_radix_kind {
    SK_RADIX_RESIDENT = 0,  /* resident KV: backing-prefix matching, active entries pinned */
    SK_RADIX_RECURRENT = 1  /* recurrent whole state: exact-node matching only */
} sk_radix_kind;

typedef enum sk_radix_status {
    SK_RADIX_OK = 0,        /* done; for an insert: stored in a vacant slot */
    SK_RADIX_REPLACED = 1,  /* insert replaced an entry; *prev_handle is the old handle */
    SK_RADIX_OCCUPIED = 2,  /* insert-if-vacant found an entry; nothing changed */
    SK_RADIX_ACTIVE = 3,    /* the resident entry has active refs; nothing changed */
    SK_RADIX_EMPTY_KEY = 4, /* keys must hold at least one token */
    SK_RADIX_MISS = 5,      /* nothing found */
    SK_RADIX_NO_MEMORY = 7  /* allocation failed (same value as SKIPPY_SCHED_NO_MEMORY) */
} sk_radix_status;

typedef enum sk_radix_probe_mode {
    SK_RADIX_PEEK = 0,    /* no clock, recency or ref change */
    SK_RADIX_LOOKUP = 1,  /* clock += 1 (even on a miss); the hit becomes most recent */
    SK_RADIX_ACQUIRE = 2  /* as LOOKUP, and the hit gains one active ref */
} sk_radix_probe_mode;

/* One entry as a probe, an exact look-up, the LRU scan or the entry cursor reports it. */
typedef struct sk_radix_hit {
    size_t matched_tokens;  /* query tokens the entry can restore */
    size_t stored_tokens;   /* length of the entry's own key (>= matched for resident slices) */
    uint64_t handle;        /* caller's payload handle */
    uint64_t logical_bytes; /* caller-declared size of the payload */
    uint64_t last_used;     /* clock value of the entry's last use */
    uint32_t active_refs;   /* outstanding acquires */
    int32_t node;           /* node holding the entry (for sk_radix_copy_key) */
    size_t ns_index;        /* namespace index (for sk_radix_ns_name), 0.. in name byte order */
} sk_radix_hit;

typedef struct sk_radix_stats {
    uint64_t namespaces;
    uint64_t nodes;                   /* non-root nodes */
    uint64_t token_edges;             /* tokens stored on non-root edges */
    uint64_t splits;                  /* edge splits performed by inserts */
    uint64_t resident_entries;
    uint64_t resident_tokens;         /* sum of resident key lengths */
    uint64_t resident_logical_bytes;
    uint64_t resident_active_refs;
    uint64_t recurrent_entries;
    uint64_t recurrent_logical_bytes;
    uint64_t recurrent_active_refs;
    uint64_t resident_evictions;
    uint64_t recurrent_evictions;
} sk_radix_stats;

typedef struct sk_radix sk_radix;

sk_radix *sk_radix_new(void);
void sk_radix_free(sk_radix *r);

/* clock value; mutations and recency updates advance it, peeks never do */
uint64_t sk_radix_epoch(const sk_radix *r);

/* continues the clock from a saved epoch (e.g. a cache rebuilt from a snapshot) */
void sk_radix_set_epoch(sk_radix *r, uint64_t clock);

/* changes whenever an insert or a removal changes the tree (node ids may then be stale) */
uint64_t sk_radix_version(const sk_radix *r);

/*
 * Stores handle under (ns, tokens). Resident inserts without if_vacant fail with ACTIVE when
 * the existing entry has active refs; if_vacant fails with OCCUPIED when any entry exists.
 * Returns OK, REPLACED (old handle in *prev_handle), OCCUPIED, ACTIVE, EMPTY_KEY, NO_MEMORY.
 */
int sk_radix_insert(sk_radix *r, int kind, int if_vacant, const char *ns, size_t ns_len,
                    const int32_t *tokens, size_t n, uint64_t logical_bytes, uint64_t handle,
                    uint64_t *prev_handle);

/* Longest-prefix match (resident: backing prefix; recurrent: exact node). OK or MISS. */
int sk_radix_probe(sk_radix *r, int kind, int mode, const char *ns, size_t ns_len,
                   const int32_t *tokens, size_t n, sk_radix_hit *out);

/* Exact key; touch = clock += 1 (even on a miss) and the hit becomes most recent. OK or MISS. */
int sk_radix_exact(sk_radix *r, int kind, int touch, const char *ns, size_t ns_len,
                   const int32_t *tokens, size_t n, sk_radix_hit *out);

/* Drops one active ref of the exact key (clock += 1). OK, or MISS when absent or unreferenced. */
int sk_radix_release(sk_radix *r, int kind, const char *ns, size_t ns_len,
                     const int32_t *tokens, size_t n);

/* Removes the exact key's entry (no clock change). OK (handle in *handle), MISS, NO_MEMORY. */
int sk_radix_remove(sk_radix *r, int kind, const char *ns, size_t ns_len, const int32_t *tokens,
                    size_t n, uint64_t *handle);

/* Unreferenced entry with the smallest (last_used, namespace, key). OK or MISS. */
int sk_radix_lru(const sk_radix *r, int kind, sk_radix_hit *out);

/* Removes the entry a hit of this same state names; count_eviction bumps the kind's counter. */
int sk_radix_remove_hit(sk_radix *r, int kind, const sk_radix_hit *hit, int count_eviction,
                        uint64_t *handle);

/*
 * Entry cursor in (namespace, key) order: start with *ns_index = 0 and *node = -1; each OK
 * fills *out and advances; MISS at the end. The tree must not change while iterating.
 */
int sk_radix_next(const sk_radix *r, int kind, size_t *ns_index, int32_t *node,
                  sk_radix_hit *out);

/* Full key of a node into dst, which holds the node's key length (hit.stored_tokens) tokens. */
void sk_radix_copy_key(const sk_radix *r, int32_t node, int32_t *dst);

/* Name bytes of a namespace index (not NUL-terminated). */
const char *sk_radix_ns_name(const sk_radix *r, size_t ns_index, size_t *len);

void sk_radix_get_stats(const sk_radix *r, sk_radix_stats *out);

#endif
