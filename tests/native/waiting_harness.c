/*
 * Native stress of the waiting queue's ranking inside the scheduler. Two schedulers run the
 * same random operations (submit, cancel, plan + complete, preempt); the first one gets
 * injected allocation failures, and a call that fails for lack of memory must leave it exactly
 * as the second one is before the call. Every dirty plan is also checked against the one-shot
 * kernel: the queue after admission must be sk_rank_order over the queue before it, minus the
 * admitted sequences. Under fair share (policy 4) the order is not that kernel's, but the
 * tenants' counters and lifts are part of the compared state.
 * Linked with -Wl,--wrap=malloc,--wrap=calloc,--wrap=realloc against the core's sources.
 * Usage: waiting_harness <seed> <steps> <admission policy 0..2 or 4> <grouping 0|1>
 * prints "ok ..." or reports and exits 1.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sk_internal.h"
#include "harness.h"

static unsigned long no_memory[4];

/* ---- a comparable picture of a scheduler ---- */

typedef struct view {
    char text[1 << 16];
    size_t len;
} view;

static void put(view *v, const char *fmt, unsigned long long a, unsigned long long b)
{
    int n = snprintf(v->text + v->len, sizeof v->text - v->len, fmt, a, b);
    CHECK(n >= 0 && (size_t)n < sizeof v->text - v->len);
    v->len += (size_t)n;
}

static void put_seq(view *v, const skippy_scheduler *s, uint32_t slot)
{
    skippy_sequence_info q;
    CHECK(skippy_scheduler_sequence(s, slot, &q));
    v->len += (size_t)snprintf(v->text + v->len, sizeof v->text - v->len, "%.*s", (int)q.id_len,
                               q.id);
    put(v, "(st%llu cur%llu ", q.status, q.prefill_cursor);
    put(v, "gen%llu ord%llu ", q.generated_count, q.enqueue_order);
    put(v, "turn%llu at%llu) ", q.enqueued_turn, q.admitted_at);
}

static void take_view(const skippy_scheduler *s, view *v)
{
    size_t n, i;
    const uint32_t *w = skippy_scheduler_waiting_slots(s, &n);
    const uint64_t *used;
    v->len = 0;
    put(v, "W%llu turn%llu: ", n, skippy_scheduler_waiting_turn(s));
    for (i = 0; i < n; i++) put_seq(v, s, w[i]);
    w = skippy_scheduler_active_slots(s, &n);
    put(v, "A%llu: ", n, 0);
    for (i = 0; i < n; i++) put_seq(v, s, w[i]);
    used = skippy_scheduler_component_used(s, &n);
    for (i = 0; i < n; i++) put(v, "used%llu=%llu ", i, used[i]);
    for (i = 0; i < sizeof s->m / sizeof(uint64_t); i++)
        put(v, "m%llu=%llu ", i, ((const uint64_t *)&s->m)[i]);
    put(v, "dirty%llu set%llu", s->dirty, s->rank_set ? sk_rank_set_size(s->rank_set) : 0);
    for (i = 0; i < 4; i++) {
        double c = skippy_scheduler_tenant_counter(s, (uint32_t)i);
        uint64_t bits;
        memcpy(&bits, &c, sizeof bits);
        put(v, " tenant%llu=%llx", i, bits);
    }
    put(v, " lifts%llu", skippy_scheduler_fair_share_lifts(s), 0);
}

static void same(const skippy_scheduler *a, const skippy_scheduler *b)
{
    static view va, vb;
    take_view(a, &va);
    take_view(b, &vb);
    if (va.len != vb.len || memcmp(va.text, vb.text, va.len) != 0) {
        fprintf(stderr, "step %ld: states differ\n%.*s\n%.*s\n", step, (int)va.len, va.text,
                (int)vb.len, vb.text);
        exit(1);
    }
}

/* ---- operations ---- */

enum { OP_SUBMIT, OP_CANCEL, OP_PLAN, OP_PREEMPT };

typedef struct op {
    int kind;
    char id[24];
    int32_t prompt[48];
    size_t prompt_len;
    uint64_t priority, saved;
    uint32_t max_tokens;
    uint64_t used;
    uint32_t tenant;
} op;

static unsigned long next_id;
static int32_t heads[4][24];

static void random_op(op *o)
{
    /* Alternating busy and quiet periods make the queue grow and drain again. */
    size_t r = below(100), busy = (step / 400) % 2 == 0 ? 50 : 12;
    memset(o, 0, sizeof *o);
    if (r < busy) {
        size_t i, head = below(3) ? below(24) : 0, h = below(4);
        o->kind = OP_SUBMIT;
        snprintf(o->id, sizeof o->id, "s%lu", next_id++);
        o->prompt_len = 1 + below(head ? 40 : 12);
        for (i = 0; i < o->prompt_len; i++) o->prompt[i] = i < head ? heads[h][i] : (int32_t)below(3);
        o->priority = below(4) == 0 ? below(3) : 0;
        o->saved = below(3) * 50;
        o->max_tokens = 1 + (uint32_t)below(5);
        o->tenant = (uint32_t)below(4);
    } else if (r < busy + 10) {
        o->kind = OP_CANCEL;
        snprintf(o->id, sizeof o->id, "s%lu", next_id ? (unsigned long)below(next_id) : 0ul);
    } else if (r < 92) {
        o->kind = OP_PLAN;
    } else {
        o->kind = OP_PREEMPT;
        o->used = 100 + below(250);
    }
}

/* Token for a sampling row, a function of the sequence alone so both schedulers agree. */
static int32_t sampled(const skippy_scheduler *s, uint32_t slot)
{
    skippy_sequence_info q;
    uint64_t h = 1469598103934665603ull;
    size_t i;
    CHECK(skippy_scheduler_sequence(s, slot, &q));
    for (i = 0; i < q.id_len; i++) h = (h ^ (unsigned char)q.id[i]) * 1099511628211ull;
    h = (h ^ q.generated_count) * 1099511628211ull;
    return (h >> 20) % 9 == 0 ? -1 : (int32_t)((h >> 8) % 3);
}

/* The queue after a dirty plan must be the one-shot order of the queue before it, filtered. */
static uint32_t before_q[1024];
static size_t before_n;
static sk_rank_item items[1024];
static size_t expect[1024];
static sk_rank_ws *ws;

static void remember_queue(const skippy_scheduler *s)
{
    size_t i;
    const uint32_t *w = skippy_scheduler_waiting_slots(s, &before_n);
    CHECK(before_n <= 1024);
    memcpy(before_q, w, before_n * sizeof(uint32_t));
    for (i = 0; i < before_n; i++) {
        const sk_seq *q = &s->seqs[w[i]];
        sk_rank_item it = {q->priority, q->saved_cost, q->enqueued_turn, q->enqueue_order,
                           q->tokens, q->prompt_len,
                           sk_rank_deadline_key(q->ttft_deadline_us)};
        items[i] = it;
    }
}

static void check_ranked(const skippy_scheduler *s, int mode)
{
    size_t n, i, k = 0;
    const uint32_t *w = skippy_scheduler_waiting_slots(s, &n);
    CHECK(sk_rank_order(ws, items, before_n, s->waiting_turn, s->cfg.cache_aging_cost_per_iteration,
                        s->cfg.group_waiting_prefixes, mode, expect) == 0);
    for (i = 0; i < before_n; i++) {
        uint32_t slot = before_q[expect[i]];
        if (s->seqs[slot].where != SK_WHERE_WAITING) continue;
        CHECK(k < n && w[k] == slot);
        k++;
    }
    CHECK(k == n);
}

/* Returns 1 when the call failed for lack of memory. */
static int apply(skippy_scheduler *s, const op *o, int check_rank, int mode)
{
    skippy_status st;
    if (o->kind == OP_SUBMIT) {
        skippy_sequence_desc d;
        skippy_sequence_desc_init(&d, o->id, strlen(o->id), o->prompt, o->prompt_len,
                                  o->max_tokens);
        d.priority = o->priority;
        d.saved_cost = o->saved;
        d.tenant = o->tenant;
        st = skippy_scheduler_submit(s, &d, NULL, NULL);
        return st != SKIPPY_STATUS_OK && s->code == SKIPPY_SCHED_NO_MEMORY;
    }
    if (o->kind == OP_CANCEL) {
        uint32_t slot = skippy_scheduler_find(s, o->id, strlen(o->id));
        bool ok = skippy_scheduler_cancel(s, o->id, strlen(o->id));
        return !ok && slot != SK_NO_SLOT;
    }
    if (o->kind == OP_PREEMPT) {
        size_t n;
        st = skippy_scheduler_preempt(s, &o->used, 1, &n, NULL);
        return st != SKIPPY_STATUS_OK && s->code == SKIPPY_SCHED_NO_MEMORY;
    }
    {
        skippy_plan *p;
        size_t i;
        int dirty = s->dirty;
        if (check_rank && dirty) remember_queue(s);
        st = skippy_scheduler_plan(s, &p, NULL);
        if (st != SKIPPY_STATUS_OK) {
            CHECK(s->code == SKIPPY_SCHED_NO_MEMORY);
            return 1;
        }
        if (check_rank && dirty) check_ranked(s, mode);
        for (i = 0; i < p->sample_count; i++) {
            p->outputs.sampled_request_indexes[i] = p->sample_rows[i];
            p->outputs.predicted_tokens[i] = sampled(s, p->slots[p->sample_rows[i]]);
        }
        p->outputs.count = p->sample_count;
        st = skippy_scheduler_complete(s, p->serial, NULL, NULL);
        if (st != SKIPPY_STATUS_OK) {
            CHECK(s->code == SKIPPY_SCHED_NO_MEMORY);
            st = skippy_scheduler_complete(s, p->serial, NULL, NULL); /* the plan stays live */
            CHECK(st == SKIPPY_STATUS_OK);
        }
        return 0;
    }
}

static skippy_scheduler *make(int policy, int grouping, uint64_t aging)
{
    skippy_scheduler_config c;
    skippy_memory_component comp = {"kv", 300, 0, 1, 0};
    skippy_scheduler *s;
    skippy_scheduler_config_default(&c);
    c.max_active_sequences = 6;
    c.max_waiting_sequences = 200;
    c.max_tokens_per_iteration = 256;
    c.prefill_chunk_tokens = 16;
    c.group_waiting_prefixes = grouping;
    c.cache_aging_cost_per_iteration = aging;
    c.admission_policy = (uint32_t)policy;
    c.memory_components = &comp;
    c.memory_component_count = 1;
    CHECK(skippy_scheduler_create(&c, &s, NULL) == SKIPPY_STATUS_OK);
    if (policy == SKIPPY_ADMISSION_FAIR_SHARE)
        CHECK(skippy_scheduler_set_tenant_weight(s, 2, 3.0, NULL) == SKIPPY_STATUS_OK);
    return s;
}

int main(int argc, char **argv)
{
    static const uint64_t agings[] = {0, 1, 10, 4096};
    long steps, i;
    int policy, grouping, mode;
    uint64_t aging;
    skippy_scheduler *sut, *ref;
    skippy_plan *p;
    size_t k, peak = 0;
    if (argc != 5) return 2;
    rng += (uint64_t)strtoul(argv[1], NULL, 10) * 0x9E3779B97F4A7C15ull;
    steps = strtol(argv[2], NULL, 10);
    policy = atoi(argv[3]);
    mode = policy == SKIPPY_ADMISSION_FCFS       ? SK_RANK_FCFS
           : policy == SKIPPY_ADMISSION_PRIORITY ? SK_RANK_PRIORITY
                                                 : SK_RANK_CACHE_AWARE;
    grouping = atoi(argv[4]) != 0;
    aging = agings[below(4)];
    for (k = 0; k < 4 * 24; k++) heads[k / 24][k % 24] = (int32_t)below(3);
    ws = sk_rank_ws_new();
    sut = make(policy, grouping, aging);
    ref = make(policy, grouping, aging);
    /* Size the plan and the active set first: those grow after admission has started, which
     * is not what this harness is about. */
    {
        op warm = {OP_SUBMIT, "warm", {1}, 1, 0, 0, 1, 0, 0};
        skippy_scheduler *both[2] = {sut, ref};
        for (k = 0; k < 2; k++) {
            CHECK(apply(both[k], &warm, 0, mode) == 0);
            CHECK(skippy_scheduler_plan(both[k], &p, NULL) == SKIPPY_STATUS_OK);
            CHECK(skippy_scheduler_cancel(both[k], "warm", 4));
            CHECK(skippy_scheduler_plan(both[k], &p, NULL) == SKIPPY_STATUS_OK);
        }
    }
    for (i = 0; i < steps; i++) {
        op o;
        static view before;
        step = i;
        random_op(&o);
        take_view(ref, &before);
        fail_after = below(3) ? (long)below(4) : -1;
        if (apply(sut, &o, 0, mode)) {
            static view now;
            fail_after = -1;
            no_memory[o.kind]++;
            take_view(sut, &now);
            if (now.len != before.len || memcmp(now.text, before.text, now.len) != 0) {
                fprintf(stderr, "step %ld: a failed call (kind %d) changed the state\n%.*s\n%.*s\n",
                        step, o.kind, (int)before.len, before.text, (int)now.len, now.text);
                return 1;
            }
            CHECK(apply(sut, &o, 0, mode) == 0);
        }
        fail_after = -1;
        CHECK(apply(ref, &o, policy != SKIPPY_ADMISSION_FAIR_SHARE, mode) == 0);
        same(sut, ref);
        if (ref->waiting_len > peak) peak = ref->waiting_len;
    }
    printf("ok steps=%ld no_memory_submit=%lu no_memory_cancel=%lu no_memory_plan=%lu "
           "no_memory_preempt=%lu peak_waiting=%lu grouping=%d aging=%llu\n", steps,
           no_memory[OP_SUBMIT], no_memory[OP_CANCEL], no_memory[OP_PLAN], no_memory[OP_PREEMPT],
           (unsigned long)peak, grouping, (unsigned long long)aging);
    skippy_scheduler_free(sut);
    skippy_scheduler_free(ref);
    sk_rank_ws_free(ws);
    return 0;
}
