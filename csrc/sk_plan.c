/*
 * Planning (docs/behaviour.md §2.4, §2.5) and the duration observations that decide whether mixed
 * planning pays off (§2.6).
 *
 * A plan is written straight into the skippy_plan struct-of-arrays: request rows point into
 * one token arena, row index = work index. Admission runs first (sk_admit.c); then either the
 * homogeneous planner (a prefill plan or a decode-only plan) or, once durations show that
 * mixing is cheap enough, the mixed planner fills the rows.
 *
 * Plans in flight (§2.11): up to max_inflight_plans plans may be live, each in its own buffer
 * of a ring. A sampling row adds a placeholder to its sequence (`pending`), so the next plan can
 * already feed that sequence's next decode row; its input token is then deferred: the plan's
 * deferred table says which earlier plan's sample it is. Each row remembers its cursor before
 * the row and its sequence's epoch, so aborting a plan puts every sequence back exactly (the
 * ring's lookup and the undo are sk_live.c's).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "sk_internal.h"

#define EWMA_ALPHA 0.25
#define MIXED_SLOWDOWN 0.20
#define MIXED_MIN_EXTRA_US 8000.0
#define MIXED_MAX_EXTRA_US 20000.0

/* A token buffer past a million tokens (4 MiB each for tokens and positions) is sized from what
 * the sequences can feed rather than a chunk per sequence (ensure_plan_capacity). */
#define EXACT_TOKENS_ABOVE ((uint64_t)1 << 20)

/*
 * Rows never exceed min(active, max_tokens); tokens never exceed min(max_tokens, active*chunk).
 * Both capacities double like every other array of the core, but stop at those bounds, since a
 * plan can never use more.
 */
/*
 * Grows one of a plan's arrays, which a host may read and write in place (the Python face lends
 * them to numpy without a copy), from `old` to `count` elements. The old block is not freed
 * but kept until the scheduler is: an array a host kept from an earlier plan still points into
 * it, and writing there must not land in memory the allocator has handed out again. Capacities
 * at least double, so the blocks kept add up to less than the arrays themselves.
 */
static int plan_grow(skippy_scheduler *s, void **ptr, size_t old, size_t count, size_t elem)
{
    if (count > SIZE_MAX / elem) return -1;
    if (!*ptr) return sk_resize(ptr, count, elem);
    if (sk_grow((void **)&s->moved_blocks, &s->moved_cap, s->moved_len + 1, sizeof(void *)))
        return -1;
    void *moved = malloc(count * elem);
    if (!moved) return -1;
    memcpy(moved, *ptr, (old < count ? old : count) * elem);
    s->moved_blocks[s->moved_len++] = *ptr;
    *ptr = moved;
    return 0;
}

/* Sized before admission (make_plan), so that a failure changes nothing: for every sequence
 * that may be active once it has run, those active now and those waiting (at most
 * max_active_sequences of them). */
static int ensure_plan_capacity(skippy_scheduler *s, sk_plan_slot *slot)
{
    skippy_plan *plan = &slot->plan;
    size_t max_tokens = s->cfg.max_tokens_per_iteration;
    size_t may_run = sk_sat_add(s->active_len, s->waiting_len), most = s->cfg.max_active_sequences;
    if (may_run > most) may_run = most > s->active_len ? most : s->active_len;
    size_t rows_needed = may_run < max_tokens ? may_run : max_tokens;
    bool sources = s->cfg.max_inflight_plans > 1;
    if (rows_needed < 1) rows_needed = 1;
    if (rows_needed > plan->request_capacity) {
        size_t cap = plan->request_capacity * 2;
        if (cap < 16) cap = 16;
        if (cap > max_tokens) cap = max_tokens;
        if (cap < rows_needed) cap = rows_needed;
        size_t old = plan->request_capacity;
        if (plan_grow(s, (void **)&plan->requests, old, cap, sizeof(skippy_iteration_request)) ||
            plan_grow(s, (void **)&plan->row_offsets, old ? old + 1 : 0, cap + 1,
                      sizeof(size_t)) ||
            plan_grow(s, (void **)&plan->slots, old, cap, sizeof(uint32_t)) ||
            plan_grow(s, (void **)&plan->phases, old, cap, 1) ||
            plan_grow(s, (void **)&plan->sample_last, old, cap, 1) ||
            plan_grow(s, (void **)&plan->sample_rows, old, cap, sizeof(size_t)) ||
            plan_grow(s, (void **)&plan->new_rows, old, cap, 1) ||
            plan_grow(s, (void **)&plan->restored_tokens, old, cap, sizeof(size_t)) ||
            plan_grow(s, (void **)&plan->outputs.sampled_request_indexes, old, cap,
                      sizeof(size_t)) ||
            plan_grow(s, (void **)&plan->outputs.predicted_tokens, old, cap, sizeof(int32_t)) ||
            sk_resize((void **)&slot->row_cursor, cap, sizeof(size_t)) ||
            sk_resize((void **)&slot->row_epoch, cap, sizeof(uint32_t)) ||
            sk_resize((void **)&slot->new_list, cap, sizeof(size_t)) ||
            (sources &&
             (sk_resize((void **)&slot->row_prev_step, cap, sizeof(uint64_t)) ||
              sk_resize((void **)&slot->row_prev_row, cap, sizeof(size_t)) ||
              plan_grow(s, (void **)&plan->deferred.rows, old, cap, sizeof(size_t)) ||
              plan_grow(s, (void **)&plan->deferred.source_steps, old, cap, sizeof(uint64_t)) ||
              plan_grow(s, (void **)&plan->deferred.source_indexes, old, cap,
                        sizeof(size_t)))))
            return -1;
        if (cap > s->row_scratch_cap) {
            if (sk_resize((void **)&s->row_seen, cap, 1) ||
                sk_resize((void **)&s->row_token, cap, sizeof(int32_t)))
                return -1;
            s->row_scratch_cap = cap;
        }
        /* (the kept part is zero but for listed rows, see sk_plan_slot) */
        memset(plan->new_rows + old, 0, cap - old);
        memset(plan->restored_tokens + old, 0, (cap - old) * sizeof(size_t));
        plan->request_capacity = cap;
        if (sources) plan->deferred.capacity = cap;
    }
    if (s->cfg.planning_rule == SKIPPY_PLANNING_SLACK && sk_prefill_order_reserve(s, may_run))
        return -1;
    /* A plan has at most one row per active sequence, of at most a chunk of its replay tokens
     * not yet fed (emit_prefill) or one decode token (emit_decode). */
    size_t chunk = s->cfg.prefill_chunk_tokens;
    uint64_t tokens_needed = sk_sat_mul(may_run ? may_run : 1, chunk);
    if (tokens_needed > max_tokens) tokens_needed = max_tokens;
    if (tokens_needed > plan->token_capacity && tokens_needed > EXACT_TOKENS_ABOVE) {
        /* A large chunk and budget would ask for far more than any plan uses: size for what
         * the sequences can feed instead (read only then, so no ordinary plan pays a pass). */
        uint64_t need = 0;
        for (size_t at = 0; at < s->active_len; at++) {
            const sk_seq *seq = &s->seqs[s->active[at]];
            size_t replay = sk_replay_len(seq);
            size_t left = replay > seq->cursor ? replay - seq->cursor : 0;
            if (left > chunk) left = chunk;
            need = sk_sat_add(need, left > 1 ? left : 1);
        }
        /* A waiting sequence's cursor may yet move back (its restore re-read at admission):
         * a chunk of its replay at most. */
        for (size_t i = 0; i < s->waiting_len; i++) {
            size_t replay = sk_replay_len(&s->seqs[s->waiting[i]]);
            need = sk_sat_add(need, replay < chunk ? (replay > 1 ? replay : 1) : chunk);
        }
        /* Depth 1 replacing its live plan (this buffer's): undoing it, after this sizing, moves
         * its rows' cursors back by at most the tokens it fed. */
        if (s->live_count >= s->cfg.max_inflight_plans) need = sk_sat_add(need, plan->token_count);
        if (need < tokens_needed) tokens_needed = need ? need : 1;
    }
    if (tokens_needed > plan->token_capacity) {
        uint64_t cap = sk_sat_mul(plan->token_capacity, 2);
        if (cap < 256) cap = 256;
        if (cap > max_tokens) cap = max_tokens;
        if (cap < tokens_needed) cap = tokens_needed;
        size_t old = plan->token_capacity;
        if (plan_grow(s, (void **)&plan->tokens, old, (size_t)cap, sizeof(int32_t)) ||
            plan_grow(s, (void **)&plan->positions, old, (size_t)cap, sizeof(int32_t)))
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
    uint8_t *phases, *sample_last, *new_rows;
    size_t *row_cursor, *restored_tokens, *new_list;
    uint32_t *row_epoch;
    uint64_t *row_prev_step;                  /* NULL at depth 1: no sources to track */
    size_t *row_prev_row;
    size_t *deferred_rows, *deferred_indexes;
    uint64_t *deferred_steps;
    size_t row_count, token_count, sample_count, deferred_count, new_count;
    uint64_t step;
    bool disjoint;                            /* disjoint_inflight_plans at depth > 1 */
    size_t decode_share;                      /*   then: decode rows of this plan at most */
    uint64_t tokens_by_phase[3];
} sk_writer;

static inline void writer_open(sk_writer *out, sk_plan_slot *slot, uint64_t step, bool sources,
                               bool disjoint)
{
    skippy_plan *plan = &slot->plan;
    out->requests = plan->requests;
    out->tokens = plan->tokens;
    out->positions = plan->positions;
    out->row_offsets = plan->row_offsets;
    out->sample_rows = plan->sample_rows;
    out->slots = plan->slots;
    out->phases = plan->phases;
    out->sample_last = plan->sample_last;
    out->new_rows = plan->new_rows;
    out->restored_tokens = plan->restored_tokens;
    out->new_list = slot->new_list;
    out->new_count = 0;
    out->row_cursor = slot->row_cursor;
    out->row_epoch = slot->row_epoch;
    out->row_prev_step = sources ? slot->row_prev_step : NULL;
    out->row_prev_row = sources ? slot->row_prev_row : NULL;
    out->deferred_rows = plan->deferred.rows;
    out->deferred_steps = plan->deferred.source_steps;
    out->deferred_indexes = plan->deferred.source_indexes;
    out->row_count = out->token_count = out->sample_count = out->deferred_count = 0;
    out->step = step;
    out->disjoint = sources && disjoint;
    out->decode_share = SIZE_MAX;
    out->tokens_by_phase[0] = out->tokens_by_phase[1] = out->tokens_by_phase[2] = 0;
}

/*
 * Disjoint plans in flight (§2.11a, `disjoint_inflight_plans` at depth > 1): a sequence with a
 * row in a plan that is still live (even a row a preemption made void since) is left out of
 * the plan being made; its next row comes once that plan has completed. So the
 * plans in flight hold disjoint sequences and no row is ever deferred: a pipeline of stages
 * runs them all at once without waiting on a sample still in the pipe. A plan takes at most
 * ceil(active / depth) decode rows, so the decoding sequences settle into depth groups that
 * take turns instead of one plan taking them all and the next finding none (sk_in_flight,
 * sk_internal.h).
 */

/* What the planner may give a row now: everything, unless it is in flight under §2.11a. */
static inline bool may_plan(skippy_scheduler *s, const sk_writer *out, const sk_seq *seq)
{
    return !out->disjoint || !sk_in_flight(s, seq);
}

/* A live-decode sequence's row, unless §2.11a leaves it out (in flight, or the share is full). */
static inline bool may_decode(skippy_scheduler *s, const sk_writer *out, const sk_seq *seq)
{
    return live_decode(seq) &&
           (!out->disjoint || (out->tokens_by_phase[SKIPPY_PHASE_DECODE] < out->decode_share &&
                               !sk_in_flight(s, seq)));
}

/* Closes the row whose `count` tokens were just written at the end of the token arena. The
 * first row of a sequence since its admission is new; it restored what lies before it. */
static inline void put_row(sk_writer *out, skippy_scheduler *s, sk_seq *seq, uint32_t slot,
                           size_t count, uint8_t phase, bool sample, size_t cursor_before)
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
    out->row_cursor[row] = cursor_before;
    out->row_epoch[row] = seq->epoch;
    if (out->disjoint) seq->flight_serial = out->step + 1; /* the serial this plan gets */
    if (seq->fresh) {
        out->new_rows[row] = 1;
        out->restored_tokens[row] = cursor_before;
        out->new_list[out->new_count++] = row;
        sk_unfresh(s, seq);
    }
    if (sample) out->sample_rows[out->sample_count++] = row;
    out->token_count = first + count;
    out->row_offsets[row + 1] = out->token_count;
    out->tokens_by_phase[phase] += count;
}

/* A sampling row adds the placeholder of its sample; at depth > 1 the sequence remembers
 * which row will produce it and the row remembers what it replaced (for abort). */
static inline void add_placeholder(sk_writer *out, sk_seq *seq, size_t row)
{
    if (out->row_prev_step) {
        out->row_prev_step[row] = seq->source_step;
        out->row_prev_row[row] = seq->source_row;
        seq->source_step = out->step;
        seq->source_row = row;
    }
    seq->pending++;
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
    bool fresh = sk_planned_gen(seq) == 0;
    bool sample = fresh && end == replay;
    int32_t *tokens = out->tokens + out->token_count;
    int32_t *positions = out->positions + out->token_count;
    /* NOTE: replay tokens are all confirmed: a preemption drops the placeholders (§2.11). */
    memcpy(tokens, seq->tokens + start, count * sizeof(int32_t));
    for (size_t offset = 0; offset < count; offset++) positions[offset] = pos32(start + offset);
    put_row(out, s, seq, slot, count, fresh ? SKIPPY_PHASE_PREFILL : SKIPPY_PHASE_RECOMPUTE,
            sample, start);
    s->n_class[SK_CLASS_PREFILL]--;
    seq->cursor = end;
    if (sample) add_placeholder(out, seq, out->row_count - 1);
    s->n_class[sk_class(seq)]++;
    return count;
}

/* A live-decode sequence's pending token, fed at position R (= its index in the history); when
 * that token is itself still in flight, the row's input is deferred. */
static inline void emit_decode(sk_writer *out, skippy_scheduler *s, sk_seq *seq, uint32_t slot,
                               size_t replay)
{
    size_t row = out->row_count;
    if (seq->pending) {
        out->tokens[out->token_count] = SKIPPY_DEFERRED_TOKEN;
        size_t j = out->deferred_count++;
        out->deferred_rows[j] = row;
        out->deferred_steps[j] = seq->source_step;
        out->deferred_indexes[j] = seq->source_row;
    } else {
        out->tokens[out->token_count] = seq->last;
    }
    out->positions[out->token_count] = pos32(replay);
    put_row(out, s, seq, slot, 1, SKIPPY_PHASE_DECODE, true, seq->cursor);
    seq->cursor = replay + 1;
    add_placeholder(out, seq, row);
    if (sk_saturated(seq)) { /* its samples in flight reach max_tokens: idle until they land */
        s->n_class[SK_CLASS_LIVE]--;
        s->n_class[SK_CLASS_IDLE]++;
    }
}

/*
 * Decode-only plan (the steady state): every live-decode sequence in walk order until the
 * budget ends. Same rows as emit_decode would write, with every cursor in a register: each
 * row is one token, so row, token and sample indexes are all equal. At depth 1 nothing is in
 * flight while planning, so no row is deferred; deeper pipelines take the general path, and so
 * does a plan with a sequence still waiting for its first row (one admitted with its prompt
 * already in the cache): the steady state has none, so no row here is new.
 */
static void plan_decode_only(skippy_scheduler *s, sk_writer *out)
{
    const uint32_t *active = s->active;
    size_t active_count = s->active_len, budget = s->cfg.max_tokens_per_iteration, row = 0;
    sk_seq *seqs = s->seqs;
    if (out->row_prev_step || s->fresh_count) {
        for (size_t at = 0; at < active_count && out->row_count < budget; at++) {
            sk_seq *seq = &seqs[active[at]];
            if (may_decode(s, out, seq)) emit_decode(out, s, seq, active[at], sk_replay_len(seq));
        }
        return;
    }
    skippy_iteration_request *request = out->requests;
    int32_t *tokens = out->tokens, *positions = out->positions;
    size_t *row_offsets = out->row_offsets, *sample_rows = out->sample_rows;
    size_t *row_cursor = out->row_cursor;
    uint32_t *slots = out->slots, *row_epoch = out->row_epoch;
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
        row_cursor[row] = seq->cursor;
        row_epoch[row] = seq->epoch;
        seq->cursor = replay + 1;
        seq->pending = 1;
        if (seq->max_tokens <= generated + 1) { /* saturated until its sample lands */
            s->n_class[SK_CLASS_LIVE]--;
            s->n_class[SK_CLASS_IDLE]++;
        }
        row++;
    }
    out->row_count = out->token_count = out->sample_count = row;
    out->tokens_by_phase[SKIPPY_PHASE_DECODE] = row;
}

/* The slack rule's toll (§2.13): a prefill row after the first costs `toll` tokens of the
 * budget (its own llama.cpp pass) and starts only when at least slack_min_chunk_tokens are
 * left after it. False: no further prefill row fits. Toll 0 (the reference rule) always fits. */
static bool pay_toll(const skippy_scheduler *s, size_t *budget, size_t prefill_rows, size_t toll)
{
    if (toll == 0 || prefill_rows == 0) return true;
    if (*budget <= toll || *budget - toll < s->cfg.slack_min_chunk_tokens) return false;
    *budget -= toll;
    return true;
}

/*
 * The first-token hold (§2.13; off unless slack_first_token_hold, and only under the slack
 * rule). A sequence is *first-pending* while it has a first-token deadline and no token
 * planned. The prefill that may be planned is *pressed* when now + 2 x (base_us +
 * per_prefill_token_us x its tokens left, summed) is not before the nearest deadline among its
 * first-pending sequences. While pressed, a first-pending sequence is *held* when its deadline
 * is later than now + (max_inflight_plans + 2) x (base_us + per_prefill_token_us x
 * max_tokens_per_iteration) (a few full steps from now) and another sequence of that prefill
 * has more than one token left: its chunk stops one token short of its prompt, and with one
 * token left it gets no row. The first-pending sequences with one token left that are not held
 * (released) go first in every prefill plan, paying no toll (their token rides the decode
 * rows' pass), and after the decode rows in a decode-only plan of the rule.
 */
typedef struct sk_ft_hold {
    bool on;          /* slack_first_token_hold under the slack rule */
    bool pressed;
    double release_us; /* held: a deadline later than this */
    size_t longer;    /* plannable prefill-pending sequences with more than one token left */
} sk_ft_hold;

static sk_ft_hold hold_begin(skippy_scheduler *s, const sk_writer *out)
{
    sk_ft_hold h = {false, false, 0.0, 0};
    if (!s->cfg.slack_first_token_hold || s->cfg.planning_rule != SKIPPY_PLANNING_SLACK)
        return h;
    h.on = true;
    uint64_t left_sum = 0;
    double nearest = INFINITY;
    for (size_t at = 0, n = s->active_len; at < n; at++) {
        const sk_seq *seq = &s->seqs[s->active[at]];
        if (!prefill_pending(seq) || !may_plan(s, out, seq)) continue;
        size_t left = sk_replay_len(seq) - seq->cursor;
        left_sum = sk_sat_add(left_sum, left);
        if (left > 1) h.longer++;
        if (sk_first_pending(seq) && seq->ttft_deadline_us < nearest)
            nearest = seq->ttft_deadline_us;
    }
    const skippy_step_cost *c = &s->cost;
    double work = c->base_us + c->per_prefill_token_us * (double)left_sum;
    if (nearest == INFINITY || s->now_us + 2.0 * work < nearest) return h;
    h.pressed = true;
    double full = c->base_us + c->per_prefill_token_us * (double)s->cfg.max_tokens_per_iteration;
    h.release_us = s->now_us + ((double)s->cfg.max_inflight_plans + 2.0) * full;
    return h;
}

/* A leader of the cold prefix hold (sk_hold.c) is never held: its peers wait for its first
 * token, so holding it would hold their whole prefill back, not one token. */
static inline bool held(const sk_ft_hold *h, const sk_seq *seq, size_t left)
{
    return h->pressed && sk_first_pending(seq) && seq->ttft_deadline_us > h->release_us &&
           h->longer > (left > 1 ? 1u : 0u) && seq->lead != SK_LEAD_HELD_ON;
}

/* The released last tokens (above): one-token rows of the first-pending sequences with one
 * token left that are not held, in walk order, while `*budget` and `rows` < `limit` allow.
 * Returns the rows written. */
static size_t emit_released(skippy_scheduler *s, sk_writer *out, const sk_ft_hold *h,
                            size_t *budget, size_t limit)
{
    size_t rows = 0;
    if (!h->on) return 0;
    for (size_t at = 0; at < s->active_len && *budget > 0 && rows < limit; at++) {
        uint32_t slot = s->active[at];
        const sk_seq *seq = &s->seqs[slot];
        if (!prefill_pending(seq) || !may_plan(s, out, seq) || !sk_first_pending(seq) ||
            sk_replay_len(seq) - seq->cursor != 1 || held(h, seq, 1))
            continue;
        *budget -= emit_prefill(out, s, slot, 1);
        rows++;
    }
    return rows;
}

/* Prefill chunks within `budget` tokens in the order of sk_prefill_walk (sk_prefill_order.c),
 * each row after the first paying `toll` (pay_toll); returns the prefill rows written. Under a
 * position cost (`ratio` > 0, sk_slack.c) the budget is in token equivalents: each row's chunk
 * is the longest whose equivalents fit (the first row at least one token), and pays them (at
 * most what is left). `walk`, when not NULL, was begun for this
 * plan and has already given `first`, the first row's sequence. */
static size_t fill_prefill(skippy_scheduler *s, sk_writer *out, size_t budget, size_t toll,
                           double ratio, sk_prefill_walk *walk, uint32_t first)
{
    size_t prefill_rows = 0, limit = s->cfg.max_prefill_sequences_per_iteration;
    bool peeked = walk != NULL;
    sk_prefill_walk own;
    sk_ft_hold hold = hold_begin(s, out);
    if (!walk) {
        own = sk_prefill_walk_begin(s, out->disjoint);
        walk = &own;
    }
    size_t released = emit_released(s, out, &hold, &budget, limit);
    while (budget > 0 && released + prefill_rows < limit) {
        uint32_t slot = peeked ? first : sk_prefill_walk_next(s, walk);
        peeked = false;
        if (slot == SK_NO_SLOT) break;
        const sk_seq *seq = &s->seqs[slot];
        size_t left = sk_replay_len(seq) - seq->cursor, cap = SIZE_MAX;
        if (left == 0) continue; /* released above */
        if (held(&hold, seq, left)) {
            if (left == 1) continue;
            cap = left - 1;
        }
        if (!pay_toll(s, &budget, prefill_rows, toll)) break;
        size_t room = budget < cap ? budget : cap;
        if (ratio > 0.0) {
            size_t start = seq->cursor;
            size_t chunk = sk_slack_position_chunk(start, room, ratio);
            if (chunk == 0) {
                if (prefill_rows > 0) break;
                chunk = 1; /* a step that prefills makes progress, whatever one token costs */
            }
            size_t count = emit_prefill(out, s, slot, chunk);
            budget -= sk_slack_position_charge(start, count, ratio, budget);
        } else {
            budget -= emit_prefill(out, s, slot, room);
        }
        prefill_rows++;
    }
    return released + prefill_rows;
}

/* A homogeneous prefill plan within `budget` tokens. */
static void plan_prefill(skippy_scheduler *s, sk_writer *out, size_t budget, bool has_live,
                         size_t toll, double ratio, sk_prefill_walk *walk, uint32_t first)
{
    if (fill_prefill(s, out, budget, toll, ratio, walk, first))
        s->consecutive_prefill = has_live ? s->consecutive_prefill + 1 : 0;
}

static void plan_homogeneous(skippy_scheduler *s, sk_writer *out, bool has_prefill, bool has_live)
{
    bool run_prefill = has_prefill && (!has_live || s->consecutive_prefill <
                                                        s->cfg.max_consecutive_prefill_iterations);
    if (!run_prefill) {
        plan_decode_only(s, out);
        if (out->row_count) s->consecutive_prefill = 0;
        return;
    }
    plan_prefill(s, out, s->cfg.max_tokens_per_iteration, has_live, 0, 0.0, NULL, SK_NO_SLOT);
}

/* Decode rows first, from a cursor that rotates so a short budget serves everyone in turn;
 * then prefill chunks with what budget is left, at most `prefill_cap` tokens, each row after
 * the first paying `toll` (pay_toll). */
static void plan_mixed(skippy_scheduler *s, sk_writer *out, size_t prefill_cap, size_t toll,
                       double ratio, sk_prefill_walk *walk, uint32_t first)
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
            if (may_decode(s, out, seq)) {
                emit_decode(out, s, seq, slot, sk_replay_len(seq));
                budget--;
            }
        }
        size_t next = start + examined;
        s->mixed_cursor = next % active_count;
    }
    if (budget > prefill_cap) budget = prefill_cap;
    fill_prefill(s, out, budget, toll, ratio, walk, first);
    s->consecutive_prefill = 0;
}

/* The slack rule (§2.13, sk_slack.c) when prefill and live decode both wait. Under a position
 * cost the prefill walk begins here: the rule sizes the smallest useful chunk from the start
 * position of the first row it gives, and the plan goes on from that walk. */
static void plan_slack(skippy_scheduler *s, sk_writer *out, size_t decode_rows)
{
    double ratio = sk_slack_position_ratio(s);
    sk_prefill_walk walk, *begun = NULL;
    uint32_t first = SK_NO_SLOT;
    size_t first_start = 0;
    if (ratio > 0.0) {
        walk = sk_prefill_walk_begin(s, out->disjoint);
        begun = &walk;
        first = sk_prefill_walk_next(s, begun);
        if (first != SK_NO_SLOT) first_start = s->seqs[first].cursor;
    }
    sk_slack_choice choice = sk_slack_decide(s, decode_rows, out->disjoint, ratio, first_start);
    if (choice.kind == SK_SLACK_MIXED) {
        plan_mixed(s, out, choice.prefill_budget, sk_slack_toll(s), ratio, begun, first);
    } else if (choice.kind == SK_SLACK_PREFILL_ONLY) {
        plan_prefill(s, out, choice.prefill_budget, true, sk_slack_toll(s), ratio, begun, first);
    } else {
        plan_decode_only(s, out);
        sk_ft_hold hold = hold_begin(s, out);
        size_t budget = s->cfg.max_tokens_per_iteration - out->row_count;
        emit_released(s, out, &hold, &budget, s->cfg.max_prefill_sequences_per_iteration);
        s->consecutive_prefill = 0;
    }
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

/* §2.11a: the classes counted over the sequences the plan may take (not those in flight), the
 * decode rows at most its share. */
static void count_plannable(skippy_scheduler *s, sk_writer *out, bool *has_prefill,
                            size_t *live_count)
{
    size_t depth = s->cfg.max_inflight_plans, prefill = 0, live = 0;
    out->decode_share = (s->active_len + depth - 1) / depth;
    for (size_t at = 0; at < s->active_len; at++) {
        const sk_seq *seq = &s->seqs[s->active[at]];
        if (!may_plan(s, out, seq)) continue;
        if (prefill_pending(seq)) prefill++;
        else if (live_decode(seq)) live++;
    }
    *has_prefill = prefill > 0;
    *live_count = live < out->decode_share ? live : out->decode_share;
}

static int make_plan(skippy_scheduler *s, skippy_plan **out_plan)
{
    size_t depth = s->cfg.max_inflight_plans;
    if (depth > 1 && s->live_count >= depth)
        return sk_fail(s, SKIPPY_SCHED_PLAN_IN_FLIGHT, "%zu plans are in flight "
                       "(max_inflight_plans); complete or abort the oldest first", depth);
    /* The plan's buffer is sized first, for every sequence admission may add, so that an
     * allocation failure leaves everything as it was. At depth 1 it is the live plan's own
     * (reallocation keeps what aborting reads). */
    sk_plan_slot *slot = &s->plans[sk_live_ring(s, s->live_count)];
    if (ensure_plan_capacity(s, slot))
        return sk_fail(s, SKIPPY_SCHED_NO_MEMORY, "out of memory sizing the plan");
    s->waiting_turn = sk_sat_add(s->waiting_turn, 1);
    size_t admitted = 0;
    int rc = sk_admit_waiting(s, &admitted);
    if (rc) {
        s->waiting_turn--;
        return rc;
    }
    sk_refresh_counts(s);
    /* Sequences that left since the previous plan give their slots back now that nothing can
     * fail (a failed call leaves them readable: skippy_scheduler_retired). Admission takes no
     * slot, so this order decides nothing. */
    for (size_t i = 0; i < s->retired_len; i++) sk_store_release(s, s->retired[i].slot);
    s->retired_len = 0;
    if (s->live_count >= depth) sk_abort_from(s, 0); /* depth 1: replaced, so undone (§0.4f) */
    slot = &s->plans[sk_live_ring(s, s->live_count)];
    skippy_plan *plan = &slot->plan;
    for (size_t i = 0; i < slot->new_count; i++) { /* the last plan made here (read above) */
        plan->new_rows[slot->new_list[i]] = 0;
        plan->restored_tokens[slot->new_list[i]] = 0;
    }
    slot->new_count = 0;
    plan->row_offsets[0] = 0;
    plan->admitted = admitted;
    plan->preempted = s->prio_victim_len; /* for priority at this admission (§2.8a) */
    plan->outputs.count = 0;
    slot->consecutive_before = s->consecutive_prefill;
    slot->mixed_before = s->mixed_cursor;
    slot->interleaved_before = s->interleaved;
#ifdef SK_CHECK_INVARIANTS
    sk_check_classes(s);
#endif
    sk_writer out;
    writer_open(&out, slot, s->plan_serial, depth > 1, s->cfg.disjoint_inflight_plans);
    /* Class counts are kept up to date by every change of an active sequence (sk_class). */
    bool has_prefill = s->n_class[SK_CLASS_PREFILL] > 0;
    size_t live_count = s->n_class[SK_CLASS_LIVE];
    if (out.disjoint) count_plannable(s, &out, &has_prefill, &live_count);
    size_t decode_rows = live_count < s->cfg.max_tokens_per_iteration
                             ? live_count : s->cfg.max_tokens_per_iteration;
    if (s->cfg.planning_rule == SKIPPY_PLANNING_SLACK) {
        if (has_prefill && live_count > 0) {
            plan_slack(s, &out, decode_rows);
        } else {
            s->interleaved = 0; /* nothing waits on the other phase */
            plan_homogeneous(s, &out, has_prefill, live_count > 0);
        }
    }
    /* Mixed planning needs a decode-only duration for this many decode rows to compare with;
     * a plan whose admission preempted for priority is mixed whatever the gate says (§2.8a
     * point 6: the running streams keep decoding beside the beneficiary's prefill). */
    else if (s->cfg.mixed_prefill_decode && decode_rows > 0 &&
             (s->prio_victim_len > 0 ||
              (s->mixed_viable && decode_rows < s->ewma_cap && !isnan(s->ewma[decode_rows]))))
        plan_mixed(s, &out, SIZE_MAX, 0, 0.0, NULL, SK_NO_SLOT);
    else
        plan_homogeneous(s, &out, has_prefill, live_count > 0);
    plan->request_count = out.row_count;
    plan->token_count = out.token_count;
    plan->sample_count = out.sample_count;
    plan->deferred.count = out.deferred_count;
    slot->new_count = out.new_count;
    memcpy(slot->tokens_by_phase, out.tokens_by_phase, sizeof slot->tokens_by_phase);
    /* One sample per row at most: the runtime gets exactly the row count as capacity. */
    plan->outputs.capacity = plan->request_count;
    plan->step = s->plan_serial;
    plan->serial = ++s->plan_serial;
    slot->live = true;
    slot->void_mark = s->void_count;
    s->live_count++;
    if (out_plan) *out_plan = plan;
    return 0;
}

skippy_status skippy_scheduler_plan(skippy_scheduler *s, skippy_plan **out_plan,
                                    skippy_error **out_error)
{
    if (!s) return SK_NO_SCHEDULER(out_error);
    return sk_result(s, make_plan(s, out_plan), out_error);
}

/* ---------------------------------------------------------------- observation (§2.6) */

/*
 * A decode-only plan updates the duration estimate for its row count; a mixed plan is compared
 * with that estimate, and mixing stops for good once it slowed decoding down by more than the
 * allowed margin.
 */
static int observe(skippy_scheduler *s, uint64_t serial, double elapsed_us)
{
    sk_plan_slot *slot;
    int rc = sk_check_live(s, serial, false, &slot);
    if (rc) return rc;
    if (!isfinite(elapsed_us) || elapsed_us <= 0.0) return 0;
    const uint64_t *phase_tokens = slot->tokens_by_phase;
    uint64_t prefill_tokens = phase_tokens[SKIPPY_PHASE_PREFILL] + phase_tokens[SKIPPY_PHASE_RECOMPUTE];
    uint64_t decode_rows = phase_tokens[SKIPPY_PHASE_DECODE]; /* one token per decode row */
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
    if (!s) return SK_NO_SCHEDULER(out_error);
    return sk_result(s, observe(s, serial, elapsed_us), out_error);
}
