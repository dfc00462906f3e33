"""Large, fresh host buffers that the kernel may back with huge pages.

A load into fresh memory is bound by page faults, not by reading or hashing:
with 4 KiB pages every 4 KiB of a destination costs a fault that zeroes it.
Where transparent huge pages are in `madvise` mode (the default of many
distributions), memory marked MADV_HUGEPAGE faults 2 MiB at a time, which
makes filling it several times faster.  torch's CPU allocator asks for this
only under an environment variable, so large buffers are marked here, right
after torch allocates them and before anything touches them.  They stay
ordinary torch tensors: same allocator, resizable, freed as usual.

Huge pages are asked for only while the kernel has free 2 MiB blocks to give:
when free memory is fragmented into small pages, a fault on memory marked
MADV_HUGEPAGE compacts memory first (THP's `defrag` setting), which costs more
than the faults it saves.
"""

from __future__ import annotations

import threading
import time

import torch

from . import _native

HUGE_PAGE = 2 << 20
# Below this the allocator may hand out reused heap memory, and the faults saved
# are few; above it glibc maps fresh memory for every allocation.
MIN_HUGE_BYTES = 4 << 20
#: how long a reading of the free 2 MiB blocks is trusted (allocations subtract from it)
_FRESH_FOR = 0.5

_lock = threading.Lock()
_free_blocks = 0
_read_at = -1e9


def empty_bytes(nbytes: int, *, pinned: bool = False) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` uninitialised bytes, on huge pages where the kernel allows.

    Raises RuntimeError or MemoryError when the memory cannot be had, as torch.empty does.
    """
    out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    if not pinned and nbytes >= MIN_HUGE_BYTES and _take_free_blocks(nbytes // HUGE_PAGE):
        _native.advise_huge(out)
    return out


def _take_free_blocks(n: int) -> bool:
    """Whether the kernel has n free 2 MiB blocks not promised to earlier buffers; if so they
    are counted as taken until the next reading."""
    global _free_blocks, _read_at
    with _lock:
        now = time.monotonic()
        if now - _read_at > _FRESH_FOR:
            _free_blocks = free_huge_blocks()
            _read_at = now
        if _free_blocks < n:
            return False
        _free_blocks -= n
        return True


def free_huge_blocks() -> int:
    """Free physically contiguous 2 MiB blocks, from /proc/buddyinfo (all zones and nodes);
    a large number where that file cannot be read (other systems: let the kernel decide)."""
    try:
        with open("/proc/buddyinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return 1 << 40
    order = (HUGE_PAGE // 4096).bit_length() - 1  # 9 with 4 KiB pages
    total = 0
    for line in lines:
        counts = line.split()[4:]  # "Node 0, zone Normal" then free blocks of order 0, 1, ...
        for o, c in enumerate(counts):
            if o >= order and c.isdigit():
                total += int(c) << (o - order)
    return total
