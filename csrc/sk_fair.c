/*
 * Fair-share admission (docs/behaviour.md §3.6): virtual token counters per tenant.
 *
 * The rules are those of the Python reference (policies.VirtualTokenCounters), which the twin
 * scheduler runs; the tests compare the two order for order and counter for counter, so every
 * floating-point step here is the one Python makes, in the same order:
 *
 *   charge   counter += (prefill_cost * prefill + decode_cost * decode) / weight, per completed
 *            row (the file's build flags forbid fusing that multiply-add, which Python never does);
 *   lift     a tenant none of whose queued requests was queued at the previous ranking is raised
 *            to the lowest counter among the tenants that were (or, when none was, among the
 *            tenants queued at the previous ranking);
 *   order    the tenant with the lowest counter goes next, ties to the one whose next request
 *            was enqueued first; each pick adds its request's expected prefill charge to a
 *            scratch copy of the counter, so one ranking interleaves the way picks would.
 *
 * "A request" is one submission: it keeps its identity through preemption (its slot keeps the
 * serial of the last ranking that saw it queued) and a new submit is a new request.
 *
 * Tenant ids are the host's (any uint32); a small open-addressing index maps them to dense
 * entries, which are never removed (a tenant's counter outlives its requests).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "sk_fair.h"

#define NO_NEXT SIZE_MAX
#define NO_TENANT UINT32_MAX

typedef struct sk_tenant {
    double counter;
    double weight;
    double scratch;       /* counter plus the expected charges of this ranking's picks so far */
    uint64_t mark;        /* serial of the last ranking that found it queued */
    uint64_t head_order;  /* enqueue order of `head`'s request */
    size_t head, tail;    /* its requests in this ranking: positions in the within order, */
                          /* linked through sk_fair.next */
    uint32_t id;
    uint32_t first_seen;  /* rank of its first request in the within order (last tie-break) */
    bool stayed;          /* one of its requests was queued at the previous ranking */
} sk_tenant;

struct sk_fair {
    sk_tenant *tenants;
    size_t tenant_count, tenant_cap;
    uint32_t *map;            /* tenant id -> dense index + 1; 0 = empty; power-of-two size */
    size_t map_cap;
    uint32_t *slot_tenant;    /* dense tenant of each slot's sequence */
    uint64_t *slot_seen;      /* serial of the last ranking that saw the slot's request queued */
    size_t slot_cap;
    uint64_t serial;          /* rankings made */
    uint64_t lifts;
    /* one ranking's scratch: tenants queued now / at the previous ranking, the heap of tenants,
     * the per-tenant links of the within order and the result */
    uint32_t *present, *previous, *heap;
    size_t previous_count, list_cap;
    size_t *next, *picked;
    size_t queue_cap;
};

sk_fair *sk_fair_new(void) { return calloc(1, sizeof(sk_fair)); }

void sk_fair_free(sk_fair *f)
{
    if (!f) return;
    free(f->tenants);
    free(f->map);
    free(f->slot_tenant);
    free(f->slot_seen);
    free(f->present);
    free(f->previous);
    free(f->heap);
    free(f->next);
    free(f->picked);
    free(f);
}

int sk_fair_check_config(const skippy_scheduler_config *cfg)
{
    return isfinite(cfg->fair_prefill_cost) && cfg->fair_prefill_cost >= 0 &&
                   isfinite(cfg->fair_decode_cost) && cfg->fair_decode_cost >= 0
               ? 0
               : -1;
}

static inline double cost(const skippy_scheduler_config *cfg, double weight, double prefill,
                          double decode)
{
    return (cfg->fair_prefill_cost * prefill + cfg->fair_decode_cost * decode) / weight;
}

/* Prompt tokens a request still has to prefill when admitted: what its restore does not cover. */
static inline size_t uncached(const sk_seq *q)
{
    size_t restored = q->has_restore ? q->restore_tokens : 0;
    return q->prompt_len > restored ? q->prompt_len - restored : 0;
}

/* ---------------------------------------------------------------- tenant index */

static inline size_t map_home(uint32_t id, size_t cap)
{
    uint32_t h = id; /* murmur3's finaliser: ids are often small or strided */
    h ^= h >> 16;
    h *= 0x85ebca6bu;
    h ^= h >> 13;
    h *= 0xc2b2ae35u;
    h ^= h >> 16;
    return (size_t)h & (cap - 1);
}

static uint32_t find_tenant(const sk_fair *f, uint32_t id)
{
    if (!f->map_cap) return NO_TENANT;
    for (size_t i = map_home(id, f->map_cap);; i = (i + 1) & (f->map_cap - 1)) {
        uint32_t e = f->map[i];
        if (e == 0) return NO_TENANT;
        if (f->tenants[e - 1].id == id) return e - 1;
    }
}

static void map_put(uint32_t *map, size_t cap, uint32_t id, uint32_t index)
{
    size_t i = map_home(id, cap);
    while (map[i]) i = (i + 1) & (cap - 1);
    map[i] = index + 1;
}

/* The dense index of tenant `id`, made (counter 0, weight 1) when new; -1 on out of memory. */
static int enter_tenant(sk_fair *f, uint32_t id, uint32_t *out)
{
    uint32_t found = find_tenant(f, id);
    if (found != NO_TENANT) {
        *out = found;
        return 0;
    }
    size_t count = f->tenant_count;
    if (count >= NO_TENANT - 1) return -1; /* the index stores index + 1 in a uint32 */
    /* Everything that can fail comes first. The index stays at most half full. */
    if ((count + 1) * 2 > f->map_cap) {
        size_t cap = f->map_cap ? f->map_cap * 2 : 16;
        uint32_t *map = calloc(cap, sizeof(uint32_t));
        if (!map) return -1;
        for (size_t k = 0; k < count; k++) map_put(map, cap, f->tenants[k].id, (uint32_t)k);
        free(f->map);
        f->map = map;
        f->map_cap = cap;
    }
    if (sk_grow((void **)&f->tenants, &f->tenant_cap, count + 1, sizeof(sk_tenant))) return -1;
    sk_tenant *t = &f->tenants[count];
    memset(t, 0, sizeof *t);
    t->id = id;
    t->weight = 1.0;
    map_put(f->map, f->map_cap, id, (uint32_t)count);
    f->tenant_count = count + 1;
    *out = (uint32_t)count;
    return 0;
}

/* ---------------------------------------------------------------- submit */

int sk_fair_submit(skippy_scheduler *s, uint32_t slot, uint32_t tenant)
{
    sk_fair *f = s->fair;
    if (!f) return 0;
    if ((size_t)slot >= f->slot_cap) {
        size_t cap = f->slot_cap, cap2 = f->slot_cap;
        if (sk_grow((void **)&f->slot_tenant, &cap, (size_t)slot + 1, sizeof(uint32_t)) ||
            sk_grow((void **)&f->slot_seen, &cap2, cap, sizeof(uint64_t)))
            return -1;
        f->slot_cap = cap;
    }
    uint32_t index;
    if (enter_tenant(f, tenant, &index)) return -1;
    f->slot_tenant[slot] = index;
    f->slot_seen[slot] = 0; /* rankings count from 1: never seen */
    return 0;
}

/* ---------------------------------------------------------------- ranking */

/* The heap's order: lowest scratch counter, then earliest next request, then first seen. */
static inline bool goes_before(const sk_tenant *a, const sk_tenant *b)
{
    if (a->scratch != b->scratch) return a->scratch < b->scratch;
    if (a->head_order != b->head_order) return a->head_order < b->head_order;
    return a->first_seen < b->first_seen;
}

static void sift_down(const sk_tenant *tenants, uint32_t *heap, size_t len, size_t at)
{
    uint32_t moving = heap[at];
    for (;;) {
        size_t child = 2 * at + 1;
        if (child >= len) break;
        if (child + 1 < len && goes_before(&tenants[heap[child + 1]], &tenants[heap[child]]))
            child++;
        if (!goes_before(&tenants[heap[child]], &tenants[moving])) break;
        heap[at] = heap[child];
        at = child;
    }
    heap[at] = moving;
}

static int reserve_ranking(sk_fair *f, size_t n)
{
    if (n > f->queue_cap) {
        size_t cap = f->queue_cap, cap2 = f->queue_cap;
        if (sk_grow((void **)&f->next, &cap, n, sizeof(size_t)) ||
            sk_grow((void **)&f->picked, &cap2, cap, sizeof(size_t)))
            return -1;
        f->queue_cap = cap;
    }
    if (n > f->list_cap) {
        /* `previous` keeps its entries: it is read by this very ranking */
        size_t cap = f->list_cap, cap2 = f->list_cap, cap3 = f->list_cap;
        if (sk_grow((void **)&f->present, &cap, n, sizeof(uint32_t)) ||
            sk_grow((void **)&f->previous, &cap2, cap, sizeof(uint32_t)) ||
            sk_grow((void **)&f->heap, &cap3, cap, sizeof(uint32_t)))
            return -1;
        f->list_cap = cap;
    }
    return 0;
}

int sk_fair_order(skippy_scheduler *s, size_t *order, size_t n)
{
    sk_fair *f = s->fair;
    if (reserve_ranking(f, n)) return -1;
    sk_tenant *tenants = f->tenants;
    const uint32_t *waiting = s->waiting;
    uint64_t previous = f->serial, current = previous + 1;

    /* Group the within order by tenant, in order of first appearance, and note who stayed. */
    size_t present_count = 0;
    for (size_t p = 0; p < n; p++) {
        uint32_t slot = waiting[order[p]];
        uint32_t index = f->slot_tenant[slot];
        sk_tenant *t = &tenants[index];
        if (t->mark != current) {
            t->mark = current;
            t->stayed = false;
            t->head = p;
            t->head_order = s->seqs[slot].enqueue_order;
            t->first_seen = (uint32_t)present_count;
            f->present[present_count++] = index;
        } else {
            f->next[t->tail] = p;
        }
        t->tail = p;
        f->next[p] = NO_NEXT;
        if (previous && f->slot_seen[slot] == previous) t->stayed = true;
        f->slot_seen[slot] = current;
    }

    /* Lift returning tenants to the floor. */
    bool has_floor = false;
    double floor_value = 0.0;
    for (size_t k = 0; k < present_count; k++) {
        const sk_tenant *t = &tenants[f->present[k]];
        if (t->stayed && (!has_floor || t->counter < floor_value)) {
            floor_value = t->counter;
            has_floor = true;
        }
    }
    if (!has_floor) {
        for (size_t k = 0; k < f->previous_count; k++) {
            const sk_tenant *t = &tenants[f->previous[k]];
            if (!has_floor || t->counter < floor_value) {
                floor_value = t->counter;
                has_floor = true;
            }
        }
    }
    if (has_floor) {
        for (size_t k = 0; k < present_count; k++) {
            sk_tenant *t = &tenants[f->present[k]];
            if (!t->stayed && t->counter < floor_value) {
                t->counter = floor_value;
                f->lifts++;
            }
        }
    }

    /* Interleave: a heap of the queued tenants by scratch counter. */
    uint32_t *heap = f->heap;
    size_t heap_len = present_count;
    for (size_t k = 0; k < present_count; k++) {
        tenants[f->present[k]].scratch = tenants[f->present[k]].counter;
        heap[k] = f->present[k];
    }
    for (size_t k = heap_len / 2; k-- > 0;) sift_down(tenants, heap, heap_len, k);
    size_t picked = 0;
    while (heap_len) {
        sk_tenant *t = &tenants[heap[0]];
        size_t p = t->head;
        f->picked[picked++] = order[p];
        size_t q = f->next[p];
        if (q == NO_NEXT) {
            heap[0] = heap[--heap_len];
        } else {
            const sk_seq *seq = &s->seqs[waiting[order[p]]];
            t->scratch += cost(&s->cfg, t->weight, (double)uncached(seq), 0.0);
            t->head = q;
            t->head_order = s->seqs[waiting[order[q]]].enqueue_order;
        }
        if (heap_len) sift_down(tenants, heap, heap_len, 0);
    }
    memcpy(order, f->picked, n * sizeof(size_t));

    uint32_t *swap = f->previous;
    f->previous = f->present;
    f->present = swap;
    f->previous_count = present_count;
    f->serial = current;
    return 0;
}

/* ---------------------------------------------------------------- completion */

void sk_fair_charge(skippy_scheduler *s, const sk_plan_slot *plan_slot)
{
    sk_fair *f = s->fair;
    const skippy_plan *plan = &plan_slot->plan;
    /* The void test completion applies to sampling rows (sk_sched.c), for every row. */
    bool check_epochs = plan_slot->void_mark != s->void_count;
    for (size_t row = 0; row < plan->request_count; row++) {
        uint32_t slot = plan->slots[row];
        const sk_seq *seq = &s->seqs[slot];
        if (seq->where != SK_WHERE_ACTIVE ||
            (check_epochs && seq->epoch != plan_slot->row_epoch[row]))
            continue;
        double tokens = (double)(plan->row_offsets[row + 1] - plan->row_offsets[row]);
        sk_tenant *t = &f->tenants[f->slot_tenant[slot]];
        if (plan->phases[row] == SKIPPY_PHASE_DECODE)
            t->counter += cost(&s->cfg, t->weight, 0.0, tokens);
        else
            t->counter += cost(&s->cfg, t->weight, tokens, 0.0);
    }
}

/* ---------------------------------------------------------------- public accessors */

skippy_status skippy_scheduler_set_tenant_weight(skippy_scheduler *s, uint32_t tenant,
                                                 double weight, skippy_error **out_error)
{
    int rc = 0;
    uint32_t index;
    if (!s) return SK_NO_SCHEDULER(out_error);
    if (!s->fair)
        rc = sk_fail(s, SKIPPY_SCHED_INVALID,
                     "tenant weights apply to the fair-share admission policy only");
    else if (!isfinite(weight) || weight <= 0)
        rc = sk_fail(s, SKIPPY_SCHED_INVALID, "tenant weight must be a finite number > 0, got %g",
                     weight);
    else if (enter_tenant(s->fair, tenant, &index))
        rc = sk_fail(s, SKIPPY_SCHED_NO_MEMORY, "out of memory setting a tenant weight");
    else
        s->fair->tenants[index].weight = weight;
    return sk_result(s, rc, out_error);
}

double skippy_scheduler_tenant_counter(const skippy_scheduler *s, uint32_t tenant)
{
    if (!s || !s->fair) return 0.0;
    uint32_t index = find_tenant(s->fair, tenant);
    return index == NO_TENANT ? 0.0 : s->fair->tenants[index].counter;
}

uint64_t skippy_scheduler_fair_share_lifts(const skippy_scheduler *s)
{
    return s && s->fair ? s->fair->lifts : 0;
}
