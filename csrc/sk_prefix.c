/*
 * The prefix store (docs/behaviour.md §8c): resident token prefixes under a capacity in tokens
 * and in holder slots, with pins and least-recently-used eviction.
 *
 * Layout: entries live in one array recycled through a free list; an entry keeps only the
 * tokens of its own segment (its key is its parent's key plus the segment), so resident memory
 * follows the capacity, not the sum of full key lengths. Longest-prefix lookups go through the
 * unified radix (sk_radix.c) with the entry index as the handle. Eviction candidates sit in a
 * binary heap keyed by (last_used, serial) with lazy deletion: an item is valid only while its
 * entry is alive in the same generation, evictable (no pins, no resident children) and still
 * carries that last_used. Choosing victims reads the heap without committing, so an insert that
 * cannot be made room for changes nothing.
 */
#include <stdlib.h>
#include <string.h>
#include <stdio.h>
#include <stdarg.h>

#include "sk_grow.h"
#include "sk_prefix.h"
#include "sk_radix.h"

#define NONE SKIPPY_PREFIX_NONE
#define NS "prefix"
#define NS_LEN 6
/* Journal bounds: past these the scheduler re-reads every waiting sequence instead. */
#define JOURNAL_MAX_CHANGES 65536u
#define JOURNAL_MAX_TOKENS ((size_t)1 << 24)

typedef struct sk_pentry {
    int32_t *seg;         /* segment tokens (own buffer, kept across occupants) */
    size_t seg_cap;
    size_t start, length;
    uint64_t last_used, serial, handle;
    uint32_t parent, children, pins, holder;
    uint32_t gen;         /* bumped at every eviction: stale heap items never match */
    uint32_t next_free;
    uint32_t mark;        /* victim choice scratch: chosen in round `mark` */
    uint32_t gone;        /* victim choice scratch: children chosen in round `gone_round` */
    uint32_t gone_round;
    bool alive;
} sk_pentry;

typedef struct sk_heap_item {
    uint64_t last_used, serial;
    uint32_t entry, gen;
} sk_heap_item;

struct skippy_prefix_store {
    skippy_prefix_store_config cfg;
    sk_radix *radix;
    sk_pentry *e;
    size_t e_cap;
    uint32_t e_len, free_head;
    sk_heap_item *heap;
    size_t heap_len, heap_cap;
    sk_heap_item *popped;
    size_t popped_cap;
    uint32_t *victims;
    size_t victims_cap;
    uint32_t *holders;    /* free holder offsets, a stack (lowest on top at first) */
    size_t holders_len;
    skippy_prefix_eviction *evicted;
    size_t evicted_len, evicted_cap;
    int32_t *key;         /* key scratch */
    size_t key_cap;
    uint64_t clock, serial, epoch;
    uint32_t round;
    skippy_prefix_store_stats st;
    /* journal (only while a scheduler is attached) */
    skippy_scheduler *owner;
    sk_prefix_detach_fn detach; /* the owner's, called when the store is freed */
    sk_prefix_change *changes;
    size_t n_changes, changes_cap;
    int32_t *jtok;
    size_t jtok_len, jtok_cap;
    bool overflow;
    char message[200];
};

static skippy_sched_code fail(skippy_prefix_store *p, skippy_sched_code code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(p->message, sizeof p->message, fmt, ap);
    va_end(ap);
    return code;
}

static bool bounded_holders(const skippy_prefix_store *p) { return p->cfg.holder_slots != SIZE_MAX; }

void skippy_prefix_store_config_default(skippy_prefix_store_config *c)
{
    if (!c) return;
    c->capacity_tokens = UINT64_MAX;
    c->holder_slots = SIZE_MAX;
    c->first_holder_id = 0;
}

skippy_sched_code skippy_prefix_store_create(const skippy_prefix_store_config *config,
                                             skippy_prefix_store **out)
{
    if (!out) return SKIPPY_SCHED_INVALID;
    *out = NULL;
    if (!config) return SKIPPY_SCHED_INVALID;
    if (config->holder_slots != SIZE_MAX &&
        (config->holder_slots > UINT32_MAX ||
         (uint64_t)config->first_holder_id + config->holder_slots > NONE))
        return SKIPPY_SCHED_INVALID;
    skippy_prefix_store *p = calloc(1, sizeof *p);
    if (!p) return SKIPPY_SCHED_NO_MEMORY;
    p->cfg = *config;
    p->free_head = NONE;
    p->radix = sk_radix_new();
    if (!p->radix) goto oom;
    if (bounded_holders(p) && p->cfg.holder_slots) {
        p->holders = malloc(p->cfg.holder_slots * sizeof(uint32_t));
        if (!p->holders) goto oom;
        for (size_t i = 0; i < p->cfg.holder_slots; i++)
            p->holders[i] = (uint32_t)(p->cfg.holder_slots - 1 - i);
        p->holders_len = p->cfg.holder_slots;
    }
    *out = p;
    return SKIPPY_SCHED_OK;
oom:
    skippy_prefix_store_free(p);
    return SKIPPY_SCHED_NO_MEMORY;
}

void skippy_prefix_store_free(skippy_prefix_store *p)
{
    if (!p) return;
    if (p->owner) p->detach(p->owner);
    sk_radix_free(p->radix);
    for (size_t i = 0; i < p->e_cap; i++) free(p->e[i].seg); /* slots past e_len too */
    free(p->e);
    free(p->heap);
    free(p->popped);
    free(p->victims);
    free(p->holders);
    free(p->evicted);
    free(p->key);
    free(p->changes);
    free(p->jtok);
    free(p);
}

const char *skippy_prefix_store_last_message(const skippy_prefix_store *p)
{
    return p ? p->message : "prefix store is NULL";
}

static bool resident(const skippy_prefix_store *p, uint32_t id)
{
    return id < p->e_len && p->e[id].alive;
}

static bool evictable(const sk_pentry *x) { return x->alive && x->pins == 0 && x->children == 0; }

/* ---- keys ---- */

static int key_room(skippy_prefix_store *p, size_t n)
{
    return sk_grow((void **)&p->key, &p->key_cap, n ? n : 1, sizeof(int32_t));
}

static void key_of(const skippy_prefix_store *p, uint32_t id, int32_t *dst)
{
    while (id != NONE) {
        const sk_pentry *x = &p->e[id];
        memcpy(dst + x->start, x->seg, (x->length - x->start) * sizeof(int32_t));
        id = x->parent;
    }
}

/* ---- the heap ---- */

static bool item_less(const sk_heap_item *a, const sk_heap_item *b)
{
    return a->last_used != b->last_used ? a->last_used < b->last_used : a->serial < b->serial;
}

static bool item_valid(const skippy_prefix_store *p, const sk_heap_item *it)
{
    const sk_pentry *x = &p->e[it->entry];
    return x->gen == it->gen && evictable(x) && x->last_used == it->last_used;
}

static void heap_up(sk_heap_item *h, size_t i)
{
    while (i > 0) {
        size_t up = (i - 1) / 2;
        if (!item_less(&h[i], &h[up])) break;
        sk_heap_item t = h[i]; h[i] = h[up]; h[up] = t;
        i = up;
    }
}

static void heap_down(sk_heap_item *h, size_t n, size_t i)
{
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && item_less(&h[l], &h[m])) m = l;
        if (r < n && item_less(&h[r], &h[m])) m = r;
        if (m == i) return;
        sk_heap_item t = h[i]; h[i] = h[m]; h[m] = t;
        i = m;
    }
}

static sk_heap_item heap_pop(skippy_prefix_store *p)
{
    sk_heap_item top = p->heap[0];
    p->heap[0] = p->heap[--p->heap_len];
    heap_down(p->heap, p->heap_len, 0);
    return top;
}

/* Drops stale items when they outnumber the entries (rebuild in place, no allocation). */
static void heap_compact(skippy_prefix_store *p)
{
    size_t kept = 0;
    uint32_t round = ++p->round;
    for (size_t i = 0; i < p->heap_len; i++) {
        const sk_heap_item *it = &p->heap[i];
        sk_pentry *x = &p->e[it->entry];
        /* keep one valid item per entry, so at most `entries` remain */
        if (item_valid(p, it) && x->mark != round) {
            x->mark = round;
            p->heap[kept++] = *it;
        }
    }
    p->heap_len = kept;
    for (size_t i = kept / 2 + 1; i-- > 0;) heap_down(p->heap, kept, i);
}

/* The heap always has room for one more item per entry plus slack (heap_reserve). */
static void heap_push(skippy_prefix_store *p, uint32_t id)
{
    if (p->heap_len >= p->heap_cap) heap_compact(p);
    if (p->heap_len >= p->heap_cap) return; /* cannot happen: see heap_reserve */
    sk_pentry *x = &p->e[id];
    sk_heap_item it = {x->last_used, x->serial, id, x->gen};
    p->heap[p->heap_len] = it;
    heap_up(p->heap, p->heap_len++);
}

static int heap_reserve(skippy_prefix_store *p, size_t entries)
{
    /* Each entry has at most one valid item; compaction keeps only those, so 2x entries plus a
     * margin always leaves room for the pushes of one call. */
    size_t need = 2 * entries + 64;
    if (need <= p->heap_cap) return 0;
    return sk_grow((void **)&p->heap, &p->heap_cap, need, sizeof(sk_heap_item));
}

/* ---- journal ---- */

/*
 * Records a change of the resident key `key` (`len` tokens): the prompts whose match can have
 * changed are those that share more than `lcp` tokens with it, `lcp` being its longest common
 * prefix with the keys resident besides it (any prompt sharing fewer is matched as far through
 * those). So the record is the key's first lcp + 1 tokens; nothing when another resident key
 * holds all of it. (Which entry backs an unchanged match may still change: the scheduler looks
 * the entry up again when it pins it.)
 */
static void journal_add(skippy_prefix_store *p, const int32_t *key, size_t len, size_t lcp)
{
    if (!p->owner || p->overflow || lcp >= len) return;
    len = lcp + 1;
    if (p->n_changes >= JOURNAL_MAX_CHANGES || p->jtok_len + len > JOURNAL_MAX_TOKENS ||
        sk_grow((void **)&p->changes, &p->changes_cap, p->n_changes + 1, sizeof(sk_prefix_change)) ||
        sk_grow((void **)&p->jtok, &p->jtok_cap, p->jtok_len + len, sizeof(int32_t))) {
        /* A journal that cannot be kept is dropped: the reader re-reads everything. */
        p->overflow = true;
        p->n_changes = 0;
        p->jtok_len = 0;
        return;
    }
    memcpy(p->jtok + p->jtok_len, key, len * sizeof(int32_t));
    p->changes[p->n_changes].offset = p->jtok_len;
    p->changes[p->n_changes].length = len;
    p->n_changes++;
    p->jtok_len += len;
}

/* The longest common prefix of key with the resident keys (the store's own match). */
static size_t resident_lcp(const skippy_prefix_store *p, const int32_t *key, size_t len)
{
    size_t m = 0;
    if (p->owner) skippy_prefix_store_match(p, key, len, &m);
    return m;
}

const sk_prefix_change *sk_prefix_journal(const skippy_prefix_store *p, size_t *count,
                                          const int32_t **tokens, bool *overflow)
{
    *count = p->n_changes;
    *tokens = p->jtok;
    *overflow = p->overflow;
    return p->changes;
}

void sk_prefix_journal_clear(skippy_prefix_store *p)
{
    p->n_changes = 0;
    p->jtok_len = 0;
    p->overflow = false;
}

uint64_t sk_prefix_epoch(const skippy_prefix_store *p) { return p->epoch; }
skippy_scheduler *sk_prefix_owner(const skippy_prefix_store *p) { return p->owner; }

void sk_prefix_set_owner(skippy_prefix_store *p, skippy_scheduler *owner,
                         sk_prefix_detach_fn detach)
{
    p->owner = owner;
    p->detach = owner ? detach : NULL;
    sk_prefix_journal_clear(p);
}

uint32_t sk_prefix_holder(const skippy_prefix_store *p, uint32_t id)
{
    return resident(p, id) ? p->e[id].holder : NONE;
}

/* ---- reads ---- */

uint32_t skippy_prefix_store_match(const skippy_prefix_store *p, const int32_t *tokens,
                                   size_t n, size_t *out_matched)
{
    if (out_matched) *out_matched = 0;
    if (!p || !tokens || n == 0 || p->st.entries == 0) return NONE;
    sk_radix_hit hit;
    if (sk_radix_probe(p->radix, SK_RADIX_RESIDENT, SK_RADIX_PEEK, NS, NS_LEN, tokens, n, &hit) !=
        SK_RADIX_OK)
        return NONE;
    if (out_matched) *out_matched = hit.matched_tokens < n ? hit.matched_tokens : n;
    return (uint32_t)hit.handle;
}

uint32_t skippy_prefix_store_find(const skippy_prefix_store *p, const int32_t *tokens, size_t n)
{
    if (!p || !tokens || n == 0 || p->st.entries == 0) return NONE;
    sk_radix_hit hit;
    if (sk_radix_exact(p->radix, SK_RADIX_RESIDENT, 0, NS, NS_LEN, tokens, n, &hit) != SK_RADIX_OK)
        return NONE;
    return (uint32_t)hit.handle;
}

bool skippy_prefix_store_entry(const skippy_prefix_store *p, uint32_t id,
                               skippy_prefix_entry_info *o)
{
    if (!p || !o || !resident(p, id)) return false;
    const sk_pentry *x = &p->e[id];
    o->parent = x->parent;
    o->holder = x->holder;
    o->start = x->start;
    o->length = x->length;
    o->pins = x->pins;
    o->children = x->children;
    o->last_used = x->last_used;
    o->serial = x->serial;
    o->handle = x->handle;
    o->segment = x->seg;
    return true;
}

bool skippy_prefix_store_key(const skippy_prefix_store *p, uint32_t id, int32_t *dst)
{
    if (!p || !dst || !resident(p, id)) return false;
    key_of(p, id, dst);
    return true;
}

void skippy_prefix_store_get_stats(const skippy_prefix_store *p, skippy_prefix_store_stats *o)
{
    if (!o) return;
    if (!p) {
        memset(o, 0, sizeof *o);
        return;
    }
    *o = p->st;
    o->epoch = p->epoch;
}

const skippy_prefix_eviction *skippy_prefix_store_evicted(const skippy_prefix_store *p,
                                                          size_t *count)
{
    if (count) *count = p ? p->evicted_len : 0;
    return p ? p->evicted : NULL;
}

size_t skippy_prefix_store_lru_order(const skippy_prefix_store *p, uint32_t *out)
{
    if (!p || !out) return 0;
    size_t n = 0;
    for (uint32_t i = 0; i < p->e_len; i++)
        if (evictable(&p->e[i])) out[n++] = i;
    /* insertion sort by (last_used, serial): an inspection call, not a hot path */
    for (size_t i = 1; i < n; i++) {
        uint32_t v = out[i];
        size_t j = i;
        while (j > 0) {
            const sk_pentry *a = &p->e[out[j - 1]], *b = &p->e[v];
            if (a->last_used < b->last_used ||
                (a->last_used == b->last_used && a->serial < b->serial))
                break;
            out[j] = out[j - 1];
            j--;
        }
        out[j] = v;
    }
    return n;
}

/* ---- writes ---- */

static void stamp(skippy_prefix_store *p, uint32_t id)
{
    p->clock++;
    for (uint32_t k = id; k != NONE; k = p->e[k].parent) p->e[k].last_used = p->clock;
    if (evictable(&p->e[id])) heap_push(p, id);
}

skippy_sched_code skippy_prefix_store_touch(skippy_prefix_store *p, uint32_t id)
{
    if (!p) return SKIPPY_SCHED_INVALID;
    if (!resident(p, id)) return fail(p, SKIPPY_SCHED_INVALID, "entry %u is not resident", id);
    stamp(p, id);
    return SKIPPY_SCHED_OK;
}

skippy_sched_code skippy_prefix_store_pin(skippy_prefix_store *p, uint32_t id)
{
    if (!p) return SKIPPY_SCHED_INVALID;
    if (!resident(p, id)) return fail(p, SKIPPY_SCHED_INVALID, "cannot pin entry %u: not resident", id);
    if (p->e[id].pins == UINT32_MAX) return fail(p, SKIPPY_SCHED_INVALID, "entry %u pinned too often", id);
    p->e[id].pins++;
    return SKIPPY_SCHED_OK;
}

skippy_sched_code skippy_prefix_store_unpin(skippy_prefix_store *p, uint32_t id)
{
    if (!p) return SKIPPY_SCHED_INVALID;
    if (!resident(p, id) || p->e[id].pins == 0)
        return fail(p, SKIPPY_SCHED_INVALID, "entry %u is not pinned", id);
    if (--p->e[id].pins == 0 && evictable(&p->e[id])) heap_push(p, id);
    return SKIPPY_SCHED_OK;
}

/* Removes a chosen (evictable) entry; the evicted list has room (reserved by the caller). */
static int evict(skippy_prefix_store *p, uint32_t id)
{
    sk_pentry *x = &p->e[id];
    int32_t *key = p->key; /* key_room(x->length) was reserved by the caller */
    key_of(p, id, key);
    uint64_t handle;
    int rc = sk_radix_remove(p->radix, SK_RADIX_RESIDENT, NS, NS_LEN, key, x->length, &handle);
    if (rc == SK_RADIX_NO_MEMORY) return SKIPPY_SCHED_NO_MEMORY;
    journal_add(p, key, x->length, resident_lcp(p, key, x->length));
    skippy_prefix_eviction *ev = &p->evicted[p->evicted_len++];
    ev->entry = id;
    ev->holder = x->holder;
    ev->handle = x->handle;
    ev->start = x->start;
    ev->length = x->length;
    x->alive = false;
    x->gen++;
    if (x->holder != NONE) p->holders[p->holders_len++] = x->holder - p->cfg.first_holder_id;
    x->holder = NONE;
    uint32_t up = x->parent;
    if (up != NONE) {
        p->e[up].children--;
        if (evictable(&p->e[up])) heap_push(p, up);
    }
    p->st.used_tokens -= x->length - x->start;
    p->st.entries--;
    p->st.evictions++;
    p->st.evicted_tokens += x->length - x->start;
    p->epoch++;
    x->next_free = p->free_head;
    p->free_head = id;
    return 0;
}

static bool over(const skippy_prefix_store *p, uint64_t freed, size_t chosen, uint64_t need)
{
    bool tokens = p->cfg.capacity_tokens != UINT64_MAX &&
                  p->st.used_tokens - freed + need > p->cfg.capacity_tokens;
    bool slots = bounded_holders(p) && p->st.entries - chosen + 1 > p->cfg.holder_slots;
    return tokens || slots;
}

/*
 * Chooses victims (least recently used evictable entries, never `parent`) until `need` tokens
 * and one holder slot fit; a victim's parent becomes a candidate once all its resident children
 * are chosen. Returns the victim count, or SIZE_MAX when no room can be made (the heap is then
 * as it was). Victims are left in p->victims; the caller evicts them in that order.
 */
static size_t choose_victims(skippy_prefix_store *p, uint64_t need, uint32_t parent)
{
    if (p->cfg.capacity_tokens != UINT64_MAX && need > p->cfg.capacity_tokens) return SIZE_MAX;
    if (bounded_holders(p) && p->cfg.holder_slots < 1) return SIZE_MAX;
    uint32_t round = ++p->round;
    size_t chosen = 0, npopped = 0;
    uint64_t freed = 0;
    while (over(p, freed, chosen, need)) {
        uint32_t victim = NONE;
        while (p->heap_len) {
            sk_heap_item it = heap_pop(p);
            sk_pentry *x = &p->e[it.entry];
            uint32_t gone = x->gone_round == round ? x->gone : 0;
            if (x->gen != it.gen || !x->alive || x->pins || x->last_used != it.last_used ||
                x->mark == round || x->children - gone)
                continue; /* stale */
            p->popped[npopped++] = it;
            if (it.entry == parent) continue;
            victim = it.entry;
            break;
        }
        if (victim == NONE) {
            for (size_t i = 0; i < npopped; i++) {
                p->heap[p->heap_len] = p->popped[i];
                heap_up(p->heap, p->heap_len++);
            }
            return SIZE_MAX;
        }
        sk_pentry *v = &p->e[victim];
        v->mark = round;
        p->victims[chosen++] = victim;
        freed += v->length - v->start;
        uint32_t up = v->parent;
        if (up != NONE) {
            sk_pentry *u = &p->e[up];
            if (u->gone_round != round) { u->gone_round = round; u->gone = 0; }
            u->gone++;
            if (u->children == u->gone && u->pins == 0) {
                sk_heap_item it = {u->last_used, u->serial, up, u->gen};
                p->heap[p->heap_len] = it; /* room: heap_reserve */
                heap_up(p->heap, p->heap_len++);
            }
        }
    }
    /* Candidates looked at but not chosen (the new entry's parent) go back on the heap. */
    for (size_t i = 0; i < npopped; i++) {
        if (p->e[p->popped[i].entry].mark == round) continue;
        p->heap[p->heap_len] = p->popped[i];
        heap_up(p->heap, p->heap_len++);
    }
    return chosen;
}

skippy_sched_code skippy_prefix_store_insert(skippy_prefix_store *p, const int32_t *tokens,
                                             size_t n, uint32_t parent, uint64_t handle,
                                             uint32_t *out_entry)
{
    if (out_entry) *out_entry = NONE;
    if (!p) return SKIPPY_SCHED_INVALID;
    /* Validation, then the reservations, change nothing (not even the list of the last
     * evictions, which is emptied only once this insert is sure to be made or refused). */
    if (!tokens && n)
        return fail(p, SKIPPY_SCHED_INVALID, "key tokens are NULL with a count of %zu", n);
    if (n == 0) return fail(p, SKIPPY_SCHED_INVALID, "a key must hold at least one token");
    for (size_t i = 0; i < n; i++)
        if (tokens[i] < 0) return fail(p, SKIPPY_SCHED_INVALID, "key token %zu is negative", i);
    size_t start = 0;
    if (parent != NONE) {
        if (!resident(p, parent))
            return fail(p, SKIPPY_SCHED_INVALID, "parent entry %u is not resident", parent);
        start = p->e[parent].length;
        if (n <= start)
            return fail(p, SKIPPY_SCHED_INVALID, "key of %zu tokens does not extend its parent "
                        "(%zu tokens)", n, start);
        if (skippy_prefix_store_find(p, tokens, start) != parent)
            return fail(p, SKIPPY_SCHED_INVALID, "the parent's key is not a prefix of the key");
    }
    /* Checked: from here on the evictions listed are this insert's (none if it fails before
     * evicting); a refused call above leaves the last insert's list as it was. */
    p->evicted_len = 0;
    uint32_t existing = skippy_prefix_store_find(p, tokens, n);
    if (existing != NONE) {
        stamp(p, existing);
        if (out_entry) *out_entry = existing;
        return SKIPPY_SCHED_OK;
    }
    /* Reserve everything first: after victims are chosen only the radix can fail. */
    size_t entries = p->st.entries + 1;
    if (heap_reserve(p, entries + 1) ||
        sk_grow((void **)&p->popped, &p->popped_cap, p->heap_cap, sizeof(sk_heap_item)) ||
        sk_grow((void **)&p->victims, &p->victims_cap, entries, sizeof(uint32_t)) ||
        sk_grow((void **)&p->evicted, &p->evicted_cap, entries, sizeof(skippy_prefix_eviction)) ||
        key_room(p, n))
        return fail(p, SKIPPY_SCHED_NO_MEMORY, "out of memory inserting a prefix");
    /* the key scratch holds the longest key ever resident, so victims' keys fit (key_room(n)
     * above covers this one) */
    if (p->heap_len + entries + 2 > p->heap_cap) heap_compact(p);
    uint32_t id = p->free_head;
    if (id == NONE) {
        size_t old_cap = p->e_cap;
        if (p->e_len == NONE - 1 ||
            sk_grow((void **)&p->e, &p->e_cap, (size_t)p->e_len + 1, sizeof(sk_pentry)))
            return fail(p, SKIPPY_SCHED_NO_MEMORY, "out of memory inserting a prefix");
        /* Slots are zeroed once, when the array grows, not when taken: the slot past e_len
         * keeps the segment buffer of an insert that was refused (or failed) after sizing it,
         * and the next fresh insert reuses that buffer instead of losing it. */
        if (p->e_cap > old_cap)
            memset(&p->e[old_cap], 0, (p->e_cap - old_cap) * sizeof(sk_pentry));
        id = p->e_len; /* taken below, once nothing can fail */
    }
    sk_pentry *x = &p->e[id];
    if (sk_grow((void **)&x->seg, &x->seg_cap, n - start, sizeof(int32_t)))
        return fail(p, SKIPPY_SCHED_NO_MEMORY, "out of memory inserting a prefix");
    size_t chosen = choose_victims(p, n - start, parent);
    if (chosen == SIZE_MAX) {
        p->st.refused_inserts++;
        return SKIPPY_SCHED_OK;
    }
    for (size_t i = 0; i < chosen; i++)
        if (evict(p, p->victims[i])) {
            /* The victims left stay evictable: back on the heap they go. */
            for (size_t k = i; k < chosen; k++)
                if (evictable(&p->e[p->victims[k]])) heap_push(p, p->victims[k]);
            return fail(p, SKIPPY_SCHED_NO_MEMORY, "out of memory evicting (evictions so far are "
                        "reported by skippy_prefix_store_evicted)");
        }
    size_t lcp = resident_lcp(p, tokens, n); /* before it is resident itself */
    uint64_t prev;
    int rc = sk_radix_insert(p->radix, SK_RADIX_RESIDENT, 0, NS, NS_LEN, tokens, n, n - start,
                             id, &prev);
    if (rc != SK_RADIX_OK)
        return fail(p, SKIPPY_SCHED_NO_MEMORY, "out of memory inserting a prefix (evictions so "
                    "far are reported by skippy_prefix_store_evicted)");
    /* Commit. (evict() may have pushed the free list: re-read it.) */
    x = &p->e[id];
    if (id == p->e_len) {
        p->e_len++;
    } else {
        /* id was the free head before the evictions; evictions push onto the head, so unlink
         * id wherever it now sits */
        uint32_t *link = &p->free_head;
        while (*link != id) link = &p->e[*link].next_free;
        *link = x->next_free;
    }
    memcpy(x->seg, tokens + start, (n - start) * sizeof(int32_t));
    x->start = start;
    x->length = n;
    x->parent = parent;
    x->children = 0;
    x->pins = 0;
    x->handle = handle;
    x->serial = ++p->serial;
    x->alive = true;
    x->holder = NONE;
    if (bounded_holders(p)) x->holder = p->cfg.first_holder_id + p->holders[--p->holders_len];
    if (parent != NONE) p->e[parent].children++;
    p->st.used_tokens += n - start;
    p->st.entries++;
    p->st.inserts++;
    p->epoch++;
    journal_add(p, tokens, n, lcp);
    stamp(p, id);
    if (out_entry) *out_entry = id;
    return SKIPPY_SCHED_OK;
}

uint32_t skippy_prefix_store_evict_one(skippy_prefix_store *p)
{
    if (!p) return NONE;
    p->evicted_len = 0;
    if (sk_grow((void **)&p->evicted, &p->evicted_cap, 1, sizeof(skippy_prefix_eviction))) return NONE;
    while (p->heap_len) {
        sk_heap_item it = p->heap[0];
        if (!item_valid(p, &it)) {
            heap_pop(p);
            continue;
        }
        if (key_room(p, p->e[it.entry].length)) return NONE;
        heap_pop(p);
        if (evict(p, it.entry)) return NONE;
        return it.entry;
    }
    return NONE;
}
