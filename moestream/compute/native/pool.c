/* The worker pool behind every parallel entry point (ms_internal_dispatch): the caller plus ms_set_threads - 1
 * workers, which spin briefly between calls (a decode step issues several back to back), then sleep on a futex. */
#include "internal.h"

#include <pthread.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>
#include <linux/futex.h>
#include <sys/syscall.h>

/* ---------------------------------------------------------------------------------------------------- */
/* thread pool */

#define MAX_THREADS 64

static struct {
    int n;                      /* workers (not counting the caller) */
    pthread_t th[MAX_THREADS];
    _Atomic uint32_t gen;       /* bumped per dispatch; workers futex-wait on it */
    _Atomic int64_t next;       /* next task index to claim */
    _Atomic int active;         /* workers still inside the current dispatch */
    _Atomic int sleepers;
    task_fn fn;
    void *ctx;
    int64_t ntasks;
    pthread_mutex_t mu;         /* one dispatch at a time (callers from several Python threads) */
} P = {.mu = PTHREAD_MUTEX_INITIALIZER};

static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
}

/* How long an idle worker spins before sleeping on the futex. Long in decode (a step's calls follow each other
 * closely, and waking from the futex would cost more than spinning until the next one); short when other
 * threads need the cores between calls (reader threads packing a prompt's misses). */
static _Atomic double spin_s = 2e-3;

void ms_set_spin_us(double us) { atomic_store(&spin_s, us >= 0 && us <= 1e6 ? us * 1e-6 : us > 1e6 ? 1.0 : 0.0); }

static void run_tasks(void) {
    int64_t t;
    while ((t = atomic_fetch_add_explicit(&P.next, 1, memory_order_relaxed)) < P.ntasks) P.fn(P.ctx, t);
}

static void *worker(void *arg) {
    uint32_t seen = (uint32_t)(uintptr_t)arg; /* the generation when it was created: never miss a dispatch */
    for (;;) {
        uint32_t g;
        double t0 = 0;
        int spins = 0;
        while ((g = atomic_load_explicit(&P.gen, memory_order_acquire)) == seen) {
            if (++spins < 64) { cpu_relax(); continue; }
            spins = 0;
            double el = 0;
            if (t0 == 0) t0 = now_s();
            else el = now_s() - t0;
            /* past the first 50 us, offer the core to any runnable thread (reader threads submitting reads
             * or packing) while still answering the next call without a futex wake-up */
            if (el > 50e-6) sched_yield();
            if (el > atomic_load_explicit(&spin_s, memory_order_relaxed)) {
                atomic_fetch_add(&P.sleepers, 1);
                syscall(SYS_futex, &P.gen, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
                atomic_fetch_sub(&P.sleepers, 1);
                t0 = 0;
            }
        }
        seen = g;
        run_tasks();
        atomic_fetch_sub_explicit(&P.active, 1, memory_order_release);
    }
    return NULL;
}

/* Use `n` threads in all (the caller plus n - 1 workers). Threads are only ever added. */
int ms_set_threads(int n) {
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    pthread_mutex_lock(&P.mu);
    while (P.n < n - 1) {
        void *gen = (void *)(uintptr_t)atomic_load(&P.gen);
        if (pthread_create(&P.th[P.n], NULL, worker, gen) != 0) break;
        pthread_detach(P.th[P.n]);
        P.n++;
    }
    pthread_mutex_unlock(&P.mu);
    return P.n + 1;
}

void ms_internal_dispatch(task_fn fn, void *ctx, int64_t ntasks) {
    if (P.n == 0 || ntasks == 1) {
        for (int64_t t = 0; t < ntasks; t++) fn(ctx, t);
        return;
    }
    pthread_mutex_lock(&P.mu);
    P.fn = fn;
    P.ctx = ctx;
    P.ntasks = ntasks;
    atomic_store_explicit(&P.next, 0, memory_order_relaxed);
    atomic_store_explicit(&P.active, P.n, memory_order_relaxed);
    atomic_fetch_add_explicit(&P.gen, 1, memory_order_release);
    if (atomic_load(&P.sleepers)) syscall(SYS_futex, &P.gen, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
    run_tasks();
    int spins = 0;
    while (atomic_load_explicit(&P.active, memory_order_acquire) > 0) {
        if (++spins < 4096) cpu_relax();
        else sched_yield(); /* a worker was descheduled: let it run */
    }
    pthread_mutex_unlock(&P.mu);
}

int ms_internal_threads(void) { return P.n + 1; }
