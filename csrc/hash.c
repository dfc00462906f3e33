/* Context-bound chunk checksums (spec/FORMAT.md section 4) and content digests (section 12). */
#include <string.h>
#include <xxhash.h>

#include "ckptfmt.h"
#include "xxh.h"

extern XXH128_hash_t XXH3_128bits_dispatch(const void *input, size_t len) __attribute__((weak));
extern XXH_errorcode XXH3_128bits_update_dispatch(XXH3_state_t *state, const void *input, size_t len)
    __attribute__((weak));
extern XXH_errorcode XXH3_64bits_update_dispatch(XXH3_state_t *state, const void *input, size_t len)
    __attribute__((weak));

XXH128_hash_t ckf_xxh3_128(const void *input, size_t len) {
    return XXH3_128bits_dispatch ? XXH3_128bits_dispatch(input, len) : XXH3_128bits(input, len);
}

XXH_errorcode ckf_xxh3_128_update(XXH3_state_t *state, const void *input, size_t len) {
    return XXH3_128bits_update_dispatch ? XXH3_128bits_update_dispatch(state, input, len)
                                        : XXH3_128bits_update(state, input, len);
}

XXH_errorcode ckf_xxh3_64_update(XXH3_state_t *state, const void *input, size_t len) {
    return XXH3_64bits_update_dispatch ? XXH3_64bits_update_dispatch(state, input, len)
                                       : XXH3_64bits_update(state, input, len);
}

static void put64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

uint64_t ckf_chunk_seed(const uint8_t *file_id, uint64_t index, uint64_t offset, uint64_t stored_len,
                        uint64_t raw_len, uint8_t codec, uint8_t filter, uint8_t width) {
    uint8_t ctx[72];
    memset(ctx, 0, sizeof ctx);
    memcpy(ctx, "ckptfmt-chunk", 13); /* followed by three zero bytes */
    memcpy(ctx + 16, file_id, 16);
    put64(ctx + 32, index);
    put64(ctx + 40, offset);
    put64(ctx + 48, stored_len);
    put64(ctx + 56, raw_len);
    ctx[64] = codec;
    ctx[65] = filter;
    ctx[66] = width;
    return XXH3_64bits(ctx, sizeof ctx);
}

unsigned ckf_xxhash_version(void) { return XXH_versionNumber(); }

void ckf_digest(const uint8_t *src, uint64_t len, uint8_t *out) {
    XXH128_canonical_t canon;
    XXH128_canonicalFromHash(&canon, ckf_xxh3_128(src, (size_t)len));
    memcpy(out, canon.digest, 16);
}

/* Content digests of many chunks, one chunk per task: chunks are a few MiB,
 * so a state of any real size keeps every thread busy. */
typedef struct {
    const uint8_t **src;
    const uint64_t *len;
    uint8_t *out;
} digest_job;

static void task_digest(void *ctx, uint64_t i, int thread) {
    digest_job *j = (digest_job *)ctx;
    (void)thread;
    ckf_digest(j->src[i], j->len[i], j->out + 16 * i);
}

void ckf_content_digests(const uint8_t **src, const uint64_t *len, uint64_t n, uint8_t *out, int nthreads) {
    digest_job j = {src, len, out};
    ckf_parallel_for(nthreads, n, task_digest, &j);
}
