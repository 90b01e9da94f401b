/*
 * Waiting-work ranking (behaviour.md §3). The DFS rank over the waiting prompts is computed
 * with an explicit work stack (no recursion): each frame skips the tokens all of its members
 * share, then splits them by the next token.
 */
#include <stdlib.h>
#include <string.h>

#include "sk_rank.h"

struct sk_rank_ws {
    size_t cap;
    size_t *a, *b;           /* position arrays */
    size_t *dfs;             /* dfs rank per position */
    uint64_t *score, *group; /* effective / grouping score per position */
    size_t *frames;          /* (begin, end, depth, kind) quadruples */
    size_t *bk;              /* bucket (begin, end) pairs */
};

typedef int (*cmp_fn)(const void *ctx, size_t x, size_t y);

static void merge_sort(size_t *v, size_t *tmp, size_t n, cmp_fn cmp, const void *ctx)
{
    for (size_t w = 1; w < n; w *= 2) {
        for (size_t lo = 0; lo < n; lo += 2 * w) {
            size_t mid = lo + w < n ? lo + w : n, hi = lo + 2 * w < n ? lo + 2 * w : n;
            size_t i = lo, j = mid, k = lo;
            while (i < mid && j < hi) tmp[k++] = cmp(ctx, v[j], v[i]) < 0 ? v[j++] : v[i++];
            while (i < mid) tmp[k++] = v[i++];
            while (j < hi) tmp[k++] = v[j++];
        }
        memcpy(v, tmp, n * sizeof(size_t));
    }
}

sk_rank_ws *sk_rank_ws_new(void) { return calloc(1, sizeof(sk_rank_ws)); }

void sk_rank_ws_free(sk_rank_ws *ws)
{
    if (!ws) return;
    free(ws->a); free(ws->b); free(ws->dfs); free(ws->score); free(ws->group);
    free(ws->frames); free(ws->bk);
    free(ws);
}

static int ws_reserve(sk_rank_ws *ws, size_t n)
{
    if (n <= ws->cap) return 0;
    size_t c = ws->cap ? ws->cap : 64;
    while (c < n) c *= 2;
#define R(f, k) { void *p = realloc(ws->f, (k) * sizeof(*ws->f)); if (!p) return -1; ws->f = p; }
    R(a, c) R(b, c) R(dfs, c) R(score, c) R(group, c) R(frames, 8 * c + 8) R(bk, 2 * c + 2)
#undef R
    ws->cap = c;
    return 0;
}

static uint64_t sat_add(uint64_t a, uint64_t b) { uint64_t r = a + b; return r < a ? UINT64_MAX : r; }
static uint64_t sat_mul(uint64_t a, uint64_t b) { return (a && b > UINT64_MAX / a) ? UINT64_MAX : a * b; }

typedef struct { const sk_rank_item *it; size_t depth; } tok_ctx;

/* Terminal (no token at depth) first, then by token; stable. */
static int cmp_token(const void *c, size_t x, size_t y)
{
    const tok_ctx *t = c;
    long long tx = t->it[x].token_count > t->depth ? t->it[x].tokens[t->depth] : -1LL;
    long long ty = t->it[y].token_count > t->depth ? t->it[y].tokens[t->depth] : -1LL;
    return tx < ty ? -1 : tx > ty;
}

static int cmp_order(const void *c, size_t x, size_t y)
{
    const sk_rank_item *it = c;
    return it[x].order < it[y].order ? -1 : it[x].order > it[y].order;
}

typedef struct { const sk_rank_item *it; const size_t *bk; const size_t *pos; size_t depth; } bucket_ctx;

static int cmp_bucket(const void *c, size_t x, size_t y)
{
    const bucket_ctx *b = c;
    size_t sx = b->bk[2 * x + 1] - b->bk[2 * x], sy = b->bk[2 * y + 1] - b->bk[2 * y];
    if (sx != sy) return sx > sy ? -1 : 1;
    uint64_t ox = UINT64_MAX, oy = UINT64_MAX;
    for (size_t i = b->bk[2 * x]; i < b->bk[2 * x + 1]; i++)
        if (b->it[b->pos[i]].order < ox) ox = b->it[b->pos[i]].order;
    for (size_t i = b->bk[2 * y]; i < b->bk[2 * y + 1]; i++)
        if (b->it[b->pos[i]].order < oy) oy = b->it[b->pos[i]].order;
    if (ox != oy) return ox < oy ? -1 : 1;
    int32_t tx = b->it[b->pos[b->bk[2 * x]]].tokens[b->depth];
    int32_t ty = b->it[b->pos[b->bk[2 * y]]].tokens[b->depth];
    return tx < ty ? -1 : tx > ty;
}

static void dfs_rank(sk_rank_ws *ws, const sk_rank_item *it, size_t n)
{
    size_t *pos = ws->a, *tmp = ws->b, *fr = ws->frames, top = 0, next = 0;
    for (size_t i = 0; i < n; i++) pos[i] = i;
    /* frame kinds: 0 = visit, 1 = emit terminals sorted by order */
    fr[0] = 0; fr[1] = n; fr[2] = 0; fr[3] = 0; top = 1;
    while (top) {
        top--;
        size_t lo = fr[4 * top], hi = fr[4 * top + 1], depth = fr[4 * top + 2], kind = fr[4 * top + 3];
        if (kind == 1) {
            merge_sort(pos + lo, tmp, hi - lo, cmp_order, it);
            for (size_t i = lo; i < hi; i++) ws->dfs[pos[i]] = next++;
            continue;
        }
        if (hi - lo <= 1) {
            for (size_t i = lo; i < hi; i++) ws->dfs[pos[i]] = next++;
            continue;
        }
        size_t limit = SIZE_MAX;
        for (size_t i = lo; i < hi; i++)
            if (it[pos[i]].token_count < limit) limit = it[pos[i]].token_count;
        const sk_rank_item *f = &it[pos[lo]];
        while (depth < limit) {
            size_t i = lo + 1;
            while (i < hi && it[pos[i]].tokens[depth] == f->tokens[depth]) i++;
            if (i < hi) break;
            depth++;
        }
        tok_ctx tc = {it, depth};
        merge_sort(pos + lo, tmp, hi - lo, cmp_token, &tc);
        size_t term_end = lo;
        while (term_end < hi && it[pos[term_end]].token_count <= depth) term_end++;
        size_t nb = 0;
        for (size_t i = term_end; i < hi;) {
            size_t j = i + 1;
            while (j < hi && it[pos[j]].tokens[depth] == it[pos[i]].tokens[depth]) j++;
            ws->bk[2 * nb] = i; ws->bk[2 * nb + 1] = j; nb++;
            i = j;
        }
        /* order buckets, then lay them out contiguously after lo, terminals last */
        size_t *bidx = tmp + (hi - lo); /* spare room in tmp: n >= (hi-lo)+nb not guaranteed */
        (void)bidx;
        size_t *border = malloc((nb ? nb : 1) * 2 * sizeof(size_t));
        if (!border) return;
        for (size_t k = 0; k < nb; k++) border[k] = k;
        bucket_ctx bc = {it, ws->bk, pos, depth};
        merge_sort(border, border + nb, nb, cmp_bucket, &bc);
        size_t w = 0;
        size_t *layout = malloc((hi - lo) * sizeof(size_t));
        size_t *starts = malloc((nb + 1) * sizeof(size_t));
        if (!layout || !starts) { free(border); free(layout); free(starts); return; }
        for (size_t k = 0; k < nb; k++) {
            size_t b = border[k];
            starts[k] = lo + w;
            for (size_t i = ws->bk[2 * b]; i < ws->bk[2 * b + 1]; i++) layout[w++] = pos[i];
        }
        starts[nb] = lo + w;
        for (size_t i = lo; i < term_end; i++) layout[w++] = pos[i];
        memcpy(pos + lo, layout, (hi - lo) * sizeof(size_t));
        /* push terminal frame first so it runs after every bucket */
        fr[4 * top] = starts[nb]; fr[4 * top + 1] = hi; fr[4 * top + 2] = depth; fr[4 * top + 3] = 1; top++;
        for (size_t k = nb; k > 0; k--) {
            fr[4 * top] = starts[k - 1];
            fr[4 * top + 1] = k < nb ? starts[k] : starts[nb];
            fr[4 * top + 2] = depth + 1; fr[4 * top + 3] = 0; top++;
        }
        free(border); free(layout); free(starts);
    }
}

typedef struct {
    const sk_rank_item *it;
    const sk_rank_ws *ws;
    int mode, grouping;
} final_ctx;

static int prompts_equal(const sk_rank_item *a, const sk_rank_item *b)
{
    return a->token_count == b->token_count &&
           memcmp(a->tokens, b->tokens, a->token_count * sizeof(int32_t)) == 0;
}

static int cmp_final(const void *c, size_t x, size_t y)
{
    const final_ctx *f = c;
    const sk_rank_item *a = &f->it[x], *b = &f->it[y];
    if (f->mode != SK_RANK_FCFS) {
        if (a->priority != b->priority) return a->priority > b->priority ? -1 : 1;
    }
    if (f->mode == SK_RANK_CACHE_AWARE) {
        const uint64_t *k = f->grouping ? f->ws->group : f->ws->score;
        if (k[x] != k[y]) return k[x] > k[y] ? -1 : 1;
        if (f->grouping && f->ws->dfs[x] != f->ws->dfs[y] && !prompts_equal(a, b))
            return f->ws->dfs[x] < f->ws->dfs[y] ? -1 : 1;
        if (f->ws->score[x] != f->ws->score[y]) return f->ws->score[x] > f->ws->score[y] ? -1 : 1;
    }
    if (a->order != b->order) return a->order < b->order ? -1 : 1;
    return 0;
}

int sk_rank_order(sk_rank_ws *ws, const sk_rank_item *items, size_t n, uint64_t current_turn,
                  uint64_t aging, int grouping, int mode, size_t *out)
{
    if (n == 0) return 0;
    if (ws_reserve(ws, n)) return 7;
    if (mode == SK_RANK_CACHE_AWARE) {
        uint64_t band = sat_mul(aging > 1 ? aging : 1, 4);
        for (size_t i = 0; i < n; i++) {
            uint64_t age = current_turn > items[i].enqueued_turn ? current_turn - items[i].enqueued_turn : 0;
            ws->score[i] = sat_add(items[i].saved_cost, sat_mul(age, aging));
            uint64_t bands = age / 4 + (age % 4 != 0);
            ws->group[i] = sat_add(items[i].saved_cost, sat_mul(bands, band));
        }
        if (grouping) dfs_rank(ws, items, n);
    }
    for (size_t i = 0; i < n; i++) out[i] = i;
    final_ctx fc = {items, ws, mode, grouping};
    merge_sort(out, ws->b, n, cmp_final, &fc);
    return 0;
}
