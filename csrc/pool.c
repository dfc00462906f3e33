/* A fixed set of worker threads that share one loop: each takes the next index. */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "ckptfmt.h"

#define CKF_MAX_THREADS 256

typedef struct {
    atomic_uint_fast64_t next;
    uint64_t n;
    ckf_task fn;
    void *ctx;
} loop;

typedef struct {
    loop *l;
    int thread;
} worker_arg;

static void run(loop *l, int thread) {
    for (;;) {
        uint64_t i = atomic_fetch_add(&l->next, 1);
        if (i >= l->n) return;
        l->fn(l->ctx, i, thread);
    }
}

static void *worker(void *p) {
    worker_arg *a = (worker_arg *)p;
    run(a->l, a->thread);
    return NULL;
}

int ckf_parallel_for(int nthreads, uint64_t n, ckf_task fn, void *ctx) {
    loop l;
    atomic_init(&l.next, 0);
    l.n = n;
    l.fn = fn;
    l.ctx = ctx;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > CKF_MAX_THREADS) nthreads = CKF_MAX_THREADS;
    if ((uint64_t)nthreads > n) nthreads = n ? (int)n : 1;
    pthread_t tids[CKF_MAX_THREADS];
    worker_arg args[CKF_MAX_THREADS];
    int started = 0, rc = 0;
    for (int t = 1; t < nthreads; t++) {
        args[t].l = &l;
        args[t].thread = t;
        rc = pthread_create(&tids[t], NULL, worker, &args[t]);
        if (rc != 0) break;
        started = t;
    }
    run(&l, 0);
    for (int t = 1; t <= started; t++) pthread_join(tids[t], NULL);
    return rc;
}

/* Parallel copies in pieces of a few MiB: snapshots into staging memory.  Streaming
 * (non-temporal) stores write around the cache: a snapshot's destination is not read
 * again until the writer gets to it, long after it would have left the cache, and
 * plain stores would first read every destination line in.  glibc's memcpy streams
 * only pieces larger than most of the last-level cache; for these 4 MiB pieces it
 * does not, and a 1 GiB copy on 2 threads took 79 ms that way against 47 ms here. */
typedef struct {
    uint8_t *dst;
    const uint8_t *src;
    uint64_t len;
} copy_job;

#define COPY_PIECE (4u << 20)
/* copies below this stay in the cache: the writer may read them back at once */
#define STREAM_MIN ((size_t)1 << 20)

#if defined(__SSE2__)
static void copy_stream(uint8_t *dst, const uint8_t *src, size_t n) {
    if (n < STREAM_MIN) { /* small: likely read again soon, from the cache */
        memcpy(dst, src, n);
        return;
    }
    /* plain stores up to a cache line boundary: no line is written both ways */
    size_t head = (64 - ((uintptr_t)dst & 63)) & 63;
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, n - i);
    _mm_sfence();
}
#endif

static void copy_piece(void *ctx, uint64_t i, int thread) {
    copy_job *c = (copy_job *)ctx;
    (void)thread;
    uint64_t off = i * COPY_PIECE;
    uint64_t n = c->len - off < COPY_PIECE ? c->len - off : COPY_PIECE;
#if defined(__SSE2__)
    copy_stream(c->dst + off, c->src + off, (size_t)n);
#else
    memcpy(c->dst + off, c->src + off, (size_t)n);
#endif
}

void ckf_copy(uint8_t *dst, const uint8_t *src, uint64_t len, int nthreads) {
    copy_job c = {dst, src, len};
    ckf_parallel_for(nthreads, (len + COPY_PIECE - 1) / COPY_PIECE, copy_piece, &c);
}

/* ckf_copy_spans: spans a task, and how many bytes of a span one task copies at most */
#define SPANS_PER_TASK 64
#define SPAN_PIECE ((uint64_t)1 << 20)

/* One task: a piece of one large span, or up to SPANS_PER_TASK small spans in a row. */
typedef struct {
    uint64_t span;  /* the first span of the task */
    uint64_t piece; /* a large span: the piece; UINT64_MAX: small spans from `span` on */
} span_task;

typedef struct {
    const uint64_t *spans;
    uint64_t n;
    const span_task *tasks;
} spans_ctx;

static void copy_span_task(void *ctx, uint64_t t, int thread) {
    const spans_ctx *c = (const spans_ctx *)ctx;
    (void)thread;
    span_task task = c->tasks[t];
    const uint64_t *s = c->spans;
    if (task.piece != UINT64_MAX) {
        uint64_t at = task.piece * SPAN_PIECE, len = s[3 * task.span + 2];
        uint64_t n = len - at < SPAN_PIECE ? len - at : SPAN_PIECE;
        memcpy((uint8_t *)(uintptr_t)s[3 * task.span + 1] + at, (const uint8_t *)(uintptr_t)s[3 * task.span] + at,
               (size_t)n);
        return;
    }
    for (uint64_t i = task.span, end = task.span + SPANS_PER_TASK; i < c->n && i < end; i++) {
        if (s[3 * i + 2] > SPAN_PIECE) break; /* a large span: tasks of its own */
        memcpy((uint8_t *)(uintptr_t)s[3 * i + 1], (const uint8_t *)(uintptr_t)s[3 * i], (size_t)s[3 * i + 2]);
    }
}

/* The pieces of a large span: its length was checked (ckf_copy_spans), so this cannot overflow. */
static uint64_t span_pieces(uint64_t len) { return (len + SPAN_PIECE - 1) / SPAN_PIECE; }

int ckf_copy_spans(const uint64_t *spans, uint64_t n, int nthreads) {
    /* the tasks: each large span cut into SPAN_PIECE pieces, runs of small spans in groups;
     * lengths are the caller's: one whose pieces would not add up (their count overflowing,
     * or that of the tasks, or the tasks' bytes) is refused before anything is allocated */
    if (n > UINT64_MAX / 3) return EINVAL;
    uint64_t ntasks = 0;
    for (uint64_t i = 0; i < n;) {
        if (spans[3 * i + 2] > SPAN_PIECE) {
            if (spans[3 * i + 2] > UINT64_MAX - SPAN_PIECE) return EINVAL;
            uint64_t pieces = span_pieces(spans[3 * i + 2]);
            if (pieces > UINT64_MAX - ntasks) return EINVAL;
            ntasks += pieces;
            i++;
            continue;
        }
        uint64_t end = i + SPANS_PER_TASK;
        while (i < n && i < end && spans[3 * i + 2] <= SPAN_PIECE) i++;
        ntasks++;
    }
    if (ntasks > SIZE_MAX / sizeof(span_task)) return EINVAL;
    span_task *tasks = malloc((ntasks ? ntasks : 1) * sizeof *tasks);
    if (!tasks) return ENOMEM;
    uint64_t t = 0;
    for (uint64_t i = 0; i < n;) {
        if (spans[3 * i + 2] > SPAN_PIECE) {
            for (uint64_t p = 0, pieces = span_pieces(spans[3 * i + 2]); p < pieces; p++)
                tasks[t++] = (span_task){i, p};
            i++;
            continue;
        }
        tasks[t++] = (span_task){i, UINT64_MAX};
        uint64_t end = i + SPANS_PER_TASK;
        while (i < n && i < end && spans[3 * i + 2] <= SPAN_PIECE) i++;
    }
    spans_ctx c = {spans, n, tasks};
    ckf_parallel_for(nthreads, ntasks, copy_span_task, &c);
    free(tasks);
    return 0;
}
