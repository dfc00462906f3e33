/* Advice to the kernel about fresh host memory. */
#include <errno.h>
#include <stdint.h>
#include <sys/mman.h>

#include "ckptfmt.h"

#define HUGE_PAGE ((uintptr_t)2 << 20)

int ckf_advise_huge(uint8_t *p, uint64_t len) {
#ifdef MADV_HUGEPAGE
    uintptr_t start = ((uintptr_t)p + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1);
    uintptr_t end = ((uintptr_t)p + (uintptr_t)len) & ~(HUGE_PAGE - 1);
    if (len > UINTPTR_MAX - (uintptr_t)p || end <= start) return 0; /* no whole huge page inside */
    return madvise((void *)start, (size_t)(end - start), MADV_HUGEPAGE) ? errno : 0;
#else
    (void)p;
    (void)len;
    return 0;
#endif
}
