/* The byte-shuffle filter and zstd with the format's frame parameters. */
#include <zstd.h>

#include "ckptfmt.h"

/* The byte-shuffle filter: unit i of `width` bytes goes to byte i of each of the
 * `width` planes, dst[j*n + i] = src[i*width + j].  Widths 2, 4 and 8 (bf16/fp16,
 * fp32, fp64/int64) take 16 units at a time with SSE2 byte interleaves, which every
 * x86-64 has; other widths and the last units use the plain loops. */

static void shuffle_tail(uint8_t *dst, const uint8_t *src, uint64_t n, uint32_t width, uint64_t from) {
    for (uint64_t i = from; i < n; i++)
        for (uint32_t j = 0; j < width; j++) dst[j * n + i] = src[i * width + j];
}

static void unshuffle_tail(uint8_t *dst, const uint8_t *src, uint64_t n, uint32_t width, uint64_t from) {
    for (uint64_t i = from; i < n; i++)
        for (uint32_t j = 0; j < width; j++) dst[i * width + j] = src[j * n + i];
}

#ifdef __SSE2__
#include <emmintrin.h>

#define LOAD(p) _mm_loadu_si128((const __m128i *)(p))
#define STORE(p, v) _mm_storeu_si128((__m128i *)(p), (v))

/* Non-temporal stores (stream != 0, a 16-byte aligned destination) write around the
 * cache: for un-shuffled bytes that nobody reads soon (a loaded state is far larger
 * than the cache) they skip reading every destination line before writing it. */
#define PUT(p, v)                                                                                                  \
    do {                                                                                                           \
        if (stream)                                                                                                \
            _mm_stream_si128((__m128i *)(p), (v));                                                                 \
        else                                                                                                       \
            STORE(p, v);                                                                                           \
    } while (0)

/* 16 units of `width` bytes from the planes at src + j*n + i, interleaved into dst */
static inline __attribute__((always_inline)) uint64_t unshuffle_sse2_body(uint8_t *dst, const uint8_t *src, uint64_t n,
                                                                          uint32_t width, int stream) {
    uint64_t i = 0;
    if (width == 2) {
        for (; i + 16 <= n; i += 16) {
            __m128i a = LOAD(src + i), b = LOAD(src + n + i);
            PUT(dst + 2 * i, _mm_unpacklo_epi8(a, b));
            PUT(dst + 2 * i + 16, _mm_unpackhi_epi8(a, b));
        }
    } else if (width == 4) {
        for (; i + 16 <= n; i += 16) {
            __m128i a0 = LOAD(src + i), a1 = LOAD(src + n + i);
            __m128i a2 = LOAD(src + 2 * n + i), a3 = LOAD(src + 3 * n + i);
            __m128i lo01 = _mm_unpacklo_epi8(a0, a1), hi01 = _mm_unpackhi_epi8(a0, a1);
            __m128i lo23 = _mm_unpacklo_epi8(a2, a3), hi23 = _mm_unpackhi_epi8(a2, a3);
            uint8_t *o = dst + 4 * i;
            PUT(o, _mm_unpacklo_epi16(lo01, lo23));
            PUT(o + 16, _mm_unpackhi_epi16(lo01, lo23));
            PUT(o + 32, _mm_unpacklo_epi16(hi01, hi23));
            PUT(o + 48, _mm_unpackhi_epi16(hi01, hi23));
        }
    } else if (width == 8) {
        for (; i + 16 <= n; i += 16) {
            __m128i a[8], b[8], c[8];
            for (int j = 0; j < 8; j++) a[j] = LOAD(src + (uint64_t)j * n + i);
            /* bytes j, j+1 of units 0-7 (b[j]) and 8-15 (b[j+1]) */
            for (int j = 0; j < 8; j += 2) {
                b[j] = _mm_unpacklo_epi8(a[j], a[j + 1]);
                b[j + 1] = _mm_unpackhi_epi8(a[j], a[j + 1]);
            }
            /* bytes 0-3 and 4-7 of units 0-3, 4-7, 8-11, 12-15 */
            for (int h = 0; h < 2; h++) {
                c[4 * h] = _mm_unpacklo_epi16(b[h], b[2 + h]);
                c[4 * h + 1] = _mm_unpackhi_epi16(b[h], b[2 + h]);
                c[4 * h + 2] = _mm_unpacklo_epi16(b[4 + h], b[6 + h]);
                c[4 * h + 3] = _mm_unpackhi_epi16(b[4 + h], b[6 + h]);
            }
            uint8_t *o = dst + 8 * i;
            for (int q = 0; q < 2; q++) {     /* units 0-7, then 8-15 */
                for (int r = 0; r < 2; r++) { /* units 0-3 / 4-7 of that half */
                    __m128i x = c[4 * q + r], y = c[4 * q + 2 + r];
                    PUT(o, _mm_unpacklo_epi32(x, y));
                    PUT(o + 16, _mm_unpackhi_epi32(x, y));
                    o += 32;
                }
            }
        }
    }
    return i;
}

static uint64_t unshuffle_sse2(uint8_t *dst, const uint8_t *src, uint64_t n, uint32_t width, int stream) {
    if (!stream || (uintptr_t)dst % 16) return unshuffle_sse2_body(dst, src, n, width, 0);
    uint64_t i = unshuffle_sse2_body(dst, src, n, width, 1);
    _mm_sfence();
    return i;
}

/* even and odd bytes of 32 bytes: the inverse of one unpack level */
static inline void split_bytes(__m128i x, __m128i y, __m128i *even, __m128i *odd) {
    const __m128i mask = _mm_set1_epi16(0x00ff);
    *even = _mm_packus_epi16(_mm_and_si128(x, mask), _mm_and_si128(y, mask));
    *odd = _mm_packus_epi16(_mm_srli_epi16(x, 8), _mm_srli_epi16(y, 8));
}

/* The source of a shuffle is the caller's tensor memory, read once and not in cache:
 * the hardware prefetcher alone leaves the loop waiting on memory (about 11 GB/s
 * from DRAM, against 16 with a software prefetch 2 KiB ahead). */
#define PREFETCH_AHEAD 2048
#define PREFETCH(p) _mm_prefetch((const char *)(p) + PREFETCH_AHEAD, _MM_HINT_T0)

static uint64_t shuffle_sse2(uint8_t *dst, const uint8_t *src, uint64_t n, uint32_t width) {
    uint64_t i = 0;
    if (width == 2) {
        for (; i + 16 <= n; i += 16) {
            __m128i e, o;
            if (i % 32 == 0) PREFETCH(src + 2 * i);
            split_bytes(LOAD(src + 2 * i), LOAD(src + 2 * i + 16), &e, &o);
            STORE(dst + i, e);
            STORE(dst + n + i, o);
        }
    } else if (width == 4) {
        for (; i + 16 <= n; i += 16) {
            const uint8_t *s = src + 4 * i;
            PREFETCH(s);
            __m128i e0, o0, e1, o1, p0, p1, p2, p3;
            split_bytes(LOAD(s), LOAD(s + 16), &e0, &o0);      /* bytes 0,2 / 1,3 of units 0-7 */
            split_bytes(LOAD(s + 32), LOAD(s + 48), &e1, &o1); /* units 8-15 */
            split_bytes(e0, e1, &p0, &p2);
            split_bytes(o0, o1, &p1, &p3);
            STORE(dst + i, p0);
            STORE(dst + n + i, p1);
            STORE(dst + 2 * n + i, p2);
            STORE(dst + 3 * n + i, p3);
        }
    } else if (width == 8) {
        for (; i + 16 <= n; i += 16) {
            const uint8_t *s = src + 8 * i;
            PREFETCH(s);
            PREFETCH(s + 64);
            __m128i e[4], o[4], ee[2], eo[2], oe[2], oo[2], p[8];
            for (int k = 0; k < 4; k++) split_bytes(LOAD(s + 32 * k), LOAD(s + 32 * k + 16), &e[k], &o[k]);
            /* e: bytes 0,2,4,6 of units 4k..4k+3; o: bytes 1,3,5,7 */
            split_bytes(e[0], e[1], &ee[0], &eo[0]);
            split_bytes(e[2], e[3], &ee[1], &eo[1]);
            split_bytes(o[0], o[1], &oe[0], &oo[0]);
            split_bytes(o[2], o[3], &oe[1], &oo[1]);
            /* ee: bytes 0,4; eo: 2,6; oe: 1,5; oo: 3,7 -- of units 0-7 and 8-15 */
            split_bytes(ee[0], ee[1], &p[0], &p[4]);
            split_bytes(eo[0], eo[1], &p[2], &p[6]);
            split_bytes(oe[0], oe[1], &p[1], &p[5]);
            split_bytes(oo[0], oo[1], &p[3], &p[7]);
            for (int j = 0; j < 8; j++) STORE(dst + (uint64_t)j * n + i, p[j]);
        }
    }
    return i;
}
#else
static uint64_t unshuffle_sse2(uint8_t *dst, const uint8_t *src, uint64_t n, uint32_t width, int stream) {
    (void)dst, (void)src, (void)n, (void)width, (void)stream;
    return 0;
}
static uint64_t shuffle_sse2(uint8_t *dst, const uint8_t *src, uint64_t n, uint32_t width) {
    (void)dst, (void)src, (void)n, (void)width;
    return 0;
}
#endif

void ckf_shuffle(uint8_t *dst, const uint8_t *src, uint64_t len, uint32_t width) {
    uint64_t n = len / width;
    shuffle_tail(dst, src, n, width, shuffle_sse2(dst, src, n, width));
}

void ckf_unshuffle(uint8_t *dst, const uint8_t *src, uint64_t len, uint32_t width) {
    uint64_t n = len / width;
    unshuffle_tail(dst, src, n, width, unshuffle_sse2(dst, src, n, width, 0));
}

void ckf_unshuffle_stream(uint8_t *dst, const uint8_t *src, uint64_t len, uint32_t width) {
    uint64_t n = len / width;
    unshuffle_tail(dst, src, n, width, unshuffle_sse2(dst, src, n, width, 1));
}

size_t ckf_zstd_bound(size_t len) { return ZSTD_compressBound(len); }

size_t ckf_zstd_decompress(uint8_t *dst, size_t cap, const uint8_t *src, size_t len) {
    size_t r = ZSTD_decompress(dst, cap, src, len);
    return ZSTD_isError(r) ? (size_t)-1 : r;
}

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
        if (ZSTD_isError(ZSTD_CCtx_setParameter(cctx, ZSTD_c_minMatch, CKF_FAST_MIN_MATCH))) return 0;
        if (ZSTD_isError(ZSTD_CCtx_setParameter(cctx, ZSTD_c_hashLog, CKF_FAST_HASH_LOG))) return 0;
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
