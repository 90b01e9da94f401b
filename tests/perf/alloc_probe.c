/*
 * Counts heap calls made by the scheduler core in steady state. Linked with
 * -Wl,--wrap=malloc,--wrap=calloc,--wrap=realloc so every allocation of the static core goes
 * through the counters below; counting is on only for the measured steps.
 *
 *   alloc_probe decode|mixed|churn N STEPS   ->  prints "allocations=<k> rows=<r>"
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "skippy_scheduler.h"

void *__real_malloc(size_t n);
void *__real_calloc(size_t n, size_t m);
void *__real_realloc(void *p, size_t n);
static long allocations;
static int counting;

void *__wrap_malloc(size_t n) { allocations += counting; return __real_malloc(n); }
void *__wrap_calloc(size_t n, size_t m) { allocations += counting; return __real_calloc(n, m); }
void *__wrap_realloc(void *p, size_t n) { allocations += counting; return __real_realloc(p, n); }

#define LONG_PROMPT 400000
static int32_t *prompt;
static unsigned long next_id;

static void submit(skippy_scheduler *s, size_t len, size_t generated, uint32_t max_tokens)
{
    char id[32];
    int n = snprintf(id, sizeof id, "r%lu", next_id++);
    int32_t first = 1;
    skippy_sequence_desc d;
    skippy_sequence_desc_init(&d, id, (size_t)n, prompt, len, max_tokens);
    if (generated) {
        d.generated_tokens = &first;
        d.generated_count = 1;
        d.prefill_cursor = len;
    }
    if (skippy_scheduler_submit(s, &d, NULL, NULL) != SKIPPY_STATUS_OK) exit(2);
}

/* One iteration; in churn mode the last sampling row finishes and a new request arrives. */
static size_t step(skippy_scheduler *s, int churn)
{
    skippy_plan *p;
    if (skippy_scheduler_plan(s, &p, NULL) != SKIPPY_STATUS_OK) exit(3);
    size_t k = p->sample_count, rows = p->request_count;
    for (size_t i = 0; i < k; i++) {
        p->outputs.sampled_request_indexes[i] = p->sample_rows[i];
        p->outputs.predicted_tokens[i] = 7;
    }
    if (churn && k && p->phases[p->sample_rows[k - 1]] == SKIPPY_PHASE_DECODE)
        p->outputs.predicted_tokens[k - 1] = -1;
    p->outputs.count = k;
    skippy_iteration_telemetry t;
    if (skippy_scheduler_complete(s, p->serial, &t, NULL) != SKIPPY_STATUS_OK) exit(4);
    static uint64_t finished; /* telemetry counts are cumulative */
    if (churn && t.finished > finished) submit(s, 512, 0, 1u << 30);
    finished = t.finished;
    return rows;
}

int main(int argc, char **argv)
{
    if (argc < 4) return 1;
    const char *mode = argv[1];
    size_t n = strtoul(argv[2], NULL, 10), steps = strtoul(argv[3], NULL, 10);
    int mixed = strcmp(mode, "mixed") == 0, churn = strcmp(mode, "churn") == 0;
    prompt = malloc(LONG_PROMPT * sizeof(int32_t));
    if (!prompt) return 2;
    for (size_t i = 0; i < LONG_PROMPT; i++) prompt[i] = (int32_t)(i * 7 % 32000);

    skippy_scheduler_config cfg;
    skippy_scheduler_config_default(&cfg);
    cfg.max_active_sequences = n + 1;
    cfg.sequence_id_limit = n + 17;
    cfg.max_waiting_sequences = n + 16;
    cfg.max_tokens_per_iteration = n + 512;
    cfg.mixed_prefill_decode = mixed || churn;
    skippy_scheduler *s;
    if (skippy_scheduler_create(&cfg, &s, NULL) != SKIPPY_STATUS_OK) return 2;
    for (size_t i = 0; i < n; i++) submit(s, 512, 1, 1u << 30);
    /* Two decode-only plans record decode durations (mixed plans need them); the first one
     * finishes a sequence and a new prefilled one replaces it. */
    for (int k = 0; k < 2 && (mixed || churn); k++) {
        skippy_plan *p;
        if (skippy_scheduler_plan(s, &p, NULL) != SKIPPY_STATUS_OK) return 3;
        if (skippy_scheduler_observe(s, p->serial, 10000.0, NULL) != SKIPPY_STATUS_OK) return 3;
        for (size_t i = 0; i < p->sample_count; i++) {
            p->outputs.sampled_request_indexes[i] = p->sample_rows[i];
            p->outputs.predicted_tokens[i] = 7;
        }
        p->outputs.count = p->sample_count;
        if (k == 0) p->outputs.predicted_tokens[p->sample_count - 1] = -1;
        if (skippy_scheduler_complete(s, p->serial, NULL, NULL) != SKIPPY_STATUS_OK) return 4;
        if (k == 0) submit(s, 512, 1, 1u << 30);
    }
    if (mixed) submit(s, LONG_PROMPT, 0, 1); /* stays in prefill: one chunk per step */
    for (size_t i = 0; i < 50; i++) step(s, churn);
    size_t rows = 0;
    counting = 1;
    for (size_t i = 0; i < steps; i++) rows += step(s, churn);
    counting = 0;
    printf("allocations=%ld rows=%zu\n", allocations, rows);
    skippy_scheduler_free(s);
    free(prompt);
    return 0;
}
