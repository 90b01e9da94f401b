/*
 * A native host that links the scheduler core with no Python: it submits a few sequences and
 * runs plan -> runtime -> complete until every sequence has finished, then prints each
 * sequence's generated tokens.
 *
 * The "runtime" here is a stand-in with the exact signature of the Skippy runtime's
 * skippy_iteration_batch_sampled: it receives the plan's request rows as they are (no copy or
 * translation) and writes compact sampled outputs (work index, token) into the plan's output
 * block. Its "model" predicts last_token + 1, and the end-of-sequence token (-1) after 5000.
 * A failed runtime call aborts its plan, and the runtime's error is freed with the runtime's
 * skippy_error_free (defined here for the stand-in), not with skippy_scheduler_error_free.
 *
 * Build against an installed package:
 *   cc examples/c_host/host.c -I"$(python -c 'import skippy_scheduler as s; print(s.get_include())')" \
 *      -L"$(python -c 'import skippy_scheduler as s; print(s.get_library_dir())')" \
 *      -lskippy_scheduler_core -lm -o host
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "skippy_scheduler.h"

static skippy_status fake_runtime(const skippy_iteration_request *requests, size_t request_count,
                                  struct skippy_activation_desc *output_descs, void **output_payloads,
                                  const size_t *output_payload_capacities,
                                  size_t *out_output_payload_bytes,
                                  size_t *out_sampled_request_indexes, int32_t *out_predicted_tokens,
                                  size_t sampled_output_capacity, size_t *out_sampled_output_count,
                                  skippy_error **out_error)
{
    (void)output_descs; (void)output_payloads; (void)output_payload_capacities;
    (void)out_output_payload_bytes;
    if (out_error) *out_error = NULL;
    size_t need = 0;
    for (size_t i = 0; i < request_count; i++) need += requests[i].sample_last;
    *out_sampled_output_count = need;
    if (need > sampled_output_capacity) return SKIPPY_STATUS_BUFFER_TOO_SMALL;
    size_t k = 0;
    for (size_t i = 0; i < request_count; i++) {
        if (!requests[i].sample_last) continue;
        int32_t last = requests[i].token_ids[requests[i].token_count - 1];
        out_sampled_request_indexes[k] = i;
        out_predicted_tokens[k] = last >= 5000 ? -1 : last + 1;
        k++;
    }
    return SKIPPY_STATUS_OK;
}

/* The stand-in runtime's skippy_error_free (declared in skippy_abi.h; a real runtime defines
 * it). An error the runtime returns is freed with this, never with skippy_scheduler_error_free. */
void skippy_error_free(skippy_error *error)
{
    if (!error) return;
    free((void *)error->message);
    free(error);
}

/* Checks a scheduler call: its error is the scheduler's, freed with skippy_scheduler_error_free. */
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

/* Submits three sequences and runs plan -> runtime -> complete until all of them have ended;
 * 0 on success. */
static int drive(skippy_scheduler *s, skippy_iteration_batch_sampled_fn runtime)
{
    skippy_error *err = NULL;
    static const int32_t p0[] = {10, 11, 12, 13, 14, 15};
    static const int32_t p1[] = {100, 101};
    static const int32_t p2[] = {4995, 4996, 4997, 4998, 4999};
    const int32_t *prompts[] = {p0, p1, p2};
    const size_t lens[] = {6, 2, 5};
    const char *ids[] = {"alpha", "beta", "gamma"};
    for (int i = 0; i < 3; i++) {
        skippy_sequence_desc d;
        skippy_sequence_desc_init(&d, ids[i], strlen(ids[i]), prompts[i], lens[i], 4);
        if (check(skippy_scheduler_submit(s, &d, NULL, &err), &err, "submit")) return 1;
    }

    int done = 0, iterations = 0;
    while (done < 3 && iterations < 100) {
        skippy_plan *plan = NULL;
        if (check(skippy_scheduler_plan(s, &plan, &err), &err, "plan")) return 1;
        skippy_plan_outputs *o = &plan->outputs;
        if (plan->request_count > 0) {
            skippy_error *runtime_err = NULL;
            skippy_status st = runtime(plan->requests, plan->request_count, NULL, NULL, NULL, NULL,
                                       o->sampled_request_indexes, o->predicted_tokens,
                                       o->capacity, &o->count, &runtime_err);
            if (st != SKIPPY_STATUS_OK) {
                /* The runtime's error goes to the runtime's skippy_error_free. The scheduler
                 * advanced the plan's sequences when it made the plan: abort it, so that they
                 * return to where they were. */
                fprintf(stderr, "runtime failed: %s\n",
                        runtime_err && runtime_err->message ? runtime_err->message : "?");
                skippy_error_free(runtime_err);
                check(skippy_scheduler_abort(s, plan->serial, &err), &err, "abort");
                return 1;
            }
        }
        skippy_iteration_telemetry t;
        if (check(skippy_scheduler_complete(s, plan->serial, &t, &err), &err, "complete"))
            return 1;
        iterations++;
        /* Sequences that ended in this completion; readable until the next plan. */
        size_t n = 0;
        const skippy_retired *ret = skippy_scheduler_retired(s, &n);
        for (size_t i = 0; i < n; i++) {
            skippy_sequence_info info;
            if (!skippy_scheduler_sequence(s, ret[i].slot, &info)) return 1;
            printf("%.*s %s:", (int)info.id_len, info.id,
                   ret[i].status == SKIPPY_SEQ_FINISHED    ? "finished"
                   : ret[i].status == SKIPPY_SEQ_CANCELLED ? "cancelled"
                                                           : "failed");
            for (size_t k = 0; k < info.generated_count; k++)
                printf(" %d", info.tokens[info.prompt_count + k]);
            printf("\n");
        }
        done += (int)n;
    }
    const skippy_scheduler_metrics *m = skippy_scheduler_get_metrics(s);
    printf("iterations %llu finished %llu prefill %llu decode %llu\n",
           (unsigned long long)m->iterations, (unsigned long long)m->finished,
           (unsigned long long)m->prefill_tokens, (unsigned long long)m->decode_tokens);
    return done == 3 ? 0 : 1;
}

int main(void)
{
    skippy_scheduler_config cfg;
    skippy_scheduler_config_default(&cfg);
    cfg.max_tokens_per_iteration = 8;
    cfg.prefill_chunk_tokens = 4;
    cfg.mixed_prefill_decode = true;

    skippy_scheduler *s = NULL;
    skippy_error *err = NULL;
    if (check(skippy_scheduler_create(&cfg, &s, &err), &err, "create")) return 1;
    int rc = drive(s, fake_runtime);
    skippy_scheduler_free(s);
    return rc;
}
