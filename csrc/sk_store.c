/*
 * Sequence slots and the id index. A slot keeps its id and token buffers when its sequence
 * leaves, so a later occupant reuses the memory. The index maps id bytes to the slot of a
 * waiting or active sequence (finished ones are unindexed at once, so an id can be reused).
 */
#include <stdlib.h>
#include <string.h>

#include "sk_internal.h"

#define MAP_EMPTY 0u
#define MAP_TOMB UINT32_MAX

uint64_t sk_hash_id(const char *id, size_t len)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < len; i++) {
        h ^= (unsigned char)id[i];
        h *= 1099511628211ull;
    }
    return h;
}

int sk_store_init(skippy_scheduler *s)
{
    s->map_cap = 64;
    s->map = calloc(s->map_cap, sizeof(uint32_t));
    return s->map ? 0 : -1;
}

void sk_store_free(skippy_scheduler *s)
{
    for (uint32_t i = 0; i < s->seq_cap; i++) {
        free(s->seqs[i].id);
        free(s->seqs[i].tokens);
    }
    free(s->seqs_raw);
    free(s->free_slots);
    free(s->map);
}

uint32_t sk_store_find(const skippy_scheduler *s, const char *id, size_t len, uint64_t hash)
{
    size_t mask = s->map_cap - 1;
    for (size_t i = (size_t)hash & mask;; i = (i + 1) & mask) {
        uint32_t e = s->map[i];
        if (e == MAP_EMPTY) return SK_NO_SLOT;
        if (e == MAP_TOMB) continue;
        const sk_seq *q = &s->seqs[e - 1];
        /* (len 0: the empty id, whose bytes may be a NULL pointer) */
        if (q->id_hash == hash && q->id_len == len && (len == 0 || memcmp(q->id, id, len) == 0))
            return e - 1;
    }
}

static void map_insert_raw(uint32_t *map, size_t cap, uint64_t hash, uint32_t slot)
{
    size_t mask = cap - 1;
    size_t i = (size_t)hash & mask;
    while (map[i] != MAP_EMPTY && map[i] != MAP_TOMB) i = (i + 1) & mask;
    map[i] = slot + 1;
}

static int map_rehash(skippy_scheduler *s, size_t cap)
{
    uint32_t *m = calloc(cap, sizeof(uint32_t));
    if (!m) return -1;
    size_t live = 0;
    for (size_t i = 0; i < s->map_cap; i++) {
        uint32_t e = s->map[i];
        if (e != MAP_EMPTY && e != MAP_TOMB) {
            map_insert_raw(m, cap, s->seqs[e - 1].id_hash, e - 1);
            live++;
        }
    }
    free(s->map);
    s->map = m;
    s->map_cap = cap;
    s->map_fill = live;
    return 0;
}

int sk_store_reserve(skippy_scheduler *s)
{
    /* Keep the index at most half full (tombstones included) so probes stay short. */
    if ((s->map_fill + 1) * 2 > s->map_cap) {
        size_t live = 0;
        for (size_t i = 0; i < s->map_cap; i++)
            if (s->map[i] != MAP_EMPTY && s->map[i] != MAP_TOMB) live++;
        size_t cap = s->map_cap;
        while ((live + 1) * 4 > cap) cap *= 2;
        if (map_rehash(s, cap)) return -1;
    }
    if (s->free_len == 0) {
        if (s->seq_cap == SK_NO_SLOT - 1) return -1;
        uint32_t old_cap = s->seq_cap;
        /* Doubling as sk_grow does, but slot numbers must stay below SK_NO_SLOT. */
        size_t wanted = sk_grown_capacity(old_cap, (size_t)old_cap + 1, 16);
        uint32_t new_cap = wanted > SK_NO_SLOT - 1 ? SK_NO_SLOT - 1 : (uint32_t)wanted;
        /* Aligned by hand (C99 has no aligned realloc) so each slot's hot fields are one line. */
#if SIZE_MAX / 256 <= UINT32_MAX /* only 32-bit size_t can overflow here (sk_seq < 256 B) */
        if ((size_t)new_cap > (SIZE_MAX - SK_SEQ_ALIGN) / sizeof(sk_seq)) return -1;
#endif
        void *raw = malloc((size_t)new_cap * sizeof(sk_seq) + SK_SEQ_ALIGN);
        if (!raw) return -1;
        sk_seq *seqs = (sk_seq *)(((uintptr_t)raw + SK_SEQ_ALIGN - 1) & ~(uintptr_t)(SK_SEQ_ALIGN - 1));
        if (old_cap) memcpy(seqs, s->seqs, (size_t)old_cap * sizeof(sk_seq));
        memset(seqs + old_cap, 0, (size_t)(new_cap - old_cap) * sizeof(sk_seq));
        free(s->seqs_raw);
        s->seqs_raw = raw;
        s->seqs = seqs;
        if (sk_resize((void **)&s->free_slots, new_cap, sizeof(uint32_t))) return -1;
        s->seq_cap = new_cap;
        /* Lowest slots are handed out first. */
        for (uint32_t i = new_cap; i > old_cap; i--) s->free_slots[s->free_len++] = i - 1;
    }
    return 0;
}

uint32_t sk_store_take(skippy_scheduler *s) { return s->free_slots[--s->free_len]; }

void sk_store_index(skippy_scheduler *s, uint32_t slot)
{
    map_insert_raw(s->map, s->map_cap, s->seqs[slot].id_hash, slot);
    s->map_fill++;
}

void sk_store_unindex(skippy_scheduler *s, uint32_t slot)
{
    size_t mask = s->map_cap - 1;
    for (size_t i = (size_t)s->seqs[slot].id_hash & mask;; i = (i + 1) & mask) {
        if (s->map[i] == MAP_EMPTY) return;
        if (s->map[i] == slot + 1) {
            /* A following empty cell lets us clear instead of leaving a tombstone. */
            if (s->map[(i + 1) & mask] == MAP_EMPTY) {
                s->map[i] = MAP_EMPTY;
                s->map_fill--;
            } else {
                s->map[i] = MAP_TOMB;
            }
            return;
        }
    }
}

void sk_store_release(skippy_scheduler *s, uint32_t slot)
{
    s->seqs[slot].where = SK_WHERE_FREE;
    s->free_slots[s->free_len++] = slot;
}
