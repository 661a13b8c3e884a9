/*
 * Sustained memory read bandwidth, N threads (default 2).
 *
 * Allocates one buffer (default 1 GiB; it must be several times the CPU caches, and
 * bench_vs_llamacpp.py passes 8x their total, since some VMs report L3s of 480 MB), each thread
 * first-touches its own contiguous slice, then every pass all threads sum
 * their slices at once (pure streaming reads, vectorised by the compiler) and
 * the pass's wall time gives bytes/second. Prints the median and best pass.
 *
 *   gcc -O3 -march=native -pthread bandwidth.c -o bandwidth
 *   ./bandwidth [-t THREADS] [-s SIZE_MIB] [-r PASSES] [--json]
 *
 * GB here is 1e9 bytes.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define MAX_THREADS 256
#define MAX_PASSES 1000

typedef struct {
    const uint64_t *base;
    size_t n;      /* number of uint64 in this thread's slice */
    int passes;
    uint64_t sink;
    int id;
} task_t;

static pthread_barrier_t start_bar, end_bar;
static uint64_t *g_buf;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* 8 independent accumulators so the loop is bound by loads, not by add latency. */
static uint64_t __attribute__((noinline)) sum_slice(const uint64_t *restrict p, size_t n) {
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0, a5 = 0, a6 = 0, a7 = 0;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        a0 += p[i + 0]; a1 += p[i + 1]; a2 += p[i + 2]; a3 += p[i + 3];
        a4 += p[i + 4]; a5 += p[i + 5]; a6 += p[i + 6]; a7 += p[i + 7];
    }
    for (; i < n; i++) a0 += p[i];
    return a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7;
}

static void *worker(void *arg) {
    task_t *t = (task_t *)arg;
    /* first touch: the thread that reads a page also faults it in */
    uint64_t *w = (uint64_t *)t->base;
    for (size_t i = 0; i < t->n; i++) w[i] = (uint64_t)i * 0x9E3779B97F4A7C15ull + (uint64_t)t->id;
    uint64_t s = 0;
    for (int p = 0; p < t->passes; p++) {
        pthread_barrier_wait(&start_bar);
        s += sum_slice(t->base, t->n);
        pthread_barrier_wait(&end_bar);
    }
    t->sink = s;
    return NULL;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int threads = 2, passes = 10, json = 0;
    size_t size_mib = 1024;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-t") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "-s") && i + 1 < argc) size_mib = (size_t)atol(argv[++i]);
        else if (!strcmp(argv[i], "-r") && i + 1 < argc) passes = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--json")) json = 1;
        else {
            fprintf(stderr, "usage: %s [-t THREADS] [-s SIZE_MIB] [-r PASSES] [--json]\n", argv[0]);
            return 2;
        }
    }
    if (threads < 1 || threads > MAX_THREADS || passes < 1 || passes > MAX_PASSES || size_mib < 1) {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }
    size_t bytes = size_mib << 20;
    size_t align = 2u << 20;
    g_buf = aligned_alloc(align, (bytes + align - 1) / align * align);
    if (!g_buf) { perror("aligned_alloc"); return 1; }
#ifdef MADV_HUGEPAGE
    madvise(g_buf, bytes, MADV_HUGEPAGE);
#endif
    size_t n = bytes / sizeof(uint64_t);
    size_t per = n / (size_t)threads / 8 * 8;
    bytes = per * (size_t)threads * sizeof(uint64_t);

    pthread_barrier_init(&start_bar, NULL, (unsigned)threads + 1);
    pthread_barrier_init(&end_bar, NULL, (unsigned)threads + 1);
    pthread_t tids[MAX_THREADS];
    task_t tasks[MAX_THREADS];
    /* one extra untimed warm-up pass */
    for (int i = 0; i < threads; i++) {
        tasks[i] = (task_t){g_buf + (size_t)i * per, per, passes + 1, 0, i};
        pthread_create(&tids[i], NULL, worker, &tasks[i]);
    }
    double gbs[MAX_PASSES];
    for (int p = 0; p < passes + 1; p++) {
        pthread_barrier_wait(&start_bar);
        double t0 = now();
        pthread_barrier_wait(&end_bar);
        double dt = now() - t0;
        if (p > 0) gbs[p - 1] = (double)bytes / dt / 1e9;
    }
    uint64_t sink = 0;
    for (int i = 0; i < threads; i++) {
        pthread_join(tids[i], NULL);
        sink ^= tasks[i].sink;
    }
    qsort(gbs, (size_t)passes, sizeof(double), cmp_double);
    double median = passes % 2 ? gbs[passes / 2] : 0.5 * (gbs[passes / 2 - 1] + gbs[passes / 2]);
    double best = gbs[passes - 1], worst = gbs[0];
    if (json)
        printf("{\"threads\": %d, \"bytes\": %zu, \"passes\": %d, \"median_gb_s\": %.3f, "
               "\"max_gb_s\": %.3f, \"min_gb_s\": %.3f, \"checksum\": %llu}\n",
               threads, bytes, passes, median, best, worst, (unsigned long long)(sink & 0xffff));
    else
        printf("read bandwidth, %d thread(s), %.2f GB buffer, %d passes: median %.2f GB/s "
               "(min %.2f, max %.2f)\n", threads, (double)bytes / 1e9, passes, median, worst, best);
    free(g_buf);
    return 0;
}
