/*
 * Layout of the radix cache shared by its storage half (sk_radix.c: insert, remove, node and
 * token-pool management) and its query half (sk_radix_query.c: probes, LRU, cursor, stats).
 */
#ifndef SK_RADIX_INTERNAL_H
#define SK_RADIX_INTERNAL_H

#include <string.h>

#include "sk_radix.h"

#define RX_ROOT (-1)    /* parent of a namespace root */
#define RX_FREE (-2)    /* parent of a node on the free list */
#define RX_KINDS 2

typedef struct rx_slot {
    uint64_t handle;
    uint64_t bytes;
    uint64_t last_used;
    uint32_t refs;
    uint32_t present;
} rx_slot;

/* first token duplicated beside the id so child searches stay inside one small array */
typedef struct rx_child {
    int32_t first;
    int32_t node;
} rx_child;

typedef struct rx_node {
    size_t off;     /* edge span start in the token pool; next free node while on the free list */
    size_t len;     /* edge length (0 only for roots) */
    size_t depth;   /* key length at the end of this edge */
    int32_t parent; /* RX_ROOT, RX_FREE or a node id */
    uint32_t nchild;
    uint32_t cap;   /* child capacity; the buffer survives recycling so reuse does not allocate */
    uint32_t res_below; /* resident entries in this subtree (self included): steers matching */
    rx_child *child;
    rx_slot slot[RX_KINDS];
} rx_node;

typedef struct rx_ns {
    char *name;
    size_t len;
    int32_t root;
} rx_ns;

struct sk_radix {
    uint64_t clock;
    uint64_t version;   /* bumped by every insert and removal (cursor invalidation) */
    uint64_t splits;
    uint64_t evictions[RX_KINDS];

    rx_node *nodes;
    size_t nodes_used;  /* high-water mark of node ids */
    size_t nodes_cap;
    int32_t free_head;  /* -1 when empty */
    size_t free_count;

    int32_t *pool;      /* edge tokens; spans of live nodes are disjoint */
    size_t pool_len;
    size_t pool_cap;
    size_t pool_garbage; /* tokens no live span covers; compaction reclaims them */

    rx_ns *ns;          /* sorted by name bytes, the order the LRU tie-break uses */
    size_t ns_count;
    size_t ns_cap;
};

static inline uint64_t rx_sat_add(uint64_t a, uint64_t b)
{
    return a > UINT64_MAX - b ? UINT64_MAX : a + b;
}

static inline int32_t rx_first(const sk_radix *r, int32_t id)
{
    return r->pool[r->nodes[id].off];
}

/* index of the first child whose first token is >= t (binary search) */
static inline uint32_t rx_child_lower(const rx_node *nd, int32_t t)
{
    uint32_t lo = 0, hi = nd->nchild;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (nd->child[mid].first < t)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static inline int32_t rx_child_find(const rx_node *nd, int32_t t)
{
    uint32_t k = rx_child_lower(nd, t);
    return (k < nd->nchild && nd->child[k].first == t) ? nd->child[k].node : -1;
}

/* length of the common prefix of a and b over their first n tokens */
static inline size_t rx_lcp(const int32_t *a, const int32_t *b, size_t n)
{
    size_t i = 0;
    if (memcmp(a, b, n * sizeof(int32_t)) == 0)
        return n;
    while (n - i >= 16 && memcmp(a + i, b + i, 16 * sizeof(int32_t)) == 0)
        i += 16;
    while (i < n && a[i] == b[i])
        i++;
    return i;
}

/* namespace index of (name, len), or -1 with *insert_at set to its sorted position */
long sk_radix_ns_find(const sk_radix *r, const char *name, size_t len, size_t *insert_at);

/* next node after cur in preorder (child-key order) inside the subtree of top, or -1 */
int32_t sk_radix_preorder_next(const sk_radix *r, int32_t cur, int32_t top);

/* node at exactly tokens[0..n) in the tree of root, or -1 */
int32_t sk_radix_node_at(const sk_radix *r, int32_t root, const int32_t *tokens, size_t n);
/* Node holding a `kind` entry under exactly this key in namespace ns (its index in *nsi), or -1. */
int32_t sk_radix_find_entry(const sk_radix *r, int kind, const char *ns, size_t ns_len,
                            const int32_t *tokens, size_t n, long *nsi);

/* removes slot kind of node id in namespace ns_index, pruning and re-merging (OK / NO_MEMORY) */
int sk_radix_remove_slot(sk_radix *r, size_t ns_index, int32_t id, int kind, uint64_t *handle);

#endif
