"""The only module that imports the compiled C engine; turns its codes into exceptions.

`available()` says whether the engine was built.  CKPTFMT_BACKEND=python forces
the pure-Python path even when it was.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import threading
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError, CheckpointWarning
from ..format.encryption import TagMismatch
from .children import stop_child

if TYPE_CHECKING:
    from .writeoptions import WriteOptions

#: why the engine could not be imported (None when it was)
NOT_BUILT: str | None = None
try:  # the engine is optional: installs without a compiler use the Python path
    from .._ckptfmt_c import ffi, lib  # type: ignore[import-not-found]
except ImportError as e:  # depends on the build
    ffi = None
    lib = None
    NOT_BUILT = str(e)
    if os.environ.get("CKPTFMT_REQUIRE_ENGINE") == "1":
        raise ImportError(
            f"ckptfmt: CKPTFMT_REQUIRE_ENGINE=1 but the C engine is not built ({e}); install "
            "gcc, libzstd-dev and libxxhash-dev and reinstall ckptfmt"
        ) from e
_warned_slow = False

#: the level value that asks the engine for its default zstd profile
FAST_PROFILE = 1000


def built() -> bool:
    return lib is not None


def available() -> bool:
    forced = os.environ.get("CKPTFMT_BACKEND", "").lower() == "python"
    if lib is None and not forced:
        _warn_slow_path()
    return lib is not None and not forced


def _warn_slow_path() -> None:
    """Say once, at the first use, that the engine is missing: pip hides the failed build."""
    global _warned_slow
    if _warned_slow:
        return
    _warned_slow = True
    warnings.warn(
        f"ckptfmt: the C engine is not built ({NOT_BUILT}); using the pure-Python path, which is "
        "several times slower. Install gcc, libzstd-dev and libxxhash-dev and reinstall; "
        "CKPTFMT_REQUIRE_ENGINE=1 makes this an error, CKPTFMT_BACKEND=python silences it.",
        CheckpointWarning,
        stacklevel=3,
    )


def versions() -> dict[str, str]:
    if lib is None:
        return {}
    z = int(lib.ckf_zstd_version())
    x = int(lib.ckf_xxhash_version())
    return {
        "zstd": f"{z // 10000}.{z // 100 % 100}.{z % 100}",
        "xxhash": f"{x // 10000}.{x // 100 % 100}.{x % 100}",
    }


ERR_IO, ERR_NOMEM, ERR_ZSTD, ERR_ARG, ERR_CORRUPT, ERR_SHORT, ERR_CRYPTO = 1, 2, 3, 4, 5, 6, 7
ERR_AUTH = 8  # an encrypted chunk's GCM tag failed (spec section 17)
WHY_CHECKSUM, WHY_PADDING, WHY_ZSTD, WHY_NO_SIZE, WHY_DECLARED, WHY_DECODED, WHY_SHORT = 1, 2, 3, 4, 5, 6, 7
WHY_DIGEST = 8
WHY_FRAME, WHY_WINDOW, WHY_DICT = 9, 10, 11
WHY_SHA = 12
WHY_TAG = 13


def crypto_available() -> bool:
    """Whether the engine was built with libcrypto (SHA-256 chunk digests for signed files,
    AES-256-GCM for encrypted ones)."""
    return lib is not None and bool(lib.ckf_crypto_available())


class EngineGCM:
    """AES-256-GCM of small messages by the engine's libcrypto, with the interface of
    ``cryptography``'s AESGCM (encrypt, decrypt raising its InvalidTag): a file's key wrap and
    index without importing ``cryptography`` (whose first import costs a save or a load a tenth
    of a second or more)."""

    def __init__(self, key: bytes) -> None:
        if lib is None or not lib.ckf_crypto_available() or len(key) != 32:
            raise ValueError("EngineGCM needs the engine built with libcrypto and a 32-byte key")
        self._key = bytes(key)

    def __repr__(self) -> str:
        return "EngineGCM()"  # never the key

    def encrypt(self, nonce: bytes, data: bytes, aad: bytes | None) -> bytes:
        """Ciphertext then the 16-byte tag, as AESGCM.encrypt returns them."""
        assert lib is not None and ffi is not None
        if len(nonce) != 12:
            raise ValueError("EngineGCM takes 12-byte nonces")
        aad = aad or b""
        out = ffi.new("uint8_t[]", max(len(data), 1))
        tag = ffi.new("uint8_t[16]")
        if not lib.ckf_gcm_seal(self._key, nonce, aad, len(aad), data, len(data), out, tag):
            raise ValueError("AES-256-GCM encryption failed in libcrypto")
        return bytes(ffi.buffer(out, len(data))) + bytes(ffi.buffer(tag, 16))

    def decrypt(self, nonce: bytes, data: bytes, aad: bytes | None) -> bytes:
        """The plaintext of `data` (ciphertext then its 16-byte tag); cryptography's InvalidTag
        (imported only then) when the tag does not match, or format.encryption.TagMismatch
        where cryptography is not installed."""
        assert lib is not None and ffi is not None
        if len(nonce) != 12:
            raise ValueError("EngineGCM takes 12-byte nonces")
        aad = aad or b""
        n = len(data) - 16
        out = ffi.new("uint8_t[]", max(n, 1))
        if n < 0 or not lib.ckf_gcm_open(
            self._key, nonce, aad, len(aad), bytes(data[:n]), n, out, ffi.new("uint8_t[16]", bytes(data[n:]))
        ):
            try:
                from cryptography.exceptions import InvalidTag
            except ImportError:
                raise TagMismatch from None
            raise InvalidTag
        return bytes(ffi.buffer(out, n))


_cap = threading.local()  # threads_at_most: a cap for the engine calls of this thread


def default_threads() -> int:
    """Engine threads per call: CKPTFMT_THREADS, else the cores (at most 16), under any cap
    this thread set with threads_at_most."""
    text = os.environ.get("CKPTFMT_THREADS")
    n = max(1, min(256, int(text))) if text else max(1, min(16, os.cpu_count() or 1))
    cap = getattr(_cap, "n", None)
    return n if cap is None else max(1, min(n, cap))


def threads_set() -> bool:
    """Whether CKPTFMT_THREADS chooses the engine's threads (callers then keep their hands off)."""
    return bool(os.environ.get("CKPTFMT_THREADS"))


@contextlib.contextmanager
def threads_at_most(n: int | None) -> Iterator[None]:
    """Engine calls made by this thread use at most `n` threads (None: no cap) inside the block:
    several processes sharing a machine's cores (ranks of one host) should not each start
    one thread per core."""
    before = getattr(_cap, "n", None)
    _cap.n = before if n is None else n if before is None else min(n, before)
    try:
        yield
    finally:
        _cap.n = before


def write_chunks(
    fd: int,
    file_id: bytes,
    first_index: int,
    first_offset: int,
    pieces: list[tuple[Any, int]],
    options: WriteOptions,
    threads: int,
    path: str,
    *,
    digests_out: list[bytes] | None = None,
    sha_out: list[bytes] | None = None,
    tags_out: list[bytes] | None = None,
    _checksums: bool = True,
) -> tuple[list[tuple[int, int, int, int, int, int, int]], int]:
    """Write chunks (byte views with their shuffle widths) compressed and encrypted as
    `options` say; return their records and the end offset.

    Each record is (offset, stored_len, raw_len, codec, filter, width, checksum).
    With `digests_out`, each chunk's content digest (16 bytes) is appended to it,
    computed in the same pass over the bytes as the checksum.
    With `sha_out`, each chunk's SHA-256 (signed files, spec section 16: 32 bytes over its
    context and stored bytes) is appended to it, taken in the same pass too.
    With options.key (a data key, spec section 17) each chunk is encrypted with AES-256-GCM
    after compression, in the same pass, and its tag appended to `tags_out`.
    ``_checksums=False`` exists only so benchmarks can price the checksums: it
    writes zero checksums, which makes the file invalid.
    """
    assert lib is not None and ffi is not None
    n = len(pieces)
    chunks = ffi.new("ckf_chunk[]", max(n, 1))
    keep = _fill_chunks(chunks, pieces, options.key)
    status = ffi.new("ckf_status *")
    end = ffi.new("uint64_t *")
    fid = ffi.new("uint8_t[16]", file_id)
    compress, lvl = _codec(options)
    digests = ffi.new("uint8_t[]", 16 * n) if digests_out is not None and n else ffi.NULL
    rc = lib.ckf_write_chunks(
        fd,
        fid,
        first_index,
        first_offset,
        chunks,
        n,
        compress,
        lvl,
        threads,
        (1 if _checksums else 0) | (lib.CKF_SHA if sha_out is not None else 0),
        digests,
        status,
        end,
    )
    _release(keep)
    if rc != lib.CKF_OK:
        raise_status(status, path, "writing")
    if digests_out is not None and n:
        raw = bytes(ffi.buffer(digests, 16 * n))
        digests_out.extend(raw[16 * i : 16 * i + 16] for i in range(n))
    if sha_out is not None:
        sha_out.extend(bytes(ffi.buffer(chunks[i].sha, 32)) for i in range(n))
    if tags_out is not None:
        tags_out.extend(bytes(ffi.buffer(chunks[i].tag, 16)) for i in range(n))
    return _records(chunks, n), int(end[0])


def _codec(options: WriteOptions) -> tuple[int, int]:
    """The engine's compression switch and zstd level for `options`."""
    assert lib is not None
    return (1 if options.compression else 0), (
        lib.CKF_LEVEL_FAST_PROFILE if options.level is None else options.level
    )


def _fill_chunks(chunks: Any, pieces: list[tuple[Any, int]], key: bytes | None) -> list[Any]:
    """Point the writer's chunk entries at `pieces` (and at the data `key` each chunk is
    encrypted with); return the buffers to release."""
    assert ffi is not None
    keep = []
    for i, (view, width) in enumerate(pieces):
        buf = ffi.from_buffer("uint8_t[]", view)
        keep.append(buf)
        chunks[i].src = buf
        chunks[i].raw_len = len(buf)
        chunks[i].width = width
    if key is not None:
        kbuf = ffi.new("uint8_t[32]", key)
        keep.append(kbuf)
        for i in range(len(pieces)):
            chunks[i].key = kbuf
    return keep


def _records(chunks: Any, n: int) -> list[tuple[int, int, int, int, int, int, int]]:
    """The records the writer filled in: (offset, stored_len, raw_len, codec, filter, width, checksum)."""
    return [
        (
            int(c.offset),
            int(c.stored_len),
            int(c.raw_len),
            int(c.codec),
            int(c.filter),
            int(c.fwidth),
            int(c.checksum),
        )
        for c in (chunks[i] for i in range(n))
    ]


class ForkedWrite:
    """A child process writing chunks from a copy-on-write view of this one (csrc/snapshot.c).

    Its records and result live in a MAP_SHARED mapping this object owns: read them
    with `outcome` once the child has been reaped, then `close`."""

    def __init__(
        self,
        pid: int,
        shared: mmap.mmap,
        base: Any,
        result: Any,
        chunks: Any,
        n: int,
        found: tuple[Any, Any] | None = None,
        held: list[tuple[int, bytes]] | None = None,
    ) -> None:
        self.pid = pid
        self.held = held  # an incremental child's table (raw length, digest) its matches index
        self._shared = shared
        self._base = base
        self._result = result
        self._chunks = chunks
        self._n = n
        self._found = found  # an incremental save's (digests, match) arrays

    def outcome(self, path: str) -> tuple[list[tuple[int, int, int, int, int, int, int]], int] | None:
        """(records, end offset) of a child that finished; None if it ended before it did.
        Raises what the writer failed with (an OSError for I/O errors, naming `path`)."""
        r = self._result
        if not r.finished:
            return None
        if r.rc != lib.CKF_OK:
            raise_status(r.status, path, "writing")
        return _records(self._chunks, self._n), int(r.end_offset)

    def tags(self) -> list[bytes]:
        """The GCM tag of each chunk of a finished child given a data key (fork_write's options.key)."""
        assert ffi is not None
        return [bytes(ffi.buffer(self._chunks[i].tag, 16)) for i in range(self._n)]

    def shas(self) -> list[bytes]:
        """The SHA-256 of each chunk of a finished child told to sign (fork_write's options.sign)."""
        assert ffi is not None
        return [bytes(ffi.buffer(self._chunks[i].sha, 32)) for i in range(self._n)]

    def findings(self) -> tuple[list[bytes], list[int]]:
        """A finished incremental child's content digest of each chunk, and where each was found
        in fork_write's `held` (-1: written here)."""
        assert ffi is not None and self._found is not None
        digests, match = self._found
        raw = bytes(ffi.buffer(digests, 16 * self._n))
        return [raw[16 * i : 16 * i + 16] for i in range(self._n)], [int(match[i]) for i in range(self._n)]

    def close(self) -> None:
        if self._base is not None:
            assert ffi is not None
            ffi.release(self._base)
            self._base = None
            self._shared.close()


def fork_write(
    fd: int,
    file_id: bytes,
    first_offset: int,
    pieces: list[tuple[Any, int]],
    options: WriteOptions,
    threads: int,
    ready_fd: int,
    parent_fd: int,
    *,
    held: list[tuple[int, bytes]] | None = None,
    _fault: int = 0,
) -> ForkedWrite:
    """Fork a child that writes `pieces` as chunks 0.. of the file at `fd` (checksums on) from
    its copy-on-write view of this process's memory, then one byte to `ready_fd`, and return
    it; OSError if fork() fails.  The child exits early when `parent_fd` (the read end of a
    pipe whose write end only this process holds) reaches end-of-file.
    `held` (an incremental save, spec section 12): the (raw length, content digest) pairs,
    sorted, of the chunks the file may refer to; the child digests every chunk and writes
    only those not found there (ForkedWrite.findings).  With options.sign it takes each
    chunk's SHA-256 (ForkedWrite.shas).
    Once this returns the caller may change or free the pieces' memory.  ``_fault`` exists
    for tests only (1: the child kills itself, 2: it exits without a result, 3 or 4:
    it sleeps 2 or 30 s before writing)."""
    assert lib is not None and ffi is not None
    n = len(pieces)
    head = -(-ffi.sizeof("ckf_fork_result") // 64) * 64
    size = head + ffi.sizeof("ckf_chunk") * max(n, 1)
    found_at = size
    if held is not None:  # the child's findings: 16 digest bytes and a match per chunk
        size += (16 + 8) * max(n, 1)
    shared = mmap.mmap(-1, size)  # anonymous, MAP_SHARED
    base = ffi.from_buffer(shared)
    result = ffi.cast("ckf_fork_result *", base)
    chunks = ffi.cast("ckf_chunk *", base + head)
    # with a data key the child encrypts each chunk; its tags land in `chunks`
    keep = _fill_chunks(chunks, pieces, options.key)
    fid = ffi.new("uint8_t[16]", file_id)
    compress, lvl = _codec(options)
    checksum = 1 | (lib.CKF_SHA if options.sign is not None else 0)
    found = None
    table: Any = ffi.NULL
    if held is not None:
        match = ffi.cast("int64_t *", base + found_at)
        found = (ffi.cast("uint8_t *", base + found_at + 8 * max(n, 1)), match)
        table = ffi.new("ckf_held[]", max(len(held), 1))
        for i, (raw_len, digest) in enumerate(held):
            table[i].raw_len = raw_len
            table[i].digest = digest
        keep.append(table)
    digests, match_out = found if found is not None else (ffi.NULL, ffi.NULL)
    args: list[Any] = [fd, fid, 0, first_offset, chunks, n, compress, lvl, threads, checksum]
    args += [table, len(held or ()), digests, match_out, ready_fd, parent_fd]
    pid = -1
    try:
        pid = lib.ckf_fork_write(*args, result, _fault)
        err = ffi.errno
        _release(keep)
        if pid < 0:
            raise OSError(err, f"fork failed: {os.strerror(err)}")
        return ForkedWrite(int(pid), shared, base, result, chunks, n, found, held)
    except BaseException:
        # fork() ran with signals blocked: a ^C pressed meanwhile is raised right after it
        # returns, before the caller holds the child, which must not be left behind
        if pid > 0:
            stop_child(int(pid))
        _release(keep)
        ffi.release(base)
        shared.close()
        raise


#: the exit status of a staged child whose job did not come within its deadline (snapshot.c)
NO_JOB_STATUS = 6


def fork_stage(sock: int, ready_fd: int, parent_fd: int, job_wait: float) -> int:
    """Fork a child that holds this process's memory as it is now (copy-on-write) and waits
    for one job on `sock` (hand_job); return its pid, OSError if fork() fails.  It writes a
    byte to `ready_fd` when its job is done, exits without writing when `sock` reaches
    end-of-file, and exits at once when `parent_fd` does (see fork_write).  A job that has not
    come `job_wait` seconds after the fork never will: the child exits with NO_JOB_STATUS."""
    assert lib is not None and ffi is not None
    wait_ms = max(1, min(int(job_wait * 1000), 2**31 - 1))
    pid = lib.ckf_fork_stage(sock, ready_fd, parent_fd, wait_ms)
    if pid < 0:
        err = ffi.errno
        raise OSError(err, f"fork failed: {os.strerror(err)}")
    return int(pid)


def hand_job(
    pid: int,
    sock: socket.socket,
    fd: int,
    file_id: bytes,
    first_offset: int,
    pieces: list[tuple[Any, int]],
    options: WriteOptions,
    threads: int,
    *,
    held: list[tuple[int, bytes]] | None = None,
    _fault: int = 0,
) -> ForkedWrite:
    """Tell the staged child `pid` (fork_stage; `sock`, this process's end of its socket) to
    write `pieces` to the file at `fd` as fork_write's child would; return it as a ForkedWrite.
    Every piece must lie in memory that existed, as it is to be written, when the child was
    forked: the child reads the same addresses in its own view.  The job goes over in a memfd
    both map (csrc/ckptfmt.h, ckf_fork_job).  ``_fault``: as for fork_write, tests only."""
    assert lib is not None and ffi is not None
    n, nheld = len(pieces), len(held or ())
    chunks_at = -(-ffi.sizeof("ckf_fork_job") // 64) * 64
    held_at = chunks_at + ffi.sizeof("ckf_chunk") * max(n, 1)
    digests_at = held_at + ffi.sizeof("ckf_held") * max(nheld, 1)
    match_at = digests_at + 16 * max(n, 1)
    size = match_at + 8 * max(n, 1)
    memfd = os.memfd_create("ckptfmt-fork-job", os.MFD_CLOEXEC)
    try:
        os.ftruncate(memfd, size)
        shared = mmap.mmap(memfd, size)
    except BaseException:
        os.close(memfd)
        raise
    base = ffi.from_buffer(shared)
    keep: list[Any] = []
    try:
        job = ffi.cast("ckf_fork_job *", base)
        job.size, job.first_index, job.first_offset, job.n, job.nheld = size, 0, first_offset, n, nheld
        job.chunks_at, job.held_at, job.digests_at, job.match_at = chunks_at, held_at, digests_at, match_at
        job.compress, job.level = _codec(options)
        job.nthreads = threads
        job.checksum = 1 | (lib.CKF_SHA if options.sign is not None else 0)
        job.has_key = 0 if options.key is None else 1
        if options.key is not None:
            job.key = options.key
        job.find = 0 if held is None else 1
        job.test_fault = _fault
        job.file_id = file_id
        chunks = ffi.cast("ckf_chunk *", base + chunks_at)
        keep = _fill_chunks(chunks, pieces, None)  # the child points each chunk at job.key
        table = ffi.cast("ckf_held *", base + held_at)
        for i, (raw_len, digest) in enumerate(held or ()):
            table[i].raw_len = raw_len
            table[i].digest = digest
        found = None
        if held is not None:
            found = (ffi.cast("uint8_t *", base + digests_at), ffi.cast("int64_t *", base + match_at))
        result = ffi.addressof(job[0], "result")
        socket.send_fds(sock, [b"j"], [fd, memfd])
        _release(keep)
        return ForkedWrite(pid, shared, base, result, chunks, n, found, held)
    except BaseException:
        _release(keep)
        ffi.release(base)
        shared.close()
        raise
    finally:
        os.close(memfd)


def _release(bufs: list[Any]) -> None:
    """Drop the buffer exports of `bufs` now.

    An exception's traceback keeps the frame's locals alive; an export left there
    would pin the caller's memoryviews (a staging slab already handed back to the
    pool) until a garbage collection that then fails to clear them.
    """
    assert ffi is not None
    for b in bufs:
        ffi.release(b)
    bufs.clear()


def raise_status(status: Any, path: str, doing: str) -> None:
    code, err, chunk = int(status.code), int(status.err_no), int(status.chunk)
    where = f" (chunk {chunk})" if chunk >= 0 else ""
    if code == lib.CKF_ERR_IO:
        raise OSError(err, f"{os.strerror(err)} while {doing}{where}", path)
    if code == lib.CKF_ERR_NOMEM:
        raise MemoryError(f"{path}: out of memory while {doing}{where}")
    if code == ERR_CRYPTO:
        raise CheckpointError(f"libcrypto failed while {doing}{where}", path=path)
    raise CheckpointError(
        f"C engine failed while {doing}{where}: code {code}", path=path, chunk=chunk if chunk >= 0 else None
    )


def advise_huge(t: Any) -> None:
    """Ask for huge pages for a fresh, untouched CPU tensor's memory (no-op without the engine)."""
    if lib is not None and ffi is not None:
        lib.ckf_advise_huge(ffi.cast("uint8_t *", t.data_ptr()), t.numel() * t.element_size())


def huge_file(fd: int, end: int) -> tuple[int, int]:
    """Give the new, empty file open at `fd` (on tmpfs) 2 MiB pages below `end` before it is
    written (csrc/memory.c ckf_huge_file): (regions collapsed, 0 or the errno that stopped it).
    The regions it could not collapse keep small pages; the file's bytes are the same either way."""
    assert lib is not None and ffi is not None
    regions = ffi.new("uint64_t *")
    err = lib.ckf_huge_file(fd, end, regions)
    return int(regions[0]), int(err)


def content_digests(views: list[Any], threads: int) -> list[bytes]:
    """XXH3-128 content digests (canonical 16 bytes) of byte views, in parallel without the GIL."""
    assert lib is not None and ffi is not None
    n = len(views)
    bufs = [ffi.from_buffer("uint8_t[]", v) for v in views]
    src = ffi.new("const uint8_t *[]", max(n, 1))
    lens = ffi.new("uint64_t[]", max(n, 1))
    for i, b in enumerate(bufs):
        src[i] = b
        lens[i] = len(b)
    out = ffi.new("uint8_t[]", 16 * max(n, 1))
    lib.ckf_content_digests(src, lens, n, out, threads)
    _release(bufs)  # the views may be a staging slab, handed back to the pool next
    raw = bytes(ffi.buffer(out, 16 * n))
    return [raw[16 * i : 16 * i + 16] for i in range(n)]


def copy(dst: Any, src: Any, threads: int) -> None:
    """dst[:len(src)] = src on `threads` threads, without the GIL."""
    assert lib is not None and ffi is not None
    d = ffi.from_buffer("uint8_t[]", dst, require_writable=True)
    s = ffi.from_buffer("uint8_t[]", src)
    if len(s) > len(d):
        raise ValueError(f"copy of {len(s)} bytes into {len(d)}")
    lib.ckf_copy(d, s, len(s), threads)


def zstd_compress(data: Any, level: int) -> bytes:
    """zstd with exactly the engine's frame parameters (used by the reference writer when built)."""
    assert lib is not None and ffi is not None
    src = ffi.from_buffer("uint8_t[]", data)
    cap = lib.ckf_zstd_bound(len(src))
    dst = ffi.new("uint8_t[]", max(cap, 1))
    n = lib.ckf_zstd_compress(dst, cap, src, len(src), level)
    if n == 0 and len(src):
        raise CheckpointError(f"zstd could not compress {len(src)} bytes at level {level}")
    return bytes(ffi.buffer(dst, n))


__all__ = [
    "advise_huge",
    "available",
    "built",
    "content_digests",
    "copy",
    "default_threads",
    "huge_file",
    "versions",
    "write_chunks",
    "zstd_compress",
]
