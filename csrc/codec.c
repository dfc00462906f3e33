/* The byte-shuffle filter and zstd with the format's frame parameters. */
#include <zstd.h>

#include "ckptfmt.h"

/* dst[j*n + i] = src[i*w + j]: byte j of every unit, for j = 0..w-1 */
void ckf_shuffle(uint8_t *dst, const uint8_t *src, uint64_t len, uint32_t width) {
    uint64_t n = len / width;
    if (width == 2) {
        uint8_t *lo = dst, *hi = dst + n;
        for (uint64_t i = 0; i < n; i++) {
            lo[i] = src[2 * i];
            hi[i] = src[2 * i + 1];
        }
        return;
    }
    if (width == 4) {
        uint8_t *p0 = dst, *p1 = dst + n, *p2 = dst + 2 * n, *p3 = dst + 3 * n;
        for (uint64_t i = 0; i < n; i++) {
            p0[i] = src[4 * i];
            p1[i] = src[4 * i + 1];
            p2[i] = src[4 * i + 2];
            p3[i] = src[4 * i + 3];
        }
        return;
    }
    for (uint64_t i = 0; i < n; i++)
        for (uint32_t j = 0; j < width; j++) dst[j * n + i] = src[i * width + j];
}

void ckf_unshuffle(uint8_t *dst, const uint8_t *src, uint64_t len, uint32_t width) {
    uint64_t n = len / width;
    for (uint64_t i = 0; i < n; i++)
        for (uint32_t j = 0; j < width; j++) dst[i * width + j] = src[j * n + i];
}

size_t ckf_zstd_bound(size_t len) { return ZSTD_compressBound(len); }

unsigned ckf_zstd_version(void) { return ZSTD_versionNumber(); }

static size_t compress_with(ZSTD_CCtx *cctx, uint8_t *dst, size_t cap, const uint8_t *src, size_t len,
                            int level) {
    ZSTD_CCtx_reset(cctx, ZSTD_reset_session_and_parameters);
    int fast_profile = level == CKF_LEVEL_FAST_PROFILE;
    if (fast_profile) level = 1;
    if (ZSTD_isError(ZSTD_CCtx_setParameter(cctx, ZSTD_c_compressionLevel, level))) return 0;
    if (fast_profile) {
        /* Shuffled floating-point data gains from Huffman-coding the sign/exponent
         * plane, hardly from matches: a tiny hash table and long minimum matches
         * keep the ratio and roughly double the speed. */
        if (ZSTD_isError(ZSTD_CCtx_setParameter(cctx, ZSTD_c_strategy, ZSTD_fast))) return 0;
        if (ZSTD_isError(ZSTD_CCtx_setParameter(cctx, ZSTD_c_minMatch, 7))) return 0;
        if (ZSTD_isError(ZSTD_CCtx_setParameter(cctx, ZSTD_c_hashLog, 8))) return 0;
    }
    if (ZSTD_isError(ZSTD_CCtx_setParameter(cctx, ZSTD_c_contentSizeFlag, 1))) return 0;
    if (ZSTD_isError(ZSTD_CCtx_setParameter(cctx, ZSTD_c_checksumFlag, 0))) return 0;
    size_t r = ZSTD_compress2(cctx, dst, cap, src, len);
    return ZSTD_isError(r) ? 0 : r;
}

size_t ckf_zstd_compress(uint8_t *dst, size_t cap, const uint8_t *src, size_t len, int level) {
    ZSTD_CCtx *cctx = ZSTD_createCCtx();
    if (!cctx) return 0;
    size_t r = compress_with(cctx, dst, cap, src, len, level);
    ZSTD_freeCCtx(cctx);
    return r;
}

/* used by writer.c with a per-thread context */
size_t ckf_zstd_compress_ctx(void *cctx, uint8_t *dst, size_t cap, const uint8_t *src, size_t len, int level) {
    return compress_with((ZSTD_CCtx *)cctx, dst, cap, src, len, level);
}
