/*
 * Storage half of the radix cache: node arena, token pool, namespaces, insert and remove.
 *
 * Invariant kept by every mutation (and relied on by remove): a non-root node holds a payload
 * or has at least two children. Inserts preserve it because a split node either receives the
 * new payload or gets two children; removes restore it with at most one prune and one merge.
 * Every fallible allocation happens before the first structural change, so a failing call
 * leaves the tree exactly as it was.
 */
#include <stdlib.h>

#include "sk_grow.h"
#include "sk_radix_internal.h"

sk_radix *sk_radix_new(void)
{
    sk_radix *r = calloc(1, sizeof(*r));
    if (r)
        r->free_head = -1;
    return r;
}

void sk_radix_free(sk_radix *r)
{
    size_t i;
    if (!r)
        return;
    for (i = 0; i < r->nodes_used; i++)
        free(r->nodes[i].child);
    for (i = 0; i < r->ns_count; i++)
        free(r->ns[i].name);
    free(r->nodes);
    free(r->pool);
    free(r->ns);
    free(r);
}

uint64_t sk_radix_epoch(const sk_radix *r) { return r->clock; }

uint64_t sk_radix_version(const sk_radix *r) { return r->version; }

void sk_radix_set_epoch(sk_radix *r, uint64_t clock) { r->clock = clock; }

long sk_radix_ns_find(const sk_radix *r, const char *name, size_t len, size_t *insert_at)
{
    size_t lo = 0, hi = r->ns_count;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        const rx_ns *e = &r->ns[mid];
        size_t m = e->len < len ? e->len : len;
        int c = m ? memcmp(e->name, name, m) : 0;
        if (c == 0)
            c = (e->len > len) - (e->len < len);
        if (c == 0)
            return (long)mid;
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (insert_at)
        *insert_at = lo;
    return -1;
}

int32_t sk_radix_node_at(const sk_radix *r, int32_t root, const int32_t *tokens, size_t n)
{
    int32_t cur = root;
    size_t i = 0;
    while (i < n) {
        int32_t c = rx_child_find(&r->nodes[cur], tokens[i]);
        const rx_node *cn;
        if (c < 0)
            return -1;
        cn = &r->nodes[c];
        if (cn->len > n - i || memcmp(r->pool + cn->off, tokens + i, cn->len * sizeof(int32_t)))
            return -1;
        i += cn->len;
        cur = c;
    }
    return cur;
}

int32_t sk_radix_find_entry(const sk_radix *r, int kind, const char *ns, size_t ns_len,
                            const int32_t *tokens, size_t n, long *nsi)
{
    int32_t id;
    if (kind < 0 || kind >= RX_KINDS || n == 0)
        return -1;
    *nsi = sk_radix_ns_find(r, ns, ns_len, NULL);
    if (*nsi < 0)
        return -1;
    id = sk_radix_node_at(r, r->ns[*nsi].root, tokens, n);
    return id >= 0 && r->nodes[id].slot[kind].present ? id : -1;
}

/* makes k node takes infallible */
static int rx_reserve_nodes(sk_radix *r, size_t k)
{
    size_t spare = r->free_count + (r->nodes_cap - r->nodes_used);
    size_t need;
    if (spare >= k)
        return 0;
    need = r->nodes_used + (k - r->free_count);
    if (need > (size_t)INT32_MAX)
        return -1;
    return sk_grow((void **)&r->nodes, &r->nodes_cap, need, sizeof(rx_node));
}

static int rx_reserve_pool(sk_radix *r, size_t k)
{
    if (k > SIZE_MAX - r->pool_len)
        return -1;
    return sk_grow((void **)&r->pool, &r->pool_cap, r->pool_len + k, sizeof(int32_t));
}

static int rx_reserve_children(sk_radix *r, int32_t id, size_t need)
{
    rx_node *nd = &r->nodes[id];
    size_t cap = nd->cap;
    if (need > UINT32_MAX)
        return -1;
    if (sk_grow((void **)&nd->child, &cap, need, sizeof(rx_child)))
        return -1;
    nd->cap = (uint32_t)(cap > UINT32_MAX ? UINT32_MAX : cap);
    return 0;
}

/* entries never exceed INT32_MAX nodes, so the per-subtree counts cannot overflow */
static void rx_count_resident(sk_radix *r, int32_t id, int delta)
{
    while (id >= 0) {
        r->nodes[id].res_below += (uint32_t)delta;
        id = r->nodes[id].parent;
    }
}

/* requires a prior rx_reserve_nodes */
static int32_t rx_take_node(sk_radix *r, int32_t parent, size_t off, size_t len, size_t depth)
{
    int32_t id;
    rx_node *nd;
    if (r->free_head >= 0) {
        id = r->free_head;
        r->free_head = (int32_t)r->nodes[id].off;
        r->free_count--;
    } else {
        id = (int32_t)r->nodes_used++;
        r->nodes[id].child = NULL;
        r->nodes[id].cap = 0;
    }
    nd = &r->nodes[id];
    nd->off = off;
    nd->len = len;
    nd->depth = depth;
    nd->parent = parent;
    nd->nchild = 0;
    nd->res_below = 0;
    memset(nd->slot, 0, sizeof(nd->slot));
    return id;
}

static void rx_give_node(sk_radix *r, int32_t id)
{
    rx_node *nd = &r->nodes[id];
    nd->parent = RX_FREE;
    nd->nchild = 0;
    nd->len = 0;
    nd->off = (size_t)(int64_t)r->free_head;
    r->free_head = id;
    r->free_count++;
}

static void rx_child_insert(sk_radix *r, int32_t parent, int32_t first, int32_t id)
{
    rx_node *p = &r->nodes[parent];
    uint32_t k = rx_child_lower(p, first);
    memmove(p->child + k + 1, p->child + k, (p->nchild - k) * sizeof(rx_child));
    p->child[k].first = first;
    p->child[k].node = id;
    p->nchild++;
}

static void rx_child_erase(sk_radix *r, int32_t parent, int32_t first)
{
    rx_node *p = &r->nodes[parent];
    uint32_t k = rx_child_lower(p, first);
    memmove(p->child + k, p->child + k + 1, (p->nchild - k - 1) * sizeof(rx_child));
    p->nchild--;
}

static void rx_child_replace(sk_radix *r, int32_t parent, int32_t first, int32_t id)
{
    rx_node *p = &r->nodes[parent];
    p->child[rx_child_lower(p, first)].node = id;
}

/* Rewrites live spans into a fresh pool once garbage dominates; skipped if memory is short. */
static void rx_maybe_compact(sk_radix *r)
{
    size_t live = 0, i, at = 0;
    int32_t *fresh;
    if (r->pool_garbage < 4096 || r->pool_garbage < r->pool_len - r->pool_garbage)
        return;
    /* recount instead of trusting the bookkeeping: the copy must fit whatever happens */
    for (i = 0; i < r->nodes_used; i++)
        if (r->nodes[i].parent != RX_FREE)
            live += r->nodes[i].len;
    fresh = malloc((live ? live : 1) * sizeof(int32_t));
    if (!fresh)
        return;
    for (i = 0; i < r->nodes_used; i++) {
        rx_node *nd = &r->nodes[i];
        if (nd->parent == RX_FREE || nd->len == 0)
            continue;
        memcpy(fresh + at, r->pool + nd->off, nd->len * sizeof(int32_t));
        nd->off = at;
        at += nd->len;
    }
    free(r->pool);
    r->pool = fresh;
    r->pool_len = r->pool_cap = at;
    r->pool_garbage = 0;
}

int sk_radix_insert(sk_radix *r, int kind, int if_vacant, const char *ns, size_t ns_len,
                    const int32_t *tokens, size_t n, uint64_t logical_bytes, uint64_t handle,
                    uint64_t *prev_handle)
{
    size_t insert_at = 0, i = 0, common = 0, leaf_len = 0;
    long nsi;
    int32_t cur = -1, split_child = -1, target = -1, split = -1, leaf = -1;
    char *name = NULL;
    rx_slot *slot;
    int status;

    if (n == 0)
        return SK_RADIX_EMPTY_KEY;
    if (kind < 0 || kind >= RX_KINDS)
        return SK_RADIX_MISS;
    nsi = sk_radix_ns_find(r, ns, ns_len, &insert_at);
    if (nsi >= 0) {
        cur = r->ns[nsi].root;
        while (i < n) {
            int32_t c = rx_child_find(&r->nodes[cur], tokens[i]);
            size_t len;
            if (c < 0)
                break;
            len = r->nodes[c].len;
            common = rx_lcp(r->pool + r->nodes[c].off, tokens + i, len < n - i ? len : n - i);
            if (common < len) {
                split_child = c;
                break;
            }
            i += len;
            cur = c;
            common = 0;
        }
        if (i == n && split_child < 0) {
            target = cur;
            slot = &r->nodes[cur].slot[kind];
            if (slot->present && if_vacant)
                return SK_RADIX_OCCUPIED;
            if (slot->present && kind == SK_RADIX_RESIDENT && slot->refs > 0)
                return SK_RADIX_ACTIVE;
        }
    }

    /* everything fallible first */
    if (target < 0) {
        leaf_len = n - i - common;
        if (rx_reserve_nodes(r, 3) || rx_reserve_pool(r, leaf_len))
            return SK_RADIX_NO_MEMORY;
        if (split_child < 0 && nsi >= 0 &&
            rx_reserve_children(r, cur, (size_t)r->nodes[cur].nchild + 1))
            return SK_RADIX_NO_MEMORY;
        if (nsi < 0) {
            if (sk_grow((void **)&r->ns, &r->ns_cap, r->ns_count + 1, sizeof(rx_ns)))
                return SK_RADIX_NO_MEMORY;
            name = malloc(ns_len ? ns_len : 1);
            if (!name)
                return SK_RADIX_NO_MEMORY;
            if (ns_len)
                memcpy(name, ns, ns_len);
            cur = rx_take_node(r, RX_ROOT, 0, 0, 0);
            if (rx_reserve_children(r, cur, 1)) {
                rx_give_node(r, cur);
                free(name);
                return SK_RADIX_NO_MEMORY;
            }
        }
        if (split_child >= 0) {
            split = rx_take_node(r, cur, r->nodes[split_child].off, common, i + common);
            if (rx_reserve_children(r, split, 2)) {
                rx_give_node(r, split);
                return SK_RADIX_NO_MEMORY;
            }
        }
    }

    /* structural changes; nothing below can fail */
    if (name) {
        memmove(r->ns + insert_at + 1, r->ns + insert_at, (r->ns_count - insert_at) * sizeof(rx_ns));
        r->ns[insert_at].name = name;
        r->ns[insert_at].len = ns_len;
        r->ns[insert_at].root = cur;
        r->ns_count++;
    }
    if (split >= 0) {
        rx_node *c = &r->nodes[split_child];
        c->off += common;
        c->len -= common;
        c->parent = split;
        r->nodes[split].res_below = c->res_below;
        rx_child_replace(r, cur, tokens[i], split);
        rx_child_insert(r, split, r->pool[c->off], split_child);
        r->splits = rx_sat_add(r->splits, 1);
        cur = split;
        target = split;
    }
    if (target < 0 || (split >= 0 && leaf_len > 0)) {
        memcpy(r->pool + r->pool_len, tokens + (n - leaf_len), leaf_len * sizeof(int32_t));
        leaf = rx_take_node(r, cur, r->pool_len, leaf_len, n);
        r->pool_len += leaf_len;
        rx_child_insert(r, cur, tokens[n - leaf_len], leaf);
        target = leaf;
    }

    r->clock = rx_sat_add(r->clock, 1);
    r->version++;
    slot = &r->nodes[target].slot[kind];
    status = SK_RADIX_OK;
    if (slot->present) {
        if (prev_handle)
            *prev_handle = slot->handle;
        status = SK_RADIX_REPLACED;
    } else if (kind == SK_RADIX_RESIDENT) {
        rx_count_resident(r, target, 1);
    }
    slot->present = 1;
    slot->handle = handle;
    slot->bytes = logical_bytes;
    slot->last_used = r->clock;
    slot->refs = 0;
    return status;
}

/*
 * Joins node x (no payload, exactly one child c) into c: c takes x's place under x's parent
 * with the concatenated edge, so c's own children keep their parent links.
 */
static void rx_merge_into_child(sk_radix *r, int32_t x)
{
    rx_node *xn = &r->nodes[x];
    int32_t c = xn->child[0].node;
    rx_node *cn = &r->nodes[c];
    int32_t first = r->pool[xn->off];
    if (xn->off + xn->len == cn->off) {
        cn->off = xn->off;
    } else {
        /* space reserved by the caller */
        memcpy(r->pool + r->pool_len, r->pool + xn->off, xn->len * sizeof(int32_t));
        memcpy(r->pool + r->pool_len + xn->len, r->pool + cn->off, cn->len * sizeof(int32_t));
        r->pool_garbage += xn->len + cn->len;
        cn->off = r->pool_len;
        r->pool_len += xn->len + cn->len;
    }
    cn->len += xn->len;
    cn->parent = xn->parent;
    rx_child_replace(r, xn->parent, first, c);
    rx_give_node(r, x);
}

static int rx_reserve_merge(sk_radix *r, int32_t x)
{
    const rx_node *xn = &r->nodes[x];
    const rx_node *cn = &r->nodes[xn->child[0].node];
    if (xn->off + xn->len == cn->off)
        return 0;
    if (xn->len > SIZE_MAX - cn->len)
        return -1;
    return rx_reserve_pool(r, xn->len + cn->len);
}

int sk_radix_remove_slot(sk_radix *r, size_t ns_index, int32_t id, int kind, uint64_t *handle)
{
    rx_node *nd = &r->nodes[id];
    int other = nd->slot[1 - kind].present != 0;
    int32_t parent = nd->parent;
    int32_t merge = -1; /* node that will be joined into its single child */
    int prune = 0;

    if (!other && nd->nchild == 1) {
        merge = id;
    } else if (!other && nd->nchild == 0) {
        rx_node *pn = &r->nodes[parent];
        prune = 1;
        if (pn->parent != RX_ROOT && pn->nchild == 2 && !pn->slot[0].present &&
            !pn->slot[1].present)
            merge = parent;
    }
    if (merge >= 0 && !prune && rx_reserve_merge(r, merge))
        return SK_RADIX_NO_MEMORY;
    if (merge >= 0 && prune) {
        /* after the prune the parent's single child is the sibling: check that span */
        rx_node *pn = &r->nodes[merge];
        int32_t sib = pn->child[0].node == id ? pn->child[1].node : pn->child[0].node;
        const rx_node *sn = &r->nodes[sib];
        if (pn->off + pn->len != sn->off &&
            (pn->len > SIZE_MAX - sn->len || rx_reserve_pool(r, pn->len + sn->len)))
            return SK_RADIX_NO_MEMORY;
        nd = &r->nodes[id];
    }

    r->version++;
    if (kind == SK_RADIX_RESIDENT)
        rx_count_resident(r, id, -1);
    nd = &r->nodes[id];
    if (handle)
        *handle = nd->slot[kind].handle;
    memset(&nd->slot[kind], 0, sizeof(rx_slot));
    if (prune) {
        rx_child_erase(r, parent, r->pool[nd->off]);
        r->pool_garbage += nd->len;
        rx_give_node(r, id);
        if (r->nodes[parent].parent == RX_ROOT && r->nodes[parent].nchild == 0) {
            free(r->ns[ns_index].name);
            memmove(r->ns + ns_index, r->ns + ns_index + 1,
                    (r->ns_count - ns_index - 1) * sizeof(rx_ns));
            r->ns_count--;
            rx_give_node(r, parent);
        }
    }
    if (merge >= 0)
        rx_merge_into_child(r, merge);
    rx_maybe_compact(r);
    return SK_RADIX_OK;
}

int sk_radix_remove(sk_radix *r, int kind, const char *ns, size_t ns_len, const int32_t *tokens,
                    size_t n, uint64_t *handle)
{
    long nsi;
    int32_t id = sk_radix_find_entry(r, kind, ns, ns_len, tokens, n, &nsi);
    if (id < 0)
        return SK_RADIX_MISS;
    return sk_radix_remove_slot(r, (size_t)nsi, id, kind, handle);
}

int sk_radix_remove_hit(sk_radix *r, int kind, const sk_radix_hit *hit, int count_eviction,
                        uint64_t *handle)
{
    int status;
    if (kind < 0 || kind >= RX_KINDS || hit->ns_index >= r->ns_count || hit->node < 0 ||
        (size_t)hit->node >= r->nodes_used || r->nodes[hit->node].parent < 0 ||
        !r->nodes[hit->node].slot[kind].present)
        return SK_RADIX_MISS;
    status = sk_radix_remove_slot(r, hit->ns_index, hit->node, kind, handle);
    if (status == SK_RADIX_OK && count_eviction)
        r->evictions[kind] = rx_sat_add(r->evictions[kind], 1);
    return status;
}

void sk_radix_copy_key(const sk_radix *r, int32_t node, int32_t *dst)
{
    size_t end = r->nodes[node].depth;
    while (r->nodes[node].parent >= 0) {
        const rx_node *nd = &r->nodes[node];
        end -= nd->len;
        memcpy(dst + end, r->pool + nd->off, nd->len * sizeof(int32_t));
        node = nd->parent;
    }
}
