/* The stage plan wire format (docs/wire-format.md): a decoder for native stage runtimes.
 *
 * A plan frame is one contiguous little-endian buffer: a 64-byte header, then the plan's arrays,
 * each starting on an 8-byte boundary. `sk_wire_decode_plan` checks a frame completely and fills
 * a view whose pointers point into the frame itself: nothing is copied, and the view is valid as
 * long as the frame's memory is. A frame that fails any check leaves the view untouched.
 */
#ifndef SK_WIRE_H
#define SK_WIRE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SK_WIRE_PLAN_MAGIC 0x57504b53u /* "SKPW" read as a little-endian uint32 */
#define SK_WIRE_VERSION 1u
#define SK_WIRE_HEADER_BYTES 64u
#define SK_WIRE_ALIGN 8u

/* Row flag bits. */
#define SK_WIRE_ROW_SAMPLE_LAST 0x01u /* the row's last token is sampled */
#define SK_WIRE_ROW_PHASE_MASK 0x06u  /* skippy_phase << 1: prefill 0, recompute 1, decode 2 */
#define SK_WIRE_ROW_NEW 0x08u         /* the row brings its sequence in (first row on the lane) */
#define SK_WIRE_ROW_KNOWN 0x0fu

typedef enum sk_wire_status {
    SK_WIRE_OK = 0,
    SK_WIRE_TRUNCATED = 1,   /* shorter than the header or than the header's total size */
    SK_WIRE_BAD_MAGIC = 2,   /* not a plan frame */
    SK_WIRE_BAD_VERSION = 3, /* a version or header size this decoder does not read */
    SK_WIRE_BAD_SIZE = 4,    /* counts and total size disagree, or trailing bytes */
    SK_WIRE_BAD_VALUE = 5,   /* offsets, flags, lanes or table entries out of range */
    SK_WIRE_MISALIGNED = 6,  /* the buffer does not start on an 8-byte boundary */
    SK_WIRE_UNSUPPORTED = 7  /* a big-endian host */
} sk_wire_status;

/* A decoded plan: pointers into the frame (row index = work index everywhere). */
typedef struct sk_wire_plan_view {
    uint64_t step;                   /* the scheduler's step of the plan */
    uint64_t serial;                 /* the plan's serial number */
    uint32_t n_rows;                 /* rows (one per scheduled sequence) */
    uint32_t n_tokens;               /* entries of the token and position arenas */
    uint32_t n_deferred;             /* deferred-input table entries */
    uint32_t n_release;              /* lanes to free before the rows run */
    uint32_t n_sample;               /* rows with SK_WIRE_ROW_SAMPLE_LAST */
    const uint32_t *row_offsets;     /* n_rows + 1: row r holds tokens [off[r], off[r+1]) */
    const int32_t *row_lanes;        /* n_rows: the llama sequence id (lane) of each row */
    const int32_t *row_restore;      /* n_rows: restore holder of a new row, -1 for none */
    const uint8_t *row_flags;        /* n_rows: SK_WIRE_ROW_* bits */
    const int32_t *tokens;           /* n_tokens: input token ids */
    const int32_t *positions;        /* n_tokens: position of each token in its sequence */
    const uint32_t *deferred_rows;   /* n_deferred: rows whose one input token is deferred */
    const uint64_t *deferred_steps;  /* n_deferred: step of the plan that samples it */
    const uint32_t *deferred_index;  /* n_deferred: work index of the row in that plan */
    const int32_t *release_lanes;    /* n_release: lanes whose KV is freed first */
} sk_wire_plan_view;

/* Check `frame` (len bytes) and fill `*out`; `*why`, when not NULL, gets a static message. */
sk_wire_status sk_wire_decode_plan(const void *frame, size_t len, sk_wire_plan_view *out,
                                   const char **why);

/* Bytes of a frame with these counts; 0 for n_rows == UINT32_MAX, whose row offsets cannot
 * be counted. Counts the decoder refuses for what they say (more rows than tokens, more
 * deferred inputs than rows) still get the size such a frame would have. */
uint64_t sk_wire_plan_bytes(uint32_t n_rows, uint32_t n_tokens, uint32_t n_deferred,
                            uint32_t n_release);

#ifdef __cplusplus
}
#endif
#endif /* SK_WIRE_H */
