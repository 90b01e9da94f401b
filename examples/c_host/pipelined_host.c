/*
 * A native host with two plans in flight (max_inflight_plans = 2), no Python: while the
 * "device" runs plan N, the host already has plan N+1 made; it then fills N+1's deferred
 * inputs from N's sampled outputs, runs N+1, and completes N. Every sequence must end with
 * exactly the tokens a one-plan-at-a-time host gives it (the program checks this itself by
 * running the same workload at depth 1 first).
 *
 * The "model" predicts last_token + 1 and ends a sequence (-1) once it reaches a multiple of 7
 * above 5000. Build like the other example:
 *   cc examples/c_host/pipelined_host.c $(skippy-scheduler config --cflags --libs) -o pipelined
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "skippy_scheduler.h"

#define N_SEQ 5
#define MAX_TOKENS 12

static int32_t next_token(int32_t last) { return (last > 5000 && last % 7 == 0) ? -1 : last + 1; }

/* The device: one sample per sampling row, from the row's last input token. */
static void run_plan(skippy_plan *plan)
{
    skippy_plan_outputs *o = &plan->outputs;
    size_t k = 0;
    for (size_t i = 0; i < plan->request_count; i++) {
        const skippy_iteration_request *r = &plan->requests[i];
        if (!r->sample_last) continue;
        o->sampled_request_indexes[k] = i;
        o->predicted_tokens[k] = next_token(r->token_ids[r->token_count - 1]);
        k++;
    }
    o->count = k;
}

/* Deferred inputs of `plan` come from `earlier` (the plan made just before it). */
static int resolve(skippy_plan *plan, const skippy_plan *earlier)
{
    const skippy_deferred_inputs *d = &plan->deferred;
    for (size_t j = 0; j < d->count; j++) {
        if (!earlier || d->source_steps[j] != earlier->step) return -1;
        int32_t token = 0; /* an ended source: the row's output is discarded anyway */
        for (size_t k = 0; k < earlier->outputs.count; k++)
            if (earlier->outputs.sampled_request_indexes[k] == d->source_indexes[j]) {
                int32_t t = earlier->outputs.predicted_tokens[k];
                token = t < 0 ? 0 : t;
            }
        plan->tokens[plan->row_offsets[d->rows[j]]] = token;
    }
    return 0;
}

/* 0 when `st` is OK; else prints the scheduler's message, frees its error and returns 1.
 * `errp` is read here, after the call that set it: passing the error itself as an argument
 * beside that call would read it first (C leaves the order of arguments open). */
static int check(skippy_status st, skippy_error **errp, const char *what)
{
    if (st == SKIPPY_STATUS_OK) return 0;
    skippy_error *err = *errp;
    fprintf(stderr, "%s failed: %s\n", what, err && err->message ? err->message : "?");
    skippy_scheduler_error_free(err);
    *errp = NULL;
    return 1;
}

/* Runs the workload at `depth`; writes each sequence's tokens (ended by -2) into out. */
static int run(size_t depth, int32_t out[N_SEQ][MAX_TOKENS + 1], unsigned long long *deferred)
{
    skippy_scheduler_config cfg;
    skippy_scheduler_config_default(&cfg);
    cfg.max_tokens_per_iteration = 16;
    cfg.prefill_chunk_tokens = 4;
    cfg.max_inflight_plans = depth;
    skippy_scheduler *s = NULL;
    skippy_error *err = NULL;
    if (check(skippy_scheduler_create(&cfg, &s, &err), &err, "create")) return 1;
    int rc = 1; /* every failure below goes to `out`, which frees the scheduler */
    char ids[N_SEQ][16];
    for (int i = 0; i < N_SEQ; i++) {
        int32_t prompt[9];
        size_t len = 2 + (size_t)i * 2 % 7;
        for (size_t k = 0; k < len; k++) prompt[k] = 4990 + i * 3 + (int32_t)k;
        snprintf(ids[i], sizeof ids[i], "seq%d", i);
        skippy_sequence_desc d;
        skippy_sequence_desc_init(&d, ids[i], strlen(ids[i]), prompt, len, MAX_TOKENS);
        if (check(skippy_scheduler_submit(s, &d, NULL, &err), &err, "submit")) goto out;
        out[i][0] = -2;
    }
    /* Plans in flight, oldest first: each has run on the "device" (in order) and waits for
     * completion; a real device would be running the newest while the host completes the
     * oldest and makes the next. */
    skippy_plan *inflight[2] = {NULL, NULL};
    size_t count = 0;
    int ended = 0;
    for (int guard = 0; ended < N_SEQ && guard < 1000; guard++) {
        if (count < depth) {
            skippy_plan *next = NULL;
            if (check(skippy_scheduler_plan(s, &next, &err), &err, "plan")) goto out;
            if (next->request_count > 0) {
                *deferred += next->deferred.count;
                if (resolve(next, count ? inflight[count - 1] : NULL)) {
                    fprintf(stderr, "a deferred input names a plan that is not the previous one\n");
                    goto out;
                }
                run_plan(next);
                inflight[count++] = next;
                continue;
            }
            /* Everything runnable is in flight: give the empty plan back, complete one. */
            if (check(skippy_scheduler_abort(s, next->serial, &err), &err, "abort")) goto out;
            if (count == 0) break;
        }
        skippy_iteration_telemetry t;
        if (check(skippy_scheduler_complete(s, inflight[0]->serial, &t, &err), &err, "complete"))
            goto out;
        inflight[0] = inflight[1];
        inflight[1] = NULL;
        count--;
        /* Sequences that ended in this completion; readable until the next plan. */
        size_t n = 0;
        const skippy_retired *ret = skippy_scheduler_retired(s, &n);
        for (size_t i = 0; i < n; i++) {
            skippy_sequence_info info;
            if (!skippy_scheduler_sequence(s, ret[i].slot, &info)) goto out;
            int which = info.id[3] - '0';
            for (size_t k = 0; k < info.generated_count; k++)
                out[which][k] = info.tokens[info.prompt_count + k];
            out[which][info.generated_count] = -2;
        }
        ended += (int)n;
    }
    const skippy_scheduler_metrics *m = skippy_scheduler_get_metrics(s);
    printf("depth %zu: iterations %llu finished %llu discarded rows %llu\n", depth,
           (unsigned long long)m->iterations, (unsigned long long)m->finished,
           (unsigned long long)m->discarded_rows);
    rc = ended == N_SEQ ? 0 : 1;
out:
    skippy_scheduler_free(s);
    return rc;
}

int main(void)
{
    static int32_t one[N_SEQ][MAX_TOKENS + 1], two[N_SEQ][MAX_TOKENS + 1];
    unsigned long long deferred1 = 0, deferred2 = 0;
    if (run(1, one, &deferred1) || run(2, two, &deferred2)) return 1;
    for (int i = 0; i < N_SEQ; i++) {
        printf("seq%d:", i);
        for (int k = 0; k <= MAX_TOKENS && two[i][k] != -2; k++) printf(" %d", two[i][k]);
        printf("\n");
        for (int k = 0; k <= MAX_TOKENS; k++) {
            if (one[i][k] != two[i][k]) { fprintf(stderr, "seq%d differs at %d\n", i, k); return 1; }
            if (one[i][k] == -2) break;
        }
    }
    printf("deferred inputs: %llu at depth 1, %llu at depth 2; same tokens at both depths\n",
           deferred1, deferred2);
    return deferred1 == 0 && deferred2 > 0 ? 0 : 1;
}
