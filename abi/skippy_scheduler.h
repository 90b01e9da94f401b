/*
 * skippy_scheduler.h: the C interface of the scheduler core (libskippy_scheduler_core.a).
 *
 * A native host links this library and drives the loop
 *     skippy_scheduler_submit ... skippy_scheduler_plan -> run plan->requests on the runtime,
 *     writing compact outputs into plan->outputs -> skippy_scheduler_complete
 * with no Python involved. The Python package wraps the same functions.
 *
 * Conventions: functions that can fail return skippy_status and, when out_error is not NULL,
 * store a heap-allocated skippy_error on failure (free it with skippy_scheduler_error_free, not
 * the runtime's skippy_error_free) or NULL on success. skippy_scheduler_last_code() then tells
 * the precise reason (skippy_sched_code); each
 * call that reports through it (the skippy_status calls, and skippy_scheduler_cancel) sets it
 * back to SKIPPY_SCHED_OK, with an empty message, when it does not fail.
 * A failed call never changes scheduler state, with two exceptions: a submit refused with
 * SKIPPY_SCHED_QUEUE_FULL counts the refusal in metrics.rejected_overload; and a plan that fails
 * in its policy callback, or out of memory, may already have re-read from the prefix store what
 * it holds for waiting sequences (their restore, cursor and saved cost, counted in
 * metrics.stale_refreshes), as the next plan would read it anyway. Sequences are
 * addressed by their id bytes or by the slot the scheduler gave them (stable while the sequence
 * is waiting or active).
 *
 * NULL arguments. Every entry point accepts NULL for any pointer argument:
 *  - A NULL scheduler or prefix store: a call returning skippy_status returns
 *    SKIPPY_STATUS_INVALID_ARGUMENT (with an error object when out_error is not NULL), one
 *    returning skippy_sched_code returns SKIPPY_SCHED_INVALID (an output entry, if given, is set
 *    to SKIPPY_PREFIX_NONE), and neither records anything. Getters return NULL, 0, false or
 *    SKIPPY_PREFIX_NONE (a list getter sets its count to 0; get_stats fills zeros);
 *    skippy_scheduler_last_code returns SKIPPY_SCHED_INVALID and the two last_message calls a
 *    fixed message naming the NULL handle. Void calls (free, set_callbacks, set_clock) do
 *    nothing.
 *  - skippy_scheduler_create with a NULL config or out_scheduler, and
 *    skippy_prefix_store_create likewise, fail (INVALID_ARGUMENT / SKIPPY_SCHED_INVALID, with an
 *    error object for the scheduler); *out is set to NULL first whenever out is not NULL.
 *  - The initialisers given NULL (skippy_scheduler_config_default, _config_normalize,
 *    skippy_sequence_desc_init, skippy_prefix_store_config_default) do nothing.
 *  - A required input that is NULL (a descriptor, a step cost, an array with a non-zero count)
 *    fails the call with SKIPPY_SCHED_INVALID and a message that names it; an array whose count
 *    is 0 may be NULL. An id that is NULL with length 0 is the empty id; NULL with a length is
 *    refused (submit fails, find returns SKIPPY_PREFIX_NONE, cancel returns false with
 *    last_code SKIPPY_SCHED_INVALID).
 *  - An optional output that is NULL (out_slot, out_plan, out_telemetry, out_preempted,
 *    out_entry, out_matched, out_error) is not written; the call does its work all the same.
 *  - List getters (skippy_scheduler_active_slots, _waiting_slots, _component_used, _retired,
 *    _priority_victims, skippy_prefix_store_evicted): the count pointer may be NULL; the array
 *    is returned all the same.
 *  - A NULL destination to fill (skippy_scheduler_sequence's out_info,
 *    skippy_prefix_store_entry's out_info, _key's dst, _lru_order's out,
 *    skippy_scheduler_take_prompt_keeps' out, _get_stats' out_stats): nothing is written or
 *    taken, and the call returns false or 0.
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
