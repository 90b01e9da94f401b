/*
 * Waiting-work ranking kernel (behaviour.md §3).
 *
 * Every ordering here is a chain of stable LSD radix sorts on 64-bit keys, least significant
 * key first: the reference comparator (priority, score, waiting-prefix DFS rank, effective
 * score, enqueue order, then input position by stability) becomes a few linear passes, and
 * only key bytes that differ somewhere get a pass, so a key shared by the whole queue (one
 * priority level, one score band) costs a single read of the keys.
 *
 * The waiting-prefix DFS rank is produced in place: a segment of the position array holding
 * one radix node is rearranged so that its children occupy consecutive sub-segments in visit
 * order, followed by the prompts that end at the node. Each child is then refined inside its
 * own sub-segment, so the order in which pending segments are processed does not matter and
 * an explicit work stack replaces recursion. Common token runs are skipped with block
 * compares against the segment's first prompt before branching, so a long shared prefix costs
 * one sequential scan per prompt, never one stack level per token.
 *
 * Prompts with identical token vectors always end together at one node, where they form a
 * contiguous block; the reference compares them as equal at the DFS key, so that block is
 * ordered by (effective score desc, order asc, position asc) right away. The DFS output is
 * then already sorted by every key below the score, and stable sorts by the TTFT deadline
 * (§3.3a), then (priority desc, grouping score desc) finish the job. A deadline key shared by
 * the whole queue (no deadlines: UINT64_MAX everywhere) gets no pass at all.
 */
#include "sk_rank_impl.h"

#include <stdlib.h>
#include <string.h>

#define SK_SMALL_SORT 24

typedef struct sk_task {
    uint32_t start, count;
    size_t depth;
} sk_task;

struct sk_rank_ws {
    size_t cap;
    uint32_t *pos;     /* DFS order under construction */
    uint32_t *term;    /* prompts ending at the current node */
    uint64_t *eff;     /* effective score per position */
    uint64_t *grp;     /* grouping score per position */
    sk_kv *kv_a, *kv_b, *kv_c;
    sk_task *tasks;
};

sk_rank_ws *sk_rank_ws_new(void) { return (sk_rank_ws *)calloc(1, sizeof(sk_rank_ws)); }

void sk_rank_ws_free(sk_rank_ws *ws)
{
    if (!ws) return;
    free(ws->pos);
    free(ws->term);
    free(ws->eff);
    free(ws->grp);
    free(ws->kv_a);
    free(ws->kv_b);
    free(ws->kv_c);
    free(ws->tasks);
    free(ws);
}

/* NOTE: each buffer is swapped in as soon as it grows, so a failure part-way leaves every
 * pointer valid; cap only advances once all of them hold the new size. */
static int ws_reserve(sk_rank_ws *ws, size_t n)
{
    size_t want;
    if (n <= ws->cap) return SK_RANK_OK;
    want = sk_grown_capacity(ws->cap, n, 64);
    if (sk_resize((void **)&ws->pos, want, sizeof *ws->pos) ||
        sk_resize((void **)&ws->term, want, sizeof *ws->term) ||
        sk_resize((void **)&ws->eff, want, sizeof *ws->eff) ||
        sk_resize((void **)&ws->grp, want, sizeof *ws->grp) ||
        sk_resize((void **)&ws->kv_a, want, sizeof *ws->kv_a) ||
        sk_resize((void **)&ws->kv_b, want, sizeof *ws->kv_b) ||
        sk_resize((void **)&ws->kv_c, want, sizeof *ws->kv_c) ||
        sk_resize((void **)&ws->tasks, want, sizeof *ws->tasks))
        return SK_RANK_NO_MEMORY;
    ws->cap = want;
    return SK_RANK_OK;
}

uint64_t sk_rank_deadline_key(double deadline_us)
{
    uint64_t bits;
    if (!(deadline_us > 0.0)) return UINT64_MAX;
    memcpy(&bits, &deadline_us, sizeof bits);
    return bits;
}

/* Stable sort by key; the result ends in a. tmp must hold n records. Only the key bytes that
 * differ somewhere get a pass (order values, tokens and counts rarely use more than two). */
void sk_rank_kv_sort(sk_kv *a, sk_kv *tmp, size_t n)
{
    uint32_t hist[8][256];
    unsigned digit[8], nd = 0, d, q;
    uint64_t all_or = 0, all_and = UINT64_MAX, varying;
    sk_kv *src = a, *dst = tmp;
    size_t i;
    if (n < 2) return;
    if (n <= SK_SMALL_SORT) {
        for (i = 1; i < n; i++) {
            sk_kv v = a[i];
            size_t j = i;
            while (j > 0 && a[j - 1].key > v.key) {
                a[j] = a[j - 1];
                j--;
            }
            a[j] = v;
        }
        return;
    }
    for (i = 0; i < n; i++) {
        all_or |= a[i].key;
        all_and &= a[i].key;
    }
    varying = all_or ^ all_and;
    for (d = 0; d < 8; d++)
        if ((varying >> (8 * d)) & 255u) digit[nd++] = d;
    if (nd == 0) return;
    memset(hist, 0, nd * sizeof(hist[0]));
    for (i = 0; i < n; i++) {
        uint64_t k = a[i].key;
        for (q = 0; q < nd; q++) hist[q][(k >> (8 * digit[q])) & 255u]++;
    }
    for (q = 0; q < nd; q++) {
        uint32_t *h = hist[q], sum = 0;
        unsigned shift = 8 * digit[q], b;
        for (b = 0; b < 256; b++) {
            uint32_t c = h[b];
            h[b] = sum;
            sum += c;
        }
        for (i = 0; i < n; i++) dst[h[(src[i].key >> shift) & 255u]++] = src[i];
        { sk_kv *t = src; src = dst; dst = t; }
    }
    if (src != a) memcpy(a, src, n * sizeof(sk_kv));
}

#define SK_AHEAD 8 /* prompts touched ahead of use: token reads are one cache miss each */

/* Length of the common prefix of a and b, at most n tokens. Whole blocks are compared with a
 * branch-free OR of differences (which compilers vectorise) before the exact scan. */
size_t sk_rank_lcp32(const int32_t *a, const int32_t *b, size_t n)
{
    size_t i = 0;
    if (a == b) return n;
    while (i + 32 <= n) {
        uint32_t diff = 0;
        unsigned k;
        for (k = 0; k < 32; k++) diff |= (uint32_t)(a[i + k] ^ b[i + k]);
        if (diff) break;
        i += 32;
    }
    while (i < n && a[i] == b[i]) i++;
    return i;
}

/* Orders one node's prompts that end at it (all identical) and writes them at pos[at..). */
static void place_terminals(sk_rank_ws *ws, const sk_rank_item *items, size_t t, size_t at)
{
    sk_kv *kv = ws->kv_a;
    size_t i;
    for (i = 0; i < t; i++) {
        kv[i].idx = ws->term[i];
        kv[i].key = ws->term[i];
    }
    sk_rank_kv_sort(kv, ws->kv_b, t);
    for (i = 0; i < t; i++) kv[i].key = items[kv[i].idx].order;
    sk_rank_kv_sort(kv, ws->kv_b, t);
    for (i = 0; i < t; i++) kv[i].key = ~ws->eff[kv[i].idx];
    sk_rank_kv_sort(kv, ws->kv_b, t);
    for (i = 0; i < t; i++) ws->pos[at + i] = kv[i].idx;
}

/* Rearranges pos[0..n) into the waiting-prefix DFS order of §3.2 (identical prompts grouped
 * and ordered by effective score, order, position). */
static void dfs_order(sk_rank_ws *ws, const sk_rank_item *items, size_t n)
{
    size_t top = 0;
    ws->tasks[top].start = 0;
    ws->tasks[top].count = (uint32_t)n;
    ws->tasks[top].depth = 0;
    top++;
    while (top > 0) {
        sk_task task = ws->tasks[--top];
        uint32_t *seg = ws->pos + task.start;
        size_t k = task.count, d = task.depth, limit, j, m = 0, t = 0, b = 0, w = 0;
        const int32_t *first;
        if (k < 2) continue;
        limit = items[seg[0]].token_count;
        for (j = 1; j < k; j++)
            if (items[seg[j]].token_count < limit) limit = items[seg[j]].token_count;
        first = items[seg[0]].tokens;
        for (j = 1; j < k && limit > d; j++) {
            if (j + SK_AHEAD < k) SK_PREFETCH(items[seg[j + SK_AHEAD]].tokens + d);
            limit = d + sk_rank_lcp32(first + d, items[seg[j]].tokens + d, limit - d);
        }
        d = limit;

        for (j = 0; j < k; j++) {
            uint32_t p = seg[j];
            if (j + SK_AHEAD < k) {
                const sk_rank_item *ahead = &items[seg[j + SK_AHEAD]];
                if (ahead->token_count > d) SK_PREFETCH(ahead->tokens + d);
            }
            if (items[p].token_count == d) {
                ws->term[t++] = p;
            } else {
                ws->kv_a[m].key = (uint32_t)items[p].tokens[d] ^ 0x80000000u;
                ws->kv_a[m].idx = p;
                m++;
            }
        }
        sk_rank_kv_sort(ws->kv_a, ws->kv_b, m);
        /* Buckets come out in ascending token order; the stable sorts below keep that as the
         * last tie-break after (size desc, smallest order asc). */
        for (j = 0; j < m;) {
            size_t e = j + 1;
            uint64_t min_order = items[ws->kv_a[j].idx].order;
            while (e < m && ws->kv_a[e].key == ws->kv_a[j].key) {
                uint64_t o = items[ws->kv_a[e].idx].order;
                if (o < min_order) min_order = o;
                e++;
            }
            ws->kv_c[b].key = min_order;
            ws->kv_c[b].idx = (uint32_t)j;
            ws->kv_c[b].aux = (uint32_t)(e - j);
            b++;
            j = e;
        }
        sk_rank_kv_sort(ws->kv_c, ws->kv_b, b);
        for (j = 0; j < b; j++) ws->kv_c[j].key = (uint64_t)(UINT32_MAX - ws->kv_c[j].aux);
        sk_rank_kv_sort(ws->kv_c, ws->kv_b, b);
        for (j = 0; j < b; j++) {
            size_t from = ws->kv_c[j].idx, cnt = ws->kv_c[j].aux, q;
            for (q = 0; q < cnt; q++) seg[w + q] = ws->kv_a[from + q].idx;
            if (cnt > 1) {
                ws->tasks[top].start = task.start + (uint32_t)w;
                ws->tasks[top].count = (uint32_t)cnt;
                ws->tasks[top].depth = d + 1;
                top++;
            }
            w += cnt;
        }
        place_terminals(ws, items, t, task.start + w);
    }
}

/* Fills the scores; returns whether the deadline keys differ anywhere (else no pass). */
static int fill_scores(sk_rank_ws *ws, const sk_rank_item *items, size_t n, uint64_t turn,
                       uint64_t aging)
{
    size_t i;
    uint64_t dl_diff = 0;
    for (i = 0; i < n; i++) {
        sk_rank_scores(&items[i], turn, aging, &ws->eff[i], &ws->grp[i]);
        dl_diff |= items[i].deadline ^ items[0].deadline;
    }
    return dl_diff != 0;
}

enum { KEY_ORDER, KEY_PRIORITY, KEY_EFF, KEY_GROUP, KEY_DEADLINE };

/* One stable pass over kv_a by the given key of each record's position. */
static void sort_by(sk_rank_ws *ws, const sk_rank_item *items, size_t n, int which)
{
    sk_kv *kv = ws->kv_a;
    size_t i;
    for (i = 0; i < n; i++) {
        uint32_t p = kv[i].idx;
        switch (which) {
        case KEY_ORDER: kv[i].key = items[p].order; break;
        case KEY_PRIORITY: kv[i].key = ~items[p].priority; break;
        case KEY_EFF: kv[i].key = ~ws->eff[p]; break;
        case KEY_DEADLINE: kv[i].key = items[p].deadline; break;
        default: kv[i].key = ~ws->grp[p]; break;
        }
    }
    sk_rank_kv_sort(kv, ws->kv_b, n);
}

int sk_rank_order(sk_rank_ws *ws, const sk_rank_item *items, size_t n, uint64_t current_turn,
                  uint64_t aging_cost_per_turn, int group_waiting_prefixes, int mode,
                  size_t *out)
{
    size_t i;
    int rc, grouping = group_waiting_prefixes != 0, mixed_dl = 0;
    if (n == 0) return SK_RANK_OK;
    if (n > UINT32_MAX || mode < SK_RANK_CACHE_AWARE || mode > SK_RANK_PRIORITY)
        return SK_RANK_INVALID;
    rc = ws_reserve(ws, n);
    if (rc != SK_RANK_OK) return rc;

    if (mode == SK_RANK_CACHE_AWARE)
        mixed_dl = fill_scores(ws, items, n, current_turn, aging_cost_per_turn);
    if (mode == SK_RANK_CACHE_AWARE && grouping) {
        for (i = 0; i < n; i++) ws->pos[i] = (uint32_t)i;
        dfs_order(ws, items, n);
        for (i = 0; i < n; i++) ws->kv_a[i].idx = ws->pos[i];
        if (mixed_dl) sort_by(ws, items, n, KEY_DEADLINE);
        sort_by(ws, items, n, KEY_GROUP);
    } else {
        for (i = 0; i < n; i++) ws->kv_a[i].idx = (uint32_t)i;
        sort_by(ws, items, n, KEY_ORDER);
        if (mode == SK_RANK_CACHE_AWARE) {
            if (mixed_dl) sort_by(ws, items, n, KEY_DEADLINE);
            sort_by(ws, items, n, KEY_EFF);
        }
    }
    if (mode != SK_RANK_FCFS) sort_by(ws, items, n, KEY_PRIORITY);
    for (i = 0; i < n; i++) out[i] = ws->kv_a[i].idx;
    return SK_RANK_OK;
}
