"""A sparse in-memory image of one object, so the fd-based engine can write and read objects.

The engine writes chunks with ``pwrite`` at planned offsets and reads them with ``pread``;
an object store has neither.  A spool is a memfd the size of the object: a save's writer
fills it at the offsets the file will have, and each part is uploaded from it and then
released; a load fetches just the byte ranges it is about to read into it, and releases
them once read.  Pages never written cost nothing, released ones are returned
(``MADV_REMOVE`` punches them out of the memfd), so memory stays bounded by what is in
flight, never the object's size.
"""

from __future__ import annotations

import mmap
import os

PAGE = mmap.PAGESIZE


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
        if self._map is not None and hi > lo:
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
