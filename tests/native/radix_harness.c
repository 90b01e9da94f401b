/*
 * Native stress of the radix cache: random operations with structural invariants checked
 * after each one, and injected allocation failures that must leave the cache unchanged.
 * Built from the sources (unity build) so that the allocator can be replaced.
 * Usage: radix_harness <seed> <steps>; prints "ok ..." and exits 0, or reports and exits 1.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static long fail_after = -1; /* allocations left before one fails; -1 = never */
static unsigned long failures;

static int t_fail(void)
{
    if (fail_after == 0) {
        failures++;
        return 1;
    }
    if (fail_after > 0)
        fail_after--;
    return 0;
}
static void *t_malloc(size_t n) { return t_fail() ? NULL : malloc(n); }
static void *t_realloc(void *p, size_t n) { return t_fail() ? NULL : realloc(p, n); }
static void *t_calloc(size_t a, size_t b) { return t_fail() ? NULL : calloc(a, b); }
#define malloc t_malloc
#define realloc t_realloc
#define calloc t_calloc
#include "sk_radix.c"
#include "sk_radix_query.c"
#undef malloc
#undef realloc
#undef calloc

#define CHECK(cond)                                                                  \
    do {                                                                             \
        if (!(cond)) {                                                               \
            fprintf(stderr, "step %ld: check failed: %s (line %d)\n", step, #cond, __LINE__); \
            exit(1);                                                                 \
        }                                                                            \
    } while (0)

static long step;

static uint32_t check_subtree(const sk_radix *r, int32_t top)
{
    /* returns the resident count of top's subtree, checking every node in it (iteratively) */
    int32_t cur = top;
    uint32_t total = 0;
    while (cur >= 0) {
        const rx_node *nd = &r->nodes[cur];
        uint32_t k, below = nd->slot[SK_RADIX_RESIDENT].present ? 1u : 0u;
        CHECK(nd->parent != RX_FREE);
        for (k = 0; k < nd->nchild; k++) {
            const rx_node *c = &r->nodes[nd->child[k].node];
            CHECK(c->parent == cur);
            CHECK(c->len >= 1);
            CHECK(nd->child[k].first == r->pool[c->off]);
            CHECK(k == 0 || nd->child[k - 1].first < nd->child[k].first);
            CHECK(c->depth == nd->depth + c->len);
            below += c->res_below;
        }
        CHECK(nd->res_below == below);
        if (nd->parent >= 0)
            CHECK(nd->slot[0].present || nd->slot[1].present || nd->nchild >= 2);
        total += nd->slot[SK_RADIX_RESIDENT].present ? 1u : 0u;
        cur = sk_radix_preorder_next(r, cur, top);
    }
    return total;
}

static void check_tree(const sk_radix *r)
{
    size_t k, reachable = 0, live_tokens = 0, i;
    for (k = 0; k < r->ns_count; k++) {
        int32_t root = r->ns[k].root, cur = root;
        CHECK(r->nodes[root].parent == RX_ROOT && r->nodes[root].nchild >= 1);
        if (k > 0) {
            size_t a = r->ns[k - 1].len, b = r->ns[k].len, m = a < b ? a : b;
            int c = memcmp(r->ns[k - 1].name, r->ns[k].name, m);
            CHECK(c < 0 || (c == 0 && a < b));
        }
        CHECK(check_subtree(r, root) == r->nodes[root].res_below);
        for (; cur >= 0; cur = sk_radix_preorder_next(r, cur, root))
            reachable++;
    }
    CHECK(reachable + r->free_count == r->nodes_used);
    for (i = 0; i < r->nodes_used; i++)
        if (r->nodes[i].parent != RX_FREE)
            live_tokens += r->nodes[i].len;
    CHECK(live_tokens == r->pool_len - r->pool_garbage);
}

/* order-sensitive digest of every entry: namespace, key and slot fields */
static uint64_t digest(sk_radix *r)
{
    uint64_t h = 1469598103934665603ull ^ r->clock;
    int kind;
    static int32_t key[4096];
    for (kind = 0; kind < RX_KINDS; kind++) {
        size_t ns_index = 0, i, nl;
        int32_t node = -1;
        sk_radix_hit hit;
        while (sk_radix_next(r, kind, &ns_index, &node, &hit) == SK_RADIX_OK) {
            const char *name = sk_radix_ns_name(r, hit.ns_index, &nl);
            sk_radix_copy_key(r, hit.node, key);
            for (i = 0; i < nl; i++)
                h = (h ^ (uint8_t)name[i]) * 1099511628211ull;
            for (i = 0; i < hit.stored_tokens; i++)
                h = (h ^ (uint32_t)key[i]) * 1099511628211ull;
            h = (h ^ hit.handle ^ (hit.last_used << 20) ^ ((uint64_t)hit.active_refs << 40) ^
                 hit.logical_bytes) * 1099511628211ull;
        }
    }
    return h;
}

int main(int argc, char **argv)
{
    unsigned seed = argc > 1 ? (unsigned)atoi(argv[1]) : 1;
    long steps = argc > 2 ? atol(argv[2]) : 20000;
    sk_radix *r = sk_radix_new();
    static int32_t key[4096];
    const char *names[] = {"a", "b", "stage-0"};
    unsigned long no_memory = 0, compactions = 0;
    size_t last_pool = 0;
    if (!r)
        return 1;
    srand(seed);
    for (step = 0; step < steps; step++) {
        size_t n = (size_t)(rand() % 40), i;
        const char *ns = names[rand() % 3];
        int op = rand() % 12, kind = rand() % 2, st;
        uint64_t before = 0, handle = 0;
        sk_radix_stats s0, s1;
        sk_radix_hit hit;
        if (rand() % 50 == 0)
            n = 500 + (size_t)(rand() % 3000); /* long keys: garbage enough to compact */
        for (i = 0; i < n; i++)
            key[i] = rand() % 3 - (i % 7 == 6 ? 1 : 0);
        if (rand() % 3 == 0) {
            before = digest(r);
            sk_radix_get_stats(r, &s0);
            fail_after = rand() % 4;
        }
        switch (op) {
        case 0: case 1: case 2: case 3:
            st = sk_radix_insert(r, kind, op == 3, ns, strlen(ns), key, n, n, (uint64_t)step,
                                 &handle);
            break;
        case 4: case 5:
            st = sk_radix_remove(r, kind, ns, strlen(ns), key, n, &handle);
            break;
        case 6:
            st = sk_radix_probe(r, kind, rand() % 3, ns, strlen(ns), key, n, &hit);
            if (st == SK_RADIX_OK)
                CHECK(hit.matched_tokens <= n && hit.matched_tokens <= hit.stored_tokens);
            break;
        case 7:
            st = sk_radix_release(r, kind, ns, strlen(ns), key, n);
            break;
        case 8:
            st = sk_radix_exact(r, kind, 1, ns, strlen(ns), key, n, &hit);
            break;
        default:
            st = sk_radix_lru(r, kind, &hit);
            if (st == SK_RADIX_OK) {
                CHECK(hit.active_refs == 0);
                st = sk_radix_remove_hit(r, kind, &hit, 1, &handle);
            }
            break;
        }
        fail_after = -1;
        if (st == SK_RADIX_NO_MEMORY) {
            no_memory++;
            sk_radix_get_stats(r, &s1);
            CHECK(memcmp(&s0, &s1, sizeof(s0)) == 0);
            CHECK(digest(r) == before);
        }
        if (r->pool_len < last_pool)
            compactions++;
        last_pool = r->pool_len;
        if (step % 7 == 0 || st == SK_RADIX_NO_MEMORY)
            check_tree(r);
    }
    check_tree(r);
    printf("ok steps=%ld no_memory=%lu injected=%lu compactions=%lu namespaces=%zu\n", steps,
           no_memory, failures, compactions, r->ns_count);
    sk_radix_free(r);
    return 0;
}
