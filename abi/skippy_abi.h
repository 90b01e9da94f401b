/*
 * skippy_abi.h: the one source of truth for every struct, enum and constant shared between
 * skippy-scheduler and a native Skippy runtime host.
 *
 * The iteration request row mirrors the native Skippy ABI 0.1.52 (`skippy_iteration_request`,
 * 72 bytes, align 8 on LP64); the plan and output structs are this project's own and carry
 * their own version (SKIPPY_PLAN_ABI_*), which the compiled Python modules check at import.
 *
 * The declarations themselves live in skippy_abi_decls.h, which is free of preprocessor
 * directives so that cffi can read it verbatim; this wrapper adds the includes, the guards and
 * the prototypes of functions that a runtime (not this project) implements.
 */
#ifndef SKIPPY_ABI_H
#define SKIPPY_ABI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Skippy runtime ABI whose iteration-request layout this header mirrors. */
#define SKIPPY_ABI_VERSION_MAJOR 0
#define SKIPPY_ABI_VERSION_MINOR 1
#define SKIPPY_ABI_VERSION_PATCH 52

#include "skippy_abi_decls.h"

/*
 * Implemented by a Skippy runtime (feature bit SKIPPY_ABI_FEATURE_ITERATION_BATCH), not by this
 * project. A host passes `plan->requests`, `plan->request_count` and the plan's output block
 * (`plan->outputs.sampled_request_indexes`, `.predicted_tokens`, `.capacity`, `&.count`)
 * straight through.
 */
skippy_status skippy_iteration_batch_sampled(
    const struct skippy_iteration_request *requests, size_t request_count,
    struct skippy_activation_desc *output_descs, void **output_payloads,
    const size_t *output_payload_capacities, size_t *out_output_payload_bytes,
    size_t *out_sampled_request_indexes, int32_t *out_predicted_tokens,
    size_t sampled_output_capacity, size_t *out_sampled_output_count,
    struct skippy_error **out_error);

/* Implemented by the runtime: frees an error object the runtime returned (the scheduler's own
 * are freed with skippy_scheduler_error_free, skippy_scheduler.h). */
void skippy_error_free(struct skippy_error *error);

#ifdef __cplusplus
}
#endif

#endif /* SKIPPY_ABI_H */
