/* The parallel chunk reader: pread, verify and decode chunks straight into place.
 *
 * Each chunk is read with pread into its destination (raw chunks, in pieces
 * that are hashed while still in cache; small raw chunks that follow each other in
 * the file, a run of them with one preadv) or into a per-thread scratch buffer
 * (zstd chunks), its checksum and zero padding are checked, and zstd chunks
 * are decoded into exactly raw_len bytes (un-shuffled when filtered).  In files
 * with content digests (feature bit 0) the decoded bytes' XXH3-128 is checked too.  Every
 * length comes from the validated index; the decoder still checks each frame
 * against it, so a forged checksum cannot make it write out of bounds.
 *
 * A zstd chunk must be one standard zstd frame (no legacy or skippable frame, no
 * dictionary) whose header declares exactly raw_len bytes and a window of at most
 * 2^27 bytes: one-pass decoding does not enforce ZSTD_d_windowLogMax, so the header
 * is checked here, in the same order and with the same reasons as the Python reader.
 * Scratch buffers are per thread, taken by a thread when it first meets a zstd
 * chunk (warm from an earlier call when cache.c holds one), and only as many
 * threads run as there are chunks.  Shuffled chunks are decoded into the thread's
 * plain buffer and un-shuffled into place, with streaming stores where the
 * destination is resident (load_into's, or a load's once populated) and nobody
 * reads it right after.  A load faults in each large fresh destination in one call
 * just before writing it.  Threads ask for the chunks ahead of theirs to be read
 * (read_ahead): a file read cold keeps the disk busy instead of waiting on each piece.
 *
 * Chunks of encrypted files (a data key in the entry, spec section 17) are decrypted in place
 * with AES-256-GCM, piece by piece right after each piece is read and hashed (the checksum
 * is over the ciphertext), and the tag is checked before anything is decoded; a mismatch is
 * CKF_ERR_AUTH.  A raw chunk's destination then holds plaintext no tag has vouched for
 * until the chunk ends: callers that must not expose it (load_into) check first.
 */
#include <errno.h>
#include <pthread.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>
#include <xxhash.h>
#define ZSTD_STATIC_LINKING_ONLY /* ZSTD_d_windowLogMax, ZSTD_findFrameCompressedSize */
#include <zstd.h>

#include "cache.h"
#include "ckptfmt.h"
#include "xxh.h"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

#define PIECE (256u << 10)
/* Bytes of chunks asked of the kernel ahead of the ones being read (read-ahead advice,
 * a sliding window): the threads read different chunks of one file at once, which the
 * kernel's own readahead takes for random reads, so a cold file was read 256 KiB at a
 * time per thread (0.19 GB/s where dd read 1.1).  Each advice queues one chunk's reads
 * and returns; the window keeps the disk's queue full without holding more than this
 * much of the file in flight. */
#define LOOKAHEAD ((uint64_t)64 << 20)
/* Entries whose bytes follow each other in the file are advised together, up to this many
 * bytes a run, and a mapping's presence (populate_or_fail) is checked once for as many:
 * a probe and an advice per entry cost four system calls for each 4 KiB chunk (a state of
 * many small tensors), more than its read. */
#define SPAN ((uint64_t)1 << 20)
/* Raw chunks of at most RUN_CHUNK bytes that follow each other in the file are read in runs:
 * one preadv of up to RUN_MAX chunks (and their padding) and PIECE bytes, each chunk then
 * checked while the run is in cache.  A read per 4 KiB chunk cost more than the chunk. */
#define RUN_MAX 64
#define RUN_CHUNK ((uint64_t)64 << 10)

typedef struct {
    int fd;
    const uint8_t *map; /* ckf_check_mapped: the file's mapping, read in place instead of fd */
    const uint8_t *file_id;
    ckf_rchunk *chunks;
    int verify;
    int check_only;      /* verify == 2: nobody reads the destinations afterwards */
    uint8_t **piece;     /* check_only, per thread: where raw chunks are read, a piece at a time */
    uint64_t max_stored; /* largest stored zstd chunk: the size of each scratch buffer */
    uint64_t max_plain;  /* largest chunk decoded via plain: the size of each plain buffer */
    uint8_t **scratch;   /* per thread, taken on first use: stored bytes */
    uint8_t **plain;     /* per thread, taken on first use: decoded bytes before un-shuffling
                          * (or, checking only without a digest, instead of the destination) */
    size_t *caps;        /* per thread: the sizes of scratch and plain (cache.c) */
    ZSTD_DCtx **dctx;
    XXH3_state_t **hstate; /* per thread, created on first use: checksum and content digest */
    void **sha;            /* per thread, created on first use: SHA-256 of signed files' chunks */
    void **gcm;            /* per thread, created on first use: AES-256-GCM of encrypted chunks */
    /* the lowest entry that failed (n while none has): errors are reported for the first
     * damaged entry in order whatever thread finds one first, and entries above it are skipped */
    atomic_uint_fast64_t fail_at;
    pthread_mutex_t fail_lock;
    ckf_status *status;
    long page_size;
    uint64_t n;                  /* entries in chunks */
    uint64_t ahead;              /* read-ahead: chunks advised beyond the one a thread starts */
    atomic_uint_fast64_t advised; /* read-ahead: entries [0, advised) are advised or claimed */
    uint64_t *runs;                 /* run r is entries [runs[r], runs[r + 1]) */
    uint64_t data_end;              /* the end of the furthest entry's bytes and padding */
    atomic_uint_fast64_t populated; /* a mapping: bytes [0, populated) were found in the file */
} rjob;

static void rfail(rjob *j, int code, int err_no, int64_t chunk, int reason, uint64_t value) {
    uint64_t at = chunk < 0 ? 0 : (uint64_t)chunk;
    pthread_mutex_lock(&j->fail_lock);
    if (at < atomic_load(&j->fail_at) || !j->status->code) {
        j->status->code = code;
        j->status->err_no = err_no;
        j->status->chunk = chunk;
        j->status->reason = reason;
        j->status->value = value;
        if (at < atomic_load(&j->fail_at)) atomic_store(&j->fail_at, at);
    }
    pthread_mutex_unlock(&j->fail_lock);
}

/* read exactly the bytes of iov[0, cnt) from off on; 0 ok, -1 end of file, else errno; *got: bytes read */
static int preadv_all(int fd, struct iovec *iov, int cnt, uint64_t off, uint64_t *got) {
    *got = 0;
    int idx = 0;
    while (idx < cnt) {
        ssize_t r = preadv(fd, iov + idx, cnt - idx, (off_t)(off + *got));
        if (r < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (r == 0) return -1;
        *got += (uint64_t)r;
        size_t left = (size_t)r;
        while (idx < cnt && left >= iov[idx].iov_len) left -= iov[idx++].iov_len;
        if (idx < cnt && left) {
            iov[idx].iov_base = (uint8_t *)iov[idx].iov_base + left;
            iov[idx].iov_len -= left;
        }
    }
    return 0;
}

/* read exactly len bytes at off (at most a piece: the callers' reads); 0 ok, -1 end of file, else errno */
static int pread_all(int fd, uint8_t *p, uint64_t len, uint64_t off, uint64_t *got) {
    struct iovec one = {.iov_base = p, .iov_len = (size_t)len};
    return preadv_all(fd, &one, 1, off, got);
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

/* madvise(advice) over the pages that hold [p, p+len); 0, or -1 with errno set */
static int advise_pages(const rjob *j, const uint8_t *p, uint64_t len, int advice) {
    uintptr_t start = (uintptr_t)p & ~((uintptr_t)j->page_size - 1);
    return madvise((void *)start, (size_t)((uintptr_t)p + len - start), advice);
}

/* Fail cleanly if the file shrank below [p, p+len) of its mapping, instead of raising
 * SIGBUS when the hash touches it: the page holding the last byte is mapped with
 * MADV_POPULATE_READ (Linux 5.14), which reports a page past the end of the file as an
 * error.  Only that page: the hash then faults the others in, and the kernel maps a
 * fault's neighbours with it (fault-around), which costs less than populating every
 * page (1 GiB here: 0.08 s against 0.11 s on tmpfs, 0.04 s against 0.09 s in the page
 * cache).  A file truncated between this check and the hash still raises SIGBUS, as
 * it would with every page populated first: the truncation unmaps them again. */
static int populate_one(rjob *j, int64_t k, const uint8_t *p, uint64_t len) {
    if (advise_pages(j, p + len - 1, 1, MADV_POPULATE_READ) == 0) return 0;
    if (errno == EINVAL || errno == ENOSYS || errno == EPERM) return 0; /* not supported here */
    if (errno == EINTR || errno == EAGAIN) return 0; /* the hash faults the rest in */
    if (k < 0) return 1;
    rfail(j, CKF_ERR_SHORT, 0, k, CKF_WHY_SHORT, (uint64_t)(p - j->map));
    return 1;
}

/* The check above, made once for many small entries: a file shrinks from its end, so the
 * page holding a byte further on (up to SPAN ahead, within the entries' bytes) being in the
 * file means every byte before it is; bytes below `populated` need no call.  When that
 * further page is not in the file, the entry's own last page is checked, so the failure
 * names the first entry that lies past the end, as one check per entry would. */
static int populate_or_fail(rjob *j, int64_t k, const uint8_t *p, uint64_t len) {
    if (!len) return 0;
    uint64_t end = (uint64_t)(p - j->map) + len;
    if (end <= atomic_load(&j->populated)) return 0;
    uint64_t far = j->data_end - end > SPAN ? end + SPAN : j->data_end;
    if (far > end && populate_one(j, -1, j->map + far - 1, 1) == 0) {
        uint64_t seen = atomic_load(&j->populated);
        while (seen < far && !atomic_compare_exchange_weak(&j->populated, &seen, far)) {
        }
        return 0;
    }
    return populate_one(j, k, p, len);
}

/* Fault in the pages of a fresh destination [p, p+len) in one call, just before
 * they are written: the kernel's loop over them costs about two thirds of a trap
 * per page (1 GiB of 4 KiB pages: 0.32 s against 0.5 s here).  Only the fault-in
 * happens early; the bytes are written as before.  1 if the pages are in; where
 * the call fails (kernels before 5.14, no memory), the writes go on as without it. */
static int populate_dst(rjob *j, uint8_t *p, uint64_t len) {
    return advise_pages(j, p, len, MADV_POPULATE_WRITE) == 0;
}

/* whether the pages of [p, p+len) look resident: the first, middle and last are (a hint) */
static int resident(const uint8_t *p, uint64_t len, long page_size) {
    if (!len) return 0;
    const uint8_t *probe[3] = {p, p + len / 2, p + len - 1};
    for (int i = 0; i < 3; i++) {
        unsigned char in = 0;
        uintptr_t start = (uintptr_t)probe[i] & ~((uintptr_t)page_size - 1);
        if (mincore((void *)start, 1, &in) != 0 || !(in & 1)) return 0;
    }
    return 1;
}

/* whether the bytes [off, off+len) of the file at fd look cached: the first, middle and
 * last byte can be read without waiting for the disk (RWF_NOWAIT; a hint, like resident) */
static int cached(int fd, uint64_t off, uint64_t len) {
    uint64_t probe[3] = {off, off + len / 2, off + len - 1};
    for (int i = 0; i < 3; i++) {
        uint8_t byte;
        struct iovec v = {&byte, 1};
        if (preadv2(fd, &v, 1, (off_t)probe[i], RWF_NOWAIT) != 1) return 0;
    }
    return 1;
}

/* Read-ahead advice for entries up to i + ahead, each claimed by one thread: the bytes
 * of a chunk and its padding, through the mapping (MADV_WILLNEED) or the descriptor
 * (POSIX_FADV_WILLNEED).  Advice only: a failure changes nothing but the speed.
 * Chunks whose pages look resident already are skipped (no page cache walk). */
static void read_ahead(rjob *j, uint64_t i) {
    uint64_t until = j->n - i > j->ahead ? i + j->ahead + 1 : j->n;
    for (;;) {
        uint64_t a = atomic_load(&j->advised);
        if (a >= until) return;
        /* the run from entry a: the entries after it whose bytes follow on, up to SPAN bytes */
        uint64_t start = j->chunks[a].offset;
        uint64_t end = start + j->chunks[a].stored_len + j->chunks[a].pad; /* run_read checked: below 2^63 */
        uint64_t b = a + 1;
        while (b < until && j->chunks[b].offset == end && end - start < SPAN) {
            end += j->chunks[b].stored_len + j->chunks[b].pad;
            b++;
        }
        if (!atomic_compare_exchange_weak(&j->advised, &a, b)) continue;
        uint64_t len = end - start;
        if (!len) continue;
        if (j->map) {
            if (!resident(j->map + start, len, j->page_size))
                (void)advise_pages(j, j->map + start, len, MADV_WILLNEED);
        } else if (!cached(j->fd, start, len)) {
            (void)posix_fadvise(j->fd, (off_t)start, (off_t)len, POSIX_FADV_WILLNEED);
        }
    }
}

/* this thread's buffers for a zstd chunk, allocated when it first needs them; 0 ok */
static int thread_buffers(rjob *j, int thread, const ckf_rchunk *c, int64_t k) {
    if (!j->scratch[thread] &&
        !(j->scratch[thread] = ckf_buf_take((size_t)j->max_stored, &j->caps[2 * thread])))
        goto nomem;
    if ((c->filter == CKF_FILTER_SHUFFLE || (j->check_only && !c->has_digest)) && !j->plain[thread] &&
        !(j->plain[thread] = ckf_buf_take((size_t)j->max_plain, &j->caps[2 * thread + 1])))
        goto nomem;
    if (!j->dctx[thread]) {
        ZSTD_DCtx *d = ckf_dctx_take();
        if (!d) goto nomem;
        j->dctx[thread] = d;
        if (ZSTD_isError(ZSTD_DCtx_setParameter(d, ZSTD_d_windowLogMax, CKF_ZSTD_WINDOW_LOG_MAX))) goto nomem;
    }
    return 0;
nomem:
    rfail(j, CKF_ERR_NOMEM, ENOMEM, k, 0, 0);
    return 1;
}

static uint32_t read_le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* the frame header rules of spec section 3; 0 ok, else the failure is recorded */
static int check_frame(rjob *j, const ckf_rchunk *c, const uint8_t *stored, int64_t k) {
    /* legacy (v0.x) frames, skippable frames and anything else: only the standard magic */
    if (c->stored_len < 4 || read_le32(stored) != ZSTD_MAGICNUMBER) {
        rfail(j, CKF_ERR_CORRUPT, 0, k, CKF_WHY_FRAME, 0);
        return 1;
    }
    ZSTD_frameHeader fh;
    size_t r = ZSTD_getFrameHeader(&fh, stored, (size_t)c->stored_len);
    if (ZSTD_isError(r) || r != 0 || fh.frameType != ZSTD_frame) { /* r > 0: header truncated */
        rfail(j, CKF_ERR_CORRUPT, 0, k, CKF_WHY_ZSTD, 0);
        return 1;
    }
    if (fh.frameContentSize == ZSTD_CONTENTSIZE_UNKNOWN) {
        rfail(j, CKF_ERR_CORRUPT, 0, k, CKF_WHY_NO_SIZE, 0);
        return 1;
    }
    if (fh.frameContentSize != c->raw_len) {
        rfail(j, CKF_ERR_CORRUPT, 0, k, CKF_WHY_DECLARED, (uint64_t)fh.frameContentSize);
        return 1;
    }
    if (fh.windowSize > (1ull << CKF_ZSTD_WINDOW_LOG_MAX)) {
        rfail(j, CKF_ERR_CORRUPT, 0, k, CKF_WHY_WINDOW, (uint64_t)fh.windowSize);
        return 1;
    }
    if (fh.dictID != 0) {
        rfail(j, CKF_ERR_CORRUPT, 0, k, CKF_WHY_DICT, fh.dictID);
        return 1;
    }
    /* a content checksum (fh.checksumFlag) is allowed; ZSTD_decompressDCtx verifies it */
    return 0;
}

/* The thread's checksum state, reset for chunk `c` (its seed binds the chunk to its file, place
 * and shape); NULL once entry k is failed (no memory). */
static XXH3_state_t *checksum_state(rjob *j, const ckf_rchunk *c, int64_t k, int thread) {
    XXH3_state_t **h = &j->hstate[2 * thread];
    if (!*h && !(*h = XXH3_createState())) {
        rfail(j, CKF_ERR_NOMEM, ENOMEM, k, 0, 0);
        return NULL;
    }
    XXH3_64bits_reset_withSeed(
        *h, ckf_chunk_seed(j->file_id, c->index, c->offset, c->stored_len, c->raw_len, c->codec, c->filter, c->width));
    return *h;
}

/* The thread's content digest state, reset; NULL once entry k is failed (no memory). */
static XXH3_state_t *digest_state(rjob *j, int64_t k, int thread) {
    XXH3_state_t **d = &j->hstate[2 * thread + 1];
    if (!*d && !(*d = XXH3_createState())) {
        rfail(j, CKF_ERR_NOMEM, ENOMEM, k, 0, 0);
        return NULL;
    }
    XXH3_128bits_reset(*d);
    return *d;
}

static void task_read(void *ctx, uint64_t i, int thread) {
    rjob *j = (rjob *)ctx;
    if (i > atomic_load(&j->fail_at)) return;
    ckf_rchunk *c = &j->chunks[i];
    int64_t k = (int64_t)i; /* errors name the entry; the caller knows its chunk */
    read_ahead(j, i);
    if (c->codec == CKF_CODEC_ZSTD && thread_buffers(j, thread, c, k)) return;
    XXH3_state_t *h = NULL;
    if (j->verify && !(h = checksum_state(j, c, k, thread))) return;
    /* checking only, a raw chunk goes through one cache-sized buffer instead of its destination */
    uint8_t *through = NULL;
    if (j->check_only && c->codec == CKF_CODEC_RAW && !j->map) {
        if (!j->piece[thread] && !(j->piece[thread] = malloc(PIECE))) {
            rfail(j, CKF_ERR_NOMEM, ENOMEM, k, 0, 0);
            return;
        }
        through = j->piece[thread];
    }
    uint8_t *stored = c->codec == CKF_CODEC_RAW ? c->dst : j->scratch[thread];
    /* the bytes as read: the destination or scratch, or the mapping itself */
    const uint8_t *in = j->map ? j->map + c->offset : stored;
    /* the content digest of a raw chunk is taken piece by piece with its checksum (after
     * decryption when encrypted), while the piece is still in cache; a zstd chunk's after it
     * is decoded */
    XXH3_state_t *d = NULL;
    if (j->verify && c->has_digest && c->codec == CKF_CODEC_RAW && !(d = digest_state(j, k, thread))) return;
    /* the SHA-256 of the stored bytes (signed files read with trusted keys), taken with the
     * checksum, piece by piece; checked before anything is decoded */
    void *s = NULL;
    if (c->has_sha) {
        if (!j->sha[thread] && !(j->sha[thread] = ckf_sha_new())) {
            rfail(j, ckf_crypto_available() ? CKF_ERR_NOMEM : CKF_ERR_CRYPTO, ENOMEM, k, 0, 0);
            return;
        }
        s = j->sha[thread];
        if (!ckf_sha_begin(s, j->file_id, c->index, c->offset, c->stored_len, c->raw_len, c->codec, c->filter,
                           c->width)) {
            rfail(j, CKF_ERR_CRYPTO, 0, k, 0, 0);
            return;
        }
    }
    /* encrypted files: decrypted in place as each piece is read, the tag checked at the end */
    void *g = NULL;
    if (c->key) {
        if (!j->gcm[thread] && !(j->gcm[thread] = ckf_gcm_new())) {
            rfail(j, ckf_crypto_available() ? CKF_ERR_NOMEM : CKF_ERR_CRYPTO, ENOMEM, k, 0, 0);
            return;
        }
        g = j->gcm[thread];
        if (!ckf_gcm_begin(g, 0, c->key, j->file_id, c->index, c->offset, c->stored_len, c->raw_len, c->codec,
                           c->filter, c->width)) {
            rfail(j, CKF_ERR_CRYPTO, 0, k, 0, 0);
            return;
        }
    }
    /* a destination a load writes that is not faulted in yet (a load's fresh memory, not
     * load_into's); below a piece, the pages saved are too few to pay for asking */
    int fresh = c->dst && !j->map && !j->check_only && c->raw_len >= PIECE &&
                !resident(c->dst, c->raw_len, j->page_size);
    int bad = 0;
    for (uint64_t done = 0; done < c->stored_len && !bad;) {
        uint64_t step = c->stored_len - done < PIECE ? c->stored_len - done : PIECE;
        const uint8_t *at = through ? through : in + done;
        if (j->map) {
            bad = populate_or_fail(j, k, at, step);
        } else {
            if (fresh && c->codec == CKF_CODEC_RAW) (void)populate_dst(j, stored + done, step);
            bad = read_or_fail(j, k, through ? through : stored + done, step, c->offset + done);
        }
        if (!bad && h) ckf_xxh3_64_update(h, at, (size_t)step);
        if (!bad && d && !g) ckf_xxh3_128_update(d, at, (size_t)step);
        if (!bad && s && !ckf_sha_update(s, at, step)) {
            rfail(j, CKF_ERR_CRYPTO, 0, k, 0, 0);
            bad = 1;
        }
        if (!bad && g) { /* never a mapping (run_read refuses it): `at` is our own memory */
            uint8_t *w = through ? through : stored + done;
            if (!ckf_gcm_update(g, w, w, step)) {
                rfail(j, CKF_ERR_CRYPTO, 0, k, 0, 0);
                bad = 1;
            }
            /* an encrypted raw chunk's content digest is of its plaintext (incremental files) */
            if (!bad && d) ckf_xxh3_128_update(d, w, (size_t)step);
        }
        done += step;
    }
    uint8_t content[16] = {0};
    int check_content = d != NULL;
    if (d) {
        XXH128_canonical_t canon;
        XXH128_canonicalFromHash(&canon, XXH3_128bits_digest(d));
        memcpy(content, canon.digest, sizeof content);
    }
    uint8_t pad[CKF_ALIGN];
    if (!bad && c->pad) { /* pad < CKF_ALIGN: run_read checked every entry */
        if (j->map) {
            bad = populate_or_fail(j, k, in + c->stored_len, c->pad);
            if (!bad) memcpy(pad, in + c->stored_len, c->pad);
        } else {
            bad = read_or_fail(j, k, pad, c->pad, c->offset + c->stored_len);
        }
    }
    uint64_t digest = h ? XXH3_64bits_digest(h) : 0;
    if (bad) return;
    if (j->verify && digest != c->checksum) {
        rfail(j, CKF_ERR_CORRUPT, 0, k, CKF_WHY_CHECKSUM, 0);
        return;
    }
    if (s) {
        uint8_t sha[32];
        if (!ckf_sha_end(s, sha)) {
            rfail(j, CKF_ERR_CRYPTO, 0, k, 0, 0);
            return;
        }
        if (memcmp(sha, c->sha, sizeof sha)) {
            rfail(j, CKF_ERR_CORRUPT, 0, k, CKF_WHY_SHA, 0);
            return;
        }
    }
    if (g && !ckf_gcm_finish(g, c->tag)) {
        rfail(j, CKF_ERR_AUTH, 0, k, CKF_WHY_TAG, 0);
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
    /* zstd: one standard frame, declaring exactly raw_len, consuming exactly stored_len */
    if (check_frame(j, c, stored, k)) return;
    size_t frame = ZSTD_findFrameCompressedSize(stored, (size_t)c->stored_len);
    if (ZSTD_isError(frame) || frame != c->stored_len) {
        rfail(j, CKF_ERR_CORRUPT, 0, k, CKF_WHY_ZSTD, 0);
        return;
    }
    /* checking only, without a digest to take, the decoded bytes go to the thread's own
     * buffer (in cache) rather than a destination nobody reads */
    int via_plain = c->filter == CKF_FILTER_SHUFFLE || (j->check_only && !c->has_digest);
    uint8_t *out = via_plain ? j->plain[thread] : c->dst;
    /* large destinations are in memory now: resident already, or populated here */
    int placed = c->raw_len >= PIECE && (!fresh || populate_dst(j, c->dst, c->raw_len));
    size_t n = ZSTD_decompressDCtx(j->dctx[thread], out, (size_t)c->raw_len, stored, (size_t)c->stored_len);
    if (ZSTD_isError(n)) {
        rfail(j, CKF_ERR_CORRUPT, 0, k, CKF_WHY_ZSTD, 0);
        return;
    }
    if (n != c->raw_len) {
        rfail(j, CKF_ERR_CORRUPT, 0, k, CKF_WHY_DECODED, n);
        return;
    }
    /* the un-shuffled bytes are only needed by a caller that reads them or for their digest */
    if (j->check_only && !c->has_digest) return;
    /* Streaming stores when nothing reads the destination soon (no digest to take) and
     * its pages are in memory (load_into's, or populated above): they skip reading each
     * line before writing it, about twice as fast.  Where each page fault zeroes a page
     * in the cache right before the write, plain stores are as fast. */
    if (c->filter == CKF_FILTER_SHUFFLE) {
        if (!(c->has_digest && j->verify) &&
            (placed || (c->raw_len < PIECE && resident(c->dst, c->raw_len, j->page_size))))
            ckf_unshuffle_stream(c->dst, out, c->raw_len, c->width);
        else
            ckf_unshuffle(c->dst, out, c->raw_len, c->width);
    }
    if (j->verify && c->has_digest) {
        ckf_digest(c->dst, c->raw_len, content);
        if (memcmp(content, c->digest, sizeof content)) rfail(j, CKF_ERR_CORRUPT, 0, k, CKF_WHY_DIGEST, 0);
    }
}

/* whether entry c may be read in a run with its neighbours: a small raw chunk of the file,
 * neither signed (SHA-256) nor encrypted, whose checks are the checksum, padding and digest */
static int runnable(const rjob *j, const ckf_rchunk *c) {
    return !j->map && c->codec == CKF_CODEC_RAW && !c->key && !c->has_sha && c->stored_len <= RUN_CHUNK;
}

/* The runs of the entries: an entry that is not runnable is a run of its own; so are entries
 * a run cannot take (not following the previous one in the file, or past RUN_MAX or PIECE). */
static uint64_t plan_runs(const rjob *j, uint64_t *runs) {
    const ckf_rchunk *ch = j->chunks;
    uint64_t nruns = 0;
    for (uint64_t i = 0; i < j->n;) {
        uint64_t e = i + 1, bytes = ch[i].stored_len + ch[i].pad;
        if (runnable(j, &ch[i])) {
            while (e < j->n && e - i < RUN_MAX && runnable(j, &ch[e]) &&
                   ch[e].offset == ch[e - 1].offset + ch[e - 1].stored_len + ch[e - 1].pad &&
                   bytes + ch[e].stored_len + ch[e].pad <= PIECE) {
                bytes += ch[e].stored_len + ch[e].pad;
                e++;
            }
        }
        runs[nruns++] = i;
        i = e;
    }
    runs[nruns] = j->n;
    return nruns;
}

/* The checks of a raw chunk read whole to `in` with its padding to `pad`, in task_read's order:
 * checksum, padding, content digest. */
static void check_raw(rjob *j, const ckf_rchunk *c, int64_t k, const uint8_t *in, const uint8_t *pad, int thread) {
    if (j->verify) {
        XXH3_state_t *h = checksum_state(j, c, k, thread);
        if (!h) return;
        ckf_xxh3_64_update(h, in, (size_t)c->stored_len);
        if (XXH3_64bits_digest(h) != c->checksum) {
            rfail(j, CKF_ERR_CORRUPT, 0, k, CKF_WHY_CHECKSUM, 0);
            return;
        }
    }
    for (uint32_t p = 0; p < c->pad; p++) {
        if (pad[p]) {
            rfail(j, CKF_ERR_CORRUPT, 0, k, CKF_WHY_PADDING, c->offset + c->stored_len + p);
            return;
        }
    }
    if (j->verify && c->has_digest) {
        XXH3_state_t *d = digest_state(j, k, thread);
        if (!d) return;
        ckf_xxh3_128_update(d, in, (size_t)c->stored_len);
        XXH128_canonical_t canon;
        XXH128_canonicalFromHash(&canon, XXH3_128bits_digest(d));
        if (memcmp(canon.digest, c->digest, sizeof canon.digest))
            rfail(j, CKF_ERR_CORRUPT, 0, k, CKF_WHY_DIGEST, 0);
    }
}

/* Entries [s, e), a run (plan_runs): one preadv into their destinations (checking only: into
 * the thread's piece buffer) and padding, then each checked.  A read that stops short fails
 * the first entry it did not read whole, where task_read would have, after the entries
 * before it are checked. */
static void read_run(rjob *j, uint64_t s, uint64_t e, int thread) {
    if (s > atomic_load(&j->fail_at)) return;
    read_ahead(j, s);
    uint8_t pads[RUN_MAX][CKF_ALIGN];
    struct iovec iov[2 * RUN_MAX];
    uint8_t *piece = NULL;
    if (j->check_only) {
        if (!j->piece[thread] && !(j->piece[thread] = malloc(PIECE))) {
            rfail(j, CKF_ERR_NOMEM, ENOMEM, (int64_t)s, 0, 0);
            return;
        }
        piece = j->piece[thread];
    }
    int cnt = 0;
    uint64_t pos = 0;
    for (uint64_t i = s; i < e; i++) {
        const ckf_rchunk *c = &j->chunks[i];
        if (c->stored_len) {
            iov[cnt].iov_base = piece ? piece + pos : c->dst;
            iov[cnt++].iov_len = (size_t)c->stored_len;
        }
        if (c->pad) {
            iov[cnt].iov_base = pads[i - s];
            iov[cnt++].iov_len = c->pad;
        }
        pos += c->stored_len;
    }
    uint64_t off = j->chunks[s].offset, got;
    int err = preadv_all(j->fd, iov, cnt, off, &got);
    uint64_t done = 0; /* bytes of the run before entry i */
    pos = 0;
    for (uint64_t i = s; i < e; i++) {
        const ckf_rchunk *c = &j->chunks[i];
        if (i > atomic_load(&j->fail_at)) return;
        if (err && done + c->stored_len + c->pad > got) {
            if (err == -1)
                rfail(j, CKF_ERR_SHORT, 0, (int64_t)i, CKF_WHY_SHORT, off + got);
            else
                rfail(j, CKF_ERR_IO, err, (int64_t)i, 0, off + got);
            return;
        }
        check_raw(j, c, (int64_t)i, piece ? piece + pos : c->dst, pads[i - s], thread);
        done += c->stored_len + c->pad;
        pos += c->stored_len;
    }
}

static void task_run(void *ctx, uint64_t r, int thread) {
    rjob *j = (rjob *)ctx;
    uint64_t s = j->runs[r], e = j->runs[r + 1];
    if (e - s == 1)
        task_read(ctx, s, thread);
    else
        read_run(j, s, e, thread);
}

static int run_read(int fd, const uint8_t *map, uint64_t map_len, const uint8_t *file_id, ckf_rchunk *chunks,
                    uint64_t n, int verify, int nthreads, ckf_status *status) {
    status->code = CKF_OK;
    status->err_no = 0;
    status->chunk = -1;
    status->reason = 0;
    status->value = 0;
    if (nthreads < 1 || nthreads > 256) {
        status->code = CKF_ERR_ARG;
        return CKF_ERR_ARG;
    }
    uint64_t max_stored = 0, max_plain = 0, all_stored = 0, data_end = 0;
    for (uint64_t i = 0; i < n; i++) {
        ckf_rchunk *c = &chunks[i];
        /* the caller validated the index; these checks keep C safe on its own, with checked
         * arithmetic: every byte of the chunk and its padding lies below 2^63 (off_t) */
        if ((c->codec != CKF_CODEC_RAW && c->codec != CKF_CODEC_ZSTD) ||
            (c->codec == CKF_CODEC_RAW && (c->stored_len != c->raw_len || c->filter != CKF_FILTER_NONE)) ||
            (c->codec == CKF_CODEC_ZSTD && (c->stored_len == 0 || c->stored_len >= c->raw_len)) ||
            (c->filter == CKF_FILTER_SHUFFLE && (c->width < 2 || c->raw_len % c->width)) ||
            c->filter > CKF_FILTER_SHUFFLE || c->pad >= CKF_ALIGN || c->offset > (uint64_t)INT64_MAX - CKF_ALIGN ||
            c->stored_len > (uint64_t)INT64_MAX - c->offset - c->pad || c->raw_len > (uint64_t)SIZE_MAX / 2 ||
            (!map && c->raw_len && !c->dst && !(verify == 2 && !c->has_digest)) ||
            (map && (c->codec != CKF_CODEC_RAW || c->offset + c->stored_len + c->pad > map_len)) ||
            (c->has_sha && !verify) || (map && c->key)) {
            status->code = CKF_ERR_ARG;
            status->chunk = (int64_t)i;
            return CKF_ERR_ARG;
        }
        all_stored = all_stored > UINT64_MAX - c->stored_len ? UINT64_MAX : all_stored + c->stored_len;
        if (c->offset + c->stored_len + c->pad > data_end) data_end = c->offset + c->stored_len + c->pad;
        if (c->codec == CKF_CODEC_ZSTD && c->stored_len > max_stored) max_stored = c->stored_len;
        if (c->codec == CKF_CODEC_ZSTD && (c->filter == CKF_FILTER_SHUFFLE || (verify == 2 && !c->has_digest)) &&
            c->raw_len > max_plain)
            max_plain = c->raw_len;
    }
    rjob j;
    memset(&j, 0, sizeof j);
    j.fd = fd;
    j.map = map;
    j.page_size = sysconf(_SC_PAGESIZE) > 0 ? sysconf(_SC_PAGESIZE) : 4096;
    j.file_id = file_id;
    j.chunks = chunks;
    j.verify = verify != 0;
    j.check_only = verify == 2;
    j.status = status;
    j.max_stored = max_stored;
    j.max_plain = max_plain;
    j.n = n;
    j.runs = malloc((n + 1) * sizeof *j.runs);
    if (!j.runs) {
        status->code = CKF_ERR_NOMEM;
        status->err_no = ENOMEM;
        return CKF_ERR_NOMEM;
    }
    uint64_t nruns = plan_runs(&j, j.runs);
    /* no more threads than runs: each thread's scratch is allocated when it first needs it */
    if ((uint64_t)nthreads > nruns) nthreads = nruns ? (int)nruns : 1;
    /* the window in chunks of the mean stored size; at least one beyond each thread's */
    uint64_t mean = n ? all_stored / n : 0;
    j.ahead = mean ? LOOKAHEAD / mean : n;
    if (j.ahead < (uint64_t)nthreads) j.ahead = (uint64_t)nthreads;
    atomic_init(&j.advised, 0);
    j.data_end = data_end;
    atomic_init(&j.populated, 0);
    atomic_init(&j.fail_at, n);
    pthread_mutex_init(&j.fail_lock, NULL);
    j.scratch = calloc((size_t)nthreads, sizeof(uint8_t *));
    j.plain = calloc((size_t)nthreads, sizeof(uint8_t *));
    j.caps = calloc(2 * (size_t)nthreads, sizeof(size_t));
    j.dctx = calloc((size_t)nthreads, sizeof(ZSTD_DCtx *));
    j.hstate = calloc(2 * (size_t)nthreads, sizeof(XXH3_state_t *));
    j.piece = calloc((size_t)nthreads, sizeof(uint8_t *));
    j.sha = calloc((size_t)nthreads, sizeof(void *));
    j.gcm = calloc((size_t)nthreads, sizeof(void *));
    if (!j.scratch || !j.plain || !j.caps || !j.dctx || !j.hstate || !j.piece || !j.sha || !j.gcm) {
        status->code = CKF_ERR_NOMEM;
        status->err_no = ENOMEM;
    } else {
        ckf_parallel_for(nthreads, nruns, task_run, &j);
    }
    for (int t = 0; t < nthreads; t++) {
        if (j.scratch && j.caps) ckf_buf_give(j.scratch[t], j.caps[2 * t]);
        if (j.plain && j.caps) ckf_buf_give(j.plain[t], j.caps[2 * t + 1]);
        if (j.dctx) ckf_dctx_give(j.dctx[t]);
        if (j.hstate) {
            XXH3_freeState(j.hstate[2 * t]);
            XXH3_freeState(j.hstate[2 * t + 1]);
        }
        if (j.piece) free(j.piece[t]);
        if (j.sha) ckf_sha_free(j.sha[t]);
        if (j.gcm) ckf_gcm_free(j.gcm[t]);
    }
    free(j.scratch);
    free(j.plain);
    free(j.caps);
    free(j.dctx);
    free(j.hstate);
    free(j.piece);
    free(j.sha);
    free(j.gcm);
    free(j.runs);
    pthread_mutex_destroy(&j.fail_lock);
    return status->code;
}

int ckf_read_chunks(int fd, const uint8_t *file_id, ckf_rchunk *chunks, uint64_t n, int verify, int nthreads,
                    ckf_status *status) {
    return run_read(fd, NULL, 0, file_id, chunks, n, verify, nthreads, status);
}

int ckf_check_mapped(const uint8_t *map, uint64_t map_len, const uint8_t *file_id, ckf_rchunk *chunks, uint64_t n,
                     int nthreads, ckf_status *status) {
    if (!map) {
        memset(status, 0, sizeof *status);
        status->code = CKF_ERR_ARG;
        status->chunk = -1;
        return CKF_ERR_ARG;
    }
    return run_read(-1, map, map_len, file_id, chunks, n, 1, nthreads, status);
}

int ckf_fill_rchunks(ckf_rchunk *chunks, const uint64_t *fields, uint64_t n) {
    for (uint64_t i = 0; i < n; i++) {
        const uint64_t *f = fields + 10 * i;
        if (f[0] > UINTPTR_MAX || f[5] > UINT8_MAX || f[6] > UINT8_MAX || f[7] > UINT8_MAX || f[9] > UINT32_MAX)
            return CKF_ERR_ARG;
        ckf_rchunk *c = &chunks[i];
        c->dst = (uint8_t *)(uintptr_t)f[0];
        c->index = f[1];
        c->offset = f[2];
        c->stored_len = f[3];
        c->raw_len = f[4];
        c->codec = (uint8_t)f[5];
        c->filter = (uint8_t)f[6];
        c->width = (uint8_t)f[7];
        c->checksum = f[8];
        c->pad = (uint32_t)f[9];
    }
    return CKF_OK;
}
