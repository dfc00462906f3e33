/* The parallel chunk writer: encode, checksum and pwrite chunks at planned offsets.
 *
 * Without compression every offset is known up front, so one parallel pass
 * hashes and writes each chunk straight from the caller's memory.  With
 * compression the chunks are taken in windows of a few per thread: the window
 * is compressed in parallel (per-thread zstd contexts and shuffle buffers),
 * offsets are assigned in order, then the window is hashed and written in
 * parallel.  Memory stays bounded by the window, not the state.
 *
 * When asked (digests != NULL), each chunk's content digest (XXH3-128 of its raw
 * bytes, spec section 12) comes out too: for a raw chunk in the same pass as its
 * checksum, piece by piece while in cache; for a compressed one before encoding.
 */
#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>
#include <zstd.h>

#include "ckptfmt.h"
#include "xxh.h"

size_t ckf_zstd_compress_ctx(void *cctx, uint8_t *dst, size_t cap, const uint8_t *src, size_t len, int level);

#define WINDOW_PER_THREAD 2

typedef struct {
    int fd;
    const uint8_t *file_id;
    uint64_t first_index;
    ckf_chunk *chunks;
    uint64_t base; /* first chunk of the current window */
    int level;
    int checksum;
    uint8_t *digests;    /* NULL, or 16 bytes per chunk of the call */
    int digest_on_write; /* digests taken in task_write (raw path) rather than task_encode */
    /* per window slot: the compressed bytes (NULL when stored raw) */
    uint8_t **slot_buf;
    size_t slot_cap;
    /* per thread */
    ZSTD_CCtx **cctx;
    uint8_t **scratch;
    /* first error wins */
    atomic_int failed;
    ckf_status *status;
} job;

static void fail(job *j, int code, int err_no, int64_t chunk) {
    int expected = 0;
    if (atomic_compare_exchange_strong(&j->failed, &expected, 1)) {
        j->status->code = code;
        j->status->err_no = err_no;
        j->status->chunk = chunk;
    }
}

static int pwrite_all(int fd, const uint8_t *p, uint64_t len, uint64_t off) {
    while (len) {
        size_t step = len > (1u << 30) ? (1u << 30) : (size_t)len;
        ssize_t w = pwrite(fd, p, step, (off_t)off);
        if (w < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (w == 0) return EIO;
        p += w;
        len -= (uint64_t)w;
        off += (uint64_t)w;
    }
    return 0;
}

/* Hash and write chunk base+i of the window (its offset and codec are decided).
 * The chunk goes in pieces small enough to stay in the core's cache between
 * being hashed and being copied into the page cache by pwrite, so the checksum
 * costs no second trip through memory. */
#define PIECE (256u << 10)

static void task_write(void *ctx, uint64_t i, int thread) {
    job *j = (job *)ctx;
    (void)thread;
    if (atomic_load(&j->failed)) return;
    uint64_t k = j->base + i;
    ckf_chunk *c = &j->chunks[k];
    const uint8_t *p = c->codec == CKF_CODEC_RAW ? c->src : j->slot_buf[i];
    XXH3_state_t *h = NULL, *d = NULL;
    if (j->checksum) {
        h = XXH3_createState();
        if (!h) {
            fail(j, CKF_ERR_NOMEM, ENOMEM, (int64_t)(j->first_index + k));
            return;
        }
        uint64_t seed = ckf_chunk_seed(j->file_id, j->first_index + k, c->offset, c->stored_len, c->raw_len,
                                       c->codec, c->filter, c->fwidth);
        XXH3_64bits_reset_withSeed(h, seed);
    }
    if (j->digests && j->digest_on_write) { /* raw chunks only: stored bytes are the raw bytes */
        d = XXH3_createState();
        if (!d) {
            XXH3_freeState(h);
            fail(j, CKF_ERR_NOMEM, ENOMEM, (int64_t)(j->first_index + k));
            return;
        }
        XXH3_128bits_reset(d);
    }
    for (uint64_t done = 0; done < c->stored_len;) {
        uint64_t step = c->stored_len - done < PIECE ? c->stored_len - done : PIECE;
        if (h) ckf_xxh3_64_update(h, p + done, (size_t)step);
        if (d) ckf_xxh3_128_update(d, p + done, (size_t)step);
        int e = pwrite_all(j->fd, p + done, step, c->offset + done);
        if (e) {
            fail(j, CKF_ERR_IO, e, (int64_t)(j->first_index + k));
            break;
        }
        done += step;
    }
    c->checksum = h ? XXH3_64bits_digest(h) : 0;
    XXH3_freeState(h);
    if (d) {
        XXH128_canonical_t canon;
        XXH128_canonicalFromHash(&canon, XXH3_128bits_digest(d));
        memcpy(j->digests + 16 * k, canon.digest, 16);
        XXH3_freeState(d);
    }
}

/* compress chunk base+i into window slot i; fall back to raw when it does not pay */
static void task_encode(void *ctx, uint64_t i, int thread) {
    job *j = (job *)ctx;
    if (atomic_load(&j->failed)) return;
    ckf_chunk *c = &j->chunks[j->base + i];
    if (j->digests) ckf_digest(c->src, c->raw_len, j->digests + 16 * (j->base + i));
    c->codec = CKF_CODEC_RAW;
    c->filter = CKF_FILTER_NONE;
    c->fwidth = 0;
    c->stored_len = c->raw_len;
    if (c->raw_len == 0) return;
    int shuffle = c->width > 1 && c->raw_len % c->width == 0;
    const uint8_t *src = c->src;
    if (shuffle) {
        ckf_shuffle(j->scratch[thread], c->src, c->raw_len, c->width);
        src = j->scratch[thread];
    }
    uint8_t *dst = j->slot_buf[i];
    size_t n = ckf_zstd_compress_ctx(j->cctx[thread], dst, j->slot_cap, src, (size_t)c->raw_len, j->level);
    if (n == 0) {
        fail(j, CKF_ERR_ZSTD, 0, (int64_t)(j->first_index + j->base + i));
        return;
    }
    if (n >= c->raw_len) return; /* stored raw, unfiltered */
    c->codec = CKF_CODEC_ZSTD;
    c->stored_len = n;
    if (shuffle) {
        c->filter = CKF_FILTER_SHUFFLE;
        c->fwidth = (uint8_t)c->width;
    }
}

static uint64_t align_up(uint64_t x) { return (x + CKF_ALIGN - 1) / CKF_ALIGN * CKF_ALIGN; }

int ckf_write_chunks(int fd, const uint8_t *file_id, uint64_t first_index, uint64_t first_offset,
                     ckf_chunk *chunks, uint64_t n, int compress, int level, int nthreads, int checksum,
                     uint8_t *digests, ckf_status *status, uint64_t *end_offset) {
    status->code = CKF_OK;
    status->err_no = 0;
    status->chunk = -1;
    if (first_offset % CKF_ALIGN || nthreads < 1 || nthreads > 256) {
        status->code = CKF_ERR_ARG;
        return CKF_ERR_ARG;
    }
    job j;
    memset(&j, 0, sizeof j);
    j.fd = fd;
    j.file_id = file_id;
    j.first_index = first_index;
    j.chunks = chunks;
    j.level = level;
    j.checksum = checksum;
    j.digests = digests;
    j.digest_on_write = !compress;
    j.status = status;
    atomic_init(&j.failed, 0);
    uint64_t pos = first_offset;

    if (!compress) {
        for (uint64_t i = 0; i < n; i++) {
            chunks[i].codec = CKF_CODEC_RAW;
            chunks[i].filter = CKF_FILTER_NONE;
            chunks[i].fwidth = 0;
            chunks[i].stored_len = chunks[i].raw_len;
            chunks[i].offset = pos;
            pos = align_up(pos + chunks[i].raw_len);
        }
        ckf_parallel_for(nthreads, n, task_write, &j);
        *end_offset = pos;
        return status->code;
    }

    uint64_t max_raw = 0;
    for (uint64_t i = 0; i < n; i++)
        if (chunks[i].raw_len > max_raw) max_raw = chunks[i].raw_len;
    uint64_t window = (uint64_t)nthreads * WINDOW_PER_THREAD;
    j.slot_cap = ZSTD_compressBound((size_t)max_raw);
    j.slot_buf = calloc(window, sizeof(uint8_t *));
    j.cctx = calloc((size_t)nthreads, sizeof(ZSTD_CCtx *));
    j.scratch = calloc((size_t)nthreads, sizeof(uint8_t *));
    int ok = j.slot_buf && j.cctx && j.scratch;
    for (uint64_t s = 0; ok && s < window; s++) ok = (j.slot_buf[s] = malloc(j.slot_cap ? j.slot_cap : 1)) != NULL;
    for (int t = 0; ok && t < nthreads; t++) {
        ok = (j.cctx[t] = ZSTD_createCCtx()) != NULL && (j.scratch[t] = malloc(max_raw ? max_raw : 1)) != NULL;
    }
    if (!ok) {
        status->code = CKF_ERR_NOMEM;
        status->err_no = ENOMEM;
    } else {
        for (uint64_t base = 0; base < n && !atomic_load(&j.failed); base += window) {
            uint64_t count = n - base < window ? n - base : window;
            j.base = base;
            ckf_parallel_for(nthreads, count, task_encode, &j);
            if (atomic_load(&j.failed)) break;
            for (uint64_t i = base; i < base + count; i++) {
                chunks[i].offset = pos;
                pos = align_up(pos + chunks[i].stored_len);
            }
            ckf_parallel_for(nthreads, count, task_write, &j);
        }
    }
    for (uint64_t s = 0; j.slot_buf && s < window; s++) free(j.slot_buf[s]);
    for (int t = 0; j.cctx && t < nthreads; t++) ZSTD_freeCCtx(j.cctx[t]);
    for (int t = 0; j.scratch && t < nthreads; t++) free(j.scratch[t]);
    free(j.slot_buf);
    free(j.cctx);
    free(j.scratch);
    *end_offset = pos;
    return status->code;
}
