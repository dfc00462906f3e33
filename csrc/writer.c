/* The parallel chunk writer: encode, checksum and pwrite chunks at planned offsets.
 *
 * Without compression every offset is known up front, so one parallel pass
 * hashes and writes each chunk straight from the caller's memory.  With
 * compression the threads run one pipeline: each takes the next chunk and
 * compresses it into a free slot (per-thread zstd contexts and shuffle
 * buffers); as soon as the chunks before it are compressed, its offset is
 * assigned, and one thread at a time hashes and writes the next chunk in file
 * order while the others go on compressing.  One writer at a time: pwrites to
 * one file serialize in the kernel anyway (the inode lock), where a second
 * writer only spins; nobody waits for a whole window to finish.  Memory stays
 * bounded by the slots (two per thread and four more), not the state.
 *
 * When asked (digests != NULL), each chunk's content digest (XXH3-128 of its raw
 * bytes, spec section 12) comes out too: for a raw chunk in the same pass as its
 * checksum, piece by piece while in cache; for a compressed one before encoding.
 *
 * Chunks of encrypted files (a data key in the chunk, spec section 17) are encrypted with
 * AES-256-GCM in the same pass, after compression: each piece is encrypted into the
 * thread's piece buffer, and the ciphertext is hashed and written from there while in cache
 * (the caller's memory is never changed); the GCM tag comes out with the chunk.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>
#include <zstd.h>

#include "cache.h"
#include "ckptfmt.h"
#include "xxh.h"

size_t ckf_zstd_compress_ctx(void *cctx, uint8_t *dst, size_t cap, const uint8_t *src, size_t len, int level);

/* slots for compressed chunks: one being compressed per thread, one being written, and
 * room for chunks compressed ahead of a slower one before them (their offsets wait) */
#define SLOTS(nthreads) (2 * (nthreads) + 4)

typedef struct {
    int fd;
    const uint8_t *file_id;
    uint64_t first_index;
    ckf_chunk *chunks;
    uint64_t n;
    int level;
    int checksum;
    uint8_t *digests;    /* NULL, or 16 bytes per chunk of the call */
    int digest_on_write; /* digests taken in write_chunk (raw path) rather than encode_chunk */
    uint64_t page;       /* the page size sync_file_range rounds to */
    /* per thread */
    XXH3_state_t **hstate; /* checksum, and content digest of raw chunks (two per thread) */
    void **sha;            /* checksum & CKF_SHA: a SHA-256 context per thread, else NULL */
    void **gcm;            /* encrypted chunks: an AES-256-GCM context per thread, else NULL */
    uint8_t **cipher;      /* ... and a piece buffer per thread for the ciphertext */
    ZSTD_CCtx **cctx;
    uint8_t **scratch;
    size_t *scratch_cap;
    /* the compression pipeline, under m: chunks [0, next_take) are taken, [0, next_assign)
     * compressed with offsets assigned, [0, next_write) written or being written */
    pthread_mutex_t m;
    pthread_cond_t cv;
    uint64_t next_take, next_assign, next_write;
    uint64_t pos;        /* where chunk next_assign goes */
    int writing;         /* a thread is writing chunk next_write - 1 */
    uint8_t *encoded;    /* per chunk: compressed, waiting for its offset */
    int *slot_of;        /* per chunk: its slot */
    uint8_t **slot_buf;  /* per slot: the compressed bytes */
    size_t *slot_cap;
    int *free_slots;
    int nfree;
    size_t need_cap;     /* the size every slot must have */
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

/* Hash and write chunk k (its offset and codec are decided) from p, its stored bytes.
 * The chunk goes in pieces small enough to stay in the core's cache between
 * being hashed and being copied into the page cache by pwrite, so the checksum
 * costs no second trip through memory. */
#define PIECE (256u << 10)

static void write_chunk(job *j, uint64_t k, const uint8_t *p, int thread) {
    ckf_chunk *c = &j->chunks[k];
    XXH3_state_t *h = NULL, *d = NULL;
    if (j->checksum) {
        h = j->hstate[2 * thread];
        uint64_t seed = ckf_chunk_seed(j->file_id, j->first_index + k, c->offset, c->stored_len, c->raw_len,
                                       c->codec, c->filter, c->fwidth);
        XXH3_64bits_reset_withSeed(h, seed);
    }
    void *s = NULL;
    if (j->sha) {
        s = j->sha[thread];
        if (!ckf_sha_begin(s, j->file_id, j->first_index + k, c->offset, c->stored_len, c->raw_len, c->codec,
                           c->filter, c->fwidth)) {
            fail(j, CKF_ERR_CRYPTO, 0, (int64_t)(j->first_index + k));
            return;
        }
    }
    void *g = NULL;
    if (c->key) {
        g = j->gcm[thread];
        if (!ckf_gcm_begin(g, 1, c->key, j->file_id, j->first_index + k, c->offset, c->stored_len, c->raw_len,
                           c->codec, c->filter, c->fwidth)) {
            fail(j, CKF_ERR_CRYPTO, 0, (int64_t)(j->first_index + k));
            return;
        }
    }
    if (j->digests && j->digest_on_write) { /* raw chunks only: stored bytes are the raw bytes */
        d = j->hstate[2 * thread + 1];
        XXH3_128bits_reset(d);
    }
    for (uint64_t done = 0; done < c->stored_len;) {
        uint64_t step = c->stored_len - done < PIECE ? c->stored_len - done : PIECE;
        if (d) ckf_xxh3_128_update(d, p + done, (size_t)step); /* of the plaintext */
        const uint8_t *out = p + done;                         /* the bytes the file gets */
        if (g) {
            if (!ckf_gcm_update(g, j->cipher[thread], p + done, step)) {
                fail(j, CKF_ERR_CRYPTO, 0, (int64_t)(j->first_index + k));
                break;
            }
            out = j->cipher[thread];
        }
        if (h) ckf_xxh3_64_update(h, out, (size_t)step);
        if (s && !ckf_sha_update(s, out, step)) {
            fail(j, CKF_ERR_CRYPTO, 0, (int64_t)(j->first_index + k));
            break;
        }
        int e = pwrite_all(j->fd, out, step, c->offset + done);
        if (e) {
            fail(j, CKF_ERR_IO, e, (int64_t)(j->first_index + k));
            break;
        }
        done += step;
    }
#ifdef SYNC_FILE_RANGE_WRITE
    /* Start writing the chunk back now (a hint: errors surface at the fsync that commits
     * the file): the commit's fsync then waits for what is still in flight, not for the
     * whole file, so the device works while the other chunks are hashed and copied. */
    /* whole pages only: the pages shared with the neighbouring chunks go with the fsync */
    uint64_t page = j->page;
    uint64_t first = (c->offset + page - 1) / page * page;
    uint64_t end = (c->offset + c->stored_len) / page * page;
    if (end > first) (void)sync_file_range(j->fd, (off_t)first, (off_t)(end - first), SYNC_FILE_RANGE_WRITE);
#endif
    c->checksum = h ? XXH3_64bits_digest(h) : 0;
    if (s && !ckf_sha_end(s, c->sha)) fail(j, CKF_ERR_CRYPTO, 0, (int64_t)(j->first_index + k));
    if (g && !ckf_gcm_finish(g, c->tag)) fail(j, CKF_ERR_CRYPTO, 0, (int64_t)(j->first_index + k));
    if (d) {
        XXH128_canonical_t canon;
        XXH128_canonicalFromHash(&canon, XXH3_128bits_digest(d));
        memcpy(j->digests + 16 * k, canon.digest, 16);
    }
}

/* uncompressed: chunk i, straight from the caller's memory */
static void task_write(void *ctx, uint64_t i, int thread) {
    job *j = (job *)ctx;
    if (atomic_load(&j->failed)) return;
    write_chunk(j, i, j->chunks[i].src, thread);
}

/* compress chunk k into dst (slot_cap bytes); fall back to raw when it does not pay */
static void encode_chunk(job *j, uint64_t k, uint8_t *dst, size_t cap, int thread) {
    ckf_chunk *c = &j->chunks[k];
    if (j->digests) ckf_digest(c->src, c->raw_len, j->digests + 16 * k);
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
    size_t n = ckf_zstd_compress_ctx(j->cctx[thread], dst, cap, src, (size_t)c->raw_len, j->level);
    if (n == 0) {
        fail(j, CKF_ERR_ZSTD, 0, (int64_t)(j->first_index + k));
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

/* a thread of the compression pipeline: write the next chunk when nobody is writing
 * and its offset is known, else compress the next chunk when a slot is free, else wait */
static void task_pipeline(void *ctx, uint64_t unused, int thread) {
    job *j = (job *)ctx;
    (void)unused;
    pthread_mutex_lock(&j->m);
    while (!atomic_load(&j->failed) && j->next_write < j->n) {
        if (!j->writing && j->next_write < j->next_assign) {
            uint64_t k = j->next_write++;
            int s = j->slot_of[k];
            j->writing = 1;
            pthread_mutex_unlock(&j->m);
            ckf_chunk *c = &j->chunks[k];
            write_chunk(j, k, c->codec == CKF_CODEC_RAW ? c->src : j->slot_buf[s], thread);
            pthread_mutex_lock(&j->m);
            j->writing = 0;
            j->free_slots[j->nfree++] = s;
            pthread_cond_broadcast(&j->cv);
        } else if (j->next_take < j->n && j->nfree > 0) {
            uint64_t k = j->next_take++;
            int s = j->free_slots[--j->nfree];
            j->slot_of[k] = s;
            pthread_mutex_unlock(&j->m);
            encode_chunk(j, k, j->slot_buf[s], j->slot_cap[s], thread);
            pthread_mutex_lock(&j->m);
            j->encoded[k] = 1;
            int ready = 0;
            while (j->next_assign < j->n && j->encoded[j->next_assign]) {
                ckf_chunk *c = &j->chunks[j->next_assign++];
                c->offset = j->pos;
                j->pos = align_up(j->pos + c->stored_len);
                ready = 1;
            }
            if (ready) pthread_cond_broadcast(&j->cv);
        } else {
            pthread_cond_wait(&j->cv, &j->m);
        }
    }
    pthread_cond_broadcast(&j->cv); /* a failure: the others stop waiting */
    pthread_mutex_unlock(&j->m);
}

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
    int encrypt = 0;
    for (uint64_t i = 0; i < n; i++) encrypt |= chunks[i].key != NULL;
    if (((checksum & CKF_SHA) || encrypt) && !ckf_crypto_available()) {
        status->code = CKF_ERR_CRYPTO;
        *end_offset = first_offset;
        return CKF_ERR_CRYPTO;
    }
    /* no more threads than chunks */
    if ((uint64_t)nthreads > n) nthreads = n ? (int)n : 1;
    job j;
    memset(&j, 0, sizeof j);
    j.fd = fd;
    j.file_id = file_id;
    j.first_index = first_index;
    j.chunks = chunks;
    j.n = n;
    j.level = level;
    j.checksum = checksum & 1;
    long page = sysconf(_SC_PAGESIZE);
    j.page = page > 0 ? (uint64_t)page : 4096u;
    j.digests = digests;
    j.digest_on_write = !compress;
    j.status = status;
    atomic_init(&j.failed, 0);
    uint64_t pos = first_offset;
    int slots = compress ? SLOTS(nthreads) : 0;

    j.hstate = calloc(2 * (size_t)nthreads, sizeof(XXH3_state_t *));
    int ok = j.hstate != NULL;
    for (int t = 0; ok && t < 2 * nthreads; t++) ok = (j.hstate[t] = XXH3_createState()) != NULL;
    if (ok && (checksum & CKF_SHA)) {
        ok = (j.sha = calloc((size_t)nthreads, sizeof(void *))) != NULL;
        for (int t = 0; ok && t < nthreads; t++) ok = (j.sha[t] = ckf_sha_new()) != NULL;
    }
    if (ok && encrypt) {
        ok = (j.gcm = calloc((size_t)nthreads, sizeof(void *))) != NULL &&
             (j.cipher = calloc((size_t)nthreads, sizeof(uint8_t *))) != NULL;
        for (int t = 0; ok && t < nthreads; t++)
            ok = (j.gcm[t] = ckf_gcm_new()) != NULL && (j.cipher[t] = malloc(PIECE)) != NULL;
    }
    if (ok && !compress) {
        for (uint64_t i = 0; i < n; i++) {
            chunks[i].codec = CKF_CODEC_RAW;
            chunks[i].filter = CKF_FILTER_NONE;
            chunks[i].fwidth = 0;
            chunks[i].stored_len = chunks[i].raw_len;
            chunks[i].offset = pos;
            pos = align_up(pos + chunks[i].raw_len);
        }
        ckf_parallel_for(nthreads, n, task_write, &j);
    } else if (ok) {
        uint64_t max_raw = 0;
        for (uint64_t i = 0; i < n; i++)
            if (chunks[i].raw_len > max_raw) max_raw = chunks[i].raw_len;
        j.need_cap = ZSTD_compressBound((size_t)max_raw);
        j.pos = first_offset;
        j.slot_buf = calloc((size_t)slots, sizeof(uint8_t *));
        j.slot_cap = calloc((size_t)slots, sizeof(size_t));
        j.free_slots = calloc((size_t)slots, sizeof(int));
        j.cctx = calloc((size_t)nthreads, sizeof(ZSTD_CCtx *));
        j.scratch = calloc((size_t)nthreads, sizeof(uint8_t *));
        j.scratch_cap = calloc((size_t)nthreads, sizeof(size_t));
        j.encoded = calloc(n ? (size_t)n : 1, 1);
        j.slot_of = calloc(n ? (size_t)n : 1, sizeof(int));
        ok = j.slot_buf && j.slot_cap && j.free_slots && j.cctx && j.scratch && j.scratch_cap && j.encoded &&
             j.slot_of;
        for (int s = 0; ok && s < slots; s++) {
            ok = (j.slot_buf[s] = ckf_buf_take(j.need_cap, &j.slot_cap[s])) != NULL;
            j.free_slots[j.nfree++] = s;
        }
        for (int t = 0; ok && t < nthreads; t++)
            ok = (j.cctx[t] = ckf_cctx_take()) != NULL &&
                 (j.scratch[t] = ckf_buf_take((size_t)max_raw, &j.scratch_cap[t])) != NULL;
        if (ok) {
            pthread_mutex_init(&j.m, NULL);
            pthread_cond_init(&j.cv, NULL);
            ckf_parallel_for(nthreads, (uint64_t)nthreads, task_pipeline, &j);
            pthread_cond_destroy(&j.cv);
            pthread_mutex_destroy(&j.m);
            pos = j.pos;
        }
        for (int s = 0; j.slot_buf && s < slots; s++) ckf_buf_give(j.slot_buf[s], j.slot_cap[s]);
        for (int t = 0; j.cctx && t < nthreads; t++) ckf_cctx_give(j.cctx[t]);
        for (int t = 0; j.scratch && t < nthreads; t++) ckf_buf_give(j.scratch[t], j.scratch_cap[t]);
        free(j.slot_buf);
        free(j.slot_cap);
        free(j.free_slots);
        free(j.cctx);
        free(j.scratch);
        free(j.scratch_cap);
        free(j.encoded);
        free(j.slot_of);
    }
    for (int t = 0; j.hstate && t < 2 * nthreads; t++) XXH3_freeState(j.hstate[t]);
    free(j.hstate);
    for (int t = 0; j.sha && t < nthreads; t++) ckf_sha_free(j.sha[t]);
    free(j.sha);
    for (int t = 0; j.gcm && t < nthreads; t++) ckf_gcm_free(j.gcm[t]);
    for (int t = 0; j.cipher && t < nthreads; t++) free(j.cipher[t]);
    free(j.gcm);
    free(j.cipher);
    if (!ok) {
        status->code = CKF_ERR_NOMEM;
        status->err_no = ENOMEM;
    }
    *end_offset = pos;
    return status->code;
}
