/* Decoder of the stage plan wire format (abi/sk_wire.h, docs/wire-format.md).
 *
 * Every check runs before `*out` is written, so a refused frame changes nothing. Counts are
 * bounded by the header's total size before any array is touched, and all size arithmetic is
 * done in uint64_t on 32-bit counts, which cannot overflow. */
#include "sk_wire.h"

#include <string.h>

static uint64_t pad8(uint64_t n) { return (n + 7u) & ~(uint64_t)7u; }

static uint32_t rd32(const unsigned char *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static uint64_t rd64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static int little_endian(void) {
    const uint16_t one = 1;
    unsigned char b;
    memcpy(&b, &one, 1);
    return b == 1;
}

uint64_t sk_wire_plan_bytes(uint32_t n_rows, uint32_t n_tokens, uint32_t n_deferred,
                            uint32_t n_release) {
    uint64_t r = n_rows, t = n_tokens, d = n_deferred;
    if (n_rows == UINT32_MAX) return 0;
    return SK_WIRE_HEADER_BYTES + pad8(4 * (r + 1)) + 2 * pad8(4 * r) + pad8(r) + 2 * pad8(4 * t)
           + pad8(4 * d) + 8 * d + pad8(4 * d) + pad8(4 * (uint64_t)n_release);
}

static sk_wire_status fail(const char **why, const char *msg, sk_wire_status st) {
    if (why) *why = msg;
    return st;
}

sk_wire_status sk_wire_decode_plan(const void *frame, size_t len, sk_wire_plan_view *out,
                                   const char **why) {
    const unsigned char *b = (const unsigned char *)frame;
    sk_wire_plan_view v;
    uint64_t at, total;
    uint32_t r, j, n_sample = 0;
    if (why) *why = "ok";
    if (!little_endian()) return fail(why, "big-endian hosts are not supported", SK_WIRE_UNSUPPORTED);
    if (frame == NULL || out == NULL) return fail(why, "NULL frame or view", SK_WIRE_BAD_VALUE);
    if (((uintptr_t)frame & (SK_WIRE_ALIGN - 1)) != 0)
        return fail(why, "frame is not 8-byte aligned", SK_WIRE_MISALIGNED);
    if (len < SK_WIRE_HEADER_BYTES) return fail(why, "frame shorter than its header", SK_WIRE_TRUNCATED);
    if (rd32(b) != SK_WIRE_PLAN_MAGIC) return fail(why, "not a plan frame (magic)", SK_WIRE_BAD_MAGIC);
    if ((rd32(b + 4) & 0xffffu) != SK_WIRE_VERSION || (rd32(b + 4) >> 16) != SK_WIRE_HEADER_BYTES)
        return fail(why, "unknown version or header size", SK_WIRE_BAD_VERSION);
    total = rd64(b + 8);
    if (total > len) return fail(why, "frame shorter than its stated size", SK_WIRE_TRUNCATED);
    if (total < len) return fail(why, "bytes after the stated frame size", SK_WIRE_BAD_SIZE);
    memset(&v, 0, sizeof v);
    v.step = rd64(b + 16);
    v.serial = rd64(b + 24);
    v.n_rows = rd32(b + 32);
    v.n_tokens = rd32(b + 36);
    v.n_deferred = rd32(b + 40);
    v.n_release = rd32(b + 44);
    if (rd32(b + 48) != 0 || rd32(b + 52) != 0 || rd64(b + 56) != 0)
        return fail(why, "reserved header fields are not zero", SK_WIRE_BAD_VALUE);
    if (v.n_rows > v.n_tokens || v.n_deferred > v.n_rows)
        return fail(why, "more rows than tokens or deferred entries than rows", SK_WIRE_BAD_SIZE);
    if (sk_wire_plan_bytes(v.n_rows, v.n_tokens, v.n_deferred, v.n_release) != total)
        return fail(why, "counts disagree with the frame size", SK_WIRE_BAD_SIZE);
    at = SK_WIRE_HEADER_BYTES;
    v.row_offsets = (const uint32_t *)(b + at); at += pad8(4 * ((uint64_t)v.n_rows + 1));
    v.row_lanes = (const int32_t *)(b + at); at += pad8(4 * (uint64_t)v.n_rows);
    v.row_restore = (const int32_t *)(b + at); at += pad8(4 * (uint64_t)v.n_rows);
    v.row_flags = b + at; at += pad8(v.n_rows);
    v.tokens = (const int32_t *)(b + at); at += pad8(4 * (uint64_t)v.n_tokens);
    v.positions = (const int32_t *)(b + at); at += pad8(4 * (uint64_t)v.n_tokens);
    v.deferred_rows = (const uint32_t *)(b + at); at += pad8(4 * (uint64_t)v.n_deferred);
    v.deferred_steps = (const uint64_t *)(b + at); at += 8 * (uint64_t)v.n_deferred;
    v.deferred_index = (const uint32_t *)(b + at); at += pad8(4 * (uint64_t)v.n_deferred);
    v.release_lanes = (const int32_t *)(b + at);
    if (v.row_offsets[0] != 0 || v.row_offsets[v.n_rows] != v.n_tokens)
        return fail(why, "row offsets do not span the token arena", SK_WIRE_BAD_VALUE);
    for (r = 0; r < v.n_rows; r++) {
        uint32_t a = v.row_offsets[r], e = v.row_offsets[r + 1];
        if (e <= a) return fail(why, "a row without tokens (offsets not increasing)", SK_WIRE_BAD_VALUE);
        if (e > v.n_tokens) return fail(why, "a row offset past the token arena", SK_WIRE_BAD_VALUE);
        if (v.row_lanes[r] < 0 || v.row_restore[r] < -1)
            return fail(why, "a negative lane or restore holder", SK_WIRE_BAD_VALUE);
        if (v.row_flags[r] & ~SK_WIRE_ROW_KNOWN || (v.row_flags[r] & SK_WIRE_ROW_PHASE_MASK) == 6)
            return fail(why, "unknown row flag bits", SK_WIRE_BAD_VALUE);
        if (v.row_restore[r] >= 0 && !(v.row_flags[r] & SK_WIRE_ROW_NEW))
            return fail(why, "a restore on a row that is not new", SK_WIRE_BAD_VALUE);
        n_sample += v.row_flags[r] & SK_WIRE_ROW_SAMPLE_LAST;
        for (j = a; j < e; j++) {
            if (v.positions[j] < 0) return fail(why, "a negative position", SK_WIRE_BAD_VALUE);
            if (j > a && (v.positions[j - 1] == INT32_MAX || v.positions[j] != v.positions[j - 1] + 1))
                return fail(why, "positions within a row are not consecutive", SK_WIRE_BAD_VALUE);
        }
    }
    for (j = 0; j < v.n_deferred; j++) {
        uint32_t row = v.deferred_rows[j];
        if (row >= v.n_rows || v.row_offsets[row + 1] - v.row_offsets[row] != 1)
            return fail(why, "a deferred entry names a row that is not a one-token row", SK_WIRE_BAD_VALUE);
    }
    for (j = 0; j < v.n_release; j++)
        if (v.release_lanes[j] < 0) return fail(why, "a negative lane to release", SK_WIRE_BAD_VALUE);
    v.n_sample = n_sample;
    *out = v;
    return SK_WIRE_OK;
}
