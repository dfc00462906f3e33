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

In a virtual machine whose free 2 MiB blocks are handed back to the host
(virtio-balloon free page reporting, at order 9), a huge-page fault may take a
block the host has to fault in again.  Measured on such a VM, filling 1 GiB of
fresh memory ran at 0.45-0.6 GB/s with huge pages and 2.0 GB/s with 4 KiB pages,
but at 8.5 GB/s with huge pages when the process had freed that memory just
before (blocks are reported about two seconds after they are freed), and at
anything in between when some of it was.  Which blocks the next faults take
cannot be seen from user space (the time a buffer's first huge pages took did
not predict how the rest would fault), and a resume is the first load of a fresh
process.  So there buffers allocated per call (a load's destinations, a verify's
window) get 4 KiB pages: 2.5-2.8 GB/s every time.  Buffers kept for the life of the
process and refilled by every save (staging slabs) still take huge pages: they pay
the first fault once, and every copy into them then takes fewer TLB misses.  Hosts
that report only larger blocks (a higher order) are left alone; only order 9 was
measured.

A new file on tmpfs that a save writes (engine/chunkwrite.py) is like a buffer
used once: its pages are allocated as it is written, one 4 KiB page at a time under
the file's lock unless the mount says `huge=` (this is most of a save's time: 0.42
CPU-seconds of a 1 GiB save, against 0.24 into 2 MiB pages made first), so it gets
2 MiB pages where a load's destinations would (`wants_huge_file`).

CKPTFMT_HUGE_PAGES overrides the host check: `auto` (the default) decides as
above, `on` asks for huge pages for every large buffer and tmpfs file whatever the
host, `off` never asks.  `on` still asks only while the kernel has free 2 MiB blocks.
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING

from . import native as _native

if TYPE_CHECKING:
    import torch

HUGE_PAGE = 2 << 20
# Below this the allocator may hand out reused heap memory, and the faults saved
# are few; above it glibc maps fresh memory for every allocation.
MIN_HUGE_BYTES = 4 << 20
#: how long a reading of the free 2 MiB blocks is trusted (allocations subtract from it)
_FRESH_FOR = 0.5

_lock = threading.Lock()
_free_blocks = 0
_read_at = -1e9


def _forget_in_child() -> None:
    """A forked child reads the free blocks afresh (its lock may have been held at the fork)."""
    global _lock, _free_blocks, _read_at
    _lock = threading.Lock()
    _free_blocks, _read_at = 0, -1e9


os.register_at_fork(after_in_child=_forget_in_child)


def empty_bytes(nbytes: int, *, pinned: bool = False, reused: bool = False) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` uninitialised bytes, on huge pages where the kernel allows
    and they pay off; `reused`: the buffer is kept and refilled by call after call (staging
    slabs), so it takes huge pages even on hosts where their first fault is slower.

    Raises RuntimeError or MemoryError when the memory cannot be had, as torch.empty does.
    """
    import torch  # here, not with the module: the reader imports it before any load needs torch

    out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    if (
        not pinned
        and nbytes >= MIN_HUGE_BYTES
        and _wants_huge_pages(reused)
        and _take_free_blocks(nbytes // HUGE_PAGE)
    ):
        _native.advise_huge(out)
    return out


def empty_storage(nbytes: int) -> torch.UntypedStorage:
    """A CPU storage of `nbytes` uninitialised bytes: one allocation, no tensor, for a small
    one (a load of many small tensors makes one per tensor); empty_bytes' pages for a large one.

    Raises RuntimeError or MemoryError when the memory cannot be had, as torch.empty does.
    """
    if nbytes < MIN_HUGE_BYTES:
        import torch

        return torch.UntypedStorage(nbytes)
    return empty_bytes(nbytes).untyped_storage()


def wants_huge_file(nbytes: int) -> bool:
    """Whether a new tmpfs file of `nbytes` should be given 2 MiB pages before it is written:
    as a buffer used once (where the host takes free 2 MiB blocks back, a 1 GiB file took 3.6-4.6
    s to get them against 1.0 s to write with small pages), and only while the kernel has the
    free blocks (else collapsing would compact memory first); if so they are counted as taken.

    Raises ValueError for an unknown CKPTFMT_HUGE_PAGES."""
    return nbytes >= MIN_HUGE_BYTES and _wants_huge_pages(False) and _take_free_blocks(nbytes // HUGE_PAGE)


#: the environment variable that overrides the host check: auto, on or off
HUGE_PAGES_ENV = "CKPTFMT_HUGE_PAGES"
_SETTINGS = ("auto", "on", "off")


def huge_pages_setting() -> str:
    """CKPTFMT_HUGE_PAGES, read at each call: "auto" (unset or empty), "on" or "off".

    Raises ValueError for any other value.
    """
    text = os.environ.get(HUGE_PAGES_ENV, "").strip().lower() or "auto"
    if text not in _SETTINGS:
        raise ValueError(f"{HUGE_PAGES_ENV} must be one of {', '.join(_SETTINGS)}, not {text!r}")
    return text


def _wants_huge_pages(reused: bool) -> bool:
    """Whether a large buffer should ask for huge pages, before counting free 2 MiB blocks."""
    setting = huge_pages_setting()
    if setting != "auto":
        return setting == "on"
    return reused or not host_reclaims_huge_blocks()


_BALLOON = "/sys/bus/virtio/drivers/virtio_balloon"
_REPORTING_ORDER = "/sys/module/page_reporting/parameters/page_reporting_order"
#: virtio-balloon feature bit: free page reporting
_F_REPORTING = 5
_reclaims: bool | None = None


def host_reclaims_huge_blocks() -> bool:
    """Whether this is a VM that reports free 2 MiB blocks to its host (read once)."""
    global _reclaims
    if _reclaims is None:
        order = (HUGE_PAGE // 4096).bit_length() - 1
        _reclaims = _balloon_reports_free_pages() and _reporting_order() <= order
    return _reclaims


def _balloon_reports_free_pages() -> bool:
    try:
        devices = [d for d in os.listdir(_BALLOON) if d.startswith("virtio")]
    except OSError:
        return False
    for d in devices:
        try:
            with open(os.path.join(_BALLOON, d, "features")) as f:
                bits = f.read().strip()
        except OSError:
            continue
        if len(bits) > _F_REPORTING and bits[_F_REPORTING] == "1":
            return True
    return False


def _reporting_order() -> int:
    """The smallest order of free blocks reported (the kernel's default is the pageblock's, 9)."""
    try:
        with open(_REPORTING_ORDER) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 9


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
