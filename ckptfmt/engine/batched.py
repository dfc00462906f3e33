"""Many engine operations in one call: chunk reads prepared once and run several times, whole
or by slices, and many small copies.

An atomic load_into() reads the same chunks twice: it checks every one, then reads them into
their targets.  Building the engine's record of a chunk costs about as much Python as the
engine's read of a 4 KiB chunk, so for a state of many small tensors the records are built
once (`PreparedReads`, by chunkrecords' one builder) and both passes run them, the second a
batch of targets at a time.  Only chunks of one local file: referenced files and objects'
spools go through ChunkReader.read_into, which groups and fetches them.  `copy_spans` copies chunks checked in a bounce buffer into
their targets (signed or encrypted files) in one call.
"""

from __future__ import annotations

import array
import errno
from collections.abc import Sequence

from ..errors import LimitError
from . import chunkrecords
from . import native as _native
from .chunkread import ChunkReader


class PreparedReads:
    """Reads of chunks of one local file into host addresses, built into the engine's records
    once and run as often as needed, whole or by slices (load_into checks every chunk, then
    reads them into their places, a batch of targets at a time): no Python per chunk per run.
    `items`: (chunk number, address of its raw_len bytes, which the caller keeps alive).  Each
    failure is the error ChunkReader.read_into gives for it."""

    def __init__(self, reader: ChunkReader, items: Sequence[tuple[int, int]]) -> None:
        ffi = _native.ffi
        assert ffi is not None
        self._reader = reader
        self._items = items
        #: the number of items
        self.n = len(items)
        self._numbers = [k for k, _ in items]
        key = reader.data_key
        self._key = ffi.new("uint8_t[32]", key) if key else ffi.NULL  # alive as long as the records
        chunks = reader.chunks
        self._rows = chunkrecords.build(items, [chunks[k] for k, _ in items], self._key)

    def read(self, lo: int, hi: int, verify: bool, check_only: bool = False) -> None:
        """Read items [lo, hi) as read_chunks does: check_only checks every chunk, whatever
        `verify` says, and leaves the destinations of raw chunks untouched (they pass through
        the engine's own buffer)."""
        reader = self._reader
        status = chunkrecords.run_reads(
            reader.fd,
            reader.file_id,
            self._rows + lo,
            self._numbers[lo:hi],
            verify,
            _native.default_threads(),
            check_only,
        )
        if status is not None:
            raise reader.native_error(status, self._items[lo:hi])


def prepare(reader: ChunkReader, items: Sequence[tuple[int, int]]) -> PreparedReads | None:
    """`items` (chunk, host address of its raw_len bytes) of `reader`'s file, prepared to be
    read several times (PreparedReads); None where they cannot be: without the C engine, for
    an object's spool (its bytes are fetched as read), or when a chunk lies in a referenced file."""
    if not _native.available() or reader.remote is not None:
        return None
    chunks = reader.chunks
    if reader.externals and any(chunks[k].source >= 0 for k, _ in items):
        return None
    return PreparedReads(reader, items)


def copy_spans(spans: list[int], threads: int) -> None:
    """Copies on `threads` threads without the GIL: `spans` is flat (source address, destination
    address, length) triples of host memory the caller keeps alive, no two overlapping."""
    ffi, lib = _native.ffi, _native.lib
    assert lib is not None and ffi is not None
    if len(spans) % 3:
        raise ValueError(f"copy_spans takes (source, destination, length) triples, not {len(spans)} numbers")
    view = ffi.from_buffer("uint64_t[]", array.array("Q", spans))
    try:
        rc = lib.ckf_copy_spans(view, len(spans) // 3, threads)
    finally:
        ffi.release(view)
    if rc == errno.EINVAL:  # lengths whose pieces overflow the engine's counts: nothing copied
        raise LimitError(
            f"{len(spans) // 3} copies of up to {max(spans[2::3])} bytes each: more than the engine can plan"
        )
    if rc:
        raise MemoryError(f"out of memory planning {len(spans) // 3} copies")
