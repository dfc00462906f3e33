"""The engine's chunk reads: their records (ckf_rchunk[]) built by one builder, and the engine
calls that run them (reads into destinations, checks of a mapped file).

Every read of chunks through the C engine passes it one record per chunk.  Building a record
costs about as much Python as the engine's read of a 4 KiB chunk, so a state of many small
tensors spends much of its read here: the leading fields of every record are packed into one
array in a loop that builds no tuple per chunk, and set by one engine call
(`ckf_fill_rchunks`); the optional fields (content digest, SHA-256, GCM tag) are set one by one
on the few records that have one.  A destination is an address (an int, 0 for none) of memory
the caller keeps alive for the call.  Failures are returned as the engine's status, for the
chunk reader to turn into the error that names the chunk (chunkread.ChunkReader.native_error).
"""

from __future__ import annotations

import array
import contextlib
import threading
from collections.abc import Sequence
from operator import itemgetter
from typing import Any, cast

from ..format.index import Chunk
from . import native as _native

#: the leading fields of a chunk record, in the order ckf_fill_rchunks takes them after the
#: destination and the chunk's number: each record's first 8 items, taken as one slice
_PACKED = ("offset", "stored_len", "raw_len", "codec", "filter", "width", "checksum", "pad")
assert Chunk._fields[: len(_PACKED)] == _PACKED
#: the optional fields, set one by one (fill_extras) on the few records that have one
_DIGEST, _SHA, _TAG = (Chunk._fields.index(name) for name in ("digest", "sha", "tag"))

#: a failed engine call: (code, errno, position of the failing item, reason, value)
Status = tuple[int, int, int, int, int]


def build(items: Sequence[tuple[int, int]], records: Sequence[Chunk], key: Any = None) -> Any:
    """The engine's records (ckf_rchunk[]) of `items` (chunk number, destination address; 0:
    none), `records[i]` the chunk record of items[i]; `key`: a uint8_t[32] data key, for
    encrypted chunks, kept alive by the caller as long as the records."""
    ffi, lib = _native.ffi, _native.lib
    assert lib is not None and ffi is not None
    fields: list[int] = []
    add = fields.extend
    extras = []
    for i, ((k, address), ch) in enumerate(zip(items, records, strict=True)):
        add((address, k))
        add(ch[:8])
        if ch[_DIGEST] or ch[_SHA] or ch[_TAG]:
            extras.append(i)
    rows = ffi.new("ckf_rchunk[]", len(items) or 1)
    view = ffi.from_buffer("uint64_t[]", array.array("Q", fields))
    try:
        rc = lib.ckf_fill_rchunks(rows, view, len(items))
    finally:
        ffi.release(view)
    if rc:  # the index was checked: a value past its member's width is the engine's bug
        raise ValueError(f"chunk records of {len(items)} chunks hold a value past the engine's fields")
    for i in extras:
        fill_extras(rows[i], items[i][0], records[i], key)
    return rows


def fill_extras(c: Any, k: int, ch: Chunk, key: Any = None) -> None:
    """The optional fields of chunk `k`'s engine record `c`: content digest, signed SHA-256, GCM tag."""
    ffi = _native.ffi
    assert ffi is not None
    if ch.digest:  # files with content digests (feature bit 0)
        c.has_digest = 1
        ffi.memmove(c.digest, ch.digest, 16)
    if ch.sha:  # signed files read with trusted keys (section 16)
        c.has_sha = 1
        ffi.memmove(c.sha, ch.sha, 32)
    if ch.tag:  # encrypted files read with the key (section 17)
        if not key:
            raise ValueError(f"chunk {k} is encrypted and no data key was given")
        c.key = key
        ffi.memmove(c.tag, ch.tag, 16)


def read_chunks(
    fd: int,
    file_id: bytes,
    items: Sequence[tuple[int, memoryview | int | None]],
    records: Sequence[Chunk],
    verify: bool,
    threads: int,
    check_only: bool = False,
    key: bytes | None = None,
) -> Status | None:
    """Read (chunk number, destination) in parallel, `records[i]` the chunk record of items[i];
    None, or the failure's (code, errno, position in `items`, reason, value) for the caller to
    turn into an exception.  The chunk number is the one the checksum seed binds in the file at
    `fd`.  A destination is the address (an int) of raw_len bytes of host memory the caller
    keeps alive for the call (a load's fresh storages: no buffer export per chunk), or a
    writable buffer of exactly raw_len bytes.  check_only: every chunk checked, whatever
    `verify` says, the destinations' contents left undefined (raw chunks not copied, shuffled
    ones not un-shuffled); a chunk without a content digest then needs no destination (None).
    `key`: an encrypted file's data key (spec 17): tagged chunks decrypted."""
    ffi = _native.ffi
    assert ffi is not None
    kbuf = ffi.new("uint8_t[32]", key) if key else ffi.NULL
    keep: list[Any] = []
    try:
        pairs: Sequence[tuple[int, int]]
        if set(map(type, map(itemgetter(1), items))) == {int}:  # addresses already (a load's)
            pairs = cast("Sequence[tuple[int, int]]", items)
        else:
            pairs = _addresses(items, records, check_only, keep)
        rows = build(pairs, records, kbuf)
        return run_reads(fd, file_id, rows, [k for k, _ in pairs], verify, threads, check_only)
    finally:  # the exports dropped now, not when a traceback holding this frame is freed
        for dst in keep:
            ffi.release(dst)


def _addresses(
    items: Sequence[tuple[int, memoryview | int | None]],
    records: Sequence[Chunk],
    check_only: bool,
    keep: list[Any],
) -> list[tuple[int, int]]:
    """`items` with each destination an address: a buffer's (its export put in `keep`, for the
    caller to release), 0 for none (only where nothing is written: check_only, no digest)."""
    ffi = _native.ffi
    assert ffi is not None
    pairs = []
    for (k, dest), ch in zip(items, records):
        if type(dest) is int:
            pairs.append((k, dest))
        elif dest is None:
            if not check_only or ch.digest:
                raise ValueError(f"chunk {k} needs a destination: it is read or its digest taken")
            pairs.append((k, 0))
        else:
            dst = ffi.from_buffer("uint8_t[]", dest, require_writable=True)
            keep.append(dst)
            if len(dst) != ch.raw_len:
                raise ValueError(f"chunk {k}: a destination of {len(dst)} bytes, the chunk {ch.raw_len}")
            pairs.append((k, int(ffi.cast("uintptr_t", dst))))
    return pairs


def run_reads(
    fd: int, file_id: bytes, records: Any, numbers: list[int], verify: bool, threads: int, check_only: bool
) -> Status | None:
    """Read len(numbers) records from `records` (build's, or build's + lo) as read_chunks
    says, `numbers` their chunk numbers (for errors); check_only: every check, no raw copy."""
    ffi, lib = _native.ffi, _native.lib
    assert lib is not None and ffi is not None
    status = ffi.new("ckf_status *")
    fid = ffi.new("uint8_t[16]", file_id)
    mode = 2 if check_only else 1 if verify else 0
    rc = lib.ckf_read_chunks(fd, fid, records, len(numbers), mode, threads, status)
    return _outcome(rc, status, numbers)


class MappedCheck:
    """The engine's check of raw chunks where they lie in a mapping of their file, started now
    and waited for later.  With `background` the engine's call runs on a thread of its own (it
    releases the GIL), so that the caller's Python work (building the tensors over the mapping,
    which reads none of its pages) shares the cores with the engine's hashing; a thread costs
    about half a millisecond to start and join, so only a load with many tensors to build
    asks for one.  Until wait() has returned, the caller must hand nothing of the mapping to
    anyone: the chunks are not checked yet."""

    def __init__(
        self,
        mapping: Any,
        file_id: bytes,
        numbers: Sequence[int],
        chunks: Sequence[Chunk],
        background: bool,
    ) -> None:
        ffi = _native.ffi
        assert ffi is not None
        self._src = ffi.from_buffer("uint8_t[]", mapping)
        self._result: Status | None = None
        self._failure: BaseException | None = None
        self._thread: threading.Thread | None = None
        try:
            args = (file_id, numbers, [chunks[k] for k in numbers], _native.default_threads())
            if background:
                thread = threading.Thread(
                    target=self._run, args=args, name="ckptfmt-mapped-check", daemon=True
                )
                with contextlib.suppress(RuntimeError):  # no thread to be had: checked here instead
                    thread.start()
                    self._thread = thread
            if self._thread is None:
                self._run(*args)
        except BaseException:
            if self._thread is None:
                ffi.release(self._src)
            raise

    def _run(self, file_id: bytes, numbers: Sequence[int], records: Sequence[Chunk], threads: int) -> None:
        try:
            self._result = check_at(self._src, len(self._src), file_id, numbers, records, threads)
        except BaseException as e:  # raised again by wait(), in the caller's thread
            self._failure = e

    def wait(self) -> Status | None:
        """Wait for the check; None, or the failure as read_chunks reports it."""
        ffi = _native.ffi
        assert ffi is not None
        if self._thread is not None:
            self._thread.join()
        ffi.release(self._src)
        if self._failure is not None:
            raise self._failure
        return self._result


def check_at(
    start: Any, size: int, file_id: bytes, numbers: Sequence[int], records: Sequence[Chunk], threads: int
) -> Status | None:
    """Verify the raw chunks `numbers` (`records[i]` the record of numbers[i]) where they lie in
    the memory at `start` (a uint8_t pointer) that holds the file's first `size` bytes, of which
    the engine reads only the chunks' own; None, or the failure as read_chunks reports it."""
    ffi, lib = _native.ffi, _native.lib
    assert lib is not None and ffi is not None
    arr = build([(k, 0) for k in numbers], records)
    status = ffi.new("ckf_status *")
    fid = ffi.new("uint8_t[16]", file_id)
    rc = lib.ckf_check_mapped(start, size, fid, arr, len(numbers), threads, status)
    return _outcome(rc, status, numbers)


def _outcome(rc: int, status: Any, numbers: Sequence[int]) -> Status | None:
    lib = _native.lib
    assert lib is not None
    if rc == lib.CKF_OK:
        return None
    if rc == lib.CKF_ERR_ARG:
        pos = int(status.chunk)
        which = numbers[pos] if 0 <= pos < len(numbers) else pos
        raise ValueError(f"chunk {which} has a layout the reader refuses")
    return int(status.code), int(status.err_no), int(status.chunk), int(status.reason), int(status.value)
