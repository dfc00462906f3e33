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
 * MAP_SHARED; the caller learns that the child is done from a byte on a pipe (or,
 * for a child that died, from waitpid), and trusts the result only if `finished`
 * is set (a child killed part-way never sets it).
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "ckptfmt.h"

/* Close descriptors [lo, ...) except those in keep (sorted, all above 2) with
 * close_range; -1 where the kernel lacks it. */
static int close_ranges(const int *keep, int nkeep) {
#ifdef SYS_close_range
    unsigned lo = 3;
    for (int i = 0; i < nkeep; i++) {
        unsigned k = (unsigned)keep[i];
        if (k > lo && syscall(SYS_close_range, lo, k - 1, 0) != 0) return -1;
        if (k + 1 > lo) lo = k + 1;
    }
    return syscall(SYS_close_range, lo, ~0u, 0) == 0 ? 0 : -1;
#else
    (void)keep;
    (void)nkeep;
    return -1;
#endif
}

static int is_kept(const int *keep, int nkeep, long fd) {
    for (int i = 0; i < nkeep; i++)
        if (keep[i] == fd) return 1;
    return 0;
}

/* Close every descriptor above 2 except those in keep (sorted, all above 2): with
 * close_range, else those /proc/self/fd lists (never a loop up to RLIMIT_NOFILE,
 * which can be a billion). */
static void close_all_but(const int *keep, int nkeep) {
    if (close_ranges(keep, nkeep) == 0) return;
    for (;;) { /* listed in batches: closing while the directory is read could skip entries */
        int found[256], n = 0;
        DIR *d = opendir("/proc/self/fd");
        if (!d) { /* no /proc: a bounded loop over the numbers descriptors usually take */
            for (int v = 3; v < 65536; v++)
                if (!is_kept(keep, nkeep, v)) close(v);
            return;
        }
        struct dirent *e;
        while (n < 256 && (e = readdir(d)) != NULL) {
            char *end;
            long v = strtol(e->d_name, &end, 10);
            if (*end || end == e->d_name || v < 3 || v == dirfd(d)) continue;
            if (!is_kept(keep, nkeep, v)) found[n++] = (int)v;
        }
        closedir(d);
        for (int i = 0; i < n; i++) close(found[i]);
        if (n < 256) return;
    }
}

/* A descriptor the child keeps, moved above 2 if it is one of the standard three
 * (quiet_stdio replaces those); the child gives up when it cannot be moved, since
 * writing the file through /dev/null would commit holes. */
static int above_stdio(int fd) {
    if (fd > 2) return fd;
    int moved = fcntl(fd, F_DUPFD, 3);
    if (moved < 0) _exit(4);
    return moved;
}

/* stdin and stdout become /dev/null: a reader of the parent's output must not wait for
 * this child to end.  stderr stays in sanitizer builds, which report there. */
static void quiet_stdio(void) {
#if defined(__SANITIZE_ADDRESS__)
    const int last = 1;
#else
    const int last = 2;
#endif
    int null = open("/dev/null", O_RDWR | O_CLOEXEC);
    for (int t = 0; t <= last; t++) {
        if (null >= 0)
            dup2(null, t);
        else
            close(t);
    }
    if (null > last) close(null);
}

/* The parent holds the write end of this pipe: end-of-file means it is gone (killed,
 * or exited), and then nobody will commit what this child writes.  A process the
 * parent forked meanwhile may hold that end too, so the parent's pid is checked as
 * well, ten times a second: once the parent is gone, this child has another. */
typedef struct {
    int fd;
    pid_t parent;
} watch_arg;

static void *watch_parent(void *p) {
    watch_arg *w = (watch_arg *)p;
    for (;;) {
        struct pollfd pf = {w->fd, POLLIN, 0};
        if (poll(&pf, 1, 100) > 0 || getppid() != w->parent) _exit(2);
    }
    return NULL;
}

static void sort3(int *a) {
    for (int i = 0; i < 3; i++)
        for (int j = i + 1; j < 3; j++)
            if (a[j] < a[i]) {
                int t = a[i];
                a[i] = a[j];
                a[j] = t;
            }
}

/* The content digest of each chunk (spec section 12), one chunk per task. */
typedef struct {
    const ckf_chunk *chunks;
    uint8_t *digests;
} digest_job;

static void task_digest(void *ctx, uint64_t i, int thread) {
    digest_job *j = (digest_job *)ctx;
    (void)thread;
    ckf_digest(j->chunks[i].src, j->chunks[i].raw_len, j->digests + 16 * i);
}

static int held_cmp(uint64_t raw_len, const uint8_t *digest, const ckf_held *h) {
    if (raw_len != h->raw_len) return raw_len < h->raw_len ? -1 : 1;
    return memcmp(digest, h->digest, 16);
}

/* The position of (raw_len, digest) in `held` (sorted by raw length, then digest bytes), or -1. */
static int64_t find_held(const ckf_held *held, uint64_t nheld, uint64_t raw_len, const uint8_t *digest) {
    uint64_t lo = 0, hi = nheld;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        int c = held_cmp(raw_len, digest, &held[mid]);
        if (c == 0) return (int64_t)mid;
        if (c < 0)
            hi = mid;
        else
            lo = mid + 1;
    }
    return -1;
}

/* An incremental save's chunks: digest every chunk, look each up in `held` (match[k]: its
 * position there, or -1), and write the chunks not found, each run of them between found
 * ones as the chunk numbers and at the offsets it has in the file (what the parent's writer
 * does, engine/chunkwrite.py's ChunkWriter).  With nothing held, one pass writes every chunk
 * and takes its digest on the way. */
static int write_against(int fd, const uint8_t *file_id, uint64_t first_index, uint64_t first_offset,
                         ckf_chunk *chunks, uint64_t n, int compress, int level, int nthreads, int checksum,
                         const ckf_held *held, uint64_t nheld, uint8_t *digests, int64_t *match,
                         ckf_status *status, uint64_t *end_offset) {
    for (uint64_t k = 0; k < n; k++) match[k] = -1;
    if (nheld == 0)
        return ckf_write_chunks(fd, file_id, first_index, first_offset, chunks, n, compress, level, nthreads,
                                checksum, digests, status, end_offset);
    digest_job dj = {chunks, digests};
    ckf_parallel_for(nthreads, n, task_digest, &dj);
    for (uint64_t k = 0; k < n; k++) match[k] = find_held(held, nheld, chunks[k].raw_len, digests + 16 * k);
    uint64_t pos = first_offset;
    status->code = CKF_OK;
    status->err_no = 0;
    status->chunk = -1;
    *end_offset = pos;
    for (uint64_t i = 0; i < n;) {
        if (match[i] >= 0) {
            i++;
            continue;
        }
        uint64_t j = i;
        while (j < n && match[j] < 0) j++;
        int rc = ckf_write_chunks(fd, file_id, first_index + i, pos, chunks + i, j - i, compress, level, nthreads,
                                  checksum, NULL, status, &pos);
        *end_offset = pos;
        if (rc != CKF_OK) return rc;
        i = j;
    }
    return CKF_OK;
}

/* fork() with every signal blocked, as the caller's mask comes back at once in the parent:
 * signals meant for the job (a terminal's ^C, a scheduler's SIGTERM) are the parent's to act
 * on, since it decides whether this save still matters.  The child is born with them blocked
 * (no moment in which one could kill it or run a handler of the parent's); they stay blocked
 * on the writer's threads too, so a write past RLIMIT_FSIZE fails with EFBIG instead of
 * killing the child.  In the child, `keep` (three descriptors) are moved above 2 and every
 * other descriptor is closed, stdio goes to /dev/null, and a thread makes it exit once the
 * parent is gone (keep[2] is the read end of the parent's pipe).  Returns what fork() does. */
static pid_t fork_quiet(int keep[3]) {
    sigset_t all, before;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &before);
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid != 0) { /* the parent: the child's pid, or -1 with errno */
        int err = errno;
        pthread_sigmask(SIG_SETMASK, &before, NULL);
        errno = err;
        return pid;
    }
    for (int i = 0; i < 3; i++) keep[i] = above_stdio(keep[i]);
    int sorted[3] = {keep[0], keep[1], keep[2]};
    sort3(sorted);
    close_all_but(sorted, 3);
    quiet_stdio();
    static watch_arg watch; /* the child's only copy: it lasts until _exit */
    watch.fd = keep[2];
    watch.parent = parent;
    pthread_t watcher;
    if (pthread_create(&watcher, NULL, watch_parent, &watch) == 0) pthread_detach(watcher);
    return 0;
}

/* A child's test faults: 1 it kills itself, 2 it exits without a result, 3 or 4 it sleeps 2 or
 * 30 s (slow enough to look at, or to outlive its parent). */
static void test_faults(int test_fault) {
    if (test_fault == 1) kill(getpid(), SIGKILL);
    if (test_fault == 2) _exit(3);
    if (test_fault == 3) sleep(2);
    if (test_fault == 4) sleep(30);
}

/* The child's work once it knows it: write the chunks, publish the result, tell the parent
 * (which may commit then, while this process's exit still unmaps its memory), exit. */
static void write_and_exit(int fd, const uint8_t *file_id, uint64_t first_index, uint64_t first_offset,
                           ckf_chunk *chunks, uint64_t n, int compress, int level, int nthreads, int checksum,
                           const ckf_held *held, uint64_t nheld, uint8_t *digests, int64_t *match, int ready_fd,
                           ckf_fork_result *result) {
    if (digests)
        result->rc = write_against(fd, file_id, first_index, first_offset, chunks, n, compress, level, nthreads,
                                   checksum, held, nheld, digests, match, &result->status, &result->end_offset);
    else
        result->rc = ckf_write_chunks(fd, file_id, first_index, first_offset, chunks, n, compress, level,
                                      nthreads, checksum, NULL, &result->status, &result->end_offset);
    atomic_store(&result->finished, 1);
    ssize_t w;
    do {
        w = write(ready_fd, "", 1);
    } while (w < 0 && errno == EINTR);
    _exit(0);
}

int64_t ckf_fork_write(int fd, const uint8_t *file_id, uint64_t first_index, uint64_t first_offset,
                       ckf_chunk *chunks, uint64_t n, int compress, int level, int nthreads, int checksum,
                       const ckf_held *held, uint64_t nheld, uint8_t *digests, int64_t *match, int ready_fd,
                       int parent_fd, ckf_fork_result *result, int test_fault) {
    atomic_store(&result->finished, 0);
    result->rc = CKF_ERR_ARG;
    int keep[3] = {fd, ready_fd, parent_fd};
    pid_t pid = fork_quiet(keep);
    if (pid != 0) return (int64_t)pid;
    test_faults(test_fault);
    write_and_exit(keep[0], file_id, first_index, first_offset, chunks, n, compress, level, nthreads, checksum,
                   held, nheld, digests, match, keep[1], result);
    return 0; /* not reached */
}

static int64_t now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

/* Wait at most `wait_ms` for the job to arrive on `sock`: a parent that never hands one over
 * (nor closes its end) must not keep this child, and the memory it holds, for ever.  Past
 * the deadline the child exits with status 6, which the parent names (background/forksave.py). */
static void await_job(int sock, int wait_ms) {
    const int64_t end = now_ms() + wait_ms;
    for (;;) {
        int64_t left = end - now_ms();
        if (left <= 0) _exit(6);
        struct pollfd pf = {sock, POLLIN, 0};
        int rc = poll(&pf, 1, left > INT32_MAX ? INT32_MAX : (int)left);
        if (rc > 0) return; /* a message, or end-of-file: recvmsg tells which */
        if (rc < 0 && errno != EINTR) _exit(5);
    }
}

/* The job of a staged child (ckf_fork_stage): one message on its socket carrying the file's
 * descriptor and a memfd that holds a ckf_fork_job, whose arrays lie at offsets within it (the
 * parent and the child map it at different addresses).  Whatever is wrong with it, the child
 * exits without a result, which fails the save. */
static ckf_fork_job *receive_job(int sock, int *file_fd) {
    char byte;
    struct iovec iov = {&byte, 1};
    union {
        char buf[CMSG_SPACE(2 * sizeof(int))];
        struct cmsghdr align;
    } u;
    struct msghdr msg;
    memset(&msg, 0, sizeof msg);
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = u.buf;
    msg.msg_controllen = sizeof u.buf;
    ssize_t got;
    do {
        got = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
    } while (got < 0 && errno == EINTR);
    if (got <= 0) _exit(0); /* the parent closed its end: it needs nothing written */
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    if (!c || c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS || c->cmsg_len != CMSG_LEN(2 * sizeof(int)))
        _exit(5);
    int fds[2];
    memcpy(fds, CMSG_DATA(c), sizeof fds);
    struct stat st;
    if (fstat(fds[1], &st) != 0 || (uint64_t)st.st_size < sizeof(ckf_fork_job)) _exit(5);
    void *map = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fds[1], 0);
    close(fds[1]);
    if (map == MAP_FAILED) _exit(5);
    ckf_fork_job *job = (ckf_fork_job *)map;
    if (job->size != (uint64_t)st.st_size) _exit(5);
    *file_fd = fds[0];
    return job;
}

/* Whether [at, at + count * width) lies within the job's region (overflow checked). */
static int fits(const ckf_fork_job *job, uint64_t at, uint64_t count, uint64_t width) {
    if (count && width > (UINT64_MAX - at) / count) return 0;
    return at + count * width <= job->size;
}

static void *at_offset(ckf_fork_job *job, uint64_t at) { return (uint8_t *)job + at; }

int64_t ckf_fork_stage(int sock, int ready_fd, int parent_fd, int job_wait_ms) {
    int keep[3] = {sock, ready_fd, parent_fd};
    pid_t pid = fork_quiet(keep);
    if (pid != 0) return (int64_t)pid;
    await_job(keep[0], job_wait_ms);
    int fd;
    ckf_fork_job *job = receive_job(keep[0], &fd);
    close(keep[0]);
    uint64_t n = job->n, nheld = job->nheld;
    if (!fits(job, job->chunks_at, n, sizeof(ckf_chunk)) || !fits(job, job->held_at, nheld, sizeof(ckf_held)) ||
        (job->find && (!fits(job, job->digests_at, n, 16) || !fits(job, job->match_at, n, 8))))
        _exit(5);
    ckf_chunk *chunks = (ckf_chunk *)at_offset(job, job->chunks_at);
    for (uint64_t k = 0; k < n; k++) chunks[k].key = job->has_key ? job->key : NULL;
    test_faults(job->test_fault);
    write_and_exit(fd, job->file_id, job->first_index, job->first_offset, chunks, n, job->compress, job->level,
                   job->nthreads, job->checksum, (const ckf_held *)at_offset(job, job->held_at), nheld,
                   job->find ? (uint8_t *)at_offset(job, job->digests_at) : NULL,
                   job->find ? (int64_t *)at_offset(job, job->match_at) : NULL, keep[1], &job->result);
    return 0; /* not reached */
}
