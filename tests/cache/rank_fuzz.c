/*
 * Random add/remove sequences on sk_rank_set, each step checked against sk_rank_order over
 * the live items in add order. Built with sanitizers by test_rank_native.py.
 * Usage: rank_fuzz ROUNDS MAX_STEPS SEED
 */
#include "sk_rank.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CAP 512

static unsigned long long state;

static unsigned rnd(unsigned n)
{
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (unsigned)(state >> 33) % n;
}

static int32_t *make_prompt(int32_t *const *prompts, const sk_rank_item *items, int have,
                            size_t *len)
{
    int32_t *t;
    size_t k, n;
    if (have && rnd(3) == 0) { /* a prefix of an earlier prompt */
        int o = (int)rnd((unsigned)have);
        n = rnd((unsigned)items[o].token_count + 1);
        t = malloc((n + 1) * sizeof(int32_t));
        if (n) memcpy(t, prompts[o], n * sizeof(int32_t));
    } else {
        size_t shared = rnd(2) ? 30 + rnd(200) : 0;
        n = shared + rnd(6);
        t = malloc((n + 1) * sizeof(int32_t));
        for (k = 0; k < n; k++) t[k] = k < shared ? 7 : (int32_t)rnd(3) - (rnd(9) == 0 ? 5 : 0);
    }
    *len = n;
    return t;
}

int main(int argc, char **argv)
{
    int rounds = argc > 1 ? atoi(argv[1]) : 100, max_steps = argc > 2 ? atoi(argv[2]) : 200;
    static int32_t *prompts[CAP];
    static sk_rank_item items[CAP], live_items[CAP];
    static uint32_t handles[CAP], got[CAP];
    static size_t want[CAP];
    static int live[CAP], map[CAP];
    state = argc > 3 ? strtoull(argv[3], NULL, 10) : 1;
    for (int round = 0; round < rounds; round++) {
        sk_rank_set *set = sk_rank_set_new();
        sk_rank_ws *ws = sk_rank_ws_new();
        int added = 0, steps = (int)rnd((unsigned)max_steps) + 1;
        if (!set || !ws) return 2;
        for (int step = 0; step < steps; step++) {
            size_t n = 0, i;
            int grouping = (int)rnd(2), mode = (int)rnd(3);
            uint64_t aging = rnd(3) ? rnd(3) : UINT64_MAX;
            if (rnd(4) != 0 && added < CAP) {
                size_t len;
                prompts[added] = make_prompt(prompts, items, added, &len);
                items[added].priority = rnd(2);
                items[added].saved_cost = rnd(4) ? rnd(3) : UINT64_MAX - rnd(2);
                items[added].enqueued_turn = rnd(9);
                items[added].order = rnd(12);
                items[added].tokens = prompts[added];
                items[added].token_count = len;
                if (sk_rank_set_add(set, &items[added], &handles[added])) return 3;
                live[added++] = 1;
            } else if (added) {
                int o = (int)rnd((unsigned)added);
                if (live[o]) {
                    if (sk_rank_set_remove(set, handles[o])) return 4;
                    live[o] = 0;
                }
            }
            for (i = 0; i < (size_t)added; i++)
                if (live[i]) {
                    live_items[n] = items[i];
                    map[n++] = (int)i;
                }
            if (sk_rank_set_size(set) != n) return 5;
            if (sk_rank_order(ws, live_items, n, 8, aging, grouping, mode, want)) return 6;
            if (sk_rank_set_order(set, 8, aging, grouping, mode, got)) return 7;
            for (i = 0; i < n; i++)
                if (handles[map[want[i]]] != got[i]) {
                    printf("mismatch: round %d step %d position %zu\n", round, step, i);
                    return 1;
                }
        }
        sk_rank_set_free(set);
        sk_rank_ws_free(ws);
        for (int i = 0; i < added; i++) free(prompts[i]);
    }
    puts("ok");
    return 0;
}
