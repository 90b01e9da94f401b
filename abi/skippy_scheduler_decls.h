/* Scheduler C API declarations (directive-free; included by skippy_scheduler.h). */

/* Precise outcome of a scheduler call (skippy_scheduler_last_code). */
typedef enum skippy_sched_code {
    SKIPPY_SCHED_OK = 0,
    SKIPPY_SCHED_QUEUE_FULL = 1,     /* waiting queue at max_waiting_sequences */
    SKIPPY_SCHED_DUPLICATE = 2,      /* id already waiting or active */
    SKIPPY_SCHED_EMPTY_PROMPT = 3,   /* prompt has no token */
    SKIPPY_SCHED_INVALID = 4,        /* an argument value is out of its domain */
    SKIPPY_SCHED_STALE_PLAN = 5,     /* the plan was completed or replaced */
    SKIPPY_SCHED_BAD_OUTPUTS = 6,    /* malformed sampled outputs (count, index, repeat, row) */
    SKIPPY_SCHED_NO_MEMORY = 7,      /* allocation failed */
    SKIPPY_SCHED_CALLBACK = 8,       /* a policy callback reported failure */
    SKIPPY_SCHED_PLAN_IN_FLIGHT = 9  /* max_inflight_plans are live, or completion out of order */
} skippy_sched_code;

/* Sequence status. CANCELLED only appears in retired records. */
typedef enum skippy_seq_status {
    SKIPPY_SEQ_WAITING = 0,
    SKIPPY_SEQ_RUNNING = 1,
    SKIPPY_SEQ_PREEMPTED = 2,
    SKIPPY_SEQ_FINISHED = 3,
    SKIPPY_SEQ_FAILED = 4,
    SKIPPY_SEQ_CANCELLED = 5
} skippy_seq_status;

/* Built-in admission orders; CALLBACK asks the rank callback. */
typedef enum skippy_admission_policy {
    SKIPPY_ADMISSION_CACHE_AWARE = 0,  /* priority, cache value + aging, prefix grouping */
    SKIPPY_ADMISSION_FCFS = 1,         /* enqueue order only */
    SKIPPY_ADMISSION_PRIORITY = 2,     /* priority, then enqueue order */
    SKIPPY_ADMISSION_CALLBACK = 3,
    SKIPPY_ADMISSION_FAIR_SHARE = 4    /* per-tenant service counters; cache-aware within a tenant */
} skippy_admission_policy;

/* Built-in preemption victim rules; CALLBACK asks the victim callback. */
typedef enum skippy_preemption_policy {
    SKIPPY_PREEMPT_LOWEST_PRIORITY_NEWEST = 0,
    SKIPPY_PREEMPT_FEWEST_COMPUTED = 1,
    SKIPPY_PREEMPT_CALLBACK = 2
} skippy_preemption_policy;

typedef struct skippy_memory_component {
    const char *name;             /* NUL-terminated; copied at create */
    uint64_t capacity_bytes;      /* pool size */
    uint64_t resident_bytes;      /* taken by resident state outside the scheduler */
    uint64_t bytes_per_token;     /* reserved per admission token */
    uint64_t bytes_per_sequence;  /* reserved once per sequence */
} skippy_memory_component;

/* How a plan is filled when prefill and decode both wait (docs/behaviour.md §2.13). */
typedef enum skippy_planning_rule {
    SKIPPY_PLANNING_REFERENCE = 0,  /* the reference: homogeneous plans, mixed gate of §2.6 */
    SKIPPY_PLANNING_SLACK = 1       /* chunks sized from the tightest decode slack (§2.13) */
} skippy_planning_rule;

/* Predicted step time (µs) = base_us + per_prefill_token_us * prefill and recompute tokens
 * + per_prefill_row_us * max(prefill rows - 1, 0) + per_prefill_position_us * (sum of the
 * prefill and recompute tokens' positions) / 1000 + [any decode row] (decode_base_us +
 * per_decode_row_us * decode rows): the slack rule's cost model (§2.13), the shape of the
 * lab's runtime cost model (§5.3) plus a pass per extra prefill sequence and the attention
 * each prefill token pays for the context before it. */
typedef struct skippy_step_cost {
    double base_us;
    double per_prefill_token_us;
    double decode_base_us;
    double per_decode_row_us;
    double per_prefill_row_us; /* each prefill or recompute row after the first */
    double per_prefill_position_us; /* per prefill token per 1000 positions before it */
} skippy_step_cost;

/* Configuration; skippy_scheduler_config_default fills the defaults. SIZE_MAX = unbounded. */
typedef struct skippy_scheduler_config {
    size_t max_active_sequences;                 /* default 32 */
    size_t sequence_id_limit;                    /* default 256: holder ids (active + prefixes) */
    size_t reserved_sequence_ids;                /* default 16 */
    size_t max_waiting_sequences;                /* default 256 */
    size_t max_tokens_per_iteration;             /* default 2048 */
    size_t prefill_chunk_tokens;                 /* default 256 */
    size_t max_prefill_sequences_per_iteration;  /* default SIZE_MAX */
    size_t max_consecutive_prefill_iterations;   /* default SIZE_MAX */
    uint64_t cache_aging_cost_per_iteration;     /* default 4096 cost units per turn; 0 = no aging */
    bool mixed_prefill_decode;                   /* default false */
    bool group_waiting_prefixes;                 /* default true */
    uint32_t admission_policy;                   /* skippy_admission_policy */
    uint32_t preemption_policy;                  /* skippy_preemption_policy */
    const skippy_memory_component *memory_components;
    size_t memory_component_count;
    size_t max_inflight_plans;                   /* default 1 (1..255): plans live at once */
    double fair_prefill_cost;                    /* default 1.0: FAIR_SHARE charge per prefill or
                                                    recompute token (finite, >= 0) */
    double fair_decode_cost;                     /* default 2.0: FAIR_SHARE charge per decode token */
    bool priority_preemption;                    /* default false: a waiting sequence of strictly
                                                    higher priority that cannot be admitted
                                                    preempts lower-priority running ones (§2.8a) */
    size_t priority_preemption_guard_steps;      /* default 8: plans during which a sequence
                                                    preempted for priority is not again */
    size_t max_priority_preemptions_per_step;    /* default 4: priority victims per plan */
    uint32_t planning_rule;                      /* skippy_planning_rule: default REFERENCE */
    double itl_target_us;                        /* default 100000: inter-token target T (SLACK) */
    double slack_safety;                         /* default 1.2: predicted step time factor */
    size_t slack_interleave_max;                 /* default 4: decode-only steps in a row while
                                                    prefill waits (k) */
    size_t slack_min_chunk_tokens;               /* default 32: the smallest useful chunk */
    skippy_step_cost step_cost;                  /* initial cost model (skippy_scheduler_set_step_cost) */
    bool disjoint_inflight_plans;                /* default false: a sequence with a row in a
                                                    live plan gets none in the next (§2.11a) */
    size_t cold_prefix_hold_tokens;              /* default 0 = off: with a prefix store, a
                                                    waiting sequence sharing this many prompt
                                                    tokens past its restore with a running
                                                    leader's cold prompt waits for it (§2.3a) */
    size_t cold_prefix_hold_max_steps;           /* default 64: plans one sequence is held at most */
    double slack_prefill_age_max_us;             /* default 2000000: under the slack rule, prefill
                                                    runs fewest remaining tokens first, but a
                                                    sequence submitted this long ago (clock µs;
                                                    with a first-token deadline still to meet,
                                                    this long past the deadline) goes first in
                                                    walk order; 0 = walk order (§2.13; finite,
                                                    >= 0) */
    bool slack_first_token_hold;                 /* default false: under the slack rule, while
                                                    the prefill that waits is pressed for its
                                                    first-token deadlines, a prompt far from its
                                                    own deadline keeps its last token back (no
                                                    decode rows of its own yet), released near
                                                    the deadline beside the decode rows (§2.13) */
} skippy_scheduler_config;

/* What submit copies from the caller (nothing is borrowed after the call). */
typedef struct skippy_sequence_desc {
    const char *id;                            /* id bytes (UTF-8), not necessarily NUL-ended */
    size_t id_len;
    const int32_t *prompt_tokens;              /* >= 1 token, each >= 0 */
    size_t prompt_count;
    const int32_t *generated_tokens;           /* already generated (last = pending decode) */
    size_t generated_count;
    uint32_t max_tokens;                       /* generation limit, checked after each new
                                                  token: a sequence always gets one more (0
                                                  acts as 1, and one submitted with as many
                                                  already generated gets one) */
    uint64_t priority;                         /* higher runs first */
    size_t admission_tokens;                   /* tokens reserved at admission */
    uint32_t status;                           /* skippy_seq_status, kept as given */
    size_t prefill_cursor;                     /* tokens already in the runtime's cache
                                                  (clamped: the pending token always runs) */
    bool has_prefix_restore;                   /* a restored prefix backs the sequence */
    size_t restore_token_count;                /* tokens the restore covers */
    uint64_t saved_cost;                       /* cache affinity's estimated saved cost */
    const skippy_sampling_config *sampling;    /* copied by pointer into each row */
    struct skippy_session *session;            /* copied by pointer into each row */
    uint32_t tenant;                           /* FAIR_SHARE: whose service it is (default 0) */
    double itl_target_us;                      /* its inter-token target (SLACK); 0 = config's */
    double ttft_deadline_us;                   /* first-token deadline on the scheduler clock;
                                                  0 = none (carried; admission does not read it
                                                  yet) */
} skippy_sequence_desc;

/* Read-only view of one sequence (pointers valid until the next mutating call). */
typedef struct skippy_sequence_info {
    const char *id;
    size_t id_len;
    const int32_t *tokens;                     /* prompt followed by generated tokens */
    size_t prompt_count;
    size_t generated_count;
    uint32_t max_tokens;
    uint64_t priority;
    size_t admission_tokens;
    uint32_t status;                           /* skippy_seq_status */
    size_t prefill_cursor;
    bool has_prefix_restore;
    size_t restore_token_count;
    uint64_t enqueued_turn;
    uint64_t enqueue_order;
    uint64_t admitted_at;                      /* admission counter; 0 = not admitted */
    uint64_t saved_cost;
    const skippy_sampling_config *sampling;
    struct skippy_session *session;
    uint32_t restore_entry;                    /* prefix store entry backing the restore, or
                                                  SKIPPY_PREFIX_NONE (attached store only) */
    uint32_t restore_holder;                   /* that entry's holder id (SKIPPY_PREFIX_NONE) */
    uint64_t cache_epoch;                      /* store epoch the affinity was read at */
    uint32_t tenant;
    double itl_target_us;                      /* as submitted (0 = the config's) */
    double ttft_deadline_us;                   /* as submitted (0 = none) */
    double last_token_us;                      /* clock at its last token or admission (SLACK) */
} skippy_sequence_info;

/* Cumulative counters. */
typedef struct skippy_scheduler_metrics {
    uint64_t iterations;
    uint64_t admitted;
    uint64_t preempted;
    uint64_t finished;
    uint64_t failed;
    uint64_t cancelled;
    uint64_t rejected_overload;
    uint64_t prefill_tokens;
    uint64_t recompute_tokens;
    uint64_t decode_tokens;
    uint64_t prefix_hits;
    uint64_t prefix_misses;
    uint64_t active_sequences;
    uint64_t waiting_sequences;
    uint64_t discarded_rows;   /* sampling rows completed after their sequence ended or lost its rows */
    uint64_t aborted_plans;    /* plans undone by skippy_scheduler_abort (or replaced at depth 1) */
    uint64_t restored_tokens;  /* prompt tokens admitted as prefix restores (attached store) */
    uint64_t stale_refreshes;  /* waiting affinities re-scored from the attached store (§2.12) */
    uint64_t preempted_priority; /* of `preempted`, those made for priority (§2.8a); the rest
                                    were made for memory */
    uint64_t slo_relegated;    /* sequences a slack-rule prefill order put behind because their
                                  first-token deadline could no longer be met (§2.13), once each */
} skippy_scheduler_metrics;

/* Per-completion figures (component arrays: see skippy_scheduler_component_used). */
typedef struct skippy_iteration_telemetry {
    uint64_t iteration;
    uint64_t active_sequences;
    uint64_t waiting_sequences;
    uint64_t admitted;
    uint64_t preempted;
    uint64_t prefill_tokens;
    uint64_t recompute_tokens;
    uint64_t decode_tokens;
    uint64_t prefix_hits;
    uint64_t prefix_misses;
    uint64_t finished;
    uint64_t failed;
    uint64_t cancelled;
    uint64_t rejected_overload;
    uint64_t stale_refreshes;  /* cumulative, as the metric */
} skippy_iteration_telemetry;

/* Why a sequence left the scheduler (skippy_retired.reason). */
typedef enum skippy_end_reason {
    SKIPPY_END_STOP = 0,       /* the host sampled an end token (a negative token) */
    SKIPPY_END_LENGTH = 1,     /* max_tokens generated tokens were reached */
    SKIPPY_END_FAILED = 2,     /* a sampling row got no output, or the token could not be kept */
    SKIPPY_END_CANCELLED = 3   /* skippy_scheduler_cancel removed it */
} skippy_end_reason;

/* A sequence that left the scheduler (finished, failed, cancelled); see skippy_scheduler_retired. */
typedef struct skippy_retired {
    uint32_t slot;    /* readable with skippy_scheduler_sequence until the next plan */
    uint32_t status;  /* SKIPPY_SEQ_FINISHED, _FAILED or _CANCELLED */
    uint32_t reason;  /* skippy_end_reason */
} skippy_retired;

typedef struct skippy_scheduler skippy_scheduler;

/* Slow-path policy hooks: return 0 on success, anything else aborts the call. */
typedef int (*skippy_rank_callback)(void *ctx, const skippy_scheduler *scheduler,
                                    const uint32_t *waiting_slots, size_t count,
                                    uint64_t current_turn, size_t *out_order);
typedef int (*skippy_victim_callback)(void *ctx, const skippy_scheduler *scheduler,
                                      const uint32_t *active_slots, size_t count,
                                      size_t *out_index);

skippy_version skippy_scheduler_abi_version(void);
uint32_t skippy_scheduler_plan_abi_version(void);
/* Frees an error object this library returned (never one of the runtime's: that one goes to the
 * runtime's own skippy_error_free, which this library does not define, so that a host links
 * both). */
void skippy_scheduler_error_free(skippy_error *error);

void skippy_scheduler_config_default(skippy_scheduler_config *config);
void skippy_scheduler_config_normalize(skippy_scheduler_config *config);
void skippy_sequence_desc_init(skippy_sequence_desc *desc, const char *id, size_t id_len,
                               const int32_t *prompt_tokens, size_t prompt_count,
                               uint32_t max_tokens);

skippy_status skippy_scheduler_create(const skippy_scheduler_config *config,
                                      skippy_scheduler **out_scheduler, skippy_error **out_error);
void skippy_scheduler_free(skippy_scheduler *scheduler);
const skippy_scheduler_config *skippy_scheduler_get_config(const skippy_scheduler *scheduler);
/* The outcome of the last call that reports through it (see skippy_scheduler.h): OK and ""
 * after one that did not fail. A NULL scheduler gives SKIPPY_SCHED_INVALID and a fixed message
 * ("scheduler is NULL"). */
skippy_sched_code skippy_scheduler_last_code(const skippy_scheduler *scheduler);
const char *skippy_scheduler_last_message(const skippy_scheduler *scheduler);
void skippy_scheduler_set_callbacks(skippy_scheduler *scheduler, skippy_rank_callback rank,
                                    skippy_victim_callback victim, void *ctx);

skippy_status skippy_scheduler_submit(skippy_scheduler *scheduler,
                                      const skippy_sequence_desc *desc, uint32_t *out_slot,
                                      skippy_error **out_error);
skippy_status skippy_scheduler_plan(skippy_scheduler *scheduler, skippy_plan **out_plan,
                                    skippy_error **out_error);
skippy_status skippy_scheduler_observe(skippy_scheduler *scheduler, uint64_t plan_serial,
                                       double elapsed_us, skippy_error **out_error);
skippy_status skippy_scheduler_complete(skippy_scheduler *scheduler, uint64_t plan_serial,
                                        skippy_iteration_telemetry *out_telemetry,
                                        skippy_error **out_error);
skippy_status skippy_scheduler_abort(skippy_scheduler *scheduler, uint64_t plan_serial,
                                     skippy_error **out_error);
bool skippy_scheduler_plan_live(const skippy_scheduler *scheduler, uint64_t plan_serial);
size_t skippy_scheduler_live_plans(const skippy_scheduler *scheduler);
uint64_t skippy_scheduler_oldest_plan(const skippy_scheduler *scheduler);  /* serial; 0 = none */
skippy_status skippy_scheduler_preempt(skippy_scheduler *scheduler, const uint64_t *used_bytes,
                                       size_t used_count, size_t *out_preempted,
                                       skippy_error **out_error);
/* The slots the last successful skippy_scheduler_preempt chose, *out_preempted of them, in the
 * order chosen (valid until the next preempt; a failed one leaves them as they were). */
const uint32_t *skippy_scheduler_preempted_slots(const skippy_scheduler *scheduler);
/* The slots the last plan's admission preempted for priority (§2.8a), in the order chosen; the
 * count goes to *out_count (valid until the next plan). */
const uint32_t *skippy_scheduler_priority_victims(const skippy_scheduler *scheduler,
                                                  size_t *out_count);
/* Cold prefix hold (§2.3a): the slots of the leaders held on (a waiting sequence was held on
 * each) that have confirmed a token since their admission, not yet returned (their prompts
 * are computed): the host keeps each one's prompt as a resident prefix. Fills at most `cap` slots into `out` and returns how many; each leader once. */
size_t skippy_scheduler_take_prompt_keeps(skippy_scheduler *scheduler, uint32_t *out,
                                          size_t cap);
/* true when the sequence was cancelled; false for an id neither waiting nor active (last_code
 * SKIPPY_SCHED_OK) or on a failure (last_code SKIPPY_SCHED_INVALID for a NULL id with a
 * non-zero length, SKIPPY_SCHED_NO_MEMORY; nothing changed). */
bool skippy_scheduler_cancel(skippy_scheduler *scheduler, const char *id, size_t id_len);

/* The slot of the waiting or active sequence with this id, else SKIPPY_PREFIX_NONE. */
uint32_t skippy_scheduler_find(const skippy_scheduler *scheduler, const char *id, size_t id_len);
bool skippy_scheduler_sequence(const skippy_scheduler *scheduler, uint32_t slot,
                               skippy_sequence_info *out_info);
const skippy_scheduler_metrics *skippy_scheduler_get_metrics(const skippy_scheduler *scheduler);
const uint32_t *skippy_scheduler_active_slots(const skippy_scheduler *scheduler, size_t *out_count);
const uint32_t *skippy_scheduler_waiting_slots(const skippy_scheduler *scheduler, size_t *out_count);
const uint64_t *skippy_scheduler_component_used(const skippy_scheduler *scheduler,
                                                size_t *out_count);
const skippy_retired *skippy_scheduler_retired(const skippy_scheduler *scheduler,
                                               size_t *out_count);
uint64_t skippy_scheduler_waiting_turn(const skippy_scheduler *scheduler);
bool skippy_scheduler_mixed_viable(const skippy_scheduler *scheduler);
/* The slack rule (§2.13): the time now on the caller's clock (µs), read by the next plan and
 * stamped on the sequences the next completion gives a token (call it before both; a value
 * that is not finite, NaN or an infinity, is ignored: the clock keeps its last value); and the
 * cost model, refitted by the caller (finite values >= 0, else SKIPPY_SCHED_INVALID; NULL is
 * SKIPPY_SCHED_INVALID too). */
void skippy_scheduler_set_clock(skippy_scheduler *scheduler, double now_us);
skippy_status skippy_scheduler_set_step_cost(skippy_scheduler *scheduler,
                                             const skippy_step_cost *cost,
                                             skippy_error **out_error);

/* ---------------------------------------------------------------- prefix store (§8c) */

/*
 * Which token prefixes have KV resident in the runtime, under a capacity in tokens and in
 * holder slots. An entry is a segment that extends its parent entry (or starts the prompt); it
 * costs the tokens of its own segment. Pinned entries and entries with resident children are
 * never evicted; otherwise the least recently used entry goes first. Each entry takes a holder
 * id from [first_holder_id, first_holder_id + holder_slots) when holder_slots is bounded (for a
 * llama.cpp host: the sequence ids the scheduler reserves), else its holder is NONE.
 * Calls that can fail return a skippy_sched_code and change nothing when they fail, except an
 * insert that runs out of memory after evicting (skippy_prefix_store_evicted lists what went).
 */
/* SKIPPY_PREFIX_NONE (0xFFFFFFFF, skippy_scheduler.h): no entry / no holder. */
typedef struct skippy_prefix_store skippy_prefix_store;

typedef struct skippy_prefix_store_config {
    uint64_t capacity_tokens;  /* UINT64_MAX = unbounded */
    size_t holder_slots;       /* SIZE_MAX = unbounded (no holder ids then) */
    uint32_t first_holder_id;
} skippy_prefix_store_config;

typedef struct skippy_prefix_entry_info {
    uint32_t parent;           /* SKIPPY_PREFIX_NONE for a first segment */
    uint32_t holder;
    size_t start;              /* parent's key length */
    size_t length;             /* full key length */
    uint32_t pins;
    uint32_t children;         /* resident child entries */
    uint64_t last_used;
    uint64_t serial;           /* insert order, from 1 */
    uint64_t handle;           /* the caller's value */
    const int32_t *segment;    /* tokens [start, length) of the key; valid until the next write */
} skippy_prefix_entry_info;

typedef struct skippy_prefix_store_stats {
    uint64_t used_tokens;
    uint64_t entries;
    uint64_t inserts;
    uint64_t evictions;
    uint64_t evicted_tokens;
    uint64_t refused_inserts;  /* inserts no room could be made for */
    uint64_t epoch;            /* bumped by every insert and eviction, never by reads */
} skippy_prefix_store_stats;

/* One eviction of the last writing call (insert, evict_one): what the host must free. */
typedef struct skippy_prefix_eviction {
    uint32_t entry;
    uint32_t holder;
    uint64_t handle;
    size_t start;
    size_t length;
} skippy_prefix_eviction;

void skippy_prefix_store_config_default(skippy_prefix_store_config *config);
skippy_sched_code skippy_prefix_store_create(const skippy_prefix_store_config *config,
                                             skippy_prefix_store **out_store);
/* Frees the store; a scheduler it is attached to is detached first. */
void skippy_prefix_store_free(skippy_prefix_store *store);
/* Why the last failing call failed ("prefix store is NULL" for a NULL store). */
const char *skippy_prefix_store_last_message(const skippy_prefix_store *store);
/* Longest resident prefix of tokens (a read: no recency change). Returns the entry that backs
 * it (SKIPPY_PREFIX_NONE on a miss) and the matched token count in *out_matched. */
uint32_t skippy_prefix_store_match(const skippy_prefix_store *store, const int32_t *tokens,
                                   size_t count, size_t *out_matched);
/* The entry whose key is exactly tokens, or SKIPPY_PREFIX_NONE. */
uint32_t skippy_prefix_store_find(const skippy_prefix_store *store, const int32_t *tokens,
                                  size_t count);
/* Makes tokens[0..count) resident as a segment after parent (whose key must be its prefix).
 * *out_entry: the new entry, the existing one if the key is resident (touched), or
 * SKIPPY_PREFIX_NONE when no room could be made (nothing changed; returns OK). */
skippy_sched_code skippy_prefix_store_insert(skippy_prefix_store *store, const int32_t *tokens,
                                             size_t count, uint32_t parent, uint64_t handle,
                                             uint32_t *out_entry);
skippy_sched_code skippy_prefix_store_touch(skippy_prefix_store *store, uint32_t entry);
skippy_sched_code skippy_prefix_store_pin(skippy_prefix_store *store, uint32_t entry);
skippy_sched_code skippy_prefix_store_unpin(skippy_prefix_store *store, uint32_t entry);
/* Evicts the least recently used evictable entry; SKIPPY_PREFIX_NONE when none is. */
uint32_t skippy_prefix_store_evict_one(skippy_prefix_store *store);
/* What the last insert or evict_one that passed its checks evicted (a refused call, INVALID,
 * leaves the list as it was). */
const skippy_prefix_eviction *skippy_prefix_store_evicted(const skippy_prefix_store *store,
                                                          size_t *out_count);
bool skippy_prefix_store_entry(const skippy_prefix_store *store, uint32_t entry,
                               skippy_prefix_entry_info *out_info);
/* Full key of a resident entry into dst (room for its length); false if not resident. */
bool skippy_prefix_store_key(const skippy_prefix_store *store, uint32_t entry, int32_t *dst);
void skippy_prefix_store_get_stats(const skippy_prefix_store *store,
                                   skippy_prefix_store_stats *out_stats);
/* Evictable entries, next victim first, into out (room for stats.entries); returns the count. */
size_t skippy_prefix_store_lru_order(const skippy_prefix_store *store, uint32_t *out);

/*
 * Attaches a store to a scheduler (NULL detaches): from then on the core reads every waiting
 * sequence's prefix restore and saved cost from the store — at submit, and again immediately
 * before each admission selection for the sequences whose prompt lies under a prefix that was
 * inserted or evicted since they were last read (stale refresh, §2.12) — and pins the entry a
 * sequence is admitted with until the sequence leaves the active set. saved cost = matched x
 * prefill_cost_per_token - matched x restore_cost_per_token (saturating, at least 0). Only while
 * the scheduler holds no sequence, and a store serves one scheduler at a time (else INVALID).
 */
skippy_status skippy_scheduler_set_prefix_store(skippy_scheduler *scheduler,
                                                skippy_prefix_store *store,
                                                uint64_t prefill_cost_per_token,
                                                uint64_t restore_cost_per_token,
                                                skippy_error **out_error);
skippy_prefix_store *skippy_scheduler_prefix_store(const skippy_scheduler *scheduler);
/* Fair share (SKIPPY_ADMISSION_FAIR_SHARE; see docs/behaviour.md §3.6). A tenant's weight
 * divides every charge to its counter (default 1.0); INVALID for a weight that is not a finite
 * number > 0 or a scheduler of another admission policy. The counter of a tenant the scheduler
 * has not seen is 0; lifts counts the times a returning tenant was raised to the floor. */
skippy_status skippy_scheduler_set_tenant_weight(skippy_scheduler *scheduler, uint32_t tenant,
                                                 double weight, skippy_error **out_error);
double skippy_scheduler_tenant_counter(const skippy_scheduler *scheduler, uint32_t tenant);
uint64_t skippy_scheduler_fair_share_lifts(const skippy_scheduler *scheduler);
