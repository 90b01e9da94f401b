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
 *
 * It stands in for the runtime's own header, whose include guard (SKIPPY_ABI_H) it shares: a
 * translation unit includes one of the two. This one declares what a host needs to drive the
 * scheduler and hand plans to the runtime (the shared types, skippy_abi_version,
 * skippy_abi_features, skippy_iteration_batch_sampled, skippy_error_free); calls of the
 * runtime's that it does not declare (models, sessions) go in a file of their own.
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

/* Implemented by the runtime: the ABI it was built for (a host requires an exact match with
 * SKIPPY_ABI_VERSION_*) and its SKIPPY_ABI_FEATURE_* bits. */
skippy_version skippy_abi_version(void);
uint64_t skippy_abi_features(void);

#ifdef __cplusplus
}
#endif

#endif /* SKIPPY_ABI_H */
