"""Reading hyper-rectangles of saved tensors, verified, touching only the chunks they need.

DCP asks a storage layer for a box of a saved chunk (``storage_offsets`` and
``lengths``) to copy into a box of a destination tensor.  A ckptfmt storage is cut
into chunks, each with its own checksum, so the unit that can be read *and
verified* is a chunk: the reader works out exactly which chunks hold bytes of the
box and reads only those (for a box of rows of a row-major tensor: the chunks
under those rows).  Where the box is one contiguous byte range and the
destination is a contiguous CPU tensor of the same dtype, chunks that lie inside
the range are read straight into the destination's memory; only the (at most
two) chunks at its edges pass through a scratch buffer.  Otherwise the needed
chunks are read into a scratch buffer laid out like the storage and the box is
copied out of it with torch (which also converts dtypes and moves to devices).

All chunks of one file are read in one parallel, verifying call of the engine
(``CheckpointFile.read_into``) per batch of bounded scratch memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..engine import bytesview, hostmem
from ..errors import CorruptError, LimitError
from ..files.indexspace import is_row_major
from ..files.reader import CheckpointFile
from ..format import dtypes

#: scratch memory one batch of reads may hold (destinations read in place cost none)
DEFAULT_BATCH_BYTES = 256 << 20


@dataclass
class ReadStats:
    """What a load read: chunks and stored bytes (padding excluded), and scratch bytes used."""

    chunks: int = 0
    bytes: int = 0
    scratch_bytes: int = 0


@dataclass
class RegionJob:
    """The reads one box needs: made (scratch allocated) only when its batch runs."""

    file: CheckpointFile
    scratch_bytes: int
    make: Callable[[], tuple[list[tuple[int, memoryview]], Callable[[], None]]]
    chunks: list[int] = field(default_factory=list)


def element_runs(
    shape: Sequence[int], stride: Sequence[int], offset: int, box_off: Sequence[int], box_len: Sequence[int]
) -> tuple[np.ndarray, int]:
    """(start element of each run, run length in elements) covering the box of a tensor.

    For a row-major tensor the runs are exact: the box is prod(box_len[:k]) runs of
    box_len[k] * prod(shape[k+1:]) elements, k being the last dimension the box does
    not cover completely.  For other layouts one run spans the box's first to last element.
    """
    if not is_row_major(shape, stride):
        first = offset + sum(o * s for o, s in zip(box_off, stride))
        last = offset + sum((o + n - 1) * s for o, n, s in zip(box_off, box_len, stride))
        return np.array([first], dtype=np.int64), last - first + 1
    ndim = len(shape)
    k = -1
    for d in range(ndim - 1, -1, -1):
        if box_off[d] != 0 or box_len[d] != shape[d]:
            k = d
            break
    if k == -1:
        return np.array([offset], dtype=np.int64), math.prod(shape)
    run = box_len[k] * math.prod(shape[k + 1 :])
    starts = np.array([offset + box_off[k] * stride[k]], dtype=np.int64)
    for d in range(k - 1, -1, -1):  # outer dimensions: every index combination, in order
        idx = (np.arange(box_off[d], box_off[d] + box_len[d], dtype=np.int64) * stride[d])[:, None]
        starts = (idx + starts[None, :]).reshape(-1)
    return starts, run


def chunks_for_runs(starts: np.ndarray, run_bytes: int, itemsize: int, chunk_size: int) -> np.ndarray:
    """Sorted chunk numbers (within the storage) that hold any byte of the runs."""
    lo = starts * itemsize
    first = lo // chunk_size
    last = (lo + run_bytes - 1) // chunk_size
    base = int(first.min())
    marks = np.zeros(int(last.max()) - base + 2, dtype=np.int64)
    np.add.at(marks, first - base, 1)
    np.add.at(marks, last - base + 1, -1)
    return np.nonzero(np.cumsum(marks[:-1]) > 0)[0] + base


def plan_box(
    f: CheckpointFile,
    meta: dict[str, Any],
    box_off: Sequence[int],
    box_len: Sequence[int],
    dest: torch.Tensor,
    after: Callable[[], None],
    what: str,
) -> RegionJob | None:
    """A job that copies the box of the tensor described by `meta` (a validated tensor node of
    `f`) into `dest`, then calls `after`; None when the box is empty (`after` runs now)."""
    shape, stride, offset = meta["shape"], meta["stride"], meta["offset"]
    if len(box_off) != len(shape) or len(box_len) != len(shape):
        raise CorruptError(
            f"asked for a {len(box_off)}-d box of a {len(shape)}-d tensor", path=f.path, key=what
        )
    if any(o < 0 or n < 0 or o + n > s for o, n, s in zip(box_off, box_len, shape)):
        raise CorruptError(
            f"asked for rows {list(box_off)} + {list(box_len)} of a tensor of shape {shape}",
            path=f.path,
            key=what,
        )
    if tuple(dest.shape) != tuple(box_len):
        raise CorruptError(
            f"the destination has shape {list(dest.shape)}, the box {list(box_len)}", path=f.path, key=what
        )
    if math.prod(box_len) == 0:
        after()
        return None
    dtype = dtypes.TORCH_DTYPES[meta["dtype"]]
    itemsize = dtypes.torch_itemsize(meta["dtype"])
    rec = f.storages[meta["storage"]]
    cs = f.chunk_size
    starts, run = element_runs(shape, stride, offset, box_off, box_len)
    local = chunks_for_runs(starts, run * itemsize, itemsize, cs)
    chunk_ids = (local + rec.first_chunk).tolist()
    if len(starts) == 1 and is_row_major(shape, stride) and _direct_ok(dest, dtype, meta):
        return _direct_job(
            f, chunk_ids, rec.first_chunk, int(starts[0]) * itemsize, run * itemsize, dest, after
        )
    base = (chunk_ids[0] - rec.first_chunk) * cs  # byte of the storage where the scratch starts
    end = (chunk_ids[-1] - rec.first_chunk) * cs + f.chunks[chunk_ids[-1]].raw_len
    span = -(-(end - base) // itemsize) * itemsize
    start_el = (offset * itemsize - base) // itemsize + sum(o * s for o, s in zip(box_off, stride))

    def make() -> tuple[list[tuple[int, memoryview]], Callable[[], None]]:
        scratch = _alloc(span, f, what)
        view = bytesview.tensor_bytes(scratch)
        reads = []
        for k in chunk_ids:
            at = (k - rec.first_chunk) * cs - base
            reads.append((k, view[at : at + f.chunks[k].raw_len]))

        def finish() -> None:
            src = scratch.view(dtype).as_strided(list(box_len), list(stride), start_el)
            if meta["conj"]:
                src = src.conj()
            dest.copy_(src)
            after()

        return reads, finish

    return RegionJob(f, span, make, chunk_ids)


def _direct_ok(dest: torch.Tensor, dtype: torch.dtype, meta: dict[str, Any]) -> bool:
    return (
        dest.device.type == "cpu"
        and dest.dtype == dtype
        and dest.is_contiguous()
        and not dest.is_conj()
        and not dest.is_neg()
        and not meta["conj"]
    )


def _direct_job(
    f: CheckpointFile,
    chunk_ids: list[int],
    first_chunk: int,
    lo: int,
    nbytes: int,
    dest: torch.Tensor,
    after: Callable[[], None],
) -> RegionJob:
    """Bytes [lo, lo + nbytes) of the storage into a contiguous destination: inner chunks in place."""
    cs = f.chunk_size
    hi = lo + nbytes
    edges = {
        k
        for k in chunk_ids
        if (k - first_chunk) * cs < lo or (k - first_chunk) * cs + f.chunks[k].raw_len > hi
    }
    scratch_bytes = sum(f.chunks[k].raw_len for k in edges)

    def make() -> tuple[list[tuple[int, memoryview]], Callable[[], None]]:
        out = bytesview.contiguous_bytes(dest)
        reads: list[tuple[int, memoryview]] = []
        copies: list[tuple[memoryview, memoryview]] = []
        for k in chunk_ids:
            start = (k - first_chunk) * cs
            n = f.chunks[k].raw_len
            if k in edges:
                buf = bytesview.tensor_bytes(_alloc(n, f, ""))
                reads.append((k, buf))
                a, b = max(lo, start), min(hi, start + n)
                copies.append((out[a - lo : b - lo], buf[a - start : b - start]))
            else:
                reads.append((k, out[start - lo : start - lo + n]))

        def finish() -> None:
            for dst, src in copies:
                dst[:] = src
            after()

        return reads, finish

    return RegionJob(f, scratch_bytes, make, chunk_ids)


def _alloc(nbytes: int, f: CheckpointFile, what: str) -> torch.Tensor:
    try:
        return hostmem.empty_bytes(nbytes)
    except (RuntimeError, MemoryError) as e:
        raise LimitError(
            f"cannot allocate {nbytes} bytes to read into: {str(e)[:100]}", path=f.path, key=what
        ) from e


def run_jobs(
    jobs: list[RegionJob], verify: bool, stats: ReadStats, batch_bytes: int = DEFAULT_BATCH_BYTES
) -> None:
    """Run jobs batch by batch: each batch's chunks are read by one parallel call per file."""
    batch: list[RegionJob] = []
    held = 0
    for job in jobs:
        if batch and held + job.scratch_bytes > batch_bytes:
            _run_batch(batch, verify, stats)
            batch, held = [], 0
        batch.append(job)
        held += job.scratch_bytes
    if batch:
        _run_batch(batch, verify, stats)


def _run_batch(batch: list[RegionJob], verify: bool, stats: ReadStats) -> None:
    per_file: dict[int, tuple[CheckpointFile, list[tuple[int, memoryview]]]] = {}
    finishers = []
    for job in batch:
        reads, finish = job.make()
        per_file.setdefault(id(job.file), (job.file, []))[1].extend(reads)
        finishers.append(finish)
        stats.scratch_bytes += job.scratch_bytes
    for f, reads in per_file.values():
        f.read_into(reads, verify)
        stats.chunks += len(reads)
        stats.bytes += sum(f.chunks[k].stored_len for k, _ in reads)
    for finish in finishers:
        finish()
