/*
 * sk_error.h: how the scheduler core reports a failed call.
 *
 * Internal functions return 0, or the skippy_sched_code that sk_fail recorded on the scheduler
 * together with a message (skippy_scheduler_last_code / _last_message read them back). A public
 * entry point hands that result to sk_result, which turns it into the skippy_status the C API
 * returns and, when the caller asked for one, an owned skippy_error.
 *
 * Only the public header is included here: the scheduler's layout (sk_internal.h) includes this
 * file, not the other way round.
 */
#ifndef SK_ERROR_H
#define SK_ERROR_H

#include "skippy_scheduler.h"

#if defined(__GNUC__) || defined(__clang__)
#define SK_PRINTF_LIKE(fmt, args) __attribute__((format(printf, fmt, args)))
#else
#define SK_PRINTF_LIKE(fmt, args)
#endif

/* Records `code` and the formatted message on the scheduler; returns (int)code. */
int sk_fail(skippy_scheduler *s, skippy_sched_code code, const char *fmt, ...) SK_PRINTF_LIKE(3, 4);

/* The public result of an internal result `rc` (0 clears the recorded code and message). */
skippy_status sk_result(skippy_scheduler *s, int rc, skippy_error **out_error);

/*
 * A failure with no scheduler to record it on (a NULL handle, or create before the scheduler
 * exists): returns `status` and, when out_error is not NULL, stores an owned skippy_error with
 * `message` (NULL when even that cannot be allocated).
 */
skippy_status sk_fail_alone(skippy_status status, const char *message, skippy_error **out_error);

/* What skippy_scheduler_last_message and the error object say for a NULL scheduler. */
#define SK_NULL_SCHEDULER "scheduler is NULL"

/* A NULL scheduler handle given to an entry point that returns a status. */
#define SK_NO_SCHEDULER(out_error) \
    sk_fail_alone(SKIPPY_STATUS_INVALID_ARGUMENT, SK_NULL_SCHEDULER, out_error)

#endif
