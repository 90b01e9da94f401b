/*
 * Declarations shared by C, cffi and Cython. No preprocessor directives in this file: cffi's
 * cdef reads it as is (see abi/skippy_abi.h for the includes and guards).
 * Every field states its meaning and unit. Sizes and offsets are LP64 and are checked by
 * tests/native/test_abi_layout.py across the C compiler, cffi and Cython.
 */

/* This project's plan ABI: bumped whenever a struct below changes layout or meaning. */
enum {
    SKIPPY_PLAN_ABI_VERSION = 4
};

/* Three uint32 fields returned by value (12 bytes). */
typedef struct skippy_version {
    uint32_t major;
    uint32_t minor;
    uint32_t patch;
} skippy_version;

/* Status of every skippy_* entry point (C enum, int sized). */
typedef enum skippy_status {
    SKIPPY_STATUS_OK = 0,
    SKIPPY_STATUS_ERROR = 1,
    SKIPPY_STATUS_INVALID_ARGUMENT = 2,
    SKIPPY_STATUS_UNSUPPORTED = 3,
    SKIPPY_STATUS_BUFFER_TOO_SMALL = 4,
    SKIPPY_STATUS_IO_ERROR = 5,
    SKIPPY_STATUS_MODEL_ERROR = 6,
    SKIPPY_STATUS_RUNTIME_ERROR = 7
} skippy_status;

/* Heap-allocated by the callee on failure; released by the caller (16 bytes on LP64). */
typedef struct skippy_error {
    skippy_status status;  /* what failed */
    const char *message;   /* NUL-terminated, owned by the error object */
} skippy_error;

/* skippy_abi_features() bits (0.1.52 header names). */
enum {
    SKIPPY_ABI_FEATURE_RUNTIME_SLICE = 0,
    SKIPPY_ABI_FEATURE_SAMPLING_CONFIG = 12,
    SKIPPY_ABI_FEATURE_RECURRENT_STATE = 14,
    SKIPPY_ABI_FEATURE_ITERATION_BATCH = 28,
    SKIPPY_ABI_FEATURE_ACTIVATION_BOUNDARY = 29,
    SKIPPY_ABI_FEATURE_MODEL_SOURCE = 30
};

/* Opaque runtime objects: never dereferenced by the scheduler, only carried. */
struct skippy_session;
struct skippy_activation_desc;

/* Sampling config, 0.1.52 layout: 2352 bytes, align 4. */
enum {
    SKIPPY_SAMPLING_FLAG_ENABLED = 1,
    SKIPPY_SAMPLING_FLAG_IGNORE_EOS = 2,
    SKIPPY_SAMPLING_MAX_LOGIT_BIAS = 256,
    SKIPPY_SAMPLING_MAX_SAMPLERS = 16,
    SKIPPY_SAMPLING_MAX_DRY_BREAKERS = 8,
    SKIPPY_SAMPLING_DRY_BREAKER_BYTES = 16
};

typedef struct skippy_logit_bias {
    int32_t token;  /* token id */
    float bias;     /* added to the token's logit */
} skippy_logit_bias;

typedef struct skippy_sampling_config {
    uint32_t version;             /* 0 = greedy argmax */
    uint32_t flags;               /* SKIPPY_SAMPLING_FLAG_* */
    uint32_t seed;                /* 0 = runtime default */
    int32_t top_k;
    int32_t penalty_last_n;
    float temperature;
    float top_p;
    float presence_penalty;
    float frequency_penalty;
    float repeat_penalty;
    uint32_t logit_bias_count;    /* used entries of logit_bias */
    float min_p;
    float typical_p;
    float top_nsigma;
    float dynatemp_range;
    float dynatemp_exponent;
    float dry_multiplier;
    float dry_base;
    int32_t dry_allowed_length;
    int32_t dry_penalty_last_n;
    float xtc_probability;
    float xtc_threshold;
    int32_t mirostat_mode;
    float mirostat_entropy;
    float mirostat_learning_rate;
    uint32_t sampler_count;       /* used entries of samplers */
    uint32_t samplers[16];        /* 1 penalties .. 9 temperature */
    uint32_t ignore_eos;
    uint32_t dry_sequence_breaker_count;
    char dry_sequence_breakers[8][16];  /* NUL-padded */
    skippy_logit_bias logit_bias[256];
} skippy_sampling_config;

/* One work row of an iteration: 72 bytes, align 8, byte-identical to the 0.1.52 runtime. */
typedef struct skippy_iteration_request {
    struct skippy_session *session;                 /* host's native session of the sequence */
    const int32_t *token_ids;                       /* row tokens (points into the plan arena) */
    size_t token_count;                             /* >= 1 */
    const int32_t *positions;                       /* absolute positions, or NULL */
    size_t position_count;                          /* token_count when positions set, else 0 */
    const struct skippy_sampling_config *sampling;  /* NULL = greedy */
    const struct skippy_activation_desc *input_desc;/* NULL for a token-input stage */
    const void *input_payload;                      /* activation payload for input_desc */
    bool sample_last;                               /* sample the row's last token */
} skippy_iteration_request;

/* Function type of the runtime's single-call iteration (prototype in skippy_abi.h). */
typedef skippy_status (*skippy_iteration_batch_sampled_fn)(
    const struct skippy_iteration_request *requests, size_t request_count,
    struct skippy_activation_desc *output_descs, void **output_payloads,
    const size_t *output_payload_capacities, size_t *out_output_payload_bytes,
    size_t *out_sampled_request_indexes, int32_t *out_predicted_tokens,
    size_t sampled_output_capacity, size_t *out_sampled_output_count,
    struct skippy_error **out_error);

/* Work-row phase (scheduler metadata; not part of the native row). */
typedef enum skippy_phase {
    SKIPPY_PHASE_PREFILL = 0,
    SKIPPY_PHASE_RECOMPUTE = 1,
    SKIPPY_PHASE_DECODE = 2
} skippy_phase;

/*
 * Compact sampled outputs, laid out exactly as the runtime call writes them:
 * entry k names work row sampled_request_indexes[k] and its token predicted_tokens[k].
 */
typedef struct skippy_plan_outputs {
    size_t *sampled_request_indexes;  /* capacity entries */
    int32_t *predicted_tokens;        /* capacity entries; negative = end of sequence */
    size_t capacity;                  /* = rows of the plan (one sample per row at most) */
    size_t count;                     /* entries written by the host */
} skippy_plan_outputs;

/*
 * Decode rows whose input token an earlier plan is still sampling (plans in flight, behaviour.md
 * §2.11): entry j says row `rows[j]` of this plan feeds, as its one token, the token that the
 * plan of step `source_steps[j]` samples at work index `source_indexes[j]`. The arena holds
 * SKIPPY_DEFERRED_TOKEN there until the host writes the real token. Empty at depth 1.
 */
typedef struct skippy_deferred_inputs {
    size_t *rows;                     /* count entries: work indexes in this plan, ascending */
    uint64_t *source_steps;           /* count entries: step of the plan that samples the token */
    size_t *source_indexes;           /* count entries: work index of that sample in its plan */
    size_t count;                     /* entries in use */
    size_t capacity;                  /* allocated entries */
} skippy_deferred_inputs;

enum {
    SKIPPY_DEFERRED_TOKEN = -1        /* arena value of a deferred input not yet written */
};

/*
 * One iteration plan, struct-of-arrays, owned by the scheduler. Row i of every per-row array
 * describes work index i. A scheduler keeps max_inflight_plans plans, each with its own arrays,
 * allocated once and reused: a plan is valid until it is completed or aborted (at depth 1,
 * making the next plan aborts a live one).
 */
typedef struct skippy_plan {
    uint64_t serial;                             /* plan number (1, 2, ...); 0 = no plan */
    skippy_iteration_request *requests;          /* request_count rows, ready for the runtime */
    size_t request_count;                        /* rows in this plan */
    size_t request_capacity;                     /* allocated rows */
    int32_t *tokens;                             /* flat token arena: token_count entries */
    int32_t *positions;                          /* absolute position of each arena token */
    size_t token_count;                          /* tokens in this plan (all rows) */
    size_t token_capacity;                       /* allocated arena entries */
    size_t *row_offsets;                         /* request_count + 1 offsets into the arena */
    uint32_t *slots;                             /* scheduler slot of each row's sequence */
    uint8_t *phases;                             /* skippy_phase of each row */
    uint8_t *sample_last;                        /* 1 when the row samples its last token */
    size_t *sample_rows;                         /* work indexes of the sampling rows */
    size_t sample_count;                         /* entries of sample_rows */
    size_t admitted;                             /* sequences admitted while planning */
    size_t preempted;                            /* sequences this plan's admission preempted
                                                    for priority (§2.8a; their slots:
                                                    skippy_scheduler_priority_victims);
                                                    preemption for memory is reported by
                                                    skippy_scheduler_preempt */
    skippy_plan_outputs outputs;                 /* filled by the host, consumed on completion */
    uint64_t step;                               /* plans made before this one (serial - 1) */
    skippy_deferred_inputs deferred;             /* inputs to fill from earlier plans' outputs */
    uint8_t *new_rows;                           /* 1 when the row is its sequence's first since
                                                    admission (a first admission or a resume
                                                    after preemption), else 0 */
    size_t *restored_tokens;                     /* new rows: tokens [0, n) of the sequence the
                                                    host must already hold before the row (a
                                                    prefix restore, or a caller-set cursor); 0
                                                    for every other row */
} skippy_plan;
