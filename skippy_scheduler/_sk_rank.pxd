# Cython view of csrc/sk_rank.h: the waiting-work ranking kernel and the persistent ranked set.
from libc.stdint cimport int32_t, uint32_t, uint64_t

cdef extern from "sk_rank.h" nogil:
    ctypedef struct sk_rank_item:
        uint64_t priority
        uint64_t saved_cost
        uint64_t enqueued_turn
        uint64_t order
        const int32_t *tokens
        size_t token_count
        uint64_t deadline

    uint64_t sk_rank_deadline_key(double deadline_us)

    ctypedef enum sk_rank_mode:
        SK_RANK_CACHE_AWARE
        SK_RANK_FCFS
        SK_RANK_PRIORITY

    ctypedef struct sk_rank_ws:
        pass
    sk_rank_ws *sk_rank_ws_new()
    void sk_rank_ws_free(sk_rank_ws *ws)
    int sk_rank_order(sk_rank_ws *ws, const sk_rank_item *items, size_t n, uint64_t current_turn,
                      uint64_t aging_cost_per_turn, int group_waiting_prefixes, int mode,
                      size_t *out)

    ctypedef struct sk_rank_set:
        pass
    sk_rank_set *sk_rank_set_new()
    void sk_rank_set_free(sk_rank_set *s)
    size_t sk_rank_set_size(const sk_rank_set *s)
    int sk_rank_set_add(sk_rank_set *s, const sk_rank_item *item, uint32_t *out_handle)
    int sk_rank_set_remove(sk_rank_set *s, uint32_t handle)
    int sk_rank_set_update(sk_rank_set *s, uint32_t handle, uint64_t priority,
                           uint64_t saved_cost, uint64_t enqueued_turn)
    int sk_rank_set_order(sk_rank_set *s, uint64_t current_turn, uint64_t aging_cost_per_turn,
                          int group_waiting_prefixes, int mode, uint32_t *out)
