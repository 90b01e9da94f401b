/*
 * What the scheduler reads of a prefix store besides its public API (sk_prefix.c, §8c).
 *
 * The change journal: while a scheduler is attached, every insert and eviction appends the
 * prefix under which waiting prompts may have changed their match: the changed key up to one
 * token past its longest common prefix with the other resident keys (a prompt that shares no
 * more than that with the key is matched as far through the others, before and after). A key
 * another resident key holds whole is not recorded. The scheduler drains the journal before
 * admission (sk_affinity.c). A journal that grows past its bound is dropped and flagged as
 * overflowed; the scheduler then re-reads every waiting sequence instead.
 */
#ifndef SK_PREFIX_H
#define SK_PREFIX_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "skippy_scheduler.h"

typedef struct sk_prefix_change {
    size_t offset;  /* into the journal's token pool */
    size_t length;
} sk_prefix_change;

/* The journal since the last sk_prefix_journal_clear: changes, their token pool, overflow. */
const sk_prefix_change *sk_prefix_journal(const skippy_prefix_store *store, size_t *out_count,
                                          const int32_t **out_tokens, bool *out_overflow);
void sk_prefix_journal_clear(skippy_prefix_store *store);
uint64_t sk_prefix_epoch(const skippy_prefix_store *store);

/* Attachment bookkeeping (one scheduler per store). The store calls nothing of the scheduler's
 * but `detach`, which the scheduler gives it with itself as `owner` (sk_affinity.c): a store
 * freed while attached calls detach(owner) first. */
typedef void (*sk_prefix_detach_fn)(skippy_scheduler *owner);
skippy_scheduler *sk_prefix_owner(const skippy_prefix_store *store);
void sk_prefix_set_owner(skippy_prefix_store *store, skippy_scheduler *owner,
                         sk_prefix_detach_fn detach);

/* Holder id of a resident entry (SKIPPY_PREFIX_NONE when it has none or is not resident). */
uint32_t sk_prefix_holder(const skippy_prefix_store *store, uint32_t entry);

#endif
