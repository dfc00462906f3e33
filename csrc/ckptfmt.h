/* ckptfmt C engine: chunk encoding, checksums and parallel positioned I/O.
 *
 * C does bytes and threads; Python does decisions, files and errors.  No
 * function here calls back into Python, and every call runs with the GIL
 * released (cffi releases it around out-of-line API calls).  Errors come back
 * as a code, the errno and the chunk index in a ckf_status.
 */
#ifndef CKPTFMT_H
#define CKPTFMT_H

#include <stddef.h>
#include <stdint.h>

#define CKF_OK 0
#define CKF_ERR_IO 1      /* a system call failed: see err_no */
#define CKF_ERR_NOMEM 2   /* an allocation failed */
#define CKF_ERR_ZSTD 3    /* zstd refused to compress or decompress */
#define CKF_ERR_ARG 4     /* an argument is out of range */
#define CKF_ERR_CORRUPT 5 /* stored bytes do not match their checksum or sizes */
#define CKF_ERR_SHORT 6   /* the file ended before a chunk did */
#define CKF_ERR_CRYPTO 7  /* libcrypto failed, or the engine was built without it */
#define CKF_ERR_AUTH 8    /* an encrypted chunk's GCM tag does not match (spec section 17) */

/* level meaning: zstd level 1 tuned for shuffled floating-point data (the default):
 * the fast strategy, minimum match and hash table log below (ckptfmt/format.py has
 * the same numbers as ZSTD_FAST_PROFILE) */
#define CKF_LEVEL_FAST_PROFILE 1000
#define CKF_FAST_MIN_MATCH 7
#define CKF_FAST_HASH_LOG 8
/* frames needing a larger window (log2 of bytes) are rejected, spec section 3 */
#define CKF_ZSTD_WINDOW_LOG_MAX 27

#define CKF_CODEC_RAW 0
#define CKF_CODEC_ZSTD 1
#define CKF_FILTER_NONE 0
#define CKF_FILTER_SHUFFLE 1
#define CKF_ALIGN 64

/* One chunk.  The writer reads src/raw_len/width and fills the rest. */
typedef struct {
    const uint8_t *src;  /* raw bytes */
    uint64_t raw_len;
    uint32_t width;      /* shuffle unit of the storage's dtype; 1 = never shuffle */
    uint64_t offset;     /* out */
    uint64_t stored_len; /* out */
    uint64_t checksum;   /* out */
    uint8_t codec;       /* out */
    uint8_t filter;      /* out */
    uint8_t fwidth;      /* out: filter width, 0 without a filter */
    uint8_t sha[32];     /* out, with checksum & CKF_SHA: the chunk's SHA-256 (spec section 16) */
    const uint8_t *key;  /* encrypted files: the 32-byte data key (spec section 17), else NULL */
    uint8_t tag[16];     /* out, with key: the GCM tag of the chunk's ciphertext */
} ckf_chunk;

typedef struct {
    int code;
    int err_no;
    int64_t chunk;  /* index of the chunk that failed, -1 if none */
    int reason;     /* CKF_WHY_* for CKF_ERR_CORRUPT and CKF_ERR_SHORT */
    uint64_t value; /* a size or offset that goes with the reason */
} ckf_status;

/* One chunk to read: where it is (from the validated index) and where it goes. */
typedef struct {
    uint8_t *dst; /* raw_len bytes */
    uint64_t index;
    uint64_t offset;
    uint64_t stored_len;
    uint64_t raw_len;
    uint64_t checksum;
    uint32_t pad; /* zero bytes after the chunk (< 64) */
    uint8_t codec;
    uint8_t filter;
    uint8_t width;
    uint8_t has_digest; /* files with feature bit 0: check the decoded bytes' digest too */
    uint8_t digest[16]; /* XXH3-128 of the raw bytes, canonical (big-endian) order */
    uint8_t has_sha;    /* signed files read with trusted keys: check the stored bytes' SHA-256 */
    uint8_t sha[32];    /* the chunk's SHA-256 (spec section 16) */
    const uint8_t *key; /* encrypted files: the 32-byte data key (spec section 17), else NULL */
    uint8_t tag[16];    /* with key: the GCM tag the ciphertext must have */
} ckf_rchunk;

#define CKF_WHY_CHECKSUM 1 /* checksum mismatch */
#define CKF_WHY_PADDING 2  /* non-zero padding (value: its offset) */
#define CKF_WHY_ZSTD 3     /* not a single valid zstd frame */
#define CKF_WHY_NO_SIZE 4  /* the frame does not declare its size */
#define CKF_WHY_DECLARED 5 /* the frame declares another size (value) */
#define CKF_WHY_DECODED 6  /* the frame decodes to another size (value) */
#define CKF_WHY_SHORT 7    /* the file ended (value: where) */
#define CKF_WHY_DIGEST 8   /* the decoded bytes do not match their content digest */
#define CKF_WHY_FRAME 9    /* not a standard zstd frame: legacy, skippable or another magic */
#define CKF_WHY_WINDOW 10  /* the frame needs a window above 2^27 bytes (value: its size) */
#define CKF_WHY_DICT 11    /* the frame needs a dictionary (value: its id) */
#define CKF_WHY_SHA 12     /* the stored bytes do not match their SHA-256 (spec section 16) */
#define CKF_WHY_TAG 13     /* the ciphertext does not match its GCM tag (spec section 17) */

/* ckf_write_chunks' checksum argument: bit 0 XXH3 checksums, bit 1 SHA-256 digests too */
#define CKF_SHA 2

/* Read, verify (when verify != 0) and decode chunks [0, n) on nthreads threads.
 * verify == 2 checks only: every check is made, but the destinations' contents are
 * left undefined (raw chunks pass through a small per-thread buffer, shuffled chunks
 * are not un-shuffled unless their content digest needs it), and a chunk without a
 * content digest may have no destination (dst NULL).
 * chunks[i].index is the chunk number the checksum seed binds (in the file at fd);
 * on failure status->chunk is i, the position of the failing entry in `chunks`.
 * Entries are taken in order, each thread asking the kernel to read ahead the chunks
 * up to about 64 MiB beyond the one it starts (POSIX_FADV_WILLNEED, where not cached). */
int ckf_read_chunks(int fd, const uint8_t *file_id, ckf_rchunk *chunks, uint64_t n, int verify, int nthreads,
                    ckf_status *status);

/* chunks[i] from fields[10 i, 10 i + 10): dst, index, offset, stored_len, raw_len, codec, filter,
 * width, checksum, pad (a chunk record's order); the rest of each left as it is.  CKF_ERR_ARG,
 * and chunk i left unset, where a value does not fit its member */
int ckf_fill_rchunks(ckf_rchunk *chunks, const uint64_t *fields, uint64_t n);

/* Verify raw chunks [0, n) where they lie in a mapping of their file (map_len bytes
 * from offset 0): checksums, padding and content digests, on nthreads threads,
 * the hash faulting the pages in (each piece's last page is mapped first, so that a
 * file shrunk below it is an error, not SIGBUS), with the
 * read-ahead of ckf_read_chunks through the mapping (MADV_WILLNEED); `dst` is
 * not used.  A file that shrank below the mapping fails with CKF_ERR_SHORT. */
int ckf_check_mapped(const uint8_t *map, uint64_t map_len, const uint8_t *file_id, ckf_rchunk *chunks, uint64_t n,
                     int nthreads, ckf_status *status);

/* Ask the kernel for transparent huge pages for the 2 MiB-aligned interior of
 * fresh memory [p, p+len) before it is first touched; 0, or the errno of madvise. */
int ckf_advise_huge(uint8_t *p, uint64_t len);

/* Give a new, empty file on a shared-memory filesystem (tmpfs) 2 MiB pages for its
 * 2 MiB-aligned interior below `end` (MADV_COLLAPSE), before it is written: the file is
 * sized to `end` and each region gets one zero byte (the bytes of [0, end) are all
 * written later or zero).  *regions counts the 2 MiB regions collapsed; 0, or the errno
 * of the step that failed (the regions before it stay huge, the rest keep small pages). */
int ckf_huge_file(int fd, uint64_t end, uint64_t *regions);

/* Encode, checksum and pwrite chunks [0, n) as chunks number first_index.. of
 * the file, the first at first_offset (a multiple of 64), each next one at the
 * 64-aligned end of the previous.  compress: 0 raw, 1 zstd at `level`.  On
 * success *end_offset is the aligned end of the last chunk.  checksum = 0 skips
 * hashing and leaves every checksum 0: such files are invalid; benchmarks only.
 * digests: NULL, or 16 * n bytes that receive each chunk's content digest
 * (XXH3-128 of its raw bytes, canonical order), taken in the same pass. */
int ckf_write_chunks(int fd, const uint8_t *file_id, uint64_t first_index, uint64_t first_offset,
                     ckf_chunk *chunks, uint64_t n, int compress, int level, int nthreads, int checksum,
                     uint8_t *digests, ckf_status *status, uint64_t *end_offset);

/* The outcome of a forked write (snapshot.c), in memory mapped MAP_SHARED so the
 * parent sees what the child wrote there.  finished is set last, and only by a
 * child that ran the writer to its end; rc, status and end_offset are then those
 * of ckf_write_chunks. */
typedef struct {
    _Atomic int32_t finished;
    int32_t rc;
    ckf_status status;
    uint64_t end_offset;
} ckf_fork_result;

/* A chunk an incremental save may refer to instead of writing it (spec section 12): its raw
 * length and content digest (canonical order).  Arrays of these are sorted by raw_len, then
 * by the digest's bytes (memcmp). */
typedef struct {
    uint64_t raw_len;
    uint8_t digest[16];
} ckf_held;

/* Fork a child that runs ckf_write_chunks (`checksum` as there: 1, or 1 | CKF_SHA) over `chunks`
 * from its copy-on-write view of this process's memory, writes one byte to ready_fd
 * and exits.  With `digests` (16 * n bytes) and `match` (n entries), both MAP_SHARED, the
 * save is incremental: the child takes every chunk's content digest into `digests`, sets
 * match[k] to the position in `held` (nheld entries, sorted as ckf_held says) of the same
 * (raw length, digest), or -1, and writes only the chunks not found, each at the chunk
 * number it has in the file, one after another from first_offset; the records of found
 * chunks are left as they were (the parent fills them in from the file that holds them).  It keeps no other descriptor than fd, ready_fd and parent_fd (stdin and
 * stdout become /dev/null, stderr too outside sanitizer builds), and exits at once
 * when parent_fd, the read end of a pipe whose write end only the parent holds,
 * reaches end-of-file.  `chunks` and `result` must lie in MAP_SHARED memory.
 * Returns the child's pid (reap it with waitpid), or -1 with errno set when fork()
 * fails.  test_fault: 0; tests pass 1
 * (the child kills itself with SIGKILL), 2 (it exits with status 3), 3 or 4 (it
 * sleeps 2 or 30 s before writing). */
int64_t ckf_fork_write(int fd, const uint8_t *file_id, uint64_t first_index, uint64_t first_offset,
                       ckf_chunk *chunks, uint64_t n, int compress, int level, int nthreads, int checksum,
                       const ckf_held *held, uint64_t nheld, uint8_t *digests, int64_t *match, int ready_fd,
                       int parent_fd, ckf_fork_result *result, int test_fault);

/* The job a staged child (ckf_fork_stage) is handed: what ckf_fork_write takes, in one memfd
 * the parent fills and passes over the child's socket with the file's descriptor.  The
 * arrays lie at byte offsets from the job's start (the two processes map it at different
 * addresses): `n` ckf_chunk at chunks_at (their `key` is set by the child: `key` when has_key),
 * `nheld` ckf_held at held_at, and with `find` (an incremental save) 16 * n digest bytes at
 * digests_at and n int64_t matches at match_at.  `size` is the memfd's length. */
typedef struct {
    uint64_t size;
    uint64_t first_index;
    uint64_t first_offset;
    uint64_t n;
    uint64_t nheld;
    uint64_t chunks_at;
    uint64_t held_at;
    uint64_t digests_at;
    uint64_t match_at;
    int32_t compress;
    int32_t level;
    int32_t nthreads;
    int32_t checksum;
    int32_t has_key;
    int32_t find;
    int32_t test_fault;
    int32_t unused;
    uint8_t file_id[16];
    uint8_t key[32];
    ckf_fork_result result;
} ckf_fork_job;

/* Fork a child that holds this process's memory as it is now (copy-on-write) and waits to be
 * told what to write of it: one message on `sock` (a Unix socket) with two descriptors, the
 * file to write and a memfd holding a ckf_fork_job.  It then does what ckf_fork_write's child
 * does with the job's arguments, and sets the job's `result`.  It exits without writing when
 * `sock` reaches end-of-file (the parent needs nothing written) or parent_fd does (the parent
 * is gone), and without a result when the job is malformed (status 5) or has not come within
 * job_wait_ms milliseconds of the fork (status 6).  Descriptors and signals as for
 * ckf_fork_write.  Returns the child's pid, or -1 with errno set. */
int64_t ckf_fork_stage(int sock, int ready_fd, int parent_fd, int job_wait_ms);

/* Helpers shared by the engine and exposed for tests. */
/* tests only: hold the engine cache's lock for ms milliseconds (cache.c) */
void ckf_test_hold_cache(unsigned ms);
uint64_t ckf_chunk_seed(const uint8_t *file_id, uint64_t index, uint64_t offset, uint64_t stored_len,
                        uint64_t raw_len, uint8_t codec, uint8_t filter, uint8_t width);
void ckf_shuffle(uint8_t *dst, const uint8_t *src, uint64_t len, uint32_t width);
void ckf_unshuffle(uint8_t *dst, const uint8_t *src, uint64_t len, uint32_t width);
/* the same bytes with non-temporal stores where dst is 16-byte aligned: for destinations not read again soon */
void ckf_unshuffle_stream(uint8_t *dst, const uint8_t *src, uint64_t len, uint32_t width);
/* zstd-compress with the engine's exact parameters; returns the size or 0 on failure */
size_t ckf_zstd_compress(uint8_t *dst, size_t cap, const uint8_t *src, size_t len, int level);
size_t ckf_zstd_bound(size_t len);
/* zstd alone, for benchmarks and tests: decode one frame into dst; its size, or (size_t)-1 */
size_t ckf_zstd_decompress(uint8_t *dst, size_t cap, const uint8_t *src, size_t len);
unsigned ckf_zstd_version(void);
unsigned ckf_xxhash_version(void);
/* memcpy on nthreads threads */
void ckf_copy(uint8_t *dst, const uint8_t *src, uint64_t len, int nthreads);
/* n copies on nthreads threads: the bytes at address spans[3i] go to address spans[3i+1],
 * spans[3i+2] of them (the spans must not overlap); 0, or with nothing copied ENOMEM, or
 * EINVAL for lengths whose pieces' count overflows (one over UINT64_MAX - 1 MiB, say) */
int ckf_copy_spans(const uint64_t *spans, uint64_t n, int nthreads);
/* content digest (spec section 12): XXH3-128 of src, 16 bytes in canonical (big-endian) order */
void ckf_digest(const uint8_t *src, uint64_t len, uint8_t *out);
/* content digests of chunks [0, n) on nthreads threads: out[16*i ..] for chunk i */
void ckf_content_digests(const uint8_t **src, const uint64_t *len, uint64_t n, uint8_t *out, int nthreads);

/* SHA-256 chunk digests (crypto.c): 0 where the engine was built without libcrypto */
int ckf_crypto_available(void);
void *ckf_sha_new(void);
void ckf_sha_free(void *ctx);
int ckf_sha_begin(void *ctx, const uint8_t *file_id, uint64_t index, uint64_t offset, uint64_t stored_len,
                  uint64_t raw_len, uint8_t codec, uint8_t filter, uint8_t width);
int ckf_sha_update(void *ctx, const uint8_t *p, uint64_t len);
int ckf_sha_end(void *ctx, uint8_t *out);
/* AES-256-GCM of encrypted files' chunks (crypto.c, spec section 17.3): begin sets the key, the
 * nonce of chunk `index` and the 72-byte associated data; update en- or decrypts len bytes
 * (out may equal in); finish writes the tag (encrypting) or checks it (decrypting).  1 ok, 0 not */
void *ckf_gcm_new(void);
void ckf_gcm_free(void *ctx);
int ckf_gcm_begin(void *ctx, int encrypt, const uint8_t *key, const uint8_t *file_id, uint64_t index,
                  uint64_t offset, uint64_t stored_len, uint64_t raw_len, uint8_t codec, uint8_t filter,
                  uint8_t width);
int ckf_gcm_update(void *ctx, uint8_t *out, const uint8_t *in, uint64_t len);
int ckf_gcm_finish(void *ctx, uint8_t *tag);
/* one AES-256-GCM encryption or decryption (12-byte nonce, any associated data): the small
 * messages of a file (the key wrap, the index) without loading a second crypto library; 0 on
 * failure (for ckf_gcm_open: also when `tag` does not match) */
int ckf_gcm_seal(const uint8_t *key, const uint8_t *nonce, const uint8_t *aad, uint64_t aad_len, const uint8_t *in,
                 uint64_t len, uint8_t *out, uint8_t *tag);
int ckf_gcm_open(const uint8_t *key, const uint8_t *nonce, const uint8_t *aad, uint64_t aad_len, const uint8_t *in,
                 uint64_t len, uint8_t *out, uint8_t *tag);

/* parallel for: calls fn(ctx, i, thread) for i in [0, n) on nthreads threads
 * (the calling thread is one of them); returns 0, or an errno if threads could
 * not be started (then everything ran on the calling thread). */
typedef void (*ckf_task)(void *ctx, uint64_t i, int thread);
int ckf_parallel_for(int nthreads, uint64_t n, ckf_task fn, void *ctx);

#endif
