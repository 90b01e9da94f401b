/*
 * Private state of the scheduler core. Everything lives in flat arrays owned by one
 * skippy_scheduler: sequence slots (each with one token buffer: prompt then generated tokens),
 * an id -> slot hash index, the waiting queue and active set as slot arrays, and the plan's
 * struct-of-arrays. Arrays grow geometrically and are never shrunk, so a scheduler in steady
 * state does not allocate.
 */
#ifndef SK_INTERNAL_H
#define SK_INTERNAL_H

#include <stdint.h>
#include <stddef.h>

#include "skippy_scheduler.h"
#include "sk_error.h"
#include "sk_grow.h"
#include "sk_rank.h"
#include "sk_sat.h"

#define SK_NO_SLOT UINT32_MAX
#define SK_MAX_INFLIGHT_PLANS 255  /* sk_seq.pending is one byte */

/* Where a slot's sequence currently is. */
enum { SK_WHERE_FREE = 0, SK_WHERE_WAITING = 1, SK_WHERE_ACTIVE = 2, SK_WHERE_RETIRED = 3 };

/*
 * NOTE: the fields a plan or a completion touches for every row come first and fit one 64-byte
 * cache line; the slot array is 64-byte aligned (sk_store.c). `last` and `room` spare a decode
 * row from reading the token buffer: its tail sits on a different page for every sequence, and
 * planning only ever needs the pending token from it (completion still appends there).
 */
#define SK_SEQ_ALIGN 64
#if defined(__GNUC__) || defined(__clang__)
#define SK_LINE_ALIGNED __attribute__((aligned(SK_SEQ_ALIGN)))
#else
#define SK_LINE_ALIGNED
#endif

typedef struct SK_LINE_ALIGNED sk_seq {
    /* hot: read or written for every row of every plan */
    int32_t *tokens;          /* prompt_len prompt tokens, then gen_len generated tokens */
    size_t prompt_len;
    size_t gen_len;
    size_t cursor;            /* replay tokens already fed to the runtime */
    const skippy_sampling_config *sampling;
    struct skippy_session *session;
    uint32_t max_tokens;
    uint32_t room;            /* token_cap - prompt_len - gen_len, saturated at UINT32_MAX */
    int32_t last;             /* = tokens[prompt_len + gen_len - 1], the pending decode token */
    uint8_t where;            /* SK_WHERE_* */
    /* cold */
    uint8_t status;           /* skippy_seq_status */
    bool has_restore;
    /* hot again: samples of this sequence in live plans whose tokens have not arrived yet; the
     * history the planner sees is prompt + gen_len confirmed + pending placeholders (§2.11) */
    uint8_t pending;
    size_t token_cap;
    char *id;                 /* id bytes + NUL (own buffer, reused across occupants) */
    size_t id_len;
    size_t id_cap;
    uint64_t id_hash;
    uint64_t priority;
    size_t admission_tokens;
    size_t restore_tokens;
    uint64_t enqueued_turn;
    uint64_t enqueue_order;
    uint64_t admitted_at;     /* admission counter value, 0 = not admitted */
    uint64_t saved_cost;
    uint32_t rank_handle;     /* in s->rank_set while waiting (when there is one) */
    uint32_t epoch;           /* changes when rows planned so far become void (preempt, retire) */
    uint64_t source_step;     /* depth > 1: the plan step and work index that sample the newest */
    size_t source_row;        /*   pending placeholder (the input of the next decode row) */
    /* with an attached prefix store (sk_affinity.c) */
    uint32_t pinned_entry;    /* the entry pinned while active (SKIPPY_PREFIX_NONE) */
    uint64_t cache_epoch;     /* store epoch at the last read */
    uint32_t probe_round;     /* refresh dedup stamp */
    uint32_t tenant;          /* as submitted; fair share keeps its own per-slot state (sk_fair.c) */
    bool fresh;               /* active with no row planned since its admission (new_rows) */
    uint64_t prio_preempted_at; /* plan step + 1 of its last preemption for priority, 0 = none */
    /* the slack rule (sk_slack.c, §2.13) and the first-token deadline (carried only) */
    double itl_target_us;     /* 0 = cfg.itl_target_us */
    double ttft_deadline_us;  /* 0 = none */
    double last_token_us;     /* s->now_us at its last token, or at its admission */
    double submitted_us;      /* s->now_us at its submit, kept across preemption (§2.13) */
    /* disjoint_inflight_plans (sk_plan.c, sk_live.c): serial of the last plan with a row of it
     * (0 = none); while that plan is live the sequence is in flight. */
    uint64_t flight_serial;
    /* cold prefix hold (sk_hold.c, §2.3a) */
    uint32_t held_steps;      /* plans it was held while waiting (since submit or preemption) */
    uint64_t held_walk;       /* the admission walk (admit_walks) that last held it, 0 = none */
    uint8_t lead;             /* SK_LEAD_*: held on while active (reset at admission) */
    bool no_lead;             /* admitted after a hold that gained it nothing: leads nobody */
    size_t lead_base;         /* gen_len when first held on (read while lead != NONE) */
    size_t admit_gen;         /* gen_len at its admission */
    size_t held_restore;      /* its restore when last held */
    uint32_t held_on;         /* the slot of its leader when last held, */
    uint64_t held_on_admitted; /*   and that leader's admitted_at (the slot may be reused) */
    bool slo_relegated;       /* a prefill order put it behind for its deadline (§2.13, counted once) */
} sk_seq;

/* A leader's state under the cold prefix hold (sk_hold.c). */
enum { SK_LEAD_NONE = 0, SK_LEAD_HELD_ON = 1, SK_LEAD_REPORTED = 2 };

/*
 * One of the max_inflight_plans plan buffers. NOTE: its new_rows and restored_tokens arrays are
 * zero except at the rows listed in new_list, which the next plan made in the buffer clears: new
 * rows are rare, so a steady plan writes neither array. Besides the public plan it keeps what
 * completing and aborting need: the tokens per phase, each row's cursor before the row, the epoch of its
 * sequence, (depth > 1) the sequence's previous pending source, and the planner counters from
 * before the plan.
 */
typedef struct sk_plan_slot {
    skippy_plan plan;
    bool live;
    uint64_t tokens_by_phase[3];
    size_t *row_cursor;
    uint32_t *row_epoch;
    uint64_t *row_prev_step;
    size_t *row_prev_row;
    size_t *new_list;         /* the rows new_rows / restored_tokens hold nonzero entries for */
    size_t new_count;
    size_t consecutive_before;
    size_t mixed_before;
    size_t interleaved_before;
    uint64_t void_mark;       /* s->void_count when made: equal at completion = no row is void */
} sk_plan_slot;

struct skippy_scheduler {
    skippy_scheduler_config cfg;          /* normalized; memory_components -> comps */
    skippy_memory_component *comps;
    uint64_t *used;                       /* bytes reserved (or measured) per component */
    uint64_t *available;                  /* capacity - resident per component */
    uint64_t *used_scratch;               /* trial usage while choosing victims */

    sk_seq *seqs;                         /* SK_SEQ_ALIGN-aligned inside seqs_raw */
    void *seqs_raw;
    uint32_t seq_cap;
    uint32_t *free_slots;
    uint32_t free_len;

    uint32_t *map;                        /* open addressing: slot + 1, 0 empty, ~0 tombstone */
    size_t map_cap;                       /* power of two */
    size_t map_fill;                      /* live + tombstones */

    uint32_t *waiting;
    size_t waiting_len;
    size_t waiting_cap;
    uint32_t *scratch;                    /* waiting_cap entries: deferred list, permutations */

    uint32_t *active;                     /* admission (walk) order */
    size_t active_len;
    size_t active_cap;

    skippy_retired *retired;
    size_t retired_len;
    size_t retired_cap;

    uint32_t *victims;
    size_t victim_len;
    size_t victim_cap;
    uint32_t *prio_victims;               /* this plan's victims of preemption for priority */
    size_t prio_victim_cap;
    size_t prio_victim_len;               /* of the last admission pass (the plan's preempted) */

    skippy_scheduler_metrics m;
    size_t consecutive_prefill;
    uint64_t waiting_turn;
    uint64_t next_order;
    uint64_t admit_counter;
    bool dirty;

    double *ewma;                         /* decode-only EWMA (µs) by decode row count; NaN = none */
    size_t ewma_cap;
    bool mixed_viable;
    size_t mixed_cursor;
    double now_us;                        /* skippy_scheduler_set_clock (slack rule, §2.13) */
    skippy_step_cost cost;                /* skippy_scheduler_set_step_cost */
    size_t interleaved;                   /* decode-only plans in a row while prefill waited */
    struct sk_prefill_key *prefill_keys;  /* the slack rule's prefill order (sk_prefill_order.c) */
    uint32_t *prefill_edf;                /* of prefill_keys_cap: the deadline pass's order */
    size_t prefill_keys_cap;
    size_t prefill_keys_len;
    size_t leaders;                       /* leaders marked and not yet reported (sk_hold.c) */
    uint64_t admit_walks;                 /* admission walks made (sk_admit.c), for held_walk */

    size_t n_class[3];                    /* active sequences per SK_CLASS_* (see sk_class) */
    size_t fresh_count;                   /* active sequences with `fresh` set */

    sk_plan_slot *plans;                  /* cfg.max_inflight_plans buffers (a ring) */
    size_t live_head;                     /* ring index of the oldest live plan */
    size_t live_count;                    /* live plans: live_head, live_head + 1, ... */
    uint64_t plan_serial;                 /* serial of the last plan made (0 = none) */
    uint64_t void_count;                  /* bumped whenever a sequence's planned rows go void */
    uint8_t *row_seen;                    /* row_scratch_cap scratch for output validation */
    int32_t *row_token;
    size_t row_scratch_cap;
    void **moved_blocks;                  /* plan arrays' blocks before they grew (sk_plan.c) */
    size_t moved_len, moved_cap;

    sk_rank_set *rank_set;                /* waiting sequences, for grouped cache-aware ranking */
    uint32_t *rank_slot;                  /* rank_set handle -> slot */
    size_t rank_slot_cap;
    sk_rank_ws *rank_ws;                  /* the other built-in policies: one-shot ranking */
    sk_rank_item *rank_items;
    size_t *rank_out;                     /* permutation from sk_rank_order or a user policy */
    size_t rank_cap;
    struct sk_fair *fair;                 /* SKIPPY_ADMISSION_FAIR_SHARE only (sk_fair.h) */

    bool rank_by_set;                     /* rank_set orders the queue (else it only indexes it) */

    skippy_prefix_store *store;           /* attached prefix store (sk_affinity.c) or NULL */
    uint64_t aff_prefill_cost;            /* cost units per matched token */
    uint64_t aff_restore_cost;            /* cost units per restored token */
    uint64_t store_epoch_seen;            /* store epoch the waiting affinities reflect */
    uint32_t probe_round;
    uint32_t *under;                      /* rank_set handles under a changed prefix */
    uint32_t *resumers;                   /* slots of the ranked set's members with generated
                                           * tokens (their match reads past the prompt) */
    size_t resumers_len, resumers_cap;
    size_t under_cap;

    skippy_rank_callback rank_cb;
    skippy_victim_callback victim_cb;
    void *cb_ctx;

    skippy_sched_code code;
    char message[256];
};

/* sk_store.c: slots and the id index */
int sk_store_init(skippy_scheduler *s);
void sk_store_free(skippy_scheduler *s);
uint64_t sk_hash_id(const char *id, size_t len);
uint32_t sk_store_find(const skippy_scheduler *s, const char *id, size_t len, uint64_t hash);
int sk_store_reserve(skippy_scheduler *s);          /* makes sure one slot and one index entry are free */
uint32_t sk_store_take(skippy_scheduler *s);        /* pops a free slot (after sk_store_reserve) */
void sk_store_index(skippy_scheduler *s, uint32_t slot);
void sk_store_unindex(skippy_scheduler *s, uint32_t slot);
void sk_store_release(skippy_scheduler *s, uint32_t slot);

/* sk_waiting.c: the waiting queue's ranking (sk_waiting_add/remove are no-ops unless the
 * policy keeps a ranked set; add returns -1 on out of memory and then changes nothing) */
int sk_waiting_init(skippy_scheduler *s);
void sk_waiting_free(skippy_scheduler *s);
int sk_waiting_add(skippy_scheduler *s, uint32_t slot, uint64_t order);
void sk_waiting_remove(skippy_scheduler *s, uint32_t slot);
int sk_waiting_rank(skippy_scheduler *s);

/* sk_affinity.c: the attached prefix store (no-ops without one). read_new fills a submitted
 * or preempted sequence's restore from the store; refresh re-reads the waiting sequences under
 * changed prefixes (before admission); pin / unpin bracket a sequence's time in the active
 * set. Only refresh can fail (out of memory), and then changes nothing it has not finished. */
void sk_affinity_read(skippy_scheduler *s, sk_seq *seq);
int sk_affinity_refresh(skippy_scheduler *s);
void sk_affinity_pin(skippy_scheduler *s, sk_seq *seq);
void sk_affinity_unpin(skippy_scheduler *s, sk_seq *seq);
void sk_affinity_release_pins(skippy_scheduler *s); /* scheduler free: give every pin back */
/* Detaches the attached store (no-op without one); the store calls it when freed first. */
void sk_affinity_detach_store(skippy_scheduler *s);
/* The cursor a waiting sequence starts from: its restored length under §0.4b's rule. */
size_t sk_restore_cursor(const sk_seq *seq);

/* sk_hold.c (§2.3a): whether the admission walk holds this waiting sequence for a running
 * leader that is computing its cold prefix (marks the leader) */
bool sk_hold(skippy_scheduler *s, sk_seq *waiting);

/* sk_move.c: one sequence's moves between the waiting queue and the active set (the callers
 * choose who moves and keep the arrays' order), and room in the waiting array and scratch. */
void sk_admit_one(skippy_scheduler *s, uint32_t slot);      /* room in s->active is the caller's */
void sk_requeue_victim(skippy_scheduler *s, uint32_t slot); /* out of the active set */
int sk_reserve_waiting(skippy_scheduler *s, size_t need);

/* sk_priority.c: preemption for priority (§2.8a), after the admission pass; reserve allocates
 * everything it may need before the pass changes anything. */
int sk_priority_reserve(skippy_scheduler *s);
void sk_priority_preempt(skippy_scheduler *s, size_t *admitted);

/* sk_admit.c: admits what fits from the front of the ranked waiting queue (§2.3), then
 * preempts for priority when that is on; the planner runs it before every plan */
int sk_admit_waiting(skippy_scheduler *s, size_t *out_admitted);

static inline uint64_t sk_reservation(const skippy_memory_component *component, size_t tokens)
{
    return sk_sat_add(component->bytes_per_sequence,
                      sk_sat_mul(component->bytes_per_token, tokens));
}

/* Whether seq's reservation fits on top of `used`. */
static inline bool sk_fits_on(const skippy_scheduler *s, const uint64_t *used, const sk_seq *seq)
{
    for (size_t i = 0; i < s->cfg.memory_component_count; i++) {
        uint64_t need = sk_sat_add(used[i], sk_reservation(&s->comps[i], seq->admission_tokens));
        if (need > s->available[i]) return false;
    }
    return true;
}

static inline void sk_refresh_counts(skippy_scheduler *s)
{
    s->m.active_sequences = s->active_len;
    s->m.waiting_sequences = s->waiting_len;
}

/* Generated tokens the planner counts: confirmed plus in-flight placeholders. */
static inline size_t sk_planned_gen(const sk_seq *q) { return q->gen_len + q->pending; }

/* A first-token deadline still to meet: one is set and no token is planned yet (§2.13). */
static inline bool sk_first_pending(const sk_seq *q)
{
    return q->ttft_deadline_us > 0.0 && sk_planned_gen(q) == 0;
}

/* Replay length R: the prompt plus every planned generated token but the newest (the pending
 * decode input). */
static inline size_t sk_replay_len(const sk_seq *q)
{
    size_t gen = sk_planned_gen(q);
    return q->prompt_len + (gen > 0 ? gen - 1 : 0);
}

static inline uint32_t sk_room(const sk_seq *q)
{
    size_t r = q->token_cap - q->prompt_len - q->gen_len;
    return r > UINT32_MAX ? UINT32_MAX : (uint32_t)r;
}

/* The tokens a store match reads (sk_affinity.c): the replay, so a preempted sequence restores
 * what it had computed, generated tokens included (docs/behaviour.md §2.12). */
static inline size_t sk_affinity_key_len(const sk_seq *q) { return sk_replay_len(q); }

static inline bool prefill_pending(const sk_seq *q) { return q->cursor < sk_replay_len(q); }
/* Its in-flight samples already bring it to max_tokens: nothing more to plan until they land. */
static inline bool sk_saturated(const sk_seq *q)
{
    return q->pending && sk_planned_gen(q) >= q->max_tokens;
}
static inline bool live_decode(const sk_seq *q)
{
    return !prefill_pending(q) && sk_planned_gen(q) > 0 && !sk_saturated(q);
}

/*
 * What an active sequence can run next. The scheduler keeps n_class[] equal to the count of
 * active sequences in each class, so planning knows whether any prefill or live decode exists
 * without walking the active set: every change to an active sequence's cursor or generated
 * tokens, and every entry to or exit from the active set, moves it between the counts.
 */
enum { SK_CLASS_IDLE = 0, SK_CLASS_PREFILL = 1, SK_CLASS_LIVE = 2 };

static inline int sk_class(const sk_seq *q)
{
    return prefill_pending(q) ? SK_CLASS_PREFILL : live_decode(q) ? SK_CLASS_LIVE : SK_CLASS_IDLE;
}

/* The live plan buffers, oldest first: the n-th is s->plans[sk_live_ring(s, n)]. */
static inline size_t sk_live_ring(const skippy_scheduler *s, size_t nth)
{
    return (s->live_head + nth) % s->cfg.max_inflight_plans;
}

/* A sequence that leaves the active set before its first row is no longer fresh. */
static inline void sk_unfresh(skippy_scheduler *s, sk_seq *seq)
{
    if (seq->fresh) {
        seq->fresh = false;
        s->fresh_count--;
    }
}

/* sk_live.c: the live plan with this serial (NULL when there is none); the same as an error
 * (SKIPPY_SCHED_STALE_PLAN unless `serial` names a live plan; with `oldest`,
 * SKIPPY_SCHED_PLAN_IN_FLIGHT unless it is the oldest one); undo of the live plans from the
 * n-th oldest on, newest first (abort) */
sk_plan_slot *sk_find_live(skippy_scheduler *s, uint64_t serial, size_t *out_nth);
int sk_check_live(skippy_scheduler *s, uint64_t serial, bool oldest, sk_plan_slot **out_slot);
void sk_abort_from(skippy_scheduler *s, size_t nth);

/* §2.11a: a sequence with a row in a plan that is still live (even a voided row). */
static inline bool sk_in_flight(skippy_scheduler *s, const sk_seq *seq)
{
    return seq->flight_serial && sk_find_live(s, seq->flight_serial, NULL) != NULL;
}

/* sk_slack.c: what the slack rule runs this step (§2.13) when prefill and live decode both
 * wait; prefill_budget bounds the step's prefill tokens. Updates s->interleaved. With
 * skip_in_flight (disjoint plans, §2.11a) the least slack leaves out the sequences in flight,
 * which this plan cannot give a row. */
enum { SK_SLACK_DECODE_ONLY = 0, SK_SLACK_MIXED = 1, SK_SLACK_PREFILL_ONLY = 2 };
typedef struct sk_slack_choice {
    int kind;
    size_t prefill_budget;
} sk_slack_choice;
sk_slack_choice sk_slack_decide(skippy_scheduler *s, size_t decode_rows, bool skip_in_flight,
                                double ratio, size_t first_start);
int sk_check_step_cost(const skippy_step_cost *cost);
double sk_slack_position_ratio(const skippy_scheduler *s);
size_t sk_slack_position_chunk(size_t start, size_t budget, double ratio);
size_t sk_slack_position_charge(size_t start, size_t count, double ratio, size_t cap);

/* sk_prefill_order.c: the order a prefill walk visits the prefill-pending sequences the plan
 * may take (under `disjoint`, §2.11a, not those in flight): walk order, or under the slack rule
 * with an age bound and several candidates its shortest-first order (§2.13). reserve sizes the
 * scratch array for the active set (before planning; -1 on out of memory); next gives the next
 * sequence's slot, SK_NO_SLOT when none is left. */
enum {
    SK_PF_OVERDUE = 0,        /* submitted (or past its deadline) at least the age bound ago */
    SK_PF_DEADLINE = 1,       /* a first-token deadline it can still meet: by `rank` */
    SK_PF_FREE = 2,           /* no first-token deadline: fewest tokens left first */
    SK_PF_RELEGATED = 3,      /* a deadline it cannot meet in this order: fewest tokens left */
    SK_PF_TAKEN = 4           /* given its row in this plan */
};
typedef struct sk_prefill_key {
    uint32_t slot;
    uint8_t cls;              /* SK_PF_*: classes go in this order */
    size_t left;              /* remaining prefill tokens (replay length - cursor) */
    double deadline_us;       /* SK_PF_DEADLINE: its first-token deadline */
    uint32_t rank;            /* SK_PF_DEADLINE: its place in the deadline class's order */
} sk_prefill_key;
typedef struct sk_prefill_walk {
    bool ordered;             /* the keys of s->prefill_keys, else walk order from `at` */
    bool disjoint;
    size_t at;
} sk_prefill_walk;
int sk_prefill_order_reserve(skippy_scheduler *s, size_t active_most);
sk_prefill_walk sk_prefill_walk_begin(skippy_scheduler *s, bool disjoint);
uint32_t sk_prefill_walk_next(skippy_scheduler *s, sk_prefill_walk *walk);
size_t sk_slack_toll(const skippy_scheduler *s);

#endif
