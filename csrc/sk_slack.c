/*
 * The slack-sized planning rule (docs/behaviour.md §2.13), a departure from the reference's
 * mixed-plan gate: when prefill and live decode both wait, each step sizes its prefill chunk
 * from the tightest decode slack and a linear cost model the caller keeps fitted.
 *
 * Slack of a live decode row = (clock at its previous token) + (its inter-token target) − now.
 * Predicted step time = base + per prefill token × chunk + per prefill row × (prefill rows
 * − 1) + (decode base + per decode row × rows when it has decode rows); a step fits
 * when its predicted time × safety is within the minimum slack. A mixed step carries the
 * decode rows and the chunk; when mixing is not predicted cheaper than the decode step plus
 * the chunk run alone, the chunk runs alone and must leave room for the decode step after it.
 * When not even slack_min_chunk_tokens fit, up to slack_interleave_max decode-only steps run in
 * a row, then a prefill step of the smallest useful chunk does, so the oldest admitted prefill
 * never waits more than k steps between two of its chunks. The chunk is sized for one
 * prefill row; when the plan spreads it over more (sk_plan.c), each row after the first pays
 * sk_slack_toll tokens of it for the pass llama.cpp runs for it. Under a position cost
 * (per_prefill_position_us > 0) the budget is in token equivalents: a chunk of c tokens from
 * position p costs c + ratio × (c·p + c(c−1)/2) of it, ratio = per_prefill_position_us /
 * (1000 × per_prefill_token_us), so a chunk deep in a long prompt is shorter than one at its
 * start, and the smallest useful chunk is counted in tokens of the first row the plan takes.
 * With no position cost every choice is the one made without the term. Nothing is latched:
 * every step decides anew. Under disjoint plans in flight (§2.11a) the sequences in flight are not
 * in the minimum: this plan cannot give them a row, and their last-token stamps wait for the
 * plan that carries their next token, so they would only make every slack look spent. With
 * plans in flight a sequence whose first token is still in flight counts its slack from now:
 * its stamp is still its admission, and no gap has begun (its first token lands at the end of
 * a plan in flight, no earlier than now).
 *
 * NOTE: built with -ffp-contract=off; the reference twin (reference/slack.py) evaluates the
 * same expressions in the same order, so both make the same choice bit for bit.
 */
#include <float.h>
#include <math.h>

#include "sk_internal.h"

int sk_check_step_cost(const skippy_step_cost *c)
{
    return !(isfinite(c->base_us) && c->base_us >= 0.0 && isfinite(c->per_prefill_token_us) &&
             c->per_prefill_token_us >= 0.0 && isfinite(c->decode_base_us) &&
             c->decode_base_us >= 0.0 && isfinite(c->per_decode_row_us) &&
             c->per_decode_row_us >= 0.0 && isfinite(c->per_prefill_row_us) &&
             c->per_prefill_row_us >= 0.0 && isfinite(c->per_prefill_position_us) &&
             c->per_prefill_position_us >= 0.0);
}

/* Tokens of the prefill budget each prefill row after the first pays for its own pass:
 * ceil(per_prefill_row_us / per_prefill_token_us), at most max_tokens_per_iteration (which no
 * budget exceeds, so a toll that large admits no second row, as does a zero per-token cost
 * beside a positive per-row one). */
size_t sk_slack_toll(const skippy_scheduler *s)
{
    double row = s->cost.per_prefill_row_us, per_token = s->cost.per_prefill_token_us;
    size_t cap = s->cfg.max_tokens_per_iteration;
    if (!(row > 0.0)) return 0;
    if (!(per_token > 0.0)) return cap;
    double toll = ceil(row / per_token);
    return toll >= (double)cap ? cap : (size_t)toll;
}

/* Largest chunk whose prefill time (per_token each) fits in `spare` µs, at most `room`. */
static size_t largest_chunk(double spare, double per_token, size_t room)
{
    if (!(spare >= 0.0)) return 0;
    if (per_token <= 0.0) return room;
    double chunk = floor(spare / per_token);
    if (chunk >= (double)room) return room;
    return (size_t)chunk;
}

/* Token equivalents each prefill token pays per position before it (module comment): 0 when
 * there is no position cost, or no per-token cost to measure it in. */
double sk_slack_position_ratio(const skippy_scheduler *s)
{
    double q = s->cost.per_prefill_position_us, per_token = s->cost.per_prefill_token_us;
    if (!(q > 0.0) || !(per_token > 0.0)) return 0.0;
    double ratio = q / (1000.0 * per_token);
    return ratio <= DBL_MAX ? ratio : DBL_MAX; /* finite: ratio × 0 positions stays 0 */
}

/* Token equivalents of `count` tokens from position `start`: c + ratio × (c·start + c(c−1)/2). */
static double position_equivalents(size_t start, size_t count, double ratio)
{
    double positions = (double)count * (double)start + (double)(count * (count - 1) / 2);
    return (double)count + ratio * positions;
}

/* The longest chunk from `start` whose token equivalents fit in `budget` (ratio > 0): the root
 * of the quadratic, in the form without cancellation, then checked one token either way. */
size_t sk_slack_position_chunk(size_t start, size_t budget, double ratio)
{
    if (budget == 0) return 0;
    double b = (double)budget, lin = 1.0 + ratio * ((double)start - 0.5);
    double root = 2.0 * b / (lin + sqrt(lin * lin + 2.0 * ratio * b));
    size_t chunk = root >= b ? budget : root >= 0.0 ? (size_t)floor(root) : 0;
    while (chunk < budget && position_equivalents(start, chunk + 1, ratio) <= b) chunk++;
    while (chunk > 0 && position_equivalents(start, chunk, ratio) > b) chunk--;
    return chunk;
}

/* What `count` tokens from `start` take from the budget: their equivalents rounded up, at most
 * `cap`. */
size_t sk_slack_position_charge(size_t start, size_t count, double ratio, size_t cap)
{
    double charge = position_equivalents(start, count, ratio);
    return charge >= (double)cap ? cap : (size_t)ceil(charge);
}

sk_slack_choice sk_slack_decide(skippy_scheduler *s, size_t decode_rows, bool skip_in_flight,
                                double ratio, size_t first_start)
{
    const skippy_scheduler_config *cfg = &s->cfg;
    const uint32_t *active = s->active;
    const sk_seq *seqs = s->seqs;
    double now = s->now_us, target = cfg->itl_target_us, min_slack = INFINITY;
    for (size_t at = 0, n = s->active_len; at < n; at++) {
        const sk_seq *seq = &seqs[active[at]];
        if (!live_decode(seq) || (skip_in_flight && sk_in_flight(s, seq))) continue;
        double own = seq->itl_target_us > 0.0 ? seq->itl_target_us : target;
        /* Its first token still in flight (plans in flight): no gap has begun; the first lands
         * no earlier than now, and its stamp is still its admission. */
        double last = seq->gen_len == 0 && seq->last_token_us < now ? now : seq->last_token_us;
        double slack = last + own - now;
        if (slack < min_slack) min_slack = slack;
    }
    double base = s->cost.base_us, per_token = s->cost.per_prefill_token_us;
    double decode_part = s->cost.decode_base_us + s->cost.per_decode_row_us * (double)decode_rows;
    double decode_us = base + decode_part;
    double avail = min_slack / cfg->slack_safety;
    size_t min_chunk = cfg->slack_min_chunk_tokens, max_tokens = cfg->max_tokens_per_iteration;
    size_t mixed_room = max_tokens - decode_rows;
    double probe = (double)min_chunk;
    bool mix = mixed_room >= min_chunk &&
               base + per_token * probe + decode_part < decode_us + (base + per_token * probe);
    size_t chunk = mix ? largest_chunk(avail - decode_us, per_token, mixed_room)
                       : largest_chunk(avail - decode_us - base, per_token, max_tokens);
    sk_slack_choice choice;
    choice.kind = mix ? SK_SLACK_MIXED : SK_SLACK_PREFILL_ONLY;
    choice.prefill_budget = chunk;
    size_t usable = ratio > 0.0 ? sk_slack_position_chunk(first_start, chunk, ratio) : chunk;
    if (usable < min_chunk) {
        if (s->interleaved < cfg->slack_interleave_max) {
            s->interleaved++;
            choice.kind = SK_SLACK_DECODE_ONLY;
            choice.prefill_budget = 0;
            return choice;
        }
        /* the starvation bound: a prefill step now, of min_chunk tokens of its first row */
        choice.prefill_budget = min_chunk;
        if (ratio > 0.0)
            choice.prefill_budget = sk_slack_position_charge(first_start, min_chunk, ratio,
                                                             max_tokens);
    }
    s->interleaved = 0;
    return choice;
}

void skippy_scheduler_set_clock(skippy_scheduler *s, double now_us)
{
    if (s && isfinite(now_us)) s->now_us = now_us; /* a NaN or infinite time is ignored */
}

static int set_step_cost(skippy_scheduler *s, const skippy_step_cost *cost)
{
    if (!cost) return sk_fail(s, SKIPPY_SCHED_INVALID, "step cost is NULL");
    if (sk_check_step_cost(cost))
        return sk_fail(s, SKIPPY_SCHED_INVALID, "step cost coefficients must be finite numbers "
                       ">= 0");
    s->cost = *cost;
    return 0;
}

skippy_status skippy_scheduler_set_step_cost(skippy_scheduler *s, const skippy_step_cost *cost,
                                             skippy_error **out_error)
{
    if (!s) return SK_NO_SCHEDULER(out_error);
    return sk_result(s, set_step_cost(s, cost), out_error);
}
