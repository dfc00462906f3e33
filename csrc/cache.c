/* A small process-wide cache of scratch buffers and zstd contexts.
 *
 * The reader and the writer need a few MiB of scratch and a zstd context per
 * thread for every call, and a save or a verify makes one call per batch of
 * chunks.  Fresh memory costs a page fault (and a zeroed page) per 4 KiB, which
 * for a 4 MiB buffer is about as long as decoding it; so buffers and contexts go
 * back here at the end of a call and the next call takes them warm.  The cache
 * is bounded (CACHE_SLOTS entries of each kind, CACHE_MAX_BYTES of buffers, no
 * buffer above CACHE_MAX_BUFFER, no context above CACHE_MAX_CONTEXT): what does not fit is freed as before.  A buffer
 * keeps the pages a call touched: at most CACHE_MAX_BYTES stay resident.
 */
#include <pthread.h>
#include <stdlib.h>
#include <time.h>
#include <zstd.h>

#include "ckptfmt.h"

#define CACHE_SLOTS 16
#define CACHE_MAX_BYTES ((size_t)64 << 20)
#define CACHE_MAX_BUFFER ((size_t)16 << 20)
#define CACHE_MAX_CONTEXT ((size_t)8 << 20)

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static struct {
    void *p;
    size_t cap;
} bufs[CACHE_SLOTS];
static int nbufs;
static size_t cached_bytes;
static ZSTD_DCtx *dctxs[CACHE_SLOTS];
static int ndctx;
static ZSTD_CCtx *cctxs[CACHE_SLOTS];
static int ncctx;

/* a fork while another thread holds the lock must not leave it held in the child */
static void before_fork(void) { pthread_mutex_lock(&lock); }
static void after_fork(void) { pthread_mutex_unlock(&lock); }
static void register_fork(void) { pthread_atfork(before_fork, after_fork, after_fork); }

static void take_lock(void) {
    pthread_once(&once, register_fork);
    pthread_mutex_lock(&lock);
}

/* Sizes that may be cached are rounded up to a multiple of an eighth of their
 * highest power of two, so that calls whose largest chunk differs a little share
 * buffers; the pages past what a call touches are never faulted in, so the
 * rounding costs address space only. */
static size_t size_class(size_t size) {
    if (size > CACHE_MAX_BUFFER) return size;
    if (size < ((size_t)64 << 10)) return (size_t)64 << 10;
    size_t top = (size_t)1 << (63 - __builtin_clzll((unsigned long long)size));
    size_t granule = top / 8;
    return (size + granule - 1) / granule * granule;
}

void *ckf_buf_take(size_t size, size_t *cap) {
    size = size_class(size);
    take_lock();
    int best = -1;
    for (int i = 0; i < nbufs; i++) /* the smallest cached buffer that is large enough */
        if (bufs[i].cap >= size && (best < 0 || bufs[i].cap < bufs[best].cap)) best = i;
    if (best >= 0) {
        void *p = bufs[best].p;
        *cap = bufs[best].cap;
        cached_bytes -= bufs[best].cap;
        bufs[best] = bufs[--nbufs];
        pthread_mutex_unlock(&lock);
        return p;
    }
    pthread_mutex_unlock(&lock);
    void *p = malloc(size);
    *cap = p ? size : 0;
    return p;
}

void ckf_buf_give(void *p, size_t cap) {
    if (!p) return;
    void *evicted[CACHE_SLOTS];
    int nevicted = 0;
    if (cap <= CACHE_MAX_BUFFER) {
        take_lock();
        /* no room: smaller buffers make way for this one (later calls need the larger size) */
        while (nbufs == CACHE_SLOTS || cached_bytes + cap > CACHE_MAX_BYTES) {
            int small = -1;
            for (int i = 0; i < nbufs; i++)
                if (bufs[i].cap < cap && (small < 0 || bufs[i].cap < bufs[small].cap)) small = i;
            if (small < 0) break;
            evicted[nevicted++] = bufs[small].p;
            cached_bytes -= bufs[small].cap;
            bufs[small] = bufs[--nbufs];
        }
        if (nbufs < CACHE_SLOTS && cached_bytes + cap <= CACHE_MAX_BYTES) {
            bufs[nbufs].p = p;
            bufs[nbufs].cap = cap;
            nbufs++;
            cached_bytes += cap;
            p = NULL;
        }
        pthread_mutex_unlock(&lock);
    }
    for (int i = 0; i < nevicted; i++) free(evicted[i]);
    free(p);
}

ZSTD_DCtx *ckf_dctx_take(void) {
    take_lock();
    ZSTD_DCtx *d = ndctx ? dctxs[--ndctx] : NULL;
    pthread_mutex_unlock(&lock);
    if (!d) return ZSTD_createDCtx();
    ZSTD_DCtx_reset(d, ZSTD_reset_session_and_parameters);
    return d;
}

void ckf_dctx_give(ZSTD_DCtx *d) {
    if (!d) return;
    if (ZSTD_sizeof_DCtx(d) > CACHE_MAX_CONTEXT) {
        ZSTD_freeDCtx(d);
        return;
    }
    take_lock();
    if (ndctx < CACHE_SLOTS) {
        dctxs[ndctx++] = d;
        d = NULL;
    }
    pthread_mutex_unlock(&lock);
    ZSTD_freeDCtx(d);
}

ZSTD_CCtx *ckf_cctx_take(void) {
    take_lock();
    ZSTD_CCtx *c = ncctx ? cctxs[--ncctx] : NULL;
    pthread_mutex_unlock(&lock);
    if (!c) return ZSTD_createCCtx();
    ZSTD_CCtx_reset(c, ZSTD_reset_session_and_parameters);
    return c;
}

void ckf_cctx_give(ZSTD_CCtx *c) {
    if (!c) return;
    /* a high level or a large chunk leaves a context with tens of MiB of workspace:
     * only the small ones of the usual levels are kept */
    if (ZSTD_sizeof_CCtx(c) > CACHE_MAX_CONTEXT) {
        ZSTD_freeCCtx(c);
        return;
    }
    take_lock();
    if (ncctx < CACHE_SLOTS) {
        cctxs[ncctx++] = c;
        c = NULL;
    }
    pthread_mutex_unlock(&lock);
    ZSTD_freeCCtx(c);
}

/* Tests only: hold the cache's lock for `ms` milliseconds, as a thread inside the
 * engine does, so that a fork meanwhile can be shown not to leave it held. */
void ckf_test_hold_cache(unsigned ms) {
    take_lock();
    struct timespec t = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
    while (nanosleep(&t, &t) != 0) {
    }
    pthread_mutex_unlock(&lock);
}
