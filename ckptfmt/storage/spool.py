"""A sparse in-memory image of one object, so the fd-based engine can write and read objects.

The engine writes chunks with ``pwrite`` at planned offsets and reads them with ``pread``;
an object store has neither.  A spool is a memfd the size of the object: a save's writer
fills it at the offsets the file will have, and each part is uploaded from it and then
released; a load fetches just the byte ranges it is about to read into it, and releases
them once read.  Pages never written cost nothing, released ones are returned
(``MADV_REMOVE`` punches them out of the memfd), so memory stays bounded by what is in
flight, never the object's size.

A spool belongs to one process: its memfd is shared with a forked child, and so is its
mapping (MAP_SHARED), so a child that fetched into it would write into the pages its parent
reads, and one that released pages would punch holes in them.  A child takes a spool of its
own instead (`in_child`), put in place of the descriptors `dup` handed out to readers.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from collections.abc import Callable
from concurrent.futures import Executor

from .pools import submit_or_run

PAGE = mmap.PAGESIZE


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise, called through ctypes, which lets go of the GIL for the call (mmap's
    madvise holds it); None where there is none."""
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_madvise = _libc_madvise()


class Spool:
    """A memfd of `size` bytes (grown on demand) and a shared mapping of it."""

    def __init__(self, name: str, size: int = 0) -> None:
        self.name = name
        self.fd = os.memfd_create(f"ckptfmt-{name}"[:200], os.MFD_CLOEXEC)
        self._map: mmap.mmap | None = None
        self.size = 0
        #: descriptors of the memfd handed to readers (dup), which close them
        self._dups: list[int] = []
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
            # the mapping's address, for madvise (the ctypes view is let go at once: a buffer
            # still exported would keep the mapping from closing)
            self._address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))

    def view(self, start: int, end: int) -> memoryview:
        """The bytes [start, end) as a writable view of the mapping (valid until resize or close)."""
        if self._map is None or not 0 <= start <= end <= self.size:
            raise ValueError(f"range [{start}, {end}) outside the spool of {self.size} bytes")
        return memoryview(self._map)[start:end]

    def release(self, start: int, end: int) -> None:
        """Give back the whole pages inside [start, end); later reads of them see zeros."""
        lo = -(-start // PAGE) * PAGE
        hi = min(end, self.size) // PAGE * PAGE
        mapping = self._map  # read once: close() on another thread may set it to None
        if mapping is None or hi <= lo:
            return
        # Freeing pages costs about as much as filling them (~0.1 s per 256 MiB here):
        # mmap.madvise holds the GIL all that while, stalling the threads that fetch the
        # next ranges, so libc's madvise is called through ctypes, without it.  Through the
        # mapping, not the descriptor: a release queued on another thread (RemoteObject's)
        # stays safe after close() has closed the descriptor, whose number may be reused.
        if _madvise is None or _madvise(self._address + lo, hi - lo, mmap.MADV_REMOVE) != 0:
            mapping.madvise(mmap.MADV_REMOVE, lo, hi - lo)

    def dup(self) -> int:
        """A descriptor of the memfd for a reader (the engine's preads), which closes it; in a
        forked child it reads the child's own spool once one is made (in_child)."""
        fd = os.dup(self.fd)
        self._dups.append(fd)
        return fd

    def in_child(self) -> Spool:
        """A forked child's own spool in place of this one, its parent's: a fresh memfd of the
        same size, empty, put in place of the descriptors `dup` handed out that still name
        this memfd (their numbers kept; one a reader closed since, its number perhaps reused
        for another file, is left alone).  The child's copies of this one's descriptor and
        mapping are closed; nothing of the parent's pages is written or freed."""
        fresh = Spool(self.name, self.size)
        try:
            parents = os.fstat(self.fd)
            for fd in self._dups:
                if _names(fd, parents):
                    os.dup2(fresh.fd, fd, inheritable=False)
                    fresh._dups.append(fd)
        except BaseException:
            fresh.close()
            raise
        self.close()
        return fresh

    def close(self, free_on: Executor | None = None) -> None:
        """Close the descriptor and the mapping.  free_on: the mapping (which keeps the memfd,
        and so its pages, alive, and holds a descriptor of its own) is closed by that
        executor, after the releases queued on it: freeing the pages costs about as much as
        filling them (~0.1 s per 256 MiB here), and the caller need not wait for it.  The
        spool's descriptor is closed here either way, and the mapping here too where the
        executor takes no more work (at interpreter exit, once concurrent.futures' exit hook
        has run: a save finishing then must still end, and end its save)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        mapping, self._map = self._map, None
        if mapping is None:
            return
        if free_on is not None:
            submit_or_run(free_on, _close_map, mapping)
        else:
            _close_map(mapping)


def _names(fd: int, file: os.stat_result) -> bool:
    """Whether descriptor `fd` is open on `file` (a memfd's inode is its own)."""
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (file.st_dev, file.st_ino)


def _close_map(mapping: mmap.mmap) -> None:
    try:
        mapping.close()  # munmap lets go of the GIL
    except BufferError:
        pass  # a view is still held by a request in flight: the mapping goes with it
