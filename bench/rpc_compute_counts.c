/* What a llama.cpp RPC server's device computes: every graph it runs (one per micro-batch of the
 * client's llama_decode) and the time the device spent in it, the tensor bytes set and read.
 * Preloaded into the RPC server, it writes the running totals to $RPC_COUNTS_OUT (one line:
 * graphs, compute ns, sets, bytes set, gets, bytes read) every few graphs:
 *
 *   cc -O2 -shared -fPIC -o rpc_compute_counts.so bench/rpc_compute_counts.c -ldl
 *   RPC_COUNTS_OUT=counts.txt LD_PRELOAD=$PWD/rpc_compute_counts.so \
 *       python -m skippy_scheduler.hosts.llama.rpc_server --port 50620 -t 1
 *
 * Then one load against one server on it (`bench/gpu_rounds.py --servers ours|theirs`), and the
 * file holds that load's totals (BENCHMARKS.md, "On a device that is not the host's"). The
 * server's calls into ggml are interposed by name; ggml is loaded by ctypes without making its
 * symbols global, so the real functions are looked up in libggml-base by its name. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static long long n_graphs, ns_compute, n_set, bytes_set, n_get, bytes_get;
static int (*real_compute)(void *, void *);
static void (*real_set)(void *, const void *, size_t, size_t);
static void (*real_get)(const void *, void *, size_t, size_t);

static void * ggml_function(const char * name) {
    void * f = dlsym(RTLD_NEXT, name);
    if (f) {
        return f;
    }
    void * lib = dlopen("libggml-base.so.0", RTLD_NOW | RTLD_NOLOAD);
    if (!lib) {
        lib = dlopen("libggml-base.so", RTLD_NOW | RTLD_NOLOAD);
    }
    f = lib ? dlsym(lib, name) : NULL;
    if (!f) {
        fprintf(stderr, "rpc_compute_counts: no %s in the process\n", name);
        abort();
    }
    return f;
}

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void write_totals(void) {
    const char * path = getenv("RPC_COUNTS_OUT");
    FILE * f = path ? fopen(path, "w") : NULL;
    if (!f) {
        return;
    }
    fprintf(f, "%lld %lld %lld %lld %lld %lld\n", n_graphs, ns_compute, n_set, bytes_set, n_get,
            bytes_get);
    fclose(f);
}

int ggml_backend_graph_compute(void * backend, void * graph) {
    if (!real_compute) {
        real_compute = (int (*)(void *, void *)) ggml_function("ggml_backend_graph_compute");
    }
    long long t0 = now_ns();
    int status = real_compute(backend, graph);
    ns_compute += now_ns() - t0;
    if (++n_graphs % 4 == 0) {
        write_totals();
    }
    return status;
}

void ggml_backend_tensor_set(void * tensor, const void * data, size_t offset, size_t size) {
    if (!real_set) {
        real_set = (void (*)(void *, const void *, size_t, size_t))
            ggml_function("ggml_backend_tensor_set");
    }
    n_set++;
    bytes_set += (long long) size;
    real_set(tensor, data, offset, size);
}

void ggml_backend_tensor_get(const void * tensor, void * data, size_t offset, size_t size) {
    if (!real_get) {
        real_get = (void (*)(const void *, void *, size_t, size_t))
            ggml_function("ggml_backend_tensor_get");
    }
    n_get++;
    bytes_get += (long long) size;
    real_get(tensor, data, offset, size);
}
