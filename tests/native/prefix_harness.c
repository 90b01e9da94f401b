/*
 * The prefix store attached to a scheduler, driven through the public C API alone (no Python).
 *
 * First two scripted cases of stale refresh (an entry evicted while its request waits, a prefix
 * made resident while its request waits), seen through skippy_scheduler_get_metrics, the plan
 * rows and the pins. Then a random run (submit, store insert / eviction / touch, plan and
 * complete with random tokens and ends, preemption, cancel) that checks after every plan that
 *   - each waiting sequence's restore is what the store matches for its prompt now, i.e. the
 *     change journal led the core to every sequence whose match changed;
 *   - stale_refreshes rose by exactly the number of waiting sequences whose restore changed
 *     since they were last read;
 *   - each entry's pin count is the number of active sequences admitted with it;
 *   - each admitted sequence's first row starts at its restored length (the last prompt
 *     token replayed on a full hit).
 * Part of the run changes the store often enough between two plans to overflow the journal.
 * Finally the store is freed while sequences are active: the scheduler detaches it.
 * With inject != 0, store inserts run with allocation failures injected and a failed insert
 * must leave the store as it was.
 * Linked with -Wl,--wrap=malloc,--wrap=calloc,--wrap=realloc against the core's sources.
 * Usage: prefix_harness <seed> <steps> <inject 0|1>; prints "ok ..." or reports and exits 1.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "skippy_scheduler.h"
#include "harness.h"

#define OK(call)                                                                             \
    do {                                                                                     \
        skippy_error *err_ = NULL;                                                           \
        if ((call) != SKIPPY_STATUS_OK) {                                                    \
            fprintf(stderr, "step %ld: %s failed: %s (line %d)\n", step, #call,              \
                    err_ && err_->message ? err_->message : "?", __LINE__);                  \
            exit(1);                                                                         \
        }                                                                                    \
    } while (0)

#define NONE SKIPPY_PREFIX_NONE
#define MAX_ENTRY_ID 4096 /* entry ids are recycled, so they stay below the peak entry count */
#define PREFILL_COST 10
#define RESTORE_COST 1

/* ---- store helpers ---- */

static uint32_t insert_prefix(skippy_prefix_store *p, const int32_t *tokens, size_t len)
{
    /* the deepest resident proper prefix is the parent, as a host's segments nest */
    uint32_t parent = NONE, out = NONE;
    for (size_t k = len - 1; k > 0 && parent == NONE; k--)
        parent = skippy_prefix_store_find(p, tokens, k);
    CHECK(skippy_prefix_store_insert(p, tokens, len, parent, 0, &out) == SKIPPY_SCHED_OK);
    return out;
}

static uint32_t pins_of(const skippy_prefix_store *p, uint32_t entry)
{
    skippy_prefix_entry_info info;
    CHECK(skippy_prefix_store_entry(p, entry, &info));
    return info.pins;
}

static uint32_t holder_of(const skippy_prefix_store *p, uint32_t entry)
{
    skippy_prefix_entry_info info;
    CHECK(skippy_prefix_store_entry(p, entry, &info));
    return info.holder;
}

/* A comparable picture of a store: stats, then every resident entry and the LRU order. */
typedef struct picture {
    char text[1 << 15];
    size_t len;
} picture;

static void put(picture *v, const char *fmt, unsigned long long a, unsigned long long b)
{
    int n = snprintf(v->text + v->len, sizeof v->text - v->len, fmt, a, b);
    CHECK(n >= 0 && (size_t)n < sizeof v->text - v->len);
    v->len += (size_t)n;
}

static void take_picture(const skippy_prefix_store *p, picture *v)
{
    skippy_prefix_store_stats st;
    skippy_prefix_entry_info info;
    static uint32_t order[MAX_ENTRY_ID];
    v->len = 0;
    skippy_prefix_store_get_stats(p, &st);
    put(v, "used%llu entries%llu ", st.used_tokens, st.entries);
    put(v, "ins%llu ev%llu ", st.inserts, st.evictions);
    put(v, "evt%llu epoch%llu |", st.evicted_tokens, st.epoch);
    for (uint32_t id = 0; id < MAX_ENTRY_ID; id++) {
        if (!skippy_prefix_store_entry(p, id, &info)) continue;
        put(v, " %llu<%llu", id, info.parent);
        put(v, " h%llu p%llu", info.holder, info.pins);
        put(v, " c%llu u%llu", info.children, info.last_used);
        put(v, " [%llu,%llu)", info.start, info.length);
        for (size_t k = 0; k < info.length - info.start; k++) put(v, ",%llu", info.segment[k], 0);
    }
    CHECK(st.entries <= MAX_ENTRY_ID);
    size_t n = skippy_prefix_store_lru_order(p, order);
    put(v, " | lru%llu:", n, 0);
    for (size_t k = 0; k < n; k++) put(v, " %llu", order[k], 0);
}

/* ---- scheduler helpers ---- */

static skippy_scheduler *new_scheduler(size_t max_active, const skippy_memory_component *comps,
                                       size_t ncomps, uint32_t admission)
{
    skippy_scheduler_config cfg;
    skippy_scheduler *s = NULL;
    skippy_scheduler_config_default(&cfg);
    cfg.max_active_sequences = max_active;
    cfg.max_tokens_per_iteration = 64;
    cfg.prefill_chunk_tokens = 64;
    cfg.memory_components = comps;
    cfg.memory_component_count = ncomps;
    cfg.admission_policy = admission;
    OK(skippy_scheduler_create(&cfg, &s, &err_));
    return s;
}

static void submit(skippy_scheduler *s, const char *id, const int32_t *prompt, size_t len,
                   uint32_t max_tokens)
{
    skippy_sequence_desc d;
    skippy_sequence_desc_init(&d, id, strlen(id), prompt, len, max_tokens);
    OK(skippy_scheduler_submit(s, &d, NULL, &err_));
}

static const skippy_iteration_request *first_row(const skippy_plan *plan, uint32_t slot)
{
    for (size_t r = 0; r < plan->request_count; r++)
        if (plan->slots[r] == slot) return &plan->requests[r];
    return NULL;
}

/* Completes plan: each sampling row gets a random token, or ends its sequence (end_pct %). */
static void complete(skippy_scheduler *s, skippy_plan *plan, unsigned end_pct)
{
    skippy_plan_outputs *o = &plan->outputs;
    o->count = 0;
    for (size_t k = 0; k < plan->sample_count; k++) {
        o->sampled_request_indexes[o->count] = plan->sample_rows[k];
        o->predicted_tokens[o->count] = below(100) < end_pct ? -1 : (int32_t)below(20);
        o->count++;
    }
    skippy_iteration_telemetry t;
    OK(skippy_scheduler_complete(s, plan->serial, &t, &err_));
    CHECK(t.stale_refreshes == skippy_scheduler_get_metrics(s)->stale_refreshes);
}

/* ---- scripted cases ---- */

static const int32_t HOT[] = {1, 2, 3, 4, 5, 6};
static const int32_t COLD[] = {9, 9, 9};

static void scripted(uint32_t admission, int evict)
{
    skippy_prefix_store_config pc;
    skippy_prefix_store *p = NULL;
    skippy_prefix_store_config_default(&pc);
    pc.holder_slots = 4;
    pc.first_holder_id = 20;
    CHECK(skippy_prefix_store_create(&pc, &p) == SKIPPY_SCHED_OK);
    skippy_scheduler *s = new_scheduler(2, NULL, 0, admission);
    OK(skippy_scheduler_set_prefix_store(s, p, 100, 0, &err_));
    CHECK(skippy_scheduler_prefix_store(s) == p);
    uint32_t entry = NONE;
    if (evict) CHECK(skippy_prefix_store_insert(p, HOT, 4, NONE, 0, &entry) == SKIPPY_SCHED_OK);
    submit(s, "cold", COLD, 3, 3);
    submit(s, "hot", HOT, 6, 3);
    uint32_t hot = skippy_scheduler_find(s, "hot", 3), cold = skippy_scheduler_find(s, "cold", 4);
    skippy_sequence_info info;
    CHECK(skippy_scheduler_sequence(s, hot, &info));
    CHECK(info.restore_token_count == (evict ? 4u : 0u) && info.saved_cost == (evict ? 400u : 0u));
    if (evict)
        CHECK(skippy_prefix_store_evict_one(p) == entry); /* gone before the selection */
    else
        CHECK(skippy_prefix_store_insert(p, HOT, 4, NONE, 0, &entry) == SKIPPY_SCHED_OK &&
              entry != NONE); /* resident before the selection */
    skippy_plan *plan = NULL;
    OK(skippy_scheduler_plan(s, &plan, &err_));
    const skippy_scheduler_metrics *m = skippy_scheduler_get_metrics(s);
    CHECK(m->stale_refreshes == 1);
    CHECK(plan->request_count == 2);
    const skippy_iteration_request *row = first_row(plan, hot);
    CHECK(row != NULL && first_row(plan, cold) != NULL);
    if (evict) {
        CHECK(plan->slots[0] == cold); /* FIFO: no score left for hot */
        CHECK(row->positions[0] == 0 && m->restored_tokens == 0 && m->prefix_misses == 2);
    } else {
        /* cache-aware policies put the request that gained the score first */
        CHECK(plan->slots[0] == (admission == SKIPPY_ADMISSION_CACHE_AWARE ? hot : cold));
        CHECK(row->positions[0] == 4 && row->token_count == 2 && m->restored_tokens == 4);
        CHECK(skippy_scheduler_sequence(s, hot, &info));
        CHECK(info.restore_entry == entry && info.restore_holder == holder_of(p, entry));
        CHECK(info.restore_holder >= 20 && info.restore_holder < 24);
        /* pinned while active: neither eviction nor capacity pressure takes it */
        CHECK(pins_of(p, entry) == 1 && skippy_prefix_store_evict_one(p) == NONE);
    }
    complete(s, plan, 100); /* every sequence ends */
    CHECK(m->finished == 2);
    if (!evict) {
        CHECK(pins_of(p, entry) == 0);
        CHECK(skippy_prefix_store_evict_one(p) == entry);
    }
    skippy_scheduler_free(s); /* detaches the store */
    skippy_scheduler *t = new_scheduler(2, NULL, 0, admission);
    OK(skippy_scheduler_set_prefix_store(t, p, 1, 0, &err_));
    skippy_scheduler_free(t);
    skippy_prefix_store_free(p);
}

/* Refused inserts (no room can be made) leave the store as it was, buffers included (the
 * leak checker sees any segment buffer a refusal loses). */
static void refusals(void)
{
    skippy_prefix_store_config pc;
    skippy_prefix_store *p = NULL;
    static picture before, after;
    skippy_prefix_store_config_default(&pc);
    pc.capacity_tokens = 4;
    CHECK(skippy_prefix_store_create(&pc, &p) == SKIPPY_SCHED_OK);
    uint32_t a = insert_prefix(p, HOT, 2), out = 0;
    CHECK(a != NONE && skippy_prefix_store_pin(p, a) == SKIPPY_SCHED_OK);
    take_picture(p, &before);
    for (int i = 0; i < 3; i++) {
        /* 5 tokens exceed the capacity; 3 would need the pinned entry's room */
        CHECK(skippy_prefix_store_insert(p, COLD, 3, NONE, 0, &out) == SKIPPY_SCHED_OK);
        CHECK(out == NONE);
        CHECK(skippy_prefix_store_insert(p, HOT, 5, a, 0, &out) == SKIPPY_SCHED_OK);
        CHECK(out == NONE);
    }
    take_picture(p, &after);
    CHECK(before.len == after.len && memcmp(before.text, after.text, before.len) == 0);
    skippy_prefix_store_stats st;
    skippy_prefix_store_get_stats(p, &st);
    CHECK(st.refused_inserts == 6);
    CHECK(skippy_prefix_store_insert(p, COLD, 2, NONE, 0, &out) == SKIPPY_SCHED_OK && out != NONE);
    skippy_prefix_store_free(p);
}

/* ---- the random run ---- */

static const int32_t PROMPTS[][8] = {
    {1, 2, 3, 4, 5, 6}, {1, 2, 3, 4, 7}, {1, 2, 3, 8, 8, 8, 8}, {1, 2, 9},
    {1, 5, 5, 5},       {6, 6, 6, 6, 6}, {6, 6, 2},             {1, 2, 3, 4, 5, 6, 0, 0},
};
static const size_t PROMPT_LEN[] = {6, 5, 7, 3, 4, 5, 3, 8};
#define NPROMPTS (sizeof PROMPT_LEN / sizeof PROMPT_LEN[0])
#define NIDS 6

/* What the store matches for a sequence's prompt now. */
static size_t matched_now(const skippy_prefix_store *p, const skippy_sequence_info *q,
                          uint32_t *entry)
{
    size_t m = 0;
    *entry = skippy_prefix_store_match(p, q->tokens, q->prompt_count, &m);
    if (m == 0) *entry = NONE;
    return m;
}

static size_t stale_now(const skippy_scheduler *s, const skippy_prefix_store *p)
{
    size_t n, stale = 0;
    const uint32_t *w = skippy_scheduler_waiting_slots(s, &n);
    for (size_t i = 0; i < n; i++) {
        skippy_sequence_info q;
        uint32_t e;
        CHECK(skippy_scheduler_sequence(s, w[i], &q));
        stale += matched_now(p, &q, &e) != (q.has_prefix_restore ? q.restore_token_count : 0);
    }
    return stale;
}

static void check_after_plan(const skippy_scheduler *s, const skippy_prefix_store *p,
                             const skippy_plan *plan, size_t admitted_before)
{
    static uint32_t pins[MAX_ENTRY_ID];
    size_t n;
    memset(pins, 0, sizeof pins);
    const uint32_t *w = skippy_scheduler_waiting_slots(s, &n);
    for (size_t i = 0; i < n; i++) {
        skippy_sequence_info q;
        uint32_t e;
        CHECK(skippy_scheduler_sequence(s, w[i], &q));
        size_t m = matched_now(p, &q, &e);
        CHECK(q.has_prefix_restore == (m > 0) && q.restore_token_count == m);
        CHECK(q.restore_entry == e);
        CHECK(q.saved_cost == m * PREFILL_COST - m * RESTORE_COST);
    }
    w = skippy_scheduler_active_slots(s, &n);
    for (size_t i = 0; i < n; i++) {
        skippy_sequence_info q;
        CHECK(skippy_scheduler_sequence(s, w[i], &q));
        if (q.restore_entry != NONE) {
            CHECK(q.restore_entry < MAX_ENTRY_ID);
            pins[q.restore_entry]++;
            CHECK(q.restore_holder == holder_of(p, q.restore_entry));
        }
        if (q.admitted_at > admitted_before) {
            /* admitted by this plan: its first row starts at the restored length */
            const skippy_iteration_request *row = first_row(plan, w[i]);
            size_t expect = q.has_prefix_restore ? q.restore_token_count : 0;
            size_t replay = q.prompt_count + (q.generated_count ? q.generated_count - 1 : 0);
            if (expect > replay) expect = replay;
            if (q.generated_count == 0 && expect >= replay) expect = replay - 1;
            if (row) CHECK((size_t)row->positions[0] == expect);
        }
    }
    for (uint32_t id = 0; id < MAX_ENTRY_ID; id++) {
        skippy_prefix_entry_info info;
        if (skippy_prefix_store_entry(p, id, &info)) CHECK(info.pins == pins[id]);
        else CHECK(pins[id] == 0);
    }
}

static void overflow_journal(skippy_prefix_store *p)
{
    /* Each insert into the full store evicts at least one entry: two journal changes per
     * insert, well past the journal's bound of 65536 changes. */
    skippy_prefix_store_stats before, after;
    skippy_prefix_store_get_stats(p, &before);
    for (int32_t i = 0; i < 40000; i++) {
        int32_t key[2] = {1000 + i % 7, 2000 + i};
        uint32_t out;
        CHECK(skippy_prefix_store_insert(p, key, 2, NONE, 0, &out) == SKIPPY_SCHED_OK);
        CHECK(out != NONE);
    }
    skippy_prefix_store_get_stats(p, &after);
    CHECK(after.epoch - before.epoch > 70000);
}

static unsigned long no_memory_unchanged, no_memory_after_evictions, made_despite_failures;

static void insert_with_failures(skippy_prefix_store *p, const int32_t *tokens, size_t len)
{
    static picture before, after;
    uint32_t parent = NONE, out = NONE;
    for (size_t k = len - 1; k > 0 && parent == NONE; k--)
        parent = skippy_prefix_store_find(p, tokens, k);
    take_picture(p, &before);
    fail_after = (long)below(4);
    skippy_sched_code rc = skippy_prefix_store_insert(p, tokens, len, parent, 0, &out);
    fail_after = -1;
    if (rc == SKIPPY_SCHED_NO_MEMORY) {
        size_t evicted = 0;
        skippy_prefix_store_evicted(p, &evicted);
        take_picture(p, &after);
        if (evicted == 0) {
            CHECK(before.len == after.len && memcmp(before.text, after.text, before.len) == 0);
            no_memory_unchanged++;
        } else {
            no_memory_after_evictions++; /* reported; the run goes on checking the store */
        }
        CHECK(out == NONE);
    } else {
        CHECK(rc == SKIPPY_SCHED_OK);
        made_despite_failures++;
    }
}

static void random_run(size_t steps, int inject)
{
    skippy_memory_component kv = {"kv", 120, 0, 2, 4};
    skippy_prefix_store_config pc;
    skippy_prefix_store *p = NULL;
    skippy_prefix_store_config_default(&pc);
    pc.capacity_tokens = 6 + below(12);
    pc.holder_slots = below(2) ? SIZE_MAX : 2 + below(4);
    pc.first_holder_id = (uint32_t)below(32);
    CHECK(skippy_prefix_store_create(&pc, &p) == SKIPPY_SCHED_OK);
    uint32_t admission = (uint32_t)below(3);
    skippy_scheduler *s = new_scheduler(1 + below(4), &kv, 1, admission);
    OK(skippy_scheduler_set_prefix_store(s, p, PREFILL_COST, RESTORE_COST, &err_));
    const skippy_scheduler_metrics *m = skippy_scheduler_get_metrics(s);
    unsigned long plans = 0, overflowed = 0;
    uint64_t admit_counter = 0;
    for (step = 0; step < (long)steps; step++) {
        size_t r = below(100);
        if (r < 18) {
            char id[8];
            snprintf(id, sizeof id, "s%zu", below(NIDS));
            size_t k = below(NPROMPTS);
            skippy_sequence_desc d;
            skippy_sequence_desc_init(&d, id, strlen(id), PROMPTS[k], PROMPT_LEN[k],
                                      1 + (uint32_t)below(4));
            d.priority = below(3);
            skippy_status st = skippy_scheduler_submit(s, &d, NULL, NULL);
            CHECK(st == SKIPPY_STATUS_OK || skippy_scheduler_last_code(s) == SKIPPY_SCHED_DUPLICATE);
        } else if (r < 34) {
            size_t k = below(NPROMPTS);
            size_t len = 1 + below(PROMPT_LEN[k]);
            if (inject) insert_with_failures(p, PROMPTS[k], len);
            else insert_prefix(p, PROMPTS[k], len);
        } else if (r < 40) {
            skippy_prefix_store_evict_one(p);
        } else if (r < 43) {
            size_t k = below(NPROMPTS);
            uint32_t e = skippy_prefix_store_find(p, PROMPTS[k], 1 + below(PROMPT_LEN[k]));
            if (e != NONE) CHECK(skippy_prefix_store_touch(p, e) == SKIPPY_SCHED_OK);
        } else if (r < 80) {
            size_t active = 0;
            skippy_scheduler_active_slots(s, &active);
            /* (with nothing pinned, so that every insert of the burst is made) */
            if (step > (long)steps / 2 && !overflowed && active == 0) {
                overflow_journal(p);
                overflowed = 1;
            }
            uint64_t stale_before = m->stale_refreshes;
            size_t expect = stale_now(s, p);
            skippy_plan *plan = NULL;
            OK(skippy_scheduler_plan(s, &plan, &err_));
            CHECK(m->stale_refreshes - stale_before == expect);
            check_after_plan(s, p, plan, admit_counter);
            admit_counter += plan->admitted;
            plans++;
            complete(s, plan, 20);
        } else if (r < 88) {
            char id[8];
            snprintf(id, sizeof id, "s%zu", below(NIDS));
            skippy_scheduler_cancel(s, id, strlen(id));
        } else {
            uint64_t used = below(2 * kv.capacity_bytes);
            size_t n = 0;
            OK(skippy_scheduler_preempt(s, &used, 1, &n, &err_));
        }
    }
    CHECK(overflowed && plans > steps / 4);
    CHECK(m->stale_refreshes > 0 && m->restored_tokens > 0 && m->prefix_hits > 0);
    printf("ok plans=%lu stale_refreshes=%llu restored_tokens=%llu preempted=%llu "
           "no_memory_unchanged=%lu no_memory_after_evictions=%lu made_despite_failures=%lu\n",
           plans, (unsigned long long)m->stale_refreshes,
           (unsigned long long)m->restored_tokens, (unsigned long long)m->preempted,
           no_memory_unchanged, no_memory_after_evictions, made_despite_failures);
    fflush(stdout); /* before the leak checker's exit, which skips stdio */
    /* Freed while sequences may be active: the scheduler lets go of it and plans on. */
    skippy_prefix_store_free(p);
    CHECK(skippy_scheduler_prefix_store(s) == NULL);
    for (int i = 0; i < 20; i++) {
        skippy_plan *plan = NULL;
        OK(skippy_scheduler_plan(s, &plan, &err_));
        complete(s, plan, 30);
    }
    skippy_scheduler_free(s);
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: prefix_harness <seed> <steps> <inject 0|1>\n");
        return 2;
    }
    rng ^= strtoull(argv[1], NULL, 10) * 0x9E3779B97F4A7C15ull;
    refusals();
    for (uint32_t admission = 0; admission < 3; admission++) {
        scripted(admission, 1);
        scripted(admission, 0);
    }
    random_run((size_t)strtoull(argv[2], NULL, 10), atoi(argv[3]));
    return 0;
}
