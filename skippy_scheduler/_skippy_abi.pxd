# Cython view of abi/skippy_abi.h (declarations in abi/skippy_abi_decls.h): the structs shared
# with a native Skippy runtime. Only what the extension modules use is declared.
from libc.stdint cimport int32_t, uint8_t, uint32_t, uint64_t
from libcpp cimport bool as cbool

cdef extern from "skippy_abi.h" nogil:
    enum: SKIPPY_PLAN_ABI_VERSION

    ctypedef struct skippy_version:
        uint32_t major
        uint32_t minor
        uint32_t patch

    ctypedef enum skippy_status:
        SKIPPY_STATUS_OK
        SKIPPY_STATUS_INVALID_ARGUMENT

    ctypedef struct skippy_error:
        skippy_status status
        const char *message

    struct skippy_session
    struct skippy_activation_desc
    ctypedef struct skippy_sampling_config:
        uint32_t version

    ctypedef struct skippy_iteration_request:
        skippy_session *session
        const int32_t *token_ids
        size_t token_count
        const int32_t *positions
        size_t position_count
        const skippy_sampling_config *sampling
        const skippy_activation_desc *input_desc
        const void *input_payload
        cbool sample_last

    ctypedef struct skippy_plan_outputs:
        size_t *sampled_request_indexes
        int32_t *predicted_tokens
        size_t capacity
        size_t count

    ctypedef struct skippy_deferred_inputs:
        size_t *rows
        uint64_t *source_steps
        size_t *source_indexes
        size_t count
        size_t capacity

    enum: SKIPPY_DEFERRED_TOKEN
    enum: SKIPPY_PHASE_DECODE

    ctypedef struct skippy_plan:
        uint64_t serial
        skippy_iteration_request *requests
        size_t request_count
        size_t request_capacity
        int32_t *tokens
        int32_t *positions
        size_t token_count
        size_t token_capacity
        size_t *row_offsets
        uint32_t *slots
        uint8_t *phases
        uint8_t *sample_last
        size_t *sample_rows
        size_t sample_count
        size_t admitted
        size_t preempted
        skippy_plan_outputs outputs
        uint64_t step
        skippy_deferred_inputs deferred
        uint8_t *new_rows
        size_t *restored_tokens
