/*
 * Per-step scheduler overhead through the C API alone (no Python): N sequences decode in a
 * steady state; one step = skippy_scheduler_plan + a fake host that writes one sampled token
 * per sampling row into plan->outputs + skippy_scheduler_complete.
 *
 *   c_overhead N PROMPT WARMUP STEPS [MODE]
 *
 * MODE "time" (default) prints one line "median_ns=<x> p99_ns=<y> steps=<k>";
 * MODE "count" runs the steps without clocks so that an instruction counter
 * (valgrind --tool=callgrind --toggle-collect=bench_steps) sees only the measured steps.
 * Build: cc -O2 -I$(get_include) c_overhead.c -L$(get_library_dir) -lskippy_scheduler_core -lm
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "skippy_scheduler.h"

static int die(skippy_scheduler *s, const char *what)
{
    fprintf(stderr, "%s failed: %s\n", what, s ? skippy_scheduler_last_message(s) : "create");
    exit(2);
}

/* Kept out of line so callgrind can toggle collection on exactly one step. */
__attribute__((noinline)) int bench_step(skippy_scheduler *s, int32_t token)
{
    skippy_plan *p;
    if (skippy_scheduler_plan(s, &p, NULL) != SKIPPY_STATUS_OK) return -1;
    size_t k = p->sample_count;
    for (size_t i = 0; i < k; i++) {
        p->outputs.sampled_request_indexes[i] = p->sample_rows[i];
        p->outputs.predicted_tokens[i] = token;
    }
    p->outputs.count = k;
    if (skippy_scheduler_complete(s, p->serial, NULL, NULL) != SKIPPY_STATUS_OK) return -1;
    return (int)k;
}

/* The measured steps of "count" mode: the callgrind toggle point (warm-up steps run outside). */
__attribute__((noinline)) void bench_steps(skippy_scheduler *s, size_t n, size_t steps)
{
    for (size_t i = 0; i < steps; i++)
        if (bench_step(s, 7) != (int)n) die(s, "step");
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

int main(int argc, char **argv)
{
    if (argc < 5) {
        fprintf(stderr, "usage: %s N PROMPT WARMUP STEPS [time|count]\n", argv[0]);
        return 1;
    }
    size_t n = strtoul(argv[1], NULL, 10), prompt = strtoul(argv[2], NULL, 10);
    size_t warm = strtoul(argv[3], NULL, 10), steps = strtoul(argv[4], NULL, 10);
    int timed = argc < 6 || strcmp(argv[5], "count") != 0;
    if (n == 0 || prompt == 0 || steps == 0) return 1;

    skippy_scheduler_config cfg;
    skippy_scheduler_config_default(&cfg);
    cfg.max_active_sequences = n;
    cfg.sequence_id_limit = n + 16;
    cfg.max_waiting_sequences = n;
    cfg.max_tokens_per_iteration = n > 2048 ? n : 2048;
    skippy_scheduler *s = NULL;
    if (skippy_scheduler_create(&cfg, &s, NULL) != SKIPPY_STATUS_OK) die(NULL, "create");

    int32_t *toks = malloc(prompt * sizeof(int32_t));
    for (size_t i = 0; i < prompt; i++) toks[i] = (int32_t)(i % 32000);
    for (size_t i = 0; i < n; i++) {
        char id[32];
        int len = snprintf(id, sizeof id, "req-%zu", i);
        skippy_sequence_desc d;
        skippy_sequence_desc_init(&d, id, (size_t)len, toks, prompt, 1u << 30);
        int32_t first = 1;
        d.generated_tokens = &first; /* prefilled: every sequence decodes from the first step */
        d.generated_count = 1;
        d.prefill_cursor = prompt;
        if (skippy_scheduler_submit(s, &d, NULL, NULL) != SKIPPY_STATUS_OK) die(s, "submit");
    }
    free(toks);
    for (size_t i = 0; i < warm; i++)
        if (bench_step(s, 7) != (int)n) die(s, "warm-up step");

    if (!timed) {
        bench_steps(s, n, steps);
        printf("steps=%zu\n", steps);
    } else {
        uint64_t *ns = malloc(steps * sizeof(uint64_t));
        for (size_t i = 0; i < steps; i++) {
            uint64_t t0 = now_ns();
            if (bench_step(s, 7) != (int)n) die(s, "step");
            ns[i] = now_ns() - t0;
        }
        qsort(ns, steps, sizeof *ns, cmp_u64);
        size_t p99 = (steps * 99) / 100;
        if (p99 >= steps) p99 = steps - 1;
        printf("median_ns=%llu p99_ns=%llu steps=%zu\n", (unsigned long long)ns[steps / 2],
               (unsigned long long)ns[p99], steps);
        free(ns);
    }
    skippy_scheduler_free(s);
    return 0;
}
