/*
 * Persistent ranked set (see sk_rank.h): the waiting-prefix radix tree of §3.2 kept alive
 * between rankings.
 *
 * Node 0 is the root. A node stands for the token path of its `depth` first tokens, spelled by
 * the prompt of its `rep` item (any live item below it); the edge into it starts at the
 * parent's depth. Children are found through one hash table keyed by (parent, first edge
 * token) and kept in an array sorted by the bucket key, so the DFS of a ranking is a plain walk.
 * A node exists only where prompts branch or end: removals merge single-child nodes back
 * into their child, which keeps the tree compressed.
 *
 * Adds reserve every node, array slot and hash entry they may need before touching the tree,
 * so a failed allocation never leaves a half-inserted prompt behind.
 */
#include "sk_rank_impl.h"

#include <stdlib.h>
#include <string.h>

#define NIL UINT32_MAX
#define EMIT 0x80000000u /* stack entry flag: output the node's terminal prompts */

typedef struct sk_node {
    size_t depth;
    uint64_t min_order; /* smallest order below the node */
    uint32_t parent;    /* next free node while on the free list */
    uint32_t rep;
    uint32_t count;     /* live items below the node (itself included) */
    int32_t token;      /* first token of the edge from the parent */
    uint32_t *kids, nkids, kcap;
    /* Items whose prompt ends here: the first inline (most nodes have exactly one, and the
     * ranking walk reads it without another cache miss), the others in term[]. */
    uint32_t term0, nterm;
    uint32_t *term, tcap;
} sk_node;

static uint32_t term_at(const sk_node *n, uint32_t i) { return i ? n->term[i - 1] : n->term0; }

static void term_set(sk_node *n, uint32_t i, uint32_t h)
{
    if (i) n->term[i - 1] = h;
    else n->term0 = h;
}

typedef struct sk_slot {
    sk_rank_item item;
    uint64_t seq;  /* add sequence: the input-position tie-break */
    uint32_t node; /* where the prompt ends; NIL while the slot is free */
    uint32_t next_free;
} sk_slot;

typedef struct sk_edge {
    uint64_t key; /* parent << 32 | token */
    uint32_t child;
} sk_edge;

struct sk_rank_set {
    sk_slot *slots;
    uint32_t nslots, slot_cap, free_slot;
    size_t live;
    size_t with_deadline; /* live items with a deadline: 0 (the norm) skips the key entirely */
    uint64_t next_seq;
    sk_node *nodes;
    uint32_t nnodes, node_cap, free_node;
    sk_edge *edges;
    size_t edge_cap, nedges;
    sk_kv *kv_a, *kv_b;
    size_t kv_cap;
    uint32_t *stack;
    size_t stack_cap;
    uint64_t *eff, *grp;
    size_t score_cap;
};

/* sk_grow for the per-node arrays, whose capacities are kept as uint32_t. */
static int grow32(uint32_t **p, uint32_t *cap, size_t need)
{
    size_t c = *cap;
    if (sk_grow((void **)p, &c, need, sizeof(uint32_t))) return SK_RANK_NO_MEMORY;
    *cap = (uint32_t)c;
    return SK_RANK_OK;
}

/* Keeps a node's terminal items by (order, add) ascending, the order emit_terms wants. The
 * new item has the largest add sequence, so it goes after every equal order. */
static void term_insert(const sk_rank_set *s, sk_node *n, uint32_t h)
{
    uint64_t o = s->slots[h].item.order;
    uint32_t i = n->nterm++;
    for (; i > 0 && s->slots[term_at(n, i - 1)].item.order > o; i--) term_set(n, i, term_at(n, i - 1));
    term_set(n, i, h);
}

/* ---- (parent, token) -> child hash table, linear probing with backward-shift deletion ---- */

static uint64_t edge_key(uint32_t parent, int32_t token)
{
    return ((uint64_t)parent << 32) | (uint32_t)token;
}

static size_t edge_home(const sk_rank_set *s, uint64_t key)
{
    return (size_t)((key * 0x9E3779B97F4A7C15ull) >> 20) & (s->edge_cap - 1);
}

static uint32_t edge_get(const sk_rank_set *s, uint32_t parent, int32_t token)
{
    uint64_t key = edge_key(parent, token);
    size_t i = edge_home(s, key);
    while (s->edges[i].child != NIL) {
        if (s->edges[i].key == key) return s->edges[i].child;
        i = (i + 1) & (s->edge_cap - 1);
    }
    return NIL;
}

static void edge_put(sk_rank_set *s, uint32_t parent, int32_t token, uint32_t child)
{
    uint64_t key = edge_key(parent, token);
    size_t i = edge_home(s, key);
    while (s->edges[i].child != NIL && s->edges[i].key != key) i = (i + 1) & (s->edge_cap - 1);
    if (s->edges[i].child == NIL) s->nedges++;
    s->edges[i].key = key;
    s->edges[i].child = child;
}

static void edge_del(sk_rank_set *s, uint32_t parent, int32_t token)
{
    uint64_t key = edge_key(parent, token);
    size_t mask = s->edge_cap - 1, i = edge_home(s, key), j;
    while (s->edges[i].key != key || s->edges[i].child == NIL) {
        if (s->edges[i].child == NIL) return;
        i = (i + 1) & mask;
    }
    s->nedges--;
    for (j = (i + 1) & mask; s->edges[j].child != NIL; j = (j + 1) & mask) {
        size_t home = edge_home(s, s->edges[j].key);
        /* move j back into the hole unless its home lies cyclically in (i, j] */
        if (((j - home) & mask) >= ((j - i) & mask)) {
            s->edges[i] = s->edges[j];
            i = j;
        }
    }
    s->edges[i].child = NIL;
}

static int edge_reserve(sk_rank_set *s, size_t extra)
{
    size_t cap = s->edge_cap ? s->edge_cap : 64, i, old_cap = s->edge_cap;
    sk_edge *old = s->edges, *fresh;
    if (s->edges && (s->nedges + extra) * 2 <= s->edge_cap) return SK_RANK_OK;
    while ((s->nedges + extra) * 2 > cap) cap *= 2;
    fresh = (sk_edge *)malloc(cap * sizeof(sk_edge));
    if (!fresh) return SK_RANK_NO_MEMORY;
    for (i = 0; i < cap; i++) fresh[i].child = NIL;
    s->edges = fresh;
    s->edge_cap = cap;
    s->nedges = 0;
    for (i = 0; i < old_cap; i++)
        if (old[i].child != NIL) {
            size_t j = edge_home(s, old[i].key);
            while (fresh[j].child != NIL) j = (j + 1) & (cap - 1);
            fresh[j] = old[i];
            s->nedges++;
        }
    free(old);
    return SK_RANK_OK;
}

/* ---- children kept sorted by (count desc, min_order asc, token asc) ---- */

static int key_less(uint32_t ca, uint64_t oa, int32_t ta, uint32_t cb, uint64_t ob, int32_t tb)
{
    if (ca != cb) return ca > cb;
    if (oa != ob) return oa < ob;
    return ta < tb;
}

/* First index whose child does not sort before the key. */
static uint32_t kid_bound(const sk_rank_set *s, const sk_node *p, uint32_t c, uint64_t o,
                          int32_t t)
{
    uint32_t lo = 0, hi = p->nkids;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        const sk_node *k = &s->nodes[p->kids[mid]];
        if (key_less(k->count, k->min_order, k->token, c, o, t)) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

static void kid_insert(sk_rank_set *s, sk_node *p, uint32_t x)
{
    const sk_node *n = &s->nodes[x];
    uint32_t at = kid_bound(s, p, n->count, n->min_order, n->token);
    memmove(p->kids + at + 1, p->kids + at, (p->nkids - at) * sizeof(uint32_t));
    p->kids[at] = x;
    p->nkids++;
}

/* Removes x, found by the key it had when it was placed. */
static void kid_remove(sk_rank_set *s, sk_node *p, uint32_t c, uint64_t o, int32_t t)
{
    uint32_t at = kid_bound(s, p, c, o, t);
    memmove(p->kids + at, p->kids + at + 1, (p->nkids - at - 1) * sizeof(uint32_t));
    p->nkids--;
}

/* ---- node and slot pools ---- */

static int nodes_reserve(sk_rank_set *s, uint32_t spare)
{
    uint32_t have = 0, x;
    for (x = s->free_node; x != NIL && have < spare; x = s->nodes[x].parent) have++;
    while (have < spare) {
        if (s->nnodes == s->node_cap) {
            size_t cap = s->node_cap;
            if (cap >= NIL / 2) return SK_RANK_NO_MEMORY;
            if (sk_grow((void **)&s->nodes, &cap, (size_t)s->nnodes + 1, sizeof(sk_node)))
                return SK_RANK_NO_MEMORY;
            s->node_cap = (uint32_t)cap;
        }
        x = s->nnodes++;
        memset(&s->nodes[x], 0, sizeof(sk_node));
        s->nodes[x].parent = s->free_node;
        s->free_node = x;
        have++;
    }
    /* the nodes an add may take get their arrays now, while failing is still harmless */
    for (x = s->free_node, have = 0; have < spare; x = s->nodes[x].parent, have++) {
        if (grow32(&s->nodes[x].kids, &s->nodes[x].kcap, 2)) return SK_RANK_NO_MEMORY;
    }
    return SK_RANK_OK;
}

static uint32_t node_take(sk_rank_set *s, uint32_t parent, size_t depth, int32_t token,
                          uint32_t rep)
{
    uint32_t x = s->free_node;
    sk_node *n = &s->nodes[x];
    s->free_node = n->parent;
    n->parent = parent;
    n->depth = depth;
    n->token = token;
    n->rep = rep;
    n->count = 0;
    n->min_order = UINT64_MAX;
    n->nkids = n->nterm = 0;
    return x;
}

static void node_release(sk_rank_set *s, uint32_t x)
{
    s->nodes[x].parent = s->free_node; /* arrays are kept for reuse */
    s->free_node = x;
}

sk_rank_set *sk_rank_set_new(void)
{
    sk_rank_set *s = (sk_rank_set *)calloc(1, sizeof(sk_rank_set));
    if (!s) return NULL;
    s->free_slot = NIL;
    s->free_node = NIL;
    if (nodes_reserve(s, 1) || edge_reserve(s, 1)) {
        sk_rank_set_free(s);
        return NULL;
    }
    node_take(s, NIL, 0, 0, NIL);
    return s;
}

void sk_rank_set_free(sk_rank_set *s)
{
    uint32_t x;
    if (!s) return;
    for (x = 0; x < s->nnodes; x++) {
        free(s->nodes[x].kids);
        free(s->nodes[x].term);
    }
    free(s->nodes);
    free(s->slots);
    free(s->edges);
    free(s->kv_a);
    free(s->kv_b);
    free(s->stack);
    free(s->eff);
    free(s->grp);
    free(s);
}

size_t sk_rank_set_size(const sk_rank_set *s) { return s->live; }

/* ---- add ---- */

/* Walks down as far as the prompt matches existing nodes. Returns the deepest node v whose
 * path is a prefix of the prompt; *child is the child of v the prompt diverges inside (NIL
 * when there is none) and *split the depth where it diverges from that child. */
static uint32_t descend(const sk_rank_set *s, const int32_t *p, size_t len, uint32_t *child,
                        size_t *split)
{
    uint32_t v = 0;
    for (;;) {
        size_t dv = s->nodes[v].depth, cd, lim;
        uint32_t c;
        const int32_t *rt;
        *child = NIL;
        if (len == dv) return v;
        c = edge_get(s, v, p[dv]);
        if (c == NIL) return v;
        cd = s->nodes[c].depth;
        rt = s->slots[s->nodes[c].rep].item.tokens;
        lim = cd < len ? cd : len;
        *split = dv + 1 + sk_rank_lcp32(rt + dv + 1, p + dv + 1, lim - dv - 1);
        if (*split < cd) {
            *child = c;
            return v;
        }
        v = c;
    }
}

int sk_rank_set_add(sk_rank_set *s, const sk_rank_item *item, uint32_t *out_handle)
{
    const int32_t *p = item->tokens;
    size_t len = item->token_count, split = 0;
    uint32_t v, c, h, end, x;
    sk_node *vn;

    if (s->live >= NIL / 2) return SK_RANK_NO_MEMORY;
    if (s->free_slot == NIL && s->nslots == s->slot_cap) {
        size_t cap = s->slot_cap;
        if (sk_grow((void **)&s->slots, &cap, (size_t)s->nslots + 1, sizeof(sk_slot)))
            return SK_RANK_NO_MEMORY;
        s->slot_cap = (uint32_t)cap;
    }
    v = descend(s, p, len, &c, &split);
    if (nodes_reserve(s, 2) || edge_reserve(s, 3)) return SK_RANK_NO_MEMORY;
    vn = &s->nodes[v];
    if (c == NIL && len == vn->depth) {
        if (grow32(&vn->term, &vn->tcap, vn->nterm)) return SK_RANK_NO_MEMORY;
    } else if (c == NIL) {
        if (grow32(&vn->kids, &vn->kcap, (size_t)vn->nkids + 1)) return SK_RANK_NO_MEMORY;
    }
    /* From here on nothing can fail. */
    if (s->free_slot != NIL) {
        h = s->free_slot;
        s->free_slot = s->slots[h].next_free;
    } else {
        h = s->nslots++;
    }
    s->slots[h].item = *item;
    s->slots[h].seq = s->next_seq++;

    if (c != NIL) { /* the prompt leaves the edge into c part-way: split that edge */
        sk_node *cn = &s->nodes[c];
        uint32_t at = kid_bound(s, &s->nodes[v], cn->count, cn->min_order, cn->token);
        uint32_t m = node_take(s, v, split, cn->token, cn->rep);
        sk_node *mn = &s->nodes[m];
        cn = &s->nodes[c];
        mn->count = cn->count;
        mn->min_order = cn->min_order;
        s->nodes[v].kids[at] = m; /* same key as c: same place */
        edge_put(s, v, mn->token, m);
        cn->parent = m;
        cn->token = s->slots[cn->rep].item.tokens[split];
        edge_put(s, m, cn->token, c);
        mn->kids[0] = c;
        mn->nkids = 1;
        v = m;
    }
    if (len == s->nodes[v].depth) {
        end = v;
    } else {
        end = node_take(s, v, len, p[s->nodes[v].depth], h);
        edge_put(s, v, s->nodes[end].token, end);
    }
    term_insert(s, &s->nodes[end], h);
    s->slots[h].node = end;

    for (x = end; x != NIL; x = s->nodes[x].parent) {
        sk_node *n = &s->nodes[x];
        int placed = n->count > 0; /* a new leaf is not among its parent's children yet */
        if (x != 0 && placed) kid_remove(s, &s->nodes[n->parent], n->count, n->min_order, n->token);
        n->count++;
        if (item->order < n->min_order) n->min_order = item->order;
        if (n->rep == NIL) n->rep = h;
        if (x != 0) kid_insert(s, &s->nodes[n->parent], x);
    }
    s->live++;
    s->with_deadline += item->deadline != UINT64_MAX;
    *out_handle = h;
    return SK_RANK_OK;
}

/* ---- remove ---- */

static uint64_t subtree_min_order(const sk_rank_set *s, const sk_node *n)
{
    uint64_t m = UINT64_MAX;
    uint32_t i;
    for (i = 0; i < n->nterm; i++)
        if (s->slots[term_at(n, i)].item.order < m) m = s->slots[term_at(n, i)].item.order;
    for (i = 0; i < n->nkids; i++)
        if (s->nodes[n->kids[i]].min_order < m) m = s->nodes[n->kids[i]].min_order;
    return m;
}

int sk_rank_set_remove(sk_rank_set *s, uint32_t h)
{
    uint64_t order;
    uint32_t x, next, i;
    sk_node *n;
    if (h >= s->nslots || s->slots[h].node == NIL) return SK_RANK_INVALID;
    order = s->slots[h].item.order;
    x = s->slots[h].node;
    n = &s->nodes[x];
    for (i = 0; term_at(n, i) != h; i++) {}
    for (n->nterm--; i < n->nterm; i++) term_set(n, i, term_at(n, i + 1));

    for (; x != NIL; x = next) {
        n = &s->nodes[x];
        next = n->parent;
        if (x != 0) kid_remove(s, &s->nodes[next], n->count, n->min_order, n->token);
        n->count--;
        if (n->count == 0) {
            n->min_order = UINT64_MAX;
            n->rep = NIL;
            if (x != 0) {
                edge_del(s, next, n->token);
                node_release(s, x);
            }
            continue;
        }
        if (n->min_order == order) n->min_order = subtree_min_order(s, n);
        if (n->rep == h) n->rep = n->nterm ? n->term0 : s->nodes[n->kids[0]].rep;
        if (x == 0) continue;
        if (n->nterm == 0 && n->nkids == 1) { /* no longer a branch point: merge into the child */
            uint32_t c = n->kids[0];
            sk_node *cn = &s->nodes[c];
            edge_del(s, x, cn->token);
            cn->parent = next;
            cn->token = n->token;
            edge_put(s, next, cn->token, c);
            node_release(s, x);
            kid_insert(s, &s->nodes[next], c);
        } else {
            kid_insert(s, &s->nodes[next], x);
        }
    }
    s->with_deadline -= s->slots[h].item.deadline != UINT64_MAX;
    s->slots[h].node = NIL;
    s->slots[h].next_free = s->free_slot;
    s->free_slot = h;
    s->live--;
    return SK_RANK_OK;
}

int sk_rank_set_update(sk_rank_set *s, uint32_t h, uint64_t priority, uint64_t saved_cost,
                       uint64_t enqueued_turn)
{
    if (h >= s->nslots || s->slots[h].node == NIL) return SK_RANK_INVALID;
    s->slots[h].item.priority = priority;
    s->slots[h].item.saved_cost = saved_cost;
    s->slots[h].item.enqueued_turn = enqueued_turn;
    return SK_RANK_OK;
}

/* ---- order ---- */

enum { BY_SEQ, BY_ORDER, BY_PRIORITY, BY_EFF, BY_GROUP, BY_DEADLINE };

static void sort_range(sk_rank_set *s, sk_kv *kv, size_t n, int by)
{
    size_t i;
    for (i = 0; i < n; i++) {
        const sk_slot *sl = &s->slots[kv[i].idx];
        switch (by) {
        case BY_SEQ: kv[i].key = sl->seq; break;
        case BY_ORDER: kv[i].key = sl->item.order; break;
        case BY_PRIORITY: kv[i].key = ~sl->item.priority; break;
        case BY_EFF: kv[i].key = ~s->eff[kv[i].idx]; break;
        case BY_DEADLINE: kv[i].key = sl->item.deadline; break;
        default: kv[i].key = ~s->grp[kv[i].idx]; break;
        }
    }
    sk_rank_kv_sort(kv, s->kv_b, n);
}

/* Appends the prompts ending at node x (all identical) by effective score, order, add. */
static size_t emit_terms(sk_rank_set *s, const sk_node *n, size_t w)
{
    uint32_t i;
    int mixed = 0;
    for (i = 0; i < n->nterm; i++) {
        uint32_t h = term_at(n, i);
        s->kv_a[w + i].idx = h;
        mixed |= s->eff[h] != s->eff[n->term0];
    }
    /* already by (order, add): many identical prompts cost one pass, not three sorts */
    if (mixed) sort_range(s, s->kv_a + w, n->nterm, BY_EFF);
    return w + n->nterm;
}

int sk_rank_set_order(sk_rank_set *s, uint64_t current_turn, uint64_t aging_cost_per_turn,
                      int group_waiting_prefixes, int mode, uint32_t *out)
{
    size_t n = s->live, w = 0, top = 0, i, cap;
    uint32_t h;
    uint64_t grp0 = 0, prio0 = 0, dl0 = 0;
    int seen = 0, mixed_grp = 0, mixed_prio = 0, mixed_dl = 0;
    if (mode < SK_RANK_CACHE_AWARE || mode > SK_RANK_PRIORITY) return SK_RANK_INVALID;
    if (n == 0) return SK_RANK_OK;
    cap = s->kv_cap;
    if (sk_grow((void **)&s->kv_a, &cap, n, sizeof(sk_kv))) return SK_RANK_NO_MEMORY;
    if (cap != s->kv_cap) {
        size_t cap_b = s->kv_cap;
        if (sk_grow((void **)&s->kv_b, &cap_b, cap, sizeof(sk_kv))) return SK_RANK_NO_MEMORY;
        s->kv_cap = cap;
    }
    cap = s->score_cap;
    if (sk_grow((void **)&s->eff, &cap, s->nslots, sizeof(uint64_t))) return SK_RANK_NO_MEMORY;
    if (cap != s->score_cap) {
        size_t cap_g = s->score_cap;
        if (sk_grow((void **)&s->grp, &cap_g, cap, sizeof(uint64_t))) return SK_RANK_NO_MEMORY;
        s->score_cap = cap;
    }
    if (sk_grow((void **)&s->stack, &s->stack_cap, 2 * (size_t)s->nnodes + 2, sizeof(uint32_t)))
        return SK_RANK_NO_MEMORY;

    /* A key every live item shares needs no pass at all (one priority level is the norm). */
    for (h = 0; h < s->nslots; h++) {
        const sk_slot *sl = &s->slots[h];
        if (sl->node == NIL) continue;
        if (mode == SK_RANK_CACHE_AWARE) {
            sk_rank_scores(&sl->item, current_turn, aging_cost_per_turn, &s->eff[h], &s->grp[h]);
            if (!seen) grp0 = s->grp[h];
            mixed_grp |= s->grp[h] != grp0;
        }
        if (!seen) prio0 = sl->item.priority;
        mixed_prio |= sl->item.priority != prio0;
        seen = 1;
    }
    /* Deadlines (cache-aware mode only, §3.3a) get a pass only when they differ somewhere. */
    if (mode == SK_RANK_CACHE_AWARE && s->with_deadline == n) {
        int first = 1;
        for (h = 0; h < s->nslots && !mixed_dl; h++) {
            if (s->slots[h].node == NIL) continue;
            if (first) dl0 = s->slots[h].item.deadline;
            mixed_dl = s->slots[h].item.deadline != dl0;
            first = 0;
        }
    } else if (mode == SK_RANK_CACHE_AWARE) {
        mixed_dl = s->with_deadline > 0;
    }

    if (mode == SK_RANK_CACHE_AWARE && group_waiting_prefixes) {
        s->stack[top++] = 0;
        while (top > 0) {
            uint32_t e = s->stack[--top];
            const sk_node *nd = &s->nodes[e & ~EMIT];
            uint32_t k;
            /* the walk jumps between nodes: fetch the ones a few pops ahead */
            if (top >= 6) SK_PREFETCH(&s->nodes[s->stack[top - 6] & ~EMIT]);
            if ((e & EMIT) || nd->nkids == 0) {
                w = emit_terms(s, nd, w);
                continue;
            }
            if (nd->nterm) s->stack[top++] = e | EMIT;
            for (k = nd->nkids; k-- > 0;) s->stack[top++] = nd->kids[k];
        }
        if (mixed_dl) sort_range(s, s->kv_a, n, BY_DEADLINE); /* §3.3a */
        if (mixed_grp) sort_range(s, s->kv_a, n, BY_GROUP);
    } else {
        for (h = 0; h < s->nslots; h++)
            if (s->slots[h].node != NIL) s->kv_a[w++].idx = h;
        sort_range(s, s->kv_a, n, BY_SEQ);
        sort_range(s, s->kv_a, n, BY_ORDER);
        if (mode == SK_RANK_CACHE_AWARE) {
            if (mixed_dl) sort_range(s, s->kv_a, n, BY_DEADLINE);
            sort_range(s, s->kv_a, n, BY_EFF);
        }
    }
    if (mode != SK_RANK_FCFS && mixed_prio) sort_range(s, s->kv_a, n, BY_PRIORITY);
    for (i = 0; i < n; i++) out[i] = s->kv_a[i].idx;
    return SK_RANK_OK;
}

/* ---- prefix look-up ---- */

int sk_rank_set_under(sk_rank_set *s, const int32_t *tokens, size_t n, uint32_t *out,
                      size_t *out_count)
{
    *out_count = 0;
    if (s->live == 0) return SK_RANK_OK;
    /* The node whose path first covers tokens[0..n), if the prefix is a path at all. */
    uint32_t v = 0;
    while (s->nodes[v].depth < n) {
        size_t dv = s->nodes[v].depth;
        uint32_t c = edge_get(s, v, tokens[dv]);
        if (c == NIL) return SK_RANK_OK;
        size_t cd = s->nodes[c].depth, lim = cd < n ? cd : n;
        const int32_t *rt = s->slots[s->nodes[c].rep].item.tokens;
        if (dv + 1 < lim && sk_rank_lcp32(rt + dv + 1, tokens + dv + 1, lim - dv - 1) < lim - dv - 1)
            return SK_RANK_OK;
        v = c;
    }
    if (sk_grow((void **)&s->stack, &s->stack_cap, 2 * (size_t)s->nnodes + 2, sizeof(uint32_t)))
        return SK_RANK_NO_MEMORY;
    size_t top = 0, count = 0;
    s->stack[top++] = v;
    while (top) {
        const sk_node *nd = &s->nodes[s->stack[--top]];
        for (uint32_t i = 0; i < nd->nterm; i++) out[count++] = term_at(nd, i);
        for (uint32_t k = 0; k < nd->nkids; k++) s->stack[top++] = nd->kids[k];
    }
    *out_count = count;
    return SK_RANK_OK;
}
