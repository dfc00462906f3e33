/* Advice to the kernel about fresh host memory. */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

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

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25 /* Linux 6.1 */
#endif
/* regions collapsed per madvise call: a refusal stops the rest early, and each call drains
 * every CPU's LRU lists once (lru_add_drain_all), which on a busy machine waits for them */
#define COLLAPSE_STEP ((uint64_t)256 << 20)

/* Why: a write into a tmpfs file without huge pages allocates, charges and inserts into
 * the page cache each 4 KiB page under the inode lock, and that is most of a save's time.
 * MADV_COLLAPSE gives a region of a shared-memory file one 2 MiB page at once (holes
 * zeroed), after which pwrite only copies.  The region must hold a page to be collapsed,
 * so each gets a zero byte first: every byte of [0, end) of a file being written is
 * either written later or zero padding.  The mapping is a reopened read-only descriptor's
 * (the writer's may be write-only), placed 2 MiB-aligned, and unmapped before returning:
 * nothing is ever written through it. */
int ckf_huge_file(int fd, uint64_t end, uint64_t *regions) {
    *regions = 0;
    uint64_t len = end & ~(uint64_t)(HUGE_PAGE - 1);
    struct stat st;
    if (len == 0) return 0;
    if (fstat(fd, &st)) return errno;
    if (st.st_size != 0) return EEXIST; /* only a new, empty file: no byte of it is overwritten */
    if (ftruncate(fd, (off_t)end)) return errno;
    for (uint64_t off = 0; off < len; off += HUGE_PAGE) {
        static const uint8_t zero = 0;
        ssize_t w = pwrite(fd, &zero, 1, (off_t)off);
        if (w != 1) return w < 0 ? errno : EIO;
    }
    char self[64];
    snprintf(self, sizeof self, "/proc/self/fd/%d", fd);
    int rfd = open(self, O_RDONLY | O_CLOEXEC); /* the open file itself, not a path */
    if (rfd < 0) return errno;
    int err = 0;
    size_t span = (size_t)len + HUGE_PAGE;
    uint8_t *area = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (area == MAP_FAILED) {
        err = errno;
        close(rfd);
        return err;
    }
    uint8_t *at = (uint8_t *)(((uintptr_t)area + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1));
    uint8_t *map = mmap(at, (size_t)len, PROT_READ, MAP_SHARED | MAP_FIXED, rfd, 0);
    close(rfd);
    if (map == MAP_FAILED) {
        err = errno;
    } else {
        for (uint64_t off = 0; off < len && !err; off += COLLAPSE_STEP) {
            uint64_t step = len - off < COLLAPSE_STEP ? len - off : COLLAPSE_STEP;
            if (madvise(map + off, (size_t)step, MADV_COLLAPSE)) err = errno;
            else *regions += step / HUGE_PAGE;
        }
    }
    munmap(area, span); /* the file's mapping lies inside the reservation: both go */
    return err;
}
