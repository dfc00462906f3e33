"""A sparse in-memory image of one object, so the fd-based engine can write and read objects.

The engine writes chunks with ``pwrite`` at planned offsets and reads them with ``pread``;
an object store has neither.  A spool is a memfd the size of the object: a save's writer
fills it at the offsets the file will have, and each part is uploaded from it and then
released; a load fetches just the byte ranges it is about to read into it, and releases
them once read.  Pages never written cost nothing, released ones are returned
(a hole punched in the memfd), so memory stays bounded by what is in
flight, never the object's size.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from collections.abc import Callable

PAGE = mmap.PAGESIZE
#: fallocate's mode for freeing a range of a file's pages, its size kept
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02


def _libc_fallocate() -> Callable[[int, int, int, int], int] | None:
    """libc's fallocate, called through ctypes, which lets go of the GIL for the call; None
    where there is none."""
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_fallocate = _libc_fallocate()


class Spool:
    """A memfd of `size` bytes (grown on demand) and a shared mapping of it."""

    def __init__(self, name: str, size: int = 0) -> None:
        self.fd = os.memfd_create(f"ckptfmt-{name}"[:200], os.MFD_CLOEXEC)
        self._map: mmap.mmap | None = None
        self.size = 0
        try:
            self.resize(size)
        except BaseException:
            os.close(self.fd)
            raise

    def resize(self, size: int) -> None:
        """Make the memfd `size` bytes long (its contents kept) and map all of it."""
        if size == self.size and (self._map is not None or size == 0):
            return
        if self._map is not None:
            self._map.close()
            self._map = None
        os.ftruncate(self.fd, size)
        self.size = size
        if size:
            self._map = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    def view(self, start: int, end: int) -> memoryview:
        """The bytes [start, end) as a writable view of the mapping (valid until resize or close)."""
        if self._map is None or not 0 <= start <= end <= self.size:
            raise ValueError(f"range [{start}, {end}) outside the spool of {self.size} bytes")
        return memoryview(self._map)[start:end]

    def release(self, start: int, end: int) -> None:
        """Give back the whole pages inside [start, end); later reads of them see zeros."""
        lo = -(-start // PAGE) * PAGE
        hi = min(end, self.size) // PAGE * PAGE
        if self._map is None or hi <= lo:
            return
        # Freeing pages costs about as much as filling them (~0.1 s per 256 MiB here):
        # mmap.madvise holds the GIL all that while, stalling the threads that fetch the
        # next ranges, so the hole is punched through libc's fallocate, without it.
        mode = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
        if _fallocate is None or _fallocate(self.fd, mode, lo, hi - lo) != 0:
            self._map.madvise(mmap.MADV_REMOVE, lo, hi - lo)

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                # a view is still held by a request in flight: the mapping goes with it
                pass
            self._map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
