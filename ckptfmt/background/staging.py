"""Staging memory for non-blocking saves: a pool of slabs reused across saves.

Fresh pages cost far more than a copy into pages already touched (the first
touch faults every page in), so slabs are kept and reused, never freed after a
save.  Slabs for accelerator sources are pinned host memory, so device-to-host
copies can run asynchronously.  The pool never holds more than its limit; a
snapshot that needs more waits for the writer to return slabs.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import torch

from ..engine import hostmem

DEFAULT_SLAB_BYTES = 64 << 20


def _default_limit() -> int:
    text = os.environ.get("CKPTFMT_STAGING_BYTES")
    if text:
        return max(int(text), 1)
    phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(DEFAULT_SLAB_BYTES, min(8 << 30, phys // 4))


class StagingPool:
    def __init__(self, limit: int | None = None, slab_bytes: int = DEFAULT_SLAB_BYTES) -> None:
        self.limit = _default_limit() if limit is None else limit
        self.slab_bytes = slab_bytes
        self._free: dict[bool, list[torch.Tensor]] = {False: [], True: []}
        self._allocated = 0
        self._cond = threading.Condition()

    def configure(self, limit: int | None = None, slab_bytes: int | None = None) -> None:
        """Change the limit or the slab size; free slabs of another size are dropped."""
        with self._cond:
            if limit is not None:
                if limit < 1:
                    raise ValueError("staging limit must be positive")
                self.limit = limit
            if slab_bytes is not None and slab_bytes != self.slab_bytes:
                if slab_bytes < 1:
                    raise ValueError("slab size must be positive")
                self.slab_bytes = slab_bytes
                for pinned in (False, True):
                    self._allocated -= sum(s.numel() for s in self._free[pinned])
                    self._free[pinned].clear()
            self._cond.notify_all()

    def slab_size(self, chunk_size: int) -> int:
        """Slabs hold whole chunks and never exceed the limit (at least one chunk)."""
        size = max(self.slab_bytes, chunk_size) // chunk_size * chunk_size
        return max(chunk_size, min(size, self.limit // chunk_size * chunk_size))

    def acquire(self, size: int, pinned: bool, on_wait: Callable[[], None] | None = None) -> torch.Tensor:
        """A uint8 slab of `size` bytes; blocks while the pool is at its limit (calling on_wait first)."""
        with self._cond:
            while True:
                free = self._free[pinned]
                for i, slab in enumerate(free):
                    if slab.numel() == size:
                        return free.pop(i)
                if self._allocated + size <= self.limit or self._allocated == 0:
                    self._allocated += size
                    break
                other = self._free[not pinned]
                if free or other:  # make room by dropping a free slab of the wrong kind or size
                    victim = (free or other).pop()
                    self._allocated -= victim.numel()
                    continue
                if on_wait is not None:
                    on_wait()
                self._cond.wait()
        try:
            return self._allocate(size, pinned)
        except BaseException:
            with self._cond:
                self._allocated -= size
                self._cond.notify_all()
            raise

    def release(self, slab: torch.Tensor) -> None:
        """Give a slab back for reuse."""
        with self._cond:
            self._free[self._is_pinned(slab)].append(slab)
            self._cond.notify_all()

    def discard(self, slab: torch.Tensor) -> None:
        """Give a slab back without reusing it (a copy into it may still be running)."""
        with self._cond:
            self._allocated -= slab.numel()
            self._cond.notify_all()

    @property
    def allocated(self) -> int:
        with self._cond:
            return self._allocated

    def _allocate(self, size: int, pinned: bool) -> torch.Tensor:
        return hostmem.empty_bytes(size, pinned=pinned, reused=True)

    def _is_pinned(self, slab: torch.Tensor) -> bool:
        return bool(slab.is_pinned())

    @property
    def in_use(self) -> int:
        """Bytes of slabs acquired and not yet released: 0 whenever no save is in flight."""
        with self._cond:
            return self._allocated - sum(s.numel() for v in self._free.values() for s in v)

    @property
    def free_bytes(self) -> int:
        with self._cond:
            return sum(s.numel() for v in self._free.values() for s in v)

    def forget_in_child(self) -> None:
        """In a forked child: the slabs its parent's saves hold never come back (their threads
        are the parent's), so only the free ones count; the lock may have been held."""
        self._cond = threading.Condition()
        self._allocated = sum(s.numel() for v in self._free.values() for s in v)


POOL = StagingPool()
os.register_at_fork(after_in_child=POOL.forget_in_child)
