# Cython view of csrc/sk_radix.h: the unified token radix cache.
from libc.stdint cimport int32_t, uint32_t, uint64_t

cdef extern from "sk_radix.h":
    ctypedef struct sk_radix:
        pass
    ctypedef struct sk_radix_hit:
        size_t matched_tokens
        size_t stored_tokens
        uint64_t handle
        uint64_t logical_bytes
        uint64_t last_used
        uint32_t active_refs
        int32_t node
        size_t ns_index
    ctypedef struct sk_radix_stats:
        uint64_t namespaces, nodes, token_edges, splits
        uint64_t resident_entries, resident_tokens, resident_logical_bytes, resident_active_refs
        uint64_t recurrent_entries, recurrent_logical_bytes, recurrent_active_refs
        uint64_t resident_evictions, recurrent_evictions
    ctypedef enum sk_radix_kind:
        SK_RADIX_RESIDENT, SK_RADIX_RECURRENT
    ctypedef enum sk_radix_status:
        SK_RADIX_OK, SK_RADIX_REPLACED, SK_RADIX_OCCUPIED, SK_RADIX_ACTIVE, SK_RADIX_EMPTY_KEY
        SK_RADIX_MISS, SK_RADIX_NO_MEMORY
    ctypedef enum sk_radix_probe_mode:
        SK_RADIX_PEEK, SK_RADIX_LOOKUP, SK_RADIX_ACQUIRE
    sk_radix *sk_radix_new()
    void sk_radix_free(sk_radix *r)
    uint64_t sk_radix_epoch(const sk_radix *r)
    uint64_t sk_radix_version(const sk_radix *r)
    void sk_radix_set_epoch(sk_radix *r, uint64_t clock)
    int sk_radix_insert(sk_radix *r, int kind, int if_vacant, const char *ns, size_t ns_len,
                        const int32_t *tokens, size_t n, uint64_t logical_bytes, uint64_t handle,
                        uint64_t *prev_handle)
    int sk_radix_probe(sk_radix *r, int kind, int mode, const char *ns, size_t ns_len,
                       const int32_t *tokens, size_t n, sk_radix_hit *out)
    int sk_radix_exact(sk_radix *r, int kind, int touch, const char *ns, size_t ns_len,
                       const int32_t *tokens, size_t n, sk_radix_hit *out)
    int sk_radix_release(sk_radix *r, int kind, const char *ns, size_t ns_len,
                         const int32_t *tokens, size_t n)
    int sk_radix_remove(sk_radix *r, int kind, const char *ns, size_t ns_len,
                        const int32_t *tokens, size_t n, uint64_t *handle)
    int sk_radix_lru(const sk_radix *r, int kind, sk_radix_hit *out)
    int sk_radix_remove_hit(sk_radix *r, int kind, const sk_radix_hit *hit, int count_eviction,
                            uint64_t *handle)
    int sk_radix_next(const sk_radix *r, int kind, size_t *ns_index, int32_t *node,
                      sk_radix_hit *out)
    void sk_radix_copy_key(const sk_radix *r, int32_t node, int32_t *dst)
    const char *sk_radix_ns_name(const sk_radix *r, size_t ns_index, size_t *len)
    void sk_radix_get_stats(const sk_radix *r, sk_radix_stats *out)
