/*
 * skippy_scheduler.h: the C interface of the scheduler core (libskippy_scheduler_core.a).
 *
 * A native host links this library and drives the loop
 *     skippy_scheduler_submit ... skippy_scheduler_plan -> run plan->requests on the runtime,
 *     writing compact outputs into plan->outputs -> skippy_scheduler_complete
 * with no Python involved. The Python package wraps the same functions.
 *
 * Conventions: functions that can fail return skippy_status and, when out_error is not NULL,
 * store a heap-allocated skippy_error on failure (free it with skippy_error_free) or NULL on
 * success. skippy_scheduler_last_code() then tells the precise reason (skippy_sched_code).
 * A failed call never changes scheduler state. Sequences are addressed by their id bytes or by
 * the slot the scheduler gave them (stable while the sequence is waiting or active).
 */
#ifndef SKIPPY_SCHEDULER_H
#define SKIPPY_SCHEDULER_H

#include "skippy_abi.h"

#ifdef __cplusplus
extern "C" {
#endif

/* No prefix-store entry, no holder id (the decls file carries no directives). */
#define SKIPPY_PREFIX_NONE 0xFFFFFFFFu

#include "skippy_scheduler_decls.h"

#ifdef __cplusplus
}
#endif

#endif /* SKIPPY_SCHEDULER_H */
