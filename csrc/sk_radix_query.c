/*
 * Query half of the radix cache: longest-prefix probes, exact look-ups, reference release,
 * the LRU victim scan, the ordered entry cursor and stats. Scans walk in preorder through
 * parent links (no stack); preorder in child-key order is the lexicographic order of token
 * paths, which the "nearest descendant" rule and the LRU tie-break are defined by.
 */
#include "sk_radix_internal.h"

int32_t sk_radix_preorder_next(const sk_radix *r, int32_t cur, int32_t top)
{
    if (r->nodes[cur].nchild)
        return r->nodes[cur].child[0].node;
    while (cur != top) {
        int32_t p = r->nodes[cur].parent;
        const rx_node *pn = &r->nodes[p];
        uint32_t k = rx_child_lower(pn, rx_first(r, cur));
        if (k + 1 < pn->nchild)
            return pn->child[k + 1].node;
        cur = p;
    }
    return -1;
}

/* lexicographically smallest resident key in a subtree known to hold one */
static int32_t rx_first_resident(const sk_radix *r, int32_t cur)
{
    while (!r->nodes[cur].slot[SK_RADIX_RESIDENT].present) {
        const rx_node *nd = &r->nodes[cur];
        uint32_t k = 0;
        while (r->nodes[nd->child[k].node].res_below == 0)
            k++;
        cur = nd->child[k].node;
    }
    return cur;
}

/*
 * Longest query prefix with a resident entry at or below the point it reaches (a longer
 * cached sequence is sliced), i.e. the longest common prefix with any resident key. The walk
 * only enters subtrees that hold a resident entry, so it stops exactly there; divergence
 * mid-edge or at a branch point still matches the common part. The source is the nearest
 * resident descendant of that point in key order.
 */
static int32_t rx_backing_prefix(const sk_radix *r, int32_t root, const int32_t *t, size_t n,
                                 size_t *matched)
{
    int32_t cur = root, src = -1;
    size_t i = 0, m = 0;
    while (i < n) {
        int32_t c = rx_child_find(&r->nodes[cur], t[i]);
        size_t len, common;
        if (c < 0 || r->nodes[c].res_below == 0)
            break;
        len = r->nodes[c].len;
        common = rx_lcp(r->pool + r->nodes[c].off, t + i, len < n - i ? len : n - i);
        src = c;
        if (common < len) {
            m = i + common;
            break;
        }
        i += len;
        m = i;
        cur = c;
    }
    *matched = m;
    return m > 0 ? rx_first_resident(r, src) : -1;
}

/* deepest node on the query path holding an exact recurrent entry */
static int32_t rx_recurrent_prefix(const sk_radix *r, int32_t root, const int32_t *t, size_t n,
                                   size_t *matched)
{
    int32_t cur = root, best = -1;
    size_t i = 0;
    *matched = 0;
    while (i < n) {
        int32_t c = rx_child_find(&r->nodes[cur], t[i]);
        const rx_node *cn;
        if (c < 0)
            break;
        cn = &r->nodes[c];
        if (cn->len > n - i || rx_lcp(r->pool + cn->off, t + i, cn->len) != cn->len)
            break;
        i += cn->len;
        cur = c;
        if (cn->slot[SK_RADIX_RECURRENT].present) {
            best = cur;
            *matched = i;
        }
    }
    return best;
}

static void rx_fill(const sk_radix *r, int32_t id, size_t ns_index, int kind, size_t matched,
                    sk_radix_hit *out)
{
    const rx_node *nd = &r->nodes[id];
    const rx_slot *s = &nd->slot[kind];
    out->matched_tokens = matched;
    out->stored_tokens = nd->depth;
    out->handle = s->handle;
    out->logical_bytes = s->bytes;
    out->last_used = s->last_used;
    out->active_refs = s->refs;
    out->node = id;
    out->ns_index = ns_index;
}

int sk_radix_probe(sk_radix *r, int kind, int mode, const char *ns, size_t ns_len,
                   const int32_t *tokens, size_t n, sk_radix_hit *out)
{
    long nsi;
    int32_t best;
    size_t matched;
    rx_slot *s;
    if (mode != SK_RADIX_PEEK)
        r->clock = rx_sat_add(r->clock, 1);
    if (kind < 0 || kind >= RX_KINDS)
        return SK_RADIX_MISS;
    nsi = sk_radix_ns_find(r, ns, ns_len, NULL);
    if (nsi < 0)
        return SK_RADIX_MISS;
    if (kind == SK_RADIX_RESIDENT)
        best = rx_backing_prefix(r, r->ns[nsi].root, tokens, n, &matched);
    else
        best = rx_recurrent_prefix(r, r->ns[nsi].root, tokens, n, &matched);
    if (best < 0)
        return SK_RADIX_MISS;
    s = &r->nodes[best].slot[kind];
    if (mode != SK_RADIX_PEEK)
        s->last_used = r->clock;
    if (mode == SK_RADIX_ACQUIRE && s->refs < UINT32_MAX)
        s->refs++;
    rx_fill(r, best, (size_t)nsi, kind, matched, out);
    return SK_RADIX_OK;
}

int sk_radix_exact(sk_radix *r, int kind, int touch, const char *ns, size_t ns_len,
                   const int32_t *tokens, size_t n, sk_radix_hit *out)
{
    long nsi;
    int32_t id;
    if (touch)
        r->clock = rx_sat_add(r->clock, 1);
    id = sk_radix_find_entry(r, kind, ns, ns_len, tokens, n, &nsi);
    if (id < 0)
        return SK_RADIX_MISS;
    if (touch)
        r->nodes[id].slot[kind].last_used = r->clock;
    rx_fill(r, id, (size_t)nsi, kind, n, out);
    return SK_RADIX_OK;
}

int sk_radix_release(sk_radix *r, int kind, const char *ns, size_t ns_len,
                     const int32_t *tokens, size_t n)
{
    long nsi;
    int32_t id = sk_radix_find_entry(r, kind, ns, ns_len, tokens, n, &nsi);
    rx_slot *s;
    if (id < 0)
        return SK_RADIX_MISS;
    s = &r->nodes[id].slot[kind];
    if (s->refs == 0)
        return SK_RADIX_MISS;
    s->refs--;
    r->clock = rx_sat_add(r->clock, 1);
    s->last_used = r->clock;
    return SK_RADIX_OK;
}

int sk_radix_lru(const sk_radix *r, int kind, sk_radix_hit *out)
{
    size_t k, best_ns = 0;
    int32_t best = -1;
    uint64_t best_used = 0;
    if (kind < 0 || kind >= RX_KINDS)
        return SK_RADIX_MISS;
    /* namespaces ascend and preorder ascends, so keeping the first minimum is the tie-break */
    for (k = 0; k < r->ns_count; k++) {
        int32_t root = r->ns[k].root, cur = root;
        while (cur >= 0) {
            const rx_slot *s = &r->nodes[cur].slot[kind];
            if (s->present && s->refs == 0 && (best < 0 || s->last_used < best_used)) {
                best = cur;
                best_ns = k;
                best_used = s->last_used;
            }
            cur = sk_radix_preorder_next(r, cur, root);
        }
    }
    if (best < 0)
        return SK_RADIX_MISS;
    rx_fill(r, best, best_ns, kind, r->nodes[best].depth, out);
    return SK_RADIX_OK;
}

int sk_radix_next(const sk_radix *r, int kind, size_t *ns_index, int32_t *node,
                  sk_radix_hit *out)
{
    size_t k = *ns_index;
    int32_t cur = *node;
    if (kind < 0 || kind >= RX_KINDS)
        return SK_RADIX_MISS;
    while (k < r->ns_count) {
        int32_t root = r->ns[k].root;
        cur = cur < 0 ? root : sk_radix_preorder_next(r, cur, root);
        while (cur >= 0 && !r->nodes[cur].slot[kind].present)
            cur = sk_radix_preorder_next(r, cur, root);
        if (cur >= 0) {
            *ns_index = k;
            *node = cur;
            rx_fill(r, cur, k, kind, r->nodes[cur].depth, out);
            return SK_RADIX_OK;
        }
        k++;
    }
    *ns_index = k;
    *node = -1;
    return SK_RADIX_MISS;
}

const char *sk_radix_ns_name(const sk_radix *r, size_t ns_index, size_t *len)
{
    if (ns_index >= r->ns_count) {
        *len = 0;
        return NULL;
    }
    *len = r->ns[ns_index].len;
    return r->ns[ns_index].name;
}

void sk_radix_get_stats(const sk_radix *r, sk_radix_stats *out)
{
    size_t i;
    memset(out, 0, sizeof(*out));
    out->namespaces = r->ns_count;
    out->splits = r->splits;
    out->resident_evictions = r->evictions[SK_RADIX_RESIDENT];
    out->recurrent_evictions = r->evictions[SK_RADIX_RECURRENT];
    for (i = 0; i < r->nodes_used; i++) {
        const rx_node *nd = &r->nodes[i];
        const rx_slot *res = &nd->slot[SK_RADIX_RESIDENT];
        const rx_slot *rec = &nd->slot[SK_RADIX_RECURRENT];
        if (nd->parent == RX_FREE || nd->parent == RX_ROOT)
            continue;
        out->nodes++;
        out->token_edges = rx_sat_add(out->token_edges, nd->len);
        if (res->present) {
            out->resident_entries++;
            out->resident_tokens = rx_sat_add(out->resident_tokens, nd->depth);
            out->resident_logical_bytes = rx_sat_add(out->resident_logical_bytes, res->bytes);
            out->resident_active_refs = rx_sat_add(out->resident_active_refs, res->refs);
        }
        if (rec->present) {
            out->recurrent_entries++;
            out->recurrent_logical_bytes = rx_sat_add(out->recurrent_logical_bytes, rec->bytes);
            out->recurrent_active_refs = rx_sat_add(out->recurrent_active_refs, rec->refs);
        }
    }
}
