/*
 * Planning (docs/behaviour.md §2.4, §2.5) and the duration observations that decide whether mixed
 * planning pays off (§2.6).
 *
 * A plan is written straight into the skippy_plan struct-of-arrays: request rows point into
 * one token arena, row index = work index. Admission runs first (sk_sched.c); then either the
 * homogeneous planner (a prefill plan or a decode-only plan) or, once durations show that
 * mixing is cheap enough, the mixed planner fills the rows.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "sk_internal.h"

#define EWMA_ALPHA 0.25
#define MIXED_SLOWDOWN 0.20
#define MIXED_MIN_EXTRA_US 8000.0
#define MIXED_MAX_EXTRA_US 20000.0

/*
 * Rows never exceed min(active, max_tokens); tokens never exceed min(max_tokens, active*chunk).
 * Both capacities double like every other array of the core, but stop at those bounds, since a
 * plan can never use more.
 */
static int ensure_plan_capacity(skippy_scheduler *s)
{
    skippy_plan *plan = &s->plan;
    size_t max_tokens = s->cfg.max_tokens_per_iteration;
    size_t rows_needed = s->active_len < max_tokens ? s->active_len : max_tokens;
    if (rows_needed < 1) rows_needed = 1;
    if (rows_needed > plan->request_capacity) {
        size_t cap = plan->request_capacity * 2;
        if (cap < 16) cap = 16;
        if (cap > max_tokens) cap = max_tokens;
        if (cap < rows_needed) cap = rows_needed;
        if (sk_resize((void **)&plan->requests, cap, sizeof(skippy_iteration_request)) ||
            sk_resize((void **)&plan->row_offsets, cap + 1, sizeof(size_t)) ||
            sk_resize((void **)&plan->slots, cap, sizeof(uint32_t)) ||
            sk_resize((void **)&plan->phases, cap, 1) ||
            sk_resize((void **)&plan->sample_last, cap, 1) ||
            sk_resize((void **)&plan->sample_rows, cap, sizeof(size_t)) ||
            sk_resize((void **)&plan->outputs.sampled_request_indexes, cap, sizeof(size_t)) ||
            sk_resize((void **)&plan->outputs.predicted_tokens, cap, sizeof(int32_t)) ||
            sk_resize((void **)&s->row_seen, cap, 1) ||
            sk_resize((void **)&s->row_token, cap, sizeof(int32_t)))
            return -1;
        plan->request_capacity = cap;
    }
    uint64_t tokens_needed =
        sk_sat_mul(s->active_len ? s->active_len : 1, s->cfg.prefill_chunk_tokens);
    if (tokens_needed > max_tokens) tokens_needed = max_tokens;
    if (tokens_needed > plan->token_capacity) {
        uint64_t cap = sk_sat_mul(plan->token_capacity, 2);
        if (cap < 256) cap = 256;
        if (cap > max_tokens) cap = max_tokens;
        if (cap < tokens_needed) cap = tokens_needed;
        if (sk_resize((void **)&plan->tokens, (size_t)cap, sizeof(int32_t)) ||
            sk_resize((void **)&plan->positions, (size_t)cap, sizeof(int32_t)))
            return -1;
        plan->token_capacity = (size_t)cap;
    }
    return 0;
}

static inline int32_t pos32(size_t v) { return v > INT32_MAX ? INT32_MAX : (int32_t)v; }

/*
 * The plan's arrays and fill counters, copied into locals for the length of one plan. NOTE:
 * stores through the uint8_t arrays may alias anything, so writing rows through s->plan
 * would make the compiler reload every array pointer after each byte store; a local writer
 * that never escapes stays in registers.
 */
typedef struct sk_writer {
    skippy_iteration_request *requests;
    int32_t *tokens, *positions;
    size_t *row_offsets, *sample_rows;
    uint32_t *slots;
    uint8_t *phases, *sample_last;
    size_t row_count, token_count, sample_count;
    uint64_t tokens_by_phase[3];
} sk_writer;

static inline void writer_open(sk_writer *out, const skippy_plan *plan)
{
    out->requests = plan->requests;
    out->tokens = plan->tokens;
    out->positions = plan->positions;
    out->row_offsets = plan->row_offsets;
    out->sample_rows = plan->sample_rows;
    out->slots = plan->slots;
    out->phases = plan->phases;
    out->sample_last = plan->sample_last;
    out->row_count = out->token_count = out->sample_count = 0;
    out->tokens_by_phase[0] = out->tokens_by_phase[1] = out->tokens_by_phase[2] = 0;
}

/* Closes the row whose `count` tokens were just written at the end of the token arena. */
static inline void put_row(sk_writer *out, const sk_seq *seq, uint32_t slot, size_t count,
                           uint8_t phase, bool sample)
{
    size_t row = out->row_count++, first = out->token_count;
    skippy_iteration_request *request = &out->requests[row];
    request->session = seq->session;
    request->token_ids = out->tokens + first;
    request->token_count = count;
    request->positions = out->positions + first;
    request->position_count = count;
    request->sampling = seq->sampling;
    request->input_desc = NULL;
    request->input_payload = NULL;
    request->sample_last = sample;
    out->slots[row] = slot;
    out->phases[row] = phase;
    out->sample_last[row] = sample;
    if (sample) out->sample_rows[out->sample_count++] = row;
    out->token_count = first + count;
    out->row_offsets[row + 1] = out->token_count;
    out->tokens_by_phase[phase] += count;
}

/* A prefill-pending sequence's next chunk: replay tokens [cursor, cursor + count). */
static size_t emit_prefill(sk_writer *out, skippy_scheduler *s, uint32_t slot, size_t budget)
{
    sk_seq *seq = &s->seqs[slot];
    size_t replay = sk_replay_len(seq);
    size_t count = replay - seq->cursor;
    if (count > s->cfg.prefill_chunk_tokens) count = s->cfg.prefill_chunk_tokens;
    if (count > budget) count = budget;
    size_t start = seq->cursor, end = start + count;
    bool fresh = seq->gen_len == 0;
    int32_t *tokens = out->tokens + out->token_count;
    int32_t *positions = out->positions + out->token_count;
    memcpy(tokens, seq->tokens + start, count * sizeof(int32_t));
    for (size_t offset = 0; offset < count; offset++) positions[offset] = pos32(start + offset);
    put_row(out, seq, slot, count, fresh ? SKIPPY_PHASE_PREFILL : SKIPPY_PHASE_RECOMPUTE,
            fresh && end == replay);
    s->n_class[SK_CLASS_PREFILL]--;
    seq->cursor = end;
    s->n_class[sk_class(seq)]++;
    return count;
}

/* A live-decode sequence's pending token, fed at position R (= its index in the history). */
static inline void emit_decode(sk_writer *out, sk_seq *seq, uint32_t slot, size_t replay)
{
    out->tokens[out->token_count] = seq->last;
    out->positions[out->token_count] = pos32(replay);
    put_row(out, seq, slot, 1, SKIPPY_PHASE_DECODE, true);
    seq->cursor = replay + 1; /* still live-decode: the class counts do not change */
}

/*
 * Decode-only plan (the steady state): every live-decode sequence in walk order until the
 * budget ends. Same rows as emit_decode would write, with every cursor in a register: each
 * row is one token, so row, token and sample indexes are all equal.
 */
static void plan_decode_only(skippy_scheduler *s, sk_writer *out)
{
    const uint32_t *active = s->active;
    size_t active_count = s->active_len, budget = s->cfg.max_tokens_per_iteration, row = 0;
    sk_seq *seqs = s->seqs;
    skippy_iteration_request *request = out->requests;
    int32_t *tokens = out->tokens, *positions = out->positions;
    size_t *row_offsets = out->row_offsets, *sample_rows = out->sample_rows;
    uint32_t *slots = out->slots;
    uint8_t *phases = out->phases, *sample_last = out->sample_last;
    for (size_t at = 0; at < active_count && row < budget; at++) {
        uint32_t slot = active[at];
        sk_seq *seq = &seqs[slot];
        size_t generated = seq->gen_len;
        if (generated == 0) continue;
        size_t replay = seq->prompt_len + generated - 1;
        if (seq->cursor < replay) continue; /* prefill-pending waits for a prefill plan */
        tokens[row] = seq->last;
        positions[row] = pos32(replay);
        request->session = seq->session;
        request->token_ids = tokens + row;
        request->token_count = 1;
        request->positions = positions + row;
        request->position_count = 1;
        request->sampling = seq->sampling;
        request->input_desc = NULL;
        request->input_payload = NULL;
        request->sample_last = true;
        request++;
        slots[row] = slot;
        phases[row] = SKIPPY_PHASE_DECODE;
        sample_last[row] = 1;
        sample_rows[row] = row;
        row_offsets[row + 1] = row + 1;
        seq->cursor = replay + 1; /* still live-decode: the class counts do not change */
        row++;
    }
    out->row_count = out->token_count = out->sample_count = row;
    out->tokens_by_phase[SKIPPY_PHASE_DECODE] = row;
}

static void plan_homogeneous(skippy_scheduler *s, sk_writer *out, bool has_prefill, bool has_live)
{
    bool run_prefill = has_prefill && (!has_live || s->consecutive_prefill <
                                                        s->cfg.max_consecutive_prefill_iterations);
    size_t budget = s->cfg.max_tokens_per_iteration, active_count = s->active_len;
    const uint32_t *active = s->active;
    sk_seq *seqs = s->seqs;
    if (!run_prefill) {
        plan_decode_only(s, out);
        if (out->row_count) s->consecutive_prefill = 0;
        return;
    }
    size_t prefill_rows = 0;
    for (size_t at = 0; at < active_count && budget > 0; at++) {
        uint32_t slot = active[at];
        if (!prefill_pending(&seqs[slot])) continue;
        if (prefill_rows >= s->cfg.max_prefill_sequences_per_iteration) continue;
        budget -= emit_prefill(out, s, slot, budget);
        prefill_rows++;
    }
    if (prefill_rows) s->consecutive_prefill = has_live ? s->consecutive_prefill + 1 : 0;
}

/* Decode rows first, from a cursor that rotates so a short budget serves everyone in turn;
 * then prefill chunks with what budget is left. */
static void plan_mixed(skippy_scheduler *s, sk_writer *out)
{
    size_t budget = s->cfg.max_tokens_per_iteration, active_count = s->active_len;
    if (active_count > 0) {
        size_t start = s->mixed_cursor % active_count, examined = 0;
        for (size_t step = 0; step < active_count; step++) {
            if (budget == 0) break;
            examined = step + 1;
            size_t at = start + step;
            if (at >= active_count) at -= active_count;
            uint32_t slot = s->active[at];
            sk_seq *seq = &s->seqs[slot];
            if (live_decode(seq)) {
                emit_decode(out, seq, slot, sk_replay_len(seq));
                budget--;
            }
        }
        size_t next = start + examined;
        s->mixed_cursor = next % active_count;
    }
    size_t prefill_rows = 0;
    for (size_t at = 0; at < active_count; at++) {
        if (budget == 0 || prefill_rows >= s->cfg.max_prefill_sequences_per_iteration) break;
        uint32_t slot = s->active[at];
        if (!prefill_pending(&s->seqs[slot])) continue;
        budget -= emit_prefill(out, s, slot, budget);
        prefill_rows++;
    }
    s->consecutive_prefill = 0;
}

#ifdef SK_CHECK_INVARIANTS
/* Debug builds (-DSK_CHECK_INVARIANTS) recount the classes before every plan. */
static void sk_check_classes(const skippy_scheduler *s)
{
    size_t counted[3] = {0, 0, 0};
    for (size_t at = 0; at < s->active_len; at++) counted[sk_class(&s->seqs[s->active[at]])]++;
    if (memcmp(counted, s->n_class, sizeof counted) != 0) abort();
}
#endif

static int make_plan(skippy_scheduler *s, skippy_plan **out_plan)
{
    s->plan_live = false; /* making a plan ends the previous one, even if this one fails */
    /* Sequences that left during the previous plan's life give their slots back now. */
    for (size_t i = 0; i < s->retired_len; i++) sk_store_release(s, s->retired[i].slot);
    s->retired_len = 0;
    s->waiting_turn = sk_sat_add(s->waiting_turn, 1);
    size_t admitted = 0;
    int rc = sk_admit_waiting(s, &admitted);
    if (rc) {
        s->waiting_turn--;
        return rc;
    }
    sk_refresh_counts(s);
    if (ensure_plan_capacity(s))
        return sk_fail(s, SKIPPY_SCHED_NO_MEMORY, "out of memory sizing the plan");
    skippy_plan *plan = &s->plan;
    plan->row_offsets[0] = 0;
    plan->admitted = admitted;
    plan->preempted = 0;
    plan->outputs.count = 0;
#ifdef SK_CHECK_INVARIANTS
    sk_check_classes(s);
#endif
    /* Class counts are kept up to date by every change of an active sequence (sk_class). */
    bool has_prefill = s->n_class[SK_CLASS_PREFILL] > 0;
    size_t live_count = s->n_class[SK_CLASS_LIVE];
    size_t decode_rows = live_count < s->cfg.max_tokens_per_iteration
                             ? live_count : s->cfg.max_tokens_per_iteration;
    sk_writer out;
    writer_open(&out, plan);
    /* Mixed planning needs a decode-only duration for this many decode rows to compare with. */
    if (s->cfg.mixed_prefill_decode && s->mixed_viable && decode_rows > 0 &&
        decode_rows < s->ewma_cap && !isnan(s->ewma[decode_rows]))
        plan_mixed(s, &out);
    else
        plan_homogeneous(s, &out, has_prefill, live_count > 0);
    plan->request_count = out.row_count;
    plan->token_count = out.token_count;
    plan->sample_count = out.sample_count;
    memcpy(s->plan_tok, out.tokens_by_phase, sizeof s->plan_tok);
    /* One sample per row at most: the runtime gets exactly the row count as capacity. */
    plan->outputs.capacity = plan->request_count;
    plan->serial++;
    s->plan_live = true;
    if (out_plan) *out_plan = plan;
    return 0;
}

skippy_status skippy_scheduler_plan(skippy_scheduler *s, skippy_plan **out_plan,
                                    skippy_error **out_error)
{
    return sk_result(s, make_plan(s, out_plan), out_error);
}

/* ---------------------------------------------------------------- observation (§2.6) */

int sk_check_live(skippy_scheduler *s, uint64_t serial)
{
    if (!s->plan_live || serial != s->plan.serial)
        return sk_fail(s, SKIPPY_SCHED_STALE_PLAN, "plan %llu is no longer live",
                       (unsigned long long)serial);
    return 0;
}

/*
 * A decode-only plan updates the duration estimate for its row count; a mixed plan is compared
 * with that estimate, and mixing stops for good once it slowed decoding down by more than the
 * allowed margin.
 */
static int observe(skippy_scheduler *s, uint64_t serial, double elapsed_us)
{
    int rc = sk_check_live(s, serial);
    if (rc) return rc;
    if (!isfinite(elapsed_us) || elapsed_us <= 0.0) return 0;
    uint64_t prefill_tokens =
        s->plan_tok[SKIPPY_PHASE_PREFILL] + s->plan_tok[SKIPPY_PHASE_RECOMPUTE];
    uint64_t decode_rows = s->plan_tok[SKIPPY_PHASE_DECODE]; /* one token per decode row */
    if (decode_rows == 0) return 0;
    if (prefill_tokens == 0) {
        if (decode_rows >= s->ewma_cap) {
            size_t old_cap = s->ewma_cap;
            if (sk_grow((void **)&s->ewma, &s->ewma_cap, (size_t)decode_rows + 1, sizeof(double)))
                return sk_fail(s, SKIPPY_SCHED_NO_MEMORY, "out of memory recording a duration");
            for (size_t i = old_cap; i < s->ewma_cap; i++) s->ewma[i] = NAN;
        }
        double *estimate = &s->ewma[decode_rows];
        if (isnan(*estimate)) *estimate = elapsed_us;
        *estimate += EWMA_ALPHA * (elapsed_us - *estimate);
        return 0;
    }
    if (decode_rows >= s->ewma_cap || isnan(s->ewma[decode_rows])) return 0;
    double predicted = s->ewma[decode_rows];
    double extra = elapsed_us - predicted;
    if (extra < 1.0) extra = 1.0;
    double allowed = predicted * MIXED_SLOWDOWN;
    if (allowed < MIXED_MIN_EXTRA_US) allowed = MIXED_MIN_EXTRA_US;
    if (allowed > MIXED_MAX_EXTRA_US) allowed = MIXED_MAX_EXTRA_US;
    if (extra > allowed) s->mixed_viable = false;
    return 0;
}

skippy_status skippy_scheduler_observe(skippy_scheduler *s, uint64_t serial, double elapsed_us,
                                       skippy_error **out_error)
{
    return sk_result(s, observe(s, serial, elapsed_us), out_error);
}
