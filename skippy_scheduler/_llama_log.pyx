# cython: language_level=3
"""llama.cpp's log sink, in C: no Python runs when llama.cpp logs.

llama.cpp and ggml log through one process-wide function pointer, called from whichever thread
logs: the loading thread, a backend's worker threads, a GPU backend's initialisation (which can
run before a model is loaded and, at exit, after the interpreter has begun to shut down). A
Python callback there takes the GIL from threads Python never made, at moments Python may not be
able to run; this sink never touches the interpreter. It keeps warnings and errors (and their
continuation lines) in a ring of `RING` lines under a mutex, counts every message by level, and
optionally echoes what it receives to stderr; Python reads the ring when it builds an error
message.

`flood(threads, messages)` calls the sink from C threads at once (the test of its locking).
"""
from libc.stdint cimport uintptr_t

cdef extern from *:
    """
    #include <pthread.h>
    #include <stdio.h>
    #include <string.h>

    #define SK_LOG_RING 64
    #define SK_LOG_LINE 512
    #define SK_LOG_LEVELS 6   /* ggml: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5 */

    static pthread_mutex_t sk_log_mutex = PTHREAD_MUTEX_INITIALIZER;
    static char sk_log_lines[SK_LOG_RING][SK_LOG_LINE];
    static unsigned long long sk_log_kept;                 /* lines ever written to the ring */
    static unsigned long long sk_log_seen[SK_LOG_LEVELS];  /* messages received, by level */
    static int sk_log_echo_level;                          /* echo levels >= this (0: none) */
    static __thread int sk_log_last_level;  /* this thread's last level other than CONT */

    static void sk_log_sink(int level, const char *text, void *user_data) {
        int effective, keep, echo;
        size_t n;
        (void) user_data;
        if (text == NULL) return;
        /* A continuation line belongs to the message before it on the same thread. */
        if (level == 5) {
            effective = sk_log_last_level;
        } else {
            effective = level;
            sk_log_last_level = level;
        }
        keep = effective == 3 || effective == 4;
        pthread_mutex_lock(&sk_log_mutex);
        sk_log_seen[(level >= 0 && level < SK_LOG_LEVELS) ? level : 0]++;
        echo = sk_log_echo_level > 0 && effective >= sk_log_echo_level;
        if (keep) {
            char *line = sk_log_lines[sk_log_kept % SK_LOG_RING];
            n = strlen(text);
            if (n >= SK_LOG_LINE) n = SK_LOG_LINE - 1;
            memcpy(line, text, n);
            line[n] = 0;
            sk_log_kept++;
        }
        pthread_mutex_unlock(&sk_log_mutex);
        if (echo) {
            fputs(text, stderr);
        }
    }

    static void *sk_log_sink_address(void) { return (void *) &sk_log_sink; }

    struct sk_log_flood_arg { int id; int messages; };

    static void *sk_log_flood_thread(void *p) {
        struct sk_log_flood_arg *a = (struct sk_log_flood_arg *) p;
        char buf[1200];
        int i, levels[5] = {2, 3, 5, 4, 1};
        for (i = 0; i < a->messages; i++) {
            int level = levels[i % 5];
            size_t len = (size_t) (i % 7 == 0 ? sizeof(buf) - 1 : 40);
            memset(buf, 'a' + a->id % 26, len);
            snprintf(buf, 32, "t%d m%d l%d ", a->id, i, level);
            buf[strlen(buf)] = 'x';
            buf[len - 1] = '\\n';
            buf[len] = 0;
            sk_log_sink(level, buf, NULL);
            sk_log_sink(level, NULL, NULL);
        }
        return NULL;
    }

    /* Calls the sink from `threads` C threads at once; returns the threads that ran. */
    static int sk_log_flood(int threads, int messages) {
        pthread_t tids[64];
        struct sk_log_flood_arg args[64];
        int i, started = 0;
        if (threads > 64) threads = 64;
        for (i = 0; i < threads; i++) {
            args[i].id = i;
            args[i].messages = messages;
            if (pthread_create(&tids[i], NULL, sk_log_flood_thread, &args[i]) == 0) started++;
            else break;
        }
        for (i = 0; i < started; i++) pthread_join(tids[i], NULL);
        return started;
    }

    static void sk_log_counts(unsigned long long *seen, unsigned long long *kept) {
        int i;
        pthread_mutex_lock(&sk_log_mutex);
        for (i = 0; i < SK_LOG_LEVELS; i++) seen[i] = sk_log_seen[i];
        *kept = sk_log_kept;
        pthread_mutex_unlock(&sk_log_mutex);
    }

    /* Copies the last n ring lines (oldest first) into out[n][SK_LOG_LINE]; returns how many. */
    static int sk_log_recent(int n, char (*out)[SK_LOG_LINE]) {
        int i, have;
        unsigned long long first;
        pthread_mutex_lock(&sk_log_mutex);
        have = sk_log_kept < SK_LOG_RING ? (int) sk_log_kept : SK_LOG_RING;
        if (n > have) n = have;
        first = sk_log_kept - (unsigned long long) n;
        for (i = 0; i < n; i++) {
            memcpy(out[i], sk_log_lines[(first + (unsigned long long) i) % SK_LOG_RING],
                   SK_LOG_LINE);
        }
        pthread_mutex_unlock(&sk_log_mutex);
        return n;
    }

    static void sk_log_set_echo(int level) {
        pthread_mutex_lock(&sk_log_mutex);
        sk_log_echo_level = level;
        pthread_mutex_unlock(&sk_log_mutex);
    }
    """
    int SK_LOG_RING
    int SK_LOG_LINE
    void *sk_log_sink_address() nogil
    int sk_log_flood(int threads, int messages) nogil
    void sk_log_counts(unsigned long long *seen, unsigned long long *kept) nogil
    int sk_log_recent(int n, char (*out)[512]) nogil
    void sk_log_set_echo(int level) nogil

RING = SK_LOG_RING
LINE = SK_LOG_LINE


def sink_address() -> int:
    """The address of the C sink, to hand to `llama_log_set` (a `ggml_log_callback`)."""
    return <uintptr_t> sk_log_sink_address()


def recent(n: int = 8) -> list:
    """The last `n` (at most `RING`) warning/error lines, oldest first, each cut at `LINE` - 1
    bytes."""
    cdef char buf[64][512]
    cdef int want = max(0, min(int(n), SK_LOG_RING))
    cdef int got
    with nogil:
        got = sk_log_recent(want, buf)
    return [(<bytes> buf[i]).decode("utf-8", "replace") for i in range(got)]


def counts() -> tuple:
    """(messages received by level 0..5, lines ever kept in the ring)."""
    cdef unsigned long long seen[6]
    cdef unsigned long long kept
    sk_log_counts(seen, &kept)
    return tuple(int(seen[i]) for i in range(6)), int(kept)


def set_echo(level: int) -> None:
    """Echo messages of `level` and above to stderr (ggml levels: 1 debug, 2 info, 3 warn,
    4 error; 0: none, the default)."""
    sk_log_set_echo(int(level))


def flood(threads: int, messages: int) -> int:
    """Call the sink `messages` times from each of `threads` C threads at once (at most 64),
    with every level, lines longer than `LINE` and NULL texts; returns the threads that ran."""
    cdef int t = max(0, min(int(threads), 64))
    cdef int m = max(0, int(messages))
    cdef int started
    with nogil:
        started = sk_log_flood(t, m)
    return started
