/* The parallel chunk reader: pread, verify and decode chunks straight into place.
 *
 * Each chunk is read with pread into its destination (raw chunks, in pieces
 * that are hashed while still in cache) or into a per-thread scratch buffer
 * (zstd chunks), its checksum and zero padding are checked, and zstd chunks
 * are decoded into exactly raw_len bytes (un-shuffled when filtered).  In files
 * with content digests (feature bit 0) the decoded bytes' XXH3-128 is checked too.  Every
 * length comes from the validated index; the decoder still checks each frame
 * against it, so a forged checksum cannot make it write out of bounds.
 */
#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>
#define ZSTD_STATIC_LINKING_ONLY /* ZSTD_d_windowLogMax, ZSTD_findFrameCompressedSize */
#include <zstd.h>

#include "ckptfmt.h"
#include "xxh.h"

#define PIECE (256u << 10)
#define WINDOW_LOG_MAX 27

typedef struct {
    int fd;
    const uint8_t *file_id;
    ckf_rchunk *chunks;
    int verify;
    uint8_t **scratch; /* per thread: stored bytes */
    uint8_t **plain;   /* per thread: decoded bytes before un-shuffling */
    ZSTD_DCtx **dctx;
    atomic_int failed;
    ckf_status *status;
} rjob;

static void rfail(rjob *j, int code, int err_no, int64_t chunk, int reason, uint64_t value) {
    int expected = 0;
    if (atomic_compare_exchange_strong(&j->failed, &expected, 1)) {
        j->status->code = code;
        j->status->err_no = err_no;
        j->status->chunk = chunk;
        j->status->reason = reason;
        j->status->value = value;
    }
}

/* read exactly len bytes at off; 0 ok, -1 end of file, else errno */
static int pread_all(int fd, uint8_t *p, uint64_t len, uint64_t off, uint64_t *got) {
    *got = 0;
    while (*got < len) {
        uint64_t want = len - *got;
        size_t step = want > (1u << 30) ? (1u << 30) : (size_t)want;
        ssize_t r = pread(fd, p + *got, step, (off_t)(off + *got));
        if (r < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (r == 0) return -1;
        *got += (uint64_t)r;
    }
    return 0;
}

static int read_or_fail(rjob *j, int64_t k, uint8_t *p, uint64_t len, uint64_t off) {
    uint64_t got;
    int e = pread_all(j->fd, p, len, off, &got);
    if (e == -1) {
        rfail(j, CKF_ERR_SHORT, 0, k, CKF_WHY_SHORT, off + got);
        return 1;
    }
    if (e) {
        rfail(j, CKF_ERR_IO, e, k, 0, off + got);
        return 1;
    }
    return 0;
}

static void task_read(void *ctx, uint64_t i, int thread) {
    rjob *j = (rjob *)ctx;
    if (atomic_load(&j->failed)) return;
    ckf_rchunk *c = &j->chunks[i];
    int64_t k = (int64_t)i; /* errors name the entry; the caller knows its chunk */
    XXH3_state_t *h = NULL;
    if (j->verify) {
        h = XXH3_createState();
        if (!h) {
            rfail(j, CKF_ERR_NOMEM, ENOMEM, k, 0, 0);
            return;
        }
        XXH3_64bits_reset_withSeed(h, ckf_chunk_seed(j->file_id, c->index, c->offset, c->stored_len, c->raw_len,
                                                     c->codec, c->filter, c->width));
    }
    uint8_t *stored = c->codec == CKF_CODEC_RAW ? c->dst : j->scratch[thread];
    /* the content digest of a raw chunk is taken piece by piece with its checksum,
     * while the piece is still in cache; a zstd chunk's after it is decoded */
    XXH3_state_t *d = NULL;
    if (j->verify && c->has_digest && c->codec == CKF_CODEC_RAW) {
        d = XXH3_createState();
        if (!d) {
            XXH3_freeState(h);
            rfail(j, CKF_ERR_NOMEM, ENOMEM, k, 0, 0);
            return;
        }
        XXH3_128bits_reset(d);
    }
    int bad = 0;
    for (uint64_t done = 0; done < c->stored_len && !bad;) {
        uint64_t step = c->stored_len - done < PIECE ? c->stored_len - done : PIECE;
        bad = read_or_fail(j, k, stored + done, step, c->offset + done);
        if (!bad && h) ckf_xxh3_64_update(h, stored + done, (size_t)step);
        if (!bad && d) ckf_xxh3_128_update(d, stored + done, (size_t)step);
        done += step;
    }
    uint8_t content[16] = {0};
    int check_content = d != NULL;
    if (d) {
        XXH128_canonical_t canon;
        XXH128_canonicalFromHash(&canon, XXH3_128bits_digest(d));
        memcpy(content, canon.digest, sizeof content);
        XXH3_freeState(d);
    }
    uint8_t pad[CKF_ALIGN];
    if (!bad && c->pad) {
        bad = c->pad > CKF_ALIGN || read_or_fail(j, k, pad, c->pad, c->offset + c->stored_len);
        if (!bad && c->pad > CKF_ALIGN) rfail(j, CKF_ERR_CORRUPT, 0, k, CKF_WHY_PADDING, 0);
    }
    uint64_t digest = h ? XXH3_64bits_digest(h) : 0;
    XXH3_freeState(h);
    if (bad) return;
    if (j->verify && digest != c->checksum) {
        rfail(j, CKF_ERR_CORRUPT, 0, k, CKF_WHY_CHECKSUM, 0);
        return;
    }
    for (uint32_t p = 0; p < c->pad; p++) {
        if (pad[p]) {
            rfail(j, CKF_ERR_CORRUPT, 0, k, CKF_WHY_PADDING, c->offset + c->stored_len + p);
            return;
        }
    }
    if (c->codec == CKF_CODEC_RAW) {
        if (check_content && memcmp(content, c->digest, sizeof content))
            rfail(j, CKF_ERR_CORRUPT, 0, k, CKF_WHY_DIGEST, 0);
        return;
    }
    /* zstd: one frame, declaring exactly raw_len, consuming exactly stored_len */
    unsigned long long declared = ZSTD_getFrameContentSize(stored, (size_t)c->stored_len);
    if (declared == ZSTD_CONTENTSIZE_ERROR) {
        rfail(j, CKF_ERR_CORRUPT, 0, k, CKF_WHY_ZSTD, 0);
        return;
    }
    if (declared == ZSTD_CONTENTSIZE_UNKNOWN) {
        rfail(j, CKF_ERR_CORRUPT, 0, k, CKF_WHY_NO_SIZE, 0);
        return;
    }
    if (declared != c->raw_len) {
        rfail(j, CKF_ERR_CORRUPT, 0, k, CKF_WHY_DECLARED, (uint64_t)declared);
        return;
    }
    size_t frame = ZSTD_findFrameCompressedSize(stored, (size_t)c->stored_len);
    if (ZSTD_isError(frame) || frame != c->stored_len) {
        rfail(j, CKF_ERR_CORRUPT, 0, k, CKF_WHY_ZSTD, 0);
        return;
    }
    uint8_t *out = c->filter == CKF_FILTER_SHUFFLE ? j->plain[thread] : c->dst;
    size_t n = ZSTD_decompressDCtx(j->dctx[thread], out, (size_t)c->raw_len, stored, (size_t)c->stored_len);
    if (ZSTD_isError(n)) {
        rfail(j, CKF_ERR_CORRUPT, 0, k, CKF_WHY_ZSTD, 0);
        return;
    }
    if (n != c->raw_len) {
        rfail(j, CKF_ERR_CORRUPT, 0, k, CKF_WHY_DECODED, n);
        return;
    }
    if (c->filter == CKF_FILTER_SHUFFLE) ckf_unshuffle(c->dst, out, c->raw_len, c->width);
    if (j->verify && c->has_digest) {
        ckf_digest(c->dst, c->raw_len, content);
        if (memcmp(content, c->digest, sizeof content)) rfail(j, CKF_ERR_CORRUPT, 0, k, CKF_WHY_DIGEST, 0);
    }
}

int ckf_read_chunks(int fd, const uint8_t *file_id, ckf_rchunk *chunks, uint64_t n, int verify, int nthreads,
                    ckf_status *status) {
    status->code = CKF_OK;
    status->err_no = 0;
    status->chunk = -1;
    status->reason = 0;
    status->value = 0;
    if (nthreads < 1 || nthreads > 256) {
        status->code = CKF_ERR_ARG;
        return CKF_ERR_ARG;
    }
    uint64_t max_stored = 0, max_plain = 0;
    for (uint64_t i = 0; i < n; i++) {
        ckf_rchunk *c = &chunks[i];
        /* the caller validated the index; these checks keep C safe on its own */
        if ((c->codec != CKF_CODEC_RAW && c->codec != CKF_CODEC_ZSTD) ||
            (c->codec == CKF_CODEC_RAW && (c->stored_len != c->raw_len || c->filter != CKF_FILTER_NONE)) ||
            (c->filter == CKF_FILTER_SHUFFLE && (c->width < 2 || c->raw_len % c->width)) ||
            c->filter > CKF_FILTER_SHUFFLE || c->pad >= CKF_ALIGN) {
            status->code = CKF_ERR_ARG;
            status->chunk = (int64_t)i;
            return CKF_ERR_ARG;
        }
        if (c->codec == CKF_CODEC_ZSTD && c->stored_len > max_stored) max_stored = c->stored_len;
        if (c->filter == CKF_FILTER_SHUFFLE && c->raw_len > max_plain) max_plain = c->raw_len;
    }
    rjob j;
    memset(&j, 0, sizeof j);
    j.fd = fd;
    j.file_id = file_id;
    j.chunks = chunks;
    j.verify = verify;
    j.status = status;
    atomic_init(&j.failed, 0);
    j.scratch = calloc((size_t)nthreads, sizeof(uint8_t *));
    j.plain = calloc((size_t)nthreads, sizeof(uint8_t *));
    j.dctx = calloc((size_t)nthreads, sizeof(ZSTD_DCtx *));
    int ok = j.scratch && j.plain && j.dctx;
    for (int t = 0; ok && t < nthreads; t++) {
        if (max_stored) ok = (j.scratch[t] = malloc(max_stored)) != NULL;
        if (ok && max_plain) ok = (j.plain[t] = malloc(max_plain)) != NULL;
        if (ok && max_stored) {
            ok = (j.dctx[t] = ZSTD_createDCtx()) != NULL &&
                 !ZSTD_isError(ZSTD_DCtx_setParameter(j.dctx[t], ZSTD_d_windowLogMax, WINDOW_LOG_MAX));
        }
    }
    if (!ok) {
        status->code = CKF_ERR_NOMEM;
        status->err_no = ENOMEM;
    } else {
        ckf_parallel_for(nthreads, n, task_read, &j);
    }
    for (int t = 0; t < nthreads; t++) {
        if (j.scratch) free(j.scratch[t]);
        if (j.plain) free(j.plain[t]);
        if (j.dctx) ZSTD_freeDCtx(j.dctx[t]);
    }
    free(j.scratch);
    free(j.plain);
    free(j.dctx);
    return status->code;
}
