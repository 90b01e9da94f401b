/*
 * Misuse of the public C API (skippy_scheduler.h), through the public header alone: NULL for
 * every pointer argument of every entry point, the error object of a failed create, last_code
 * after calls that return bool, a failed prefix-store insert, and the clock. Each case checks
 * what the header documents for it (the "NULL arguments" paragraph of skippy_scheduler.h).
 * Linked with -Wl,--wrap=malloc,--wrap=calloc,--wrap=realloc against the core's sources, with
 * AddressSanitizer and UndefinedBehaviorSanitizer when the compiler offers them, so a NULL that
 * is dereferenced fails the case even where it would not crash.
 * Usage: api_misuse_harness <case> | --list; prints "ok <case>" or reports and exits 1.
 */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "skippy_scheduler.h"
#include "harness.h"

#define NONE SKIPPY_PREFIX_NONE
#define INVALID SKIPPY_STATUS_INVALID_ARGUMENT

static const int32_t P[] = {1, 2, 3, 4};
static skippy_memory_component comp = {"kv", 1000000, 0, 16, 0};

static skippy_scheduler *make_with(uint32_t admission, uint32_t preemption)
{
    skippy_scheduler_config c;
    skippy_scheduler_config_default(&c);
    c.max_tokens_per_iteration = 16;
    c.prefill_chunk_tokens = 8;
    c.memory_components = &comp;
    c.memory_component_count = 1;
    c.admission_policy = admission;
    c.preemption_policy = preemption;
    skippy_scheduler *s = NULL;
    CHECK(skippy_scheduler_create(&c, &s, NULL) == SKIPPY_STATUS_OK && s);
    return s;
}

static skippy_scheduler *make(void)
{
    return make_with(SKIPPY_ADMISSION_CACHE_AWARE, SKIPPY_PREEMPT_LOWEST_PRIORITY_NEWEST);
}

static uint32_t submit(skippy_scheduler *s, const char *id, uint32_t max_tokens)
{
    skippy_sequence_desc d;
    skippy_sequence_desc_init(&d, id, strlen(id), P, 4, max_tokens);
    uint32_t slot = NONE;
    CHECK(skippy_scheduler_submit(s, &d, &slot, NULL) == SKIPPY_STATUS_OK);
    return slot;
}

/* One plan completed with a token for every sampling row. */
static void step_once(skippy_scheduler *s)
{
    skippy_plan *p = NULL;
    CHECK(skippy_scheduler_plan(s, &p, NULL) == SKIPPY_STATUS_OK && p);
    p->outputs.count = 0;
    for (size_t k = 0; k < p->sample_count; k++) {
        p->outputs.sampled_request_indexes[k] = p->sample_rows[k];
        p->outputs.predicted_tokens[k] = 7;
        p->outputs.count++;
    }
    CHECK(skippy_scheduler_complete(s, p->serial, NULL, NULL) == SKIPPY_STATUS_OK);
}

/* A failed call's error object: present, of `status`, with a non-empty message. */
static void expect_error(skippy_error **e, skippy_status status)
{
    CHECK(*e != NULL);
    CHECK((*e)->status == status);
    CHECK((*e)->message != NULL && (*e)->message[0] != 0);
    skippy_scheduler_error_free(*e);
    *e = NULL;
}

/* What the state getters see, to compare before and after a call that must change nothing. */
typedef struct picture {
    skippy_scheduler_metrics m;
    size_t active, waiting, live;
} picture;

static picture take(const skippy_scheduler *s)
{
    picture x;
    memset(&x, 0, sizeof x);
    x.m = *skippy_scheduler_get_metrics(s);
    skippy_scheduler_active_slots(s, &x.active);
    skippy_scheduler_waiting_slots(s, &x.waiting);
    x.live = skippy_scheduler_live_plans(s);
    return x;
}

static bool same(picture a, picture b) { return memcmp(&a, &b, sizeof a) == 0; }

/* ------------------------------------------------------------------ cases */

/* Every scheduler entry point with a NULL handle: status calls fail with INVALID_ARGUMENT and
 * an error object, getters give NULL / 0 / false, void calls do nothing. */
static void null_scheduler(void)
{
    skippy_error *e = NULL;
    skippy_sequence_desc d;
    skippy_sequence_desc_init(&d, "a", 1, P, 4, 4);
    uint32_t slot = 77;
    CHECK(skippy_scheduler_submit(NULL, &d, &slot, &e) == INVALID);
    expect_error(&e, INVALID);
    CHECK(slot == 77);
    CHECK(skippy_scheduler_submit(NULL, NULL, NULL, NULL) == INVALID);
    skippy_plan *plan = NULL;
    CHECK(skippy_scheduler_plan(NULL, &plan, &e) == INVALID);
    expect_error(&e, INVALID);
    CHECK(plan == NULL);
    CHECK(skippy_scheduler_plan(NULL, NULL, NULL) == INVALID);
    CHECK(skippy_scheduler_observe(NULL, 1, 1.0, &e) == INVALID);
    expect_error(&e, INVALID);
    skippy_iteration_telemetry t;
    CHECK(skippy_scheduler_complete(NULL, 1, &t, &e) == INVALID);
    expect_error(&e, INVALID);
    CHECK(skippy_scheduler_complete(NULL, 1, NULL, NULL) == INVALID);
    CHECK(skippy_scheduler_abort(NULL, 1, &e) == INVALID);
    expect_error(&e, INVALID);
    uint64_t used[1] = {0};
    size_t n = 77;
    CHECK(skippy_scheduler_preempt(NULL, used, 1, &n, &e) == INVALID);
    expect_error(&e, INVALID);
    CHECK(n == 77);
    CHECK(skippy_scheduler_preempt(NULL, NULL, 0, NULL, NULL) == INVALID);
    skippy_step_cost cost = {1, 1, 1, 1, 1, 1};
    CHECK(skippy_scheduler_set_step_cost(NULL, &cost, &e) == INVALID);
    expect_error(&e, INVALID);
    CHECK(skippy_scheduler_set_step_cost(NULL, NULL, &e) == INVALID);
    expect_error(&e, INVALID);
    CHECK(skippy_scheduler_set_prefix_store(NULL, NULL, 0, 0, &e) == INVALID);
    expect_error(&e, INVALID);
    CHECK(skippy_scheduler_set_tenant_weight(NULL, 0, 1.0, &e) == INVALID);
    expect_error(&e, INVALID);

    CHECK(skippy_scheduler_last_code(NULL) == SKIPPY_SCHED_INVALID);
    const char *message = skippy_scheduler_last_message(NULL);
    CHECK(message != NULL && strstr(message, "NULL") != NULL);
    CHECK(skippy_scheduler_get_config(NULL) == NULL);
    CHECK(skippy_scheduler_get_metrics(NULL) == NULL);
    CHECK(!skippy_scheduler_cancel(NULL, "a", 1));
    CHECK(!skippy_scheduler_cancel(NULL, NULL, 0));
    CHECK(skippy_scheduler_find(NULL, "a", 1) == NONE);
    CHECK(skippy_scheduler_find(NULL, NULL, 3) == NONE);
    skippy_sequence_info info;
    CHECK(!skippy_scheduler_sequence(NULL, 0, &info));
    CHECK(!skippy_scheduler_sequence(NULL, 0, NULL));
    CHECK(!skippy_scheduler_plan_live(NULL, 1));
    CHECK(skippy_scheduler_live_plans(NULL) == 0);
    CHECK(skippy_scheduler_oldest_plan(NULL) == 0);
    CHECK(skippy_scheduler_preempted_slots(NULL) == NULL);
    n = 77;
    CHECK(skippy_scheduler_priority_victims(NULL, &n) == NULL && n == 0);
    CHECK(skippy_scheduler_priority_victims(NULL, NULL) == NULL);
    uint32_t keeps[4];
    CHECK(skippy_scheduler_take_prompt_keeps(NULL, keeps, 4) == 0);
    n = 77;
    CHECK(skippy_scheduler_active_slots(NULL, &n) == NULL && n == 0);
    n = 77;
    CHECK(skippy_scheduler_waiting_slots(NULL, &n) == NULL && n == 0);
    n = 77;
    CHECK(skippy_scheduler_component_used(NULL, &n) == NULL && n == 0);
    n = 77;
    CHECK(skippy_scheduler_retired(NULL, &n) == NULL && n == 0);
    CHECK(skippy_scheduler_active_slots(NULL, NULL) == NULL);
    CHECK(skippy_scheduler_waiting_slots(NULL, NULL) == NULL);
    CHECK(skippy_scheduler_component_used(NULL, NULL) == NULL);
    CHECK(skippy_scheduler_retired(NULL, NULL) == NULL);
    CHECK(skippy_scheduler_waiting_turn(NULL) == 0);
    CHECK(!skippy_scheduler_mixed_viable(NULL));
    CHECK(skippy_scheduler_prefix_store(NULL) == NULL);
    CHECK(skippy_scheduler_tenant_counter(NULL, 0) == 0.0);
    CHECK(skippy_scheduler_fair_share_lifts(NULL) == 0);
    skippy_scheduler_set_clock(NULL, 5.0);
    skippy_scheduler_set_callbacks(NULL, NULL, NULL, NULL);
    skippy_scheduler_free(NULL);
}

/* The void initialisers and frees with NULL do nothing. */
static void null_init(void)
{
    skippy_scheduler_config_default(NULL);
    skippy_scheduler_config_normalize(NULL);
    skippy_sequence_desc_init(NULL, "a", 1, P, 4, 4);
    skippy_prefix_store_config_default(NULL);
    skippy_scheduler_error_free(NULL);
    skippy_scheduler_free(NULL);
    skippy_prefix_store_free(NULL);
}

/* create follows the convention: *out cleared first, an error object for every failure. */
static void create_error_object(void)
{
    skippy_scheduler_config c;
    skippy_scheduler_config_default(&c);
    skippy_scheduler *s = (skippy_scheduler *)&c; /* a stale value that must be cleared */
    skippy_error *e = NULL;
    CHECK(skippy_scheduler_create(NULL, &s, &e) == INVALID);
    CHECK(s == NULL);
    expect_error(&e, INVALID);
    CHECK(skippy_scheduler_create(&c, NULL, &e) == INVALID);
    expect_error(&e, INVALID);
    CHECK(skippy_scheduler_create(NULL, NULL, &e) == INVALID);
    expect_error(&e, INVALID);
    CHECK(skippy_scheduler_create(NULL, NULL, NULL) == INVALID);
    c.memory_component_count = 2; /* with NULL components */
    s = (skippy_scheduler *)&c;
    CHECK(skippy_scheduler_create(&c, &s, &e) == INVALID);
    CHECK(s == NULL);
    expect_error(&e, INVALID);
    skippy_scheduler_config_default(&c);
    e = (skippy_error *)&c; /* cleared on success */
    CHECK(skippy_scheduler_create(&c, &s, &e) == SKIPPY_STATUS_OK && s && e == NULL);
    skippy_scheduler_free(s);
}

/* NULL out-params: a list getter's NULL count is allowed (the array is returned as usual);
 * sequence() with a NULL destination returns false. */
static void null_out_params(void)
{
    skippy_scheduler *s = make();
    uint32_t a = submit(s, "a", 1);
    submit(s, "b", 8);
    submit(s, "c", 8);
    CHECK(!skippy_scheduler_sequence(s, a, NULL));
    skippy_sequence_info info;
    CHECK(skippy_scheduler_sequence(s, a, &info));
    size_t n = 0;
    CHECK(skippy_scheduler_waiting_slots(s, NULL) == skippy_scheduler_waiting_slots(s, &n));
    CHECK(n == 3);
    step_once(s); /* "a" reaches max_tokens and retires */
    n = 0;
    CHECK(skippy_scheduler_active_slots(s, NULL) == skippy_scheduler_active_slots(s, &n));
    CHECK(n == 2);
    n = 0;
    CHECK(skippy_scheduler_component_used(s, NULL) == skippy_scheduler_component_used(s, &n));
    CHECK(n == 1);
    n = 0;
    CHECK(skippy_scheduler_retired(s, NULL) == skippy_scheduler_retired(s, &n));
    CHECK(n == 1);
    CHECK(skippy_scheduler_priority_victims(s, NULL) == skippy_scheduler_priority_victims(s, &n));
    CHECK(skippy_scheduler_take_prompt_keeps(s, NULL, 4) == 0);
    skippy_plan *p = NULL;
    CHECK(skippy_scheduler_plan(s, NULL, NULL) == SKIPPY_STATUS_OK); /* made, not handed out */
    CHECK(skippy_scheduler_live_plans(s) == 1);
    CHECK(skippy_scheduler_abort(s, skippy_scheduler_oldest_plan(s), NULL) == SKIPPY_STATUS_OK);
    CHECK(skippy_scheduler_plan(s, &p, NULL) == SKIPPY_STATUS_OK && p);
    CHECK(skippy_scheduler_abort(s, p->serial, NULL) == SKIPPY_STATUS_OK);
    skippy_scheduler_free(s);
}

/* A NULL id with length 0 is the empty id; with a length it is refused. */
static void null_id(void)
{
    skippy_scheduler *s = make();
    submit(s, "a", 4);
    picture before = take(s);
    CHECK(skippy_scheduler_find(s, NULL, 5) == NONE);
    CHECK(!skippy_scheduler_cancel(s, NULL, 5));
    CHECK(skippy_scheduler_last_code(s) == SKIPPY_SCHED_INVALID);
    CHECK(skippy_scheduler_last_message(s)[0] != 0);
    CHECK(same(before, take(s)));
    CHECK(skippy_scheduler_find(s, NULL, 0) == NONE);
    CHECK(!skippy_scheduler_cancel(s, NULL, 0)); /* unknown (empty) id: not an error */
    CHECK(skippy_scheduler_last_code(s) == SKIPPY_SCHED_OK);
    CHECK(skippy_scheduler_last_message(s)[0] == 0);
    skippy_sequence_desc d;
    skippy_sequence_desc_init(&d, NULL, 0, P, 4, 4);
    uint32_t slot = NONE;
    CHECK(skippy_scheduler_submit(s, &d, &slot, NULL) == SKIPPY_STATUS_OK);
    CHECK(skippy_scheduler_find(s, NULL, 0) == slot);
    CHECK(skippy_scheduler_find(s, "", 0) == slot);
    CHECK(skippy_scheduler_find(s, NULL, 1) == NONE);
    CHECK(skippy_scheduler_cancel(s, NULL, 0));
    CHECK(skippy_scheduler_last_code(s) == SKIPPY_SCHED_OK);
    CHECK(skippy_scheduler_find(s, "", 0) == NONE);
    skippy_scheduler_free(s);
}

/* last_code and last_message describe the last call: a bool call resets them. */
static void stale_last_code(void)
{
    skippy_scheduler *s = make();
    submit(s, "a", 4);
    skippy_sequence_desc d;
    skippy_sequence_desc_init(&d, "a", 1, P, 4, 4);
    CHECK(skippy_scheduler_submit(s, &d, NULL, NULL) == INVALID);
    CHECK(skippy_scheduler_last_code(s) == SKIPPY_SCHED_DUPLICATE);
    CHECK(!skippy_scheduler_cancel(s, "zz", 2)); /* unknown id */
    CHECK(skippy_scheduler_last_code(s) == SKIPPY_SCHED_OK);
    CHECK(skippy_scheduler_last_message(s)[0] == 0);
    /* Out of memory while cancelling is told apart from an unknown id. */
    picture before = take(s);
    fail_after = 0;
    bool cancelled = skippy_scheduler_cancel(s, "a", 1);
    fail_after = -1;
    CHECK(!cancelled);
    CHECK(skippy_scheduler_last_code(s) == SKIPPY_SCHED_NO_MEMORY);
    CHECK(skippy_scheduler_last_message(s)[0] != 0);
    CHECK(same(before, take(s)));
    CHECK(!skippy_scheduler_cancel(s, "zz", 2));
    CHECK(skippy_scheduler_last_code(s) == SKIPPY_SCHED_OK);
    CHECK(skippy_scheduler_submit(s, &d, NULL, NULL) == INVALID);
    CHECK(skippy_scheduler_cancel(s, "a", 1));
    CHECK(skippy_scheduler_last_code(s) == SKIPPY_SCHED_OK);
    CHECK(skippy_scheduler_last_message(s)[0] == 0);
    /* A status call resets them too. */
    CHECK(skippy_scheduler_submit(s, &d, NULL, NULL) == SKIPPY_STATUS_OK);
    CHECK(skippy_scheduler_submit(s, &d, NULL, NULL) == INVALID);
    CHECK(skippy_scheduler_last_code(s) == SKIPPY_SCHED_DUPLICATE);
    step_once(s);
    CHECK(skippy_scheduler_last_code(s) == SKIPPY_SCHED_OK);
    skippy_scheduler_free(s);
}

/* set_step_cost(NULL) has a message of its own and changes nothing. */
static void step_cost_null(void)
{
    skippy_scheduler *s = make();
    skippy_error *e = NULL;
    CHECK(skippy_scheduler_set_step_cost(s, NULL, &e) == INVALID);
    CHECK(e && strstr(e->message, "NULL") != NULL);
    CHECK(skippy_scheduler_last_code(s) == SKIPPY_SCHED_INVALID);
    CHECK(strcmp(skippy_scheduler_last_message(s), e->message) == 0);
    skippy_scheduler_error_free(e);
    e = NULL;
    skippy_step_cost nan_cost = {NAN, 0, 0, 0, 0, 0};
    CHECK(skippy_scheduler_set_step_cost(s, &nan_cost, &e) == INVALID);
    CHECK(e && strstr(e->message, "NULL") == NULL && strstr(e->message, "finite") != NULL);
    skippy_scheduler_error_free(e);
    skippy_scheduler_free(s);
}

/* A non-finite clock is ignored: admission stamps the last finite value. */
static void clock_not_finite(void)
{
    skippy_scheduler *s = make();
    skippy_scheduler_set_clock(s, 5000.0);
    uint32_t a = submit(s, "a", 4);
    skippy_scheduler_set_clock(s, NAN);
    skippy_scheduler_set_clock(s, -INFINITY);
    skippy_scheduler_set_clock(s, INFINITY);
    CHECK(skippy_scheduler_last_code(s) == SKIPPY_SCHED_OK);
    skippy_plan *p = NULL;
    CHECK(skippy_scheduler_plan(s, &p, NULL) == SKIPPY_STATUS_OK && p && p->request_count == 1);
    skippy_sequence_info info;
    CHECK(skippy_scheduler_sequence(s, a, &info));
    CHECK(info.last_token_us == 5000.0);
    skippy_scheduler_free(s);
}

/* A submit refused for a full queue counts metrics.rejected_overload (the documented exception
 * to "a failed call changes nothing"). */
static void queue_full_counts(void)
{
    skippy_scheduler_config c;
    skippy_scheduler_config_default(&c);
    c.max_waiting_sequences = 1;
    skippy_scheduler *s = NULL;
    CHECK(skippy_scheduler_create(&c, &s, NULL) == SKIPPY_STATUS_OK);
    submit(s, "a", 4);
    skippy_sequence_desc d;
    skippy_sequence_desc_init(&d, "b", 1, P, 4, 4);
    CHECK(skippy_scheduler_submit(s, &d, NULL, NULL) == INVALID);
    CHECK(skippy_scheduler_last_code(s) == SKIPPY_SCHED_QUEUE_FULL);
    CHECK(skippy_scheduler_get_metrics(s)->rejected_overload == 1);
    skippy_scheduler_free(s);
}

/* Every prefix-store entry point with a NULL store. */
static void null_prefix_store(void)
{
    uint32_t entry = 7;
    size_t n = 77;
    CHECK(skippy_prefix_store_insert(NULL, P, 4, NONE, 1, &entry) == SKIPPY_SCHED_INVALID);
    CHECK(entry == NONE);
    CHECK(skippy_prefix_store_insert(NULL, NULL, 0, NONE, 1, NULL) == SKIPPY_SCHED_INVALID);
    CHECK(skippy_prefix_store_touch(NULL, 0) == SKIPPY_SCHED_INVALID);
    CHECK(skippy_prefix_store_pin(NULL, 0) == SKIPPY_SCHED_INVALID);
    CHECK(skippy_prefix_store_unpin(NULL, 0) == SKIPPY_SCHED_INVALID);
    CHECK(skippy_prefix_store_evict_one(NULL) == NONE);
    CHECK(skippy_prefix_store_match(NULL, P, 4, &n) == NONE && n == 0);
    CHECK(skippy_prefix_store_match(NULL, NULL, 4, NULL) == NONE);
    CHECK(skippy_prefix_store_find(NULL, P, 4) == NONE);
    n = 77;
    CHECK(skippy_prefix_store_evicted(NULL, &n) == NULL && n == 0);
    CHECK(skippy_prefix_store_evicted(NULL, NULL) == NULL);
    skippy_prefix_entry_info info;
    CHECK(!skippy_prefix_store_entry(NULL, 0, &info));
    CHECK(!skippy_prefix_store_entry(NULL, 0, NULL));
    int32_t key[4];
    CHECK(!skippy_prefix_store_key(NULL, 0, key));
    skippy_prefix_store_stats st;
    memset(&st, 0xAB, sizeof st);
    skippy_prefix_store_get_stats(NULL, &st);
    skippy_prefix_store_stats zero;
    memset(&zero, 0, sizeof zero);
    CHECK(memcmp(&st, &zero, sizeof st) == 0);
    skippy_prefix_store_get_stats(NULL, NULL);
    uint32_t order[4];
    CHECK(skippy_prefix_store_lru_order(NULL, order) == 0);
    const char *message = skippy_prefix_store_last_message(NULL);
    CHECK(message != NULL && strstr(message, "NULL") != NULL);
    skippy_prefix_store *p = (skippy_prefix_store *)&st;
    CHECK(skippy_prefix_store_create(NULL, &p) == SKIPPY_SCHED_INVALID && p == NULL);
    CHECK(skippy_prefix_store_create(NULL, NULL) == SKIPPY_SCHED_INVALID);
    skippy_error *e = NULL;
    skippy_scheduler *s = make();
    CHECK(skippy_scheduler_set_prefix_store(s, NULL, 1, 0, &e) == SKIPPY_STATUS_OK && !e);
    skippy_scheduler_free(s);
}

/* NULL destinations on a live store: nothing is written and the call says so. */
static void prefix_store_null_out(void)
{
    skippy_prefix_store_config c;
    skippy_prefix_store_config_default(&c);
    skippy_prefix_store *p = NULL;
    CHECK(skippy_prefix_store_create(&c, &p) == SKIPPY_SCHED_OK && p);
    uint32_t entry = NONE;
    CHECK(skippy_prefix_store_insert(p, P, 4, NONE, 1, &entry) == SKIPPY_SCHED_OK);
    CHECK(entry != NONE);
    CHECK(!skippy_prefix_store_entry(p, entry, NULL));
    CHECK(!skippy_prefix_store_key(p, entry, NULL));
    skippy_prefix_store_get_stats(p, NULL);
    size_t n = 77;
    CHECK(skippy_prefix_store_evicted(p, NULL) == skippy_prefix_store_evicted(p, &n));
    CHECK(n == 0);
    CHECK(skippy_prefix_store_lru_order(p, NULL) == 0);
    uint32_t order[4];
    CHECK(skippy_prefix_store_lru_order(p, order) == 1 && order[0] == entry);
    CHECK(skippy_prefix_store_match(p, P, 4, NULL) == entry);
    CHECK(skippy_prefix_store_insert(p, P, 4, NONE, 1, NULL) == SKIPPY_SCHED_OK);
    skippy_prefix_store_free(p);
}

/* A refused insert leaves the store as it was, the list of the last evictions included, and
 * a NULL key has a message of its own. */
static void failed_insert_changes_nothing(void)
{
    skippy_prefix_store_config c;
    skippy_prefix_store_config_default(&c);
    c.capacity_tokens = 4;
    skippy_prefix_store *p = NULL;
    CHECK(skippy_prefix_store_create(&c, &p) == SKIPPY_SCHED_OK);
    const int32_t a[4] = {1, 2, 3, 4}, b[4] = {5, 6, 7, 8}, neg[2] = {1, -1};
    uint32_t ea = NONE, eb = NONE, out = NONE;
    CHECK(skippy_prefix_store_insert(p, a, 4, NONE, 11, &ea) == SKIPPY_SCHED_OK);
    CHECK(skippy_prefix_store_insert(p, b, 4, NONE, 22, &eb) == SKIPPY_SCHED_OK);
    size_t n = 0;
    const skippy_prefix_eviction *ev = skippy_prefix_store_evicted(p, &n);
    CHECK(n == 1 && ev[0].entry == ea && ev[0].handle == 11);
    skippy_prefix_store_stats before, after;
    skippy_prefix_store_get_stats(p, &before);

    CHECK(skippy_prefix_store_insert(p, NULL, 3, NONE, 33, &out) == SKIPPY_SCHED_INVALID);
    CHECK(out == NONE);
    const char *message = skippy_prefix_store_last_message(p);
    CHECK(strstr(message, "NULL") != NULL && strstr(message, "at least one token") == NULL);
    CHECK(skippy_prefix_store_insert(p, a, 0, NONE, 33, &out) == SKIPPY_SCHED_INVALID);
    CHECK(strstr(skippy_prefix_store_last_message(p), "at least one token") != NULL);
    CHECK(skippy_prefix_store_insert(p, neg, 2, NONE, 33, &out) == SKIPPY_SCHED_INVALID);
    CHECK(skippy_prefix_store_insert(p, a, 4, 12345, 33, &out) == SKIPPY_SCHED_INVALID);
    CHECK(skippy_prefix_store_insert(p, b, 4, eb, 33, &out) == SKIPPY_SCHED_INVALID);

    ev = skippy_prefix_store_evicted(p, &n);
    CHECK(n == 1 && ev[0].entry == ea && ev[0].handle == 11);
    skippy_prefix_store_get_stats(p, &after);
    CHECK(memcmp(&before, &after, sizeof before) == 0);
    /* A successful insert that evicts nothing empties the list. */
    CHECK(skippy_prefix_store_insert(p, b, 4, NONE, 22, &out) == SKIPPY_SCHED_OK && out == eb);
    skippy_prefix_store_evicted(p, &n);
    CHECK(n == 0);
    skippy_prefix_store_free(p);
}

/* Policy callbacks that succeed until told to fail: the rank keeps the queue's order, the
 * victim picks the first candidate `victims_left` times, then says "no more" (an index past
 * the candidates), and fails on the call numbered `victim_fail_at` (0: never). */
static int rank_fails, victim_calls, victim_fail_at, victims_left;

static int rank_in_order(void *ctx, const skippy_scheduler *s, const uint32_t *slots,
                         size_t count, uint64_t turn, size_t *out_order)
{
    (void)ctx, (void)s, (void)slots, (void)turn;
    for (size_t i = 0; i < count; i++) out_order[i] = i;
    return rank_fails;
}

static int victim_first(void *ctx, const skippy_scheduler *s, const uint32_t *slots,
                        size_t count, size_t *out_index)
{
    (void)ctx, (void)s, (void)slots;
    if (++victim_calls == victim_fail_at) return 1;
    *out_index = victims_left-- > 0 ? 0 : count;
    return 0;
}

static skippy_scheduler *make_with_callbacks(void)
{
    skippy_scheduler *s = make_with(SKIPPY_ADMISSION_CALLBACK, SKIPPY_PREEMPT_CALLBACK);
    skippy_scheduler_set_callbacks(s, rank_in_order, victim_first, NULL);
    return s;
}

/* A plan whose rank callback fails leaves the sequences retired since the last plan listed
 * and readable ("a failed call never changes scheduler state"): a host that retries still
 * learns of them. The next plan that succeeds gives their slots back. */
static void failed_plan_keeps_retired(void)
{
    skippy_scheduler *s = make_with_callbacks();
    uint32_t a = submit(s, "a", 1);
    step_once(s); /* prefill and its one token: a finishes */
    size_t n = 0;
    const skippy_retired *r = skippy_scheduler_retired(s, &n);
    CHECK(n == 1 && r[0].slot == a && r[0].status == SKIPPY_SEQ_FINISHED);
    submit(s, "b", 4);
    rank_fails = 1;
    skippy_plan *p = NULL;
    skippy_error *e = NULL;
    CHECK(skippy_scheduler_plan(s, &p, &e) == SKIPPY_STATUS_RUNTIME_ERROR);
    expect_error(&e, SKIPPY_STATUS_RUNTIME_ERROR);
    CHECK(skippy_scheduler_last_code(s) == SKIPPY_SCHED_CALLBACK);
    r = skippy_scheduler_retired(s, &n);
    CHECK(n == 1 && r[0].slot == a);
    skippy_sequence_info info;
    CHECK(skippy_scheduler_sequence(s, a, &info));
    rank_fails = 0;
    step_once(s);
    skippy_scheduler_retired(s, &n);
    CHECK(n == 0 && !skippy_scheduler_sequence(s, a, &info));
    skippy_scheduler_free(s);
}

/* A preemption whose victim callback fails leaves what the last one reported as it was. */
static void failed_preempt_keeps_victims(void)
{
    skippy_scheduler *s = make_with_callbacks();
    submit(s, "a", 8);
    submit(s, "b", 8);
    submit(s, "c", 8);
    step_once(s);
    size_t active = 0, n = 0;
    skippy_scheduler_active_slots(s, &active);
    CHECK(active == 3);
    uint64_t over[1] = {2 * comp.capacity_bytes};
    victims_left = 1;
    CHECK(skippy_scheduler_preempt(s, over, 1, &n, NULL) == SKIPPY_STATUS_OK && n == 1);
    uint32_t first = skippy_scheduler_preempted_slots(s)[0];
    picture before = take(s);
    victims_left = 1;
    victim_fail_at = victim_calls + 2; /* one victim chosen, then the policy fails */
    skippy_error *e = NULL;
    n = 77;
    CHECK(skippy_scheduler_preempt(s, over, 1, &n, &e) == SKIPPY_STATUS_RUNTIME_ERROR);
    expect_error(&e, SKIPPY_STATUS_RUNTIME_ERROR);
    CHECK(skippy_scheduler_preempted_slots(s)[0] == first);
    CHECK(same(before, take(s)));
    skippy_scheduler_free(s);
}

/* A plan that runs out of memory at any of its allocations changes nothing: the sequences it
 * would have admitted stay waiting (its buffer is sized before admission), and a retry plans. */
static void failed_plan_changes_nothing(void)
{
    long failures = 0;
    for (long k = 0; k < 1000; k++) {
        skippy_scheduler *s = make();
        char id[16];
        for (int i = 0; i < 20; i++) {
            snprintf(id, sizeof id, "s%d", i);
            submit(s, id, 4);
        }
        picture before = take(s);
        skippy_plan *p = NULL;
        fail_after = k;
        skippy_status st = skippy_scheduler_plan(s, &p, NULL);
        fail_after = -1;
        if (st == SKIPPY_STATUS_OK) {
            skippy_scheduler_free(s);
            break;
        }
        failures++;
        CHECK(skippy_scheduler_last_code(s) == SKIPPY_SCHED_NO_MEMORY);
        CHECK(same(before, take(s)));
        step_once(s);
        skippy_scheduler_free(s);
    }
    CHECK(failures > 1);
}

typedef void (*case_fn)(void);
static const struct {
    const char *name;
    case_fn fn;
} cases[] = {
    {"null_scheduler", null_scheduler},
    {"null_init", null_init},
    {"create_error_object", create_error_object},
    {"null_out_params", null_out_params},
    {"null_id", null_id},
    {"stale_last_code", stale_last_code},
    {"step_cost_null", step_cost_null},
    {"clock_not_finite", clock_not_finite},
    {"queue_full_counts", queue_full_counts},
    {"null_prefix_store", null_prefix_store},
    {"prefix_store_null_out", prefix_store_null_out},
    {"failed_insert_changes_nothing", failed_insert_changes_nothing},
    {"failed_plan_keeps_retired", failed_plan_keeps_retired},
    {"failed_preempt_keeps_victims", failed_preempt_keeps_victims},
    {"failed_plan_changes_nothing", failed_plan_changes_nothing},
};

int main(int argc, char **argv)
{
    (void)below; /* harness.h's generator: unused here */
    if (argc != 2) {
        fprintf(stderr, "usage: api_misuse_harness <case> | --list\n");
        return 2;
    }
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (strcmp(argv[1], "--list") == 0) {
            printf("%s\n", cases[i].name);
        } else if (strcmp(argv[1], cases[i].name) == 0) {
            cases[i].fn();
            printf("ok %s\n", cases[i].name);
            return 0;
        }
    }
    if (strcmp(argv[1], "--list") == 0) return 0;
    fprintf(stderr, "unknown case %s\n", argv[1]);
    return 2;
}
