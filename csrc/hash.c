/* Context-bound chunk checksums (spec/FORMAT.md section 4). */
#include <string.h>
#include <xxhash.h>

#include "ckptfmt.h"

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
