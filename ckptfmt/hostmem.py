"""Large, fresh host buffers that the kernel may back with huge pages.

A load into fresh memory is bound by page faults, not by reading or hashing:
with 4 KiB pages every 4 KiB of a destination costs a fault that zeroes it.
Where transparent huge pages are in `madvise` mode (the default of many
distributions), memory marked MADV_HUGEPAGE faults 2 MiB at a time, which
makes filling it several times faster.  torch's CPU allocator asks for this
only under an environment variable, so large buffers are marked here, right
after torch allocates them and before anything touches them.  They stay
ordinary torch tensors: same allocator, resizable, freed as usual.
"""

from __future__ import annotations

import torch

from . import _native

# Below this the allocator may hand out reused heap memory, and the faults saved
# are few; above it glibc maps fresh memory for every allocation.
MIN_HUGE_BYTES = 4 << 20


def empty_bytes(nbytes: int, *, pinned: bool = False) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` uninitialised bytes, on huge pages where the kernel allows.

    Raises RuntimeError or MemoryError when the memory cannot be had, as torch.empty does.
    """
    out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    if not pinned and nbytes >= MIN_HUGE_BYTES:
        _native.advise_huge(out)
    return out
