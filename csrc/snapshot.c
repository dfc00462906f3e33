/* Copy-on-write snapshots for non-blocking saves: a forked child writes the chunks.
 *
 * fork() hands a child the caller's memory as it is at that instant, shared
 * copy-on-write: the child writes the chunks from that view while the parent goes
 * on changing its tensors, and no byte is copied up front.  The child runs only
 * the C writer and its threads, never Python: in a threaded process the child of
 * fork() has one thread, and any lock another thread held (the interpreter's, the
 * framework's) stays held there forever.  The writer needs only libc, zstd and
 * xxhash, whose state a fork leaves usable (cache.c releases its own lock in the
 * child).
 *
 * The chunk records and the result go back through memory the caller mapped
 * MAP_SHARED; the caller learns that the child is done from waitpid, and trusts
 * the result only if `finished` is set (a child killed part-way never sets it).
 */
#include <errno.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "ckptfmt.h"

/* Close descriptors [lo, hi] (hi may be ~0u): close_range where the kernel has it. */
static void close_span(unsigned lo, unsigned hi) {
    if (lo > hi) return;
#ifdef SYS_close_range
    if (syscall(SYS_close_range, lo, hi, 0) == 0) return;
#endif
    struct rlimit rl;
    unsigned top = getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY ? (unsigned)rl.rlim_cur : 65536u;
    for (unsigned d = lo; d <= hi && d < top; d++) close((int)d);
}

/* The child holds only what it writes to: another process waiting for a pipe or a
 * socket of the parent's to close must not wait for this save as well. */
static void close_all_but(int a, int b) {
    unsigned lo = (unsigned)(a < b ? a : b), hi = (unsigned)(a < b ? b : a);
    if (lo >= 3) close_span(3, lo - 1);
    if (hi > lo) close_span(lo + 1, hi - 1);
    close_span(hi + 1, ~0u);
}

int64_t ckf_fork_write(int fd, const uint8_t *file_id, uint64_t first_index, uint64_t first_offset,
                       ckf_chunk *chunks, uint64_t n, int compress, int level, int nthreads, int ready_fd,
                       ckf_fork_result *result, int test_fault) {
    atomic_store(&result->finished, 0);
    result->rc = CKF_ERR_ARG;
    /* Signals meant for the job (a terminal's ^C, a scheduler's SIGTERM) are the
     * parent's to act on: it decides whether this save still matters.  They are
     * blocked across fork() so the child is born with them blocked (no moment in
     * which one could kill it or run a handler of the parent's); they stay blocked
     * on the writer's threads too, so a write past RLIMIT_FSIZE fails with EFBIG
     * instead of killing the child.  The parent's mask comes back at once. */
    sigset_t all, before;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &before);
    pid_t pid = fork();
    if (pid != 0) { /* the parent: the child's pid, or -1 with errno */
        int err = errno;
        pthread_sigmask(SIG_SETMASK, &before, NULL);
        errno = err;
        return (int64_t)pid;
    }
    close_all_but(fd, ready_fd);
    if (test_fault == 1) kill(getpid(), SIGKILL); /* tests: a child that dies part-way */
    if (test_fault == 2) _exit(3);                /* tests: a child that exits without a result */
    if (test_fault == 3) sleep(2);                /* tests: a child slow enough to look at */
    result->rc = ckf_write_chunks(fd, file_id, first_index, first_offset, chunks, n, compress, level, nthreads,
                                  1, NULL, &result->status, &result->end_offset);
    atomic_store(&result->finished, 1);
    /* the parent may commit now, while this process's exit still unmaps its memory */
    ssize_t w;
    do {
        w = write(ready_fd, "", 1);
    } while (w < 0 && errno == EINTR);
    _exit(0);
}
