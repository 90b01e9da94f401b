/* Reads plan frames from files and prints what sk_wire_decode_plan makes of them, one line per
 * file: "ok" with the decoded fields and where each array lies in the frame (offsets into the
 * buffer: the view points into it, nothing is copied), or "refused <status> <why>" and whether
 * the view was left as it was. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sk_wire.h"

static void print_u32(const char *name, const uint32_t *a, uint32_t n) {
    uint32_t i;
    printf(" %s=", name);
    for (i = 0; i < n; i++) printf("%s%u", i ? "," : "", (unsigned)a[i]);
}

static void print_i32(const char *name, const int32_t *a, uint32_t n) {
    uint32_t i;
    printf(" %s=", name);
    for (i = 0; i < n; i++) printf("%s%d", i ? "," : "", (int)a[i]);
}

int main(int argc, char **argv) {
    int f;
    for (f = 1; f < argc; f++) {
        FILE *fh = fopen(argv[f], "rb");
        long len;
        uint64_t *store;
        unsigned char *buf;
        sk_wire_plan_view view, before;
        const char *why = NULL;
        sk_wire_status st;
        uint32_t i;
        if (!fh) return 2;
        fseek(fh, 0, SEEK_END);
        len = ftell(fh);
        fseek(fh, 0, SEEK_SET);
        /* 8-byte aligned, and no larger than the frame rounded up to 8: reading past the
           frame reaches the sanitizer's red zone instead of spare zeros. */
        store = calloc(((size_t)len + 7) / 8 + (len == 0), 8);
        if (!store) return 2;
        buf = (unsigned char *)store;
        if (len && fread(buf, 1, (size_t)len, fh) != (size_t)len) return 2;
        fclose(fh);
        memset(&view, 0xA5, sizeof view);
        memcpy(&before, &view, sizeof view);
        st = sk_wire_decode_plan(buf, (size_t)len, &view, &why);
        if (st != SK_WIRE_OK) {
            printf("refused %d %s untouched=%d\n", (int)st, why,
                   memcmp(&before, &view, sizeof view) == 0);
        } else {
            printf("ok step=%llu serial=%llu rows=%u tokens=%u deferred=%u release=%u sample=%u",
                   (unsigned long long)view.step, (unsigned long long)view.serial,
                   (unsigned)view.n_rows, (unsigned)view.n_tokens, (unsigned)view.n_deferred,
                   (unsigned)view.n_release, (unsigned)view.n_sample);
            print_u32("offsets", view.row_offsets, view.n_rows + 1);
            print_i32("lanes", view.row_lanes, view.n_rows);
            print_i32("restore", view.row_restore, view.n_rows);
            printf(" flags=");
            for (i = 0; i < view.n_rows; i++) printf("%s%u", i ? "," : "", view.row_flags[i]);
            print_i32("tokens", view.tokens, view.n_tokens);
            print_i32("positions", view.positions, view.n_tokens);
            print_u32("deferred_rows", view.deferred_rows, view.n_deferred);
            printf(" deferred_steps=");
            for (i = 0; i < view.n_deferred; i++)
                printf("%s%llu", i ? "," : "", (unsigned long long)view.deferred_steps[i]);
            print_u32("deferred_index", view.deferred_index, view.n_deferred);
            print_i32("release", view.release_lanes, view.n_release);
            printf(" at_tokens=%ld at_release=%ld\n",
                   (long)((const unsigned char *)view.tokens - buf),
                   (long)((const unsigned char *)view.release_lanes - buf));
        }
        free(store);
    }
    /* A misaligned buffer is refused too. */
    {
        uint64_t store[16];
        sk_wire_plan_view view;
        const char *why = NULL;
        memset(store, 0, sizeof store);
        printf("misaligned %d\n", (int)sk_wire_decode_plan((unsigned char *)store + 4, 64, &view, &why));
    }
    return 0;
}
