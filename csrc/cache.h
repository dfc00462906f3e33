/* The engine's process-wide cache of scratch buffers and zstd contexts (cache.c). */
#ifndef CKPTFMT_CACHE_H
#define CKPTFMT_CACHE_H

#include <stddef.h>
#include <zstd.h>

/* a buffer of at least size bytes (*cap: its real size), warm from an earlier call
 * when one is cached, else malloc'd; NULL when out of memory */
void *ckf_buf_take(size_t size, size_t *cap);
/* hand a buffer from ckf_buf_take back (NULL is fine): cached, or freed */
void ckf_buf_give(void *p, size_t cap);
/* zstd contexts, reset to their defaults; NULL when out of memory */
ZSTD_DCtx *ckf_dctx_take(void);
void ckf_dctx_give(ZSTD_DCtx *d);
ZSTD_CCtx *ckf_cctx_take(void);
void ckf_cctx_give(ZSTD_CCtx *c);

#endif
