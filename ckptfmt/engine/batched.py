"""Many engine operations in one call: chunk reads prepared once and run several times, whole
or by slices, and many small copies.

An atomic load_into() reads the same chunks twice: it checks every one, then reads them into
their targets.  Building the engine's record of a chunk costs about as much Python as the
engine's read of a 4 KiB chunk, so for a state of many small tensors the records are built
once (`ReadTable`) and both passes run them (`PreparedReads`), the second a batch of
targets at a time.  Only chunks of one local file: referenced files and objects' spools go
through ChunkReader.read_into, which groups and fetches them.  `copy_spans` copies chunks
checked in a bounce buffer into their targets (signed or encrypted files) in one call.
"""

from __future__ import annotations

import array
import errno
from collections.abc import Sequence
from typing import Any

from ..errors import LimitError
from . import native as _native
from .chunkread import ChunkReader


class ReadTable:
    """Reads of raw_len bytes of chunks into host addresses, built into the engine's records once
    and run as often as needed, in whole or by slices (load_into checks every chunk, then reads
    them into their places, a batch of targets at a time): no Python per chunk per run.
    `items`: (chunk number, chunk record, address of raw_len bytes the caller keeps alive)."""

    def __init__(self, items: list[tuple[int, Any, int]], key: bytes | None = None) -> None:
        ffi, lib = _native.ffi, _native.lib
        assert lib is not None and ffi is not None
        null = ffi.NULL
        self.n = len(items)
        self._numbers = [k for k, _, _ in items]
        self._key = ffi.new("uint8_t[32]", key) if key else null  # alive as long as the records
        self._rows = _native.chunk_records([(k, ch, null) for k, ch, _ in items], self._key)
        addresses = array.array("Q", [address for _, _, address in items])
        view = ffi.from_buffer("uint64_t[]", addresses)
        try:
            lib.ckf_place(self._rows, view, self.n)
        finally:
            ffi.release(view)

    def run(
        self, fd: int, file_id: bytes, lo: int, hi: int, verify: bool, threads: int, check_only: bool = False
    ) -> tuple[int, int, int, int, int] | None:
        """Read entries [lo, hi) as read_chunks does (check_only: every chunk checked, whatever
        `verify` says, and destinations left untouched by raw chunks, which pass through the
        engine's own buffer); None, or the failure with its position counted from `lo`."""
        return _native.run_reads(
            fd, file_id, self._rows + lo, self._numbers[lo:hi], verify, threads, check_only
        )


class PreparedReads:
    """Chunks of one local file read into host addresses, their engine records built once
    (ReadTable) and read by slices of the items as often as needed; each failure is
    the error ChunkReader.read_into gives for it."""

    def __init__(self, reader: ChunkReader, items: Sequence[tuple[int, int]]) -> None:
        self._reader = reader
        self._items = items
        chunks = reader.chunks
        self._table = ReadTable([(k, chunks[k], at) for k, at in items], reader.data_key or None)
        #: the number of items
        self.n = len(items)

    def read(self, lo: int, hi: int, verify: bool, check_only: bool = False) -> None:
        """Read items [lo, hi), as ReadTable.run does: check_only leaves the targets untouched
        (every chunk checked then, whatever `verify` says)."""
        reader = self._reader
        status = self._table.run(
            reader.fd, reader.file_id, lo, hi, verify, _native.default_threads(), check_only
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
