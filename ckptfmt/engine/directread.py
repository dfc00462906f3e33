"""A remote file's raw chunks fetched from the socket straight into their destinations.

A load from a store used to fetch every chunk into the spool and then have the engine copy it
out into the fresh tensors, hashing it: that copy, with the spool's pages faulted in and freed
and the tensors' faulted in, bounded such loads (docs/object-stores.md, "Each store against
its floor").  Here a chunk that needs no decoding (raw, unshuffled, not encrypted) of the
object itself, DIRECT_MIN bytes or more, whose bytes the spool is not fetching, is read by the
object's requests into its destination, its padding into a few bytes of its own, under a load
without a memory bound (max_bytes keeps its windows through the spool).  Where the spool holds
some of its bytes already (the index's tail, fetched before the index said where the chunks
lie, holds the end of the last chunk), those are copied from the spool into the destination
and the rest fetched: the chunk is not read through the spool for them, which cost its every
byte a page of the spool faulted in, a copy, and the spool's pages freed again.

Once all of a chunk's bytes are in, the thread that fetched the last of them has the engine
check it where it lies (`ckf_check_mapped`: its checksum, content digest and, for a signed
file read with trusted keys, SHA-256), and its padding here: a chunk that fails raises the
chunk reader's error for it (CorruptError, SignatureError, naming path, key, chunk and
offset), which the load raises before any tensor reaches the caller, as when the engine reads
a local file into its destinations.  Every request is waited for before the reader returns or
raises, so none writes into memory given up.  A request's retries restart where its bytes
stopped, into the same memory.
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from ..errors import CorruptError
from ..format import layout as fmt
from ..format.index import Chunk
from . import chunkrecords
from . import native as _native
from .sources import Fetcher

#: chunks smaller than this go through the spool, read by the engine in batches: a direct
#: chunk costs a call of its own to check it
DIRECT_MIN = 64 << 10

Status = chunkrecords.Status
Destination = memoryview | int | None


def split(
    remote: Fetcher, chunks: Sequence[Chunk], items: Sequence[tuple[int, Destination]], check_only: bool
) -> tuple[list[tuple[int, Destination]], list[tuple[int, Destination]]]:
    """`items` (chunk number, destination) split into those fetched straight into their
    destination and those read through the spool.  Straight: raw, unshuffled, unencrypted
    chunks of this file of DIRECT_MIN bytes or more with a destination, outside whatever the
    spool is fetching and not all held by it, under a load without a memory bound, read with
    the C engine, their contents wanted (not check_only), each asked for once (a chunk with two
    destinations, a storage two targets share, goes through the spool: the fetch puts each byte
    in one place)."""
    if check_only or remote.max_bytes is not None or not _native.available():
        return [], list(items)
    wanted = Counter(k for k, _ in items)
    fits = [wanted[k] == 1 and _fits(chunks[k], dest) for k, dest in items]
    held = iter(remote.held_within([span(chunks[k]) for (k, _), ok in zip(items, fits) if ok]))
    direct = [ok and _fetchable(span(chunks[k]), next(held)) for (k, _), ok in zip(items, fits)]
    return [it for it, d in zip(items, direct) if d], [it for it, d in zip(items, direct) if not d]


def _fits(ch: Chunk, dest: Destination) -> bool:
    return (
        dest is not None
        and ch.source < 0
        and ch.codec == fmt.CODEC_RAW
        and ch.filter == fmt.FILTER_NONE
        and not ch.tag
        and ch.stored_len == ch.raw_len >= DIRECT_MIN
    )


def _fetchable(r: tuple[int, int], held: list[tuple[int, int]] | None) -> bool:
    """Whether a chunk spanning `r`, of which the spool holds `held` (None: is fetching some),
    has bytes left to fetch straight into its destination."""
    return held is not None and sum(b - a for a, b in held) < r[1] - r[0]


def _overlap(ranges: Sequence[tuple[int, int]], lo: int, hi: int) -> int:
    """Bytes of [lo, hi) within `ranges` (disjoint)."""
    return sum(max(0, min(b, hi) - max(a, lo)) for a, b in ranges)


def span(ch: Chunk) -> tuple[int, int]:
    """The chunk's stored bytes and its padding in the file."""
    return ch.offset, ch.offset + ch.stored_len + ch.pad


class DirectReads:
    """The fetches of some raw chunks into their destinations, each checked where it lies once
    its last byte is in (`landed`, on the fetching thread)."""

    def __init__(
        self,
        path: str,
        file_id: bytes,
        chunks: Sequence[Chunk],
        items: Sequence[tuple[int, Destination]],
        verify: bool,
        error: Callable[[Status, Sequence[tuple[int, Destination]]], Exception],
    ) -> None:
        ffi = _native.ffi
        assert ffi is not None
        order = sorted(range(len(items)), key=lambda i: chunks[items[i][0]].offset)
        self._items = [items[i] for i in order]
        self._chunks = [chunks[k] for k, _ in self._items]
        self._starts = [ch.offset for ch in self._chunks]
        self._arrived = [0] * len(self._items)
        # the parts of each chunk's span copied from the spool (_copy_held)
        self._copied: list[list[tuple[int, int]]] = [[] for _ in self._items]
        self._lock = threading.Lock()
        self._verify = verify
        self._error = error
        self._file_id = bytes(file_id)
        self._path = path
        self._buffers: list[Any] = []  # cffi buffers of memoryview destinations, released in close
        self._bases: list[int] = []
        self._pads: list[bytearray] = []
        self.targets: list[tuple[int, memoryview]] = []
        try:  # a destination refused: those exported so far let go of at once
            for (k, dest), ch in zip(self._items, self._chunks):
                base = self._base(dest, k, ch)
                self._bases.append(base)
                self.targets.append(
                    (ch.offset, memoryview(ffi.buffer(ffi.cast("uint8_t *", base), ch.stored_len)))
                )
                pad = bytearray(ch.pad)
                self._pads.append(pad)
                if ch.pad:
                    self.targets.append((ch.offset + ch.stored_len, memoryview(pad)))
        except BaseException:
            self.close()
            raise

    def _base(self, dest: Destination, k: int, ch: Chunk) -> int:
        """The address of chunk `k`'s destination, of its raw_len bytes (a buffer's kept
        exported until close); CorruptError where the index gives it another length."""
        ffi = _native.ffi
        assert ffi is not None
        if type(dest) is int:
            return dest
        buf = ffi.from_buffer("uint8_t[]", dest, require_writable=True)
        self._buffers.append(buf)
        if len(buf) != ch.raw_len:
            raise CorruptError(
                f"chunk {k} at offset {ch.offset}: {ch.raw_len} bytes, for a destination of {len(buf)}",
                path=self._path,
            )
        return int(ffi.cast("uintptr_t", buf))

    def start(
        self, remote: Fetcher, spooled: Sequence[tuple[int, int]], futures: list[Future[None]]
    ) -> list[Future[None]]:
        """Fetch the targets, planned with the `spooled` ranges (read through the spool): one
        request a cell, not one a tensor where they alternate; `futures` gets the requests'
        futures as they are made (to be waited for, should this fail midway).  The targets'
        bytes the spool holds are copied from it first (and given back to it), counted as
        arrived, and not asked for."""
        copied = remote.copy_held(self.targets)
        for r in copied:
            self._arrive(r, copied=True)
        return remote.start_into(self.targets, self.landed, spooled, futures, copied)

    def landed(self, request: tuple[int, int]) -> None:
        """A request's bytes are in: check each chunk whose last bytes they were."""
        self._arrive(request)

    def _arrive(self, r: tuple[int, int], copied: bool = False) -> None:
        """Bytes `r` are in their destinations (a request's, or `copied` from the spool: a
        request's bytes copied already are not counted twice): check each chunk whose last
        bytes they were."""
        lo, hi = r
        done = []
        with self._lock:
            i = max(0, bisect.bisect_right(self._starts, lo) - 1)
            while i < len(self._chunks) and self._starts[i] < hi:
                a, b = span(self._chunks[i])
                got = min(b, hi) - max(a, lo) - _overlap(self._copied[i], lo, hi)
                if got > 0:
                    self._arrived[i] += got
                    if copied:
                        self._copied[i].append((max(a, lo), min(b, hi)))
                    if self._arrived[i] == b - a:
                        done.append(i)
                i += 1
        if self._verify:
            for i in done:
                self._check(i)

    def _check(self, i: int) -> None:
        """Chunk i's checks where it lies (the engine's, then its padding's), its error raised."""
        k, ch = self._items[i][0], self._chunks[i]
        status = check_in_place(self._file_id, k, ch, self._bases[i], self._path)
        if status is None and any(self._pads[i]):
            status = (_native.ERR_CORRUPT, 0, 0, _native.WHY_PADDING, 0)
        if status is not None:
            raise self._error(status, [self._items[i]])

    def check_whole(self) -> None:
        """CorruptError naming the first chunk not all of whose bytes came (every fetch over):
        unchecked, its destination would be returned as it is."""
        for i, (k, _) in enumerate(self._items):
            a, b = span(self._chunks[i])
            if self._arrived[i] != b - a:
                raise CorruptError(
                    f"chunk {k}: {self._arrived[i]} of its {b - a} bytes came", path=self._path
                )

    def close(self) -> None:
        """Let go of the destinations' buffers (once every fetch into them is over)."""
        for buf in self._buffers:
            _native.ffi.release(buf)
        self._buffers = []


def check_in_place(file_id: bytes, k: int, ch: Chunk, base: int, path: str | None = None) -> Status | None:
    """Check raw chunk `k` (record `ch`) whose stored bytes lie at address `base`: the engine's
    check of a mapped file, given a mapping that puts the chunk's offset at `base` and ends
    with its bytes (its padding, held elsewhere, left out: the caller checks it); None, or
    the failure as read_chunks reports it; CorruptError (naming `path`) for an offset beyond
    the address (no mapping could put it there)."""
    ffi = _native.ffi
    assert ffi is not None
    if base < ch.offset:
        raise CorruptError(f"chunk {k}: its offset {ch.offset} lies beyond memory at {base:#x}", path=path)
    mapping = ffi.cast("uint8_t *", base - ch.offset)
    return chunkrecords.check_at(mapping, ch.offset + ch.stored_len, file_id, [k], [ch._replace(pad=0)], 1)


def read_direct(
    remote: Fetcher,
    path: str,
    file_id: bytes,
    chunks: Sequence[Chunk],
    items: Sequence[tuple[int, Destination]],
    spooled: Sequence[tuple[int, Destination]],
    verify: bool,
    error: Callable[[Status, Sequence[tuple[int, Destination]]], Exception],
    rest: Callable[[bool], None],
) -> None:
    """Fetch `items` (split's straight ones) into their destinations and the bytes of the
    `spooled` ones into the spool, in one plan, while `rest` (which reads the chunks through the spool,
    told whether their bytes are asked for already) runs; the first failure raised once every
    fetch is over.  None straight (always so without the C engine, which DirectReads needs):
    `rest` alone."""
    if not items:
        rest(False)
        return
    reads = DirectReads(path, file_id, chunks, items, verify, error)
    futures: list[Future[None]] = []
    try:  # started here: requests claimed or made before a failure are waited for below
        futures = reads.start(remote, [span(chunks[k]) for k, _ in spooled], futures)
        rest(True)
        # the spooled chunks are rest's, read already: only the targets' bytes are waited for
        remote.wait(futures, needs=(), into=[(at, at + len(view)) for at, view in reads.targets])
        reads.check_whole()
    finally:
        remote.wait_quietly(futures)
        reads.close()
