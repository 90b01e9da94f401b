/*
 * Failure reporting of the scheduler core (see sk_error.h) and the public skippy_error object.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sk_internal.h"

int sk_fail(skippy_scheduler *s, skippy_sched_code code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s->message, sizeof s->message, fmt, ap);
    va_end(ap);
    s->code = code;
    return (int)code;
}

static skippy_status to_status(skippy_sched_code code)
{
    switch (code) {
    case SKIPPY_SCHED_OK: return SKIPPY_STATUS_OK;
    case SKIPPY_SCHED_NO_MEMORY: return SKIPPY_STATUS_ERROR;
    case SKIPPY_SCHED_CALLBACK: return SKIPPY_STATUS_RUNTIME_ERROR;
    default: return SKIPPY_STATUS_INVALID_ARGUMENT;
    }
}

skippy_status sk_fail_alone(skippy_status status, const char *text, skippy_error **out_error)
{
    if (!out_error) return status;
    *out_error = NULL;
    /* Without memory for the error object the caller still gets the status. */
    skippy_error *error = malloc(sizeof *error);
    char *message = error ? malloc(strlen(text) + 1) : NULL;
    if (error && message) {
        strcpy(message, text);
        error->status = status;
        error->message = message;
        *out_error = error;
    } else {
        free(error);
        free(message);
    }
    return status;
}

skippy_status sk_result(skippy_scheduler *s, int rc, skippy_error **out_error)
{
    if (rc == 0) {
        if (out_error) *out_error = NULL;
        s->code = SKIPPY_SCHED_OK;
        s->message[0] = 0;
        return SKIPPY_STATUS_OK;
    }
    return sk_fail_alone(to_status((skippy_sched_code)rc), s->message, out_error);
}

void skippy_scheduler_error_free(skippy_error *error)
{
    if (!error) return;
    free((void *)error->message);
    free(error);
}
