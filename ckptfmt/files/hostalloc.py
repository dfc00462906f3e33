"""Fresh host memory for a load's storages (the CPU half of CheckpointFile's placement).

A load of many small tensors allocates one storage per tensor, so each is allocated in
the fewest torch calls: a small storage whose first tensor spans exactly its bytes
(`StorageRecord.whole`) as that tensor, in one call that builds both; every other storage
by one batch of `engine.hostmem` allocations (huge pages for the large ones where they pay
off).  A failed allocation is a LimitError naming the storage's key.  torch is imported
when memory is allocated, not when this module (or engine.hostmem) is: opening a file needs none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..engine import hostmem
from ..errors import LimitError

if TYPE_CHECKING:
    import torch

    from ..format.tree import StorageRecord


def alloc_error(path: str, nbytes: int, key: str, e: BaseException) -> LimitError:
    """The LimitError of an allocation of `nbytes` for `key` (of the file at `path`) that failed with `e`."""
    return LimitError(f"cannot allocate {nbytes} bytes for this storage: {str(e)[:100]}", path=path, key=key)


def alloc_bytes(path: str, nbytes: int, key: str) -> torch.Tensor:
    """`nbytes` of host memory (a uint8 tensor); LimitError naming `key` if it fails."""
    try:
        return hostmem.empty_bytes(nbytes)
    except (RuntimeError, MemoryError) as e:
        raise alloc_error(path, nbytes, key, e) from e


def alloc_storages(
    path: str, records: list[StorageRecord], sids: list[int]
) -> dict[int, torch.UntypedStorage]:
    """A fresh CPU storage for each of `sids` (indexes into `records`, the storages of the file
    at `path`; one allocation each, no tensor); LimitError naming the storage's key if one fails."""
    out = {}
    empty = hostmem.empty_storage
    for sid in sids:
        nbytes = records[sid].nbytes
        try:
            out[sid] = empty(nbytes)
        except (RuntimeError, MemoryError) as e:
            raise alloc_error(path, nbytes, records[sid].key, e) from e
    return out


def alloc_host(
    path: str, records: list[StorageRecord], nodes: list[Any], sids: list[int], made: dict[int, torch.Tensor]
) -> dict[int, torch.UntypedStorage | torch.Tensor]:
    """Fresh CPU memory for `sids` (indexes into `records`, the storages of the file at `path`,
    whose tree's node table is `nodes`), by storage.  A small storage whose first tensor spans
    exactly its bytes (most are: one tensor per storage) is allocated as that tensor, in
    one call that builds both (torch.empty_strided: a resizable storage of its own, as any
    other), also put in `made` by node; the others as storages, in one alloc_storages call.
    LimitError naming the storage's key if an allocation fails."""
    import torch

    from ..format.dtypes import TORCH_DTYPES

    places: dict[int, torch.UntypedStorage | torch.Tensor] = {}
    small = hostmem.MIN_HUGE_BYTES  # larger ones: hostmem's choice of pages
    empty_strided = torch.empty_strided
    others: list[int] = []  # as storages, in one batch
    for sid in sids:
        rec = records[sid]
        if not rec.whole or rec.nbytes >= small:
            others.append(sid)
            continue
        m = nodes[rec.node][1]
        try:
            t = empty_strided(m["shape"], m["stride"], dtype=TORCH_DTYPES[m["dtype"]])
        except (RuntimeError, MemoryError) as e:
            raise alloc_error(path, rec.nbytes, rec.key, e) from e
        places[sid] = made[rec.node] = t
    if others:
        places.update(alloc_storages(path, records, others))
    return places
